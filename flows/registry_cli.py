"""The `crucible` commands that read the model registry: `predict` (the registered model, in this
process) and `lineage` (what made a registered version, checked against dvc.lock and the disk)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def message(exc: Exception) -> str:
    """An error's message without KeyError's quotes or MLflow's wrapping."""
    message = getattr(exc, "message", None)
    if isinstance(message, str):
        return message
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def existing_store(root: Path) -> None:
    """The commands that only read the registry (predict, serve, lineage) open an existing store:
    MLflow would create an empty mlflow.db where there is none (in the project root, after a
    profile's run that tracked in build/<profile>), and then report no registered model. Raises
    TrackingStoreError naming the missing store and the workspaces that have one."""
    import os

    from tasks.runtime.tracking import DB_NAME, TrackingStoreError

    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / DB_NAME}"
    if not uri.startswith("sqlite:///"):
        return  # a server, checked by tracking_uri
    db = Path(uri[len("sqlite:///") :])
    if db.is_file() and db.stat().st_size:
        return
    if uri == f"sqlite:///{root / DB_NAME}":
        found = sorted(str(p.parent.relative_to(root)) for p in root.glob(f"build/*/{DB_NAME}"))
        hint = (
            f"; a profile's run tracks in its own workspace: pass --root {found[0]}"
            + (f" (workspaces with a store: {', '.join(found)})" if len(found) > 1 else "")
            if found
            else "; a profile's run tracks in its own workspace: pass --root build/<profile>"
        )
    else:
        hint = " (MLFLOW_TRACKING_URI); fix MLFLOW_TRACKING_URI or unset it"
    raise TrackingStoreError(f"{db}: no MLflow tracking store there, so no registered model to read{hint}")


def check_device() -> None:
    """The device a loaded model will run on (CRUCIBLE_DEVICE / CRUCIBLE_PRECISION, else auto),
    before anything is loaded: one that is not there raises ValueError naming the variable."""
    from crucible.device import from_environment

    from_environment()


def registered(root: Path, ref: str):
    """(name, client, model version) of params' registered model at version or alias `ref`, from
    the workspace's existing tracking store."""
    from tasks.registry.registry import resolve_version
    from tasks.registry.serving import registry_client
    from tasks.runtime.params import load_params

    name = load_params(root / "params.yaml").tracking.registered_model
    existing_store(root)
    client = registry_client(root)
    return name, client, resolve_version(client, name, ref)


def cmd_predict(args) -> int:
    import pandas as pd
    from mlflow.exceptions import MlflowException

    from tasks.registry.serving import load_registered
    from tasks.runtime.params import ParamsError
    from tasks.runtime.tracking import TrackingStoreError

    root = Path(args.root).resolve()
    try:
        check_device()  # CRUCIBLE_DEVICE=cuda on a machine without one: say so before loading anything
        name, _, mv = registered(root, args.alias)
        known = [t for t in (mv.tags.get("crucible.tasks") or "").split(",") if t]
        if known and args.task not in known:
            raise KeyError(f"unknown task {args.task!r}; valid tasks: {', '.join(known)}")
        model, _ = load_registered(root, mv.version, name)
        out = model.predict(pd.DataFrame({"text": args.texts, "task": [args.task] * len(args.texts)}))
    except (ParamsError, KeyError, ValueError, MlflowException, TrackingStoreError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    cols = [c for c in out.columns if c.startswith("proba_") and out[c].notna().all()]
    if args.json:
        print(
            json.dumps(
                [
                    {"text": t, **{k: v for k, v in r.items() if k in ["task", "label", *cols]}}
                    for t, r in zip(args.texts, out.to_dict("records"))
                ],
                indent=2,
            )
        )
        return 0
    print(f"{name} version {mv.version} (@{args.alias}), task {args.task}")
    for text, (_, row) in zip(args.texts, out.iterrows()):
        probs = "  ".join(f"{c[len('proba_') :]} {row[c]:.3f}" for c in cols)
        print(f"{row['label']:<12} {probs}   {text[:70]}{'...' if len(text) > 70 else ''}")
    return 0


def cmd_lineage(args) -> int:
    from tasks.registry import lineage
    from tasks.registry.serving import version_summary
    from tasks.runtime.params import ParamsError
    from tasks.runtime.tracking import git_commit

    root = Path(args.root).resolve()
    try:
        name, _, mv = registered(root, args.ref)
        result = lineage.compare(root, mv.tags, git_commit(root))
    except (ParamsError, KeyError, ValueError, RuntimeError) as exc:  # RuntimeError: TrackingStoreError
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    print(lineage.report(result, version_summary(name, mv)))
    return 0 if result["matches"] else 1
