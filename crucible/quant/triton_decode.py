"""The MXFP4 decode path (M <= DECODE_MAX_M rows): split-K, tokens on the MMA's N side, nibbles in
their stored order. The kernels' source and their layout: crucible.quant.triton_jit (``mx_decode``,
``splitk_reduce``); the public entry point, with its argument checks: triton_kernels.mx_linear, which
routes here for up to DECODE_MAX_M rows unless tiled block sizes are asked for.

``decode_config`` picks SPLIT_K so that the grid has at least ``waves`` programs per SM (the weight
stream of a decode matmul needs every SM loading), keeping at least two K steps per split.
"""

from __future__ import annotations

import torch

DECODE_MAX_M = 16
_BLOCK_T = 16
_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """The device's multiprocessor count (132 under the interpreter: an H100's, so that the CPU tests
    take the same split-K decisions as the GPU they stand in for)."""
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def decode_config(n: int, k: int, device: torch.device, waves: int = 2) -> dict:
    """{"block_n", "block_k", "split_k", "num_warps", "num_stages"} for a decode product (N, K)."""
    # 64 x 128 weight tiles: each of the 128 threads holds 32 values of a nibble plane (wider tiles
    # spill registers at 4 warps); the GPU check's sweep times 128-row tiles and 256-wide K steps too
    block_n = 64
    block_k = max(32, min(128, 1 << (k - 1).bit_length()))
    n_blocks = -(-n // block_n)
    split = 1
    steps = -(-k // block_k)
    while n_blocks * split < waves * sm_count(device) and steps // (split * 2) >= 2:
        split *= 2
    return {"block_n": block_n, "block_k": block_k, "split_k": split, "num_warps": 4, "num_stages": 4}


def launch(
    kernels: dict,
    ptrs: tuple,
    flags: dict,
    y: torch.Tensor,
    m: int,
    n: int,
    k: int,
    r: int,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """y (m, n; its int16 bits for bfloat16) = x @ W^T (+ bias) (+ (x @ b^T) @ a^T) for m <= DECODE_MAX_M,
    from what mx_linear prepares for both kernels: ptrs (x, packed, scales, bias, a, b; dummies for
    the absent ones), flags (their shared compile-time flags), r (the adapter rank, at least 1)."""
    dev = y.device
    cfg = decode_config(n, k, dev)
    bn = block_n or cfg["block_n"]
    bk = block_k or cfg["block_k"]
    split = split_k or cfg["split_k"]
    # every split covers whole K steps; a split that would start past K is dropped
    per = -(-k // split)
    per = -(-per // bk) * bk
    split = -(-k // per)
    partial = split > 1
    out = torch.empty(split, m, n, dtype=torch.float32, device=dev) if partial else y
    kernels["mx_decode"][(-(-n // bn), split)](
        *ptrs,
        out,
        m,
        n,
        k,
        r,
        per,
        **flags,
        PARTIAL=partial,
        BLOCK_T=_BLOCK_T,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    if partial:
        block = 1024
        kernels["splitk_reduce"][(-(-(m * n) // block),)](
            out,
            ptrs[3],  # the bias (or its dummy)
            y,
            m * n,
            n,
            SPLIT=split,
            HAS_BIAS=flags["HAS_BIAS"],
            OUT_BF16=flags["OUT_BF16"],
            BLOCK=block,
            num_warps=4,
        )
