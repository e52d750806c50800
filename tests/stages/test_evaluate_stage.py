"""The evaluate stage on synthetic features (what the merge and quantize stages keep): the continual
metrics against a hand computation from the per-variant scores, the interfaces' independence in the
stage, the deployable entry, the report and plot data, and bad input that writes nothing."""

import json
import os

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from crucible.serialize import safetensors_bytes
from tasks.runtime.io import md5_file
from tasks.stages import execute

ORDER = ["rotten", "bbc"]
CLASSES = {"rotten": ["fresh", "rotten"], "bbc": ["business", "sport", "tech"]}
METHODS = {"gs3r": {"energy": 0.9, "rank_budget": 0.5}, "weight_average": {}}
D = 8


def _cluster_features(rng, labels, means, noise):
    return torch.tensor(means[labels] + noise * rng.standard_normal((len(labels), D)), dtype=torch.float32)


def write_features(root, *, probe_rows: int = 30, seed: int = 0, merged: bool = True):
    """models/merge/ and models/quantize/ as the two stages leave them, with features whose quality
    falls with a variant-specific noise level (so the interfaces have something to measure), and the
    per-task metrics the report summarises (metrics/<task>/{curate,pseudolabel,finetune}.json)."""
    rng = np.random.default_rng(seed)
    means = {t: 3.0 * rng.standard_normal((len(c), D)) for t, c in CLASSES.items()}
    labels = {(t, s): np.arange(n) % len(CLASSES[t]) for t in ORDER for s, n in (("test", 24), ("probe", probe_rows))}
    heads = {}
    for t in ORDER:
        heads[f"{t}.weight"] = torch.tensor(means[t], dtype=torch.float32)
        heads[f"{t}.bias"] = torch.tensor(-0.5 * (means[t] ** 2).sum(1), dtype=torch.float32)
    merge_variants = [("base", "base", "base", -1, ORDER, 4.0)]
    merge_variants += [(f"finetune:{t}", "finetune", "finetune", j, ORDER[: j + 1], 0.5) for j, t in enumerate(ORDER)]
    merge_variants += [
        (f"{m}@{j}", "merge", m, j, ORDER[: j + 1], 1.0 + j + k)
        for k, m in enumerate(METHODS)
        for j in range(len(ORDER))
        if merged
    ]
    quant_variants = [
        (f"quantize:{q}", "quantize", q, -1, ORDER, n)
        for q, n in (("mxfp4", 2.5), ("mxfp4_uniform", 2.2), ("mxfp4_load_aware", 2.1))
    ]

    def store(variants):
        tensors = {f"labels/{t}/{s}": torch.tensor(y, dtype=torch.long) for (t, s), y in labels.items()}
        meta = []
        for name, family, method, arrival, tasks, noise in variants:
            for t in tasks:
                for s in ("test", "probe"):
                    tensors[f"{name}/{t}/{s}"] = _cluster_features(rng, labels[t, s], means[t], noise)
            meta.append({"name": name, "family": family, "method": method, "arrival": arrival, "tasks": list(tasks)})
        return safetensors_bytes(
            tensors, {"variants": json.dumps(meta), "classes": json.dumps(CLASSES), "tasks": json.dumps(ORDER)}
        )

    for folder, variants in (("merge", merge_variants), ("quantize", quant_variants)):
        out = root / "models" / folder
        out.mkdir(parents=True, exist_ok=True)
        (out / "features.safetensors").write_bytes(store(variants))
        (out / "config.json").write_text(
            json.dumps(
                {
                    "base_model": "all-MiniLM-L6-v2",
                    "classes": CLASSES,
                    "order": ORDER,
                    "allocation": "load_aware",
                    "main": "gs3r",
                }
            )
        )
    # the fine-tunes' heads (every interface) and the deployed ones (the value comparisons): the same here
    for path in ("merge/heads.safetensors", "merge/task_heads.safetensors", "quantize/heads.safetensors"):
        (root / "models" / path).write_bytes(safetensors_bytes(heads, {"classes": json.dumps(CLASSES)}))
    write_baseline_inputs(root, rng, labels, means)
    for t in ORDER:
        d = root / "metrics" / t
        d.mkdir(parents=True, exist_ok=True)
        (d / "curate.json").write_text(
            json.dumps(
                {
                    "eps_true": 0.3,
                    "eps_hat": 0.28,
                    "ccmmd_value": 0.001,
                    "ccmmd_ci_low": -0.001,
                    "ccmmd_ci_high": 0.003,
                    "naive": 0.004,
                    "audit_only": 0.0008,
                    "oracle": 0.0005,
                    "keep_precision": 0.9,
                    "keep_recall": 0.5,
                    "n_keep": 50,
                    "n_pool": 120,
                }
            )
        )
        (d / "pseudolabel.json").write_text(
            json.dumps(
                {
                    "accuracy": 0.9,
                    "accuracy_ci_low": 0.85,
                    "accuracy_ci_high": 0.95,
                    "accuracy_true": 0.92,
                    "naive_accuracy": 0.8,
                    "n_selected": 70,
                }
            )
        )
        (d / "finetune.json").write_text(
            json.dumps({"test_accuracy": 0.9, "dev_accuracy": 0.88, "steps": 6, "n_train": 70})
        )


def write_baseline_inputs(root, rng, labels, means) -> None:
    """What the frozen-base probe baseline reads: each task's reference and test tables and the embed
    stage's embeddings of them (row for row: the test rows are the features' test rows)."""
    from tasks.data.embeddings import ids_digest

    for t in ORDER:
        folder = root / "data" / t
        folder.mkdir(parents=True, exist_ok=True)
        frames, tensors, meta = {}, {}, {"model": "all-MiniLM-L6-v2"}
        for table, y in (("reference", np.arange(40) % len(CLASSES[t])), ("test", labels[t, "test"])):
            frames[table] = pd.DataFrame(
                {
                    "id": [f"{table[0]}{i}" for i in range(len(y))],
                    "text": [f"{table} text {i} of {t}" for i in range(len(y))],
                    "label": np.asarray(CLASSES[t])[y],
                }
            )
            frames[table].to_parquet(folder / f"{table}.parquet", index=False)
            tensors[table] = _cluster_features(rng, y, means[t], 3.0)
            meta[f"{table}_ids_md5"] = ids_digest(frames[table]["id"])
        (folder / "embeddings.safetensors").write_bytes(safetensors_bytes(tensors, meta))


@pytest.fixture
def project(tmp_path, project_root):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path / "ws", "tiny")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["pipeline"]["tasks"] = {t: params["pipeline"]["tasks"][t] for t in ORDER}  # in arrival order
    params["merge"]["methods"] = METHODS
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    write_features(root)
    return root


def test_metrics_follow_from_the_per_variant_scores(project):
    result = execute("evaluate", None, project)
    metrics = json.loads((project / "metrics" / "evaluate.json").read_text())
    variants = json.loads((project / "metrics" / "variants.json").read_text())
    assert metrics["interfaces"] == ["head", "probe", "kmeans", "agglomerative"]
    expected = {
        "base",
        "finetune:rotten",
        "finetune:bbc",
        "gs3r@0",
        "gs3r@1",
        "weight_average@0",
        "weight_average@1",
        "quantize:mxfp4",
        "quantize:mxfp4_uniform",
        "quantize:mxfp4_load_aware",
    }
    assert set(variants) == expected
    assert set(variants["gs3r@0"]) == {"rotten"} and set(variants["gs3r@1"]) == {"rotten", "bbc"}
    assert set(variants["base"]["bbc"]) == {
        "head",
        "probe",
        "kmeans_nmi",
        "kmeans_ari",
        "agglomerative_nmi",
        "agglomerative_ari",
    }
    # ACC and BWT by hand from the cells: R[j, i] = variant after arrival j on task i
    for method in METHODS:
        for iface, metric in (("head", "head"), ("probe", "probe"), ("kmeans", "kmeans_nmi")):
            r00 = variants[f"{method}@0"]["rotten"][metric]
            r10, r11 = (variants[f"{method}@1"][t][metric] for t in ORDER)
            got = metrics["methods"][method][iface]
            assert got["acc"] == pytest.approx((r10 + r11) / 2, abs=1e-6)
            assert got["bwt"] == pytest.approx(r10 - r00, abs=1e-6)
    lf = metrics["methods"]["latest_finetune"]["head"]
    assert lf["acc"] == pytest.approx(
        (variants["finetune:bbc"]["rotten"]["head"] + variants["finetune:bbc"]["bbc"]["head"]) / 2, abs=1e-6
    )
    assert lf["bwt"] == pytest.approx(
        variants["finetune:bbc"]["rotten"]["head"] - variants["finetune:rotten"]["rotten"]["head"], abs=1e-6
    )
    assert metrics["methods"]["base"]["probe"]["bwt"] == 0.0  # the base model neither learns nor forgets
    # the quantized model replaces the main method's final row; its diagonal start stays gs3r's
    q = metrics["methods"]["gs3r+mxfp4_load_aware"]["head"]
    assert q["bwt"] == pytest.approx(
        variants["quantize:mxfp4_load_aware"]["rotten"]["head"] - variants["gs3r@0"]["rotten"]["head"], abs=1e-6
    )
    dep = metrics["deployable"]
    assert dep["quantized"]["variant"] == "quantize:mxfp4_load_aware" and dep["float"]["variant"] == "gs3r@1"
    assert dep["quantized"]["accuracy"] == {t: variants["quantize:mxfp4_load_aware"][t]["head"] for t in ORDER}
    assert dep["float"]["mean_accuracy"] == pytest.approx(np.mean([variants["gs3r@1"][t]["head"] for t in ORDER]))
    assert dep["float"]["n_test"] == {"rotten": 24, "bbc": 24} and metrics["n_probe"] == {"rotten": 30, "bbc": 30}
    assert result.metrics["deployable.quantized.mean_accuracy"] == dep["quantized"]["mean_accuracy"]
    # what the register gate's derived floors start from: the majority class's share of the scored
    # test rows, and the base encoder through each task's head
    assert metrics["baselines"] == {
        "chance": {"rotten": 0.5, "bbc": round(8 / 24, 6)},
        "base": {t: variants["base"][t]["head"] for t in ORDER},
        "probe": {t: round(metrics["value"]["accuracy"]["probe"][t], 6) for t in ORDER},
    }
    # plot data and report
    summary = pd.read_csv(project / "reports" / "plots" / "summary.csv")
    assert set(summary["method"]) == {
        "gs3r",
        "weight_average",
        "latest_finetune",
        "base",
        "gs3r+mxfp4",
        "gs3r+mxfp4_uniform",
        "gs3r+mxfp4_load_aware",
    }
    matrix = pd.read_csv(project / "reports" / "plots" / "matrix.csv")
    assert len(matrix) == len(summary) * 3  # three cells (i <= j) per 2x2 matrix
    html = (project / "reports" / "index.html").read_text()
    for name in expected:
        assert name in html, name
    for figure in ("interfaces", "curves", "matrices", "ccmmd", "pseudolabel"):
        assert (project / "reports" / "figures" / f"{figure}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_deployable_models_are_compared_with_the_probe_row_by_row(project):
    """metrics/predictions.parquet holds every model's prediction on every test row; the value block
    of evaluate.json is computed from it: accuracies, each paired difference with its interval, the
    frozen-base probe refitted here from the embeddings gives the same predictions."""
    from crucible.heads import fit_probe_cv
    from crucible.seeding import derive_seed
    from crucible.stats import compare_tasks
    from tasks.data.embeddings import load_embeddings

    execute("evaluate", None, project)
    metrics = json.loads((project / "metrics" / "evaluate.json").read_text())
    preds = pd.read_parquet(project / "metrics" / "predictions.parquet")
    assert list(preds.columns) == [
        "task",
        "row",
        "id",
        "text_md5",
        "label",
        "probe",
        "finetune",
        "merged",
        "float",
        "quantized",
    ]
    assert preds.groupby("task").size().to_dict() == {"rotten": 24, "bbc": 24}
    value = metrics["value"]
    for m in ("probe", "finetune", "merged", "float", "quantized"):
        for t in ORDER:
            g = preds[preds["task"] == t]
            assert value["accuracy"][m][t] == pytest.approx((g[m] == g["label"]).mean())
    for t in ORDER:
        test = pd.read_parquet(project / "data" / t / "test.parquet")
        ref = pd.read_parquet(project / "data" / t / "reference.parquet")
        emb = load_embeddings(project, t, {"reference": ref, "test": test})
        fit = fit_probe_cv(
            emb["reference"].double().numpy(), ref["label"].to_numpy(object), seed=derive_seed(0, t, "baseline")
        )
        assert (fit.probe.predict(emb["test"].double().numpy()) == preds.loc[preds["task"] == t, "probe"]).all()
        assert value["baseline"]["probe"][t]["C"] == fit.C
    cmp = value["comparisons"]["quantized_vs_probe"]
    pairs = {
        t: ((g["quantized"] == g["label"]).to_numpy(), (g["probe"] == g["label"]).to_numpy())
        for t, g in preds.groupby("task", sort=False)
    }
    again = compare_tasks(pairs, n_boot=10_000, seed=derive_seed(0, 0))
    assert cmp["mean"]["diff"] == pytest.approx(again["mean"].diff)
    assert cmp["mean"]["ci_low"] == pytest.approx(again["mean"].ci_low, abs=1e-6)
    assert cmp["rotten"]["p_value"] == pytest.approx(again["rotten"].p_value)
    assert set(value["comparisons"]) >= {"quantized_vs_probe", "quantized_vs_finetune", "float_vs_merged"}
    assert 0 < value["normalised"]["quantized"]["value"] <= 2
    html = (project / "reports" / "index.html").read_text()
    assert "Value: the deployed model against the frozen-base probe" in html and "quantized − probe" in html


def test_same_inputs_give_the_same_artifacts(project):
    execute("evaluate", None, project)
    first = {
        p: md5_file(p)
        for p in sorted((project / "metrics").glob("*.json")) + sorted((project / "reports").rglob("*.*"))
    }
    execute("evaluate", None, project)
    assert first == {p: md5_file(p) for p in first}


def test_a_permuted_head_fails_only_the_head_interface(project):
    """Permute the rows of bbc's head (the label mapping; the fine-tunes' heads, which every interface
    reads): through the head every variant looks broken on bbc; the probe and the clusterings see the
    same features and do not move."""
    execute("evaluate", None, project)
    before = json.loads((project / "metrics" / "variants.json").read_text())
    from safetensors.torch import load_file

    path = project / "models" / "merge" / "task_heads.safetensors"
    heads = load_file(str(path))
    perm = torch.tensor([1, 2, 0])
    heads["bbc.weight"], heads["bbc.bias"] = heads["bbc.weight"][perm], heads["bbc.bias"][perm]
    path.write_bytes(safetensors_bytes(heads, {"classes": json.dumps(CLASSES)}))
    execute("evaluate", None, project)
    after = json.loads((project / "metrics" / "variants.json").read_text())
    assert before["finetune:bbc"]["bbc"]["head"] > 0.9 and after["finetune:bbc"]["bbc"]["head"] < 0.1
    for variant, tasks in before.items():
        for t, scores in tasks.items():
            for metric, value in scores.items():
                if metric != "head" or t != "bbc":
                    assert after[variant][t][metric] == value, (variant, t, metric)


def test_rows_that_differ_between_merge_and_quantize_are_refused_and_nothing_is_written(project):
    execute("evaluate", None, project)
    outputs = {p: md5_file(p) for p in (project / "metrics").glob("*.json")}
    # quantize scored other probe rows (e.g. evaluate.probe_limit changed and only quantize reran)
    keep = (project / "models" / "merge" / "features.safetensors").read_bytes()
    write_features(project, probe_rows=20, seed=0)
    (project / "models" / "merge" / "features.safetensors").write_bytes(keep)
    with pytest.raises(ValueError, match=r"quantize/features\.safetensors: its rows for '\w+/probe' differ"):
        execute("evaluate", None, project)
    assert outputs == {p: md5_file(p) for p in outputs}


def test_missing_and_corrupt_features_name_the_file_and_the_fix(project):
    path = project / "models" / "quantize" / "features.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(
        ValueError,
        match=r"quantize/features\.safetensors: features is not a readable safetensors file.*"
        r"run the quantize stage",
    ):
        execute("evaluate", None, project)
    path.unlink()
    with pytest.raises(FileNotFoundError, match=r"features not found; run the quantize stage first"):
        execute("evaluate", None, project)


def test_merge_features_without_merged_models_say_to_turn_merge_evaluate_on(project):
    write_features(project, merged=False)
    with pytest.raises(ValueError, match=r"no merged variants because merge.evaluate is off"):
        execute("evaluate", None, project)


def _edit_features(root, folder, change):
    """Rewrite models/<folder>/features.safetensors after `change(tensors, metadata)`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = root / "models" / folder / "features.safetensors"
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    tensors = load_file(str(path))
    change(tensors, meta)
    path.write_bytes(safetensors_bytes(tensors, meta))
    return path


@pytest.mark.parametrize(
    "folder, change, message",
    [
        (
            "quantize",
            lambda t, m: t.pop("quantize:mxfp4/bbc/test"),
            r"tensor 'quantize:mxfp4/bbc/test' \(or 'labels/bbc/test'\) of variant 'quantize:mxfp4' is missing",
        ),
        (
            "merge",
            lambda t, m: [t.pop(k) for k in list(t) if k.endswith("/probe")],
            r"tensor 'labels/rotten/probe' is missing \(evaluate scores every variant on the probe rows",
        ),
        (
            "quantize",
            lambda t, m: t.__setitem__("quantize:mxfp4/bbc/test", torch.zeros(24, 5)),
            r"tensor 'quantize:mxfp4/bbc/test' has shape \[24, 5\], but the head of task 'bbc' "
            r"\(.*merge/task_heads\.safetensors, "
            r"tensor 'bbc\.weight'\) takes features of width 8",
        ),
        (
            "quantize",
            lambda t, m: t.__setitem__("quantize:mxfp4/bbc/test", torch.zeros(20, D)),
            r"tensor 'quantize:mxfp4/bbc/test' has shape \[20, 8\], expected \[24, hidden\] "
            r"\(the rows of 'labels/bbc/test'\)",
        ),
        (
            "merge",
            lambda t, m: t.__setitem__("labels/bbc/test", t["labels/bbc/test"][:20]),
            r"tensor 'base/bbc/test' has shape \[24, 8\], expected \[20, hidden\] \(the rows of 'labels/bbc/test'\)",
        ),
        (
            "merge",
            lambda t, m: t["labels/bbc/probe"].__setitem__(3, 7),
            r"tensor 'labels/bbc/probe' holds 1 labels outside the 3 classes of task 'bbc' \(first: 7 at row 3\)",
        ),
        (
            "merge",
            lambda t, m: m.__setitem__("classes", json.dumps({"rotten": CLASSES["rotten"]})),
            r"metadata 'classes' has no classes for tasks \['bbc'\]",
        ),
    ],
)
def test_every_bad_feature_file_names_the_file_and_the_tensor(project, folder, change, message):
    path = _edit_features(project, folder, change)
    if folder == "merge" and "labels/bbc/probe" in message:  # the quantize stage scored the same rows
        _edit_features(project, "quantize", change)
    with pytest.raises(
        ValueError,
        match=rf"^{path}: {message}.*rebuild it with `crucible stage {folder}`|"
        rf"^{path}: {message}.*run the {folder} stage first",
    ):
        execute("evaluate", None, project)
    # nothing written: neither evaluate's metrics (beside the per-task metrics it reads) nor the report
    assert not (project / "metrics" / "evaluate.json").exists() and not (project / "metrics" / "variants.json").exists()
    assert not (project / "reports" / "index.html").exists()


def test_an_unwritable_metrics_folder_is_an_error_line_with_exit_2(project, capsys):
    """`crucible stage evaluate` cannot write metrics/: the usual `error:` line naming the file and the
    reason, exit 2, no traceback, nothing published (a file stands where the folder should be, which
    stops root too; a read-only folder does the same for other users)."""
    import shutil

    from flows.cli import build_parser

    # the per-task metrics evaluate summarises go with the folder (the report is written without them)
    shutil.rmtree(project / "metrics")
    (project / "metrics").write_text("not a folder\n")
    args = build_parser().parse_args(["stage", "evaluate", "--root", str(project)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(
        f"error: stage evaluate: {project / 'metrics' / 'evaluate.json'}: cannot write it: "
        f"File exists ({project / 'metrics'})"
    ), errors
    assert not (project / "reports" / "index.html").exists()  # all or nothing
    if os.geteuid() != 0:  # a folder without write permission (root ignores permissions)
        (project / "metrics").unlink()
        (project / "metrics").mkdir(mode=0o555)
        assert args.func(args) == 2
        assert "evaluate.json: cannot write it: Permission denied" in capsys.readouterr().err
