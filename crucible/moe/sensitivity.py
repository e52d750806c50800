"""Propagation-aware loads of a MoE's compensated matrices (docs/methods.md, moe).

    sens = output_sensitivity(float_model, batches, routes)      # key -> MatrixSensitivity
    loads = {k: s.load for k, s in sens.items()}                 # the "load_aware_prop" allocation's loads

The routed load of crucible.moe.compensate (an expert's share of the tokens, 1 for every other
matrix) weighs each matrix's output error per token by how often it occurs, but not by how much
that error costs downstream: an error in an early layer propagates through every later one and
flips later routers, an error the residual stream washes out costs little. The dense quantize stage
weighs layers by the output sensitivity of crucible.quant.compensate.collect_output_sensitivity,
g = E ||dL/dy||^2 / out_features per token (the diagonal, isotropic empirical Fisher of the layer's
output y): a perturbation e of y changes the loss by about g E||e||^2 to second order. This module
measures the same quantity for every matrix a MoE's compensation covers, keyed as moe_plan keys
them, and multiplies it by the routed share:

    load = share x g = (1 / T) sum over the tokens t routed to the matrix of ||dL/dy_t||^2 / out

where T is the number of tokens the layer saw and y_t the matrix's own output on token t:
- attention q/k/v/o, dense MLP linears, the shared expert's gate/up/down: y is the nn.Linear's
  output, every token is routed to it (share 1), so load = g exactly as the dense stage computes it;
- expert e's gate_up_proj: y_t = x_t W_gu,e^T ([gate; up], 2I values), on the tokens routed to e;
- expert e's down_proj: y_t = (act(g) * u) W_d,e^T (H values) before the routing weight w_t,e
  multiplies it, so dL/dy_t = w_t,e dL/d(experts output)_t: the combine weight that scales this
  matrix's error in the layer's output is part of its sensitivity.
The expert outputs are captured per expert: during the measurement each experts module runs an eager
forward (the computation of transformers' eager experts, expert by expert, under the model's own
top-k routes, or `routes` replayed) that registers a gradient hook on each expert's two matrix
outputs. A matrix whose output the loss does not depend on (no gradient reaches it) gets load 0, so
with qera-scaled spectra (sigma^2 = output error per routed token) load x sigma^2 estimates the loss
increase per token of the layer that each rank unit removes, one scale across experts, attention
and the shared expert.

Loss: the summed next-token cross-entropy of the model's own logits over every predicted position
of the batch (log-softmax in float32), so a token's gradient does not depend on the batch size; a
dict batch's attention_mask drops padded targets from the loss (the padded positions still count
as routed tokens, as in crucible.moe.compensate.expert_stats). No parameter gets a gradient: the
embedding output is made a leaf that requires grad and every parameter's requires_grad is off
during the measurement (restored afterwards), so the backward pass computes activation gradients
only. Deterministic: no random numbers are drawn.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from crucible.hooks import forward_hooks
from crucible.moe.mx_experts import MXExperts, quantizable_linears
from crucible.moe.routing import forward_batch, moe_layers, replay

__all__ = ["MatrixSensitivity", "output_sensitivity"]


@dataclass
class MatrixSensitivity:
    """One compensated matrix over the calibration batches: the summed squared gradient of the loss
    w.r.t. its output rows, the rows it produced (tokens routed to it), the tokens its layer saw."""

    energy: float = 0.0
    rows: int = 0
    tokens: int = 0
    out_features: int = 1

    @property
    def share(self) -> float:
        """Routed share of the layer's tokens (1 for attention and shared-expert matrices)."""
        return self.rows / self.tokens if self.tokens else 0.0

    @property
    def grad(self) -> float:
        """g = E ||dL/dy||^2 / out_features over the rows routed to the matrix (0 without rows)."""
        return self.energy / (self.rows * self.out_features) if self.rows else 0.0

    @property
    def load(self) -> float:
        """share x g: the propagation-aware load."""
        return self.energy / (self.tokens * self.out_features) if self.tokens else 0.0


def _watch(t: torch.Tensor, acc: MatrixSensitivity) -> None:
    if not t.requires_grad:
        raise RuntimeError("output_sensitivity: a watched output carries no gradient")
    acc.rows += t.numel() // t.shape[-1]

    def hook(g):
        acc.energy += float(g.detach().double().pow(2).sum())

    t.register_hook(hook)


def _eager_experts(experts: nn.Module, name: str, acc: dict[str, MatrixSensitivity], tokens: dict[str, int]):
    """An eager forward for transformers' fused experts that watches each expert's two outputs."""
    gate_up, down, act = experts.gate_up_proj, experts.down_proj, experts.act_fn

    def forward(hidden_states, top_k_index, top_k_weights):
        tokens[name] += hidden_states.shape[0]
        final = torch.zeros_like(hidden_states)
        index = top_k_index.long()
        for e in index.unique().tolist():
            tok, pos = torch.where(index == e)
            gu = F.linear(hidden_states[tok], gate_up[e])
            _watch(gu, acc[f"{name}.gate_up_proj.{e}"])
            g, u = gu.chunk(2, dim=-1)
            y = F.linear(act(g) * u, down[e])
            _watch(y, acc[f"{name}.down_proj.{e}"])
            final.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(final.dtype))
        return final

    return forward


def _next_token_loss(out, batch) -> torch.Tensor:
    ids = batch["input_ids"] if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) else batch
    ids = ids.to(out.logits.device)
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if isinstance(batch, dict) and batch.get("attention_mask") is not None:
        nll = nll * batch["attention_mask"][:, 1:].to(nll.device, nll.dtype)
    return nll.sum()


def output_sensitivity(
    model: nn.Module, batches: Iterable, routes=None, attention: bool = True, dense: bool = True, shared: bool = True
) -> dict[str, MatrixSensitivity]:
    """key -> MatrixSensitivity of every matrix compensate.moe_plan covers with the same switches
    (each expert's "<experts>.gate_up_proj.<e>" / "<experts>.down_proj.<e>", then the linears of
    quantizable_linears(model, attention, dense, shared)), over `batches` (each one forward call,
    routing.forward_batch; under `replay(model, routes)` when routes are given, else the model's own
    routing). `model` is the float MoE (ValueError for quantized experts); it is left as it was.
    ValueError if the loss is not finite or no token reached the experts."""
    layers = moe_layers(model)
    acc: dict[str, MatrixSensitivity] = {}
    tokens: dict[str, int] = {}
    layer_of: dict[str, str] = {}  # expert matrix key -> its experts module
    experts = {}
    for block_name, block in layers.items():
        name = f"{block_name}.experts"
        mod = block.experts
        if isinstance(mod, MXExperts) or not isinstance(getattr(mod, "gate_up_proj", None), torch.Tensor):
            raise ValueError(f"output_sensitivity: {name} is {type(mod).__name__}; pass the float model")
        e, two_i, h = mod.gate_up_proj.shape
        for j in range(e):
            acc[f"{name}.gate_up_proj.{j}"] = MatrixSensitivity(out_features=int(two_i))
            acc[f"{name}.down_proj.{j}"] = MatrixSensitivity(out_features=int(h))
            layer_of[f"{name}.gate_up_proj.{j}"] = layer_of[f"{name}.down_proj.{j}"] = name
        tokens[name] = 0
        experts[name] = mod
    linear_names = quantizable_linears(model, attention, dense, shared)
    for n in linear_names:
        acc[n] = MatrixSensitivity(out_features=int(model.get_submodule(n).out_features))

    def linear_hook(name):
        def fn(module, args, out):
            _watch(out, acc[name])

        return fn

    def leaf(module, args, out):  # the embedding output: a leaf that requires grad
        return out.detach().requires_grad_(True)

    flags = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    model.eval()
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for name, mod in experts.items():
            mod.forward = _eager_experts(mod, name, acc, tokens)
        pairs = [(model.get_submodule(n), linear_hook(n)) for n in linear_names]
        with (
            forward_hooks([(model.get_input_embeddings(), leaf)]),
            forward_hooks(pairs),
            torch.enable_grad(),
            replay(model, routes) if routes is not None else contextlib.nullcontext(),
        ):
            for batch in batches:
                out = forward_batch(model, batch)
                loss = _next_token_loss(out, batch)
                if not torch.isfinite(loss):
                    raise ValueError(f"output_sensitivity: the loss is {float(loss.detach())}")
                loss.backward()
    finally:
        for mod in experts.values():
            mod.__dict__.pop("forward", None)
        for p, f in flags.items():
            p.requires_grad_(f)
        model.train(was_training)
    if not any(tokens.values()):
        raise ValueError("output_sensitivity: no calibration token reached the experts (empty batches?)")
    for key, s in acc.items():
        s.tokens = tokens[layer_of[key]] if key in layer_of else s.rows
    return acc
