"""Router top-k choices of a transformers MoE: record, replay, compare (docs/methods.md, moe).

    routes = record_routes(float_model, batches)        # per MoE layer: top-k expert ids [tokens, k]
    routes.save("routes.safetensors"); routes = Routes.load("routes.safetensors")
    with replay(qmodel, routes):                        # the recorded top-k sets are forced
        qmodel(batch)
    consistency(routes, record_routes(qmodel, batches)) # per layer: set / top-1 agreement
    expert_load(routes)                                 # [layers, E] share of tokens per expert
    hidden_drift(qmodel, float_model, batches)          # per layer ||h - h_ref|| / ||h_ref||

A MoE layer is a transformers SparseMoeBlock (Mixtral, Qwen3-MoE): a module with a router `gate`
(weight [E, H], `top_k`; forward(hidden [T, H]) -> (logits [T, E], top-k weights [T, k], top-k
index [T, k])) and `experts` (the fused experts, or crucible.moe.mx_experts.MXExperts). Qwen3-MoE's dense
layers (`mlp_only_layers`, `decoder_sparse_step`) have no router and are not MoE layers here.

Batches: each item of `batches` is one forward call: a LongTensor of input ids [B, T], a dict of
keyword arguments (input_ids, attention_mask, ...) or a tuple of positional arguments. Tokens are
counted in the order the router sees them: batch after batch, each flattened row-major ([B, T] ->
B * T, padding included, since the router routes padding too).

Replay, as in rollout routing replay (R3): a forward hook on every router (installed first, so other
hooks see the forced output) replaces the top-k index by the recorded one, token by token through a
cursor per layer, and recomputes the combine weights from the current router's logits: softmax over
all E logits (in float32, as the routers do), gathered at the forced experts, renormalised over them
when the router renormalises (Mixtral always, Qwen3-MoE iff config.norm_topk_prob). Gradients flow
through those weights to the logits, as they do without replay. The hooks are removed on exit, also
when the body raises.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from crucible.device import model_device, to_device
from crucible.hooks import forward_hooks

__all__ = [
    "Routes",
    "moe_layers",
    "router_renormalises",
    "record_routes",
    "replay",
    "consistency",
    "expert_load",
    "hidden_drift",
    "forward_batch",
    "read_safetensors",
    "check_routes",
]

FORMAT = "crucible.routes/1"


# --------------------------------------------------------------------------- the model's MoE layers


def _is_moe_block(m: nn.Module) -> bool:
    gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
    return (
        isinstance(gate, nn.Module)
        and isinstance(experts, nn.Module)
        and hasattr(gate, "top_k")
        and isinstance(getattr(gate, "weight", None), torch.Tensor)
        and gate.weight.dim() == 2
        and hasattr(experts, "num_experts")
    )


def moe_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> SparseMoeBlock (a module with a top-k router `gate` and `experts`), in module order.
    Raises ValueError if the model has none."""
    found = {n: m for n, m in model.named_modules() if _is_moe_block(m)}
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no MoE layer (a module with a top-k router `.gate` and "
            f"`.experts`, as transformers' Mixtral / Qwen3-MoE SparseMoeBlock)"
        )
    return found


def router_renormalises(gate: nn.Module) -> bool:
    """Whether the router divides its top-k probabilities by their sum: Qwen3-MoE (and any router
    with `norm_topk_prob`) iff norm_topk_prob; Mixtral always. ValueError for another router."""
    if hasattr(gate, "norm_topk_prob"):
        return bool(gate.norm_topk_prob)
    if type(gate).__name__ == "MixtralTopKRouter":
        return True
    raise ValueError(
        f"router {type(gate).__name__}: cannot tell whether it renormalises its top-k weights; "
        f"supported are MixtralTopKRouter and routers with a `norm_topk_prob` attribute (Qwen3-MoE)"
    )


def forward_batch(model: nn.Module, batch, **kwargs):
    """model(batch) for a tensor of input ids, model(**batch) for a dict, model(*batch) for a tuple;
    the batch's tensors go to the model's device first."""
    batch = to_device(batch, model_device(model))
    if isinstance(batch, torch.Tensor):
        return model(batch, **kwargs)
    if isinstance(batch, dict):
        return model(**batch, **kwargs)
    if isinstance(batch, (tuple, list)):
        return model(*batch, **kwargs)
    raise ValueError(
        f"a batch must be a tensor of input ids, a dict of model inputs or a tuple, got {type(batch).__name__}"
    )


# --------------------------------------------------------------------------- routes


@dataclass
class Routes:
    """The top-k expert ids each MoE layer chose, token by token.

    indices: layer name -> integer tensor [N, k] (int16 when E fits, else int64), the router's order
    (descending probability); logits: optional layer name -> float32 [N, E]; num_experts E and top_k k,
    the same for every layer; batch_tokens: tokens per recorded forward call (they sum to N).
    Validated on construction (ValueError naming the layer and the field)."""

    indices: dict[str, torch.Tensor]
    num_experts: int
    top_k: int
    batch_tokens: list[int]
    logits: dict[str, torch.Tensor] | None = None
    offsets: list[int] = field(init=False, repr=False)

    def __post_init__(self):
        self.batch_tokens = [int(n) for n in self.batch_tokens]
        if not self.indices:
            raise ValueError("Routes: no layer recorded")
        if self.num_experts < 1 or not (1 <= self.top_k <= self.num_experts):
            raise ValueError(
                f"Routes: need 1 <= top_k <= num_experts, got top_k {self.top_k}, num_experts {self.num_experts}"
            )
        if any(n < 0 for n in self.batch_tokens):
            raise ValueError(f"Routes: batch_tokens must be >= 0, got {self.batch_tokens}")
        total = sum(self.batch_tokens)
        for name, idx in self.indices.items():
            if idx.dtype not in (torch.int16, torch.int32, torch.int64) or tuple(idx.shape) != (total, self.top_k):
                raise ValueError(
                    f"Routes: layer {name!r}: indices must be an integer tensor [{total}, {self.top_k}] "
                    f"(tokens, top_k), got {idx.dtype} {list(idx.shape)}"
                )
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_experts):
                raise ValueError(
                    f"Routes: layer {name!r}: expert ids must lie in [0, {self.num_experts}), got "
                    f"[{int(idx.min())}, {int(idx.max())}]"
                )
            if idx.numel() and bool((idx.sort(-1).values.diff(dim=-1) == 0).any()):
                raise ValueError(f"Routes: layer {name!r}: a token's top-{self.top_k} set repeats an expert")
        if self.logits is not None:
            if set(self.logits) != set(self.indices):
                raise ValueError(
                    f"Routes: logits are for layers {sorted(self.logits)}, indices for {sorted(self.indices)}"
                )
            for name, lg in self.logits.items():
                if not lg.is_floating_point() or tuple(lg.shape) != (total, self.num_experts):
                    raise ValueError(
                        f"Routes: layer {name!r}: logits must be float [{total}, {self.num_experts}], "
                        f"got {lg.dtype} {list(lg.shape)}"
                    )
                if not bool(torch.isfinite(lg).all()):
                    raise ValueError(f"Routes: layer {name!r}: logits hold NaN or inf")
        self.offsets = [0]
        for n in self.batch_tokens:
            self.offsets.append(self.offsets[-1] + n)

    @property
    def layers(self) -> list[str]:
        return list(self.indices)

    @property
    def tokens(self) -> int:
        return self.offsets[-1]

    def batch(self, i: int) -> "Routes":
        """The routes of recorded forward call i alone (for replaying one batch)."""
        return self.batches(i, i + 1)

    def batches(self, start: int, stop: int) -> "Routes":
        """The routes of recorded forward calls start..stop-1."""
        n = len(self.batch_tokens)
        if not (0 <= start < stop <= n):
            raise ValueError(f"Routes: batches [{start}, {stop}) out of range; {n} forward calls were recorded")
        a, b = self.offsets[start], self.offsets[stop]
        return Routes(
            {k: v[a:b] for k, v in self.indices.items()},
            self.num_experts,
            self.top_k,
            self.batch_tokens[start:stop],
            None if self.logits is None else {k: v[a:b] for k, v in self.logits.items()},
        )

    def metadata(self) -> dict[str, str]:
        return {
            "format": "pt",
            "crucible.routes": json.dumps(
                {
                    "format": FORMAT,
                    "layers": self.layers,
                    "num_experts": self.num_experts,
                    "top_k": self.top_k,
                    "batch_tokens": self.batch_tokens,
                    "logits": self.logits is not None,
                }
            ),
        }

    def save(self, path: Path | str | None = None) -> bytes:
        """safetensors bytes (deterministic): `<layer>.index` (and `<layer>.logits`), metadata
        "crucible.routes" (JSON: layers, num_experts, top_k, batch_tokens). Written to `path` if given."""
        from crucible.serialize import safetensors_bytes

        tensors = {f"{k}.index": v.contiguous() for k, v in self.indices.items()}
        if self.logits is not None:
            tensors.update({f"{k}.logits": v.to(torch.float32).contiguous() for k, v in self.logits.items()})
        data = safetensors_bytes(tensors, self.metadata())
        if path is not None:
            Path(path).write_bytes(data)
        return data

    @classmethod
    def load(cls, path: Path | str) -> "Routes":
        """Read a file written by save. ValueError naming the file (and the tensor) for a truncated
        or foreign file, a missing tensor or shapes that do not fit."""
        tensors, meta = read_safetensors(path)
        if "crucible.routes" not in meta:
            raise ValueError(f"{path}: no 'crucible.routes' metadata; not a routes file written by Routes.save")
        info = json.loads(meta["crucible.routes"])
        indices, logits = {}, {} if info.get("logits") else None
        for layer in info["layers"]:
            for leaf, into in (("index", indices), ("logits", logits)):
                if into is None:
                    continue
                if f"{layer}.{leaf}" not in tensors:
                    raise ValueError(f"{path}: tensor '{layer}.{leaf}' is missing")
                into[layer] = tensors.pop(f"{layer}.{leaf}")
        if tensors:
            raise ValueError(f"{path}: unexpected tensors {sorted(tensors)[:5]}")
        try:
            return cls(indices, int(info["num_experts"]), int(info["top_k"]), info["batch_tokens"], logits)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


def read_safetensors(path: Path | str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file: crucible.serialize.read_safetensors (a ValueError
    naming the file, and for a truncated one the first tensor whose bytes lie past the end) without
    its finite check: the callers check each tensor themselves, naming it."""
    from crucible.serialize import read_safetensors as read

    return read(path, finite=False)


# --------------------------------------------------------------------------- record


def _gate_dims(block: nn.Module) -> tuple[int, int]:
    return int(block.gate.weight.shape[0]), int(block.gate.top_k)


@torch.no_grad()
def record_routes(model: nn.Module, batches: Iterable, logits: bool = False) -> Routes:
    """Run `batches` through `model` (eval mode, no grad) and keep each MoE layer's top-k expert ids
    per token (and its router logits if `logits`). Under `replay` the forced ids are recorded.
    Raises ValueError if the layers disagree on E or k, or saw different numbers of calls/tokens."""
    layers = moe_layers(model)
    dims = {n: _gate_dims(b) for n, b in layers.items()}
    if len(set(dims.values())) != 1:
        raise ValueError(f"record_routes: the MoE layers differ in (num_experts, top_k): {dims}")
    num_experts, top_k = next(iter(dims.values()))
    small = num_experts <= torch.iinfo(torch.int16).max
    idx: dict[str, list] = {n: [] for n in layers}
    lg: dict[str, list] = {n: [] for n in layers}
    calls: dict[str, list] = {n: [] for n in layers}

    def hook(name):
        def fn(module, args, output):
            index = output[2].reshape(-1, top_k)
            idx[name].append(index.detach().to("cpu", torch.int16 if small else torch.int64))
            calls[name].append(index.shape[0])
            if logits:
                lg[name].append(output[0].detach().reshape(index.shape[0], -1).to("cpu", torch.float32))

        return fn

    pairs = [(b.gate, hook(n)) for n, b in layers.items()]
    was_training = model.training
    model.eval()
    try:
        with forward_hooks(pairs):
            for batch in batches:
                forward_batch(model, batch)
    finally:
        model.train(was_training)
    first = next(iter(layers))
    for n in layers:
        if calls[n] != calls[first]:
            raise ValueError(
                f"record_routes: layer {n!r} saw calls of {calls[n][:5]} tokens, layer {first!r} "
                f"{calls[first][:5]}; every MoE layer must route every token once"
            )
    if not calls[first]:
        raise ValueError("record_routes: no batch reached the routers (empty batches?)")
    cat = lambda parts: torch.cat(parts) if parts else torch.zeros(0)  # noqa: E731
    return Routes(
        {n: cat(v) for n, v in idx.items()},
        num_experts,
        top_k,
        calls[first],
        {n: cat(v) for n, v in lg.items()} if logits else None,
    )


# --------------------------------------------------------------------------- replay


def check_routes(model_layers: dict[str, nn.Module], routes: Routes, what: str) -> None:
    if list(model_layers) != routes.layers:
        raise ValueError(
            f"{what}: the routes hold {len(routes.layers)} MoE layers {routes.layers[:4]}, the model has "
            f"{len(model_layers)} {list(model_layers)[:4]}"
        )
    for n, b in model_layers.items():
        e, k = _gate_dims(b)
        if (e, k) != (routes.num_experts, routes.top_k):
            raise ValueError(
                f"{what}: layer {n!r} routes top-{k} of {e} experts, the routes top-{routes.top_k} of "
                f"{routes.num_experts}"
            )


@contextlib.contextmanager
def replay(model: nn.Module, routes: Routes, strict: bool = True) -> Iterator[dict[str, int]]:
    """Force `routes`' top-k sets in every MoE layer of `model` (see the module docstring); yields the
    per-layer cursors (tokens consumed so far). A call that needs more tokens than remain raises
    ValueError naming the layer and both counts; with `strict`, so does leaving the block (without
    an exception) before every recorded token was replayed."""
    layers = moe_layers(model)
    check_routes(layers, routes, "replay")
    cursor = {n: 0 for n in layers}
    total = routes.tokens

    def hook(name, renorm):
        recorded = routes.indices[name]

        def fn(module, args, output):
            logits, weights, index = output
            t = index.shape[0]
            c = cursor[name]
            if c + t > total:
                raise ValueError(
                    f"replay: layer {name!r} routes {c + t} tokens so far (this call {t}), but the "
                    f"routes recorded {total}"
                )
            forced = recorded[c : c + t].to(device=index.device, dtype=index.dtype)
            probs = torch.softmax(logits.reshape(t, -1).float(), dim=-1)
            w = probs.gather(1, forced.long())
            if renorm:
                w = w / w.sum(dim=-1, keepdim=True)
            cursor[name] = c + t
            return logits, w.to(weights.dtype), forced

        return fn

    hooks = {n: hook(n, router_renormalises(b.gate)) for n, b in layers.items()}
    with forward_hooks([(b.gate, hooks[n]) for n, b in layers.items()], prepend=True):
        yield cursor
    if strict:
        short = {n: c for n, c in cursor.items() if c != total}
        if short:
            n, c = next(iter(short.items()))
            raise ValueError(
                f"replay: layer {n!r} replayed {c} tokens, but the routes recorded {total} "
                f"(pass strict=False to replay a prefix)"
            )


# --------------------------------------------------------------------------- compare


def consistency(a: Routes, b: Routes) -> dict[str, dict[str, float]]:
    """Per layer: set_agreement, the share of tokens whose top-k set is the same in a and b, and
    top1_agreement, the share whose first (most probable) expert is the same. ValueError unless a
    and b hold the same layers, tokens and k."""
    if a.layers != b.layers:
        raise ValueError(
            f"consistency: routes for different layers: {len(a.layers)} {a.layers[:3]} vs "
            f"{len(b.layers)} {b.layers[:3]}"
        )
    if (a.tokens, a.top_k) != (b.tokens, b.top_k):
        raise ValueError(f"consistency: routes of {a.tokens} tokens (top-{a.top_k}) vs {b.tokens} (top-{b.top_k})")
    if a.tokens == 0:
        raise ValueError("consistency: the routes hold no token")
    out = {}
    for n in a.layers:
        x, y = a.indices[n].long(), b.indices[n].long()
        same_set = (x.sort(-1).values == y.sort(-1).values).all(-1)
        out[n] = {
            "set_agreement": float(same_set.double().mean()),
            "top1_agreement": float((x[:, 0] == y[:, 0]).double().mean()),
        }
    return out


def expert_load(routes: Routes) -> torch.Tensor:
    """[layers, E] float64: the share of tokens routed to each expert (count / tokens; each row sums
    to top_k). This is the load of the load-aware rank allocation (docs/methods.md, moe)."""
    if routes.tokens == 0:
        raise ValueError("expert_load: the routes hold no token")
    rows = [
        torch.bincount(routes.indices[n].long().flatten(), minlength=routes.num_experts).double() / routes.tokens
        for n in routes.layers
    ]
    return torch.stack(rows)


@torch.no_grad()
def hidden_drift(model: nn.Module, reference: nn.Module, batches: Iterable) -> dict[str, float]:
    """Per decoder layer l: ||h_l - h_ref,l|| / ||h_ref,l||, Frobenius norms over all tokens of all
    batches, from output_hidden_states (key "layers.<l>"; transformers reports the last layer after
    the final norm). Run it inside `replay(model, ...)` to measure the drift under forced routes."""
    diff: list[float] | None = None
    ref: list[float] | None = None
    modes = (model.training, reference.training)
    model.eval()
    reference.eval()
    try:
        for batch in batches:
            h = forward_batch(model, batch, output_hidden_states=True).hidden_states[1:]
            r = forward_batch(reference, batch, output_hidden_states=True).hidden_states[1:]
            if len(h) != len(r):
                raise ValueError(f"hidden_drift: the model has {len(h)} layers, the reference {len(r)}")
            d = [float((x.double() - y.double()).pow(2).sum()) for x, y in zip(h, r)]
            e = [float(y.double().pow(2).sum()) for y in r]
            diff = d if diff is None else [p + q for p, q in zip(diff, d)]
            ref = e if ref is None else [p + q for p, q in zip(ref, e)]
    finally:
        model.train(modes[0])
        reference.train(modes[1])
    if diff is None:
        raise ValueError("hidden_drift: no batch given")
    return {f"layers.{i}": math.sqrt(d / r) if r > 0 else float("nan") for i, (d, r) in enumerate(zip(diff, ref))}
