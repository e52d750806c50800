"""Stage `moe_quantize` (once; on when moe.enabled): the MoE of moe_build in MXFP4, compensated,
and trained with limited routing replay (docs/methods.md, moe; crucible.moe.variants).

    crucible stage moe_quantize

Reads the Qwen2-MoE checkpoint in models/moe/build/ (offline) and compares, on the held-out
sequences (tasks/data/moe_text.py), at one total adapter rank (`moe.rank_budget`; null = 8 per matrix):
- float: the MoE as built; mxfp4: every expert's slices of the fused 3-D expert parameters (and
  q/k/v/o with `moe.attention`) in MXFP4, the router in float;
- uniform: + low-rank compensation, the same rank for every matrix;
- load_aware: + compensation with ranks from allocate_ranks weighted by each expert's measured
  load (attention matrices load 1), the same total;
- load_aware_prop: the same with propagation-aware loads (routed share x the mean squared gradient
  of the next-token loss w.r.t. the matrix's output, crucible.moe.sensitivity), the same total;
- qat: the compensated variant with the lowest calibration KL to the float MoE + routing replay
  QAT: the float MoE's calibration routes replayed, router and
  MXFP4 codes frozen, only the expert adapters trained to match the float MoE's next-token
  distributions (`moe.qat_loss`: kl, or hidden-state MSE) for `moe.qat_steps` steps (resumable from
  .crucible/checkpoints/moe_quantize/ after a kill).
Each is scored without replay (it routes by itself): perplexity, routing consistency per layer
against the float MoE's routes on the same tokens (share of tokens with the same top-k set, top-1
agreement), hidden-state drift per layer, bytes and bits per weight.

Outputs (published together):
- models/moe/quantize/model.safetensors: the qat model (its start without QAT), packed MXFP4 +
  adapters (crucible.moe.mx_storage.save_quantized_moe; loads onto the build's architecture);
- models/moe/quantize/{consistency,drift,ranks}.csv and moe.png: per layer consistency and drift
  of every variant, and every matrix's rank (uniform, load-aware, propagation-aware) against its expert's load;
- metrics/moe.json (DVC metrics; the report's MoE section): the figures above, the build's
  dense and float perplexity, the allocation, the QAT loss curve. Timings go to MLflow only.
With moe.enabled false only metrics/moe.json (saying so) and a note in models/moe/quantize/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from tasks.runtime.declaration import StageSpec
from tasks.runtime.device import current
from tasks.runtime.io import AtomicOutputs, figure_png
from tasks.runtime.params_schema import Params
from tasks.runtime.paths import MOE_BUILD, MOE_JSON, MOE_QUANTIZE

FILES = ("model.safetensors", "consistency.csv", "drift.csv", "ranks.csv", "moe.png")

SPEC = StageSpec(
    name="moe_quantize",
    per_task=False,
    switch="moe.enabled",
    comment="The MoE in MXFP4 with uniform and load-aware compensation and routing replay QAT.",
    deps=(str(MOE_BUILD),),
    params=("pipeline.seed", "moe"),
    outs=(str(MOE_QUANTIZE),),
    metrics=(str(MOE_JSON),),
)


def checkpoint_dir(root: Path) -> Path:
    return Path(root) / ".crucible" / "checkpoints" / "moe_quantize"


def run(params: Params, task: str | None, root: Path, log) -> dict:
    """Read the built MoE, quantize it in every variant (crucible.moe.variants), write, log. Off
    (moe.enabled false): a note saying so."""
    root = Path(root)
    build = read_build(root)
    if not params.moe.enabled:
        note = {"enabled": False, "note": "moe.enabled is false: the MoE branch did not run"}
        with AtomicOutputs() as out:
            _replace(root / MOE_QUANTIZE, out, {"disabled.json": (json.dumps(note, indent=2) + "\n").encode()})
            out.json(note, root / MOE_JSON)
        return {"moe_enabled": 0}
    if not build.get("enabled"):
        raise ValueError(
            f"{root / MOE_BUILD / 'build.json'}: built with moe.enabled false; rerun moe_build (dvc repro moe_build)"
        )
    moe, tokenizer = load_moe(root / MOE_BUILD)
    result, budget = quantize(params, root, moe, tokenizer, log)
    metrics = write_outputs(root, build, result, budget)
    return log_results(log, metrics, result)


def read_build(root: Path) -> dict:
    build_json = root / MOE_BUILD / "build.json"
    if not build_json.is_file():
        raise FileNotFoundError(f"{build_json}: missing; run the moe_build stage first (crucible stage moe_build)")
    try:
        return json.loads(build_json.read_text())
    except ValueError as exc:
        raise ValueError(f"{build_json}: not valid JSON ({exc}); rerun moe_build") from None


def load_moe(folder: Path):
    """(the built MoE on the run's device, in eval mode, its tokenizer); an error names the folder when
    it holds no MoE layers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from crucible.moe.dense import tie_embeddings

    moe = tie_embeddings(
        AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    ).eval()
    moe = moe.to(current().device)  # calibration, the variants and replay QAT run where the model is
    if not hasattr(moe.model.layers[0].mlp, "experts"):
        raise ValueError(f"{folder}: {type(moe).__name__} has no MoE layers (mlp.experts); rebuild with moe_build")
    return moe, AutoTokenizer.from_pretrained(folder, local_files_only=True)


def quantize(params: Params, root: Path, moe, tokenizer, log):
    """(crucible.moe.variants' result, the rank budget): every MXFP4 variant on the calibration
    sequences, scored on the held-out ones; replay QAT checkpointed for resume."""
    from crucible.moe.variants import default_rank_budget, quantize_variants
    from tasks.data.moe_text import sequences

    p = params.moe
    seqs = sequences(tokenizer, p, params.pipeline.seed, parts=("calib", "eval"))
    budget = p.rank_budget if p.rank_budget is not None else default_rank_budget(moe, p.attention)
    result = quantize_variants(
        moe,
        seqs["calib"],
        seqs["eval"],
        rank_budget=budget,
        attention=p.attention,
        qat_steps=p.qat_steps,
        qat_lr=p.qat_lr,
        qat_loss=p.qat_loss,
        seed=params.pipeline.seed,
        batch_size=p.batch_size,
        mode=p.mode,
        progress=True,
        checkpoint_dir=checkpoint_dir(root),
        checkpoint_every=max(1, p.qat_steps // 4) if p.qat_steps else 0,
        log=lambda m, step: log.log_metrics({f"qat_{k}": v for k, v in m.items()}, step=step),
    )
    return result, budget


def write_outputs(root: Path, build: dict, result, budget: int) -> dict:
    """The quantized MoE, its tables and figure, and metrics/moe.json, published together; the QAT
    checkpoints go. Returns the metrics."""
    import shutil

    from crucible.moe.mx_storage import save_quantized_moe
    from tasks.report.moe_plots import figure

    metrics = {k: v for k, v in result.metrics.items() if k != "seconds"}
    metrics.update(
        enabled=True,
        rank_budget=budget,
        source=build.get("source"),
        perplexity={
            "dense": build["perplexity"]["dense"],
            **{name: v["perplexity"] for name, v in result.metrics["variants"].items()},
        },
    )
    tables = frames(result.metrics)
    files = {
        "model.safetensors": save_quantized_moe(result.model, metadata={"source": str(build.get("source"))}),
        "consistency.csv": tables["consistency"].to_csv(index=False).encode(),
        "drift.csv": tables["drift"].to_csv(index=False).encode(),
        "ranks.csv": tables["ranks"].to_csv(index=False).encode(),
        "moe.png": figure_png(figure(tables, metrics)),
    }
    with AtomicOutputs() as out:
        _replace(root / MOE_QUANTIZE, out, files)
        out.json(metrics, root / MOE_JSON)
    shutil.rmtree(checkpoint_dir(root), ignore_errors=True)
    return metrics


def log_results(log, metrics: dict, result) -> dict:
    flat = {f"perplexity_{k}": v for k, v in metrics["perplexity"].items()}
    flat.update(
        {
            f"consistency_{k}": v["consistency_mean"]["set"]
            for k, v in metrics["variants"].items()
            if "consistency_mean" in v
        }
    )
    seconds = {
        "seconds_" + re.sub(r"[^A-Za-z0-9_]+", "_", k).strip("_"): v for k, v in result.metrics["seconds"].items()
    }
    log.log_metrics({**flat, **seconds})
    return flat


def frames(m: dict) -> dict[str, pd.DataFrame]:
    """consistency (variant, layer, set, top1), drift (variant, layer, drift) and ranks (one row per
    compensated matrix) from quantize_variants' metrics."""
    cons, drift = [], []
    for name, v in m["variants"].items():
        for layer, c in (v.get("consistency") or {}).items():
            cons.append({"variant": name, "layer": _layer(layer), "set": c["set"], "top1": c["top1"]})
        for layer, d in (v.get("drift") or {}).items():
            drift.append({"variant": name, "layer": _layer(layer), "drift": d})
    ranks = pd.DataFrame(m["ranks"]["matrices"])
    return {
        "consistency": pd.DataFrame(cons, columns=["variant", "layer", "set", "top1"]),
        "drift": pd.DataFrame(drift, columns=["variant", "layer", "drift"]),
        "ranks": ranks,
    }


def _layer(name) -> int:
    found = re.findall(r"\d+", str(name))
    return int(found[0]) if found else -1


def _replace(folder: Path, out: AtomicOutputs, files: dict[str, bytes]) -> None:
    """Stage `files` into `folder`; files of an earlier run that this one does not write go once the
    new ones are published."""
    for name, data in files.items():
        out.bytes(data, folder / name)
    stale = (
        [f for f in folder.iterdir() if f.is_file() and not f.name.startswith(".") and f.name not in files]
        if folder.is_dir()
        else []
    )
    out.publish()
    for f in stale:
        f.unlink(missing_ok=True)
