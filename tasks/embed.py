"""Stage `embed` (per task): encoder embeddings of the reference, pool and test texts.

    crucible stage embed --task bbc

A stage of its own so that its output is cached by DVC: a params change in curate or later stages
does not re-embed. Output: data/<task>/embeddings.safetensors with float32 tensors `reference`,
`pool`, `test` (rows in the order of the parquet files; the md5 of each table's ids is stored in the
file's metadata and checked on read).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from tqdm.auto import tqdm

from crucible.embed import embed_texts, load_encoder
from crucible.schema import validate_disjoint
from tasks.io import AtomicOutputs, read_table
from tasks.models import resolve_model
from tasks.params import Params

TABLES = ("reference", "pool", "test")


def inputs(params: Params, task: str) -> list[Path]:
    return [Path("data") / task / f"{t}.parquet" for t in TABLES]


def outputs(params: Params, task: str) -> list[Path]:
    return [Path("data") / task / "embeddings.safetensors"]


def ids_digest(ids) -> str:
    return hashlib.md5("\n".join(map(str, ids)).encode()).hexdigest()


def load_embeddings(root: Path, task: str, frames: dict) -> dict[str, torch.Tensor]:
    """The task's embeddings, checked row for row against the tables they were computed from; a
    missing, truncated or non-finite file is an error naming it and the command that rebuilds it."""
    from tasks.io import read_safetensors

    path = Path(root) / "data" / task / "embeddings.safetensors"
    rebuild = f"rebuild it with `crucible stage embed --task {task}` (or `dvc repro embed@{task}`)"
    tensors, meta = read_safetensors(path, "embeddings", rebuild)
    out = {}
    for name, df in frames.items():
        if name not in tensors or meta.get(f"{name}_ids_md5") != ids_digest(df["id"]):
            raise ValueError(f"{path}: embeddings of '{name}' were computed for other rows than "
                             f"data/{task}/{name}.parquet; {rebuild}")
        out[name] = tensors[name]
    return out


def run(params: Params, task: str, root: Path, log) -> dict:
    from crucible.serialize import safetensors_bytes

    cfg = params.embed
    frames = {t: read_table(Path(root) / "data" / task / f"{t}.parquet", t) for t in TABLES}
    validate_disjoint(frames, {t: str(Path(root) / "data" / task / f"{t}.parquet") for t in TABLES},
                      allow_shared_ids=params.ingest.allow_shared_ids)
    torch.manual_seed(params.pipeline.seed)
    model, tokenizer = load_encoder(resolve_model(cfg.model))
    total = sum(len(df) for df in frames.values())
    tensors, meta = {}, {"model": cfg.model, "max_length": str(cfg.max_length)}
    with tqdm(total=total, desc=f"embed {task}", unit="text") as bar:
        for name, df in frames.items():
            tensors[name] = embed_texts(model, tokenizer, df["text"].tolist(), batch_size=cfg.batch_size,
                                        max_length=cfg.max_length, progress=bar.update).contiguous()
            meta[f"{name}_ids_md5"] = ids_digest(df["id"])
    with AtomicOutputs() as out:
        out.bytes(safetensors_bytes(tensors, meta), Path(root) / "data" / task / "embeddings.safetensors")
    rate = total / max(bar.format_dict["elapsed"], 1e-9)
    return {"n_embedded": total, "dim": int(tensors["pool"].shape[1]), "texts_per_second": rate}


if __name__ == "__main__":
    import sys

    from tasks.cli import main

    main(["stage", "embed", *sys.argv[1:]])
