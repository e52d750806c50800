"""Stage `model` (once): the base model's content as a manifest that every stage loading the model
depends on.

    crucible stage model

Resolves `model.name` (a packaged model, a local folder, or a model in the local Hugging Face cache;
the packaged SmolLM2 GGUF is converted once into <workspace>/.crucible/base/) and writes
models/base/manifest.json: the name, the md5 of every file of the model folder and one hash over
them. The manifest, not the folder, is the DVC dependency of embed, finetune, merge, quantize and
register (a packaged model's folder lies in site-packages, which is no portable dvc.yaml path), so
replacing the model's weights changes the manifest and makes those stages stale. `crucible run`
runs this stage every time (hashing the files takes a second; the same files write the same
bytes); under plain DVC run `dvc repro -f model` after changing a model in place. Every stage that
loads the model also checks that its files still hash to the manifest, and stops otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.data.models import manifest
from tasks.runtime.declaration import StageSpec
from tasks.runtime.io import AtomicOutputs
from tasks.runtime.params_schema import Params
from tasks.runtime.paths import BASE_MANIFEST

SPEC = StageSpec(
    name="model",
    per_task=False,
    comment="Once: the base model's files hashed into a manifest, the dependency of every stage that loads "
    "the model (crucible run reruns it each time; under plain DVC `dvc repro -f model`).",
    params=("model.name",),
    outs=(str(BASE_MANIFEST),),
)


def run(params: Params, task: str | None, root: Path, log) -> dict:
    found = manifest(params.model.name, root)
    with AtomicOutputs() as out:
        out.bytes((json.dumps(found, indent=1, sort_keys=True) + "\n").encode(), Path(root) / BASE_MANIFEST)
    log.log_params({"model.hash": found["hash"]})
    return {"files": len(found["files"])}
