"""Stage `embed` (per task): encoder embeddings of the reference, pool and test texts.

    crucible stage embed --task bbc

A stage of its own so that its output is cached by DVC: a params change in curate or later stages
does not re-embed. Output: data/<task>/embeddings.safetensors with float32 tensors `reference`,
`pool`, `test` (rows in the order of the parquet files; the md5 of each table's ids is stored in the
file's metadata and checked on read).
"""

from __future__ import annotations

from pathlib import Path

import torch

from crucible.embed import embed_texts
from crucible.progress import Progress
from crucible.schema import validate_disjoint
from tasks.data.embeddings import ids_digest
from tasks.data.models import base_model
from tasks.runtime.declaration import StageSpec
from tasks.runtime.device import current
from tasks.runtime.io import AtomicOutputs, read_table
from tasks.runtime.params_schema import Params
from tasks.runtime.paths import BASE_MANIFEST

TABLES = ("reference", "pool", "test")

SPEC = StageSpec(
    name="embed",
    per_task=True,
    comment="Per task: frozen encoder embeddings of the reference, pool and test texts (cached apart, so "
    "a later stage's params do not re-embed).",
    deps=(str(BASE_MANIFEST), *(f"data/{{task}}/{t}.parquet" for t in TABLES)),
    params=("pipeline.seed", "ingest.allow_shared_ids", "model", "embed"),
    outs=("data/{task}/embeddings.safetensors",),
)


def run(params: Params, task: str, root: Path, log) -> dict:
    from crucible.serialize import safetensors_bytes

    cfg = params.embed
    frames = {t: read_table(Path(root) / "data" / task / f"{t}.parquet", t) for t in TABLES}
    validate_disjoint(
        frames,
        {t: str(Path(root) / "data" / task / f"{t}.parquet") for t in TABLES},
        allow_shared_ids=params.ingest.allow_shared_ids,
    )
    torch.manual_seed(params.pipeline.seed)
    base = base_model(params, root)
    model, tokenizer = base.load()
    pooling = base.pooling(model.config)
    max_length = base.max_length(tokenizer, model.config, cfg.max_length)
    total = sum(len(df) for df in frames.values())
    tensors, meta = {}, {"model": base.name, "max_length": str(max_length)}
    if pooling != "mean":  # (mean: the file as before pooling was a choice)
        meta["pooling"] = pooling
    with Progress(total=total, desc=f"embed@{task}", unit="text") as bar:
        for name, df in frames.items():
            tensors[name] = embed_texts(
                model,
                tokenizer,
                df["text"].tolist(),
                batch_size=cfg.batch_size,
                max_length=max_length,
                progress=bar.update,
                pooling=pooling,
                autocast_dtype=current().autocast_dtype,
            ).contiguous()
            meta[f"{name}_ids_md5"] = ids_digest(df["id"])
    with AtomicOutputs() as out:
        out.bytes(safetensors_bytes(tensors, meta), Path(root) / "data" / task / "embeddings.safetensors")
    rate = total / max(bar.elapsed, 1e-9)
    return {"n_embedded": total, "dim": int(tensors["pool"].shape[1]), "texts_per_second": rate}
