"""The register stage's gate (docs/methods.md, value): whether a registered version becomes the
champion. It decides with the intervals of paired comparisons on every test row (crucible.stats),
never with two accuracies side by side and a margin, so that its decision does not flip on noise.

The version passes when all of these hold (each is a check in the record):
1. floors: every task's test accuracy is at least its floor, where `register.floors` or
   `register.floor` sets one;
2. vs the probe, per task: no task is significantly below the frozen-base probe (the upper end of
   the interval of acc(model) - acc(probe) is at least 0);
3. vs the probe, task mean: with `register.require_gain`, the mean over tasks is significantly above
   the probe's (the lower end of its interval is above 0): the model beats doing nothing;
4. vs the champion: the mean over the tasks both have of acc(model) - acc(champion), on the same
   rows, is not significantly below -`register.tolerance` (the upper end of its interval is at
   least -tolerance). A champion that cannot be compared on any shared task is said, not compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RULE = (
    "every task at or above its set floor; no task significantly below the frozen-base probe (upper end of the "
    "95% interval of the paired difference >= 0){gain}; the task mean not significantly below the champion's on "
    "the same rows (upper end >= -{tolerance:g})"
)


@dataclass
class GateDecision:
    passed: bool
    reason: str
    checks: list[dict] = field(default_factory=list)

    def failed(self) -> list[dict]:
        return [c for c in self.checks if not c["passed"]]


def _interval(c: dict) -> str:
    return f"{c['diff']:+.4f} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]"


def rule(require_gain: bool, tolerance: float) -> str:
    gain = "; the task mean significantly above the probe's (lower end > 0)" if require_gain else ""
    return RULE.format(gain=gain, tolerance=tolerance)


def gate(
    accuracy: dict[str, float],
    floors: dict[str, float],
    versus_probe: dict[str, dict],
    versus_champion: dict | None,
    *,
    tolerance: float,
    require_gain: bool,
) -> GateDecision:
    """The decision of the module docstring. accuracy: per task; floors: the set floors (tasks without
    one are absent); versus_probe: {task: comparison, "mean": comparison} of the model against the
    probe (crucible.stats.Comparison.to_dict()); versus_champion: None (no champion), or {version,
    comparison: {task..., "mean"} or None, note} against the champion on the shared tasks' rows."""
    checks = []
    for t, floor in floors.items():
        checks.append(
            {
                "check": f"floor {t}",
                "passed": accuracy[t] >= floor,
                "detail": f"task {t}: accuracy {accuracy[t]:.4f} vs its floor {floor:.4f}",
            }
        )
    for t, c in versus_probe.items():
        if t == "mean":
            continue
        checks.append(
            {
                "check": f"probe {t}",
                "passed": c["ci_high"] >= 0,
                "detail": f"task {t}: {c['a']:.4f} vs the probe's {c['b']:.4f}, {_interval(c)}",
            }
        )
    mean = versus_probe["mean"]
    if require_gain:
        checks.append(
            {
                "check": "probe mean",
                "passed": mean["ci_low"] > 0,
                "detail": f"task mean {mean['a']:.4f} vs the probe's {mean['b']:.4f}, {_interval(mean)}",
            }
        )
    if versus_champion is not None and versus_champion.get("comparison") is not None:
        c = versus_champion["comparison"]["mean"]
        checks.append(
            {
                "check": "champion",
                "passed": c["ci_high"] >= -tolerance,
                "detail": f"task mean {c['a']:.4f} vs champion version {versus_champion['version']}'s "
                f"{c['b']:.4f} on the same rows, {_interval(c)} (tolerance {tolerance:g})",
            }
        )
    failed = [c for c in checks if not c["passed"]]
    if failed:
        return GateDecision(False, "; ".join(c["detail"] for c in failed), checks)
    what = "first version" if versus_champion is None else f"champion version {versus_champion['version']} replaced"
    note = f" ({versus_champion['note']})" if versus_champion and versus_champion.get("note") else ""
    return GateDecision(
        True, f"{what}{note}: task mean {mean['a']:.4f} vs the probe's {mean['b']:.4f}, {_interval(mean)}", checks
    )


PREDICTIONS_ARTIFACT = "gate/predictions.parquet"  # a version's predictions on its test rows, in its run


def champion_comparison(client, champion, current, root, *, level: float, n_boot: int, seed: int) -> dict:
    """This version against the current champion on the same rows: {version, comparison (per task and
    "mean", crucible.stats) or None, note}. current: this version's rows (task, id, text_md5, text,
    label, pred). The champion's predictions come from its run's PREDICTIONS_ARTIFACT where they cover
    these rows (same task, id and text); otherwise the champion model is loaded and scores them."""
    from crucible.stats import compare_tasks

    theirs_tasks = [t for t in champion.tags.get("crucible.tasks", "").split(",") if t]
    shared = [t for t in dict.fromkeys(current["task"]) if not theirs_tasks or t in theirs_tasks]
    if not shared:
        return {
            "version": champion.version,
            "comparison": None,
            "note": f"champion version {champion.version} has no task of this model ({', '.join(theirs_tasks)}): "
            "not compared",
        }
    rows = current[current["task"].isin(shared)].reset_index(drop=True)
    theirs, how = _stored_predictions(client, champion, rows)
    if theirs is None:
        theirs, how = _rescored(root, champion, rows), "scored now by the champion model"
    pairs = {
        t: ((g["pred"] == g["label"]).to_numpy(), (theirs[g.index] == g["label"].to_numpy()))
        for t, g in rows.groupby("task", sort=False)
    }
    comparison = {t: c.to_dict() for t, c in compare_tasks(pairs, level=level, n_boot=n_boot, seed=seed).items()}
    note = f"on the {len(rows)} test rows of {', '.join(shared)}; the champion's predictions {how}"
    return {"version": champion.version, "comparison": comparison, "note": note}


def _stored_predictions(client, champion, rows):
    """(the champion's predictions aligned with `rows`, how) from its run, or (None, why not)."""
    import tempfile

    import numpy as np
    import pandas as pd
    from mlflow.exceptions import MlflowException

    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = client.download_artifacts(champion.run_id, PREDICTIONS_ARTIFACT, tmp)
            stored = pd.read_parquet(local)
    except (MlflowException, OSError, ValueError):
        return None, "not stored"
    key = ["task", "id", "text_md5"]
    if not set(key + ["pred"]) <= set(stored.columns):
        return None, "stored without row keys"
    merged = rows[key].merge(stored[key + ["pred"]].drop_duplicates(key), on=key, how="left")
    if merged["pred"].isna().any():
        return None, "stored for other rows"
    return np.asarray(merged["pred"].astype(str)), "as stored when it was registered"


def _rescored(root, champion, rows):
    """The champion model's labels for `rows` (text, task), scored in this process."""
    import numpy as np
    import pandas as pd

    from tasks.registry.serving import load_registered

    model, _ = load_registered(root, str(champion.version))
    out = model.predict(pd.DataFrame({"text": rows["text"], "task": rows["task"]}))
    return np.asarray(out["label"].astype(str))
