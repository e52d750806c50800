"""evaluate warns when a fine-tune learned next to nothing: at chance, or significantly below the
frozen base encoder's probe on the test rows (its paired interval below zero). A fine-tune a row or
two below the probe, inside the noise, is not warned about (the merge8 profile's sms: 0.960 against
0.980 on 50 rows was)."""

import numpy as np

from crucible.stats import compare_tasks
from tasks.stages.evaluate import NEAR_CHANCE, finetune_warnings


def rows(n: int, right: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[:right] = True
    return out


def worth(outcomes: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict:
    """What tasks.report.value.value gives evaluate: accuracies and fine-tune vs probe, paired."""
    cmp = compare_tasks(outcomes, n_boot=2000, seed=0)
    return {
        "accuracy": {"finetune": {t: float(ft.mean()) for t, (ft, _) in outcomes.items()}},
        "comparisons": {"finetune_vs_probe": {t: c.to_dict() for t, c in cmp.items()}},
    }


def test_a_fine_tune_at_chance_or_significantly_below_the_probe_is_warned_about():
    w = worth(
        {
            "a": (rows(400, 304 + 4), rows(400, 392)),  # 0.770: at chance (0.75 + NEAR_CHANCE / 2)
            "b": (rows(400, 300), rows(400, 360)),  # 0.750 vs 0.900 on 400 rows: clearly below
            "c": (rows(50, 48), rows(50, 49)),  # 0.960 vs 0.980 on 50 rows: one row, inside the noise
            "d": (rows(400, 380), rows(400, 360)),  # above the probe
        }
    )
    assert 0.75 < w["accuracy"]["finetune"]["a"] <= 0.75 + NEAR_CHANCE
    warnings = finetune_warnings(w, {"a": 0.75, "b": 0.5, "c": 0.5, "d": 0.5, "e": 0.5})
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("finetune@a: test accuracy 0.770 is at chance (0.750")
    assert warnings[1].startswith("finetune@b: test accuracy 0.750 is below the base model's probe 0.900 (-15.0 [")
    assert "400 test rows" in warnings[1]
    assert finetune_warnings(w, {"c": 0.5, "d": 0.5}) == []
