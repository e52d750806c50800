"""Every MLflow model crucible logs is a model "from code": no pickle in its folder, its MLmodel
names a code file, and it loads in a fresh interpreter, with pickle switched off, predicting what
the in-process model predicts. Both kinds: the finetune stage's per-task `TextClassifier` and the
register stage's multi-task model (float and MXFP4), built here from tiny fake stage folders (the
base encoder's weights and random heads) so that no pipeline stage has to run."""

import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

torch.set_num_threads(1)
BASE = "all-MiniLM-L6-v2"
TEXTS = [
    "a wonderful, moving film",
    "the plot is dull and tedious",
    "Shares fell 3% on Monday",
    "the striker scored twice",
    "a new phone chip",
]
PICKLE_SUFFIXES = (".pkl", ".pickle", ".cloudpickle")
PICKLE_MAGIC = (b"\x80\x04", b"\x80\x05")  # pickle protocols 4 and 5 (cloudpickle's defaults)


@pytest.fixture(scope="module")
def base_dir() -> str:
    from tasks.data.models import resolve_model

    return resolve_model(BASE)


@pytest.fixture(scope="module")
def encoder(base_dir):
    from crucible.embed import load_encoder

    return load_encoder(base_dir)[0]


def _state(module) -> dict:
    return {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}


def _head(hidden: int, n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(n, hidden, generator=g) * 0.5, "bias": torch.randn(n, generator=g) * 0.1}


@pytest.fixture(scope="module")
def finetune_dir(tmp_path_factory, encoder) -> Path:
    """A finetune stage folder as tasks/stages/finetune.py writes it: the backbone, a (random) head with its
    classes in the metadata, the resolved config."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("finetune") / "finetune"
    d.mkdir()
    save_file(_state(encoder), str(d / "model.safetensors"), {"format": "pt", "base_model": BASE})
    save_file(
        _head(encoder.config.hidden_size, 2, 0),
        str(d / "head.safetensors"),
        {"classes": json.dumps(["fresh", "rotten"])},
    )
    (d / "config.json").write_text(
        json.dumps(
            {"task": "rotten", "base_model": BASE, "classes": ["fresh", "rotten"], "max_length": 32, "pooling": "mean"}
        )
    )
    return d


def _multitask_source(dest: Path, encoder, kind: str, pattern: str) -> Path:
    """models/merge/ (float) or models/quantize/ (MXFP4) as their stages write them: the encoder's
    weights, one random head per task, config.json."""
    import copy

    from safetensors.torch import save_file

    from crucible.quant import quantize_model, save_quantized

    dest.mkdir(parents=True)
    classes = {"rotten": ["fresh", "rotten"], "bbc": ["business", "sport", "tech"]}
    if kind == "float":
        save_file(_state(encoder), str(dest / "model.safetensors"), {"format": "pt"})
    else:
        model = copy.deepcopy(encoder)
        quantize_model(model, pattern, "floor")
        save_quantized(model, dest / "model.safetensors")
    heads = {}
    for i, (t, names) in enumerate(classes.items()):
        heads.update({f"{t}.{k}": v for k, v in _head(encoder.config.hidden_size, len(names), i + 1).items()})
    save_file(heads, str(dest / "heads.safetensors"))
    (dest / "config.json").write_text(
        json.dumps(
            {"base_model": BASE, "classes": classes, "order": list(classes), "max_length": {"rotten": 32, "bbc": 32}}
        )
    )
    return dest


@pytest.fixture(scope="module")
def saved_models(
    tmp_path_factory, base_dir, encoder, finetune_dir, project_root
) -> dict[str, tuple[Path, pd.DataFrame]]:
    """name -> (saved model folder, its input) for every kind of model crucible logs."""
    from tasks.registry.pyfunc import save_multitask_model, save_text_classifier

    pattern = yaml.safe_load((project_root / "params.yaml").read_text())["quantize"]["modules"]
    tmp = tmp_path_factory.mktemp("models")
    out = {}
    text_input = pd.DataFrame({"text": TEXTS})
    out["text_classifier"] = (
        save_text_classifier(tmp / "text_classifier", finetune_dir, base_dir, text_input),
        text_input,
    )
    multi_input = pd.DataFrame({"text": TEXTS, "task": ["rotten", "rotten", "bbc", "bbc", "bbc"]})
    for kind in ("float", "quantized"):
        source = _multitask_source(tmp / f"source_{kind}", encoder, kind, pattern)
        out[f"multitask_{kind}"] = (
            save_multitask_model(tmp / f"multitask_{kind}", source, kind, base_dir, multi_input.head(2)),
            multi_input,
        )
    return out


KINDS = ("text_classifier", "multitask_float", "multitask_quantized")


def _is_safetensors(path: Path) -> bool:
    """A well-formed safetensors file: u64 header length, then that many bytes of a JSON object.
    (Its first two bytes can happen to equal a pickle's, e.g. for a 1152-byte header.)"""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return False
        n = struct.unpack("<Q", head)[0]
        if n > path.stat().st_size - 8:
            return False
        try:
            return isinstance(json.loads(fh.read(n)), dict)
        except ValueError:
            return False


def pickles_in(folder: Path) -> list[str]:
    """Every file under `folder` that is, or holds, a pickle: by name, by the protocol bytes it
    starts with, or a zip (torch.save's format) with a pickle inside."""
    found = []
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = str(f.relative_to(folder))
        if f.name.lower().endswith(PICKLE_SUFFIXES):
            found.append(rel)
            continue
        with open(f, "rb") as fh:
            start = fh.read(2)
        if start in PICKLE_MAGIC and not _is_safetensors(f):
            found.append(rel)
        elif zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as z:
                found += [f"{rel}:{n}" for n in z.namelist() if n.lower().endswith(PICKLE_SUFFIXES)]
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_saved_pyfunc_has_no_pickle_and_names_a_code_file(saved_models, kind):
    folder, _ = saved_models[kind]
    assert pickles_in(folder) == []
    assert not (folder / "python_model.pkl").exists()
    flavor = yaml.safe_load((folder / "MLmodel").read_text())["flavors"]["python_function"]
    assert "python_model" not in flavor, flavor  # the key of a cloudpickled PythonModel
    code = flavor["model_code_path"]
    assert code.endswith(".py") and (folder / Path(code).name).is_file(), flavor
    assert (folder / Path(code).name).read_text().count("mlflow.models.set_model(") == 1
    expected = "TextClassifier" if kind == "text_classifier" else "MultiTaskClassifier"
    assert flavor["config"] == {"crucible_model": expected}  # the model_config that picks the class
    assert (folder / "code" / "crucible" / "train.py").is_file()  # the library travels with the model
    assert not list((folder / "code").rglob("__pycache__"))


def test_the_pickle_check_sees_a_pickle(tmp_path):
    """The check above is not vacuous: a cloudpickled pyfunc, a renamed pickle and a torch.save file
    are all caught."""
    import pickle

    import mlflow.pyfunc

    class Echo(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):
            return model_input

    mlflow.pyfunc.save_model(str(tmp_path / "pickled"), python_model=Echo())
    assert "python_model.pkl" in pickles_in(tmp_path / "pickled")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "weights.bin").write_bytes(pickle.dumps({"a": 1}, protocol=4))
    torch.save({"w": torch.zeros(2)}, tmp_path / "other" / "model.pt")
    assert [p.split(":")[0] for p in pickles_in(tmp_path / "other")] == ["model.pt", "weights.bin"]


# loads the model with every unpickling entry point raising: pickle's, cloudpickle's and
# MLflow's own switch for cloudpickled pyfuncs
FRESH = r"""
import sys

def refuse(*args, **kwargs):
    raise AssertionError("unpickling while loading the model")

import pickle
pickle.load = pickle.loads = refuse
class NoUnpickler(pickle.Unpickler):
    def __init__(self, *args, **kwargs):
        refuse()
pickle.Unpickler = NoUnpickler
import cloudpickle
cloudpickle.load = cloudpickle.loads = refuse

import mlflow.pyfunc, pandas as pd, torch
torch.set_num_threads(1)
model = mlflow.pyfunc.load_model(sys.argv[1])
assert type(model.unwrap_python_model()).__module__.startswith("code_model_"), "not the logged code"
print("CLASS", type(model.unwrap_python_model()).__name__)
model.predict(pd.read_json(sys.argv[2], orient="records")).to_json(sys.argv[3], orient="records")
"""


@pytest.mark.parametrize("kind", KINDS)
def test_pyfunc_loads_in_a_fresh_process_without_unpickling(saved_models, kind, tmp_path):
    import mlflow.pyfunc

    folder, frame = saved_models[kind]
    frame.to_json(tmp_path / "in.json", orient="records")
    env = {**os.environ, "PYTHONPATH": "", "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, str(folder), str(tmp_path / "in.json"), str(tmp_path / "out.json")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = "TextClassifier" if kind == "text_classifier" else "MultiTaskClassifier"
    assert f"CLASS {expected}" in proc.stdout
    fresh = pd.DataFrame(json.loads((tmp_path / "out.json").read_text()))
    local = mlflow.pyfunc.load_model(str(folder)).predict(frame)
    assert list(fresh.columns) == list(local.columns)
    assert fresh["label"].tolist() == local["label"].tolist()
    for c in [c for c in local.columns if c.startswith("proba_")]:
        a, b = local[c].astype(float).to_numpy(), fresh[c].astype(float).to_numpy()
        assert np.array_equal(np.isnan(a), np.isnan(b)), c
        assert np.allclose(a[~np.isnan(a)], b[~np.isnan(b)], atol=1e-6), c
