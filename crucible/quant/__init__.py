"""Quantization (docs/methods.md, quantize): the MXFP4 format, its Triton kernels, MXFP4 linear layers
and low-rank compensation of the quantization error under a rank budget.

- `crucible.quant.mxfp4`: quantize / dequantize (torch path, bit-exact with torchao's MX floor mode);
- `crucible.quant.triton_kernels`: the same on the GPU, and the fused dequant-matmul (lazy import);
- `crucible.quant.triton_jit`: the Triton source of those kernels (built on first use);
- `crucible.quant.triton_decode`: the decode path (M <= 16 rows: split-K) of the fused dequant-matmul;
- `crucible.quant.linear`: MXLinear, MXEmbedding, quantize_model, cache_dequantized;
- `crucible.quant.storage`: save_quantized / load_quantized, load_quantized_encoder;
- `crucible.quant.lowrank`: activation scales, the error SVD, compensate;
- `crucible.quant.rank_allocation`: load-aware and uniform ranks under a total budget;
- `crucible.quant.compensate`: the whole-model plan (calibration stats, ranks, adapters).
"""

from crucible.quant.compensate import CompensationPlan, collect_input_stats, collect_output_sensitivity
from crucible.quant.linear import MXLinear, cache_dequantized, quantize_model, select_linears
from crucible.quant.lowrank import InputStats, compensate, factorize
from crucible.quant.mxfp4 import MXFP4Tensor, dequantize, quantize
from crucible.quant.rank_allocation import allocate_ranks, uniform_ranks, weighted_error
from crucible.quant.storage import load_quantized, load_quantized_encoder, save_quantized

__all__ = [
    "CompensationPlan",
    "InputStats",
    "MXFP4Tensor",
    "MXLinear",
    "allocate_ranks",
    "cache_dequantized",
    "collect_input_stats",
    "collect_output_sensitivity",
    "compensate",
    "dequantize",
    "factorize",
    "load_quantized",
    "load_quantized_encoder",
    "quantize",
    "quantize_model",
    "save_quantized",
    "select_linears",
    "uniform_ranks",
    "weighted_error",
]
