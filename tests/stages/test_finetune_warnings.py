"""evaluate warns when a fine-tune learned next to nothing: at chance, or below the frozen base
encoder's fresh probe (the tiny profile's 6 steps; a too high learning rate)."""

import pandas as pd

from tasks.stages.evaluate import NEAR_CHANCE, finetune_warnings


def cells(rows):
    return pd.DataFrame(rows, columns=["variant", "task", "metric", "value"])


def test_a_fine_tune_at_chance_or_below_the_base_probe_is_warned_about():
    table = cells(
        [
            ("finetune:a", "a", "head", 0.75 + NEAR_CHANCE / 2),
            ("base", "a", "probe", 0.98),  # at chance
            ("finetune:b", "b", "head", 0.80),
            ("base", "b", "probe", 0.90),  # above chance, below the probe
            ("finetune:c", "c", "head", 0.95),
            ("base", "c", "probe", 0.90),  # fine
            ("finetune:b", "a", "head", 0.10),  # another task's fine-tune on this task: not judged
        ]
    )
    warnings = finetune_warnings(table, {"a": 0.75, "b": 0.5, "c": 0.5, "d": 0.5})
    assert len(warnings) == 2
    assert warnings[0].startswith("finetune@a: test accuracy 0.760 is at chance (0.750")
    assert warnings[1].startswith("finetune@b: test accuracy 0.800 is below the base model's fresh probe 0.900")
    assert finetune_warnings(table, {"c": 0.5}) == []
