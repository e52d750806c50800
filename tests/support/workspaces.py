"""Workspaces the stage and end-to-end tests share, built once per test session: a tiny-profile
workspace with a synthetic merged model and the real quantize stage's output (`base_workspace`),
and a copy whose registry holds one champion (`registered_workspace`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml
from safetensors.torch import save_file

from tasks.stages import execute

ROOT = Path(__file__).resolve().parents[2]
QUANT_VARIANT = "mxfp4_load_aware"
_CACHE: dict[str, Path] = {}
TASKS = {"rotten": ["fresh", "rotten"], "bbc": ["business", "sport", "tech"]}
WORDS = ["market", "goal", "chip", "vote", "film", "great", "awful", "team", "price", "phone", "plot", "actor"]


def minilm_hash() -> str:
    """The content hash of the packaged MiniLM (what models/base/manifest.json records)."""
    if "minilm_hash" not in _HASHES:
        from tasks.data.models import manifest

        _HASHES["minilm_hash"] = manifest("all-MiniLM-L6-v2")["hash"]
    return _HASHES["minilm_hash"]


_HASHES: dict[str, str] = {}


def fake_merge(root, theta_0: dict, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    merged = {
        k: (v + 0.01 * torch.randn(v.shape, generator=g) * v.std() if v.ndim == 2 else v.clone()).contiguous()
        for k, v in theta_0.items()
    }
    folder = root / "models" / "merge"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(merged, str(folder / "model.safetensors"))
    heads = {}
    for t, classes in TASKS.items():
        heads[f"{t}.weight"] = torch.randn(len(classes), 384, generator=g)
        heads[f"{t}.bias"] = torch.zeros(len(classes))
    save_file(heads, str(folder / "heads.safetensors"), metadata={"classes": json.dumps(TASKS)})
    save_file(heads, str(folder / "task_heads.safetensors"), metadata={"classes": json.dumps(TASKS)})
    (folder / "config.json").write_text(
        json.dumps(
            {
                "base_model": "all-MiniLM-L6-v2",
                "base_model_hash": minilm_hash(),
                "classes": TASKS,
                "main": "gs3r",
                "order": list(TASKS),
                "max_length": {t: 32 for t in TASKS},
            }
        )
    )
    for k, (t, classes) in enumerate(TASKS.items()):
        rng = np.random.default_rng(k)
        for kind, n in (("reference", 20), ("test", 24)):
            df = pd.DataFrame(
                {
                    "id": [f"{kind[0]}{i}" for i in range(n)],
                    "text": [" ".join(rng.choice(WORDS, 7)) for _ in range(n)],
                    "label": [classes[i % len(classes)] for i in range(n)],
                }
            )
            (root / "data" / t).mkdir(parents=True, exist_ok=True)
            df.to_parquet(root / "data" / t / f"{kind}.parquet", index=False)
            if kind == "reference":  # pseudolabel's table: the reference, every fourth row a dev row
                labeled = df.assign(source="reference", confidence=1.0, weight=1.0)
                labeled["split"] = ["dev" if i % 4 == 0 else "train" for i in range(n)]
                labeled.to_parquet(root / "data" / t / "labeled.parquet", index=False)


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("dvc")
    proc = subprocess.run(
        [str(exe), *args],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "DVC_NO_ANALYTICS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, f"dvc {' '.join(args)}: {proc.stderr}"
    return proc


def _paths(entries) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


def fill_stage_files(root: Path, stage: str) -> None:
    """Placeholder files for whatever a dvc.yaml stage declares and the workspace lacks (deps and
    outs, metrics under metrics/ and figures included; a name without a suffix is a folder), so
    `dvc commit` can record it. dvc.yaml must list the files of params.yaml's pipeline.tasks
    (`write_dvc_yaml`), or this fills in other tasks' files."""
    entry = yaml.safe_load((root / "dvc.yaml").read_text())["stages"][stage]
    for path in _paths(entry.get("deps")) + sum((_paths(entry.get(k)) for k in ("outs", "metrics", "plots")), []):
        p = root / path
        if p.exists():
            continue
        if p.suffix:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f"stand-in output for {path}\n")  # lineage hashes files; content is arbitrary
        else:
            p.mkdir(parents=True)
            (p / "contents.txt").write_text(f"stand-in output in {path}\n")


def as_written_by(root: Path, sid: str, *paths: str) -> None:
    """Record files a test wrote in place of stage run `sid` (paths relative to `root`) as that stage's
    latest outputs, as a run of it on its own (`crucible stage`) records them, so the stages that read
    them accept them although dvc.lock holds other hashes (tasks/runtime/lockcheck.py)."""
    from tasks.runtime import lockcheck
    from tasks.runtime.io import md5_file

    lockcheck.record(root, sid, {**lockcheck.recorded(root, sid), **{p: md5_file(root / p) for p in paths}})


def write_evaluate(
    root: Path,
    accuracy: dict[str, float],
    float_accuracy: dict[str, float] | None = None,
    probe_accuracy: float = 0.1,
) -> None:
    """metrics/evaluate.json and metrics/predictions.parquet as the evaluate stage writes them, for a
    model of the given test accuracy per task: on each task's test rows the model is right on the
    first round(accuracy x n) of them, the frozen-base probe on the first round(probe_accuracy x n);
    the comparisons (tasks.report.value) are computed from those rows."""
    from tasks.report.value import text_md5, value

    frames = []
    for t, acc in accuracy.items():
        test = pd.read_parquet(root / "data" / t / "test.parquet")
        n, labels = len(test), test["label"].astype(str).to_numpy()
        wrong = np.array([TASKS[t][(TASKS[t].index(y) + 1) % len(TASKS[t])] for y in labels])

        def predict(a: float) -> np.ndarray:
            return np.where(np.arange(n) < round(a * n), labels, wrong)

        cols = {
            "probe": predict(probe_accuracy),
            "quantized": predict(acc),
            "float": predict((float_accuracy or accuracy)[t]),
        }
        cols.update(finetune=cols["float"], merged=cols["float"])
        frames.append(
            pd.DataFrame(
                {
                    "task": t,
                    "row": np.arange(n),
                    "id": test["id"].astype(str),
                    "text_md5": text_md5(test["text"]),
                    "label": labels,
                    **cols,
                }
            )
        )
    preds = pd.concat(frames, ignore_index=True)
    worth = value(preds, level=0.95, n_boot=2000, seed=0)

    def entry(variant, kind):
        acc = {t: a for t, a in worth["accuracy"][kind].items() if t != "mean"}
        return {
            "variant": variant,
            "accuracy": acc,
            "mean_accuracy": float(np.mean(list(acc.values()))),
            "n_test": worth["n_test"],
        }

    data = {
        "deployable": {"quantized": entry(f"quantize:{QUANT_VARIANT}", "quantized"), "float": entry("gs3r", "float")},
        "value": worth,
    }
    (root / "metrics").mkdir(exist_ok=True)
    (root / "metrics" / "evaluate.json").write_text(json.dumps(data, indent=2))
    preds.to_parquet(root / "metrics" / "predictions.parquet", index=False)
    as_written_by(root, "evaluate", "metrics/evaluate.json", "metrics/predictions.parquet")


def base_workspace(tmp_path_factory) -> Path:
    """A tiny-profile workspace with two tasks, a synthetic merged model, the real quantize stage's
    output, a metrics/evaluate.json and a dvc.lock that DVC wrote for merge, quantize and evaluate."""
    if "base" in _CACHE:
        return _CACHE["base"]
    import torch

    from crucible.embed import load_encoder
    from tasks.data.models import resolve_model
    from tasks.runtime.workspace import make_workspace
    from tasks.stages import write_dvc_yaml

    torch.set_num_threads(1)
    root = make_workspace(
        ROOT,
        tmp_path_factory.mktemp("register"),
        "tiny",
        overrides={"quantize": {"calibration_per_task": 8, "rank_per_matrix": 2}},
    )  # 36 x 2 = 72
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["pipeline"]["tasks"] = {"rotten": {"corpus": "rotten_tomatoes"}, "bbc": {"corpus": "bbc_news"}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    write_dvc_yaml(root)  # the stages over all tasks list these two tasks' files (`crucible dag write`)
    encoder, _ = load_encoder(resolve_model("all-MiniLM-L6-v2"))
    fake_merge(root, {k: v.detach().clone().contiguous() for k, v in encoder.state_dict().items()})
    execute("model", None, root)  # models/base/manifest.json: the base model's hash
    execute("quantize", None, root)
    write_evaluate(root, {"rotten": 0.6, "bbc": 0.5})
    for stage in ("merge", "quantize", "evaluate"):
        fill_stage_files(root, stage)
    _dvc(root, "commit", "--force", "model", "merge", "quantize", "evaluate")
    _CACHE["base"] = root
    return root


def copy_workspace(base: Path, tmp_path_factory, name: str) -> Path:
    """A copy of `base` with its tracking store (copying the database saves creating a new one; opened
    in the copy, its artifact locations move to the copy's own mlartifacts/), without any registered
    model and without base's artifact files (no test reads the earlier runs' artifacts)."""
    dest = tmp_path_factory.mktemp(name) / "ws"
    shutil.copytree(
        base, dest, symlinks=True, ignore=shutil.ignore_patterns("mlartifacts", "register", "registered.json")
    )
    return dest


def registered_workspace(tmp_path_factory) -> Path:
    """A copy of the base workspace whose registry holds one version, the champion."""
    if "registered" not in _CACHE:
        root = copy_workspace(base_workspace(tmp_path_factory), tmp_path_factory, "registered")
        execute("register", None, root)
        _CACHE["registered"] = root
    return _CACHE["registered"]


def test_texts(root: Path) -> pd.DataFrame:
    """Every test text of every task, the tasks interleaved."""
    frames = [pd.read_parquet(root / "data" / t / "test.parquet").assign(task=t) for t in ("rotten", "bbc")]
    return pd.concat(frames).sort_values("id", kind="stable").reset_index(drop=True)[["text", "task", "label"]]


test_texts.__test__ = False  # a helper, not a test
