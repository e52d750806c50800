"""Stage `evaluate` (once): every model variant through three interfaces, the continual metrics at
each, and one report a person can read (docs/methods.md, evaluate; crucible.evaluation, crucible.continual).

    crucible stage evaluate

Variants, in the order of arrival: the base encoder; each task's own fine-tune (on the tasks arrived
up to it); every merge method after every arrival (on the arrived tasks); the quantized merged
model in each MXFP4 form (alone, uniform and load-aware compensation; on every task). No encoder
runs here: the merge and quantize stages keep the frozen features (masked mean pooling, what the
heads see) of every variant on each task's test rows and probe rows (models/*/features.safetensors,
tasks.data.heldout_scoring.FeatureStore), so each encoder ran once over the texts.

Interfaces, per variant and task (`evaluate` params):
- head: test accuracy through the task's own trained head;
- probe: test accuracy of a fresh logistic-regression probe fitted on the variant's features of the
  task's probe rows (`probe_rows`: the reference, or labeled.parquet), never on the test rows;
- separability: each `clustering` algorithm (k = number of classes) on the test features, scored
  against the labels by NMI (the headline) and ARI, with no classifier.
Continual metrics per method and interface over the arrival order, from the matrix R[j, i] (task i
after arrival j): ACC = mean_i R[T-1, i], BWT = mean_{i<T-1} (R[T-1, i] - R[i, i]) (GEM's
definition), and the curve of the mean over the arrived tasks after each arrival. Besides the merge
methods: `latest_finetune` (after arrival j, the newest task's fine-tune alone: forgetting without
merging), `base` (the base encoder: nothing learned, nothing forgotten) and `<main>+<quantized
variant>` (the main method's matrix with its final row from the quantized model).

Outputs (all published together):
- metrics/evaluate.json: per method and interface ACC and BWT; `deployable` (head accuracy per task
  and mean of the quantize stage's written model and of the float merged model: the register
  stage's gate); `baselines` (per task: `chance`, the majority class's share of the scored test
  rows, and `base`, the base encoder's head accuracy: what the gate's derived floors start from);
  a DVC metric;
- metrics/variants.json: every variant x task x metric (DVC metric);
- reports/plots/{summary,curves,matrix,curation}.csv: plot data (views in dvc.yaml);
- reports/figures/*.png and reports/index.html: the report, figures inlined, no network needed.
Everything is logged to the stage's MLflow run and, under the flow, to the pipeline's parent run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from tasks.report.page import build_report
from tasks.runtime.declaration import Plot, StageSpec
from tasks.runtime.io import AtomicOutputs, json_safe, rebuild_hint
from tasks.runtime.params_schema import Params
from tasks.runtime.paths import (
    EVALUATE_JSON,
    MERGE,
    METRICS,
    MOE_BUILD,
    MOE_JSON,
    MOE_QUANTIZE,
    PREDICTIONS,
    QUANTIZE,
    QUANTIZE_JSON,
    REPORTS,
)

PLOTS = ("summary", "curves", "matrix", "curation")


# dvc.yaml's views of the report's plot data (`dvc plots show`; templates in .dvc/plots/)
VIEWS_COMMENT = "Views of the evaluate stage's plot data (`dvc plots show`; templates in .dvc/plots/)."
VIEWS = [
    {
        "ACC per method and interface": {
            "template": "interfaces",
            "x": "method",
            "y": {str(REPORTS / "plots" / "summary.csv"): "acc"},
        }
    },
    {
        "BWT per method and interface": {
            "template": "interfaces",
            "x": "method",
            "y": {str(REPORTS / "plots" / "summary.csv"): "bwt"},
        }
    },
    {
        "Accuracy after each arrival (mean over arrived tasks)": {
            "template": "curves",
            "x": "arrival",
            "y": {str(REPORTS / "plots" / "curves.csv"): "acc"},
        }
    },
    {
        "Accuracy matrix R[arrival, task]": {
            "template": "matrix",
            "x": "task",
            "y": {str(REPORTS / "plots" / "matrix.csv"): "arrival"},
        }
    },
    {
        "CC-MMD estimated contamination against the truth": {
            "template": "scatter",
            "x": "eps_true",
            "y": {str(REPORTS / "plots" / "curation.csv"): "eps_hat"},
        }
    },
]


SPEC = StageSpec(
    name="evaluate",
    per_task=False,
    comment="Once: every variant (base, fine-tunes, each merge method after each arrival, the quantized "
    "models) through three interfaces (head, fresh probe, clustering) from the features merge and "
    "quantize kept; one self-contained HTML report.",
    deps=(
        *(
            str(MERGE / n)
            for n in ("features.safetensors", "heads.safetensors", "task_heads.safetensors", "config.json")
        ),
        *(str(QUANTIZE / n) for n in ("features.safetensors", "heads.safetensors", "config.json")),
        str(QUANTIZE_JSON),
        str(MOE_JSON),
        str(MERGE / "accuracy.png"),
        str(QUANTIZE / "quantize.png"),
        str(MOE_BUILD),
        str(MOE_QUANTIZE),  # its moe.png goes into the report
        *(f"metrics/{{task}}/{s}.json" for s in ("ingest", "curate", "pseudolabel", "finetune")),
        # the frozen-base probe, the baseline of every comparison, and the test rows' ids
        *(f"data/{{task}}/{f}" for f in ("reference.parquet", "test.parquet", "embeddings.safetensors")),
    ),
    outs=(str(PREDICTIONS),),
    params=(
        "pipeline.seed",
        "pipeline.tasks",
        "merge.order",
        "merge.methods",
        "evaluate",
        "register.model",
    ),
    uncached=(str(REPORTS / "index.html"), str(REPORTS / "plots")),
    metrics=(str(EVALUATE_JSON), str(METRICS / "variants.json")),
    plots=(Plot(str(REPORTS / "figures")),),
)


# ---------------------------------------------------------------------------------------------------
# reading the features


def read_inputs(root: Path, params: Params) -> dict:
    """Both stages' features, checked against each other and params; heads and configs."""
    from tasks.data.heldout_scoring import read_features
    from tasks.runtime.io import read_safetensors

    order = params.merge_order()
    merged, merge_meta = read_features(root / MERGE / "features.safetensors", "merge")
    quant, quant_meta = read_features(root / QUANTIZE / "features.safetensors", "quantize")
    for path, meta, stage in ((MERGE, merge_meta, "merge"), (QUANTIZE, quant_meta, "quantize")):
        if meta["tasks"] != order:
            raise ValueError(
                f"{root / path / 'features.safetensors'}: made for tasks {meta['tasks']}, but the "
                f"arrival order is {order}; {rebuild_hint(stage)}"
            )
    if not any(v["family"] == "merge" for v in merge_meta["variants"]):
        raise ValueError(
            f"{root / MERGE / 'features.safetensors'}: holds no merged variants because "
            f"merge.evaluate is off; set merge.evaluate: true and {rebuild_hint('merge')}"
        )
    for key, labels in merged.items():
        if key.startswith("labels/"):
            other = quant.get(key)
            if other is None or not np.array_equal(other.numpy(), labels.numpy()):
                raise ValueError(
                    f"{root / QUANTIZE / 'features.safetensors'}: its rows for {key[7:]!r} differ from "
                    f"the merge stage's ({root / MERGE / 'features.safetensors'}); both must score the "
                    f"same test and probe rows: {rebuild_hint('quantize')}"
                )
    classes = merge_meta["classes"]
    missing = [t for t in order if not isinstance(classes, dict) or not classes.get(t)]
    if missing:
        raise ValueError(
            f"{root / MERGE / 'features.safetensors'}: metadata 'classes' has no classes for tasks "
            f"{missing}; {rebuild_hint('merge')}"
        )
    n = {t: len(classes[t]) for t in order}  # each task's head: (n_classes, hidden) and (n_classes,)
    shapes = {f"{t}.{k}": s for t in order for k, s in (("weight", (n[t], None)), ("bias", (n[t],)))}
    # the fine-tunes' own heads (every interface of every variant) and the deployed ones
    heads, _ = read_safetensors(
        root / MERGE / "task_heads.safetensors", "task heads", rebuild_hint("merge"), shapes=shapes
    )
    deploy_heads = {
        kind: read_safetensors(
            root / folder / "heads.safetensors", f"deployed heads ({kind})", rebuild_hint(stage), shapes=shapes
        )[0]
        for kind, folder, stage in (("float", MERGE, "merge"), ("quantized", QUANTIZE, "quantize"))
    }
    for path, tensors, meta, stage in ((MERGE, merged, merge_meta, "merge"), (QUANTIZE, quant, quant_meta, "quantize")):
        check_features(
            root / path / "features.safetensors",
            stage,
            tensors,
            meta["variants"],
            n,
            heads,
            root / MERGE / "task_heads.safetensors",
        )
    quant_config, merge_config = read_config(root, QUANTIZE, "quantize"), read_config(root, MERGE, "merge")
    if merge_config.get("main") not in params.merge.methods:
        raise ValueError(
            f"{root / MERGE / 'config.json'}: field 'main' = {merge_config.get('main')!r} is not one of "
            f"merge.methods ({', '.join(params.merge.methods)}); {rebuild_hint('merge')}"
        )
    return {
        "order": order,
        "tensors": {**merged, **quant},
        "variants": merge_meta["variants"] + quant_meta["variants"],
        "classes": merge_meta["classes"],
        "heads": heads,
        "deploy_heads": deploy_heads,
        "quantize_config": quant_config,
        "main": merge_config["main"],
    }


def read_config(root: Path, folder: Path, stage: str) -> dict:
    try:
        return json.loads((root / folder / "config.json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{root / folder / 'config.json'}: missing; {rebuild_hint(stage)}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{root / folder / 'config.json'}: not valid JSON ({exc}); {rebuild_hint(stage)}") from None


def check_features(
    path: Path,
    stage: str,
    tensors: dict,
    variants: list[dict],
    n_classes: dict[str, int],
    heads: dict,
    heads_path: Path,
) -> None:
    """What evaluate needs of a features file beyond its own consistency (read_features): every
    variant's test and probe features with the width of the task's head, and labels that are class
    indices of that head. Each error names the file, the tensor, what it holds and what was expected."""
    fix = rebuild_hint(stage)
    for t, k in n_classes.items():
        for split in ("test", "probe"):
            name = f"labels/{t}/{split}"
            if name not in tensors:
                raise ValueError(
                    f"{path}: tensor {name!r} is missing (evaluate scores every variant on the "
                    f"{split} rows of each task); {fix}"
                )
            labels = tensors[name]
            if labels.dim() != 1 or labels.is_floating_point():
                raise ValueError(
                    f"{path}: tensor {name!r} has shape {list(labels.shape)} and dtype {labels.dtype}; "
                    f"expected 1-d integer class indices; {fix}"
                )
            bad = ((labels < 0) | (labels >= k)).nonzero()
            if len(bad):
                i = int(bad[0])
                raise ValueError(
                    f"{path}: tensor {name!r} holds {len(bad)} labels outside the {k} classes of task "
                    f"{t!r} (first: {int(labels[i])} at row {i}); {fix}"
                )
    for v in variants:
        for t in v["tasks"]:
            width = heads[f"{t}.weight"].shape[1]
            for split in ("test", "probe"):
                name = f"{v['name']}/{t}/{split}"
                if name not in tensors:
                    raise ValueError(f"{path}: tensor {name!r} (variant {v['name']!r}, task {t!r}) is missing; {fix}")
                got = tensors[name]
                if got.dim() != 2 or got.shape[1] != width:
                    raise ValueError(
                        f"{path}: tensor {name!r} has shape {list(got.shape)}, but the head of task "
                        f"{t!r} ({heads_path}, tensor '{t}.weight') takes features of width {width}; "
                        f"the features and the heads come from different models: {fix}"
                    )


# ---------------------------------------------------------------------------------------------------
# the interfaces and the continual metrics


def common_rows(variants: list[dict], tensors: dict) -> dict[str, int]:
    """Per task the test rows every variant was scored on: the first N (merge.eval_limit), or all."""
    rows = {}
    for v in variants:
        for t in v["tasks"]:
            n = int(tensors[f"{v['name']}/{t}/test"].shape[0])
            rows[t] = min(rows.get(t, n), n)
    return rows


def score_variants(data: dict, params: Params, progress=None) -> pd.DataFrame:
    """Long table: variant, family, method, arrival, task, metric, value (every interface), each task
    on the test rows every variant was scored on (common_rows)."""
    from crucible.evaluation import interface_scores

    cfg = params.evaluate
    T, heads = data["tensors"], data["heads"]
    n = common_rows(data["variants"], T)
    rows = []
    for v in data["variants"]:
        for t in v["tasks"]:
            scores = interface_scores(
                T[f"{v['name']}/{t}/test"][: n[t]].numpy(),
                T[f"labels/{t}/test"][: n[t]].numpy(),
                heads[f"{t}.weight"].numpy(),
                heads[f"{t}.bias"].numpy(),
                T[f"{v['name']}/{t}/probe"].numpy(),
                T[f"labels/{t}/probe"].numpy(),
                C=cfg.probe_C,
                algorithms=tuple(cfg.clustering),
                normalize=cfg.normalize,
                seed=params.pipeline.seed,
            )
            rows += [
                {
                    "variant": v["name"],
                    "family": v["family"],
                    "method": v["method"],
                    "arrival": v["arrival"],
                    "task": t,
                    "metric": k,
                    "value": round(float(x), 6),
                }
                for k, x in scores.items()
            ]
            if progress is not None:
                progress()
    return pd.DataFrame(rows, columns=["variant", "family", "method", "arrival", "task", "metric", "value"])


def interfaces(params: Params) -> list[str]:
    """Headline metric per interface: head and probe accuracy, each clustering algorithm's NMI."""
    return ["head", "probe", *params.evaluate.clustering]


def _metric(interface: str) -> str:
    return interface if interface in ("head", "probe") else f"{interface}_nmi"


def continual_matrices(
    cells: pd.DataFrame, order: list[str], methods: list[str], main: str, quantized: list[str], ifaces: list[str]
) -> dict[str, dict[str, np.ndarray]]:
    """R[j, i] per continual method and interface (NaN above the diagonal)."""
    value = {(r.variant, r.task, r.metric): r.value for r in cells.itertuples()}
    n = len(order)

    def matrix(variant_at) -> dict[str, np.ndarray]:
        out = {}
        for iface in ifaces:
            R = np.full((n, n), np.nan)
            for j in range(n):
                for i in range(j + 1):
                    R[j, i] = value[variant_at(j), order[i], _metric(iface)]
            out[iface] = R
        return out

    mats = {m: matrix(lambda j, m=m: f"{m}@{j}") for m in methods}
    mats["latest_finetune"] = matrix(lambda j: f"finetune:{order[j]}")
    mats["base"] = matrix(lambda j: "base")
    for q in quantized:
        mats[f"{main}+{q}"] = {}
        for iface in ifaces:
            R = mats[main][iface].copy()
            R[n - 1] = [value[f"quantize:{q}", t, _metric(iface)] for t in order]
            mats[f"{main}+{q}"][iface] = R
    return mats


def _family(method: str, methods: list[str]) -> str:
    if method in methods:
        return "merge"
    if method in ("base", "latest_finetune"):
        return "base" if method == "base" else "finetune"
    return "quantize"


def summarise(mats: dict, methods: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(summary: method, family, interface, acc, bwt; curves: method, interface, arrival, acc)."""
    from crucible.continual import accuracy_curve, average_accuracy, backward_transfer

    summary, curves = [], []
    for method, by_iface in mats.items():
        for iface, R in by_iface.items():
            bwt = backward_transfer(R) if len(R) > 1 else float("nan")
            summary.append(
                {
                    "method": method,
                    "family": _family(method, methods),
                    "interface": iface,
                    "acc": round(average_accuracy(R), 6),
                    "bwt": round(bwt, 6),
                }
            )
            curves += [
                {"method": method, "interface": iface, "arrival": j, "acc": round(a, 6)}
                for j, a in enumerate(accuracy_curve(R))
            ]
    return pd.DataFrame(summary), pd.DataFrame(curves)


def deployable(value: dict, data: dict, main: str) -> dict:
    """Test accuracy per task (and mean, every test row) of the two models register can deploy, each
    with its deployed heads (tasks.report.value)."""
    variants = {"quantized": f"quantize:{quantized_variant(data)}", "float": f"{main}@{len(data['order']) - 1}"}
    out = {}
    for kind, variant in variants.items():
        acc = {t: round(a, 6) for t, a in value["accuracy"][kind].items() if t != "mean"}
        out[kind] = {
            "variant": variant,
            "accuracy": acc,
            "mean_accuracy": round(float(np.mean(list(acc.values()))), 6),
            "n_test": value["n_test"],
        }
    return out


def quantized_variant(data: dict) -> str:
    return f"mxfp4_{data['quantize_config'].get('allocation', 'load_aware')}"


# ---------------------------------------------------------------------------------------------------
# the other stages' figures, for the report


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def stage_summaries(root: Path, order: list[str]) -> dict[str, pd.DataFrame]:
    """Curation, pseudo-label and fine-tune figures per task (rows with what each stage recorded)."""
    cur, pl, ft = [], [], []
    for t in order:
        c = _read_json(root / "metrics" / t / "curate.json") or {}
        ing = _read_json(root / "metrics" / t / "ingest.json") or {}
        if c:
            cur.append(
                {
                    "task": t,
                    "eps_true": c.get("eps_true", ing.get("eps_true")),
                    "eps_hat": c.get("eps_hat"),
                    "ccmmd": c.get("ccmmd_value"),
                    "ccmmd_ci_low": c.get("ccmmd_ci_low"),
                    "ccmmd_ci_high": c.get("ccmmd_ci_high"),
                    "naive": c.get("naive"),
                    "audit_only": c.get("audit_only"),
                    "oracle": c.get("oracle"),
                    "keep_precision": c.get("keep_precision"),
                    "keep_recall": c.get("keep_recall"),
                    "n_keep": c.get("n_keep"),
                    "n_pool": c.get("n_pool"),
                }
            )
        p = _read_json(root / "metrics" / t / "pseudolabel.json") or {}
        if p:
            pl.append(
                {
                    "task": t,
                    **{
                        k: p.get(k)
                        for k in (
                            "accuracy",
                            "accuracy_ci_low",
                            "accuracy_ci_high",
                            "accuracy_true",
                            "naive_accuracy",
                            "n_selected",
                        )
                    },
                }
            )
        f = _read_json(root / "metrics" / t / "finetune.json") or {}
        if f:
            ft.append({"task": t, **{k: f.get(k) for k in ("test_accuracy", "dev_accuracy", "steps", "n_train")}})
    cols = {
        "curation": [
            "task",
            "eps_true",
            "eps_hat",
            "ccmmd",
            "ccmmd_ci_low",
            "ccmmd_ci_high",
            "naive",
            "audit_only",
            "oracle",
            "keep_precision",
            "keep_recall",
            "n_keep",
            "n_pool",
        ],
        "pseudolabel": [
            "task",
            "accuracy",
            "accuracy_ci_low",
            "accuracy_ci_high",
            "accuracy_true",
            "naive_accuracy",
            "n_selected",
        ],
        "finetune": ["task", "test_accuracy", "dev_accuracy", "steps", "n_train"],
    }
    frames = {
        "curation": pd.DataFrame(cur, columns=cols["curation"]),
        "pseudolabel": pd.DataFrame(pl, columns=cols["pseudolabel"]),
        "finetune": pd.DataFrame(ft, columns=cols["finetune"]),
    }
    for df in frames.values():  # None -> NaN, so the columns stay numeric
        for c in df.columns[1:]:
            df[c] = pd.to_numeric(df[c], errors="coerce")
    return frames


# ---------------------------------------------------------------------------------------------------
# the stage


def _csv(df: pd.DataFrame) -> bytes:
    return df.to_csv(index=False, float_format="%.6g").encode()


NEAR_CHANCE = 0.02  # a fine-tune within this of chance learned next to nothing


def finetune_warnings(worth: dict, chance: dict[str, float]) -> list[str]:
    """A task's fine-tune (its encoder and head) on every test row within NEAR_CHANCE of chance, or
    significantly below the base encoder's probe (the paired interval of fine-tune - probe, from
    `worth` = tasks.report.value.value, entirely below zero): it learned less than the frozen model
    already knows (too few steps, a too high learning rate, too little data). A point estimate below
    the probe inside the noise is not warned about. Said on stderr and in evaluate.json."""
    accuracy = worth["accuracy"].get("finetune", {})
    vs_probe = worth["comparisons"].get("finetune_vs_probe", {})
    out = []
    for task, floor in chance.items():
        ft = accuracy.get(task)
        if ft is None:
            continue
        c = vs_probe.get(task)
        if ft <= floor + NEAR_CHANCE:
            out.append(
                f"finetune@{task}: test accuracy {ft:.3f} is at chance ({floor:.3f}, the majority class's "
                f"share): it learned next to nothing (more steps or data, another lr)"
            )
        elif c is not None and c["ci_high"] < 0:
            out.append(
                f"finetune@{task}: test accuracy {ft:.3f} is below the base model's probe {c['b']:.3f} "
                f"({100 * c['diff']:+.1f} [{100 * c['ci_low']:+.1f}, {100 * c['ci_high']:+.1f}] points, "
                f"{c['n']} test rows): a linear probe on the frozen encoder beats the fine-tune"
            )
    return out


def run(params: Params, task: str | None, root: Path, log) -> dict:
    """Read both stages' features, score every variant through the interfaces, compare the deployable
    models with the baselines row by row, build the report, write, log."""
    root = Path(root)
    data = read_inputs(root, params)
    results = compute(params, root, data)
    report = build_report(report_inputs(params, root, data, results))
    write_outputs(root, results, report)
    log_results(log, root, results)
    return headline(results)


def compute(params: Params, root: Path, data: dict) -> dict:
    """Everything evaluate.json, variants.json, the plot data and the report hold."""
    from crucible.progress import Progress
    from tasks.report.value import predictions, value
    from tasks.runtime.tracking import say

    order, main, cfg = data["order"], data["main"], params.evaluate
    methods = [m for m in params.merge.methods if any(v["name"] == f"{m}@0" for v in data["variants"])]
    quantized = [v["method"] for v in data["variants"] if v["family"] == "quantize"]
    ifaces = interfaces(params)
    with Progress(
        total=sum(len(v["tasks"]) for v in data["variants"]), desc="evaluate: variants x tasks", unit="pair"
    ) as bar:
        cells = score_variants(data, params, progress=bar.update)
    mats = continual_matrices(cells, order, methods, main, quantized, ifaces)
    summary, curves = summarise(mats, methods)
    T = data["tensors"]
    preds, probe_fits = predictions(root, data, main, quantized_variant(data), params.pipeline.seed)
    worth = value(preds, level=cfg.level, n_boot=cfg.n_boot, seed=params.pipeline.seed)
    worth["baseline"] = {"probe": probe_fits}
    n_test = {t: int(T[f"labels/{t}/test"].shape[0]) for t in order}
    n_probe = {t: int(T[f"labels/{t}/probe"].shape[0]) for t in order}
    chance = {t: round(float(np.bincount(T[f"labels/{t}/test"].numpy()).max()) / max(1, n_test[t]), 6) for t in order}
    base_cells = cells[(cells["variant"] == "base") & (cells["metric"] == "head")]
    baselines = {
        "chance": chance,
        "base": {r.task: r.value for r in base_cells.itertuples()},
        "probe": {t: round(a, 6) for t, a in worth["accuracy"]["probe"].items() if t != "mean"},
    }
    table = {
        m: {r.interface: {"acc": r.acc, "bwt": r.bwt} for r in summary[summary["method"] == m].itertuples()}
        for m in mats
    }
    warnings = finetune_warnings(worth, chance)
    for w in warnings:
        say(f"warning: {w}")
    metrics = json_safe(
        {
            "order": order,
            "main": main,
            "interfaces": ifaces,
            "continual_rows": common_rows(data["variants"], T),
            "methods": table,
            "deployable": deployable(worth, data, main),
            "baselines": baselines,
            "value": worth,
            "n_test": n_test,
            "n_probe": n_probe,
            "warnings": warnings,
        }
    )
    variants = {}
    for r in cells.itertuples():
        variants.setdefault(r.variant, {}).setdefault(r.task, {})[r.metric] = r.value
    matrix_rows = [
        {"method": m, "interface": iface, "arrival": j, "task": order[i], "value": round(float(R[j, i]), 6)}
        for m, by in mats.items()
        for iface, R in by.items()
        for j in range(len(order))
        for i in range(j + 1)
    ]
    return {
        "metrics": metrics,
        "variants": variants,
        "cells": cells,
        "summary": summary,
        "curves": curves,
        "mats": mats,
        "matrix_rows": matrix_rows,
        "table": table,
        "predictions": preds,
        "summaries": stage_summaries(root, order),
    }


def report_inputs(params: Params, root: Path, data: dict, results: dict) -> dict:
    """What tasks.report.page.build_report reads."""
    from tasks.runtime.tracking import git_commit

    m = results["metrics"]
    return {
        "order": m["order"],
        "interfaces": m["interfaces"],
        "main": m["main"],
        "cells": results["cells"],
        "summary": results["summary"],
        "curves": results["curves"],
        "matrices": {k: {i: R.tolist() for i, R in by.items()} for k, by in results["mats"].items()},
        **results["summaries"],
        "value": m["value"],
        "register_model": params.register.model,
        "quantize": _read_json(root / QUANTIZE_JSON),
        "moe": _read_json(root / MOE_JSON),
        "figures": {
            name: (root / path).read_bytes()
            for name, path in (
                ("merge", MERGE / "accuracy.png"),
                ("quantize", QUANTIZE / "quantize.png"),
                ("moe", MOE_QUANTIZE / "moe.png"),
                ("moe_curve", MOE_BUILD / "curve.png"),
            )
            if (root / path).is_file()
        },
        "meta": {
            "git_commit": git_commit(root),
            "params": {"evaluate": params.evaluate.model_dump()},
            "n_test": m["n_test"],
            "n_probe": m["n_probe"],
        },
    }


def write_outputs(root: Path, results: dict, report: dict) -> None:
    with AtomicOutputs() as atomic:
        atomic.json(results["metrics"], root / EVALUATE_JSON)
        atomic.json(results["variants"], root / METRICS / "variants.json")
        atomic.parquet(results["predictions"], root / PREDICTIONS)
        atomic.bytes(_csv(results["summary"]), root / REPORTS / "plots" / "summary.csv")
        atomic.bytes(_csv(results["curves"]), root / REPORTS / "plots" / "curves.csv")
        atomic.bytes(_csv(pd.DataFrame(results["matrix_rows"])), root / REPORTS / "plots" / "matrix.csv")
        atomic.bytes(_csv(results["summaries"]["curation"]), root / REPORTS / "plots" / "curation.csv")
        for name, content in sorted(report.items()):
            atomic.bytes(content, root / REPORTS / name)
    for stale in (root / REPORTS / "figures").glob("*.png"):  # a figure this report no longer has
        if f"figures/{stale.name}" not in report:
            stale.unlink()


def _flat(results: dict) -> dict:
    flat = {
        f"{m.replace('+', ':')}.{iface}.{k}": v
        for m, by in results["table"].items()
        for iface, d in by.items()
        for k, v in d.items()
        if v == v
    }
    m = results["metrics"]
    flat.update({f"deployable.{k}.mean_accuracy": d["mean_accuracy"] for k, d in m["deployable"].items()})
    for name, by in m["value"]["comparisons"].items():
        mean = by["mean"]
        flat.update(
            {
                f"value.{name}.diff": mean["diff"],
                f"value.{name}.ci_low": mean["ci_low"],
                f"value.{name}.ci_high": mean["ci_high"],
            }
        )
    for kind, v in m["value"]["normalised"].items():
        flat.update({f"value.normalised.{kind}.{k}": x for k, x in (v or {}).items()})
    return flat


def log_results(log, root: Path, results: dict) -> None:
    flat = _flat(results)
    for handle in (log, log.parent() if hasattr(log, "parent") else None):
        if handle is None:
            continue
        handle.log_metrics(flat if handle is log else {f"evaluate.{k}": v for k, v in flat.items()})
        handle.log_artifact(root / REPORTS / "index.html", "report")
        handle.log_artifacts(root / REPORTS / "figures", "report/figures")
        handle.log_artifact(root / EVALUATE_JSON, "report")


def headline(results: dict) -> dict:
    m, table = results["metrics"], results["table"]
    main, ifaces = m["main"], m["interfaces"]
    out = {f"{main}.{iface}.acc": table[main][iface]["acc"] for iface in ifaces}
    out.update(
        {f"{main}.{i}.bwt": table[main][i]["bwt"] for i in ifaces if table[main][i]["bwt"] == table[main][i]["bwt"]}
    )
    out.update({f"deployable.{k}.mean_accuracy": d["mean_accuracy"] for k, d in m["deployable"].items()})
    return out
