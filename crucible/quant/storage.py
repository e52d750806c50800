"""The safetensors file of an MXFP4-quantized model, rebuilt without its float weights.

    save_quantized(model, "model.safetensors", metadata={...})
    model = load_quantized("model.safetensors", skeleton)              # skeleton: same architecture, any init
    encoder, tokenizer = load_quantized_encoder("model.safetensors", model_dir)  # a transformers encoder

File format (one safetensors file): for each quantized layer `<name>.packed` (uint8),
`<name>.scales` (uint8), `<name>.bias` (float32, if any), `<name>.lora_a` / `<name>.lora_b`
(adapter_dtype, if rank > 0); every other tensor of the model's state dict under its own name;
metadata "crucible.mx" = JSON {name: {in, out, mode, rank}} and "crucible.adapter_dtype".
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from crucible.quant.linear import ADAPTER_DTYPES, MXEmbedding, MXLinear, _set_module, cache_dequantized, mx_layers


def quantized_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the file format in the module docstring."""
    layers = mx_layers(model)
    if not layers:
        raise ValueError("the model has no MXLinear layer; quantize it first (quantize_model)")
    dtypes = {m.adapter_dtype for m in layers.values()}
    if len(dtypes) > 1:
        raise ValueError(f"MXLinear layers use several adapter dtypes {sorted(dtypes)}; one file holds one")
    store = ADAPTER_DTYPES[dtypes.pop()]
    tensors, info = {}, {}
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if owner in layers:
            layer = layers[owner]
            if leaf in ("lora_a", "lora_b"):
                if layer.rank:
                    tensors[name] = tensor.detach().to(store).contiguous()
            elif tensor is not None:
                tensors[name] = tensor.detach().contiguous()
        else:
            tensors[name] = tensor.detach().contiguous()
    for name, m in layers.items():
        info[name] = {"in": m.in_features, "out": m.out_features, "mode": m.mode, "rank": m.rank}
    meta = {
        "crucible.mx": json.dumps(info, sort_keys=True),
        "crucible.adapter_dtype": next(iter(layers.values())).adapter_dtype,
    }
    embs = {n: m for n, m in model.named_modules() if isinstance(m, MXEmbedding)}
    if embs:
        meta["crucible.mx_embeddings"] = json.dumps(
            {
                n: {"num": m.num_embeddings, "dim": m.embedding_dim, "mode": m.mode, "padding_idx": m.padding_idx}
                for n, m in embs.items()
            },
            sort_keys=True,
        )
    return tensors, meta


def save_quantized(model: nn.Module, path: Path | str | None = None, metadata: dict[str, str] | None = None) -> bytes:
    """The quantized model as safetensors bytes (deterministic; also written to `path` if given)."""
    from crucible.serialize import safetensors_bytes

    tensors, meta = quantized_tensors(model)
    data = safetensors_bytes(tensors, {**(metadata or {}), **meta, "format": "pt"})
    if path is not None:
        Path(path).write_bytes(data)
    return data


def load_quantized(path: Path | str, skeleton: nn.Module) -> nn.Module:
    """Rebuild a quantized model from `path` into `skeleton` (the same architecture, any weights):
    its listed linear layers become MXLinear from the packed tensors, every other tensor is loaded
    strictly; returned in eval mode. Raises ValueError naming the file for a truncated or foreign file, a
    missing or extra tensor, a shape that does not fit the architecture, or NaN / inf in a float tensor
    (naming it)."""
    from crucible.serialize import read_safetensors

    path = Path(path)
    tensors, meta = read_safetensors(path)
    if "crucible.mx" not in meta:
        raise ValueError(f"{path}: no 'crucible.mx' metadata; not a quantized model written by save_quantized")
    info = json.loads(meta["crucible.mx"])
    adapter_dtype = meta.get("crucible.adapter_dtype", "bfloat16")
    layers = {}
    for name, spec in json.loads(meta.get("crucible.mx_embeddings", "{}")).items():
        try:
            old = skeleton.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{path}: quantized embedding {name!r} does not exist in the model architecture") from None
        if not isinstance(old, nn.Embedding) or (old.num_embeddings, old.embedding_dim) != (spec["num"], spec["dim"]):
            raise ValueError(
                f"{path}: embedding {name!r} is {spec['num']} x {spec['dim']} in the file but "
                f"{type(old).__name__} {tuple(getattr(old, 'weight', torch.empty(0)).shape)} in the architecture"
            )
        for leaf in ("packed", "scales"):
            if f"{name}.{leaf}" not in tensors:
                raise ValueError(f"{path}: tensor '{name}.{leaf}' is missing")
        try:
            layers[name] = MXEmbedding(
                spec["num"],
                spec["dim"],
                tensors.pop(f"{name}.packed"),
                tensors.pop(f"{name}.scales"),
                spec["padding_idx"],
                spec["mode"],
            )
        except ValueError as exc:
            raise ValueError(f"{path}: embedding {name!r}: {exc}") from None
    for name, spec in info.items():
        try:
            old = skeleton.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{path}: quantized layer {name!r} does not exist in the model architecture") from None
        if not isinstance(old, nn.Linear) or (old.in_features, old.out_features) != (spec["in"], spec["out"]):
            raise ValueError(
                f"{path}: layer {name!r} is {spec['out']} x {spec['in']} in the file but "
                f"{type(old).__name__} {getattr(old, 'out_features', '?')} x {getattr(old, 'in_features', '?')} "
                f"in the architecture"
            )
        for leaf in ("packed", "scales") + (("lora_a", "lora_b") if spec["rank"] else ()):
            if f"{name}.{leaf}" not in tensors:
                raise ValueError(f"{path}: tensor '{name}.{leaf}' is missing")
        bias = tensors.pop(f"{name}.bias", None)
        try:
            layer = MXLinear(
                spec["in"],
                spec["out"],
                tensors.pop(f"{name}.packed"),
                tensors.pop(f"{name}.scales"),
                bias,
                mode=spec["mode"],
                adapter_dtype=adapter_dtype,
            )
        except ValueError as exc:
            raise ValueError(f"{path}: layer {name!r}: {exc}") from None
        if spec["rank"]:
            layer.set_adapter(tensors.pop(f"{name}.lora_a").float(), tensors.pop(f"{name}.lora_b").float())
        layers[name] = layer
    for name, layer in layers.items():
        _set_module(skeleton, name, layer)
    expected = {k for k in skeleton.state_dict() if k.rpartition(".")[0] not in layers}
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise ValueError(f"{path}: tensors do not fit the architecture: missing {missing[:5]}, unexpected {extra[:5]}")
    try:
        skeleton.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:
        raise ValueError(f"{path}: tensors do not fit the architecture: {str(exc)[:500]}") from None
    return skeleton.eval()


def load_quantized_encoder(path: Path | str, architecture: Path | str, dequantize_once: bool = False):
    """(encoder, tokenizer) of a quantized transformers encoder: the architecture and the tokenizer
    from the model folder `architecture` (its config and tokenizer files; no float weights are
    read), every weight from the file `path` written by save_quantized (load_quantized); in eval
    mode. `dequantize_once`: keep each matrix dequantized (cache_dequantized; serving on the CPU).
    The one loader of the quantize stage's model: the stage (tasks/stages/quantize.py) and the
    logged pyfunc (tasks/registry/pyfunc.py, which carries crucible's code only) both call it."""
    from transformers import AutoConfig, AutoTokenizer

    from crucible.models import build_from_config, prepare_tokenizer

    skeleton = build_from_config(AutoConfig.from_pretrained(str(architecture), local_files_only=True), "float32")
    encoder = load_quantized(path, skeleton)
    if dequantize_once:
        cache_dequantized(encoder)
    return encoder, prepare_tokenizer(AutoTokenizer.from_pretrained(str(architecture), local_files_only=True))
