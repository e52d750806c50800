"""Stage `finetune` (per task): the base encoder + a linear head, fine-tuned on the task's labeled
rows with GMixout (docs/methods.md, finetune; crucible.gmixout, crucible.train).

    crucible stage finetune --task bbc

Reads data/<task>/labeled.parquet (id, text, label, source, confidence, weight; the pseudolabel
stage's output) and test.parquet. A stratified, seeded share (`finetune.dev_fraction`) of the
reference-sourced rows is held out as the dev split (early stopping, best checkpoint); the rest
plus the audited members and the pseudo-labels are the training rows, each weighted by its
`weight` (`finetune.weights: ignore` sets them to 1; rows of weight 0 are dropped). Every task starts
from the same base model (`model.name`), so the merge stage can combine them; its content hash
(models/base/manifest.json) is recorded in config.json and merge refuses fine-tunes of another base.

Outputs (all published together):
- data/<task>/finetune/model.safetensors: the fine-tuned encoder's state dict (the base model's
  keys: loads into transformers' AutoModel of `model.name`);
- data/<task>/finetune/head.safetensors: `weight` (n_classes, hidden), `bias`; metadata `classes`;
- data/<task>/finetune/config.json: the resolved config (finetune params, base model, classes,
  max_length, pooling, seed, training sizes, best step);
- metrics/<task>/finetune.json: dev/test accuracy and loss, steps, best step, sizes. No timings: the
  file is a DVC output (its md5 is in dvc.lock and in merge's `data` dependency), so it must not
  change when nothing else does; throughput and train seconds go to the stage's MLflow run.
Checkpoints go to <root>/.crucible/checkpoints/finetune/<task>/, outside `data/` (a killed run
must not change what DVC sees as merge's dependency); a killed run resumes from the latest one
when the resolved config, the training rows and torch's thread count are unchanged (else it
starts over), and they are deleted on success.

Determinism. Every random draw (head init, dropout in the encoder and before the head, GMixout
masks, batch order) comes from a generator of this run seeded from `task_seed(pipeline.seed,
task)` (crucible.train), never from torch's global RNG, so a task's outputs do not depend on what
trains beside it in other threads of the process (the Prefect flow) or ran before it. The outputs
are byte-identical (same md5) when these are the same: the inputs and params, the torch /
transformers / safetensors versions, the CPU (vector kernels are chosen per instruction set), and
torch's intra-op thread count. The thread count is `CRUCIBLE_THREADS` when set (applied by
tasks.runtime.stage.execute); otherwise torch's default (the core count) under `crucible stage` / `dvc
repro`, and cores // pipeline.max_workers under the Prefect flow, so set CRUCIBLE_THREADS for
hashes that agree between the two and across machines. Runs with 1 and 2 threads differ in the
last bits (torch's parallel sums split the work by thread count); runs with the same count agree,
alone or beside other training. The count used is logged as the MLflow param `torch_threads`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from crucible.gmixout import GMixout, GMixoutConfig
from crucible.schema import validate_disjoint, validate_table
from crucible.seeding import derive_seed, numpy_rng, stream_seed
from crucible.train import EncoderClassifier, Examples, TrainConfig, evaluate, tokenize, train
from tasks.data.models import MANIFEST, BaseModel, base_model
from tasks.runtime.declaration import StageSpec
from tasks.runtime.device import current, runtime_config
from tasks.runtime.io import AtomicOutputs, read_stage_output, read_table
from tasks.runtime.params_schema import FinetuneParams, Params

LABELED_COLUMNS = ("id", "text", "label", "source", "confidence", "weight")

SPEC = StageSpec(
    name="finetune",
    per_task=True,
    comment="Per task: the base encoder and a linear head fine-tuned with GMixout on the labeled rows.",
    deps=(str(MANIFEST), "data/{task}/labeled.parquet", "data/{task}/test.parquet"),
    # the chosen method's own options only (finetune.gmixout under method: gmixout): another
    # method's options change nothing here
    params=(
        "pipeline.seed",
        "ingest.allow_shared_ids",
        "model",
        "finetune.method",
        "finetune.${finetune.method}",
        *(f"finetune.{k}" for k in FinetuneParams.common_fields()),
    ),
    outs=("data/{task}/finetune",),
    metrics=("metrics/{task}/finetune.json",),
)


def checkpoint_dir(root: Path | str, task: str) -> Path:
    """Resume state of a task's fine-tune: a scratch folder of the workspace outside `data/` (git-
    and dvc-ignored), so a killed run changes no DVC dependency."""
    return Path(root) / ".crucible" / "checkpoints" / "finetune" / task


def task_seed(seed: int, task: str) -> int:
    """The stage's seed for a task: stable across runs and independent of task order."""
    return derive_seed(seed, task, "finetune")


def read_labeled(path: Path) -> pd.DataFrame:
    """pseudolabel's table, checked: the id/text/label contract, known sources, finite weights >= 0."""
    df = read_stage_output(path, "labeled", LABELED_COLUMNS, "pseudolabel")
    validate_table(df, "reference", source=str(path))
    bad = ~df["source"].isin(["reference", "audit", "pseudo"])
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise ValueError(
            f"{path}, column 'source', row {row}: got {df['source'].iloc[row]!r}; expected reference, audit or pseudo"
        )
    w = df["weight"].to_numpy(dtype=np.float64)
    if not np.all(np.isfinite(w) & (w >= 0)):
        row = int(np.flatnonzero(~(np.isfinite(w) & (w >= 0)))[0])
        raise ValueError(f"{path}, column 'weight', row {row}: got {w[row]!r}; expected a finite number >= 0")
    return df


def split_dev(labeled: pd.DataFrame, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the dev rows: per class, round(fraction x n) (at least 1, leaving at least 1
    for training) of the reference-sourced rows, drawn with `seed`."""
    rng = numpy_rng(seed)
    dev = np.zeros(len(labeled), dtype=bool)
    ref = labeled["source"].to_numpy() == "reference"
    for label in sorted(labeled.loc[ref, "label"].unique()):
        rows = np.flatnonzero(ref & (labeled["label"].to_numpy() == label))
        k = min(max(1, round(fraction * len(rows))), len(rows) - 1)
        dev[rng.choice(rows, size=k, replace=False)] = True
    if not dev.any():
        raise ValueError("finetune: the dev split is empty; the reference needs at least 2 rows of a class")
    return dev


def mixout_config(cfg: FinetuneParams, seed: int, modules: str | None = None) -> GMixoutConfig | None:
    """The method's GMixout config; `modules`: the resolved regex (finetune.modules: auto resolved
    against the model by crucible.models.resolve_modules)."""
    modules = modules or cfg.modules
    if cfg.method == "plain":
        return None
    if cfg.method == "mixout":
        return GMixoutConfig.mixout(p=cfg.mixout.p, modules=modules, seed=seed)
    g = cfg.gmixout
    return GMixoutConfig(
        p=g.p, anchor=g.anchor, ema_beta=g.ema_beta, period=g.period, sparse=g.sparse, modules=modules, seed=seed
    )


def train_config(cfg: FinetuneParams, n_train: int, seed: int, progress: bool = True) -> TrainConfig:
    steps = cfg.max_steps or max(1, round(cfg.epochs * -(-n_train // cfg.batch_size)))
    return TrainConfig(
        lr=cfg.lr,
        head_lr=cfg.head_lr,
        max_steps=steps,
        batch_size=cfg.batch_size,
        warmup=cfg.warmup,
        weight_decay=cfg.weight_decay,
        clip=cfg.clip,
        eval_every=min(cfg.eval_every, steps),
        patience=cfg.patience,
        checkpoint_every=cfg.checkpoint_every,
        seed=seed,
        progress=progress,
    )


def examples(tokenizer, df: pd.DataFrame, classes: list[str], max_length: int, use_weights: bool = True) -> Examples:
    index = {c: i for i, c in enumerate(classes)}
    weights = (
        df["weight"].to_numpy(dtype=np.float32) if use_weights and "weight" in df else np.ones(len(df), np.float32)
    )
    labels = df["label"].map(index).to_numpy(dtype=np.int64, copy=True)
    return Examples(tokenize(tokenizer, df["text"].tolist(), max_length), labels, weights.copy())


def build_model(base: BaseModel, n_classes: int, cfg: FinetuneParams, seed: int):
    """(EncoderClassifier in train mode, tokenizer, GMixout or None); the head's initialisation and
    the mixout masks draw from generators seeded from `seed` (never torch's global one). The model
    is on the run's device (the head is drawn on the CPU, then moved: the same numbers anywhere)."""
    from crucible.models import resolve_modules

    encoder, tokenizer = base.load()
    model = EncoderClassifier(
        encoder, n_classes, dropout=cfg.dropout, seed=stream_seed(seed, "head"), pooling=base.pooling(encoder.config)
    ).to(current().device)
    try:
        modules = resolve_modules(model.encoder, cfg.modules)
    except ValueError as exc:
        raise ValueError(f"finetune.modules: {exc}") from None
    mix = mixout_config(cfg, stream_seed(seed, "mixout"), modules)
    gm = GMixout.wrap(model.encoder, mix) if mix is not None else None
    model.train()
    return model, tokenizer, gm


def run(params: Params, task: str, root: Path, log) -> dict:
    from crucible.serialize import safetensors_bytes

    cfg = params.finetune
    base = Path(root) / "data" / task
    labeled = read_labeled(base / "labeled.parquet")
    test = read_table(base / "test.parquet", "test")
    validate_disjoint(
        {"labeled": labeled, "test": test},  # training rows must not be test rows
        {"labeled": str(base / "labeled.parquet"), "test": str(base / "test.parquet")},
        pairs=(("labeled", "test"),),
        allow_shared_ids=params.ingest.allow_shared_ids,
    )
    seed = task_seed(params.pipeline.seed, task)
    classes = sorted(labeled.loc[labeled["source"] == "reference", "label"].unique())
    unknown = sorted(set(labeled["label"]) - set(classes))
    if unknown:
        raise ValueError(
            f"{base / 'labeled.parquet'}: labels {unknown[:3]} do not occur in the reference rows (classes {classes})"
        )
    dev_mask = split_dev(labeled, cfg.dev_fraction, seed)
    train_df = labeled[~dev_mask & (labeled["weight"].to_numpy() > 0)]
    dev_df = labeled[dev_mask]

    base_info = base_model(params, root)
    model, tokenizer, gm = build_model(base_info, len(classes), cfg, seed)
    max_length = base_info.max_length(tokenizer, model.encoder.config, cfg.max_length)
    use_weights = cfg.weights == "use"
    train_set = examples(tokenizer, train_df, classes, max_length, use_weights)
    dev_set = examples(tokenizer, dev_df, classes, max_length, use_weights=False)
    tcfg = train_config(cfg, len(train_set), seed)
    tcfg = TrainConfig(**{**tcfg.__dict__, "pad_id": tokenizer.pad_token_id or 0, "autocast": current().precision})

    resolved = {
        "task": task,
        "base_model": base_info.name,
        "base_model_hash": base_info.hash,
        "classes": classes,
        "max_length": max_length,
        "pooling": model.pooling,
        "dtype": base_info.dtype,
        "seed": seed,
        "finetune": cfg.resolved(),
        "train": tcfg.__dict__,
        "n_train": len(train_set),
        "n_dev": len(dev_set),
        "runtime": runtime_config(),
    }
    # the thread count too: a run resumed under another count would match no uninterrupted run
    fingerprint = hashlib.md5(
        json.dumps(
            {**resolved, "train_ids": train_df["id"].tolist(), "torch_threads": torch.get_num_threads()},
            sort_keys=True,
            default=str,
        ).encode()
    ).hexdigest()
    ckpt_dir = checkpoint_dir(root, task)
    if (ckpt_dir / "fingerprint").exists() and (ckpt_dir / "fingerprint").read_text() != fingerprint:
        shutil.rmtree(ckpt_dir)  # checkpoints of another config or data: start over
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "fingerprint").write_text(fingerprint)

    def log_curve(metrics: dict, step: int) -> None:
        if "dev_accuracy" in metrics or step % 5 == 0 or step == tcfg.max_steps:
            log.log_metrics(metrics, step)

    log.log_params({"torch_threads": torch.get_num_threads()})
    result = train(
        model, train_set, dev_set, tcfg, mixout=gm, checkpoint_dir=ckpt_dir, log=log_curve, desc=f"finetune@{task}"
    )
    if gm is not None:
        gm.unwrap()
    model.eval()
    test_set = examples(tokenizer, test, classes, max_length, use_weights=False)
    test_eval = evaluate(model, test_set, tcfg.eval_batch_size, tcfg.pad_id, tcfg.autocast_dtype)
    dev_eval = evaluate(model, dev_set, tcfg.eval_batch_size, tcfg.pad_id, tcfg.autocast_dtype)

    resolved["best_step"] = result.best_step
    backbone = {k: v.detach().cpu().contiguous() for k, v in model.encoder.state_dict().items()}
    head = {
        "weight": model.head.weight.detach().cpu().contiguous(),
        "bias": model.head.bias.detach().cpu().contiguous(),
    }
    metrics = {
        "dev_accuracy": dev_eval["accuracy"],
        "dev_loss": dev_eval["loss"],
        "test_accuracy": test_eval["accuracy"],
        "test_loss": test_eval["loss"],
        "steps": result.steps,
        "best_step": result.best_step,
        "stopped_early": int(result.stopped_early),
        "n_train": len(train_set),
        "n_dev": len(dev_set),
        "n_test": len(test_set),
    }
    timing = {
        "examples_per_second": result.examples_per_second,
        "steps_per_second": result.steps_per_second,
        "train_seconds": result.seconds,
    }  # MLflow only: not in the DVC-tracked finetune.json
    out_dir = base / "finetune"
    with AtomicOutputs() as out:
        out.bytes(
            safetensors_bytes(backbone, {"format": "pt", "base_model": base_info.name}), out_dir / "model.safetensors"
        )
        out.bytes(safetensors_bytes(head, {"classes": json.dumps(classes)}), out_dir / "head.safetensors")
        out.json(resolved, out_dir / "config.json")
        out.json(metrics, Path(root) / "metrics" / task / "finetune.json")
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    shutil.rmtree(base / ".finetune-checkpoints", ignore_errors=True)  # where earlier versions kept them
    log.log_artifact(out_dir / "config.json")
    log_model(log, out_dir, base_info.path, test, tokenizer, model.encoder.config)
    return {**metrics, **timing}


def log_model(log, finetune_dir: Path, base_model_dir: str, example: pd.DataFrame, tokenizer=None, config=None) -> None:
    """The task model as an MLflow pyfunc (texts in, labels out) under the run's `model` path,
    logged from code (tasks/registry/pyfunc.py with model_config crucible_model=TextClassifier): no pickle
    is written, and loading it unpickles nothing."""
    import tempfile

    from tasks.registry.pyfunc import save_text_classifier

    with tempfile.TemporaryDirectory() as tmp:
        save_text_classifier(
            Path(tmp) / "model", finetune_dir, base_model_dir, example.head(3), tokenizer=tokenizer, config=config
        )
        log.log_artifacts(Path(tmp) / "model", "model")
