"""MXFP4 linear layers: `MXLinear` and swapping a model's nn.Linear layers for it (the file format that
rebuilds a quantized model without its float weights: crucible.quant.storage).

    layers = select_linears(model, r"encoder\\.layer\\.\\d+\\.")            # name -> nn.Linear
    quantize_model(model, r"encoder\\.layer\\.\\d+\\.", adapters={...})    # in place; returns the MXLinears

An MXLinear computes y = x @ dequant(Wq)^T + bias + (x @ B^T) @ A^T: the packed MXFP4 weight
(crucible.quant.mxfp4) and an optional rank-r low-rank adapter (A: (out, r), B: (r, in)) that
compensates the quantization error (crucible.quant.lowrank). On a CUDA tensor with Triton present
the fused Triton kernel runs (crucible.quant.triton_kernels.mx_linear) for up to FUSED_MAX_M rows,
and above that the Triton dequantization then cuBLAS (`route_for`); elsewhere the torch path
dequantizes the weight for the call (nothing float is kept between calls), or, after
`cache_dequantized`, keeps it in bfloat16 (exact for MXFP4 values) between calls.

The adapter is held in float32 for compute, but its values are rounded to the storage dtype
(`adapter_dtype`, bfloat16 by default) when it is set, so a model saved and reloaded computes
exactly what the in-memory one did. The packed weight, scales and bias are buffers (frozen); the
adapter factors are parameters, so quantization-aware training can update them alone.

"""

from __future__ import annotations

import re
import threading

import torch
from torch import nn

from crucible.quant import mxfp4

ADAPTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MXLinear(nn.Module):
    """nn.Linear with an MXFP4 weight and an optional low-rank adapter (see the module docstring)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        packed: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        mode: str = "floor",
        adapter_dtype: str = "bfloat16",
    ):
        super().__init__()
        if adapter_dtype not in ADAPTER_DTYPES:
            raise ValueError(f"adapter_dtype must be one of {sorted(ADAPTER_DTYPES)}, got {adapter_dtype!r}")
        mxfp4.check_packed(packed, scales, (out_features, in_features), where="MXLinear")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"MXLinear: bias has shape {list(bias.shape)}, expected [{out_features}]")
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        self.adapter_dtype = adapter_dtype
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())
        self.lora_a = nn.Parameter(torch.zeros(out_features, 0))
        self.lora_b = nn.Parameter(torch.zeros(0, in_features))

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        mode: str = "floor",
        adapter: tuple[torch.Tensor, torch.Tensor] | None = None,
        adapter_dtype: str = "bfloat16",
        name: str = "linear",
    ) -> "MXLinear":
        """Quantize `linear`'s weight (K padded to a multiple of 32 if needed is refused: MXFP4 layers
        need in_features % 32 == 0). Raises ValueError naming `name` for a non-finite weight."""
        w = linear.weight.detach()
        if not torch.isfinite(w).all():
            bad = (~torch.isfinite(w)).nonzero()[0].tolist()
            raise ValueError(f"{name}.weight: non-finite value {w[tuple(bad)].item()} at {bad}; cannot quantize")
        if w.shape[1] % mxfp4.BLOCK:
            raise ValueError(
                f"{name}.weight: in_features = {w.shape[1]} is not a multiple of {mxfp4.BLOCK}; "
                f"MXFP4 blocks run along the input dimension"
            )
        q = mxfp4.quantize(w, mode=mode)
        layer = cls(w.shape[1], w.shape[0], q.packed, q.scales, linear.bias, mode=mode, adapter_dtype=adapter_dtype)
        if adapter is not None:
            layer.set_adapter(*adapter)
        return layer

    @property
    def rank(self) -> int:
        return self.lora_a.shape[1]

    def set_adapter(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Set the adapter A (out, r), B (r, in), rounded to the storage dtype."""
        r = a.shape[1] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != self.out_features or b.shape != (r, self.in_features):
            raise ValueError(
                f"MXLinear adapter: expected A ({self.out_features}, r) and B (r, {self.in_features}), got "
                f"{list(a.shape)} and {list(b.shape)}"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError("MXLinear adapter: A or B holds NaN or inf")
        store = ADAPTER_DTYPES[self.adapter_dtype]
        dev = self.packed.device
        self.lora_a = nn.Parameter(a.detach().to(store).to(device=dev, dtype=torch.float32).contiguous())
        self.lora_b = nn.Parameter(b.detach().to(store).to(device=dev, dtype=torch.float32).contiguous())

    def weight_dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = mxfp4.MXFP4Tensor(self.packed, self.scales, (self.out_features, self.in_features), self.mode)
        return mxfp4.dequantize(q, dtype)

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight for the CPU matmul: rebuilt at every call, or with
        `cache_dequantized` kept between calls, once per (device, packed data), in `cache_dtype`
        (bfloat16 by default: every MXFP4 value, an E2M1 number times a power of two, is exact in
        bfloat16, so the cache costs 2 bytes per weight instead of 4 and the float32 weight made from
        it for each call is bit for bit the dequantized one; the file and the packed buffers stay
        MXFP4)."""
        if not getattr(self, "cache_dequantized", False):
            return self.weight_dequantized(dtype)
        store = getattr(self, "cache_dtype", torch.bfloat16)
        key = (
            store,
            self.packed.device,
            self.packed.data_ptr(),
            self.packed._version,
            self.scales.data_ptr(),
            self.scales._version,
        )
        cached = getattr(self, "_dense_cache", None)
        if cached is None or cached[0] != key:
            self._dense_cache = None  # the stale copy goes before the new one is made
            cached = (key, self.weight_dequantized(torch.float32).to(store))
            self._dense_cache = cached
        weight = cached[1]
        if weight.dtype == dtype:
            return weight
        if torch.is_grad_enabled() or not torch.is_inference_mode_enabled():
            # autograd may keep the weight for the backward pass, and a scratch buffer made under
            # inference mode cannot be written outside it: a copy of its own
            return weight.to(dtype)
        # inference mode: one scratch buffer per thread, reused by every layer, so a call allocates
        # (and the allocator keeps) nothing per layer
        return _scratch(weight.shape, dtype, weight.device).copy_(weight)

    def effective_weight(self) -> torch.Tensor:
        """dequant(Wq) + A B in float32: the dense weight this layer applies."""
        w = self.weight_dequantized()
        return w + self.lora_a @ self.lora_b if self.rank else w

    def nbytes(self) -> dict[str, int]:
        """Bytes on disk: codes, scales, adapter (in its storage dtype), bias."""
        item = torch.empty((), dtype=ADAPTER_DTYPES[self.adapter_dtype]).element_size()
        return {
            "packed": self.packed.numel(),
            "scales": self.scales.numel(),
            "adapter": (self.lora_a.numel() + self.lora_b.numel()) * item,
            "bias": 0 if self.bias is None else self.bias.numel() * 4,
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MXLinear: input has {x.shape[-1]} features, expected {self.in_features}")
        route = route_for(x, self.in_features)
        if route != "torch":
            from crucible.quant import triton_kernels

            if route == "fused":
                return triton_kernels.mx_linear(
                    x,
                    self.packed,
                    self.scales,
                    self.in_features,
                    self.bias,
                    self.lora_a if self.rank else None,
                    self.lora_b if self.rank else None,
                )
            if getattr(self, "cache_dequantized", False):
                w = self._dense_weight(x.dtype)
            else:
                w = triton_kernels.dequantize(self.packed, self.scales, self.in_features, x.dtype)
        else:
            w = self._dense_weight(x.dtype)
        y = nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        if self.rank:
            y = y + nn.functional.linear(nn.functional.linear(x, self.lora_b.to(x.dtype)), self.lora_a.to(x.dtype))
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, "
            f"rank={self.rank}, bias={self.bias is not None}"
        )


class MXEmbedding(nn.Module):
    """nn.Embedding with an MXFP4 table: each looked-up row is dequantized on the fly (blocks of 32
    along the embedding dimension), so the float table is never materialised."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        packed: torch.Tensor,
        scales: torch.Tensor,
        padding_idx: int | None = None,
        mode: str = "floor",
    ):
        super().__init__()
        mxfp4.check_packed(packed, scales, (num_embeddings, embedding_dim), where="MXEmbedding")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.mode = padding_idx, mode
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scales", scales.contiguous())

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, mode: str = "floor", name: str = "embedding") -> "MXEmbedding":
        w = emb.weight.detach()
        if not torch.isfinite(w).all():
            bad = (~torch.isfinite(w)).nonzero()[0].tolist()
            raise ValueError(f"{name}.weight: non-finite value {w[tuple(bad)].item()} at {bad}; cannot quantize")
        if w.shape[1] % mxfp4.BLOCK:
            raise ValueError(f"{name}.weight: embedding_dim = {w.shape[1]} is not a multiple of {mxfp4.BLOCK}")
        q = mxfp4.quantize(w, mode=mode)
        return cls(w.shape[0], w.shape[1], q.packed, q.scales, emb.padding_idx, mode)

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = mxfp4.MXFP4Tensor(self.packed[ids], self.scales[ids], (*ids.shape, self.embedding_dim), self.mode)
        return mxfp4.dequantize(q)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode}"


_SCRATCH = threading.local()


# Rows (tokens) up to which a CUDA MXLinear runs the fused dequant-matmul kernel (decode, where the
# weight stream is the cost); above it, the Triton kernel dequantizes the weight and cuBLAS multiplies
# (prefill, where the matmul is the cost and a dequantized weight is a small extra pass).
# benchmarks/gpu_check.py measures both paths at each M and prints where they cross.
FUSED_MAX_M = 16


def route_for(x: torch.Tensor, in_features: int) -> str:
    """Which path MXLinear.forward takes for input `x`: "fused" (CUDA, Triton, at most FUSED_MAX_M
    rows), "dequant-matmul" (CUDA, Triton, more rows) or "torch" (elsewhere: the dequantized weight,
    rebuilt or cached, and torch's matmul)."""
    if not (x.is_cuda and _triton_ok()):
        return "torch"
    rows = x.numel() // max(in_features, 1)
    return "fused" if rows <= FUSED_MAX_M else "dequant-matmul"


def _scratch(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A (shape) tensor of this thread's scratch buffer for (dtype, device), grown as needed; its
    contents are the caller's until its next call in this thread."""
    n = 1
    for d in shape:
        n *= d
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    buf = buffers.get((dtype, device))
    if buf is None or buf.numel() < n:
        buf = buffers[(dtype, device)] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def cache_dequantized(model: nn.Module, on: bool = True, dtype: torch.dtype = torch.bfloat16) -> int:
    """Let every MXLinear in `model` keep its dequantized weight between calls on the CPU (serving,
    scoring: the dequantization then runs once, not once per batch), held in `dtype`: bfloat16 (the
    default) holds every MXFP4 value exactly at 2 bytes per weight (MiniLM's 36 matrices: 21 MB,
    against 42 MB in float32); under no_grad / inference_mode each call converts one layer at a time
    into a scratch buffer per thread (the largest matrix's size) that every layer reuses. Returns
    the layers set."""
    n = 0
    for m in model.modules():
        if isinstance(m, MXLinear):
            m.cache_dequantized, m.cache_dtype = on, dtype
            m._dense_cache = None
            n += 1
    return n


def quantize_embeddings(model: nn.Module, pattern: str, mode: str = "floor") -> dict[str, MXEmbedding]:
    """Replace, in place, every nn.Embedding whose name matches `pattern` (re.search) by an
    MXEmbedding; all-or-nothing like quantize_model. ValueError for a regex matching none."""
    chosen = select_modules(model, pattern, nn.Embedding, "embedding")
    built = {n: MXEmbedding.from_embedding(m, mode, name=n) for n, m in chosen.items()}
    for n, layer in built.items():
        _set_module(model, n, layer)
    return built


def _triton_ok() -> bool:
    try:
        from crucible.quant import triton_kernels
    except ImportError:
        return False
    return triton_kernels.available()


def select_modules(model: nn.Module, pattern: str, kind: type = nn.Linear, what: str = "module") -> dict:
    """The `kind` modules whose qualified name matches `pattern` (re.search), in module order;
    `auto`: every nn.Linear of the model's transformer blocks, or its input embedding for
    nn.Embedding (crucible.models). Raises ValueError for an invalid regex or one that matches none
    (listing some names)."""
    if pattern == "auto":
        from crucible.models import block_linear_pattern, input_embedding_pattern

        pattern = input_embedding_pattern(model) if kind is nn.Embedding else block_linear_pattern(model)
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"invalid {what} regex '{pattern}': {exc}") from None
    found = {n: m for n, m in model.named_modules() if isinstance(m, kind)}
    chosen = {n: m for n, m in found.items() if rx.search(n)}
    if not chosen:
        some = ", ".join(list(found)[:6]) or "none"
        raise ValueError(
            f"{what} regex '{pattern}' matches no nn.{kind.__name__} of the model; its "
            f"{kind.__name__} modules are: {some}{', ...' if len(found) > 6 else ''}"
        )
    return chosen


def select_linears(model: nn.Module, pattern: str) -> dict[str, nn.Linear]:
    """The nn.Linear modules whose name matches `pattern` (select_modules)."""
    return select_modules(model, pattern, nn.Linear, "module")


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantize_model(
    model: nn.Module,
    pattern: str,
    mode: str = "floor",
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    adapter_dtype: str = "bfloat16",
) -> dict[str, MXLinear]:
    """Replace, in place, every nn.Linear matching `pattern` by an MXLinear (with the adapter of
    `adapters[name]`, if given). All-or-nothing: every layer is built before any is swapped, so an
    error leaves the model as it was. Returns name -> MXLinear."""
    adapters = adapters or {}
    chosen = select_linears(model, pattern)
    unknown = sorted(set(adapters) - set(chosen))
    if unknown:
        raise ValueError(f"adapters given for {unknown}, which are not quantized layers (pattern {pattern!r})")
    built = {n: MXLinear.from_linear(m, mode, adapters.get(n), adapter_dtype, name=n) for n, m in chosen.items()}
    for n, layer in built.items():
        _set_module(model, n, layer)
    return built


def mx_layers(model: nn.Module) -> dict[str, MXLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, MXLinear)}
