"""The embed stage's output as the later stages read it: data/<task>/embeddings.safetensors, checked
row for row against the tables it was computed from."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from tasks.runtime.io import read_safetensors, rebuild_hint


def ids_digest(ids) -> str:
    return hashlib.md5("\n".join(map(str, ids)).encode()).hexdigest()


def load_embeddings(root: Path, task: str, frames: dict) -> dict[str, torch.Tensor]:
    """The task's embeddings, checked row for row against the tables they were computed from; a
    missing, truncated or non-finite file is an error naming it and the command that rebuilds it."""
    path = Path(root) / "data" / task / "embeddings.safetensors"
    rebuild = rebuild_hint("embed", task)
    tensors, meta = read_safetensors(path, "embeddings", rebuild)
    out = {}
    for name, df in frames.items():
        if name not in tensors or meta.get(f"{name}_ids_md5") != ids_digest(df["id"]):
            raise ValueError(
                f"{path}: embeddings of '{name}' were computed for other rows than "
                f"data/{task}/{name}.parquet; {rebuild}"
            )
        out[name] = tensors[name]
    return out
