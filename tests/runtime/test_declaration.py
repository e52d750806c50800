"""One declaration per stage (tasks/stages/*.py SPEC): dvc.yaml and the flow's DAG come from it, a
stage reads only the params it declares, and params.yaml holds the schema's defaults.

The tests read the demo's params from the demo profile (profiles/demo.yaml: the schema's defaults and
the four demo tasks), not from params.yaml, which a project of its own changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.runtime.declaration import StageSpec, code_deps, instances, overlaps, params_keys, upstream
from tasks.runtime.params import (
    ParamsError,
    deep_merge,
    load_params,
    read_profile,
    render_params,
    validate_params,
)
from tasks.runtime.params_access import UndeclaredParam, declared_values, declared_view
from tasks.runtime.params_schema import FinetuneParams
from tasks.stages import NAMES, dvc_yaml, project_dvc_yaml, spec, specs

ROOT = Path(__file__).resolve().parents[2]
TASKS = ["bbc", "rotten", "tweets", "trec"]


def test_dvc_yaml_is_generated_from_the_declarations():
    """The committed dvc.yaml is the declarations' for params.yaml's tasks (the demo's, or a project's own)."""
    assert (ROOT / "dvc.yaml").read_text() == project_dvc_yaml(ROOT), "dvc.yaml is stale: run `crucible dag write`"


def test_stages_over_all_tasks_depend_on_exactly_the_files_they_read():
    """No stage depends on a folder of another stage's mixed outputs: merge on each task's fine-tune
    and splits, evaluate on the per-task metrics it reports, so a report-only change (a PNG, a
    stage's metrics file) never reruns merge or quantize."""
    stages = yaml.safe_load(dvc_yaml(["spam", "ham"]))["stages"]
    for name in ("merge", "quantize", "evaluate", "register"):
        data = [d for d in stages[name]["deps"] if not d.startswith(("crucible/", "tasks/"))]
        assert "data" not in data and "metrics" not in data, (name, data)
        assert not any(d.endswith((".png", ".csv")) and d.startswith(("data/", "reports/")) for d in data), (name, data)
        for t in ("spam", "ham"):
            assert any(d.startswith(f"data/{t}/") or d.startswith(f"metrics/{t}/") for d in data), (name, t, data)
    assert {"data/spam/finetune", "data/ham/test.parquet"} <= set(stages["merge"]["deps"])
    assert not any("embeddings" in d or "curate" in d or "pool" in d for d in stages["merge"]["deps"])
    assert "metrics/ham/curate.json" in stages["evaluate"]["deps"]
    assert not any(d.startswith("metrics/") for d in stages["merge"]["deps"] + stages["quantize"]["deps"])
    # every metric and plot data file DVC tracks lies under metrics/ (git commits it; models/ and data/
    # are ignored), the figures under reports/ or beside their stage's model
    for name, stage in stages.items():
        body = stage.get("do", stage)
        for entry in body.get("metrics", []):
            assert next(iter(entry)).startswith("metrics/"), (name, entry)
        for entry in body.get("plots", []):
            path = next(iter(entry))
            assert path.startswith("metrics/") or path.endswith(".png") or path.startswith("reports/"), (name, path)


def test_dag_check_fails_on_a_stale_dvc_yaml(tmp_path):
    """The CLI check that CI and users run: a hand edit of dvc.yaml is reported, exit 1."""
    text = dvc_yaml(TASKS).replace("- data/${key}/test.parquet\n", "", 1)
    (tmp_path / "dvc.yaml").write_text(text)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(render_params(ROOT / "params.yaml", "demo"), sort_keys=False))
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "dag", "check", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and "stale" in proc.stderr
    (tmp_path / "dvc.yaml").write_text(dvc_yaml(TASKS))
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "dag", "check", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr


def test_a_changed_declaration_changes_dvc_yaml(monkeypatch):
    from tasks.stages import curate

    before = dvc_yaml(TASKS)
    monkeypatch.setattr(
        curate, "SPEC", StageSpec(**{**curate.SPEC.__dict__, "params": (*curate.SPEC.params, "evaluate.normalize")})
    )
    after = dvc_yaml(TASKS)
    assert after != before and "- evaluate.normalize" in after


def test_every_stage_lists_its_own_module_and_the_library_it_imports():
    deps = {name: code_deps(spec(name).module) for name in NAMES}
    for name in NAMES:
        assert f"tasks/stages/{name}.py" in deps[name]
        others = [d for d in deps[name] if d.startswith("tasks/stages/") and d != f"tasks/stages/{name}.py"]
        assert others == [], f"{name} depends on another stage's code: {others}"
    assert "crucible/ccmmd" in deps["curate"] and "crucible/merge" in deps["merge"]
    assert "tasks/data/corpora.py" in deps["ingest"]


def test_the_dag_follows_each_task():
    """A per-task run waits for its own task's upstream only; the MoE branch waits for nothing of
    the classifier chain; merge waits for every fine-tune."""
    edges = upstream(specs(), TASKS)
    assert edges["embed@bbc"] == {"ingest@bbc", "model"}  # the base model's manifest
    assert edges["finetune@rotten"] == {"ingest@rotten", "pseudolabel@rotten", "model"}
    assert edges["model"] == set()
    assert edges["moe_build"] == set() and edges["moe_quantize"] == {"moe_build"}
    assert {f"finetune@{t}" for t in TASKS} <= edges["merge"]
    assert "moe_quantize" in edges["evaluate"] and {"evaluate", "quantize", "merge"} <= edges["register"]
    assert len(instances(specs(), TASKS)) == 5 * len(TASKS) + 7


def test_the_cores_a_run_gets_follow_from_the_dag_alone():
    """How many runs may go beside a run is a property of the DAG: every per-task run may meet
    another task's; merge meets none of the classifier chain, only the MoE branch when it is on."""
    edges = upstream(specs(), TASKS)
    on = overlaps(edges)
    assert on["embed@bbc"] > 2 and on["merge"] == 3 and on["moe_build"] > 2  # merge may meet both MoE stages
    moe = {"moe_build", "moe_quantize"}
    off = overlaps({sid: ups - moe for sid, ups in edges.items() if sid not in moe})
    assert off["merge"] == off["quantize"] == off["evaluate"] == off["register"] == 1
    chain = overlaps({"a": set(), "b": {"a"}, "c": {"a"}, "d": {"b", "c"}})
    assert chain == {"a": 1, "b": 2, "c": 2, "d": 1}


def test_declarations_that_write_one_path_twice_or_loop_are_refused():
    a = StageSpec(name="a", per_task=False, comment="", deps=("y",), outs=("x",))
    b = StageSpec(name="b", per_task=False, comment="", deps=("x",), outs=("y",))
    with pytest.raises(ValueError, match="cycle"):
        upstream([a, b], [])
    c = StageSpec(name="c", per_task=False, comment="", outs=("x",))
    with pytest.raises(ValueError, match="x is declared as an output of both a and c"):
        upstream([a, c], [])


# ---------------------------------------------------------------------------------------------------
# a stage reads only what it declares


def params():
    return load_params(ROOT / "params.yaml", "demo")


def test_reading_an_undeclared_param_names_it_and_the_declaration():
    view = declared_view(params(), ("pipeline.seed", "pipeline.tasks.bbc", "curate"), "curate")
    assert view.pipeline.seed == params().pipeline.seed
    assert view.curate.level == params().curate.level
    assert view.pipeline.tasks["bbc"].corpus == "bbc_news"
    with pytest.raises(UndeclaredParam, match=r"stage 'curate' read param 'finetune.lr'.*tasks/stages/curate.py"):
        view.finetune.lr
    with pytest.raises(UndeclaredParam, match="'pipeline.tasks.rotten.corpus'"):
        view.pipeline.tasks["rotten"].corpus
    with pytest.raises(UndeclaredParam, match="'pipeline.tasks'"):
        list(view.pipeline.tasks)  # every task's name is a read of the whole mapping
    with pytest.raises(TypeError):
        view.pipeline.seed = 3


def test_helper_methods_read_through_the_view():
    p = params()
    view = declared_view(p, ("merge.order", "pipeline.tasks"), "merge")
    assert view.merge_order() == p.merge_order()
    with pytest.raises(UndeclaredParam, match="'ingest.n_reference'"):
        declared_view(p, ("pipeline.tasks",), "x").task_sizes("bbc")


def test_finetune_depends_on_the_chosen_methods_options_only():
    """Under method gmixout the finetune stage reads finetune.gmixout, not finetune.mixout or
    finetune.plain, and its declared keys say so (DVC resolves `${finetune.method}` the same way)."""
    p = params()
    keys = params_keys(spec("finetune"), "bbc", p)
    assert "finetune.gmixout" in keys and "finetune.mixout" not in keys and "finetune.plain" not in keys
    data = render_params(ROOT / "params.yaml", "demo")
    data["finetune"]["method"] = "plain"
    plain = validate_params(data, "test")
    keys = params_keys(spec("finetune"), "bbc", plain)
    assert "finetune.plain" in keys and "finetune.gmixout" not in keys
    with pytest.raises(UndeclaredParam, match="finetune.gmixout"):
        declared_view(plain, keys, "finetune").finetune.gmixout.p
    # the resolved config keeps every common key and the chosen method's options, flat
    assert set(p.finetune.resolved()) == {
        *FinetuneParams.common_fields(),
        "method",
        "p",
        "anchor",
        "ema_beta",
        "period",
        "sparse",
    }
    assert set(plain.finetune.resolved()) == {*FinetuneParams.common_fields(), "method"}


def test_declared_values_are_what_the_run_logs():
    p = params()
    values = declared_values(p, ("pipeline.seed", "curate"))
    assert values == {"pipeline.seed": p.pipeline.seed, "curate": p.curate.model_dump()}


# ---------------------------------------------------------------------------------------------------
# one source of defaults


def _diff(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in sorted(set(a) | set(b))
            for d in (
                [f"{path}{k}: only in params.yaml"]
                if k not in b
                else [f"{path}{k}: missing from params.yaml"]
                if k not in a
                else _diff(a[k], b[k], f"{path}{k}.")
            )
        ]
    return [] if a == b else [f"{path[:-1]}: params.yaml has {a!r}, the schema's default is {b!r}"]


def test_params_yaml_equals_the_schema_defaults():
    """As shipped, params.yaml is the demo profile spelled out: every key at the schema's default and
    none missing, so deleting a key changes nothing (pipeline.tasks has no default: the four demo
    tasks). A project of its own sets its tasks and settings there (docs/stages.md, your own data):
    then it only has to be valid."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    demo = render_params(ROOT / "params.yaml", "demo")
    if (raw.get("pipeline") or {}).get("tasks") != demo["pipeline"]["tasks"]:
        load_params(ROOT / "params.yaml")
        pytest.skip("params.yaml holds this project's own tasks: it is valid; the defaults check is the demo's")
    assert _diff(raw, demo) == []


def test_the_defaults_check_catches_a_drifted_default():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["ingest"]["n_pool"] += 1
    defaults = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert _diff(raw, defaults) == [
        f"ingest.n_pool: params.yaml has {raw['ingest']['n_pool']}, the schema's "
        f"default is {defaults['ingest']['n_pool']}"
    ]


@pytest.mark.parametrize("profile", sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml")))
def test_every_profile_validates(profile):
    load_params(ROOT / "params.yaml", profile)


def test_a_profile_extends_another_and_states_only_what_it_changes():
    moe = read_profile("moe")
    tiny = read_profile("tiny")
    assert moe == deep_merge(tiny, {"moe": {"enabled": True}})
    assert "pipeline" not in yaml.safe_load((ROOT / "profiles" / "moe.yaml").read_text())
    assert render_params(ROOT / "params.yaml", "moe")["finetune"]["max_steps"] == tiny["finetune"]["max_steps"]


def test_profiles_that_extend_each_other_in_a_loop_are_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: " + str(tmp_path / "b.yaml") + "\n")
    (tmp_path / "b.yaml").write_text("extends: " + str(tmp_path / "a.yaml") + "\n")
    with pytest.raises(ParamsError, match="loop"):
        read_profile(str(tmp_path / "a.yaml"))
