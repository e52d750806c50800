"""The merge stage on synthetic task models (the base encoder plus seeded low-rank updates and
random heads: the fine-tune stage is tested elsewhere): outputs, the accuracy matrix against a
direct evaluation, the merge of one task, bad input."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from support.workspaces import minilm_hash

from tasks.runtime.io import md5_file
from tasks.stages import execute

torch.set_num_threads(1)
TASKS = ("bbc", "rotten", "tweets")
METHODS = {"gs3r": {"energy": 1.0, "rank_budget": 1.0}, "weight_average": {}, "task_arithmetic": {"lam": 0.5}}
# the stage's outputs: the model and its figure under models/merge/, the metrics and the plot data
# under metrics/ (where git commits them)
MODEL_FILES = (
    "model.safetensors",
    "heads.safetensors",
    "task_heads.safetensors",
    "config.json",
    "features.safetensors",
    "accuracy.png",
)
METRIC_FILES = ("merge.json", "merge_accuracy.csv", "merge_ranks.csv")


def output_hashes(root) -> dict:
    """md5 of every file the stage writes (models/merge/ and its files under metrics/)."""
    files = [*(root / "models" / "merge").iterdir(), *(root / "metrics" / n for n in METRIC_FILES)]
    return {str(p.relative_to(root)): md5_file(p) for p in files if p.is_file()}


def fake_finetunes(root, theta_0: dict, seed: int = 0) -> None:
    """data/<task>/finetune/{model,head}.safetensors + config.json and test.parquet per task."""
    g = torch.Generator().manual_seed(seed)
    for k, task in enumerate(TASKS):
        theta = {n: v.clone() for n, v in theta_0.items()}
        for name, w in theta.items():
            if w.ndim == 2 and "embed" not in name and "layer" in name:
                m, n = w.shape
                u, v = torch.randn(m, 2, generator=g), torch.randn(n, 2, generator=g)
                w += 0.02 * (u @ v.T) / (m * n) ** 0.25
        classes = ["neg", "pos"] if task != "bbc" else ["business", "sport", "tech"]
        head = {"weight": torch.randn(len(classes), 384, generator=g), "bias": torch.zeros(len(classes))}
        folder = root / "data" / task / "finetune"
        folder.mkdir(parents=True)
        save_file(theta, str(folder / "model.safetensors"))
        save_file(head, str(folder / "head.safetensors"), metadata={"classes": json.dumps(classes)})
        (folder / "config.json").write_text(
            json.dumps(
                {
                    "base_model": "all-MiniLM-L6-v2",
                    "classes": classes,
                    "base_model_hash": minilm_hash(),
                    "max_length": 32,
                }
            )
        )
        rng = np.random.default_rng(k)
        words = ["market", "goal", "chip", "vote", "film", "great", "awful", "team", "price", "phone"]
        test = pd.DataFrame(
            {
                "id": [f"t{i}" for i in range(24)],
                "text": [" ".join(rng.choice(words, 6)) for _ in range(24)],
                "label": [classes[i % len(classes)] for i in range(24)],
            }
        )
        test.to_parquet(root / "data" / task / "test.parquet", index=False)
        reference = pd.DataFrame(
            {
                "id": [f"r{i}" for i in range(16)],
                "text": [" ".join(rng.choice(words, 6)) for _ in range(16)],
                "label": [classes[i % len(classes)] for i in range(16)],
            }
        )
        reference.to_parquet(root / "data" / task / "reference.parquet", index=False)
        labeled = reference.assign(source="reference", confidence=1.0, weight=1.0)
        labeled["split"] = ["dev" if i % 4 == 0 else "train" for i in range(len(labeled))]
        labeled.to_parquet(root / "data" / task / "labeled.parquet", index=False)


@pytest.fixture(scope="module")
def merged_project(tmp_path_factory, project_root, base_state):
    from tasks.runtime.workspace import make_workspace

    tasks = {
        "bbc": {"corpus": "bbc_news"},
        "rotten": {"corpus": "rotten_tomatoes"},
        "tweets": {"corpus": "tweet_sentiment"},
    }
    root = make_workspace(
        project_root,
        tmp_path_factory.mktemp("merge"),
        "tiny",
        overrides={"pipeline": {"tasks": tasks}, "merge": {"order": ["rotten", "bbc", "tweets"]}},
    )
    # a profile's mapping merges into the defaults; three methods only: replace the section's list
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["merge"]["methods"] = METHODS
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    fake_finetunes(root, base_state)
    result = execute("merge", None, root)
    return root, result


def test_outputs_and_metrics(merged_project):
    root, result = merged_project
    out = root / "models" / "merge"
    for name in MODEL_FILES:
        assert (out / name).is_file(), name
    for name in METRIC_FILES:
        assert (root / "metrics" / name).is_file(), name
    assert not {"merge.json", "accuracy.csv", "ranks.csv"} & {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["order"] == ["rotten", "bbc", "tweets"] and config["main_param"] == "auto"
    metrics = json.loads((root / "metrics" / "merge.json").read_text())
    assert set(metrics["methods"]) == set(METHODS)
    for entry in metrics["methods"].values():
        assert len(entry["accuracy_curve"]) == 3 and entry["state_mb"] > 0
        assert "merge_seconds" not in entry and "peak_rss_mb" not in entry  # run-to-run noise: MLflow only
    assert result.metrics["merge_seconds"] > 0 and result.metrics["peak_rss_mb"] >= 0
    assert config["main"] == metrics["main"] in METHODS
    assert metrics["avg_accuracy"] == metrics["methods"][metrics["main"]]["avg_accuracy"]
    assert result.metrics["avg_accuracy"] == metrics["avg_accuracy"]
    heads = load_file(str(out / "heads.safetensors"))
    assert set(heads) == {f"{t}.{p}" for t in TASKS for p in ("weight", "bias")}
    assert heads["bbc.weight"].shape == (3, 384)
    ranks = pd.read_csv(root / "metrics" / "merge_ranks.csv")
    assert set(ranks["method"]) == {"gs3r"} and (ranks["rank"] <= ranks["budget"]).all()


def test_each_head_is_refitted_on_the_merged_features_where_that_wins_on_the_dev_rows(merged_project):
    """merge.refit_heads: auto. Per task, a probe fitted on the final merged model's features of the
    training reference rows (crucible.heads, the same seed) is deployed where it is more accurate
    on the dev rows than the fine-tune's head; task_heads.safetensors keeps the fine-tunes' own."""
    from crucible.heads import fit_linear_head
    from crucible.seeding import derive_seed
    from tasks.data.heldout_scoring import read_features

    root, _ = merged_project
    out = root / "models" / "merge"
    heads, own = load_file(str(out / "heads.safetensors")), load_file(str(out / "task_heads.safetensors"))
    refit = json.loads((root / "metrics" / "merge.json").read_text())["refit"]
    tensors, _ = read_features(out / "features.safetensors", "merge")
    main = json.loads((out / "config.json").read_text())["main"]
    assert set(refit) == set(TASKS)
    for t in TASKS:
        r = refit[t]
        assert r["refit"] == (r["dev_accuracy_refit"] > r["dev_accuracy_kept"]) and (r["n_fit"], r["n_dev"]) == (12, 4)
        x, y = tensors[f"{main}@2/{t}/probe"].numpy(), tensors[f"labels/{t}/probe"].numpy()
        dev = np.arange(len(y)) % 4 == 0  # fake_finetunes' dev rows: every fourth reference row
        if r["refit"]:
            again = fit_linear_head(x[~dev], y[~dev], own[f"{t}.bias"].shape[0], seed=derive_seed(0, t, "refit"))
            np.testing.assert_allclose(heads[f"{t}.weight"].numpy(), again.weight, atol=1e-6)
        else:
            assert torch.equal(heads[f"{t}.weight"], own[f"{t}.weight"])
    config = json.loads((out / "config.json").read_text())
    assert config["refit"] == {t: refit[t]["refit"] for t in TASKS}


def test_accuracy_matrix_matches_a_direct_evaluation(merged_project, base_state):
    """Rebuild the methods' merged models here and score them: the stage's matrix must agree; the
    merge of one task is that task (GS3R at full energy and budget, the average, TA up to lam)."""
    from crucible.continual import backward_transfer
    from crucible.merge import make_merger, merge_sequence, task_vector
    from tasks.data.heldout_scoring import Scorer, read_task_model
    from tasks.data.models import resolve_model

    root, _ = merged_project
    order = ["rotten", "bbc", "tweets"]
    specs = [read_task_model(root, t, "all-MiniLM-L6-v2") for t in order]
    tests = {t: pd.read_parquet(root / "data" / t / "test.parquet") for t in order}
    scorer = Scorer(resolve_model("all-MiniLM-L6-v2"), specs, tests, 64)
    acc = pd.read_csv(root / "metrics" / "merge_accuracy.csv")
    metrics = json.loads((root / "metrics" / "merge.json").read_text())
    for t in order:
        scorer.load(load_file(str(root / "data" / t / "finetune" / "model.safetensors")))
        assert metrics["finetuned_accuracy"][t] == pytest.approx(scorer.accuracy(t))
    for method in ("gs3r", "task_arithmetic"):
        merger = make_merger(method, **METHODS[method])
        tvs = (task_vector(load_file(str(s["model"])), base_state) for s in specs)
        R = np.full((3, 3), np.nan)
        for j, merged in enumerate(merge_sequence(base_state, tvs, merger)):
            scorer.load(merged)
            for i in range(j + 1):
                R[j, i] = scorer.accuracy(order[i])
                row = acc[(acc["method"] == method) & (acc["arrival"] == j) & (acc["task"] == order[i])]
                assert float(row["accuracy"].iloc[0]) == pytest.approx(R[j, i], abs=1e-6), (method, j, i)
        assert metrics["methods"][method]["bwt"] == pytest.approx(backward_transfer(R))
    # one task merged = that task's own fine-tune
    gs3r_first = acc[(acc["method"] == "gs3r") & (acc["arrival"] == 0)]["accuracy"].iloc[0]
    assert gs3r_first == pytest.approx(metrics["finetuned_accuracy"]["rotten"])
    avg_first = acc[(acc["method"] == "weight_average") & (acc["arrival"] == 0)]["accuracy"].iloc[0]
    assert avg_first == pytest.approx(metrics["finetuned_accuracy"]["rotten"])


def test_features_are_those_of_the_scored_models(merged_project):
    """features.safetensors holds, per variant, the pooled features the heads see on the test and probe
    rows of the arrived tasks: the head on them gives the stage's accuracy, and recomputing them from
    the final merged model gives the same numbers."""
    from tasks.data.heldout_scoring import Scorer, read_features, read_task_model
    from tasks.data.models import resolve_model

    root, _ = merged_project
    order = ["rotten", "bbc", "tweets"]
    tensors, meta = read_features(root / "models" / "merge" / "features.safetensors", "merge")
    names = [v["name"] for v in meta["variants"]]
    assert names[:4] == ["base", "finetune:rotten", "finetune:bbc", "finetune:tweets"]
    assert {f"{m}@{j}" for m in METHODS for j in range(3)} <= set(names)
    assert meta["tasks"] == order
    arrived = {v["name"]: v["tasks"] for v in meta["variants"]}
    assert arrived["finetune:bbc"] == ["rotten", "bbc"] and arrived["base"] == order
    acc = pd.read_csv(root / "metrics" / "merge_accuracy.csv")
    heads = load_file(str(root / "models" / "merge" / "task_heads.safetensors"))  # the fine-tunes' own
    for j in range(3):
        for t in order[: j + 1]:
            x = tensors[f"gs3r@{j}/{t}/test"]
            y = tensors[f"labels/{t}/test"]
            assert tensors[f"gs3r@{j}/{t}/probe"].shape == (16, 384)
            head_acc = float(((x @ heads[f"{t}.weight"].T + heads[f"{t}.bias"]).argmax(1) == y).float().mean())
            row = acc[(acc["method"] == "gs3r") & (acc["arrival"] == j) & (acc["task"] == t)]
            assert head_acc == pytest.approx(float(row["accuracy"].iloc[0]), abs=1e-6)
    assert "gs3r@0/bbc/test" not in tensors  # bbc had not arrived yet
    specs = [read_task_model(root, t, "all-MiniLM-L6-v2") for t in order]
    tests = {t: pd.read_parquet(root / "data" / t / "test.parquet") for t in order}
    probes = {t: pd.read_parquet(root / "data" / t / "reference.parquet") for t in order}
    scorer = Scorer(resolve_model("all-MiniLM-L6-v2"), specs, tests, 64, probes=probes)
    scorer.load(load_file(str(root / "models" / "merge" / "model.safetensors")))
    for t in order:
        torch.testing.assert_close(scorer.features(t, "probe"), tensors[f"gs3r@2/{t}/probe"], atol=1e-5, rtol=1e-5)
        assert torch.equal(scorer.labels(t, "probe"), tensors[f"labels/{t}/probe"])


def test_auto_takes_the_method_most_accurate_on_the_dev_rows(merged_project):
    """merge.main: auto. Each method's final merged model, each task through its fine-tune's head, on
    the dev rows of the probe rows (fake_finetunes: every fourth reference row): the mean over tasks
    is recorded and the highest wins; its final model is the one scored on every test row."""
    from tasks.data.heldout_scoring import read_features

    root, _ = merged_project
    metrics = json.loads((root / "metrics" / "merge.json").read_text())
    tensors, meta = read_features(root / "models" / "merge" / "features.safetensors", "merge")
    heads = load_file(str(root / "models" / "merge" / "task_heads.safetensors"))
    expected = {}
    for m in METHODS:
        accs = []
        for t in TASKS:
            x, y = tensors[f"{m}@2/{t}/probe"], tensors[f"labels/{t}/probe"]
            dev = torch.arange(len(y)) % 4 == 0
            logits = x[dev] @ heads[f"{t}.weight"].T + heads[f"{t}.bias"]
            accs.append(float((logits.argmax(1) == y[dev]).float().mean()))
        expected[m] = float(np.mean(accs))
    assert metrics["main_dev_accuracy"] == pytest.approx(expected)
    assert metrics["main"] == max(expected, key=expected.get)
    rows = {v["name"]: v["test_rows"] for v in meta["variants"]}
    main = metrics["main"]
    assert rows[f"{main}@2"] == {"rotten": 24, "bbc": 24, "tweets": 24}  # every test row (eval_limit 200 > 24 here)


def test_main_model_is_the_chosen_merge_and_loads_into_the_base_architecture(merged_project, base_state):
    from crucible.embed import load_encoder
    from crucible.merge import make_merger, task_vector
    from tasks.data.models import resolve_model

    root, _ = merged_project
    main = json.loads((root / "models" / "merge" / "config.json").read_text())["main"]
    state = load_file(str(root / "models" / "merge" / "model.safetensors"))
    encoder, _ = load_encoder(resolve_model("all-MiniLM-L6-v2"))
    encoder.load_state_dict(state, strict=True)
    merger = make_merger(main, **METHODS[main])
    for t in ("rotten", "bbc", "tweets"):
        merger.add(task_vector(load_file(str(root / "data" / t / "finetune" / "model.safetensors")), base_state))
    expected = merger.merged(base_state)
    for k, v in expected.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_foreign_base_model_is_refused_and_outputs_stay(merged_project):
    root, _ = merged_project
    before = output_hashes(root)
    config_path = root / "data" / "bbc" / "finetune" / "config.json"
    original = config_path.read_text()
    config_path.write_text(json.dumps({**json.loads(original), "base_model": "bert-base-uncased"}))
    try:
        with pytest.raises(ValueError, match=r"bbc/finetune/config.json: field 'base_model' = 'bert-base-uncased'"):
            execute("merge", None, root)
    finally:
        config_path.write_text(original)
    assert output_hashes(root) == before


def test_finetune_of_other_base_weights_is_refused(merged_project):
    """Same model name, other content (the weights were replaced after the fine-tune): task vectors
    against another base cannot be merged."""
    root, _ = merged_project
    before = output_hashes(root)
    config_path = root / "data" / "bbc" / "finetune" / "config.json"
    original = config_path.read_text()
    config_path.write_text(json.dumps({**json.loads(original), "base_model_hash": "0" * 32}))
    try:
        with pytest.raises(
            ValueError,
            match=r"bbc/finetune/config.json: field 'base_model_hash' = '0{32}', but the "
            r"base model 'all-MiniLM-L6-v2' now hashes to",
        ):
            execute("merge", None, root)
    finally:
        config_path.write_text(original)
    assert output_hashes(root) == before


def test_missing_finetune_names_the_file_and_the_fix(tmp_path, project_root):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path / "p", "tiny")
    with pytest.raises(FileNotFoundError, match=r"finetune/model.safetensors: missing.*crucible stage finetune"):
        execute("merge", None, root)
    assert not (root / "models" / "merge").exists()
    assert not [p for n in METRIC_FILES for p in [root / "metrics" / n] if p.exists()]


def test_a_finetune_changed_after_its_run_is_refused_before_merge_reads_it(merged_project, capsys):
    """A valid fine-tune file with one weight set to 1e30 after finetune@bbc ran and DVC recorded it:
    merge stops before reading it, exit 2 with one line naming the file, its md5 and dvc.lock's, and
    the command that rebuilds it; merge's outputs stay."""
    from support.workspaces import _dvc

    from flows.cli import build_parser

    root, _ = merged_project
    execute("model", None, root)  # finetune@bbc's dependency, the base model's manifest
    (root / "metrics" / "bbc").mkdir(parents=True, exist_ok=True)
    (root / "metrics" / "bbc" / "finetune.json").write_text("{}\n")
    _dvc(root, "commit", "--force", "finetune@bbc")  # dvc.lock: finetune@bbc's folder as it wrote it
    path = root / "data" / "bbc" / "finetune" / "model.safetensors"
    saved, before = path.read_bytes(), output_hashes(root)
    state = load_file(str(path))
    state["pooler.dense.weight"][0, 0] = 1e30  # still a valid safetensors file
    save_file(state, str(path))
    changed = md5_file(path)
    try:
        capsys.readouterr()
        args = build_parser().parse_args(["stage", "merge", "--root", str(root)])
        code = args.func(args)
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    finally:
        path.write_bytes(saved)
        (root / "dvc.lock").unlink()
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: stage merge: {path}: md5 {changed} is not what stage finetune@bbc wrote")
    assert "(dvc.lock records " in errors[0]
    assert errors[0].endswith("rebuild it with `crucible stage finetune --task bbc` (or `dvc repro finetune@bbc`)")
    assert output_hashes(root) == before
