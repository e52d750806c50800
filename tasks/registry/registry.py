"""The model registry as crucible uses it: versions by number or alias, the gated `champion` alias,
logging the pyfunc as an MLflow 3 logged model through an explicit client (stages run in threads),
and the content hash a registered version carries. Written by the register stage; read by
`crucible serve`, `predict` and `lineage`."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.runtime.tracking import WRITE_LOCK

CHAMPION, CHALLENGER = "champion", "challenger"
HASH_TAG = "crucible.model_hash"
PYFUNC_CODE = Path(__file__).resolve().parent / "pyfunc.py"


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


def log_pyfunc(client, run_id: str, dest: Path, save) -> tuple[str, str]:
    """Log a pyfunc as an MLflow 3 logged model of run `run_id` through the explicit client (no
    fluent active run or global tracking URI: stages run in threads). `save(path, mlflow_model)`
    writes the model folder. Returns (model_id, the source to register: its artifact location)."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    experiment_id = client.get_run(run_id).info.experiment_id
    with WRITE_LOCK:
        logged = client.create_logged_model(
            experiment_id=experiment_id, name="model", source_run_id=run_id, model_type="crucible-multitask-classifier"
        )
    try:
        mlflow_model = Model(
            artifact_path=logged.artifact_location, run_id=run_id, model_id=logged.model_id, model_uuid=logged.model_id
        )
        save(dest, mlflow_model)
        with WRITE_LOCK:
            client.log_model_artifacts(logged.model_id, str(dest))
            client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    except BaseException:
        with WRITE_LOCK:
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    # the artifact location, not models:/<model_id>: the SQL registry store would resolve that through
    # the global tracking URI instead of this client's
    return logged.model_id, logged.artifact_location


def set_version_tags(client, name: str, version: str, tags: dict) -> None:
    with WRITE_LOCK:
        for k, v in tags.items():
            client.set_model_version_tag(name, version, k, str(v))


TAG_LIMIT = 5000  # characters of a model version tag value (MLflow's SQL column)


def compact_json(record: dict) -> str:
    """The record as JSON for a tag; past TAG_LIMIT, its per-task entries are dropped (they stay in
    metrics/registered.json) and the means kept."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    if len(text) <= TAG_LIMIT:
        return text
    means = {k: ({"mean": v["mean"]} if isinstance(v, dict) and "mean" in v else v) for k, v in record.items()}
    return json.dumps({**means, "truncated": "per-task intervals: metrics/registered.json"}, sort_keys=True)[:TAG_LIMIT]


def apply_gate(client, name: str, mv, decide, hold: str | None = None) -> dict:
    """Gate version `mv`, move the aliases, tag the decision; returns the gate record.

    decide(champion) -> (GateDecision, record): called with the current champion's version (None when
    there is none) unless `mv` is the champion already; `record` (JSON-able: the rule, the intervals)
    goes into the returned record and, as JSON, into the version's tag crucible.gate.record.
    `hold`: why this version may not be promoted (an experiment, register.promote: false): it is
    gated and recorded, but only as the challenger."""
    before = version_by_alias(client, name, CHAMPION)
    if before is not None and before.version == mv.version:  # a rerun of the champion: nothing moves
        return {
            "decision": CHAMPION,
            "passed": True,
            "reason": f"already the champion ({mv.tags.get('crucible.gate.reason', 'no recorded reason')})",
            "champion_before": mv.version,
            "champion_after": mv.version,
        }
    decision, record = decide(before)
    passed, reason = decision.passed, decision.reason
    if hold is not None:
        reason = f"not promoted: {hold}; the gate {'would pass' if passed else 'fails'}: {reason}"
        passed = False
    with WRITE_LOCK:
        if passed:
            client.set_registered_model_alias(name, CHAMPION, mv.version)
            challenger = version_by_alias(client, name, CHALLENGER)
            if challenger is not None and challenger.version == mv.version:
                client.delete_registered_model_alias(name, CHALLENGER)
        else:
            client.set_registered_model_alias(name, CHALLENGER, mv.version)
    label = CHAMPION if passed else CHALLENGER
    if passed and before is not None:
        set_version_tags(client, name, before.version, {"crucible.gate.superseded_by": mv.version})
    set_version_tags(
        client,
        name,
        mv.version,
        {
            "crucible.gate.decision": label,
            "crucible.gate.reason": reason,
            "crucible.gate.rule": record.get("rule", ""),
            "crucible.gate.record": compact_json(record),
        },
    )
    after = version_by_alias(client, name, CHAMPION)
    return {
        "decision": label,
        "passed": passed,
        "reason": reason,
        "champion_before": before.version if before is not None else None,
        "champion_after": after.version if after is not None else None,
        "checks": decision.checks,
        **record,
    }
