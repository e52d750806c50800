"""Stage `register` (once): the deployable model as one multi-task MLflow pyfunc in the model
registry, with a gated `champion` alias and lineage tags.

    crucible stage register

Reads the deployable model (`register.model`: `quantized` = models/quantize/, the packed MXFP4
encoder with its low-rank compensation; `float` = models/merge/, the float merged encoder), with
every task's head (heads.safetensors, config.json), metrics/evaluate.json (its `deployable` entry:
test accuracy per task of both models) and dvc.lock (lineage).

1. Model hash: md5 over the kind, the md5 of the model's model.safetensors, heads.safetensors and
   config.json, and the md5 of the pyfunc code (tasks/pyfunc.py). If a version of
   `tracking.registered_model` already carries that hash, nothing new is registered: the stage
   says so (registered.json `new_version: false`, and the log) and only re-applies the gate to
   that version (gate params may have changed).
2. Otherwise the pyfunc (tasks.pyfunc.MultiTaskClassifier: text + task in, label + probabilities
   out; weights, heads, tokenizer, crucible's code and pinned requirements inside) is logged as an
   MLflow model of this stage's run and registered as a new version.
3. The gate: the version gets the alias `champion` when no task's test accuracy is below its floor
   (`register.floors`, else `register.floor`) and its mean test accuracy is at least the current
   champion's minus `register.tolerance`; the first version needs only the floors. Otherwise it
   gets the alias `challenger`, the tag `crucible.gate.reason` says why, and the stage succeeds.
   Aliases only: registry stages are deprecated in MLflow 3.
4. Tags on the version: model hash, kind, variant, sizes, the gate's decision and reason, the
   evaluate metrics, and lineage (tasks.lineage: git commit, dvc.lock md5 of every upstream
   artifact, the params of each stage). `crucible lineage <version|alias>` resolves them.

Output: models/register/registered.json (name, version, aliases, model hash, gate decision and
reason, accuracy, sizes; a DVC metric, not cached).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

from tasks import lineage
from tasks.io import AtomicOutputs, md5_file
from tasks.params import Params

OUT = Path("models") / "register"
SOURCES = {"quantized": Path("models") / "quantize", "float": Path("models") / "merge"}
MODEL_FILES = ("model.safetensors", "heads.safetensors", "config.json")
EVALUATE = Path("metrics") / "evaluate.json"
CHAMPION, CHALLENGER = "champion", "challenger"
HASH_TAG = "crucible.model_hash"
PYFUNC_CODE = Path(__file__).resolve().parent / "pyfunc.py"


def inputs(params: Params, task: str | None = None) -> list[Path]:
    source = SOURCES[params.register.model]
    return [source / n for n in MODEL_FILES] + [SOURCES["float"] / "model.safetensors", EVALUATE, Path(lineage.LOCK)]


def outputs(params: Params, task: str | None = None) -> list[Path]:
    return [OUT / "registered.json"]


# ---------------------------------------------------------------------------------------------------
# pieces that need no registry


def model_hash(root: Path, kind: str) -> str:
    """The content hash of the packaged model: kind, its weight, head and config files, pyfunc code."""
    source = Path(root) / SOURCES[kind]
    parts = [f"kind={kind}"] + [f"{n}={md5_file(source / n)}" for n in MODEL_FILES] + [f"pyfunc={md5_file(PYFUNC_CODE)}"]
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
    return {"variant": entry.get("variant", kind), "accuracy": accuracy, "mean_accuracy": mean,
            "n_test": {t: int(v) for t, v in (entry.get("n_test") or {}).items()}}


def floors_for(params: Params, tasks: list[str]) -> dict[str, float]:
    cfg = params.register
    unknown = sorted(set(cfg.floors) - set(tasks))
    if unknown:
        raise ValueError(f"register.floors names tasks {unknown} that the model has no head for "
                         f"(its tasks: {', '.join(tasks)})")
    return {t: float(cfg.floors.get(t, cfg.floor)) for t in tasks}


def gate(accuracy: dict[str, float], mean: float, floors: dict[str, float], tolerance: float,
         champion: dict | None) -> tuple[bool, str]:
    """(passes, reason). `champion`: None (no champion yet) or {version, mean_accuracy (None if
    unknown), optionally tasks}. Passes when no task is below its floor and, if there is a champion,
    mean >= champion's mean - tolerance."""
    below = [f"task {t}: accuracy {accuracy[t]:.4f} below its floor {floors[t]:.4f}" for t in floors
             if accuracy[t] < floors[t]]
    if below:
        return False, "; ".join(below)
    if champion is None:
        return True, f"first version: mean test accuracy {mean:.4f}, every task at or above its floor"
    champ = champion.get("mean_accuracy")
    if champ is None:
        return False, (f"champion version {champion['version']} has no recorded mean test accuracy "
                       f"(tag crucible.metric.mean_accuracy); it is not replaced automatically")
    bar = champ - tolerance
    other = champion.get("tasks")
    note = (f" (the champion's mean is over tasks {', '.join(other)})"
            if other and sorted(other) != sorted(accuracy) else "")
    if mean + 1e-12 >= bar:
        return True, (f"mean test accuracy {mean:.4f} >= champion version {champion['version']}'s {champ:.4f} "
                      f"- tolerance {tolerance:.4f}; every task at or above its floor{note}")
    return False, (f"mean test accuracy {mean:.4f} < champion version {champion['version']}'s {champ:.4f} "
                   f"- tolerance {tolerance:.4f} = {bar:.4f}{note}")


def example_rows(root: Path, tasks: list[str]) -> "pd.DataFrame":
    """The model's input example: the first test text of each task (read_table validates the split
    and names the file if it is missing or broken)."""
    import pandas as pd

    from tasks.io import read_table

    rows = [{"text": str(read_table(Path(root) / "data" / t / "test.parquet", "test")["text"].iloc[0])[:300],
             "task": t} for t in tasks]
    return pd.DataFrame(rows)


def _size(paths) -> int:
    return sum(Path(p).stat().st_size for p in paths if Path(p).is_file())


def _tree_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------
# registry helpers


def _missing(exc) -> bool:
    return getattr(exc, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE")


def version_by_alias(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if _missing(exc):
            return None
        raise


def resolve_version(client, name: str, ref: str):
    """A model version by number ('3') or alias ('champion'); a clear error if neither exists."""
    from mlflow.exceptions import MlflowException

    try:
        if str(ref).isdigit():
            return client.get_model_version(name, str(ref))
        mv = client.get_model_version_by_alias(name, ref)
    except MlflowException as exc:
        if not _missing(exc):
            raise
        mv = None
    if mv is None:
        versions = _versions(client, name)
        aliases: dict[str, list[str]] = {}
        if versions:
            for alias, version in (client.get_registered_model(name).aliases or {}).items():
                aliases.setdefault(str(version), []).append(alias)
        known = ", ".join(f"{v.version}" + (f" ({', '.join(sorted(aliases[str(v.version)]))})"
                                            if str(v.version) in aliases else "") for v in versions)
        raise KeyError(f"registered model {name!r} has no version or alias {ref!r}"
                       + (f"; versions: {known}" if known else "; it has no versions (run the register stage)"))
    return mv


def _versions(client, name: str) -> list:
    from mlflow.exceptions import MlflowException

    try:
        escaped = name.replace("'", "\\'")
        return sorted(client.search_model_versions(f"name = '{escaped}'"), key=lambda v: int(v.version))
    except MlflowException as exc:
        if _missing(exc):
            return []
        raise


def _ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as exc:
        if not _missing(exc):
            raise
        client.create_registered_model(name, description=(
            "crucible's deployable multi-task text classifier: columns text and task in; task, label and "
            "proba_<class> out. Alias 'champion': the version that passed the gate; 'challenger': the latest "
            "that did not."))


def _champion_info(client, name: str) -> dict | None:
    mv = version_by_alias(client, name, CHAMPION)
    if mv is None:
        return None
    mean = mv.tags.get("crucible.metric.mean_accuracy")
    return {"version": mv.version, "mean_accuracy": float(mean) if mean is not None else None,
            "tasks": [t for t in mv.tags.get("crucible.tasks", "").split(",") if t]}


def _log_pyfunc(client, run_id: str, dest: Path, save) -> tuple[str, str]:
    """Log a pyfunc as an MLflow 3 logged model of run `run_id` through the explicit client (no
    fluent active run or global tracking URI: stages run in threads). `save(path, mlflow_model)`
    writes the model folder. Returns (model_id, the source to register: its artifact location)."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    from tasks.tracking import _WRITE_LOCK

    experiment_id = client.get_run(run_id).info.experiment_id
    with _WRITE_LOCK:
        logged = client.create_logged_model(experiment_id=experiment_id, name="model", source_run_id=run_id,
                                            model_type="crucible-multitask-classifier")
    try:
        mlflow_model = Model(artifact_path=logged.artifact_location, run_id=run_id, model_id=logged.model_id,
                             model_uuid=logged.model_id)
        save(dest, mlflow_model)
        with _WRITE_LOCK:
            client.log_model_artifacts(logged.model_id, str(dest))
            client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    except BaseException:
        with _WRITE_LOCK:
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    # the artifact location, not models:/<model_id>: the SQL registry store would resolve that through
    # the global tracking URI instead of this client's
    return logged.model_id, logged.artifact_location


def _set_tags(client, name: str, version: str, tags: dict) -> None:
    from tasks.tracking import _WRITE_LOCK

    with _WRITE_LOCK:
        for k, v in tags.items():
            client.set_model_version_tag(name, version, k, str(v))


def _apply_gate(client, name: str, mv, accuracy: dict, mean: float, floors: dict, tolerance: float) -> dict:
    """Gate version `mv`, move the aliases, tag the decision; returns the gate record."""
    from tasks.tracking import _WRITE_LOCK

    before = version_by_alias(client, name, CHAMPION)
    if before is not None and before.version == mv.version:  # a rerun of the champion: nothing moves
        return {"decision": CHAMPION, "passed": True,
                "reason": f"already the champion ({mv.tags.get('crucible.gate.reason', 'no recorded reason')})",
                "champion_before": mv.version, "champion_after": mv.version, "champion_mean_accuracy": mean,
                "tolerance": tolerance, "floors": floors}
    champion = _champion_info(client, name)
    passed, reason = gate(accuracy, mean, floors, tolerance, champion)
    with _WRITE_LOCK:
        if passed:
            client.set_registered_model_alias(name, CHAMPION, mv.version)
            challenger = version_by_alias(client, name, CHALLENGER)
            if challenger is not None and challenger.version == mv.version:
                client.delete_registered_model_alias(name, CHALLENGER)
        else:
            client.set_registered_model_alias(name, CHALLENGER, mv.version)
    decision = CHAMPION if passed else CHALLENGER
    if passed and before is not None:
        _set_tags(client, name, before.version, {"crucible.gate.superseded_by": mv.version})
    _set_tags(client, name, mv.version, {"crucible.gate.decision": decision, "crucible.gate.reason": reason,
                                         "crucible.gate.tolerance": tolerance,
                                         "crucible.gate.floors": json.dumps(floors, sort_keys=True)})
    after = version_by_alias(client, name, CHAMPION)
    return {"decision": decision, "passed": passed, "reason": reason,
            "champion_before": before.version if before is not None else None,
            "champion_after": after.version if after is not None else None,
            "champion_mean_accuracy": (champion or {}).get("mean_accuracy"), "tolerance": tolerance, "floors": floors}


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
    from tasks.models import resolve_model
    from tasks.pyfunc import save_multitask_model
    from tasks.tracking import git_commit

    cfg = params.register
    root = Path(root)
    name = params.tracking.registered_model
    kind = cfg.model
    source = root / SOURCES[kind]
    for n in MODEL_FILES:
        if not (source / n).is_file():
            stage = "quantize" if kind == "quantized" else "merge"
            raise FileNotFoundError(f"{source / n}: missing; register.model = {kind!r} registers the {stage} stage's "
                                    f"model: run `crucible stage {stage}` (or `dvc repro {stage}`)")
    config = json.loads((source / "config.json").read_text())
    tasks = [t for t in (config.get("order") or config.get("classes") or {}) if t in (config.get("classes") or {})]
    if not tasks:
        raise ValueError(f"{source / 'config.json'}: no 'classes' per task; rebuild it")
    floors = floors_for(params, tasks)
    deployable = read_deployable(root, kind, tasks)
    evaluate = json.loads((root / EVALUATE).read_text())
    h = model_hash(root, kind)
    served = _size([source / "model.safetensors", source / "heads.safetensors"])
    float_size = _size([root / SOURCES["float"] / "model.safetensors", root / SOURCES["float"] / "heads.safetensors"])
    client = log.client
    from tasks.tracking import _WRITE_LOCK

    with _WRITE_LOCK:
        _ensure_registered_model(client, name)
    same = [v for v in _versions(client, name) if v.tags.get(HASH_TAG) == h]
    if same:
        mv = same[-1]
        new = False
        note = (f"model hash {h} is already registered as version {mv.version} of {name!r}: nothing new registered")
        pyfunc_bytes = int(mv.tags.get("crucible.size.pyfunc_bytes", 0))
    else:
        new = True
        commit = git_commit(root)
        base_dir = resolve_model(config.get("base_model") or params.embed.model)
        example = example_rows(root, tasks)
        extra = {"batch_size": cfg.batch_size, "variant": deployable["variant"], "model_hash": h}
        with tempfile.TemporaryDirectory() as tmp:
            dest = Path(tmp) / "model"
            model_id, uri = _log_pyfunc(client, log.run_id, dest, lambda path, mlflow_model: save_multitask_model(
                path, source, kind, base_dir, example, extra, mlflow_model=mlflow_model))
            pyfunc_bytes = _tree_size(dest)
        tags = {HASH_TAG: h, "crucible.model_kind": kind, "crucible.tasks": ",".join(tasks),
                "crucible.size.served_bytes": served, "crucible.size.float_bytes": float_size,
                "crucible.size.pyfunc_bytes": pyfunc_bytes, "crucible.stage_run_id": log.run_id,
                **_metric_tags(deployable, evaluate), **lineage.lineage_tags(root, commit)}
        with _WRITE_LOCK:  # the tags go in with the version: one transaction, not one per tag
            mv = client.create_model_version(name, source=uri, run_id=log.run_id, model_id=model_id,
                                             tags={k: str(v) for k, v in tags.items()},
                                             description=f"{kind} model ({deployable['variant']}), tasks "
                                                         f"{', '.join(tasks)}, mean test accuracy "
                                                         f"{deployable['mean_accuracy']:.4f}")
        note = f"registered version {mv.version} of {name!r} (model hash {h})"
    record = _apply_gate(client, name, mv, deployable["accuracy"], deployable["mean_accuracy"], floors, cfg.tolerance)
    aliases = sorted(client.get_model_version(name, mv.version).aliases)
    result = {"name": name, "version": mv.version, "new_version": new, "aliases": aliases, "model_hash": h,
              "model": kind, "variant": deployable["variant"], "model_uri": f"models:/{name}/{mv.version}",
              "run_id": mv.run_id, "note": note, "gate": record, "accuracy": deployable["accuracy"],
              "mean_accuracy": deployable["mean_accuracy"], "n_test": deployable["n_test"],
              "size_bytes": {"served": served, "float": float_size, "pyfunc": pyfunc_bytes},
              "size_mb": {"served": served / 2**20, "float": float_size / 2**20, "pyfunc": pyfunc_bytes / 2**20},
              "size_ratio_served_to_float": served / float_size if float_size else None}
    with AtomicOutputs() as atomic:
        atomic.json(result, root / OUT / "registered.json")
    print(f"register: {note}; gate: {record['decision']} ({record['reason']})", file=sys.stderr)
    log.set_tags({"crucible.register.version": mv.version, "crucible.register.new_version": str(new).lower(),
                  "crucible.register.decision": record["decision"], HASH_TAG: h})
    return {"version": int(mv.version), "new_version": int(new), "gate_passed": int(record["passed"]),
            "mean_accuracy": deployable["mean_accuracy"], **{f"accuracy.{t}": a for t, a in deployable["accuracy"].items()},
            "served_mb": served / 2**20, "float_mb": float_size / 2**20, "pyfunc_mb": pyfunc_bytes / 2**20}


if __name__ == "__main__":
    from tasks.cli import main

    main(["stage", "register", *sys.argv[1:]])
