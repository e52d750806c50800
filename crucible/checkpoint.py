"""Checkpoints as safetensors plus JSON, no pickle.

    save_checkpoint("ckpt", step, {"step": step, "model": model.state_dict(), ...}, keep=2)
    state = load_checkpoint(latest_checkpoint("ckpt"))

A state is nested dicts, lists and tuples of tensors and JSON scalars. Every tensor goes into
`state.safetensors` (named by its path in the structure), the rest of the structure into
`state.json`; both are written to `step-<step as 7 digits>.tmp/` and renamed into place, so a
checkpoint directory is either complete or absent. crucible.train (fine-tuning) and crucible.moe.qat
(replay QAT) checkpoint through this module.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def _split(obj, tensors: dict, path: str):
    """The JSON skeleton of a nested state; its tensors move into `tensors` under their path."""
    if torch.is_tensor(obj):
        tensors[path] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": path}
    if isinstance(obj, dict):
        return {"__dict__": [[k, _split(v, tensors, f"{path}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {
            "__list__": [_split(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)],
            "tuple": isinstance(obj, tuple),
        }
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint: cannot store {type(obj).__name__} at {path}")


def _join(obj, tensors: dict):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: _join(v, tensors) for k, v in obj["__dict__"]}
        items = [_join(v, tensors) for v in obj["__list__"]]
        return tuple(items) if obj["tuple"] else items
    return obj


def save_checkpoint(directory: Path | str, step: int, state: dict, keep: int = 2) -> Path:
    """Write `state` (nested dicts/lists of tensors and JSON scalars) to directory/step-<step as 7 digits>/
    atomically; keep the newest `keep` checkpoints."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final, tmp = directory / f"step-{step:07d}", directory / f"step-{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors: dict = {}
    skeleton = _split(state, tensors, "s")
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "state.json").write_text(json.dumps(skeleton))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(directory.glob("step-???????"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(directory: Path | str) -> Path | None:
    found = sorted(Path(directory).glob("step-???????")) if Path(directory).is_dir() else []
    return found[-1] if found else None


def load_checkpoint(path: Path | str) -> dict:
    from safetensors.torch import load_file

    path = Path(path)
    return _join(json.loads((path / "state.json").read_text()), load_file(str(path / "state.safetensors")))
