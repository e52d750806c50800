"""MXFP4 with low-rank compensation of a whole model (docs/methods.md, quantize): calibration statistics,
one SVD per quantized matrix, ranks under a total budget, adapters.

    stats = collect_input_stats(model, names, batches)              # per layer: sums of |x|, x^2
    plan = CompensationPlan.build(layers, stats, mode="floor", scaling="qera", load="unit")
    ranks = plan.ranks(budget=288, allocation="load_aware")         # name -> rank
    adapters = plan.adapters(ranks)                                 # name -> (A, B), E ~= A @ B
    quantize_model(model, pattern, adapters=adapters)               # crucible.quant.linear

Per matrix W (out, in): E = W - dequant(Q(W)) and the SVD of E diag(s) (crucible.quant.lowrank),
computed once; its singular values are the spectrum for the allocation, its factors give the
adapter at any rank. `scaling`:
- "plain": s = 1, the SVD of E (minimises ||E - A B||_F);
- "qera" (default): s_i = sqrt(E[x_i^2]) over the layer's calibration inputs (QERA-approx): the
  Frobenius norm of (E - A B) diag(s) is the expected output error E||x (E - A B)^T||^2 when the
  input features are uncorrelated, so the spectrum is in units of output error;
- "lqer": s_i = mean |x_i| normalised by sqrt(min s * max s) (LQER).

Loads (the weight of a matrix in the allocation, `allocate_ranks`' load_i):
- "unit" (default): 1 for every dense layer. With qera scaling the spectra already measure the
  output error each rank removes, so equal loads compare layers on that common scale;
- "input_energy": the mean squared norm of the layer's calibration inputs, E||x||^2 / in. With
  plain scaling this turns the plain spectrum into an output-error estimate for isotropic inputs;
- "sensitivity": the mean squared gradient of a task loss with respect to the layer's output
  (`collect_output_sensitivity`, the diagonal empirical Fisher). With qera scaling,
  load x sigma^2 then estimates the loss increase that each rank unit removes, so layers whose
  output errors the rest of the network amplifies get more rank.
For MoE experts the load is the share of tokens routed to each expert (the MoE stage).

`allocation`: "uniform" spreads the budget evenly over the matrices (`uniform_ranks`);
"load_aware" takes the top-`budget` marginal gains load_i * sigma_{i,r}^2 (`allocate_ranks`,
optimal for the weighted error sum_i load_i sum_{j > r_i} sigma_{i,j}^2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from crucible.device import model_device, to_device
from crucible.hooks import forward_hooks
from crucible.quant import lowrank, mxfp4, rank_allocation

SCALINGS = ("plain", "qera", "lqer")
LOADS = ("unit", "input_energy", "sensitivity")
ALLOCATIONS = ("uniform", "load_aware")


@torch.no_grad()
def collect_input_stats(
    model: nn.Module,
    names: Iterable[str],
    batches: Iterable[tuple],
    forward: Callable | None = None,
    masks: Callable[[tuple], torch.Tensor] | None = None,
) -> dict[str, lowrank.InputStats]:
    """Per-feature input statistics of the named nn.Linear modules over `batches`.

    Each batch is passed as `forward(model, batch)` (default `model(*batch)`), its tensors moved to
    the model's device first. `masks(batch)`, if given, returns a (b, t) 0/1 tensor of the token
    positions to count (padding excluded); without it every input row counts. Returns name ->
    InputStats (float64 sums on the model's device)."""
    names = list(names)
    device = model_device(model)
    stats = {n: lowrank.InputStats() for n in names}
    current: dict[str, torch.Tensor | None] = {"mask": None}

    def hook(name):
        def fn(module, args):
            x = args[0]
            m = current["mask"]
            if m is not None and x.dim() == 3 and x.shape[:2] == m.shape:
                x = x[m.bool()]
            stats[name].update(x)

        return fn

    pairs = [(model.get_submodule(n), hook(n)) for n in names]
    was_training = model.training
    model.eval()
    try:
        with forward_hooks(pairs, pre=True):
            for batch in batches:
                batch = to_device(batch, device)
                current["mask"] = masks(batch) if masks is not None else None
                (forward or (lambda mdl, b: mdl(*b)))(model, batch)
    finally:
        model.train(was_training)
    empty = [n for n, s in stats.items() if s.count == 0]
    if empty:
        raise ValueError(f"no calibration input reached {empty[:3]}; check the calibration batches")
    return stats


def collect_output_sensitivity(
    model: nn.Module,
    names: Iterable[str],
    batches: Iterable,
    loss_fn: Callable[[nn.Module, object], torch.Tensor],
    masks: Callable[[object], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Mean squared gradient of a loss with respect to each named module's output, per output
    element and counted token: g_l = E ||dL/dy_l||^2 / out_features (the empirical Fisher of the
    layer's output, diagonal and isotropic). A perturbation e of the layer's output then changes
    the loss by about g_l * E||e||^2 to second order, which makes g_l the layer's load when the
    spectra are in output-error units (qera scaling). `loss_fn(model, batch)` returns a scalar;
    `masks(batch)` a (b, t) 0/1 tensor of the tokens to count. A batch's tensors go to the model's
    device first. The model's parameters get no gradient (their requires_grad is restored)."""
    names = list(names)
    device = model_device(model)
    energy = {n: 0.0 for n in names}
    count = {n: 0 for n in names}
    current: dict = {"mask": None}

    def hook(name):
        def fwd(module, args, out):
            m = current["mask"]

            def grad_hook(g):
                rows = (
                    g[m.bool()]
                    if m is not None and g.dim() == 3 and g.shape[:2] == m.shape
                    else g.reshape(-1, g.shape[-1])
                )
                energy[name] += float((rows.double() ** 2).sum()) / g.shape[-1]
                count[name] += rows.shape[0]

            out.register_hook(grad_hook)

        return fwd

    flags = {p: p.requires_grad for p in model.parameters()}
    pairs = [(model.get_submodule(n), hook(n)) for n in names]
    was_training = model.training
    model.eval()
    try:
        with forward_hooks(pairs):
            # only the named layers' weights require grad, so their outputs carry the hooks' gradients
            watched = [model.get_submodule(n).weight for n in names]
            for p in model.parameters():
                p.requires_grad_(False)
            for w in watched:
                w.requires_grad_(True)
            with torch.enable_grad():
                for batch in batches:
                    batch = to_device(batch, device)
                    current["mask"] = masks(batch) if masks is not None else None
                    loss = loss_fn(model, batch)
                    if not torch.isfinite(loss):
                        raise ValueError(f"collect_output_sensitivity: the loss is {float(loss.detach())}")
                    loss.backward()
                    for w in watched:
                        w.grad = None
    finally:
        for p, f in flags.items():
            p.requires_grad_(f)
        model.train(was_training)
    empty = [n for n in names if count[n] == 0]
    if empty:
        raise ValueError(f"no gradient reached {empty[:3]}; does the loss depend on them?")
    return {n: energy[n] / count[n] for n in names}


@dataclass
class LayerError:
    """One quantized matrix: its shape, the SVD of its (scaled) quantization error, its load."""

    name: str
    shape: tuple[int, int]
    svd: lowrank.ErrorSVD
    load: float

    @property
    def spectrum(self) -> torch.Tensor:
        return self.svd.S

    @property
    def max_rank(self) -> int:
        return self.svd.max_rank


@dataclass
class CompensationPlan:
    layers: dict[str, LayerError]
    mode: str
    scaling: str
    load: str

    @classmethod
    def build(
        cls,
        linears: dict[str, nn.Linear],
        stats: dict[str, lowrank.InputStats] | None = None,
        mode: str = "floor",
        scaling: str = "qera",
        load: str = "unit",
        progress: Callable[[str], None] | None = None,
        sensitivity: dict[str, float] | None = None,
    ) -> "CompensationPlan":
        """Quantize each layer's weight, factorize its error (see the module docstring).
        `stats` is needed unless scaling is "plain" and load is "unit"; load "sensitivity" takes
        each layer's load from `sensitivity` (collect_output_sensitivity)."""
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        if load not in LOADS:
            raise ValueError(f"load must be one of {LOADS}, got {load!r}")
        needs_stats = scaling != "plain" or load == "input_energy"
        if load == "sensitivity":
            absent = [n for n in linears if sensitivity is None or n not in sensitivity]
            if absent:
                raise ValueError(f"load 'sensitivity' needs each layer's output sensitivity; none for {absent[:3]}")
        missing = [n for n in linears if needs_stats and (stats is None or n not in stats)]
        if missing:
            raise ValueError(f"scaling {scaling!r} / load {load!r} need calibration statistics; none for {missing[:3]}")
        layers = {}
        for name, linear in linears.items():
            w = linear.weight.detach().to(torch.float32)
            if not torch.isfinite(w).all():
                raise ValueError(f"{name}.weight holds NaN or inf; cannot quantize it")
            err = w - mxfp4.dequantize(mxfp4.quantize(w, mode=mode))
            s = None if scaling == "plain" else stats[name].scale(scaling)
            weight = 1.0
            if load == "input_energy":
                st = stats[name]
                weight = float(st.sum_sq.sum() / (st.count * st.in_features))
            elif load == "sensitivity":
                weight = float(sensitivity[name])
            layers[name] = LayerError(name, tuple(w.shape), lowrank.factorize(err, s), weight)
            if progress is not None:
                progress(name)
        return cls(layers, mode, scaling, load)

    @property
    def total_rank(self) -> int:
        """The largest budget: sum over matrices of min(out, in)."""
        return sum(layer.max_rank for layer in self.layers.values())

    def ranks(self, budget: int, allocation: str = "load_aware") -> dict[str, int]:
        """name -> rank, summing to `budget` (ValueError if it exceeds total_rank)."""
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        if budget > self.total_rank:
            raise ValueError(
                f"rank budget {budget} exceeds the total rank {self.total_rank} of the "
                f"{len(self.layers)} quantized matrices (sum of min(out, in))"
            )
        names = list(self.layers)
        if allocation == "uniform":
            r = rank_allocation.uniform_ranks([self.layers[n].max_rank for n in names], budget)
        else:
            r = rank_allocation.allocate_ranks(
                [self.layers[n].spectrum for n in names], [self.layers[n].load for n in names], budget
            )
        return dict(zip(names, (int(x) for x in r)))

    def weighted_error(self, ranks: dict[str, int]) -> float:
        """sum_i load_i * sum_{j > r_i} sigma_{i,j}^2 (the error the allocation minimises)."""
        names = list(self.layers)
        return rank_allocation.weighted_error(
            [self.layers[n].spectrum for n in names],
            [self.layers[n].load for n in names],
            [ranks.get(n, 0) for n in names],
        )

    def adapters(self, ranks: dict[str, int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """name -> (A, B) for every layer of positive rank."""
        return {n: lowrank.compensate(self.layers[n].svd, r) for n, r in ranks.items() if r > 0}

    def adapter_bytes(self, ranks: dict[str, int], itemsize: int = 2) -> int:
        """Bytes of the adapters at `ranks`: r * (out + in) elements of `itemsize` bytes each."""
        return sum(r * sum(self.layers[n].shape) * itemsize for n, r in ranks.items())
