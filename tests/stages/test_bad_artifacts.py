"""A corrupt, truncated or non-finite artifact of an earlier stage is an error naming the file, the
tensor where one is at fault, and the command that rebuilds it (not a raw SafetensorError)."""

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from crucible.serialize import safetensors_bytes
from tasks.data.embeddings import ids_digest, load_embeddings
from tasks.data.heldout_scoring import read_task_model


def _embeddings(root, task="bbc"):
    frames = {"reference": pd.DataFrame({"id": ["r0", "r1"]}), "pool": pd.DataFrame({"id": ["p0", "p1", "p2"]})}
    tensors = {name: torch.randn(len(df), 4) for name, df in frames.items()}
    meta = {f"{name}_ids_md5": ids_digest(df["id"]) for name, df in frames.items()}
    path = root / "data" / task / "embeddings.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(safetensors_bytes(tensors, meta))
    return path, frames, tensors


def test_embeddings_round_trip(tmp_path):
    path, frames, tensors = _embeddings(tmp_path)
    out = load_embeddings(tmp_path, "bbc", frames)
    assert all(torch.equal(out[k], tensors[k]) for k in frames)


@pytest.mark.parametrize("cut", [7, 60, -5])
def test_truncated_embeddings_name_the_file_and_the_command(tmp_path, cut):
    path, frames, _ = _embeddings(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"embeddings\.safetensors: embeddings is not a readable safetensors file.*"
                                         r"crucible stage embed --task bbc"):
        load_embeddings(tmp_path, "bbc", frames)


def test_nan_embeddings_name_the_tensor(tmp_path):
    path, frames, tensors = _embeddings(tmp_path)
    tensors["pool"][1, 2] = float("nan")
    path.write_bytes(safetensors_bytes(tensors, {f"{n}_ids_md5": ids_digest(df["id"]) for n, df in frames.items()}))
    with pytest.raises(ValueError, match=r"tensor 'pool' of the embeddings has 1 NaN or inf values of 12.*embed"):
        load_embeddings(tmp_path, "bbc", frames)


def test_missing_embeddings(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"embeddings not found; rebuild it with `crucible stage embed"):
        load_embeddings(tmp_path, "bbc", {})


def _finetune(root, task="rotten"):
    folder = root / "data" / task / "finetune"
    folder.mkdir(parents=True)
    save_file({"encoder.layer.0.w": torch.randn(3, 3), "embeddings.x": torch.randn(2)}, str(folder / "model.safetensors"))
    save_file({"weight": torch.randn(2, 3), "bias": torch.zeros(2)}, str(folder / "head.safetensors"),
              metadata={"classes": json.dumps(["fresh", "rotten"])})
    (folder / "config.json").write_text(json.dumps({"base_model": "m", "max_length": 16}))
    return folder


def test_task_model_reads(tmp_path):
    _finetune(tmp_path)
    spec = read_task_model(tmp_path, "rotten", "m")
    assert spec["classes"] == ["fresh", "rotten"] and spec["max_length"] == 16


@pytest.mark.parametrize("name", ["model.safetensors", "head.safetensors"])
def test_truncated_finetune_files_name_the_file_and_the_command(tmp_path, name):
    folder = _finetune(tmp_path)
    (folder / name).write_bytes((folder / name).read_bytes()[:40])
    with pytest.raises(ValueError, match=rf"finetune/{name}: .* not a readable safetensors file.*"
                                         r"crucible stage finetune --task rotten"):
        read_task_model(tmp_path, "rotten", "m")


def test_inf_in_a_finetuned_weight_names_the_tensor(tmp_path):
    folder = _finetune(tmp_path)
    save_file({"encoder.layer.0.w": torch.tensor([[1.0, float("inf")], [0.0, 1.0]])}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'encoder\.layer\.0\.w' of the fine-tuned encoder "
                                         r"of task 'rotten' has 1 NaN or inf values of 4"):
        read_task_model(tmp_path, "rotten", "m")


def test_broken_config_is_named(tmp_path):
    folder = _finetune(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"finetune/config\.json: not valid JSON.*finetune --task rotten"):
        read_task_model(tmp_path, "rotten", "m")
