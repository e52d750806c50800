"""The model registry as crucible uses it: versions by number or alias, the gated `champion` alias,
logging the pyfunc as an MLflow 3 logged model through an explicit client (stages run in threads),
and the content hash a registered version carries. Written by the register stage; read by
`crucible serve`, `predict` and `lineage`."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.runtime.tracking import _WRITE_LOCK

CHAMPION, CHALLENGER = "champion", "challenger"
HASH_TAG = "crucible.model_hash"
PYFUNC_CODE = Path(__file__).resolve().parent / "pyfunc.py"


def gate(
    accuracy: dict[str, float],
    mean: float,
    floors: dict[str, float],
    tolerance: float,
    champion: dict | None,
    basis: dict[str, str] | None = None,
) -> tuple[bool, str]:
    """(passes, reason). `champion`: None (no champion yet) or {version, mean_accuracy (None if
    unknown), optionally tasks}. Passes when no task is below its floor and, if there is a champion,
    mean >= champion's mean - tolerance. `basis`: per task, where its floor comes from (said in the
    reason of a task below it)."""
    basis = basis or {}
    below = [
        f"task {t}: accuracy {accuracy[t]:.4f} below its floor {floors[t]:.4f}"
        + (f" ({basis[t]})" if basis.get(t) else "")
        for t in floors
        if accuracy[t] < floors[t]
    ]
    if below:
        return False, "; ".join(below)
    if champion is None:
        return True, f"first version: mean test accuracy {mean:.4f}, every task at or above its floor"
    champ = champion.get("mean_accuracy")
    if champ is None:
        return False, (
            f"champion version {champion['version']} has no recorded mean test accuracy "
            f"(tag crucible.metric.mean_accuracy); it is not replaced automatically"
        )
    bar = champ - tolerance
    other = champion.get("tasks")
    note = (
        f" (the champion's mean is over tasks {', '.join(other)})"
        if other and sorted(other) != sorted(accuracy)
        else ""
    )
    if mean + 1e-12 >= bar:
        return True, (
            f"mean test accuracy {mean:.4f} >= champion version {champion['version']}'s {champ:.4f} "
            f"- tolerance {tolerance:.4f}; every task at or above its floor{note}"
        )
    return False, (
        f"mean test accuracy {mean:.4f} < champion version {champion['version']}'s {champ:.4f} "
        f"- tolerance {tolerance:.4f} = {bar:.4f}{note}"
    )


def is_missing(exc) -> bool:
    return getattr(exc, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE")


def version_by_alias(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if is_missing(exc):
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
        if not is_missing(exc):
            raise
        mv = None
    if mv is None:
        found = versions(client, name)
        aliases: dict[str, list[str]] = {}
        if found:
            for alias, version in (client.get_registered_model(name).aliases or {}).items():
                aliases.setdefault(str(version), []).append(alias)
        known = ", ".join(
            f"{v.version}" + (f" ({', '.join(sorted(aliases[str(v.version)]))})" if str(v.version) in aliases else "")
            for v in found
        )
        raise KeyError(
            f"registered model {name!r} has no version or alias {ref!r}"
            + (f"; versions: {known}" if known else "; it has no versions (run the register stage)")
        )
    return mv


def versions(client, name: str) -> list:
    from mlflow.exceptions import MlflowException

    try:
        escaped = name.replace("'", "\\'")
        return sorted(client.search_model_versions(f"name = '{escaped}'"), key=lambda v: int(v.version))
    except MlflowException as exc:
        if is_missing(exc):
            return []
        raise


def ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as exc:
        if not is_missing(exc):
            raise
        client.create_registered_model(
            name,
            description=(
                "crucible's deployable multi-task text classifier: columns text and task in; task, label and "
                "proba_<class> out. Alias 'champion': the version that passed the gate; 'challenger': the latest "
                "that did not."
            ),
        )


def champion_info(client, name: str) -> dict | None:
    mv = version_by_alias(client, name, CHAMPION)
    if mv is None:
        return None
    mean = mv.tags.get("crucible.metric.mean_accuracy")
    return {
        "version": mv.version,
        "mean_accuracy": float(mean) if mean is not None else None,
        "tasks": [t for t in mv.tags.get("crucible.tasks", "").split(",") if t],
    }


def log_pyfunc(client, run_id: str, dest: Path, save) -> tuple[str, str]:
    """Log a pyfunc as an MLflow 3 logged model of run `run_id` through the explicit client (no
    fluent active run or global tracking URI: stages run in threads). `save(path, mlflow_model)`
    writes the model folder. Returns (model_id, the source to register: its artifact location)."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    experiment_id = client.get_run(run_id).info.experiment_id
    with _WRITE_LOCK:
        logged = client.create_logged_model(
            experiment_id=experiment_id, name="model", source_run_id=run_id, model_type="crucible-multitask-classifier"
        )
    try:
        mlflow_model = Model(
            artifact_path=logged.artifact_location, run_id=run_id, model_id=logged.model_id, model_uuid=logged.model_id
        )
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


def set_version_tags(client, name: str, version: str, tags: dict) -> None:
    with _WRITE_LOCK:
        for k, v in tags.items():
            client.set_model_version_tag(name, version, k, str(v))


def apply_gate(
    client,
    name: str,
    mv,
    accuracy: dict,
    mean: float,
    floors: dict,
    tolerance: float,
    basis: dict | None = None,
    hold: str | None = None,
) -> dict:
    """Gate version `mv`, move the aliases, tag the decision; returns the gate record. `basis`: per
    task, where its floor comes from (gate). `hold`: why this version may not be promoted (an
    experiment, register.promote: false): it is gated and recorded, but only as the challenger."""
    before = version_by_alias(client, name, CHAMPION)
    if before is not None and before.version == mv.version:  # a rerun of the champion: nothing moves
        return {
            "decision": CHAMPION,
            "passed": True,
            "reason": f"already the champion ({mv.tags.get('crucible.gate.reason', 'no recorded reason')})",
            "champion_before": mv.version,
            "champion_after": mv.version,
            "champion_mean_accuracy": mean,
            "tolerance": tolerance,
            "floors": floors,
            "floor_basis": basis or {},
        }
    champion = champion_info(client, name)
    passed, reason = gate(accuracy, mean, floors, tolerance, champion, basis)
    if hold is not None:
        reason = f"not promoted: {hold}; the gate {'would pass' if passed else 'fails'}: {reason}"
        passed = False
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
        set_version_tags(client, name, before.version, {"crucible.gate.superseded_by": mv.version})
    set_version_tags(
        client,
        name,
        mv.version,
        {
            "crucible.gate.decision": decision,
            "crucible.gate.reason": reason,
            "crucible.gate.tolerance": tolerance,
            "crucible.gate.floors": json.dumps(floors, sort_keys=True),
            "crucible.gate.floor_basis": json.dumps(basis or {}, sort_keys=True),
        },
    )
    after = version_by_alias(client, name, CHAMPION)
    return {
        "decision": decision,
        "passed": passed,
        "reason": reason,
        "champion_before": before.version if before is not None else None,
        "champion_after": after.version if after is not None else None,
        "champion_mean_accuracy": (champion or {}).get("mean_accuracy"),
        "tolerance": tolerance,
        "floors": floors,
        "floor_basis": basis or {},
    }
