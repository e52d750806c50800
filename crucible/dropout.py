"""Dropout that draws from a run's own generator, never torch's global one: Prefect runs per-task
training in threads of one process, and a shared global RNG would make a task's weights depend on
what trains beside it. `use_run_dropout(encoder)` swaps every nn.Dropout of a Hugging Face encoder
for a RunDropout and routes attention through an implementation whose dropout is the layer's
RunDropout (torch's sdpa kernel cannot take a generator). In eval mode nothing changes."""

from __future__ import annotations

import torch
from torch import nn


class RunDropout(nn.Module):
    """nn.Dropout whose masks come from `generator` (set by EncoderClassifier.bind_generator; the
    training run owns it), never from torch's global RNG. Identity in eval mode; in training mode
    without a generator it raises RuntimeError rather than draw from the global RNG."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RunDropout p = {p!r}: expected a probability in [0, 1]")
        self.p = float(p)
        self.generator: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x, self.p)

    def drop(self, x: torch.Tensor, p: float) -> torch.Tensor:
        """x with each element zeroed with probability p and the rest scaled by 1 / (1 - p)."""
        if not self.training or p == 0.0:
            return x
        if self.generator is None:
            raise RuntimeError(
                "RunDropout in training mode has no generator: call "
                "EncoderClassifier.bind_generator(torch.Generator()...) first (crucible.train.train does)"
            )
        if p >= 1.0:
            return torch.zeros_like(x)
        keep = torch.rand(x.shape, generator=self.generator, device=x.device) >= p
        return x * keep.to(x.dtype) / (1.0 - p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


RUN_DROPOUT_ATTENTION = "crucible_run_dropout"  # the name registered in transformers' AttentionInterface
# the RunDropout attached to an attention module that has no nn.Dropout of its own (it passes a float
# `attention_dropout` to the attention function); it holds no tensor, so state dicts do not change
ATTENTION_DROPOUT_MODULE = "crucible_attention_dropout"


def _run_dropout_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers' sdpa attention in eval mode or without dropout (the same numbers); in training
    with dropout, eager attention whose dropout on the attention probabilities is the layer's
    RunDropout (`module.dropout`): torch's sdpa kernel would draw its mask from the global RNG."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not module.training or dropout == 0.0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=0.0, **kwargs)
    drop = getattr(module, "dropout", None)
    if not isinstance(drop, RunDropout):  # attention modules that keep their dropout as a float (Llama, ModernBERT)
        drop = getattr(module, ATTENTION_DROPOUT_MODULE, None)
    if not isinstance(drop, RunDropout):
        raise RuntimeError(
            f"{type(module).__name__}: attention dropout {dropout} needs a RunDropout at "
            f"`.dropout` to draw from the run's generator; got {type(drop).__name__}"
        )
    if key.shape[1] != query.shape[1]:  # grouped-query attention: one key/value head per group
        n_rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # sdpa's mask: True = attend
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = drop.drop(scores.softmax(dim=-1), dropout)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def use_run_dropout(encoder: nn.Module) -> nn.Module:
    """Make every dropout of a Hugging Face model draw from the run's generator, in place: each
    nn.Dropout becomes a RunDropout of the same p, and, for a model built on transformers'
    AttentionInterface (BERT, RoBERTa, DistilBERT, ModernBERT, Llama, Qwen2, ...), attention goes
    through RUN_DROPOUT_ATTENTION, whose dropout on the attention probabilities is the attention
    module's RunDropout (its own `.dropout`, or one attached as `crucible_attention_dropout` when
    the module keeps the probability as a float). Models with their own eager attention (DeBERTa-v2,
    MPNet) apply an nn.Dropout module to the probabilities, which is a RunDropout after the swap.
    `encoder.crucible_attention_dropout_mode` records which: "interface" or "module". Idempotent.
    Raises ValueError for a model with attention dropout that neither way covers."""
    for name, module in list(encoder.named_modules()):
        if type(module) is nn.Dropout:
            parent, _, child = name.rpartition(".")
            setattr(encoder.get_submodule(parent) if parent else encoder, child, RunDropout(module.p))
    config = getattr(encoder, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) == RUN_DROPOUT_ATTENTION:
        return encoder
    attention_dropout = max(
        float(getattr(config, k, 0.0) or 0.0) for k in ("attention_probs_dropout_prob", "attention_dropout")
    )
    if not getattr(encoder, "_supports_attention_backend", False):
        # eager attention of the model's own: any functional dropout would draw from the global RNG
        leftovers = [
            n
            for n, m in encoder.named_modules()
            if isinstance(getattr(m, "dropout_p", None), float) and m.dropout_p > 0
        ]
        if attention_dropout > 0 and leftovers:
            raise ValueError(
                f"{type(encoder).__name__}: attention dropout {attention_dropout} is applied "
                f"functionally in {leftovers[:2]} and cannot be drawn from the run's generator; set the "
                f"config's attention dropout to 0"
            )
        encoder.crucible_attention_dropout_mode = "module"
        return encoder
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(RUN_DROPOUT_ATTENTION, _run_dropout_attention)
    AttentionMaskInterface.register(RUN_DROPOUT_ATTENTION, sdpa_mask)
    if hasattr(encoder, "set_attn_implementation"):
        encoder.set_attn_implementation(RUN_DROPOUT_ATTENTION)
    if attention_dropout > 0 and config._attn_implementation != RUN_DROPOUT_ATTENTION:
        raise ValueError(
            f"{type(encoder).__name__}: attention dropout {attention_dropout} cannot be drawn from the "
            f"run's generator (its attention implementation cannot be set to {RUN_DROPOUT_ATTENTION!r}); "
            f"set the config's attention dropout to 0 or use an encoder built on AttentionInterface"
        )
    for module in list(encoder.modules()):
        if isinstance(getattr(module, "attention_dropout", None), float) and not isinstance(
            getattr(module, "dropout", None), RunDropout
        ):
            module.add_module(ATTENTION_DROPOUT_MODULE, RunDropout(0.0))
    encoder.crucible_attention_dropout_mode = "interface"
    return encoder
