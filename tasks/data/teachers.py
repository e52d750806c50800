"""The pseudolabel stage's teachers (`pseudolabel.teacher`), each fitted on the reference's training
rows, calibrated by temperature scaling on its dev rows, and run over the pool
(docs/methods.md, pseudolabel):

- probe: logistic regression on the base model's frozen embeddings (the embed stage's);
- finetune: self-training (Xie et al. 2020): the base model fine-tuned on the reference by the same
  recipe as the finetune stage (tasks.data.classifier; LP-FT, `pseudolabel.teacher_epochs`), so
  round one's student labels the pool for round two (the finetune stage);
- model: distillation from a larger packaged model (Hinton et al. 2015): a probe on its frozen
  features (`pseudolabel.teacher_model`, e.g. all-mpnet-base-v2) labels the pool, and the student
  learns its labels.

Each returns a `TeacherRun`: the calibrated predictions on the pool, the dev calibration and what
describes the teacher (its kind, sizes, C, seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from crucible import pseudolabel as pl
from crucible.seeding import derive_seed
from tasks.runtime.params_schema import Params
from tasks.runtime.timing import Clock


@dataclass
class TeacherRun:
    pred: pl.Predictions
    calibration: pl.Calibration
    info: dict = field(default_factory=dict)


def teacher_seed(seed: int, task: str) -> int:
    return derive_seed(seed, task, "teacher")


def probe_teacher(ref_x, labels, dev, pool_x, classes, C, seed: int, source: str) -> TeacherRun:
    """A logistic-regression probe on frozen features (ref_x, pool_x)."""
    teacher = pl.fit_teacher(ref_x, labels, dev=dev, classes=classes, C=C, seed=seed, source=source)
    return TeacherRun(pl.predict(teacher, pool_x), teacher.calibration, {"C": teacher.C, "n_fit": teacher.n_fit})


def finetune_teacher(
    params: Params, root, task: str, reference: pd.DataFrame, dev, pool: pd.DataFrame, classes
) -> TeacherRun:
    """The finetune recipe on the reference's training rows for `pseudolabel.teacher_epochs` passes,
    calibrated on the dev rows, its logits over the pool."""
    from crucible.train import predict, train
    from tasks.data.classifier import examples, prepare, train_config
    from tasks.data.models import base_model

    cfg = params.finetune
    seed = teacher_seed(params.pipeline.seed, task)
    clock = Clock()
    train_df, dev_df = reference[~dev], reference[dev]
    model, tokenizer, gm, max_length, lp = prepare(
        base_model(params, root), classes, cfg, seed, train_df, cfg.max_length
    )
    train_set = examples(tokenizer, train_df, classes, max_length, use_weights=False)
    dev_set = examples(tokenizer, dev_df, classes, max_length, use_weights=False)
    tcfg = train_config(
        cfg,
        len(train_set),
        seed,
        epochs=params.pseudolabel.teacher_epochs,
        pad_id=tokenizer.pad_token_id or 0,
        checkpoints=False,
    )
    train(model, train_set, dev_set, tcfg, mixout=gm, desc=f"teacher@{task}")
    if gm is not None:
        gm.unwrap()
    model.eval()
    dev_logits = predict(model, dev_set.input_ids, tcfg.eval_batch_size, tcfg.pad_id, tcfg.autocast_dtype)
    calibration = pl.calibrate(dev_logits.numpy(), dev_set.labels.numpy())
    pool_ids = examples(tokenizer, pool.assign(label=classes[0]), classes, max_length, use_weights=False).input_ids
    pool_logits = predict(model, pool_ids, tcfg.eval_batch_size, tcfg.pad_id, tcfg.autocast_dtype)
    info = {"steps": tcfg.max_steps, "n_fit": len(train_set), "seconds": clock.seconds()}
    if lp is not None:
        info["probe_C"] = lp.C
    return TeacherRun(pl.predict_logits(pool_logits.numpy(), calibration.temperature), calibration, info)


def model_teacher(
    params: Params, root, task: str, reference: pd.DataFrame, dev, pool: pd.DataFrame, classes
) -> TeacherRun:
    """A probe on `pseudolabel.teacher_model`'s frozen, pooled, L2-normalised features of the reference
    and the pool (embedded here at embed.max_length: the larger model runs once over these texts)."""
    from crucible.embed import embed_texts
    from crucible.models import load_base, max_length, resolve_pooling
    from tasks.data.models import resolve_model
    from tasks.runtime.device import current

    clock = Clock()
    path = resolve_model(params.pseudolabel.teacher_model, root)
    model, tokenizer = load_base(path)
    model = model.to(current().device)
    pooling = resolve_pooling(path, model.config, "auto")
    texts = reference["text"].tolist() + pool["text"].tolist()
    x = (
        embed_texts(
            model,
            tokenizer,
            texts,
            batch_size=params.embed.batch_size,
            max_length=max_length(tokenizer, model.config, params.embed.max_length),  # within the model's limit
            pooling=pooling,
        )
        .double()
        .numpy()
    )
    run = probe_teacher(
        x[: len(reference)],
        reference["label"].to_numpy(dtype=object),
        dev,
        x[len(reference) :],
        classes,
        params.pseudolabel.C,
        teacher_seed(params.pipeline.seed, task),
        f"teacher {params.pseudolabel.teacher_model}",
    )
    run.info.update(model=params.pseudolabel.teacher_model, dim=int(x.shape[1]), seconds=clock.seconds())
    return run


def run_teacher(params: Params, root, task: str, reference, dev, pool, ref_x, pool_x, classes, source) -> TeacherRun:
    """The teacher `pseudolabel.teacher` names, fitted, calibrated and run over the pool."""
    kind = params.pseudolabel.teacher
    if kind == "probe":
        run = probe_teacher(
            ref_x,
            reference["label"].to_numpy(dtype=object),
            dev,
            pool_x,
            classes,
            params.pseudolabel.C,
            teacher_seed(params.pipeline.seed, task),
            source,
        )
    elif kind == "finetune":
        run = finetune_teacher(params, root, task, reference, dev, pool, list(classes))
    else:
        run = model_teacher(params, root, task, reference, dev, pool, classes)
    run.info["teacher"] = kind
    return run


def dev_mask(reference: pd.DataFrame, fraction: float, seed: int, task: str) -> np.ndarray:
    """The reference's dev rows (crucible.pseudolabel.dev_split), seeded per task."""
    return pl.dev_split(reference["label"].to_numpy(dtype=object), fraction, derive_seed(seed, task, "dev"))
