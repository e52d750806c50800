"""Stage `register` (once): the deployable model as one multi-task MLflow pyfunc in the model
registry, with a gated `champion` alias and lineage tags.

    crucible stage register

Reads the deployable model (`register.model`: `quantized` = models/quantize/, the packed MXFP4
encoder with its low-rank compensation; `float` = models/merge/, the float merged encoder), with
every task's head (heads.safetensors, config.json), metrics/evaluate.json (its `deployable` entry:
test accuracy per task of both models) and dvc.lock (lineage).

1. Model hash: md5 over the kind, the md5 of the model's model.safetensors, heads.safetensors and
   config.json, and the md5 of the pyfunc code (tasks/registry/pyfunc.py). If a version of
   `tracking.registered_model` already carries that hash, nothing new is registered: the stage
   says so (registered.json `new_version: false`, and the log) and only re-applies the gate to
   that version (gate params may have changed).
2. Otherwise the pyfunc (tasks.registry.pyfunc.MultiTaskClassifier: text + task in, label + probabilities
   out; weights, heads, tokenizer, crucible's code and pinned requirements inside) is logged as an
   MLflow model of this stage's run and registered as a new version.
3. The gate: the version gets the alias `champion` when no task's test accuracy is below its floor
   (`register.floors`, else `register.floor`, else derived from the data: the better of chance and
   the base model, plus `register.floor_margin`; floor_basis) and its mean test accuracy is at
   least the current champion's minus `register.tolerance`; the first version needs only the floors. Otherwise it
   gets the alias `challenger`, the tag `crucible.gate.reason` says why, and the stage succeeds.
   Aliases only: registry stages are deprecated in MLflow 3.
4. Tags on the version: model hash, kind, variant, sizes, the gate's decision and reason, the
   evaluate metrics, and lineage (tasks.runtime.lineage: git commit, dvc.lock md5 of every upstream
   artifact, the params of each stage). `crucible lineage <version|alias>` resolves them.

Output: metrics/registered.json (name, version, aliases, model hash, gate decision and
reason, accuracy, sizes; a DVC metric, not cached).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pandas as pd

from tasks.data.models import MANIFEST
from tasks.registry.registry import HASH_TAG, PYFUNC_CODE, apply_gate, ensure_registered_model, log_pyfunc, versions
from tasks.runtime import lineage
from tasks.runtime.declaration import StageSpec
from tasks.runtime.io import AtomicOutputs, md5_file
from tasks.runtime.params_schema import Params
from tasks.runtime.tracking import REGISTERED  # metrics/registered.json

SOURCES = {"quantized": Path("models") / "quantize", "float": Path("models") / "merge"}
MODEL_FILES = ("model.safetensors", "heads.safetensors", "config.json")
EVALUATE = Path("metrics") / "evaluate.json"


SPEC = StageSpec(
    name="register",
    per_task=False,
    comment="Once: the deployable model (register.model) with every task's head as one MLflow pyfunc in "
    "the registry; the alias `champion` moves only through the gate. Not cached: the registry "
    "holds the model; a forced rerun of the same model registers nothing.",
    deps=(
        str(MANIFEST),
        *(str(SOURCES[k] / n) for k in ("quantized", "float") for n in MODEL_FILES),
        str(EVALUATE),
        "data/{task}/test.parquet",
    ),
    params=("tracking.registered_model", "model", "register"),
    metrics=(str(REGISTERED),),
)


# ---------------------------------------------------------------------------------------------------
# pieces that need no registry


def model_hash(root: Path, kind: str) -> str:
    """The content hash of the packaged model: kind, its weight, head and config files, pyfunc code."""
    source = Path(root) / SOURCES[kind]
    parts = (
        [f"kind={kind}"] + [f"{n}={md5_file(source / n)}" for n in MODEL_FILES] + [f"pyfunc={md5_file(PYFUNC_CODE)}"]
    )
    return hashlib.md5("\n".join(parts).encode()).hexdigest()


def read_deployable(root: Path, kind: str, tasks: list[str]) -> dict:
    """evaluate.json's test accuracy of the deployable model: {variant, accuracy, mean_accuracy, n_test}."""
    path = Path(root) / EVALUATE
    hint = "run the evaluate stage first (`crucible stage evaluate` or `dvc repro evaluate`)"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the register stage gates on its test accuracy: {hint}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); {hint}") from None
    entry = (data.get("deployable") or {}).get(kind)
    if not isinstance(entry, dict) or not isinstance(entry.get("accuracy"), dict):
        raise ValueError(f"{path}: no 'deployable.{kind}.accuracy' (register.model = {kind!r}); {hint}")
    missing = [t for t in tasks if t not in entry["accuracy"]]
    if missing:
        raise ValueError(f"{path}: 'deployable.{kind}.accuracy' has no figure for tasks {missing} of the model; {hint}")
    accuracy = {t: float(entry["accuracy"][t]) for t in tasks}
    mean = entry.get("mean_accuracy")
    mean = float(mean) if mean is not None else sum(accuracy.values()) / len(accuracy)
    return {
        "variant": entry.get("variant", kind),
        "accuracy": accuracy,
        "mean_accuracy": mean,
        "n_test": {t: int(v) for t, v in (entry.get("n_test") or {}).items()},
    }


def floors_for(
    params: Params, tasks: list[str], classes: dict[str, list] | None = None, baselines: dict | None = None
) -> dict[str, float]:
    """Each task's floor (floor_basis says where each comes from)."""
    return floor_basis(params, tasks, classes, baselines)[0]


def floor_basis(
    params: Params, tasks: list[str], classes: dict[str, list] | None = None, baselines: dict | None = None
) -> tuple[dict[str, float], dict[str, str]]:
    """({task: floor}, {task: where it comes from}). A task's floor is `register.floors[task]`, else
    `register.floor`, else (floor: null) derived from the data: the better of chance and the base
    model, plus `register.floor_margin`. Chance is the majority class's share of the test rows the
    accuracy was measured on (evaluate.json's `baselines.chance`; never below 1/n_classes, and
    1/n_classes alone when evaluate did not record it); the base model is the base encoder with the
    task's head (`baselines.base`), when recorded. So a model no better than guessing the majority
    class, or than the encoder it started from, never becomes the champion by default."""
    cfg = params.register
    unknown = sorted(set(cfg.floors) - set(tasks))
    if unknown:
        raise ValueError(
            f"register.floors names tasks {unknown} that the model has no head for (its tasks: {', '.join(tasks)})"
        )
    classes, baselines = classes or {}, baselines or {}
    floors, basis = {}, {}
    for t in tasks:
        if t in cfg.floors:
            floors[t], basis[t] = float(cfg.floors[t]), "register.floors"
            continue
        if cfg.floor is not None:
            floors[t], basis[t] = float(cfg.floor), "register.floor"
            continue
        n = len(classes.get(t) or ()) or None
        uniform = 1.0 / n if n else 0.0
        chance = (baselines.get("chance") or {}).get(t)
        if chance is None:
            chance, what = uniform, f"chance 1/{n} classes = {uniform:.4f}" if n else "chance unknown"
        else:
            chance = max(float(chance), uniform)
            what = f"chance {chance:.4f} (the majority class's share of its test rows)"
        base = (baselines.get("base") or {}).get(t)
        parts = [what] + ([f"the base model {float(base):.4f}"] if base is not None else [])
        best = max(chance, float(base) if base is not None else 0.0)
        floors[t] = round(min(1.0, best + cfg.floor_margin), 6)
        basis[t] = (
            f"{'the better of ' + ' and '.join(parts) if len(parts) > 1 else parts[0]}, "
            f"+ register.floor_margin {cfg.floor_margin:g}"
        )
    return floors, basis


def lost_registry(root: Path, name: str, known: list) -> str | None:
    """What was lost when the registry holds no version of `name` but this workspace's
    registered.json says it registered one before (the tracking store was deleted or replaced);
    None otherwise."""
    path = Path(root) / REGISTERED
    if known or not path.is_file():
        return None
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(before, dict) or before.get("name") != name or before.get("version") is None:
        return None
    aliases = f" ({', '.join(before.get('aliases') or [])})" if before.get("aliases") else ""
    return (
        f"the registry holds no version of {name!r}, but {path} records version {before['version']}{aliases}, "
        f"model hash {before.get('model_hash', '?')}: the tracking store was deleted or replaced, and the "
        f"versions, aliases and gate history it held are lost; numbering starts again at 1 and the gate has no "
        f"champion to compare with"
    )


def example_rows(root: Path, tasks: list[str]) -> pd.DataFrame:
    """The model's input example: the first test text of each task (read_table validates the split
    and names the file if it is missing or broken)."""
    from tasks.runtime.io import read_table

    rows = [
        {"text": str(read_table(Path(root) / "data" / t / "test.parquet", "test")["text"].iloc[0])[:300], "task": t}
        for t in tasks
    ]
    return pd.DataFrame(rows)


def _size(paths) -> int:
    return sum(Path(p).stat().st_size for p in paths if Path(p).is_file())


def _tree_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _metric_tags(deployable: dict, evaluate: dict) -> dict:
    tags = {"crucible.metric.mean_accuracy": deployable["mean_accuracy"], "crucible.variant": deployable["variant"]}
    tags.update({f"crucible.metric.accuracy.{t}": a for t, a in deployable["accuracy"].items()})
    tags.update({f"crucible.metric.n_test.{t}": n for t, n in deployable["n_test"].items()})

    def walk(obj, prefix, depth):
        if isinstance(obj, bool):
            return
        if isinstance(obj, (int, float)):
            tags[lineage.tag_key("crucible.evaluate.", prefix)] = obj
        elif isinstance(obj, dict) and depth < 4:
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k), depth + 1)

    # evaluate's headline figures: every number of its deployable block and its top-level numbers
    walk(evaluate.get("deployable") or {}, "deployable", 1)
    for k, v in evaluate.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            tags[lineage.tag_key("crucible.evaluate.", k)] = v
    return tags


# ---------------------------------------------------------------------------------------------------
# the stage


def run(params: Params, task: str | None, root: Path, log) -> dict:
    from tasks.data.models import base_model
    from tasks.registry.pyfunc import save_multitask_model
    from tasks.runtime.tracking import experiment_name, git_commit, git_dirty

    cfg = params.register
    root = Path(root)
    name = params.tracking.registered_model
    kind = cfg.model
    source = root / SOURCES[kind]
    for n in MODEL_FILES:
        if not (source / n).is_file():
            stage = "quantize" if kind == "quantized" else "merge"
            raise FileNotFoundError(
                f"{source / n}: missing; register.model = {kind!r} registers the {stage} stage's "
                f"model: run `crucible stage {stage}` (or `dvc repro {stage}`)"
            )
    stage = "quantize" if kind == "quantized" else "merge"
    try:
        config = json.loads((source / "config.json").read_text())
    except ValueError as exc:
        raise ValueError(
            f"{source / 'config.json'}: not valid JSON ({exc}); rebuild it with `crucible stage {stage}` "
            f"(or `dvc repro {stage}`)"
        ) from None
    tasks = [t for t in (config.get("order") or config.get("classes") or {}) if t in (config.get("classes") or {})]
    if not tasks:
        raise ValueError(f"{source / 'config.json'}: no 'classes' per task; rebuild it")
    deployable = read_deployable(root, kind, tasks)
    evaluate = json.loads((root / EVALUATE).read_text())
    floors, basis = floor_basis(params, tasks, config.get("classes"), evaluate.get("baselines"))
    h = model_hash(root, kind)
    served = _size([source / "model.safetensors", source / "heads.safetensors"])
    float_size = _size([root / SOURCES["float"] / "model.safetensors", root / SOURCES["float"] / "heads.safetensors"])
    client = log.client
    from tasks.runtime.tracking import _WRITE_LOCK

    with _WRITE_LOCK:
        ensure_registered_model(client, name)
    known = versions(client, name)
    lost = lost_registry(root, name, known)
    if lost:
        print(f"register: warning: {lost}", file=sys.stderr)
    same = [v for v in known if v.tags.get(HASH_TAG) == h]
    if same:
        mv = same[-1]
        new = False
        note = f"model hash {h} is already registered as version {mv.version} of {name!r}: nothing new registered"
        pyfunc_bytes = int(mv.tags.get("crucible.size.pyfunc_bytes", 0))
    else:
        new = True
        commit = git_commit(root)
        base_dir = base_model(params, root).path
        example = example_rows(root, tasks)
        extra = {"batch_size": cfg.batch_size, "variant": deployable["variant"], "model_hash": h}
        with tempfile.TemporaryDirectory() as tmp:
            dest = Path(tmp) / "model"
            model_id, uri = log_pyfunc(
                client,
                log.run_id,
                dest,
                lambda path, mlflow_model: save_multitask_model(
                    path, source, kind, base_dir, example, extra, mlflow_model=mlflow_model
                ),
            )
            pyfunc_bytes = _tree_size(dest)
        experiment, dirty = experiment_name(), git_dirty(root)
        tags = {
            HASH_TAG: h,
            "crucible.model_kind": kind,
            "crucible.experiment": experiment or "",
            "crucible.git_dirty": "unknown" if dirty is None else str(dirty).lower(),
            "crucible.tasks": ",".join(tasks),
            "crucible.size.served_bytes": served,
            "crucible.size.float_bytes": float_size,
            "crucible.size.pyfunc_bytes": pyfunc_bytes,
            "crucible.stage_run_id": log.run_id,
            **_metric_tags(deployable, evaluate),
            **lineage.lineage_tags(root, commit),
        }
        with _WRITE_LOCK:  # the tags go in with the version: one transaction, not one per tag
            mv = client.create_model_version(
                name,
                source=uri,
                run_id=log.run_id,
                model_id=model_id,
                tags={k: str(v) for k, v in tags.items()},
                description=f"{kind} model ({deployable['variant']}), tasks "
                f"{', '.join(tasks)}, mean test accuracy "
                f"{deployable['mean_accuracy']:.4f}",
            )
        note = f"registered version {mv.version} of {name!r} (model hash {h})"
    if lost:
        note += f"; warning: {lost}"
    experiment = experiment_name()
    hold = (
        f"DVC experiment {experiment!r} (dvc exp run never promotes)"
        if experiment
        else "register.promote is false"
        if not cfg.promote
        else None
    )
    record = apply_gate(
        client, name, mv, deployable["accuracy"], deployable["mean_accuracy"], floors, cfg.tolerance, basis, hold=hold
    )
    aliases = sorted(client.get_model_version(name, mv.version).aliases)
    result = {
        "name": name,
        "version": mv.version,
        "new_version": new,
        "aliases": aliases,
        "model_hash": h,
        "model": kind,
        "variant": deployable["variant"],
        "model_uri": f"models:/{name}/{mv.version}",
        "run_id": mv.run_id,
        "experiment": experiment_name(),
        "promote": cfg.promote and not experiment_name(),
        "note": note,
        "lost_registry": lost,
        "gate": record,
        "accuracy": deployable["accuracy"],
        "mean_accuracy": deployable["mean_accuracy"],
        "n_test": deployable["n_test"],
        "size_bytes": {"served": served, "float": float_size, "pyfunc": pyfunc_bytes},
        "size_mb": {"served": served / 2**20, "float": float_size / 2**20, "pyfunc": pyfunc_bytes / 2**20},
        "size_ratio_served_to_float": served / float_size if float_size else None,
    }
    with AtomicOutputs() as atomic:
        atomic.json(result, root / REGISTERED)
    print(f"register: {note}; gate: {record['decision']} ({record['reason']})", file=sys.stderr)
    log.set_tags(
        {
            "crucible.register.version": mv.version,
            "crucible.register.new_version": str(new).lower(),
            "crucible.register.decision": record["decision"],
            HASH_TAG: h,
        }
    )
    return {
        "version": int(mv.version),
        "new_version": int(new),
        "gate_passed": int(record["passed"]),
        "mean_accuracy": deployable["mean_accuracy"],
        **{f"accuracy.{t}": a for t, a in deployable["accuracy"].items()},
        "served_mb": served / 2**20,
        "float_mb": float_size / 2**20,
        "pyfunc_mb": pyfunc_bytes / 2**20,
    }
