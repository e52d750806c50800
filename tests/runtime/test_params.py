"""params.yaml schema: each rule stops with a message naming the key, the value and what is allowed.
The rules are checked on the demo's params (profiles/demo.yaml), whatever this project's params.yaml says."""

import subprocess
import sys

import pytest
import yaml

from tasks.runtime.params import ParamsError, deep_merge, load_params, render_params, validate_params


@pytest.fixture
def base(project_root):
    return render_params(project_root / "params.yaml", "demo")


def check(data, *fragments):
    with pytest.raises(ParamsError) as err:
        validate_params(data, "params.yaml")
    msg = str(err.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in error message:\n{msg}"
    return msg


def test_shipped_params_and_profiles_are_valid(project_root):
    load_params(project_root / "params.yaml")  # the demo's, or a project's own
    params = load_params(project_root / "params.yaml", "demo")
    assert list(params.pipeline.tasks) == ["bbc", "rotten", "tweets", "trec"]
    tiny = load_params(project_root / "params.yaml", "tiny")
    assert tiny.task_sizes("bbc") == (40, 120, 40)
    assert params.task_sizes("bbc") == (200, 1500, 400) and params.task_sizes("trec") == (200, 2000, 400)


def test_unknown_key_is_named_with_a_suggestion(base):
    base["ingest"]["epss"] = 0.2
    check(base, "unknown key 'ingest.epss'", "did you mean 'ingest.eps'", "allowed keys under 'ingest'")


def test_unknown_top_level_section(base):
    base["ingets"] = {}
    check(base, "unknown key 'ingets'", "did you mean 'ingest'")


def test_unknown_key_inside_a_task(base):
    base["pipeline"]["tasks"]["bbc"]["n_pol"] = 10
    check(base, "unknown key 'pipeline.tasks.bbc.n_pol'", "did you mean 'pipeline.tasks.bbc.n_pool'")


def test_wrong_type(base):
    base["ingest"]["n_pool"] = "many"
    check(base, "key 'ingest.n_pool' = 'many'", "valid integer")


def test_out_of_range(base):
    base["ingest"]["eps"] = 1.5
    check(base, "key 'ingest.eps' = 1.5", "less than or equal to 0.95")


def test_pi_floor_must_be_positive(base):
    base["ingest"]["audit"]["pi_floor"] = 0.0
    check(base, "key 'ingest.audit.pi_floor' = 0.0", "greater than 0")


def test_choice_not_allowed(base):
    base["ingest"]["audit"]["design"] = "stratified"
    check(base, "key 'ingest.audit.design' = 'stratified'", "'uniform' or 'uncertainty'")


def test_unknown_corpus(base):
    base["pipeline"]["tasks"]["bbc"]["corpus"] = "newsgroups"
    check(base, "pipeline.tasks.bbc.corpus", "'newsgroups'", "bbc_news")


def test_missing_required_section():
    check({"ingest": {}}, "missing key 'pipeline'")


def test_bad_task_name(base):
    base["pipeline"]["tasks"]["Bad Name"] = {"corpus": "bbc_news"}
    check(base, "task name 'Bad Name'")


def test_audit_budget_larger_than_a_pool(base):
    base["pipeline"]["tasks"]["trec"]["n_pool"] = 100
    check(base, "ingest.audit.budget = 150 exceeds the pool size 100 of task 'trec'")


def test_demo_task_needs_a_corpus(base):
    base["pipeline"]["tasks"]["bbc"] = {"n_pool": 500}
    check(base, "pipeline.tasks.bbc.corpus is required")


def test_invalid_yaml_names_the_file(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("pipeline: [unclosed\n")
    with pytest.raises(ParamsError, match=f"{path}: not valid YAML"):
        load_params(path)


def test_unknown_profile(project_root):
    known = ", ".join(sorted(p.stem for p in (project_root / "profiles").glob("*.yaml")))
    assert known.startswith("demo, files, ")
    with pytest.raises(ParamsError, match=f"unknown profile 'huge'; known profiles: {known} "):
        load_params(project_root / "params.yaml", "huge")


def test_deep_merge_keeps_siblings():
    assert deep_merge({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 5}}) == {"a": {"b": 5, "c": 2}, "d": 3}


def test_cli_check_fails_on_a_typo(project_root, tmp_path):
    data = render_params(project_root / "params.yaml")
    data["ingest"]["n_refernce"] = 5
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "params", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=project_root,
    )
    assert proc.returncode == 2
    assert "unknown key 'ingest.n_refernce'" in proc.stderr and "did you mean 'ingest.n_reference'" in proc.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "flows.cli", "params", "check"], capture_output=True, text=True, cwd=project_root
    )
    assert ok.returncode == 0 and "OK" in ok.stdout


def test_merge_method_errors(base):
    base["merge"] = {"methods": {"gs3x": {}}}
    check(base, "unknown merge method 'gs3x'", "did you mean 'gs3r'", "valid: task_arithmetic")
    base["merge"] = {"methods": {"gs3r": {"energy": 1.5}}}
    check(base, "merge.methods.gs3r", "energy must be in (0, 1]")
    base["merge"] = {"methods": {"ties": {"densty": 0.2}}}
    check(base, "merge.methods.ties", "densty")
    base["merge"] = {"methods": {"ties": {}}, "main": "gs3r"}
    check(base, "merge.main = 'gs3r' is not among merge.methods (ties)")


def test_merge_order(base):
    base["merge"] = {"order": ["rotten", "bbc", "rotten"]}
    check(base, "merge.order", "lists a task twice")
    base["merge"] = {"order": ["rotten", "news"]}
    check(base, "merge.order names ['news']", "not in pipeline.tasks")
    base["merge"] = {"order": ["trec", "bbc"]}
    from tasks.runtime.params import validate_params

    assert validate_params(base, "x").merge_order() == ["trec", "bbc"]
    del base["merge"]
    assert validate_params(base, "x").merge_order() == list(base["pipeline"]["tasks"])


def test_null_removes_a_merge_method(base):
    from tasks.runtime.params import validate_params
    from tasks.runtime.params_schema import DEFAULT_MERGE_METHODS

    base["merge"] = {"methods": {**DEFAULT_MERGE_METHODS, "ties": None, "opcm": None}}
    assert list(validate_params(base, "x").merge.methods) == ["gs3r", "task_arithmetic", "weight_average", "magmax"]
    base["merge"] = {"methods": {"gs3r": None}}
    check(base, "merge.methods", "at least 1")


@pytest.mark.parametrize(
    "body, message",
    [
        ("finetune:\n  max_steps: true\n", r"key 'finetune.max_steps' = True: Input should be a valid integer"),
        ("finetune:\n  lr: '0.1'\n", r"key 'finetune.lr' = '0.1': Input should be a valid number"),
        (
            "finetune:\n  modules: 'enc(oder'\n",
            r"key 'finetune.modules' = 'enc\(oder': .*not a valid regular expression",
        ),
        (
            "ingest:\n  eps: 0.2\ningest:\n  eps: 0.1\n",
            r"key 'ingest' appears twice in one mapping: at line 3 and at line 5",
        ),
        ("finetune:\n  lr: 0.001\n  lr: 0.002\n", r"key 'lr' appears twice in one mapping: at line 4 and at line 5"),
    ],
)
def test_strict_types_duplicate_keys_and_regexes_are_refused_at_load(tmp_path, body, message):
    """A bool is not an int, a string not a number; a key given twice is not silently the last one;
    a regex that cannot compile fails `crucible params check`, not a stage."""
    path = tmp_path / "params.yaml"
    path.write_text("pipeline:\n  tasks: {bbc: {corpus: bbc_news}}\n" + body)
    with pytest.raises(ParamsError, match=message):
        load_params(path)


def test_an_int_still_fills_a_float_field(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("pipeline:\n  tasks: {bbc: {corpus: bbc_news}}\nfinetune:\n  epochs: 2\n")
    assert load_params(path).finetune.epochs == 2.0


def test_a_task_set_to_null_is_dropped(tmp_path, project_root):
    """A profile runs fewer tasks than the one it extends with `task: null`."""
    import yaml

    from tasks.runtime.params import load_params

    profile = tmp_path / "fewer.yaml"
    profile.write_text(yaml.safe_dump({"extends": "tiny", "pipeline": {"tasks": {"trec": None, "tweets": None}}}))
    params = load_params(project_root / "params.yaml", str(profile))
    assert list(params.pipeline.tasks) == ["bbc", "rotten"]
    assert list(load_params(project_root / "params.yaml", "smollm2").pipeline.tasks) == [
        "bbc",
        "rotten",
        "tweets",
        "trec",
    ]
    # the rendered params (a workspace's params.yaml, which dvc.yaml's foreach reads) lose it too
    from tasks.runtime.params import render_params

    assert list(render_params(project_root / "params.yaml", str(profile))["pipeline"]["tasks"]) == ["bbc", "rotten"]
