"""Formatting shared by the report's page and figures: numbers, signs, labels, escaping.

`fmt` and `esc` return markupsafe.Markup (escaped text), so the page's Jinja2 templates
(autoescape on) insert them as they are and escape every other string."""

from __future__ import annotations

import math
import numbers

import numpy as np
from markupsafe import Markup, escape

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DASH = "\u2013"
# |BWT| under this reads as "no forgetting": about one standard error of an accuracy near 0.8 on a
# 200-example test set, the size of the demo's test splits.
FORGETTING_TOL = 0.02
FRAMES = {
    "cells": ["variant", "family", "method", "arrival", "task", "metric", "value"],
    "summary": ["method", "family", "interface", "acc", "bwt"],
    "curves": ["method", "interface", "arrival", "acc"],
    "curation": [
        "task",
        "eps_true",
        "eps_hat",
        "ccmmd",
        "ccmmd_ci_low",
        "ccmmd_ci_high",
        "naive",
        "audit_only",
        "oracle",
        "keep_precision",
        "keep_recall",
        "n_keep",
        "n_pool",
    ],
    "pseudolabel": [
        "task",
        "accuracy",
        "accuracy_ci_low",
        "accuracy_ci_high",
        "accuracy_true",
        "naive_accuracy",
        "n_selected",
    ],
    "finetune": ["task", "test_accuracy", "dev_accuracy", "steps", "n_train"],
}
FIGURE_HOME = {
    "merge": "curves",
    "quantize": "quantize",
    "curate": "curation",
    "pseudolabel": "pseudolabel",
    "finetune": "finetune",
    "moe": "moe",
    "moe_curve": "moe",
}  # where a stage's own figure is inlined


# ---------------------------------------------------------------------------------------------------
# formatting


def esc(value) -> Markup:
    """`value` as escaped HTML text (a Markup is already escaped: returned as it is)."""
    return escape(value)


def fmt(x) -> Markup:
    """A value as text: reals to 3 decimals (non-zero ones under 5e-4 in scientific notation, so that
    a small MMD^2 does not read 0.000), NaN and None as an en dash, integers as integers; escaped."""
    if x is None:
        return Markup(DASH)
    if isinstance(x, (bool, np.bool_)):
        return Markup(str(bool(x)))
    if isinstance(x, numbers.Integral):
        return Markup(str(int(x)))
    if isinstance(x, numbers.Real):
        x = float(x)
        if math.isnan(x):
            return Markup(DASH)
        if math.isinf(x):
            return Markup("\u221e" if x > 0 else "-\u221e")
        return Markup(f"{x:.2e}" if x != 0 and abs(x) < 5e-4 else f"{x:.3f}")
    if isinstance(x, (list, tuple)):
        return Markup(", ").join(fmt(v) for v in x)
    return esc(x)


def signed(x) -> str:
    return DASH if not _finite(x) else f"{float(x):+.3f}"


def count(x):
    """An integer column that pandas may have turned into floats (a NaN in it)."""
    return int(x) if _finite(x) else None


def _finite(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _is_number(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, (bool, np.bool_))


def interface_label(interface: str) -> str:
    return f"{interface} (acc)" if interface in ("head", "probe") else f"{interface} (NMI)"


def interface_phrase(interface: str) -> str:
    return {"head": "task head (accuracy)", "probe": "linear probe (accuracy)"}.get(
        interface, f"{interface} clustering (NMI)"
    )


def flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Nested dicts as (dotted key, value) pairs, in insertion order."""
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        out += flatten(v, key + ".") if isinstance(v, dict) and v else [(key, v)]
    return out
