"""The task classifier recipe: the base model and a linear head built from the run's `finetune`
params, the head started as a probe on the frozen features of the labeled rows (LP-FT), trained by
crucible.train. Shared by the finetune stage (the student) and the pseudolabel stage's self-training
teacher (docs/methods.md, finetune and pseudolabel), so both train the same way.

Every random draw (head init, dropout, GMixout masks, batch order) comes from generators seeded from
the caller's seed, never torch's global one (crucible.train).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import torch

from crucible.gmixout import GMixout, GMixoutConfig
from crucible.heads import LinearHead, fit_linear_head
from crucible.models import resolve_modules
from crucible.seeding import stream_seed
from crucible.train import EncoderClassifier, Examples, TrainConfig, pooled_features, tokenize
from tasks.data.models import BaseModel
from tasks.runtime.device import current
from tasks.runtime.params_schema import FinetuneParams


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


def train_config(
    cfg: FinetuneParams,
    n_train: int,
    seed: int,
    *,
    epochs: float | None = None,
    progress: bool = True,
    pad_id: int = 0,
    checkpoints: bool = True,
) -> TrainConfig:
    """crucible.train's config from the finetune params: `epochs` (default finetune.epochs) passes over
    n_train rows unless finetune.max_steps is set; the run's autocast; no checkpoints when `checkpoints`
    is false (the self-training teacher)."""
    steps = (cfg.max_steps if epochs is None else None) or max(
        1, round((cfg.epochs if epochs is None else epochs) * -(-n_train // cfg.batch_size))
    )
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
        checkpoint_every=cfg.checkpoint_every if checkpoints else 0,
        seed=seed,
        progress=progress,
        pad_id=pad_id,
        autocast=current().precision,
        keep=cfg.keep,
    )


def examples(tokenizer, df: pd.DataFrame, classes: list[str], max_length: int, use_weights: bool = True) -> Examples:
    """Tokenised rows of `df` (text, label and, with use_weights, weight), labels as class indices."""
    index = {c: i for i, c in enumerate(classes)}
    weights = (
        df["weight"].to_numpy(dtype=np.float32) if use_weights and "weight" in df else np.ones(len(df), np.float32)
    )
    labels = df["label"].map(index).to_numpy(dtype=np.int64, copy=True)
    return Examples(tokenize(tokenizer, df["text"].tolist(), max_length), labels, weights.copy())


def load_classifier(base: BaseModel, n_classes: int, cfg: FinetuneParams, seed: int):
    """(EncoderClassifier in eval mode, tokenizer): the base model and a head initialised as
    nn.Linear does, from a generator seeded from `seed`, on the run's device (the head is drawn on the
    CPU, then moved: the same numbers anywhere)."""
    encoder, tokenizer = base.load()
    model = EncoderClassifier(
        encoder, n_classes, dropout=cfg.dropout, seed=stream_seed(seed, "head"), pooling=base.pooling(encoder.config)
    ).to(current().device)
    model.eval()
    return model, tokenizer


def probe_head(
    model: EncoderClassifier, rows: Examples, seed: int, batch_size: int = 64, pad_id: int = 0
) -> LinearHead:
    """LP-FT's first step: the head set to a logistic-regression probe (C by cross-validation,
    crucible.heads) fitted on the frozen encoder's pooled features of `rows`."""
    x = pooled_features(
        model, rows.input_ids, batch_size, pad_id, TrainConfig(autocast=current().precision).autocast_dtype
    )
    head = fit_linear_head(x.numpy(), rows.labels.numpy(), model.head.out_features, seed=seed)
    with torch.no_grad():
        model.head.weight.copy_(torch.from_numpy(head.weight).to(model.head.weight))
        model.head.bias.copy_(torch.from_numpy(head.bias).to(model.head.bias))
    return head


def wrap_mixout(model: EncoderClassifier, cfg: FinetuneParams, seed: int) -> GMixout | None:
    """GMixout around the encoder's selected linear layers (finetune.method), or None for plain."""
    try:
        modules = resolve_modules(model.encoder, cfg.modules)
    except ValueError as exc:
        raise ValueError(f"finetune.modules: {exc}") from None
    mix = mixout_config(cfg, stream_seed(seed, "mixout"), modules)
    return GMixout.wrap(model.encoder, mix) if mix is not None else None


def prepare(base: BaseModel, classes: list[str], cfg: FinetuneParams, seed: int, probe_rows: pd.DataFrame, max_length):
    """The classifier ready to train: (model in train mode, tokenizer, GMixout or None, max_length,
    the LP head or None). With finetune.head_init: probe, the head starts as the probe fitted on
    `probe_rows` (the labeled reference rows of the training split); with random, as nn.Linear
    starts. `max_length`: the stage's cap (resolved against the model's own limit)."""
    model, tokenizer = load_classifier(base, len(classes), cfg, seed)
    max_length = base.max_length(tokenizer, model.encoder.config, max_length)
    lp = None
    if cfg.head_init == "probe":
        rows = examples(tokenizer, probe_rows, classes, max_length, use_weights=False)
        lp = probe_head(model, rows, stream_seed(seed, "probe"), pad_id=tokenizer.pad_token_id or 0)
    gm = wrap_mixout(model, cfg, seed)
    model.train()
    return model, tokenizer, gm, max_length, lp


def with_pad(tcfg: TrainConfig, tokenizer) -> TrainConfig:
    return replace(tcfg, pad_id=tokenizer.pad_token_id or 0)
