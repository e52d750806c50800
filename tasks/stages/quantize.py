"""Stage `quantize` (once): the merged encoder's linear layers in MXFP4, with low-rank compensation
of the quantization error under one total rank budget (docs/methods.md, quantize; crucible.quant).

    crucible stage quantize

Reads models/merge/ (model.safetensors: the merged encoder; heads.safetensors and config.json:
every task's head, classes and max_length), data/<task>/reference.parquet (calibration texts: the
first `quantize.calibration_per_task` rows per task) and data/<task>/test.parquet (scoring).

1. Calibration: the float merged encoder runs over the calibration texts; hooks on every layer that
   `quantize.modules` selects accumulate per-feature E|x| and E[x^2] of its inputs (padding
   excluded), and with `quantize.load: sensitivity` the mean squared gradient of each task's
   cross-entropy (its head, its reference labels) with respect to each layer's output.
2. Per layer: W -> MXFP4 (`quantize.mode`), E = W - dequant(Q(W)), one SVD of E diag(s)
   (`quantize.scaling`), computed once for the spectra and every adapter.
3. Ranks: round(`quantize.rank_per_matrix` x the number of matrices) units over all matrices
   (MiniLM: 8 x 36 = 288), uniform and load-aware; the model written
   is the `quantize.allocation` one.
4. Scored on each task's first `merge.eval_limit` test rows (the continual matrices' rows) with its
   head, the written variant on every test row too: float, MXFP4 alone,
   MXFP4 + uniform ranks, MXFP4 + load-aware ranks.

Outputs (all published together) under models/quantize/:
- model.safetensors: the quantized encoder (packed MXFP4 codes and E8M0 scales, adapters, biases;
  the other tensors in float32: LayerNorms, and the embeddings unless `quantize.embeddings` puts
  them in MXFP4 too); `load_quantized_encoder` rebuilds it
  without the float weights;
- heads.safetensors: the task heads the quantized encoder is deployed with: the merge stage's, or
  refitted on the quantized encoder's features of each task's training reference rows where that is
  more accurate on the dev rows (`quantize.refit_heads`, tasks.data.head_refit);
- config.json: base model, quantized layers with their ranks, mode, scaling, allocation, classes,
  max_length per task;
- features.safetensors: the frozen features of the three MXFP4 variants on every task's test and
  probe rows (`evaluate.probe_rows`), for the evaluate stage (tasks.data.heldout_scoring.FeatureStore);
- quantize.json: sizes and bits per weight, accuracy per task of every variant, the share of the
  MXFP4 loss the compensation recovers, weighted compression errors, ranks (a DVC metric);
- ranks.csv: per matrix its shape, load, uniform and load-aware rank, spectrum energy kept;
- accuracy.csv: variant, task, accuracy;
- quantize.png: ranks per layer (uniform vs load-aware) and the accuracy change of each variant.
"""

from __future__ import annotations

import copy
import gc
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from tasks.data.models import base_model, read_model_folder, resolve_model
from tasks.runtime.declaration import Plot, StageSpec
from tasks.runtime.device import runtime_config
from tasks.runtime.io import AtomicOutputs, figure_png, read_table, rebuild_hint
from tasks.runtime.params_schema import Params
from tasks.runtime.paths import BASE_MANIFEST, MERGE, METRICS, QUANTIZE, QUANTIZE_JSON

VARIANTS = ("float", "mxfp4", "mxfp4_uniform", "mxfp4_load_aware")


SPEC = StageSpec(
    name="quantize",
    per_task=False,
    comment="Once: the merged encoder in MXFP4 with low-rank compensation; calibration texts from the "
    "tasks' reference sets, scoring on their test splits.",
    deps=(
        str(BASE_MANIFEST),
        *(str(MERGE / n) for n in ("model.safetensors", "heads.safetensors", "config.json")),
        "data/{task}/reference.parquet",
        "data/{task}/test.parquet",
        "data/{task}/labeled.parquet",
    ),
    params=(
        "pipeline.seed",
        "pipeline.tasks",
        "model",
        "merge.order",
        "merge.eval_limit",
        "quantize",
        "evaluate.probe_rows",
        "evaluate.probe_limit",
    ),
    outs=tuple(
        str(QUANTIZE / n) for n in ("model.safetensors", "heads.safetensors", "config.json", "features.safetensors")
    ),
    metrics=(str(QUANTIZE_JSON),),
    plots=(
        Plot(str(METRICS / "quantize_ranks.csv"), x="matrix", y="rank_load_aware"),
        Plot(str(METRICS / "quantize_accuracy.csv"), x="accuracy", y="variant", template="bar_horizontal"),
        Plot(str(QUANTIZE / "quantize.png")),
    ),
)


# ---------------------------------------------------------------------------------------------------
# reading the merge stage's model


def read_merged(root: Path, base_model: str, base_hash: str | None = None) -> dict:
    """The merge stage's outputs: encoder state, heads, classes, max_length; each error names the
    file (and the tensor) and how to rebuild it."""
    from tasks.runtime.io import read_safetensors

    paths, config = read_model_folder(
        root / MERGE,
        ("model.safetensors", "heads.safetensors", "config.json"),
        base_model,
        base_hash,
        rebuild_hint("merge"),
        "the quantize stage reads the merged model",
    )
    classes, max_length = config.get("classes") or {}, config.get("max_length") or {}
    # the encoder's names and shapes are checked against model.name's architecture when it loads
    state, _ = read_safetensors(paths["model.safetensors"], "merged encoder", rebuild_hint("merge"))
    tensors, _ = read_safetensors(
        paths["heads.safetensors"],
        "task heads",
        rebuild_hint("merge"),
        shapes={
            f"{t}.{k}": shape
            for t, cls in classes.items()
            for k, shape in (("weight", (len(cls), None)), ("bias", (len(cls),)))
        },
    )
    heads = {t: {"weight": tensors[f"{t}.weight"], "bias": tensors[f"{t}.bias"]} for t in classes}
    return {
        "state": state,
        "heads": heads,
        "classes": classes,
        "max_length": max_length,
        "config": config,
        "paths": paths,
    }


def load_quantized_encoder(folder: Path | str, base_model: str | None = None):
    """(encoder, tokenizer) from a models/quantize/ folder: crucible.quant.load_quantized_encoder
    (the registered pyfunc's loader too) with the architecture of `base_model` (default: the one
    its config.json names); no float weights are read."""
    from crucible.quant import load_quantized_encoder as load

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    return load(folder / "model.safetensors", resolve_model(base_model or config["base_model"]))


# ---------------------------------------------------------------------------------------------------
# the stage


def calibration_batches(
    root: Path,
    params: Params,
    tokenizer,
    classes: dict,
    max_length: dict,
    batch_size: int = 32,
    seed: int | None = None,
) -> list[tuple]:
    """(input_ids, attention_mask, task, labels) batches of calibration_per_task reference texts
    per task: the first rows (the stage), or a seeded random draw of them (`seed`, for benchmarks).
    Each batch holds one task's texts, so its head and labels can give a loss (load: sensitivity)."""
    import torch

    from crucible.train import collate, tokenize

    out = []
    for t in params.merge_order():
        path = root / "data" / t / "reference.parquet"
        ref = read_table(path, "reference")
        n = params.quantize.calibration_per_task
        rows = ref.head(n) if seed is None else ref.sample(n=min(n, len(ref)), random_state=seed)
        index = {c: i for i, c in enumerate(classes[t])}
        unknown = sorted(set(rows["label"]) - set(index))
        if unknown:
            raise ValueError(
                f"{path}: column 'label' has {unknown[:3]}, not among the merged head's classes {classes[t]}"
            )
        ids = tokenize(tokenizer, rows["text"].tolist(), int(max_length.get(t, 64)))
        labels = rows["label"].map(index).tolist()
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # little padding per batch
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            input_ids, mask = collate([ids[j] for j in idx], tokenizer.pad_token_id or 0)
            out.append((input_ids, mask, t, torch.tensor([labels[j] for j in idx])))
    return out


def calibrate(scorer, linears: dict, batches: list[tuple], sensitivity: bool) -> tuple[dict, dict | None]:
    """Per-layer input statistics of the scorer's (float) encoder over the calibration batches and,
    if asked, each layer's output sensitivity to its task's cross-entropy (through the task head)."""
    import torch

    from crucible.quant import collect_input_stats
    from crucible.quant.compensate import collect_output_sensitivity

    encoder = scorer.encoder
    stats = collect_input_stats(
        encoder, linears, batches, forward=lambda m, b: m(input_ids=b[0], attention_mask=b[1]), masks=lambda b: b[1]
    )
    if not sensitivity:
        return stats, None

    from crucible.models import encode

    def loss(m, b):
        pooled = encode(m, b[0], b[1], scorer.pooling).float()
        return torch.nn.functional.cross_entropy(scorer.head_logits(b[2], pooled), b[3])

    return stats, collect_output_sensitivity(encoder, linears, batches, loss, masks=lambda b: b[1])


def run(params: Params, task: str | None, root: Path, log) -> dict:
    """Read the merged model, calibrate and plan the compensation, build and score each MXFP4 variant,
    refit the deployed heads, write, log."""
    import torch

    # scoped, not torch.set_grad_enabled: under the flow, stages share worker threads
    with torch.no_grad():
        inputs = read_inputs(params, Path(root))
        plan = plan_compensation(params, Path(root), inputs)
        scored = score_variants(params, inputs, plan)
        heads = deploy_heads(params, Path(root), inputs, scored)
        metrics = write_outputs(params, Path(root), inputs, plan, scored, heads)
    return log_results(log, Path(root), metrics)


def read_inputs(params: Params, root: Path) -> dict:
    """The base model, the merged model (loaded into a scorer of every task's test and probe rows) and
    an empty feature store."""
    from tasks.data.heldout_scoring import FeatureStore, Scorer, read_probe_rows, read_tests

    base = base_model(params, root)
    merged = read_merged(root, base.name, base.hash)
    order = params.merge_order()
    missing = [t for t in order if t not in merged["classes"]]
    if missing:
        raise ValueError(
            f"{merged['paths']['config.json']}: no head for tasks {missing} of pipeline.tasks; {rebuild_hint('merge')}"
        )
    specs = [
        {
            "task": t,
            "head": merged["heads"][t],
            "classes": merged["classes"][t],
            "max_length": int(merged["max_length"].get(t, 64)),
        }
        for t in order
    ]
    # no copy of the base weights kept (keep_theta_0=False): the merged weights replace them in place
    scorer = Scorer(
        base,
        specs,
        read_tests(root, params),
        params.quantize.eval_batch_size,
        probes=read_probe_rows(root, params),
        keep_theta_0=False,
    )
    try:
        scorer.load(merged["state"])
    except RuntimeError as exc:
        raise ValueError(
            f"{merged['paths']['model.safetensors']}: does not fit the architecture of model.name "
            f"{base.name!r}: {str(exc)[:400]}; {rebuild_hint('merge')}"
        ) from None
    del merged["state"]  # loaded into the scorer's encoder: no second copy
    return {
        "base": base,
        "merged": merged,
        "order": order,
        "scorer": scorer,
        "store": FeatureStore(scorer),
        "float_encoder": scorer.encoder,
    }


def plan_compensation(params: Params, root: Path, inputs: dict) -> dict:
    """The matrices and embeddings to quantize, their calibration statistics, the error SVDs and the
    rank of every matrix under the budget, uniform and load-aware."""
    import torch

    from crucible.models import resolve_embeddings, resolve_modules
    from crucible.progress import Progress
    from crucible.quant import CompensationPlan, select_linears
    from crucible.quant.linear import select_modules

    cfg, encoder, merged, scorer = params.quantize, inputs["float_encoder"], inputs["merged"], inputs["scorer"]
    try:
        modules = resolve_modules(encoder, cfg.modules)
        linears = select_linears(encoder, modules)
    except ValueError as exc:
        raise ValueError(f"quantize.modules: {exc}") from None
    embeddings = None
    if cfg.embeddings:
        try:
            embeddings = resolve_embeddings(encoder, cfg.embeddings)
            select_modules(encoder, embeddings, torch.nn.Embedding, "embedding")
        except ValueError as exc:
            raise ValueError(f"quantize.embeddings: {exc}") from None
    rank_budget = params.rank_budget(len(linears))
    total_rank = sum(min(m.weight.shape) for m in linears.values())
    if rank_budget > total_rank:
        raise ValueError(
            f"quantize.rank_per_matrix = {cfg.rank_per_matrix:g} gives a budget of {rank_budget}, over the "
            f"total rank {total_rank} of the {len(linears)} matrices that quantize.modules selects"
        )
    batches = calibration_batches(root, params, scorer.tokenizer, merged["classes"], merged["max_length"])
    stats, sensitivity = calibrate(scorer, linears, batches, cfg.load == "sensitivity")
    bar = Progress(total=len(linears), desc="quantize: error SVDs", unit="matrix")
    plan = CompensationPlan.build(
        linears, stats, cfg.mode, cfg.scaling, cfg.load, progress=lambda _: bar.update(), sensitivity=sensitivity
    )
    bar.close()
    ranks = {a: plan.ranks(rank_budget, a) for a in ("uniform", "load_aware")}
    return {
        "modules": modules,
        "linears": linears,
        "embeddings": embeddings,
        "rank_budget": rank_budget,
        "plan": plan,
        "ranks": ranks,
        "zero": {n: 0 for n in linears},
    }


def quantized_copy(params: Params, encoder, plan: dict, ranks: dict):
    """A copy of the float encoder in MXFP4 with the adapters of `ranks` (and its embeddings, where
    quantize.embeddings asks), dequantized once for scoring."""
    from crucible.quant import cache_dequantized, quantize_model
    from crucible.quant.linear import quantize_embeddings

    cfg = params.quantize
    enc = copy.deepcopy(encoder)
    quantize_model(enc, plan["modules"], cfg.mode, plan["plan"].adapters(ranks), cfg.adapter_dtype)
    cache_dequantized(enc)  # scoring: dequantize each matrix once, not once per batch
    if plan["embeddings"]:
        try:
            quantize_embeddings(enc, plan["embeddings"], cfg.mode)
        except ValueError as exc:
            raise ValueError(f"quantize.embeddings: {exc}") from None
    return enc


def score_variants(params: Params, inputs: dict, plan: dict) -> dict:
    """The float model and each MXFP4 variant on the continual matrices' rows (the first
    merge.eval_limit), the written one on every test row too (the value comparisons); the written one
    serialised. One quantized copy at a time beside the float encoder: built, scored, dropped."""
    from crucible.progress import Progress
    from crucible.quant import save_quantized
    from crucible.quant.linear import MXEmbedding, mx_layers

    cfg, order, scorer, store = params.quantize, inputs["order"], inputs["scorer"], inputs["store"]
    float_encoder, limit, ranks = inputs["float_encoder"], params.merge.eval_limit, plan["ranks"]
    accuracy, written = {}, {}
    variants = [
        ("float", None),
        ("mxfp4", plan["zero"]),
        ("mxfp4_uniform", ranks["uniform"]),
        ("mxfp4_load_aware", ranks["load_aware"]),
    ]
    for variant, r in Progress(variants, desc="quantize: scoring", unit="variant"):
        enc = float_encoder if r is None else quantized_copy(params, float_encoder, plan, r)
        scorer.use_encoder(enc)
        if r is None:  # the merge stage keeps the float model's features
            features = {t: scorer.features(t, "test", limit) for t in order}
            accuracy[variant] = {t: scorer.accuracy(t, scorer.head_logits(t, x)) for t, x in features.items()}
        else:
            deployed = variant == f"mxfp4_{cfg.allocation}"
            store.add(f"quantize:{variant}", "quantize", variant, -1, order, test_limit=None if deployed else limit)
            accuracy[variant] = {t: store.accuracy(f"quantize:{variant}", t, limit) for t in order}
        if variant == f"mxfp4_{cfg.allocation}":
            written = {
                "layer_bytes": [m.nbytes() for m in mx_layers(enc).values()],
                "emb_bytes": sum(m.nbytes() for m in enc.modules() if isinstance(m, MXEmbedding)),
                "data": save_quantized(
                    enc, metadata={"base_model": inputs["base"].name, "method": "mxfp4", "order": json.dumps(order)}
                ),
            }
        scorer.use_encoder(float_encoder)
        if r is not None:
            del enc
            gc.collect()
    return {"accuracy": accuracy, **written}


def deploy_heads(params: Params, root: Path, inputs: dict, scored: dict) -> dict:
    """The heads the written model is deployed with (refitted on its features where that wins on the
    dev rows, tasks.data.head_refit) and its accuracy through them on every test row."""
    import torch

    from tasks.data.head_refit import dev_ids, refit_heads
    from tasks.data.heldout_scoring import probe_ids

    order, merged, store, scorer = inputs["order"], inputs["merged"], inputs["store"], inputs["scorer"]
    variant = f"quantize:mxfp4_{params.quantize.allocation}"
    deploy, refit = refit_heads(
        store,
        variant,
        {t: (merged["heads"][t]["weight"], merged["heads"][t]["bias"]) for t in order},
        probe_ids(scorer),
        dev_ids(root, order),
        params.quantize.refit_heads,
        params.pipeline.seed,
    )
    accuracy = {
        t: scorer.accuracy(t, torch.nn.functional.linear(store.tensors[f"{variant}/{t}/test"], w, b))
        for t, (w, b) in deploy.items()
    }
    heads = {f"{t}.{k}": v.contiguous() for t, (w, b) in deploy.items() for k, v in (("weight", w), ("bias", b))}
    return {"heads": heads, "refit": refit, "accuracy": accuracy}


def summary_metrics(params: Params, inputs: dict, plan: dict, scored: dict, heads: dict) -> dict:
    """quantize.json: sizes and bits per weight, the accuracy of every variant, the share of the MXFP4
    loss the compensation recovers, the weighted errors, the refit and the deployed accuracy."""
    import torch

    cfg, linears, ranks, p = params.quantize, plan["linears"], plan["ranks"], plan["plan"]
    accuracy = scored["accuracy"]
    itemsize = torch.empty((), dtype=getattr(torch, cfg.adapter_dtype)).element_size()
    n_weights = sum(m.weight.numel() for m in linears.values())
    mx_bytes = sum(b["packed"] + b["scales"] for b in scored["layer_bytes"])
    adapter_bytes = sum(b["adapter"] for b in scored["layer_bytes"])
    float_bytes = inputs["merged"]["paths"]["model.safetensors"].stat().st_size
    mean = {v: float(np.mean(list(a.values()))) for v, a in accuracy.items()}
    lost = mean["float"] - mean["mxfp4"]
    err0 = p.weighted_error(plan["zero"])
    weighted = {
        "mxfp4": err0,
        "uniform": p.weighted_error(ranks["uniform"]),
        "load_aware": p.weighted_error(ranks["load_aware"]),
    }
    return _rounded(
        {
            "mode": cfg.mode,
            "scaling": cfg.scaling,
            "allocation": cfg.allocation,
            "load": cfg.load,
            "matrices": len(linears),
            "quantized_weights": n_weights,
            "rank_budget": plan["rank_budget"],
            "total_rank": p.total_rank,
            "bits_per_weight": 8 * mx_bytes / n_weights,
            "bits_per_weight_all_in": 8 * (mx_bytes + adapter_bytes) / n_weights,
            "quantized_matrices_mb": {
                "float32": 4 * n_weights / 2**20,
                "mxfp4": mx_bytes / 2**20,
                "adapters": adapter_bytes / 2**20,
            },
            "model_mb": {"float": float_bytes / 2**20, "quantized": len(scored["data"]) / 2**20},
            "embeddings_mxfp4_mb": scored["emb_bytes"] / 2**20,
            "accuracy": accuracy,
            "mean_accuracy": mean,
            "accuracy_lost_by_mxfp4": lost,
            "recovered_share": {
                a: (mean[f"mxfp4_{a}"] - mean["mxfp4"]) / lost if lost > 0 else None for a in ("uniform", "load_aware")
            },
            "weighted_error": weighted,
            "adapter_mb": {a: p.adapter_bytes(r, itemsize) / 2**20 for a, r in ranks.items()},
            "refit": heads["refit"],
            "deployed_accuracy": heads["accuracy"],  # the written model with the written heads
            "ranks": ranks[cfg.allocation],
            "relative_weighted_error": {k: v / err0 if err0 > 0 else 0.0 for k, v in weighted.items()},
        }
    )


def write_outputs(params: Params, root: Path, inputs: dict, plan: dict, scored: dict, heads: dict) -> dict:
    """The packed model, its heads, its config, the features, quantize.json, the rank and accuracy
    tables and the figure, published together. Returns quantize.json's metrics."""
    from crucible.serialize import safetensors_bytes

    cfg, ranks, merged, order = params.quantize, plan["ranks"], inputs["merged"], inputs["order"]
    metrics = summary_metrics(params, inputs, plan, scored, heads)
    rank_rows = _rounded(
        [
            {
                "matrix": n,
                "layer": _layer_index(n),
                "out": layer.shape[0],
                "in": layer.shape[1],
                "load": layer.load,
                "rank_uniform": ranks["uniform"][n],
                "rank_load_aware": ranks["load_aware"][n],
                "energy_kept_uniform": _energy_kept(layer.spectrum, ranks["uniform"][n]),
                "energy_kept_load_aware": _energy_kept(layer.spectrum, ranks["load_aware"][n]),
            }
            for n, layer in plan["plan"].layers.items()
        ]
    )
    accuracy = scored["accuracy"]
    acc_rows = [{"variant": v, "task": t, "accuracy": a} for v, accs in accuracy.items() for t, a in accs.items()]
    config = {
        "base_model": inputs["base"].name,
        "base_model_hash": inputs["base"].hash,
        "pooling": inputs["scorer"].pooling,
        "dtype": inputs["base"].dtype,
        "order": order,
        "modules": plan["modules"],
        "embeddings": plan["embeddings"],
        "mode": cfg.mode,
        "scaling": cfg.scaling,
        "allocation": cfg.allocation,
        "load": cfg.load,
        "rank_budget": plan["rank_budget"],
        "rank_per_matrix": cfg.rank_per_matrix,
        "adapter_dtype": cfg.adapter_dtype,
        "ranks": ranks[cfg.allocation],
        "classes": merged["classes"],
        "max_length": merged["max_length"],
        "merged_from": merged["config"].get("main"),
        "refit": {t: r["refit"] for t, r in heads["refit"].items()},
        "runtime": runtime_config(),
    }
    out = root / QUANTIZE
    with AtomicOutputs() as atomic:
        atomic.bytes(scored["data"], out / "model.safetensors")
        atomic.bytes(
            safetensors_bytes(heads["heads"], {"classes": json.dumps(merged["classes"])}), out / "heads.safetensors"
        )
        atomic.json(config, out / "config.json")
        atomic.bytes(inputs["store"].to_bytes(), out / "features.safetensors")
        atomic.json(metrics, root / QUANTIZE_JSON)
        atomic.bytes(pd.DataFrame(rank_rows).to_csv(index=False).encode(), root / METRICS / "quantize_ranks.csv")
        atomic.bytes(
            pd.DataFrame(acc_rows, columns=["variant", "task", "accuracy"]).to_csv(index=False).encode(),
            root / METRICS / "quantize_accuracy.csv",
        )
        atomic.bytes(plot_quantize(rank_rows, accuracy, order), out / "quantize.png")
    return metrics


def log_results(log, root: Path, metrics: dict) -> dict:
    flat = {
        "bits_per_weight": metrics["bits_per_weight"],
        "bits_per_weight_all_in": metrics["bits_per_weight_all_in"],
        "model_mb": metrics["model_mb"]["quantized"],
        "float_model_mb": metrics["model_mb"]["float"],
        **{f"mean_accuracy.{v}": a for v, a in metrics["mean_accuracy"].items()},
        **{f"relative_weighted_error.{k}": v for k, v in metrics["relative_weighted_error"].items()},
    }
    log.log_metrics(flat)
    log.log_artifact(root / QUANTIZE / "quantize.png")
    log.log_artifact(root / QUANTIZE_JSON)
    return flat


def _rounded(obj, digits: int = 6):
    """Floats to `digits` significant digits, recursively: sums reduced over a different number of
    threads differ in the last bits, and the metrics and plot files should not."""
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v, digits) for v in obj]
    if isinstance(obj, float) and obj == obj and abs(obj) != float("inf"):
        return float(f"{obj:.{digits}g}")
    return obj


def _layer_index(name: str) -> int:
    m = re.search(r"\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _energy_kept(spectrum, r: int) -> float:
    sq = spectrum.double() ** 2
    total = float(sq.sum())
    return float(sq[:r].sum()) / total if total > 0 else 1.0


def plot_quantize(rank_rows: list[dict], accuracy: dict, order: list[str]) -> bytes:
    """PNG: the rank of every matrix (uniform vs load-aware), and each variant's accuracy change
    against the float model per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = pd.DataFrame(rank_rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    x = np.arange(len(df))
    ax1.bar(x - 0.2, df["rank_uniform"], 0.4, label="uniform", color="tab:gray")
    ax1.bar(x + 0.2, df["rank_load_aware"], 0.4, label="load-aware", color="tab:blue")
    short = [
        n.replace("encoder.layer.", "L")
        .replace(".attention.self.", ".")
        .replace(".attention.output.dense", ".attn_out")
        .replace(".intermediate.dense", ".ffn_in")
        .replace(".output.dense", ".ffn_out")
        for n in df["matrix"]
    ]
    ax1.set_xticks(x)
    ax1.set_xticklabels(short, rotation=90, fontsize=6)
    ax1.set_ylabel("adapter rank")
    ax1.set_title("compensation rank per matrix (same total budget)")
    ax1.legend(fontsize=8)
    variants = [v for v in accuracy if v != "float"]
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        delta = [100 * (accuracy[v][t] - accuracy["float"][t]) for t in order]
        ax2.bar(np.arange(len(order)) + (i - (len(variants) - 1) / 2) * width, delta, width, label=v)
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_xticks(np.arange(len(order)))
    ax2.set_xticklabels(order)
    ax2.set_ylabel("test accuracy - float (points)")
    ax2.set_title("accuracy change against the float merged model", fontsize=10)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return figure_png(fig)
