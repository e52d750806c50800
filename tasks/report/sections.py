"""What the report's sections show, as plain data for the templates (tasks/report/templates/): the
findings (sentences generated from the numbers), the tables (a table is a dict of header rows and
rows of formatted cells), the summary cards, the quantization and provenance blocks. No markup
here: the templates write every tag, and escape every string that is not already Markup (`fmt`)."""

from __future__ import annotations

import base64

import pandas as pd

from tasks.report.format import (
    DASH,
    FORGETTING_TOL,
    Markup,
    _finite,
    _is_number,
    flatten,
    fmt,
    interface_label,
    interface_phrase,
    signed,
)

# ---------------------------------------------------------------------------------------------------
# tables and figures as data


def cell(value, cls: str = "") -> dict:
    """A table cell: a value (formatted by `fmt`; a number or None gets the class "num"), a Markup
    (as it is), or (value, css class)."""
    if isinstance(value, tuple):
        value, cls = value
    if _is_number(value) or value is None:
        cls = f"num {cls}".strip()
    return {"text": value if isinstance(value, Markup) else fmt(value), "cls": cls}


def table(
    columns, rows, row_classes=None, head: list[list[dict]] | None = None, tall: bool = False, kind: str = ""
) -> dict:
    """A table in a scroll box (its header sticks while the box scrolls): {box, head, rows}. A cell
    as in `cell`; `head` (rows of {text, cls, rowspan, colspan}) replaces the one-row header of
    `columns` (the first left-aligned, the rest numeric); kind "kv" (key/value, left-aligned) or
    "wide" (the full width)."""
    if head is None:
        head = [[{"text": c, "cls": "num" if i else ""} for i, c in enumerate(columns)]]
    classes = row_classes or [""] * len(rows)
    return {
        "box": " ".join(["scroll", *(["tall"] if tall else []), *([kind] if kind else [])]),
        "head": head,
        "rows": [{"cls": classes[k], "cells": [cell(c) for c in row]} for k, row in enumerate(rows)],
    }


def bwt_cell(x):
    if not _finite(x):
        return x
    return (x, "neg" if x < -FORGETTING_TOL else "pos" if x > FORGETTING_TOL else "")


def data_uri(png: bytes) -> str:
    """A figure inlined as a data: URI (the page fetches nothing)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# ---------------------------------------------------------------------------------------------------
# the findings


def verdict(bwt) -> str:
    if not _finite(bwt):
        return "undefined"
    return "forgetting" if bwt < -FORGETTING_TOL else "gain" if bwt > FORGETTING_TOL else "none"


VERDICT = {
    "forgetting": "forgetting shows",
    "none": f"no forgetting beyond \u00b1{FORGETTING_TOL}",
    "gain": "earlier tasks gained from later arrivals",
    "undefined": "BWT is undefined",
}
VERDICT_SHORT = {"forgetting": "forgetting", "none": "no forgetting", "gain": "a gain"}


def _look(summary: pd.DataFrame) -> dict:
    return {(m, i): (a, b) for m, i, a, b in summary[["method", "interface", "acc", "bwt"]].itertuples(index=False)}


def findings(summary: pd.DataFrame, interfaces: list[str], main: str) -> list[str]:
    """One sentence per interface on the main method's ACC and BWT (and its rank by BWT among the
    continual methods: merges and latest_finetune), then one on whether the interfaces agree. Plain
    text, generated from the numbers."""
    look = _look(summary)
    family = dict(zip(summary["method"], summary["family"]))
    continual = [m for m in dict.fromkeys(summary["method"]) if family[m] in ("merge", "finetune")]
    out, verdicts, bwts = [], {}, {}
    for i in interfaces:
        if (main, i) not in look:
            continue
        acc, bwt = look[(main, i)]
        verdicts[i] = verdict(bwt)
        text = (
            f"Through the {interface_phrase(i)}, {main} ends at ACC {fmt(acc)} with BWT {signed(bwt)}: "
            f"{VERDICT[verdicts[i]]}"
        )
        if _finite(bwt):
            bwts[i] = float(bwt)
            others = [look[(m, i)][1] for m in continual if m != main and (m, i) in look and _finite(look[(m, i)][1])]
            if others:
                rank, n = 1 + sum(b > bwt for b in others), len(others) + 1
                where = {1: "the least", n: "the most"}.get(rank, f"rank {rank} (1 = least)")
                where = f"tied for {where}" if any(b == bwt for b in others) else where
                text += f" ({where} forgetting of {n} continual methods"
                if ("latest_finetune", i) in look and main != "latest_finetune":
                    text += f"; latest_finetune {signed(look[('latest_finetune', i)][1])}"
                text += ")"
        out.append(text + ".")
    kinds = [k for k in ("forgetting", "none", "gain") if k in verdicts.values()]
    if len(kinds) > 1:
        parts = "; ".join(
            f"{VERDICT_SHORT[k]} through {', '.join(i for i in verdicts if verdicts[i] == k)}" for k in kinds
        )
        out.append(f"The interfaces disagree on {main}: {parts}.")
    elif len(bwts) > 1:
        lo, hi = min(bwts, key=bwts.get), max(bwts, key=bwts.get)
        out.append(
            f"The interfaces agree on {main} ({VERDICT_SHORT[kinds[0]]} through every one); BWT runs from "
            f"{signed(bwts[lo])} ({lo}) to {signed(bwts[hi])} ({hi})."
        )
    return out


# ---------------------------------------------------------------------------------------------------
# the sections' tables


def summary_table(summary: pd.DataFrame, interfaces: list[str], main: str) -> dict:
    """Method x interface, ACC and BWT side by side; the main method's row and the best ACC marked."""
    look = _look(summary)
    family = dict(zip(summary["method"], summary["family"]))
    methods = list(dict.fromkeys(summary["method"]))
    best = {
        i: max((look[(m, i)][0] for m in methods if (m, i) in look and _finite(look[(m, i)][0])), default=None)
        for i in interfaces
    }
    head = [
        [
            {"text": "method", "rowspan": 2},
            {"text": "family", "rowspan": 2},
            *[{"text": interface_label(i), "colspan": 2, "cls": "group"} for i in interfaces],
        ],
        [{"text": t, "cls": "num"} for _ in interfaces for t in ("ACC", "BWT")],
    ]
    rows, classes = [], []
    for m in methods:
        row = [m, family[m]]
        for i in interfaces:
            acc, bwt = look.get((m, i), (None, None))
            row += [(acc, "best") if _finite(acc) and acc == best[i] else acc, bwt_cell(bwt)]
        rows.append(row)
        classes.append("main" if m == main else "main-q" if m.startswith(main + "+") else "")
    return table(None, rows, classes, head=head, kind="wide")


def summary_cards(results: dict, summary: pd.DataFrame | None) -> list[dict]:
    """The header's cards: the deployed model, then the main method's ACC and BWT per interface."""
    main, order = results["main"], results["order"]
    cards = [{"key": "deployed model", "value": main, "sub": f"{len(order)} tasks: " + " \u2192 ".join(order)}]
    if summary is not None:
        look = _look(summary)
        for i in results["interfaces"]:
            if (main, i) in look:
                acc, bwt = look[(main, i)]
                cards.append(
                    {
                        "key": interface_label(i),
                        "value": fmt(acc),
                        "bwt": signed(bwt),
                        "bwt_cls": {"forgetting": "neg", "gain": "pos"}.get(verdict(bwt), ""),
                    }
                )
    return cards


def metric_order(metrics, interfaces: list[str]) -> list[str]:
    wanted = []
    for i in interfaces:
        wanted += [i] if i in ("head", "probe") else [f"{i}_nmi", f"{i}_ari"]
    present = list(dict.fromkeys(metrics))
    return [m for m in wanted if m in present] + [m for m in present if m not in wanted]


def variant_order(cells: pd.DataFrame) -> list[tuple]:
    """(variant, family, method, arrival) in report order: base, fine-tunes by arrival, each merge
    method (in order of appearance) after each arrival, quantized, anything else."""
    info = cells.drop_duplicates("variant")[["variant", "family", "method", "arrival"]]
    rank = {"base": 0, "finetune": 1, "merge": 2, "quantize": 3}
    first_method = {m: k for k, m in enumerate(dict.fromkeys(cells["method"]))}
    rows = list(info.itertuples(index=False, name=None))
    return sorted(
        rows,
        key=lambda r: (
            rank.get(r[1], 4),
            first_method[r[2]] if r[1] == "merge" else 0,
            r[3] if r[1] in ("finetune", "merge") else 0,
        ),
    )


def variant_tables(cells: pd.DataFrame, order: list[str], interfaces: list[str], main: str) -> dict:
    """A table per task: a row per variant evaluated on it, a column per metric (every interface
    side by side); {width: a table's natural width in px, to fit one or two a row, tables: [{task,
    table}]}."""
    value = {(v, t, m): x for v, t, m, x in cells[["variant", "task", "metric", "value"]].itertuples(index=False)}
    metrics = metric_order(cells["metric"], interfaces)
    variants = variant_order(cells)
    tasks = [t for t in order if t in set(cells["task"])] + [t for t in dict.fromkeys(cells["task"]) if t not in order]
    labels = [m.replace("_nmi", " NMI").replace("_ari", " ARI") for m in metrics]
    out = []
    for t in tasks:
        rows, classes, last_family = [], [], None
        for v, fam, meth, arr in variants:
            last = order[arr] if fam == "merge" and 0 <= arr < len(order) else ""
            scores = [value.get((v, t, m)) for m in metrics]
            if all(x is None for x in scores):  # a merge from before the task arrived
                continue
            rows.append([v, last, *scores])
            cls = ["main"] if fam == "merge" and meth == main else []
            if fam != last_family and last_family is not None:
                cls.append("group-start")
            last_family = fam
            classes.append(" ".join(cls))
        out.append({"task": t, "table": table(["variant", "last arrived", *labels], rows, classes, tall=True)})
    return {"width": 250 + 66 * len(metrics), "tables": out}


def quantize_tables(q: dict, order: list[str]) -> dict:
    """{accuracy: the test accuracy per variant and task, or None; size: sizes, bits per weight and
    the share of the MXFP4 loss recovered}."""
    accuracy = None
    acc, mean = q.get("accuracy") or {}, q.get("mean_accuracy") or {}
    if acc:
        tasks = [t for t in order if any(t in a for a in acc.values())]
        tasks += [t for t in dict.fromkeys(t for a in acc.values() for t in a) if t not in tasks]
        accuracy = table(
            ["variant", *tasks, "mean"], [[v, *[a.get(t) for t in tasks], mean.get(v)] for v, a in acc.items()]
        )
    size = q.get("model_mb") or {}
    shares = q.get("recovered_share") or {}
    facts = [("float model (MB)", size.get("float")), ("quantized model (MB)", size.get("quantized"))]
    if _finite(size.get("float")) and _finite(size.get("quantized")) and size["quantized"] > 0:
        facts.append(("compression (float / quantized)", size["float"] / size["quantized"]))
    facts += [
        ("bits per weight (MXFP4 matrices)", q.get("bits_per_weight")),
        ("bits per weight, adapters included", q.get("bits_per_weight_all_in")),
        ("accuracy lost by plain MXFP4", q.get("accuracy_lost_by_mxfp4")),
    ]
    facts += [(f"share of the loss recovered: {k}", v) for k, v in shares.items()]
    return {"accuracy": accuracy, "size": table(["quantity", "value"], facts, kind="kv")}


def provenance(meta: dict, order: list[str]) -> dict:
    """The footer: {commit, params: the evaluate params table or None, examples: n_test and n_probe
    per task, or None}."""
    out = {"commit": meta.get("git_commit", DASH), "params": None, "examples": None}
    evaluate = (meta.get("params") or {}).get("evaluate")
    if evaluate:
        out["params"] = table(["param", "value"], flatten(evaluate), kind="kv")
    n_test, n_probe = meta.get("n_test") or {}, meta.get("n_probe") or {}
    if n_test or n_probe:
        tasks = [t for t in order if t in n_test or t in n_probe]
        tasks += [t for t in dict.fromkeys([*n_test, *n_probe]) if t not in tasks]
        out["examples"] = table(["task", "n_test", "n_probe"], [[t, n_test.get(t), n_probe.get(t)] for t in tasks])
    return out


# ---------------------------------------------------------------------------------------------------
# the value of the run: the deployable models against the baselines, with intervals

VALUE_MODELS = (
    ("probe", "frozen-base probe"),
    ("finetune", "own fine-tune"),
    ("merged", "merged, fine-tune's head"),
    ("float", "merged, deployed head"),
    ("quantized", "MXFP4, deployed head"),
)


def interval(c: dict) -> str:
    return f"{c['diff']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]"


def value_section(value: dict, order: list[str], deployed: str) -> dict:
    """The headline of the run: one sentence on the deployed model against the frozen-base probe and
    the fine-tunes, the accuracy of each model per task, and every paired comparison per task and
    over the task mean (difference and its interval)."""
    acc, cmp = value["accuracy"], value["comparisons"]
    vs_probe, norm = cmp[f"{deployed}_vs_probe"]["mean"], value["normalised"][deployed]
    level = round(100 * value["level"])
    ratio = (
        f"{norm['value']:.3f} [{norm['ci_low']:.3f}, {norm['ci_high']:.3f}] of the fine-tunes' accuracy"
        if norm
        else "no ratio to the fine-tunes (one is right on no test row)"
    )
    sentence = (
        f"The deployed model ({deployed}) scores {vs_probe['a']:.3f} on the task mean against the frozen-base probe's "
        f"{vs_probe['b']:.3f}: {interval(vs_probe)} ({level}% interval, paired bootstrap over {vs_probe['n']} "
        f"test rows), and {ratio}."
    )
    accuracy = table(
        ["model", *order, "mean"],
        [[label, *(acc[m][t] for t in order), acc[m]["mean"]] for m, label in VALUE_MODELS],
        row_classes=["main" if m == deployed else "" for m, _ in VALUE_MODELS],
    )
    rows = []
    for name, by in cmp.items():
        a, b = name.split("_vs_")
        rows.append([f"{a} − {b}", *(Markup(interval(by[t])) for t in order), Markup(interval(by["mean"]))])
    comparisons = table(["paired difference", *order, "task mean"], rows, kind="wide")
    return {
        "sentence": sentence,
        "accuracy": accuracy,
        "comparisons": comparisons,
        "n": {t: value["n_test"][t] for t in order},
        "level": level,
    }
