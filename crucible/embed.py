"""Sentence embeddings from a Hugging Face encoder or decoder: pooled (crucible.models.pool; masked
mean pooling, as sentence-transformers' all-MiniLM-L6-v2 was trained, by default), then
L2-normalised, as that model's pipeline does.

    model, tokenizer = load_encoder(path)          # offline, from a local folder
    x = embed_texts(model, tokenizer, texts)        # (n, d) float32

Pure compute: the caller decides where the model comes from and where the result goes.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

# resolved at import, not inside the function: transformers' lazy attributes are not safe to
# resolve from several threads at once (the Prefect flow embeds tasks in parallel threads)
from crucible.device import autocast, model_device
from crucible.models import encode, load_base, mean_pool  # noqa: F401  (mean_pool: re-exported)


def load_encoder(path: str, dtype: str = "float32"):
    """The base model (no head) and its tokenizer from a local folder (or a cached hub id), never
    downloading (crucible.models.load_base)."""
    return load_base(path, dtype)


@torch.inference_mode()
def embed_texts(
    model,
    tokenizer,
    texts: Sequence[str],
    *,
    batch_size: int = 64,
    max_length: int = 128,
    normalize: bool = True,
    progress: Callable[[int], None] | None = None,
    pooling: str = "mean",
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Embed `texts` in batches on the model's device (under `autocast_dtype` autocast when given);
    returns (n, d) float32 on the CPU. `progress(k)` is called with the number of texts done after
    each batch. Texts are sorted by length internally so batches pad little; the output is in the
    input order."""
    if len(texts) == 0:
        raise ValueError("no texts to embed")
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    device = model_device(model)
    out = torch.empty(len(texts), model.config.hidden_size, dtype=torch.float32)
    for start in range(0, len(texts), batch_size):
        idx = order[start : start + batch_size]
        batch = tokenizer(
            [texts[i] for i in idx], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        ).to(device)
        with autocast(device, autocast_dtype):
            pooled = encode(model, batch["input_ids"], batch["attention_mask"], pooling).float()
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        out[torch.tensor(idx)] = pooled.cpu()
        if progress is not None:
            progress(len(idx))
    return out
