"""Stage `finetune` (per task): the base model + a linear head, fine-tuned on the task's labeled
rows (docs/methods.md, finetune; tasks.data.classifier, crucible.gmixout, crucible.train).

    crucible stage finetune --task bbc

Reads data/<task>/labeled.parquet (id, text, label, source, confidence, weight, split; the
pseudolabel stage's output) and test.parquet. The rows of split `dev` (a stratified, seeded share of
the reference, `pseudolabel.dev_fraction`, never trained on by any stage) are the dev split; the
other rows (reference, audited members, pseudo-labels) train, each weighted by its `weight`
(`finetune.weights: ignore` sets them to 1; rows of weight 0 are dropped).

LP-FT (Kumar et al., ICLR 2022; `finetune.head_init: probe`): the head starts as a logistic-
regression probe (C by cross-validation) on the frozen base model's features of the training
reference rows, then everything is fine-tuned. `finetune.keep: last` keeps the weights after the
last step of a fixed schedule (`epochs`); `best` the step of the best dev accuracy (a few dozen dev
rows choose poorly: docs/results.md has the sweep that set the schedule). Every task starts from
the same base model (`model.name`), so the merge stage can combine them; its content hash
(models/base/manifest.json) is recorded in config.json and merge refuses fine-tunes of another base.

Outputs (all published together):
- data/<task>/finetune/model.safetensors: the fine-tuned encoder's state dict (the base model's
  keys: loads into transformers' AutoModel of `model.name`);
- data/<task>/finetune/head.safetensors: `weight` (n_classes, hidden), `bias`; metadata `classes`;
- data/<task>/finetune/config.json: the resolved config (finetune params, base model, classes,
  max_length, pooling, seed, training sizes, the LP probe's C, best dev step);
- metrics/<task>/finetune.json: dev/test accuracy and loss, the LP probe's dev accuracy, steps,
  sizes. No timings: the file is a DVC output (its md5 is in dvc.lock and in merge's `data`
  dependency), so it must not change when nothing else does; throughput and train seconds go to
  the stage's MLflow run.
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

from crucible.schema import validate_disjoint, validate_table
from crucible.seeding import derive_seed
from crucible.serialize import safetensors_bytes
from crucible.train import evaluate, train
from tasks.data.classifier import examples, prepare, train_config
from tasks.data.models import base_model
from tasks.runtime.declaration import StageSpec
from tasks.runtime.device import runtime_config
from tasks.runtime.io import AtomicOutputs, read_stage_output, read_table
from tasks.runtime.params_schema import FinetuneParams, Params
from tasks.runtime.paths import BASE_MANIFEST

LABELED_COLUMNS = ("id", "text", "label", "source", "confidence", "weight", "split")

SPEC = StageSpec(
    name="finetune",
    per_task=True,
    comment="Per task: the base encoder and a linear head fine-tuned with GMixout on the labeled rows.",
    deps=(str(BASE_MANIFEST), "data/{task}/labeled.parquet", "data/{task}/test.parquet"),
    # the chosen method's own options only (finetune.gmixout under method: gmixout): another
    # method's options change nothing here
    params=(
        "pipeline.seed",
        "ingest.allow_shared_ids",
        "model",
        *FinetuneParams.recipe_keys(),
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
    bad = ~df["split"].isin(["train", "dev"]) | ((df["split"] == "dev") & (df["source"] != "reference"))
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise ValueError(
            f"{path}, column 'split', row {row}: got {df['split'].iloc[row]!r} (source {df['source'].iloc[row]!r}); "
            "expected train, or dev for a reference row"
        )
    if not (df["split"] == "dev").any():
        raise ValueError(f"{path}, column 'split': no dev rows; rerun the pseudolabel stage (dvc repro pseudolabel)")
    return df


def run(params: Params, task: str, root: Path, log) -> dict:
    """Read the labeled rows, fine-tune (LP, then FT), score dev and test, write, log."""
    data = read_inputs(params, task, root)
    seed = task_seed(params.pipeline.seed, task)
    fitted = fit(params, root, task, data, seed, log)
    outputs = write_outputs(root, task, fitted)
    log.log_artifact(outputs / "config.json")
    log_model(log, outputs, fitted["base"].path, data["test"], fitted["tokenizer"], fitted["model"].encoder.config)
    return {**fitted["metrics"], **fitted["timing"]}


def read_inputs(params: Params, task: str, root: Path) -> dict:
    """labeled.parquet and test.parquet, validated (no test row among the training rows); the task's
    classes (the reference's); the training and dev rows."""
    base = Path(root) / "data" / task
    labeled = read_labeled(base / "labeled.parquet")
    test = read_table(base / "test.parquet", "test")
    validate_disjoint(
        {"labeled": labeled, "test": test},  # training rows must not be test rows
        {"labeled": str(base / "labeled.parquet"), "test": str(base / "test.parquet")},
        pairs=(("labeled", "test"),),
        allow_shared_ids=params.ingest.allow_shared_ids,
    )
    classes = sorted(labeled.loc[labeled["source"] == "reference", "label"].unique())
    unknown = sorted(set(labeled["label"]) - set(classes))
    if unknown:
        raise ValueError(
            f"{base / 'labeled.parquet'}: labels {unknown[:3]} do not occur in the reference rows (classes {classes})"
        )
    dev = labeled["split"].to_numpy() == "dev"
    train_df = labeled[~dev & (labeled["weight"].to_numpy() > 0)]
    return {
        "classes": classes,
        "train": train_df,
        "dev": labeled[dev],
        "test": test,
        "probe": train_df[train_df["source"] == "reference"],
    }


def fit(params: Params, root: Path, task: str, data: dict, seed: int, log) -> dict:
    """The classifier trained on the training rows (tasks.data.classifier), scored on dev and test."""
    cfg = params.finetune
    base_info = base_model(params, root)
    model, tokenizer, gm, max_length, lp = prepare(base_info, data["classes"], cfg, seed, data["probe"], cfg.max_length)
    train_set = examples(tokenizer, data["train"], data["classes"], max_length, cfg.weights == "use")
    dev_set = examples(tokenizer, data["dev"], data["classes"], max_length, use_weights=False)
    tcfg = train_config(cfg, len(train_set), seed, pad_id=tokenizer.pad_token_id or 0)
    resolved = {
        "task": task,
        "base_model": base_info.name,
        "base_model_hash": base_info.hash,
        "classes": data["classes"],
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
    lp_dev = None
    if lp is not None:
        resolved["probe_C"] = lp.C
        lp_dev = float(evaluate(model, dev_set, tcfg.eval_batch_size, tcfg.pad_id, tcfg.autocast_dtype)["accuracy"])
    ckpt_dir = fresh_checkpoints(root, task, resolved, data["train"])

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
    test_set = examples(tokenizer, data["test"], data["classes"], max_length, use_weights=False)
    test_eval = evaluate(model, test_set, tcfg.eval_batch_size, tcfg.pad_id, tcfg.autocast_dtype)
    dev_eval = evaluate(model, dev_set, tcfg.eval_batch_size, tcfg.pad_id, tcfg.autocast_dtype)
    resolved["best_step"] = result.best_step
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
        **({"probe_dev_accuracy": lp_dev} if lp_dev is not None else {}),
    }
    timing = {  # MLflow only: not in the DVC-tracked finetune.json
        "examples_per_second": result.examples_per_second,
        "steps_per_second": result.steps_per_second,
        "train_seconds": result.seconds,
    }
    return {
        "model": model,
        "tokenizer": tokenizer,
        "base": base_info,
        "resolved": resolved,
        "metrics": metrics,
        "timing": timing,
        "classes": data["classes"],
        "checkpoints": ckpt_dir,
    }


def fresh_checkpoints(root: Path, task: str, resolved: dict, train_df: pd.DataFrame) -> Path:
    """The task's checkpoint folder, emptied when it holds checkpoints of another config or data."""
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
    return ckpt_dir


def write_outputs(root: Path, task: str, fitted: dict) -> Path:
    """The encoder, the head, the resolved config and the metrics, published together; the
    checkpoints go."""
    model = fitted["model"]
    backbone = {k: v.detach().cpu().contiguous() for k, v in model.encoder.state_dict().items()}
    head = {
        "weight": model.head.weight.detach().cpu().contiguous(),
        "bias": model.head.bias.detach().cpu().contiguous(),
    }
    out_dir = Path(root) / "data" / task / "finetune"
    with AtomicOutputs() as out:
        out.bytes(
            safetensors_bytes(backbone, {"format": "pt", "base_model": fitted["base"].name}),
            out_dir / "model.safetensors",
        )
        out.bytes(safetensors_bytes(head, {"classes": json.dumps(fitted["classes"])}), out_dir / "head.safetensors")
        out.json(fitted["resolved"], out_dir / "config.json")
        out.json(fitted["metrics"], Path(root) / "metrics" / task / "finetune.json")
    shutil.rmtree(fitted["checkpoints"], ignore_errors=True)
    return out_dir


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
