"""The pipeline's scheduled deployments, served from this machine (`crucible deploy`, `make serve`).

    crucible deploy                   # a Prefect server on 127.0.0.1:4200 + this process serving
    prefect deployment run crucible-scheduled/on-demand      # (PREFECT_API_URL=http://127.0.0.1:4200/api)

prefect.yaml is the one description of the deployments (name, entrypoint, parameters, cron
schedule, concurrency limit); this module reads it and serves them with `prefect.serve`, which
polls the server for due runs and runs each in a subprocess. `serve` rather than a process work
pool: on one machine it is one process with nothing to create first (no pool, no worker), and
Ctrl-C stops it. The same prefect.yaml with `prefect deploy --all` and `prefect worker start` is
the route to workers on other hosts (docs/operations.md, "Beyond one machine").

Overlapping runs: each deployment carries `concurrency_limit: {limit: 1, collision_strategy:
ENQUEUE}`, and `serve(limit=1)` runs one flow at a time. ENQUEUE, not CANCEL_NEW: a nightly run
that comes due while another run works is queued and runs after it (cheaply: DVC skips what the
first run brought up to date) instead of being dropped. The workspace lock (tasks/runtime/lock.py) covers
what Prefect cannot see: a `dvc repro` or a user's `crucible run` on the same workspace.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import yaml

SPEC = "prefect.yaml"
STRATEGIES = ("ENQUEUE", "CANCEL_NEW")


def load_spec(root: Path | str) -> list[dict]:
    """The deployments of `root`/prefect.yaml, validated (every error names the file and field)."""
    path = Path(root) / SPEC
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no prefect.yaml, so no deployments to serve")
    spec = yaml.safe_load(path.read_text()) or {}
    deps = spec.get("deployments")
    if not isinstance(deps, list) or not deps:
        raise ValueError(f"{path}: 'deployments' must be a non-empty list, got {deps!r}")
    for i, dep in enumerate(deps):
        where = f"{path}: deployments[{i}]"
        for key in ("name", "entrypoint"):
            if not isinstance(dep.get(key), str) or not dep[key]:
                raise ValueError(f"{where}.{key} must be a non-empty string, got {dep.get(key)!r}")
        if ":" not in dep["entrypoint"]:
            raise ValueError(f"{where}.entrypoint must be FILE.py:FLOW, got {dep['entrypoint']!r}")
        for j, sched in enumerate(dep.get("schedules") or []):
            cron = sched.get("cron") if isinstance(sched, dict) else None
            if not isinstance(cron, str) or len(cron.split()) != 5:
                raise ValueError(f"{where}.schedules[{j}].cron must be a 5-field cron string, got {cron!r}")
        limit = dep.get("concurrency_limit")
        if limit is not None:
            if isinstance(limit, int):
                limit = {"limit": limit}
            if not isinstance(limit, dict) or not isinstance(limit.get("limit"), int) or limit["limit"] < 1:
                raise ValueError(
                    f"{where}.concurrency_limit must be {{limit: N >= 1, collision_strategy: "
                    f"{'|'.join(STRATEGIES)}}}, got {dep['concurrency_limit']!r}"
                )
            strategy = limit.get("collision_strategy", "ENQUEUE")
            if strategy not in STRATEGIES:
                raise ValueError(
                    f"{where}.concurrency_limit.collision_strategy must be one of "
                    f"{', '.join(STRATEGIES)}, got {strategy!r}"
                )
    return deps


def _flow(entrypoint: str):
    file, name = entrypoint.split(":")
    module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
    return getattr(module, name)


def flow_name(dep: dict) -> str:
    """The Prefect flow name of a deployment entry (what `prefect deployment run FLOW/NAME` wants)."""
    return _flow(dep["entrypoint"]).name


def build_deployments(root: Path | str) -> list:
    """RunnerDeployments for `prefect.serve`, from prefect.yaml; `root` parameters are made
    absolute (runs execute in subprocesses that must find this workspace)."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.schedules import Cron

    root = Path(root).resolve()
    out = []
    for dep in load_spec(root):
        params = dict(dep.get("parameters") or {})
        params["root"] = str((root / params.get("root", ".")).resolve())
        limit = dep.get("concurrency_limit")
        if isinstance(limit, int):
            limit = {"limit": limit}
        out.append(
            _flow(dep["entrypoint"]).to_deployment(
                name=dep["name"],
                description=dep.get("description"),
                parameters=params,
                schedules=[Cron(s["cron"], timezone=s.get("timezone", "UTC")) for s in dep.get("schedules") or []],
                concurrency_limit=None
                if limit is None
                else ConcurrencyLimitConfig(
                    limit=limit["limit"],
                    collision_strategy=ConcurrencyLimitStrategy(limit.get("collision_strategy", "ENQUEUE")),
                ),
                tags=["crucible"],
            )
        )
    return out


def serve(root: Path | str) -> None:
    """Serve the deployments until interrupted (one flow run at a time)."""
    from prefect import serve as prefect_serve

    prefect_serve(*build_deployments(root), limit=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="serve prefect.yaml's deployments of the pipeline")
    parser.add_argument("--root", default=".")
    serve(parser.parse_args().root)
