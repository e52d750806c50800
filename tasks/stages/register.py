"""Stage `register` (once): the deployable model as one multi-task MLflow pyfunc in the model
registry, with a gated `champion` alias and lineage tags.

    crucible stage register

Reads the deployable model (`register.model`: `quantized` = models/quantize/, the packed MXFP4
encoder with its low-rank compensation; `float` = models/merge/, the float merged encoder), with
every task's deployed head (heads.safetensors, config.json), metrics/evaluate.json (its `deployable`
entry: test accuracy per task of both models, and `value`: their paired comparisons with the
frozen-base probe), metrics/predictions.parquet (every test row's prediction) and dvc.lock (lineage).

1. Model hash: md5 over the kind, the md5 of the model's model.safetensors, heads.safetensors and
   config.json, and the md5 of the pyfunc code (tasks/registry/pyfunc.py). If a version of
   `tracking.registered_model` already carries that hash, nothing new is registered: the stage
   says so (registered.json `new_version: false`, and the log) and only re-applies the gate to
   that version (gate params may have changed).
2. Otherwise the pyfunc (tasks.registry.pyfunc.MultiTaskClassifier: text + task in, label + probabilities
   out; weights, heads, tokenizer, crucible's code and pinned requirements inside) is saved and checked
   (tasks/registry/verify.py: its files are what their stage recorded, and it loads and predicts in a
   fresh process as serving will; else exit 2 naming the file, and no version or alias changes),
   logged as an MLflow model of this stage's run and registered as a new version; its test
   predictions go to the run too (gate/predictions.parquet), so a later version is compared with it
   row by row.
3. The gate (tasks/registry/gate.py): with the 95 % intervals of paired comparisons on every test
   row, no task significantly below the frozen-base probe, the task mean significantly above it
   (`register.require_gain`), the task mean not significantly below the current champion's on the
   same rows (`register.tolerance`), and every task at or above a floor where one is set
   (`register.floors`, `register.floor`). A passing version gets the alias `champion`; otherwise
   `challenger`, the tag `crucible.gate.reason` says why, and the stage succeeds. The rule and the
   intervals are the tags `crucible.gate.rule` and `crucible.gate.record`. Aliases only: registry
   stages are deprecated in MLflow 3.
4. Tags on the version: model hash, kind, variant, sizes, the gate's decision, reason, rule and
   intervals, the evaluate metrics, and lineage (tasks.registry.lineage: git commit, dvc.lock md5 of
   every upstream artifact, the params of each stage). `crucible lineage <version|alias>` resolves them.

Output: metrics/registered.json (name, version, aliases, model hash, gate decision, reason, checks
and intervals, accuracy, sizes; a DVC metric, not cached).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pandas as pd

from crucible.seeding import derive_seed
from tasks.registry import lineage
from tasks.registry.gate import PREDICTIONS_ARTIFACT, champion_comparison, gate, rule
from tasks.registry.registry import HASH_TAG, PYFUNC_CODE, apply_gate, ensure_registered_model, log_pyfunc, versions
from tasks.registry.verify import verify_pyfunc
from tasks.runtime.declaration import StageSpec
from tasks.runtime.io import AtomicOutputs, md5_file, rebuild_hint
from tasks.runtime.params_schema import Params
from tasks.runtime.paths import BASE_MANIFEST, EVALUATE_JSON, MERGE, PREDICTIONS, QUANTIZE, REGISTERED

SOURCES = {"quantized": QUANTIZE, "float": MERGE}
MODEL_FILES = ("model.safetensors", "heads.safetensors", "config.json")


SPEC = StageSpec(
    name="register",
    per_task=False,
    comment="Once: the deployable model (register.model) with every task's head as one MLflow pyfunc in "
    "the registry; the alias `champion` moves only through the gate. Not cached: the registry "
    "holds the model; a forced rerun of the same model registers nothing.",
    deps=(
        str(BASE_MANIFEST),
        *(str(SOURCES[k] / n) for k in ("quantized", "float") for n in MODEL_FILES),
        str(EVALUATE_JSON),
        str(PREDICTIONS),
        "data/{task}/test.parquet",
    ),
    params=("pipeline.seed", "tracking.registered_model", "model", "register", "evaluate.level", "evaluate.n_boot"),
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
    path = Path(root) / EVALUATE_JSON
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


def set_floors(params: Params, tasks: list[str]) -> dict[str, float]:
    """The floors set in params: `register.floors[task]`, else `register.floor` (none when null)."""
    cfg = params.register
    unknown = sorted(set(cfg.floors) - set(tasks))
    if unknown:
        raise ValueError(
            f"register.floors names tasks {unknown} that the model has no head for (its tasks: {', '.join(tasks)})"
        )
    floors = {t: float(cfg.floor) for t in tasks} if cfg.floor is not None else {}
    return {**floors, **{t: float(v) for t, v in cfg.floors.items()}}


def read_value(root: Path, kind: str, tasks: list[str]) -> tuple[dict, pd.DataFrame]:
    """(evaluate.json's comparisons of the deployed model with the probe, {task: ..., "mean": ...};
    every test row's task, id, text_md5, text, label and the deployed model's prediction `pred`)."""
    from tasks.runtime.io import read_stage_output, read_table

    hint = "run the evaluate stage first (`crucible stage evaluate` or `dvc repro evaluate`)"
    value = json.loads((Path(root) / EVALUATE_JSON).read_text()).get("value") or {}
    versus = (value.get("comparisons") or {}).get(f"{kind}_vs_probe")
    if not isinstance(versus, dict) or "mean" not in versus or any(t not in versus for t in tasks):
        raise ValueError(
            f"{Path(root) / EVALUATE_JSON}: no 'value.comparisons.{kind}_vs_probe' for tasks {tasks}; {hint}"
        )
    preds = read_stage_output(
        Path(root) / PREDICTIONS, "predictions", ("task", "id", "text_md5", "label", kind), "evaluate"
    )
    preds = preds[preds["task"].isin(tasks)].rename(columns={kind: "pred"})
    texts = []
    for t, g in preds.groupby("task", sort=False):
        test = read_table(Path(root) / "data" / t / "test.parquet", "test")
        if len(test) != len(g) or (test["id"].astype(str).to_numpy() != g["id"].to_numpy()).any():
            raise ValueError(
                f"{Path(root) / PREDICTIONS}: its rows of task {t!r} are not data/{t}/test.parquet's; {hint}"
            )
        texts += test["text"].astype(str).tolist()
    return {t: versus[t] for t in [*tasks, "mean"]}, preds.assign(text=texts).reset_index(drop=True)


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
    """Read the deployable model and its evaluation, register it (unless its hash is registered),
    gate it, write registered.json, tag the run."""
    root = Path(root)
    model = read_model(params, root)
    deployable = read_deployable(root, model["kind"], model["tasks"])
    versus_probe, preds = read_value(root, model["kind"], model["tasks"])
    version = register_version(params, root, log, model, deployable, preds)
    cfg = params.register
    floors = set_floors(params, model["tasks"])

    def decide(champion):
        versus_champion = None
        if champion is not None:
            seed = derive_seed(params.pipeline.seed, "champion")
            versus_champion = champion_comparison(
                log.client, champion, preds, root, level=params.evaluate.level, n_boot=params.evaluate.n_boot, seed=seed
            )
        decision = gate(
            deployable["accuracy"],
            floors,
            versus_probe,
            versus_champion,
            tolerance=cfg.tolerance,
            require_gain=cfg.require_gain,
        )
        record = {
            "rule": rule(cfg.require_gain, cfg.tolerance),
            "floors": floors,
            "vs_probe": versus_probe,
            "vs_champion": versus_champion,
        }
        return decision, record

    name = params.tracking.registered_model
    record = apply_gate(log.client, name, version["mv"], decide, hold=hold(params))
    aliases = sorted(log.client.get_model_version(name, version["mv"].version).aliases)
    result = summary(params, model, deployable, version, record, aliases)
    with AtomicOutputs() as atomic:
        atomic.json(result, root / REGISTERED)
    print(f"register: {version['note']}; gate: {record['decision']} ({record['reason']})", file=sys.stderr)
    log.set_tags(
        {
            "crucible.register.version": version["mv"].version,
            "crucible.register.new_version": str(version["new"]).lower(),
            "crucible.register.decision": record["decision"],
            HASH_TAG: version["hash"],
        }
    )
    return {
        "version": int(version["mv"].version),
        "new_version": int(version["new"]),
        "gate_passed": int(record["passed"]),
        "mean_accuracy": deployable["mean_accuracy"],
        **{f"accuracy.{t}": a for t, a in deployable["accuracy"].items()},
        **{f"size_mb.{k}": v for k, v in result["size_mb"].items()},
    }


def read_model(params: Params, root: Path) -> dict:
    """The deployable model's folder, checked: its files, config and tasks."""
    kind = params.register.model
    source = root / SOURCES[kind]
    stage = "quantize" if kind == "quantized" else "merge"
    for n in MODEL_FILES:
        if not (source / n).is_file():
            raise FileNotFoundError(
                f"{source / n}: missing; register.model = {kind!r} registers the {stage} stage's "
                f"model: run `crucible stage {stage}` (or `dvc repro {stage}`)"
            )
    try:
        config = json.loads((source / "config.json").read_text())
    except ValueError as exc:
        raise ValueError(f"{source / 'config.json'}: not valid JSON ({exc}); {rebuild_hint(stage)}") from None
    tasks = [t for t in (config.get("order") or config.get("classes") or {}) if t in (config.get("classes") or {})]
    if not tasks:
        raise ValueError(f"{source / 'config.json'}: no 'classes' per task; {rebuild_hint(stage)}")
    return {"kind": kind, "source": source, "stage": stage, "config": config, "tasks": tasks}


def _outcome(mv, new: bool, note: str, h: str, sizes: dict, lost: str | None) -> dict:
    """register_version's result: the model version, whether it is new, the line to say (with the
    lost-registry warning), the model hash, the sizes."""
    return {
        "mv": mv,
        "new": new,
        "note": note + (f"; warning: {lost}" if lost else ""),
        "hash": h,
        "sizes": sizes,
        "lost": lost,
    }


def register_version(params: Params, root: Path, log, model: dict, deployable: dict, preds: pd.DataFrame) -> dict:
    """The registered version of this model: the one that carries its hash already, or a new one (the
    pyfunc logged, its predictions beside it, the version created with its tags in one call)."""
    from tasks.data.models import base_model
    from tasks.registry.pyfunc import save_multitask_model
    from tasks.runtime.tracking import WRITE_LOCK, experiment_name, git_commit, git_dirty

    client, name, kind, source = log.client, params.tracking.registered_model, model["kind"], model["source"]
    h = model_hash(root, kind)
    with WRITE_LOCK:
        ensure_registered_model(client, name)
    known = versions(client, name)
    lost = lost_registry(root, name, known)
    if lost:
        print(f"register: warning: {lost}", file=sys.stderr)
    sizes = {
        "served": _size([source / "model.safetensors", source / "heads.safetensors"]),
        "float": _size([root / SOURCES["float"] / n for n in ("model.safetensors", "heads.safetensors")]),
    }
    same = [v for v in known if v.tags.get(HASH_TAG) == h]
    if same:
        mv = same[-1]
        note = f"model hash {h} is already registered as version {mv.version} of {name!r}: nothing new registered"
        sizes["pyfunc"] = int(mv.tags.get("crucible.size.pyfunc_bytes", 0))
        return _outcome(mv, False, note, h, sizes, lost)
    example = example_rows(root, model["tasks"])
    extra = {"batch_size": params.register.batch_size, "variant": deployable["variant"], "model_hash": h}
    base_dir = base_model(params, root).path
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "model"
        model_id, uri = log_pyfunc(
            client,
            log.run_id,
            dest,
            lambda path, mlflow_model: verify_pyfunc(
                root,
                save_multitask_model(path, source, kind, base_dir, example, extra, mlflow_model=mlflow_model),
                source,
                model["stage"],
                example,
            ),
        )
        sizes["pyfunc"] = _tree_size(dest)
        preds_file = Path(tmp) / Path(PREDICTIONS_ARTIFACT).name
        preds[["task", "id", "text_md5", "label", "pred"]].to_parquet(preds_file, index=False)
        with WRITE_LOCK:
            client.log_artifact(log.run_id, str(preds_file), str(Path(PREDICTIONS_ARTIFACT).parent))
    experiment, dirty = experiment_name(), git_dirty(root)
    tags = {
        HASH_TAG: h,
        "crucible.model_kind": kind,
        "crucible.experiment": experiment or "",
        "crucible.git_dirty": "unknown" if dirty is None else str(dirty).lower(),
        "crucible.tasks": ",".join(model["tasks"]),
        "crucible.size.served_bytes": sizes["served"],
        "crucible.size.float_bytes": sizes["float"],
        "crucible.size.pyfunc_bytes": sizes["pyfunc"],
        "crucible.stage_run_id": log.run_id,
        **_metric_tags(deployable, json.loads((root / EVALUATE_JSON).read_text())),
        **lineage.lineage_tags(root, git_commit(root)),
    }
    with WRITE_LOCK:  # the tags go in with the version: one transaction, not one per tag
        mv = client.create_model_version(
            name,
            source=uri,
            run_id=log.run_id,
            model_id=model_id,
            tags={k: str(v) for k, v in tags.items()},
            description=f"{kind} model ({deployable['variant']}), tasks {', '.join(model['tasks'])}, mean test "
            f"accuracy {deployable['mean_accuracy']:.4f}",
        )
    note = f"registered version {mv.version} of {name!r} (model hash {h})"
    return _outcome(mv, True, note, h, sizes, lost)


def hold(params: Params) -> str | None:
    """Why this run may not move the champion: a DVC experiment, or register.promote: false."""
    from tasks.runtime.tracking import experiment_name

    experiment = experiment_name()
    if experiment:
        return f"DVC experiment {experiment!r} (dvc exp run never promotes)"
    return None if params.register.promote else "register.promote is false"


def summary(params: Params, model: dict, deployable: dict, version: dict, record: dict, aliases: list) -> dict:
    """metrics/registered.json."""
    from tasks.runtime.tracking import experiment_name

    name, mv, sizes = params.tracking.registered_model, version["mv"], version["sizes"]
    return {
        "name": name,
        "version": mv.version,
        "new_version": version["new"],
        "aliases": aliases,
        "model_hash": version["hash"],
        "model": model["kind"],
        "variant": deployable["variant"],
        "model_uri": f"models:/{name}/{mv.version}",
        "run_id": mv.run_id,
        "experiment": experiment_name(),
        "promote": params.register.promote and not experiment_name(),
        "note": version["note"],
        "lost_registry": version["lost"],
        "gate": record,
        "accuracy": deployable["accuracy"],
        "mean_accuracy": deployable["mean_accuracy"],
        "n_test": deployable["n_test"],
        "size_bytes": sizes,
        "size_mb": {k: v / 2**20 for k, v in sizes.items()},
        "size_ratio_served_to_float": sizes["served"] / sizes["float"] if sizes["float"] else None,
    }
