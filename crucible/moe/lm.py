"""Causal-LM perplexity and packed held-out token sequences (the MoE stage's language-model metric).

    seqs = token_sequences(tokenizer, texts, seq_len=128, n=64, seed=0)   # LongTensor [64, 128]
    ppl = perplexity(model, seqs, batch_size=8)

perplexity = exp(mean over predicted tokens of -log p(token_t+1 | tokens_<=t)): the logits at
position t score the token at t + 1 (the last position predicts nothing), log-softmax in float32.
Ragged sequences (a list of 1-D id sequences) are right-padded; the padded positions neither count
as targets nor are attended to (attention_mask). Right padding never changes the logits of the real
positions of a causal model, so the result equals scoring each sequence alone.

Contract
- perplexity(model, sequences, batch_size=8, progress=False) -> float. model(input_ids=...,
  attention_mask=...) must return an object with `.logits` [B, T, V]. sequences: an integer tensor
  [N, T] (T >= 2) or a list of 1-D integer sequences (each of length >= 2). The model is run in
  eval mode under no_grad and its training flag restored. ValueError, naming the parameter and
  the value, for: empty input, non-integer ids, negative ids, a sequence shorter than 2,
  batch_size < 1; and for logits that are not finite or not [B, T, V].
- token_sequences(tokenizer, texts, seq_len, n, seed=0) -> LongTensor [n, seq_len]: the texts in
  the order of a seeded permutation (numpy default_rng(seed)), each tokenized without special
  tokens and followed by the tokenizer's EOS id, concatenated, and cut into n consecutive rows (the
  rest is dropped). Texts are tokenized lazily until n * seq_len ids are reached. ValueError for
  seq_len or n < 1, a non-string or empty text list, a tokenizer without an eos_token_id, or texts
  that together hold fewer than n * seq_len tokens (naming both counts).
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch
from torch import nn

from crucible.seeding import numpy_rng

__all__ = ["perplexity", "token_sequences"]


def _as_batches(sequences) -> list[torch.Tensor]:
    if isinstance(sequences, torch.Tensor):
        if sequences.dim() != 2 or sequences.shape[0] == 0:
            raise ValueError(f"perplexity: sequences shape={list(sequences.shape)} must be [N, T] with N >= 1")
        rows = list(sequences)
    else:
        rows = [torch.as_tensor(s) for s in sequences]
        if not rows:
            raise ValueError("perplexity: sequences is empty; give a LongTensor [N, T] or a list of sequences")
    for i, r in enumerate(rows):
        if r.dim() != 1 or r.dtype == torch.bool or r.is_floating_point() or r.is_complex():
            raise ValueError(
                f"perplexity: sequences[{i}] (shape={list(r.shape)}, dtype={r.dtype}) must be a "
                "1-D sequence of integer token ids"
            )
        if r.numel() < 2:
            raise ValueError(f"perplexity: sequences[{i}] has length {r.numel()}; at least 2 tokens are needed")
        if int(r.min()) < 0:
            raise ValueError(f"perplexity: sequences[{i}] holds a negative id {int(r.min())}")
    return [r.long() for r in rows]


@torch.no_grad()
def perplexity(model: nn.Module, sequences, batch_size: int = 8, progress: bool = False) -> float:
    """Token-level perplexity of a causal LM on `sequences` (see the module docstring)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"perplexity: batch_size={batch_size!r} must be an int >= 1")
    rows = _as_batches(sequences)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    starts = range(0, len(rows), batch_size)
    if progress:
        from crucible.progress import Progress

        starts = Progress(starts, desc="perplexity", unit="batch")
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    try:
        for s in starts:
            batch = rows[s : s + batch_size]
            width = max(r.numel() for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for j, r in enumerate(batch):
                ids[j, : r.numel()] = r
                mask[j, : r.numel()] = 1
            ids, mask = ids.to(device), mask.to(device)
            logits = model(input_ids=ids, attention_mask=mask).logits
            if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
                raise ValueError(
                    f"perplexity: model logits shape={list(logits.shape)} must be [{ids.shape[0]}, {ids.shape[1]}, V]"
                )
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            target = ids[:, 1:]
            if int(target.max()) >= logp.shape[-1]:
                raise ValueError(
                    f"perplexity: token id {int(target.max())} is out of the model's vocabulary "
                    f"({logp.shape[-1]} logits)"
                )
            keep = mask[:, 1:].bool()
            token_nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)[keep]
            if not bool(torch.isfinite(token_nll).all()):
                raise ValueError("perplexity: the model's log-probabilities of the targets are not finite")
            nll += float(token_nll.double().sum())
            count += int(keep.sum())
    finally:
        model.train(was_training)
    return math.exp(nll / count)


def token_sequences(tokenizer, texts: Sequence[str], seq_len: int, n: int, seed: int = 0) -> torch.Tensor:
    """n rows of seq_len token ids packed from `texts` in a seeded order (see the module docstring)."""
    for name, value in (("seq_len", seq_len), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"token_sequences: {name}={value!r} must be an int >= 1")
    texts = list(texts)
    if not texts:
        raise ValueError("token_sequences: texts is empty")
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise ValueError(f"token_sequences: texts[{bad[0]}] is a {type(texts[bad[0]]).__name__}, not a str")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(f"token_sequences: tokenizer {type(tokenizer).__name__} has no eos_token_id to separate texts")
    need = n * seq_len
    ids: list[int] = []
    for i in numpy_rng(seed).permutation(len(texts)):
        ids.extend(tokenizer(texts[int(i)], add_special_tokens=False)["input_ids"])
        ids.append(int(eos))
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(
            f"token_sequences: the {len(texts)} texts hold {len(ids)} tokens (with EOS), fewer than "
            f"n * seq_len = {n} * {seq_len} = {need}"
        )
    return torch.tensor(ids[:need], dtype=torch.long).view(n, seq_len)
