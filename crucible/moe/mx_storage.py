"""A quantized MoE in bytes and on disk (docs/methods.md, moe).

    moe_nbytes(qmodel)                                          # bytes by kind, bits per weight
    save_quantized_moe(qmodel, "moe.safetensors"); load_quantized_moe("moe.safetensors", skeleton)

File (one safetensors file): every tensor of the quantized model's state dict (packed and scales
uint8, adapters in adapter_dtype, only when rank > 0), a tensor sharing storage with an earlier one
(tied embeddings) written once; metadata "crucible.moe" = JSON {experts: {name: {num_experts,
hidden, intermediate, mode, gate_up_ranks, down_ranks}}, linears: {name: {in, out, mode, rank}},
adapter_dtype, tied: {name: name written}}.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from crucible.moe.mx_experts import MXExperts, _set_module
from crucible.moe.routing import moe_layers, read_safetensors
from crucible.quant import mxfp4
from crucible.quant.linear import ADAPTER_DTYPES, MXLinear

__all__ = ["moe_nbytes", "save_quantized_moe", "load_quantized_moe"]


def _padded(k: int) -> int:
    return -(-k // mxfp4.BLOCK) * mxfp4.BLOCK


# --------------------------------------------------------------------------- size


def moe_nbytes(model: nn.Module) -> dict:
    """Bytes by kind: expert_weights / linear_weights (MXFP4 codes + scales), expert_adapters /
    linear_adapters (their storage dtype), float (every other parameter and persistent buffer, tied
    tensors once), total; bits_per_weight: experts and linears (codes + scales, 4.25 when the input
    dims are multiples of 32), the same with their adapters, and the whole model (total bytes over
    its float parameter count)."""
    out = {"expert_weights": 0, "expert_adapters": 0, "linear_weights": 0, "linear_adapters": 0, "float": 0}
    n_expert, n_linear, n_float = 0, 0, 0
    owned = set()
    for name, m in model.named_modules():
        if isinstance(m, MXExperts):
            b = m.nbytes()
            out["expert_weights"] += b["packed"] + b["scales"]
            out["expert_adapters"] += b["adapter"]
            n_expert += m.num_weights()
            owned.add(name)
        elif isinstance(m, MXLinear):
            b = m.nbytes()
            out["linear_weights"] += b["packed"] + b["scales"]
            out["linear_adapters"] += b["adapter"]
            out["float"] += b["bias"]
            n_linear += m.in_features * m.out_features
            n_float += 0 if m.bias is None else m.bias.numel()
            owned.add(name)
    seen = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if key.rpartition(".")[0] in owned or t is None:
            continue
        ptr = (t.data_ptr(), t.numel(), t.dtype)
        if t.numel() and ptr in seen:
            continue
        seen.add(ptr)
        out["float"] += t.numel() * t.element_size()
        n_float += t.numel()
    out["total"] = sum(out.values())
    bits = lambda nbytes, n: 8.0 * nbytes / n if n else 0.0  # noqa: E731
    out["bits_per_weight"] = {
        "experts": bits(out["expert_weights"], n_expert),
        "experts_with_adapters": bits(out["expert_weights"] + out["expert_adapters"], n_expert),
        "linears": bits(out["linear_weights"], n_linear),
        "linears_with_adapters": bits(out["linear_weights"] + out["linear_adapters"], n_linear),
        "model": bits(out["total"], n_expert + n_linear + n_float),
    }
    return out


# --------------------------------------------------------------------------- file


def _adapter_dtype(model: nn.Module) -> str:
    found = {m.adapter_dtype for m in model.modules() if isinstance(m, (MXExperts, MXLinear))}
    if not found:
        raise ValueError("the model has no MXExperts; quantize it first (quantize_moe)")
    if len(found) > 1:
        raise ValueError(f"the quantized modules use several adapter dtypes {sorted(found)}; one file holds one")
    return found.pop()


def save_quantized_moe(
    model: nn.Module, path: Path | str | None = None, metadata: dict[str, str] | None = None
) -> bytes:
    """The quantized MoE as safetensors bytes (deterministic; also written to `path` if given); the
    format is in the module docstring. Dequantized caches are never written."""
    from crucible.serialize import safetensors_bytes

    adapter_dtype = _adapter_dtype(model)
    store = ADAPTER_DTYPES[adapter_dtype]
    experts = {n: m for n, m in model.named_modules() if isinstance(m, MXExperts)}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, MXLinear)}
    if not experts:
        raise ValueError("the model has no MXExperts; quantize it first (quantize_moe)")
    tensors, tied, first = {}, {}, {}
    for key, t in model.state_dict().items():
        if t is None:
            continue
        owner, _, leaf = key.rpartition(".")
        if "lora_" in leaf and (owner in experts or owner in linears):
            if t.numel():
                tensors[key] = t.detach().to(store).contiguous()
            continue
        ptr = (t.data_ptr(), t.numel(), t.dtype, tuple(t.shape))
        if t.numel() and ptr in first:
            tied[key] = first[ptr]
            continue
        first[ptr] = key
        tensors[key] = t.detach().contiguous()
    info = {
        "experts": {
            n: {
                "num_experts": m.num_experts,
                "hidden": m.hidden_dim,
                "intermediate": m.intermediate_dim,
                "mode": m.mode,
                "gate_up_ranks": m.ranks["gate_up"],
                "down_ranks": m.ranks["down"],
            }
            for n, m in experts.items()
        },
        "linears": {
            n: {"in": m.in_features, "out": m.out_features, "mode": m.mode, "rank": m.rank} for n, m in linears.items()
        },
        "adapter_dtype": adapter_dtype,
        "tied": tied,
    }
    data = safetensors_bytes(
        tensors, {**(metadata or {}), "format": "pt", "crucible.moe": json.dumps(info, sort_keys=True)}
    )
    if path is not None:
        Path(path).write_bytes(data)
    return data


def _check(key: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None, path) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape) or (dtype is not None and t.dtype != dtype):
        raise ValueError(
            f"{path}: tensor '{key}' is {t.dtype} {list(t.shape)} in the file, the architecture needs "
            f"{dtype or t.dtype} {list(shape)} (a file of another model?)"
        )
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{path}: tensor '{key}' holds NaN or inf")
    if dtype == torch.uint8 and key.endswith("scales") and bool((t == mxfp4.E8M0_NAN).any()):
        raise ValueError(f"{path}: tensor '{key}' holds the NaN scale byte 255")
    return t


def _take(tensors: dict, key: str, shape: tuple, dtype: torch.dtype | None, path) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"{path}: tensor '{key}' is missing")
    return _check(key, tensors.pop(key), shape, dtype, path)


def load_quantized_moe(path: Path | str, skeleton: nn.Module) -> nn.Module:
    """Rebuild a model saved by save_quantized_moe into `skeleton` (the float architecture, any
    weights): its experts become MXExperts and its quantized linears MXLinear from the packed tensors, every
    other tensor is loaded strictly; returned in eval mode. ValueError naming the file and the
    tensor for a truncated or foreign file, a missing or extra tensor, a shape that does not fit,
    NaN / inf values or NaN scales. All-or-nothing: the skeleton is changed only on success."""
    tensors, meta = read_safetensors(path)
    if "crucible.moe" not in meta:
        raise ValueError(f"{path}: no 'crucible.moe' metadata; not a quantized MoE written by save_quantized_moe")
    info = json.loads(meta["crucible.moe"])
    adapter_dtype = info["adapter_dtype"]
    store = ADAPTER_DTYPES[adapter_dtype]
    blocks = {f"{n}.experts": b for n, b in moe_layers(skeleton).items()}
    built: dict[str, nn.Module] = {}
    for name, spec in info["experts"].items():
        if name not in blocks:
            raise ValueError(
                f"{path}: quantized experts {name!r} are not a MoE layer of the architecture "
                f"(it has {list(blocks)[:3]})"
            )
        old = blocks[name].experts
        e, two_i, h = old.gate_up_proj.shape
        i = two_i // 2
        module_args = {}
        for kind, (out, inp) in (("gate_up", (2 * i, h)), ("down", (h, i))):
            kp = _padded(inp)
            module_args[f"{kind}_packed"] = _take(
                tensors, f"{name}.{kind}_packed", (e, out, kp // 2), torch.uint8, path
            )
            module_args[f"{kind}_scales"] = _take(
                tensors, f"{name}.{kind}_scales", (e, out, kp // 32), torch.uint8, path
            )
        try:
            module = MXExperts(
                e, h, i, act_fn=old.act_fn, mode=spec["mode"], adapter_dtype=adapter_dtype, **module_args
            )
        except ValueError as exc:
            raise ValueError(f"{path}: experts {name!r}: {exc}") from None
        for kind, (out, inp) in (("gate_up", (2 * i, h)), ("down", (h, i))):
            ranks = [int(r) for r in spec[f"{kind}_ranks"]]
            if len(ranks) != e or any(r < 0 or r > min(out, inp) for r in ranks):
                raise ValueError(
                    f"{path}: experts {name!r}: {kind}_ranks {ranks} do not fit {e} experts of {out} x {inp}"
                )
            total = sum(ranks)
            if total:
                a = _take(tensors, f"{name}.{kind}_lora_a", (out, total), store, path)
                b = _take(tensors, f"{name}.{kind}_lora_b", (total, inp), store, path)
                module._set_concatenated(kind, a.float(), b.float(), ranks)
        built[name] = module
    for name, spec in info["linears"].items():
        try:
            old = skeleton.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{path}: quantized layer {name!r} does not exist in the architecture") from None
        if not isinstance(old, nn.Linear):
            raise ValueError(
                f"{path}: quantized layer {name!r} is {type(old).__name__} in the architecture, not nn.Linear"
            )
        out, inp = old.out_features, old.in_features
        packed = _take(tensors, f"{name}.packed", (out, _padded(inp) // 2), torch.uint8, path)
        scales = _take(tensors, f"{name}.scales", (out, _padded(inp) // 32), torch.uint8, path)
        bias = _take(tensors, f"{name}.bias", (out,), None, path) if old.bias is not None else None
        try:
            layer = MXLinear(inp, out, packed, scales, bias, mode=spec["mode"], adapter_dtype=adapter_dtype)
        except ValueError as exc:
            raise ValueError(f"{path}: layer {name!r}: {exc}") from None
        r = int(spec["rank"])
        if r:
            layer.set_adapter(
                _take(tensors, f"{name}.lora_a", (out, r), store, path).float(),
                _take(tensors, f"{name}.lora_b", (r, inp), store, path).float(),
            )
        built[name] = layer
    state = skeleton.state_dict()
    tied = info.get("tied", {})
    expected = {k: v for k, v in state.items() if k.rpartition(".")[0] not in built and k not in tied}
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ValueError(f"{path}: tensor '{extra[0]}' does not belong to the architecture (unexpected: {extra[:5]})")
    for k, v in expected.items():
        if k not in tensors:
            raise ValueError(f"{path}: tensor '{k}' is missing")
        _check(k, tensors[k], tuple(v.shape), None, path)
    for name, module in built.items():
        _set_module(skeleton, name, module)
    rest = {k: tensors[k] for k in expected}
    skeleton.load_state_dict(rest, strict=False)
    # a tied tensor (the LM head sharing the input embedding) is the same Parameter as the one that
    # was written: loading a copy into it is a no-op where the skeleton left it on the meta device
    # (transformers does, for a head it found no tensor for), and its memory would stay uninitialised
    for k, src in tied.items():
        owner, _, leaf = k.rpartition(".")
        src_owner, _, src_leaf = src.rpartition(".")
        setattr(skeleton.get_submodule(owner), leaf, getattr(skeleton.get_submodule(src_owner), src_leaf))
    return skeleton.eval()
