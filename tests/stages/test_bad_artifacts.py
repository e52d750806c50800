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
    with pytest.raises(
        ValueError,
        match=r"embeddings\.safetensors: embeddings is not a readable safetensors file.*"
        r"crucible stage embed --task bbc",
    ):
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
    save_file(
        {"encoder.layer.0.w": torch.randn(3, 3), "embeddings.x": torch.randn(2)}, str(folder / "model.safetensors")
    )
    save_file(
        {"weight": torch.randn(2, 3), "bias": torch.zeros(2)},
        str(folder / "head.safetensors"),
        metadata={"classes": json.dumps(["fresh", "rotten"])},
    )
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
    with pytest.raises(
        ValueError,
        match=rf"finetune/{name}: .* not a readable safetensors file.*"
        r"crucible stage finetune --task rotten",
    ):
        read_task_model(tmp_path, "rotten", "m")


def test_inf_in_a_finetuned_weight_names_the_tensor(tmp_path):
    folder = _finetune(tmp_path)
    save_file({"encoder.layer.0.w": torch.tensor([[1.0, float("inf")], [0.0, 1.0]])}, str(folder / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'encoder\.layer\.0\.w' of the fine-tuned encoder "
        r"of task 'rotten' has 1 NaN or inf values of 4",
    ):
        read_task_model(tmp_path, "rotten", "m")


def test_broken_config_is_named(tmp_path):
    folder = _finetune(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"finetune/config\.json: not valid JSON.*finetune --task rotten"):
        read_task_model(tmp_path, "rotten", "m")


def test_a_wrongly_shaped_head_names_the_tensor_its_shape_and_the_command(tmp_path):
    folder = _finetune(tmp_path)
    # three rows for the two classes of the metadata
    save_file(
        {"weight": torch.randn(3, 3), "bias": torch.zeros(3)},
        str(folder / "head.safetensors"),
        metadata={"classes": json.dumps(["fresh", "rotten"])},
    )
    with pytest.raises(
        ValueError,
        match=r"head\.safetensors: tensor 'weight' of the head of task 'rotten' has shape "
        r"\[3, 3\], expected \[2, \*\]; rebuild it with `crucible stage finetune --task rotten`",
    ):
        read_task_model(tmp_path, "rotten", "m")


def test_the_reader_checks_names_shapes_and_values(tmp_path):
    from tasks.runtime.io import read_safetensors

    path = tmp_path / "heads.safetensors"
    path.write_bytes(safetensors_bytes({"a.weight": torch.ones(2, 4), "a.bias": torch.zeros(2)}, {"k": "v"}))
    tensors, meta = read_safetensors(path, "task heads", "rerun merge", shapes={"a.weight": (2, None), "a.bias": (2,)})
    assert set(tensors) == {"a.weight", "a.bias"} and meta == {"k": "v"}
    with pytest.raises(
        ValueError,
        match=r"heads\.safetensors: tensor 'a\.weight' of the task heads has shape \[2, 4\], "
        r"expected \[3, \*\]; rerun merge",
    ):
        read_safetensors(path, "task heads", "rerun merge", shapes={"a.weight": (3, None), "a.bias": (2,)})
    with pytest.raises(ValueError, match=r"tensor 'a\.bias' of the task heads has shape \[2\], expected \[2, 1\]"):
        read_safetensors(path, "task heads", "rerun merge", shapes={"a.weight": (2, 4), "a.bias": (2, 1)})
    with pytest.raises(ValueError, match=r"tensor 'b\.weight' of the task heads is missing; expected shape \[2, \*\]"):
        read_safetensors(
            path, "task heads", "rerun merge", shapes={"a.weight": (2, 4), "a.bias": (2,), "b.weight": (2, None)}
        )
    with pytest.raises(ValueError, match=r"unexpected tensor 'a\.bias' of the task heads of shape \[2\]"):
        read_safetensors(path, "task heads", "rerun merge", shapes={"a.weight": (2, 4)})
    # a callable check: its text, the file and the command
    with pytest.raises(ValueError, match=r"heads\.safetensors: metadata 'k' is 'v'; rerun merge"):
        read_safetensors(path, "task heads", "rerun merge", shapes=lambda t, m: f"metadata 'k' is {m['k']!r}")
    # a non-finite value: the tensor, how many, the first value and its index
    path.write_bytes(safetensors_bytes({"a.weight": torch.tensor([[0.0, 1.0], [float("-inf"), float("nan")]])}))
    with pytest.raises(
        ValueError,
        match=r"tensor 'a\.weight' of the task heads has 2 NaN or inf values of 4 "
        r"\(first: -inf at \[1, 0\]\); rerun merge",
    ):
        read_safetensors(path, "task heads", "rerun merge")
    # truncated: the first tensor whose bytes are gone
    path.write_bytes(safetensors_bytes({"a": torch.zeros(4), "b": torch.ones(64)})[:-8])
    with pytest.raises(
        ValueError,
        match=r"heads\.safetensors: task heads is not a readable safetensors file, "
        r"truncated: tensor 'b' needs data bytes up to 272, the file holds 264",
    ):
        read_safetensors(path, "task heads", "rerun merge")
