"""`crucible compare`: the figures a user compares between runs, one column per revision.

    crucible compare                  # the work tree, HEAD, and every DVC experiment made on HEAD
    crucible compare main lr-sweep-3  # the work tree and these git revisions or experiment names

Every figure comes from the metrics files that DVC tracks under metrics/ (committed to git, so a
past commit's or an experiment's figures are read from git itself): per task the deployable
model's test accuracy and curate's eps_hat and CC-MMD, the mean accuracy, the served size, bits per
weight and the gate's decision. `dvc metrics diff` and `dvc exp show` show the same files whole.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

WORKSPACE = "workspace"


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def experiments(root: Path, baseline: str = "HEAD") -> dict[str, str]:
    """DVC experiments made on `baseline` (their refs live under refs/exps/.../<baseline sha>/<name>):
    name -> ref."""
    sha = _git(root, "rev-parse", baseline).stdout.strip()
    refs = _git(root, "for-each-ref", "--format=%(refname)", "refs/exps").stdout.split()
    prefix = f"refs/exps/{sha[:2]}/{sha[2:]}/"
    return {ref[len(prefix) :]: ref for ref in refs if sha and ref.startswith(prefix)}


def resolve(root: Path, rev: str) -> str:
    """A git revision, or the name of a DVC experiment (any baseline): what `git show` reads."""
    if _git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode == 0:
        return rev
    refs = [
        r
        for r in _git(root, "for-each-ref", "--format=%(refname)", "refs/exps").stdout.split()
        if r.rsplit("/", 1)[1] == rev
    ]
    if not refs:
        raise ValueError(f"{rev!r} is neither a git revision nor a DVC experiment of {root}")
    return refs[-1]


def read_metrics(root: Path, rev: str, path: str) -> dict | None:
    """The JSON metrics file `path` in the work tree (rev 'workspace') or at a git revision."""
    if rev == WORKSPACE:
        try:
            return json.loads((root / path).read_text())
        except (OSError, ValueError):
            return None
    out = _git(root, "show", f"{rev}:{path}")
    try:
        return json.loads(out.stdout) if out.returncode == 0 else None
    except ValueError:
        return None


def figures(root: Path, rev: str) -> dict[str, object]:
    """The compared figures of one revision (missing files give no entries)."""
    evaluate = read_metrics(root, rev, "metrics/evaluate.json") or {}
    registered = read_metrics(root, rev, "metrics/registered.json") or {}
    quantize = read_metrics(root, rev, "metrics/quantize.json") or {}
    kind = registered.get("model", "quantized")
    deploy = (evaluate.get("deployable") or {}).get(kind) or {}
    out: dict[str, object] = {}
    for task in evaluate.get("order") or []:
        out[f"accuracy {task}"] = (deploy.get("accuracy") or {}).get(task)
    out[f"mean accuracy ({kind})"] = deploy.get("mean_accuracy")
    for task in evaluate.get("order") or []:
        curate = read_metrics(root, rev, f"metrics/{task}/curate.json") or {}
        out[f"eps_hat {task}"] = curate.get("eps_hat")
        out[f"CC-MMD {task}"] = curate.get("ccmmd_value")
    out["served MB"] = (registered.get("size_mb") or {}).get("served")
    out["bits per weight (all in)"] = quantize.get("bits_per_weight_all_in")
    out["gate"] = (registered.get("gate") or {}).get("decision")
    return {k: v for k, v in out.items() if v is not None}


def table(root: Path | str, revs: list[str] | None = None) -> str:
    root = Path(root).resolve()
    if revs:
        columns = {WORKSPACE: WORKSPACE, **{r: resolve(root, r) for r in revs}}
    else:
        has_head = _git(root, "rev-parse", "--verify", "--quiet", "HEAD").returncode == 0
        columns = {
            WORKSPACE: WORKSPACE,
            **({"HEAD": "HEAD"} if has_head else {}),
            **(experiments(root) if has_head else {}),
        }
    values = {name: figures(root, rev) for name, rev in columns.items()}
    rows = list(dict.fromkeys(k for v in values.values() for k in v))
    if not rows:
        return f"no metrics under {root / 'metrics'} in {', '.join(columns)}: run the pipeline first"

    def fmt(v) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    width = max(len(r) for r in rows)
    cols = {name: max(len(name), *(len(fmt(values[name].get(r, "-"))) for r in rows)) for name in columns}
    lines = [f"{'':<{width}}  " + "  ".join(f"{name:>{cols[name]}}" for name in columns)]
    for r in rows:
        lines.append(
            f"{r:<{width}}  " + "  ".join(f"{fmt(values[name].get(r, '-')):>{cols[name]}}" for name in columns)
        )
    return "\n".join(lines)
