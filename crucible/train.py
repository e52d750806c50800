"""Fine-tuning an encoder classifier: weighted cross-entropy, AdamW with warmup and linear decay,
gradient clipping, early stopping on a dev split, checkpoints and exact resume; WiSE-FT.

    model = EncoderClassifier(AutoModel.from_pretrained(path), n_classes)
    gm = GMixout.wrap(model, GMixoutConfig(...))            # optional (crucible.gmixout)
    result = train(model, train_set, dev_set, TrainConfig(max_steps=200), mixout=gm,
                   checkpoint_dir="ckpt", log=lambda metrics, step: ...)

Data come tokenised (`Examples`: lists of token ids, integer labels, per-example weights), so a
tiny randomly initialised model trains with integer ids and no tokenizer.

Randomness: nothing here draws from torch's global generator, which all threads of a process
share (two fine-tunes in threads of one Prefect flow would otherwise interleave their draws and
each change the other's weights). Every draw comes from a torch.Generator of its own:
- the head's initialisation: a generator seeded with EncoderClassifier's `seed`;
- dropout, before the head and inside the encoder (hidden states and attention probabilities):
  `RunDropout` modules replace the encoder's nn.Dropout, and attention runs through
  `RUN_DROPOUT_ATTENTION` (transformers' sdpa in eval mode; in training, eager attention whose
  dropout is the layer's RunDropout). They draw from the generator that `train` makes for the run,
  seeded with stream_seed(TrainConfig.seed, "dropout") and saved in checkpoints;
- the batch order of epoch e: a permutation from a generator seeded with epoch_seed(seed, e);
- the mixout masks: GMixout's own generator (GMixoutConfig.seed), saved in checkpoints.
So a run is a function of its inputs and seeds, whatever trains beside it, and a run resumed from
its latest checkpoint ends with the same weights as an uninterrupted one. Bitwise equality also
needs the same torch build, CPU and intra-op thread count (torch.get_num_threads()): torch's
parallel CPU reductions (sums: bias gradients, pooling, the loss) split the work by thread count,
so 1 and 2 threads differ in the last bits (MKL's matmuls gave the same bits at 1 and 2 threads).

Checkpoints (crucible.checkpoint: safetensors plus JSON, no pickle) hold the model, optimizer,
scheduler, GMixout and RNG states. Pure torch: the caller supplies a `log(metrics, step)` callback
for tracking.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from crucible.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from crucible.device import autocast, model_device
from crucible.dropout import RunDropout, use_run_dropout
from crucible.gmixout import GMixout
from crucible.models import encode
from crucible.progress import Progress
from crucible.seeding import epoch_seed, stream_seed, torch_generator

# ---------------------------------------------------------------------------------------------------
# model and data


class EncoderClassifier(nn.Module):
    """A Hugging Face base model (encoder or decoder), pooling (crucible.models.pool: mean, cls or
    the last non-padding token), a linear head in float32.

    The head is initialised as nn.Linear initialises itself, from a generator seeded with `seed`;
    the encoder's dropouts are made RunDropout (use_run_dropout), as is the one before the head.
    In training mode they need a generator: `bind_generator` (crucible.train.train binds its own)."""

    def __init__(self, encoder: nn.Module, n_classes: int, dropout: float = 0.1, seed: int = 0, pooling: str = "mean"):
        super().__init__()
        self.pooling = pooling
        self.encoder = use_run_dropout(encoder)
        self.dropout = RunDropout(dropout)
        hidden = encoder.config.hidden_size
        self.head = nn.utils.skip_init(nn.Linear, hidden, n_classes)
        generator = torch_generator(seed)
        with torch.no_grad():  # nn.Linear.reset_parameters, drawn from `generator`
            nn.init.kaiming_uniform_(self.head.weight, a=math.sqrt(5), generator=generator)
            nn.init.uniform_(self.head.bias, -1 / math.sqrt(hidden), 1 / math.sqrt(hidden), generator=generator)

    def bind_generator(self, generator: torch.Generator | None) -> None:
        """Every RunDropout of the model draws from `generator` from now on."""
        for module in self.modules():
            if isinstance(module, RunDropout):
                module.generator = generator

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask (b, t) -> logits (b, n_classes)."""
        features = encode(self.encoder, input_ids, attention_mask, self.pooling).float()
        return self.head(self.dropout(features))


@dataclass
class Examples:
    """Tokenised examples: input_ids[i] a list of token ids, labels (n,) int64, weights (n,) float."""

    input_ids: list[list[int]]
    labels: torch.Tensor
    weights: torch.Tensor

    def __post_init__(self):
        self.labels = torch.as_tensor(self.labels, dtype=torch.long)
        self.weights = torch.as_tensor(self.weights, dtype=torch.float32)
        if not len(self.input_ids) == len(self.labels) == len(self.weights):
            raise ValueError(
                f"Examples: {len(self.input_ids)} texts, {len(self.labels)} labels, "
                f"{len(self.weights)} weights; expected one of each per example"
            )
        if len(self.input_ids) == 0:
            raise ValueError("Examples: no examples")
        if (self.weights < 0).any() or not torch.isfinite(self.weights).all():
            raise ValueError("Examples: weights must be finite and >= 0")

    def __len__(self) -> int:
        return len(self.input_ids)


def tokenize(tokenizer, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids (with the special tokens, truncated to max_length) of each text; no padding."""
    return tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]


def collate(ids: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence: (input_ids, attention_mask), both (b, t) int64."""
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)] = torch.as_tensor(x, dtype=torch.long)
        mask[i, : len(x)] = 1
    return input_ids, mask


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i CE(logits_i, y_i) / sum_i w_i (a weighted mean; 0 when every weight is 0)."""
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (weights * ce).sum() / weights.sum().clamp(min=1e-12)


# ---------------------------------------------------------------------------------------------------
# configuration and schedule


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 5e-5  # encoder learning rate (peak)
    head_lr: float = 1e-3  # the fresh head learns faster than the pretrained encoder
    max_steps: int = 100  # optimizer steps (the caller converts epochs to steps)
    batch_size: int = 16
    warmup: float = 0.1  # share of max_steps with a linear warmup; then linear decay to 0
    weight_decay: float = 0.01
    clip: float = 1.0  # max global gradient norm (0 = no clipping)
    eval_every: int = 50  # evaluate on dev every N steps (and at the last step)
    patience: int = 0  # stop after this many evaluations without improvement (0 = never)
    checkpoint_every: int = 0  # 0 = no checkpoints
    keep_checkpoints: int = 2
    eval_batch_size: int = 64
    pad_id: int = 0
    seed: int = 0
    progress: bool = True
    autocast: str = "fp32"  # fp32 | bf16: the forward passes' autocast dtype (weights stay float32)
    keep: str = (
        "best"  # best: the weights of the best dev accuracy | last: those after the last step (a fixed schedule)
    )

    def __post_init__(self):
        for name in ("max_steps", "batch_size", "eval_every", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} = {getattr(self, name)!r}: expected >= 1")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"TrainConfig.warmup = {self.warmup!r}: expected a share in [0, 1)")
        if self.autocast not in ("fp32", "bf16"):
            raise ValueError(f"TrainConfig.autocast = {self.autocast!r}: expected fp32 or bf16")
        if self.keep not in ("last", "best"):
            raise ValueError(f"TrainConfig.keep = {self.keep!r}: expected last or best")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.autocast == "bf16" else None


def linear_schedule(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: 0 -> 1 linearly over warmup_steps, then 1 -> 0 linearly at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


def make_optimizer(model: EncoderClassifier, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on biases and LayerNorm weights (1-D tensors); the head at head_lr."""
    groups = {"decay": [], "no_decay": [], "head_decay": [], "head_no_decay": []}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        prefix = "head_" if name.startswith("head.") else ""
        groups[prefix + ("decay" if param.ndim >= 2 else "no_decay")].append(param)
    return torch.optim.AdamW(
        [
            {"params": groups["decay"], "lr": cfg.lr, "weight_decay": cfg.weight_decay},
            {"params": groups["no_decay"], "lr": cfg.lr, "weight_decay": 0.0},
            {"params": groups["head_decay"], "lr": cfg.head_lr, "weight_decay": cfg.weight_decay},
            {"params": groups["head_no_decay"], "lr": cfg.head_lr, "weight_decay": 0.0},
        ]
    )


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """The example indices of optimizer step `step`: epoch e = step // steps_per_epoch walks a
    permutation drawn from a generator seeded with (seed, e); the last batch of an epoch may be
    short. A pure function of its arguments, so a resumed run needs only the step."""
    per_epoch = math.ceil(n / batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch_generator(epoch_seed(seed, epoch)))
    return perm[k * batch_size : (k + 1) * batch_size]


# ---------------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def _by_length(model: EncoderClassifier, ids, batch_size: int, pad_id: int, autocast_dtype, forward) -> torch.Tensor:
    """`forward(input_ids, mask)` over `ids` in batches of similar length (little padding) on the
    model's device, in eval mode (the training flag restored); rows back in input order, float32 on
    the CPU."""
    was_training = model.training
    model.eval()
    device = model_device(model)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = None
    try:
        for start in range(0, len(ids), batch_size):
            idx = order[start : start + batch_size]
            input_ids, mask = collate([ids[i] for i in idx], pad_id)
            with autocast(device, autocast_dtype):
                rows = forward(input_ids.to(device), mask.to(device))
            if out is None:
                out = torch.empty(len(ids), rows.shape[1])
            out[torch.tensor(idx)] = rows.float().cpu()
    finally:
        model.train(was_training)
    return out


def predict(
    model: EncoderClassifier,
    ids: Sequence[Sequence[int]],
    batch_size: int = 64,
    pad_id: int = 0,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Logits (n, n_classes), float32 on the CPU, in eval mode (no dropout, no mixing); batches run
    on the model's device; restores the training flag."""
    return _by_length(model, ids, batch_size, pad_id, autocast_dtype, model)


def pooled_features(
    model: EncoderClassifier,
    ids: Sequence[Sequence[int]],
    batch_size: int = 64,
    pad_id: int = 0,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The encoder's pooled features (n, hidden), float32 on the CPU: what the head sees, before
    dropout (eval mode; batches on the model's device; restores the training flag)."""
    out = _by_length(
        model, ids, batch_size, pad_id, autocast_dtype, lambda i, m: encode(model.encoder, i, m, model.pooling)
    )
    return torch.empty(0, model.head.in_features) if out is None else out


def evaluate(
    model: EncoderClassifier,
    data: Examples,
    batch_size: int = 64,
    pad_id: int = 0,
    autocast_dtype: torch.dtype | None = None,
) -> dict:
    """accuracy and weighted loss of `model` on `data`."""
    logits = predict(model, data.input_ids, batch_size, pad_id, autocast_dtype)
    return {
        "accuracy": float((logits.argmax(1) == data.labels).float().mean()),
        "loss": float(weighted_cross_entropy(logits, data.labels, data.weights)),
    }


# ---------------------------------------------------------------------------------------------------
# the loop


@dataclass
class TrainResult:
    steps: int  # optimizer steps taken (in total, across resumes)
    best_step: int  # step of the kept (best dev accuracy) weights
    best_dev_accuracy: float
    stopped_early: bool
    seconds: float  # wall time of this call's training steps
    examples_per_second: float
    steps_per_second: float
    history: list[dict] = field(default_factory=list)  # dev evaluations of this call

    def to_dict(self) -> dict:
        return asdict(self)


def _clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(
    model: EncoderClassifier,
    train_set: Examples,
    dev_set: Examples,
    cfg: TrainConfig,
    *,
    mixout: GMixout | None = None,
    checkpoint_dir: Path | str | None = None,
    resume: bool = True,
    log: Callable[[dict, int], None] | None = None,
    stop_after: int | None = None,
    desc: str = "finetune",
) -> TrainResult:
    """Train `model` in place; on return it holds the best dev-accuracy weights (cfg.keep = "best") or
    those of the last step (cfg.keep = "last": a fixed schedule, dev only watched), in train mode.

    `mixout` must already wrap `model`. With `checkpoint_dir`, a checkpoint is written every
    `cfg.checkpoint_every` steps and, with `resume`, training continues from the latest one.
    `stop_after` ends the call after that many total steps without the final evaluation
    (simulates a kill; tests use it). `desc` names the run on its progress line (crucible.progress),
    e.g. finetune@bbc. Dropout draws from a generator of this run, seeded with
    stream_seed(cfg.seed, "dropout") and bound to the model's RunDropout modules; torch's global
    generator is neither seeded nor drawn from.

    Device: batches, labels and weights go to the model's device; batch order, head init and the
    mixout masks are drawn on the CPU (the same numbers on any device). With cfg.autocast = bf16
    the forward pass runs under bf16 autocast while the weights, gradients and AdamW state stay
    float32 (the loss is computed on float32 logits)."""
    device = model_device(model)
    amp = cfg.autocast_dtype
    generator = torch_generator(stream_seed(cfg.seed, "dropout"), device=device)
    model.bind_generator(generator)
    optimizer = make_optimizer(model, cfg)
    warmup_steps = int(cfg.warmup * cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(warmup_steps, cfg.max_steps))
    step, best = 0, {"accuracy": -1.0, "step": 0, "bad_evals": 0}
    best_state, stopped_early = None, False

    latest = latest_checkpoint(checkpoint_dir) if (checkpoint_dir and resume) else None
    if latest is not None:
        ckpt = load_checkpoint(latest)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if mixout is not None:
            mixout.load_state_dict(ckpt["mixout"])
        generator.set_state(ckpt["dropout_rng"])
        step, best, best_state = ckpt["step"], ckpt["best"], ckpt["best_model"]
        stopped_early = ckpt["stopped_early"]

    model.train()
    history, seen, first_step = [], 0, step
    start = time.perf_counter()
    bar = Progress(total=cfg.max_steps, initial=step, desc=desc, unit="step", disable=not cfg.progress)
    while step < cfg.max_steps and not stopped_early:
        if stop_after is not None and step >= stop_after:
            bar.close()
            return TrainResult(step, best["step"], best["accuracy"], False, 0.0, 0.0, 0.0, history)
        idx = batch_indices(len(train_set), cfg.batch_size, cfg.seed, step)
        input_ids, mask = collate([train_set.input_ids[i] for i in idx], cfg.pad_id)
        if mixout is not None:
            mixout.begin_step()
        with autocast(device, amp):
            logits = model(input_ids.to(device), mask.to(device))
        loss = weighted_cross_entropy(
            logits.float(), train_set.labels[idx].to(device), train_set.weights[idx].to(device)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip if cfg.clip > 0 else float("inf"))
        if mixout is not None:
            mixout.step(optimizer)
        else:
            optimizer.step()
        scheduler.step()
        step += 1
        seen += len(idx)
        rate = seen / max(time.perf_counter() - start, 1e-9)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4f}", ex_s=f"{rate:.1f}")
        if log is not None:
            log({"train_loss": loss.item(), "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0]}, step)

        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            dev = evaluate(model, dev_set, cfg.eval_batch_size, cfg.pad_id, amp)
            history.append({"step": step, **dev})
            if log is not None:
                log({"dev_accuracy": dev["accuracy"], "dev_loss": dev["loss"]}, step)
            if dev["accuracy"] > best["accuracy"]:
                best = {"accuracy": dev["accuracy"], "step": step, "bad_evals": 0}
                best_state = _clone_state(model) if cfg.keep == "best" else None
            else:
                best = {**best, "bad_evals": best["bad_evals"] + 1}
                if cfg.patience and best["bad_evals"] >= cfg.patience:
                    stopped_early = True
        if checkpoint_dir and cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or stopped_early):
            save_checkpoint(
                checkpoint_dir,
                step,
                {
                    "step": step,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "mixout": mixout.state_dict() if mixout else None,
                    "dropout_rng": generator.get_state(),
                    "best": best,
                    "best_model": best_state,
                    "stopped_early": stopped_early,
                },
                keep=cfg.keep_checkpoints,
            )
    bar.close()
    seconds = time.perf_counter() - start
    if best_state is not None:
        model.load_state_dict(best_state)
    return TrainResult(
        step,
        best["step"],
        best["accuracy"],
        stopped_early,
        seconds,
        seen / max(seconds, 1e-9),
        (step - first_step) / max(seconds, 1e-9),
        history,
    )


# ---------------------------------------------------------------------------------------------------
# WiSE-FT


def wise_ft(
    theta_0: dict[str, torch.Tensor], theta_ft: dict[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """WiSE-FT (Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022): the weight-space
    interpolation (1 - alpha) theta_0 + alpha theta_ft of two state dicts with the same keys and
    shapes. Floating tensors are interpolated; integer buffers (e.g. position ids) come from
    theta_ft. alpha = 0 gives theta_0, alpha = 1 gives theta_ft."""
    if set(theta_0) != set(theta_ft):
        diff = sorted(set(theta_0) ^ set(theta_ft))
        raise ValueError(f"wise_ft: the state dicts have different keys, e.g. {diff[:3]}")
    out = {}
    for key, ft in theta_ft.items():
        zero = theta_0[key]
        if zero.shape != ft.shape:
            raise ValueError(f"wise_ft: '{key}' has shape {tuple(zero.shape)} vs {tuple(ft.shape)}")
        out[key] = torch.lerp(zero.to(ft.dtype), ft, alpha) if ft.is_floating_point() else ft.clone()
    return out
