"""GMixout: Mixout with an EMA anchor, a mask period and sparse updates, for any `nn.Linear`.

Mixout (Lee, Cho & Kang, "Mixout: Effective Regularization to Finetune Large-scale Pretrained
Language Models", ICLR 2020) replaces, at each training step, each weight element by an anchor u
with probability p and rescales the rest so that the expectation is kept:

    w_mix = (M * u + (1 - M) * w - p * u) / (1 - p),   M ~ Bernoulli(p) elementwise,

i.e. w_mix = u where M = 1 and u + (w - u) / (1 - p) where M = 0, so E_M[w_mix] = w and the gradient
reaches w only where M = 0. GMixout ("We revisit Mixout ...", docs/methods.md, finetune) generalises it:
- anchor: 'pretrained' (u = the weights at wrap time, fixed) or 'ema' (after every optimizer step
  u <- beta * u + (1 - beta) * w);
- period: the mask is resampled every k steps (at steps 0, k, 2k, ...) rather than every step;
- sparse: only the elements under M = 0 are updated, by a sparse AdamW: `GMixout.step(optimizer)`
  hides each wrapped weight's gradient from the (torch.optim.AdamW) optimizer, lets it step the
  other parameters, then applies AdamW to the wrapped weights at the unmasked elements only
  (index_select / index_copy_ on flat indices computed when the mask is resampled), with the
  group's lr, betas, eps and weight decay and the optimizer's own state tensors (exp_avg,
  exp_avg_sq, step), so checkpoints and LR schedulers work unchanged. Masked elements are untouched
  by momentum and by decoupled weight decay, and their moments are neither decayed nor updated;
  the work per step scales with the (1 - p) share of elements. The AdamW `step` (bias correction)
  is per tensor, not per element, as in torch. amsgrad/maximize are not supported in sparse mode.
Plain Mixout is anchor='pretrained', period=1, sparse=False.

Only the weight of a wrapped Linear is mixed; its bias is trained as usual (as in Mixout's
reference implementation). In eval mode (`module.eval()`) the layer uses w, with no mixing and no
overhead. The wrapped layer keeps the parameter names `weight` and `bias`, so the model's
state_dict is unchanged (a wrapped Hugging Face model saves and loads as the unwrapped one).

Contract of one training step:

    gm = GMixout.wrap(model, GMixoutConfig(p=0.8, anchor="ema", period=10, sparse=True))
    gm.begin_step()              # resamples the masks when step % period == 0
    loss = ...; loss.backward()
    gm.step(optimizer)           # optimizer.step(), sparse restore, EMA update, step += 1

Checkpoint with `gm.state_dict()` (anchors, masks, mask RNG state, step counter; all tensors or
ints) and `gm.load_state_dict(...)` after wrapping an identically built model.

The masks come only from the GMixout's own generator (seeded with `GMixoutConfig.seed`), never from
torch's global RNG, so models wrapped and trained in threads of one process do not change each
other's masks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from crucible.seeding import torch_generator


@dataclass(frozen=True)
class GMixoutConfig:
    """p: mask probability in [0, 1); anchor: 'pretrained' | 'ema'; ema_beta in [0, 1);
    period: resample the mask every `period` steps (>= 1); sparse: update only unmasked elements;
    modules: regex searched in the qualified names of nn.Linear modules to wrap; seed: mask RNG."""

    p: float = 0.8
    anchor: Literal["pretrained", "ema"] = "ema"
    ema_beta: float = 0.99
    period: int = 10
    sparse: bool = True
    modules: str = r"encoder\.layer\.\d+\."
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.p < 1.0:
            raise ValueError(f"GMixoutConfig.p = {self.p!r}: expected 0 <= p < 1")
        if self.anchor not in ("pretrained", "ema"):
            raise ValueError(f"GMixoutConfig.anchor = {self.anchor!r}: expected 'pretrained' or 'ema'")
        if not 0.0 <= self.ema_beta < 1.0:
            raise ValueError(f"GMixoutConfig.ema_beta = {self.ema_beta!r}: expected 0 <= beta < 1")
        if self.period < 1:
            raise ValueError(f"GMixoutConfig.period = {self.period!r}: expected an integer >= 1")

    @classmethod
    def mixout(cls, p: float = 0.8, modules: str = r"encoder\.layer\.\d+\.", seed: int = 0) -> "GMixoutConfig":
        """Plain Mixout: fixed pretrained anchor, a new mask every step, dense updates."""
        return cls(p=p, anchor="pretrained", period=1, sparse=False, modules=modules, seed=seed)


def mix_weight(w: torch.Tensor, u: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """(M u + (1 - M) w - p u) / (1 - p) with M = `mask` (bool, True = take the anchor).
    Differentiable in w; the gradient is (1 - M) / (1 - p) times the upstream gradient."""
    return torch.where(mask, u, (w - p * u) / (1.0 - p))


class MixLinear(nn.Module):
    """An nn.Linear whose weight is mixed with an anchor in training mode. Shares the original
    layer's Parameters (same names), and holds the anchor and the mask as non-persistent buffers."""

    def __init__(self, linear: nn.Linear, p: float):
        super().__init__()
        self.in_features, self.out_features, self.p = linear.in_features, linear.out_features, p
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("anchor", linear.weight.detach().clone(), persistent=False)
        self.register_buffer("mask", torch.zeros_like(linear.weight, dtype=torch.bool), persistent=False)
        # flat indices of the unmasked elements (derived from the mask; used by sparse updates)
        self.register_buffer(
            "update_index", torch.arange(linear.weight.numel(), device=linear.weight.device), persistent=False
        )

    def set_mask(self, mask: torch.Tensor) -> None:
        self.mask.copy_(mask)
        self.update_index = (~self.mask).flatten().nonzero().squeeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.p > 0:
            return F.linear(x, mix_weight(self.weight, self.anchor, self.mask, self.p), self.bias)
        return F.linear(x, self.weight, self.bias)

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        linear.weight = self.weight
        if self.bias is not None:
            linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, p={self.p}"


@torch.no_grad()
def _sparse_adamw(
    weight: torch.Tensor,
    grad: torch.Tensor,
    index: torch.Tensor,
    group: dict,
    state: dict,
    optimizer: torch.optim.Optimizer,
) -> None:
    """torch.optim.AdamW's update (single-tensor form) applied at the flat `index` of `weight` only."""
    if not isinstance(optimizer, torch.optim.AdamW) or group.get("amsgrad") or group.get("maximize"):
        raise TypeError(
            f"GMixout sparse mode needs torch.optim.AdamW without amsgrad/maximize; got "
            f"{type(optimizer).__name__}; use sparse=False with other optimizers"
        )
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
    state["step"] = state["step"] + 1  # not in place: a loaded state dict may share this tensor
    t = float(state["step"])
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    w_flat, m_flat, v_flat = weight.data.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    g = grad.reshape(-1).index_select(0, index)
    w, m, v = w_flat.index_select(0, index), m_flat.index_select(0, index), v_flat.index_select(0, index)
    w.mul_(1 - lr * wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction2_sqrt = (1 - beta2**t) ** 0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    w.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
    w_flat.index_copy_(0, index, w)
    m_flat.index_copy_(0, index, m)
    v_flat.index_copy_(0, index, v)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


class GMixout:
    """The wrapped layers of one model and the state that drives them (step, mask RNG)."""

    def __init__(self, model: nn.Module, config: GMixoutConfig, layers: dict[str, MixLinear]):
        self.model, self.config, self.layers = model, config, layers
        self.step_count = 0
        self.generator = torch_generator(config.seed)

    @classmethod
    def wrap(cls, model: nn.Module, config: GMixoutConfig) -> "GMixout":
        """Replace, in place, every nn.Linear of `model` whose qualified name matches
        `config.modules` (re.search) by a MixLinear anchored at its current weight. Raises
        ValueError when the pattern matches no Linear."""
        from crucible.models import resolve_modules

        pattern = re.compile(resolve_modules(model, config.modules))
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and pattern.search(n)]
        if not names:
            linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
            raise ValueError(
                f"GMixout modules pattern {config.modules!r} matches no nn.Linear; the model's "
                f"Linear layers are e.g. {linears[:4]}"
            )
        layers = {}
        for name in names:
            layers[name] = MixLinear(model.get_submodule(name), config.p)
            _set_submodule(model, name, layers[name])
        return cls(model, config, layers)

    def unwrap(self) -> nn.Module:
        """Put plain nn.Linear layers (sharing the trained parameters) back; returns the model."""
        for name, layer in self.layers.items():
            _set_submodule(self.model, name, layer.to_linear())
        self.layers = {}
        return self.model

    @torch.no_grad()
    def resample(self) -> None:
        for layer in self.layers.values():
            draw = torch.rand(layer.mask.shape, generator=self.generator)
            layer.set_mask(draw.to(layer.mask.device) < self.config.p)

    def begin_step(self) -> None:
        """Call before the forward pass of each training step."""
        if self.step_count % self.config.period == 0:
            self.resample()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(), then (sparse) restore the masked elements and their optimizer state,
        then (ema) move the anchors toward the new weights; advances the step counter."""
        if self.config.sparse:
            hidden = {layer: layer.weight.grad for layer in self.layers.values()}
            for layer in hidden:
                layer.weight.grad = None  # torch optimizers skip parameters without a gradient
            optimizer.step()
            groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
            for layer, grad in hidden.items():
                layer.weight.grad = grad
                if grad is not None:
                    _sparse_adamw(
                        layer.weight,
                        grad,
                        layer.update_index,
                        groups[id(layer.weight)],
                        optimizer.state[layer.weight],
                        optimizer,
                    )
        else:
            optimizer.step()
        with torch.no_grad():
            if self.config.anchor == "ema":
                beta = self.config.ema_beta
                for layer in self.layers.values():
                    layer.anchor.mul_(beta).add_(layer.weight.detach(), alpha=1.0 - beta)
        self.step_count += 1

    def state_dict(self) -> dict:
        out = {"step": self.step_count, "rng": self.generator.get_state()}
        for name, layer in self.layers.items():
            out[f"anchor.{name}"] = layer.anchor.detach().clone()
            out[f"mask.{name}"] = layer.mask.clone()
        return out

    def load_state_dict(self, state: dict) -> None:
        expected = {f"{k}.{n}" for n in self.layers for k in ("anchor", "mask")} | {"step", "rng"}
        if set(state) != expected:
            raise ValueError(
                f"GMixout state does not match the wrapped layers: missing "
                f"{sorted(expected - set(state))[:3]}, unexpected {sorted(set(state) - expected)[:3]}"
            )
        self.step_count = int(state["step"])
        self.generator.set_state(state["rng"])
        with torch.no_grad():
            for name, layer in self.layers.items():
                layer.anchor.copy_(state[f"anchor.{name}"])
                layer.set_mask(state[f"mask.{name}"])
