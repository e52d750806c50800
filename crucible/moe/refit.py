"""Training-free repair of a MoEfied model: refit every MoE block's down projections by least squares
so that the block, routing as it does, reproduces the dense FFN (docs/methods.md, moe).

    report = refit_down(moe, dense, calib_ids, ridge=1e-2)   # per layer: relative error before, after

Method. A Qwen2-MoE block computes y = sigmoid(g . x) D_s h_s(x) + sum_{e in top-k(x)} w_e(x) D_e h_e(x),
with h = act(gate x) * (up x) of the shared expert (s) and of each routed expert (e), w_e the router's
combine weights. Given the routing, y is linear in the down projections: with the features
f(x) = [sigmoid(g . x) h_s(x); w_e(x) h_e(x) for the selected e, zeros for the others] and
M = [D_s, D_1, ..., D_E], y = M f(x). The dropped experts' contribution is what the MoE misses; part
of it correlates with what the selected experts compute, and a least-squares fit of M to the dense
FFN's output F(x) on calibration tokens recovers that part:
    M = argmin ||F - M f||^2 + lambda ||M - M_0||^2,  lambda = ridge * mean diag(f^T f),
shrunk toward the current weights M_0 (so rarely routed experts stay as built). Layers are refitted
in order in one forward pass over the calibration sequences: a forward pre-hook on each block fits
it on the inputs it actually receives, after the layers before it were refitted (so the fit also
absorbs their remaining error), with the target the dense FFN of the same layer on the same input.
The gate/up projections, the routers and everything else are unchanged. float64 normal equations.

Contract
- refit_down(moe, dense, calib_ids, ridge=1e-2) -> list of {"layer", "before", "after"}: the relative
  squared error ||F - M f||^2 / ||F||^2 of each block on its calibration inputs with the old and the
  new down projections. moe: a model whose MoE blocks (crucible.moe.routing.moe_layers) have fused
  routed experts (gate_up_proj [E, 2w, H], down_proj [E, H, w]) and optionally a shared expert with
  a sigmoid gate, as crucible.moe.build.moefy writes; dense: the model it was split from (the same
  number of layers, each `mlp` the dense FFN). calib_ids [N, T] token ids, run as one batch.
  All-or-nothing: on an error the original weights are restored. ValueError for ridge not finite
  > 0, a layer count that differs, calib_ids not a 2-D integer tensor; the refitted weights are
  checked finite (naming the layer).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from crucible.device import model_device
from crucible.hooks import forward_hooks
from crucible.moe.routing import moe_layers

__all__ = ["refit_down"]


def _features(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[T, S + E * w] float64: the gated shared activations, then each routed expert's activations
    times its combine weight where the router selected it (zeros elsewhere)."""
    experts = block.experts
    n_experts, two_w, _ = experts.gate_up_proj.shape
    width = two_w // 2
    _, weights, index = block.gate(x)
    gate, up = torch.einsum("th,eih->eti", x.double(), experts.gate_up_proj.double()).split(width, dim=-1)
    h = experts.act_fn(gate) * up  # [E, T, w]
    combine = torch.zeros(x.shape[0], n_experts, dtype=torch.float64, device=x.device)
    combine.scatter_add_(1, index, weights.double())
    routed = (h.permute(1, 0, 2) * combine[:, :, None]).reshape(x.shape[0], -1)
    shared = getattr(block, "shared_expert", None)
    if shared is None:
        return routed
    hs = shared.act_fn(x.double() @ shared.gate_proj.weight.double().T) * (
        x.double() @ shared.up_proj.weight.double().T
    )
    gate_s = getattr(block, "shared_expert_gate", None)
    if gate_s is not None:
        hs = hs * torch.sigmoid(x.double() @ gate_s.weight.double().T)
    return torch.cat([hs, routed], dim=1)


def _current(block: nn.Module) -> torch.Tensor:
    """[H, S + E * w]: the down projections in the feature order of _features."""
    down = block.experts.down_proj.detach().double()  # [E, H, w]
    routed = down.permute(1, 0, 2).reshape(down.shape[1], -1)
    shared = getattr(block, "shared_expert", None)
    return routed if shared is None else torch.cat([shared.down_proj.weight.detach().double(), routed], dim=1)


def _write(block: nn.Module, m: torch.Tensor) -> None:
    down = block.experts.down_proj
    n_experts, hidden, width = down.shape
    shared = getattr(block, "shared_expert", None)
    s = 0 if shared is None else shared.down_proj.weight.shape[1]
    with torch.no_grad():
        if shared is not None:
            shared.down_proj.weight.copy_(m[:, :s].to(shared.down_proj.weight.dtype))
        down.copy_(m[:, s:].reshape(hidden, n_experts, width).permute(1, 0, 2).to(down.dtype))


@torch.no_grad()
def refit_down(moe: nn.Module, dense: nn.Module, calib_ids: torch.Tensor, ridge: float = 1e-2) -> list[dict]:
    """Refit every MoE block's down projections to the dense FFN, layer by layer (module docstring)."""
    if isinstance(ridge, bool) or not isinstance(ridge, numbers.Real) or not (math.isfinite(ridge) and ridge > 0):
        raise ValueError(f"refit_down: ridge={ridge!r} must be finite and > 0")
    if not isinstance(calib_ids, torch.Tensor) or calib_ids.dim() != 2 or calib_ids.is_floating_point():
        raise ValueError(
            f"refit_down: calib_ids must be an integer tensor [N, T], got "
            f"{getattr(calib_ids, 'shape', type(calib_ids).__name__)}"
        )
    blocks = list(moe_layers(moe).values())
    dense_layers = dense.model.layers
    if len(blocks) != len(dense_layers):
        raise ValueError(
            f"refit_down: the MoE has {len(blocks)} MoE blocks but the dense model {len(dense_layers)} "
            "layers; refit against the model the MoE was split from"
        )
    saved = [
        (
            b.experts.down_proj.detach().clone(),
            None if getattr(b, "shared_expert", None) is None else b.shared_expert.down_proj.weight.detach().clone(),
        )
        for b in blocks
    ]
    report: list[dict] = []

    def hook(i: int):
        def fn(block, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            f = _features(block, x)
            target = dense_layers[i].mlp(x).double()
            m0 = _current(block)
            gram = f.T @ f
            lam = ridge * float(gram.diagonal().mean().clamp_min(1e-12))
            eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
            m = torch.linalg.solve(gram + lam * eye, f.T @ target + lam * m0.T).T
            if not torch.isfinite(m).all():
                raise ValueError(f"refit_down: layer {i}: the refitted down projections are not finite")
            norm = float((target**2).sum().clamp_min(1e-30))
            report.append(
                {
                    "layer": i,
                    "before": float(((f @ m0.T - target) ** 2).sum()) / norm,
                    "after": float(((f @ m.T - target) ** 2).sum()) / norm,
                }
            )
            _write(block, m)

        return fn

    was = (moe.training, dense.training)
    moe.eval()
    dense.eval()
    try:
        with forward_hooks([(b, hook(i)) for i, b in enumerate(blocks)], pre=True):
            moe.model(input_ids=calib_ids.to(model_device(moe)), use_cache=False)
    except BaseException:
        for b, (down, shared) in zip(blocks, saved):
            b.experts.down_proj.copy_(down)
            if shared is not None:
                b.shared_expert.down_proj.weight.copy_(shared)
        raise
    finally:
        moe.train(was[0])
        dense.train(was[1])
    return report
