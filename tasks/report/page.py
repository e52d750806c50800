"""The report: one self-contained HTML page over the evaluate stage's results (METHODS.md sec. 6).

    from tasks.report.page import build_report, screenshot
    files = build_report(results)      # {"index.html": b"...", "figures/curves.png": b"...", ...}
    screenshot("reports/index.html", "/tmp/report.png")

The page leads with the continual table, method x interface (ACC and BWT side by side), and one
sentence per interface generated from the numbers: the interfaces disagree (a merged model can look
as if it forgot through its task head and not through a probe fitted on its frozen features), and
that is the finding to show. Then the figures, every variant's score on every task, and the stages
upstream: curation (CC-MMD), pseudo-labels, fine-tunes, quantization, the MoE branch.

`results` (made by the evaluate stage; frames in long format):
- order: the tasks in arrival order; interfaces: e.g. ["head", "probe", "kmeans"] (head and probe
  score accuracy, a clustering algorithm the NMI of its clusters); main: the deployed merge method;
- cells [variant, family, method, arrival, task, metric, value]: every variant ("base",
  "finetune:<task>", "<method>@<arrival>", "quantize:<name>") on every task and metric ("head",
  "probe", "<alg>_nmi", "<alg>_ari");
- summary [method, family, interface, acc, bwt]: ACC and BWT per continual method and interface;
- curves [method, interface, arrival, acc]; matrices {method: {interface: R}}, R[j][i] the score on
  task i after arrival j (NaN above the diagonal);
- curation, pseudolabel, finetune: the upstream stages' tables (columns in FRAMES);
- quantize: the quantize stage's quantize.json; moe: a dict of the MoE branch's figures;
- figures {name: PNG bytes} made by earlier stages ("merge", "quantize", ...), inlined in their
  sections; meta: git_commit, params (its "evaluate" shown), n_test and n_probe per task.
Only order, interfaces and main are required: any other key absent, None or empty leaves its section
out.

The HTML is one file: inline CSS, every figure a base64 data: URI, no script, nothing fetched from
the network. Nothing depends on the clock: the same `results` give the same bytes (matplotlib's PNGs
carry no date, and their Software key is dropped so that they depend on the data alone).
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
from pathlib import Path

import pandas as pd

from tasks.report.format import (  # noqa: F401 (FRAMES, PNG_SIGNATURE re-exported for callers and tests)
    DASH, FIGURE_HOME, FORGETTING_TOL, FRAMES, PNG_SIGNATURE, Markup, _finite, _is_number, count, esc, flatten, fmt,
    interface_label, interface_phrase, signed,
)
from tasks.report.plots import (RC, _pyplot, method_colors, plot_ccmmd, plot_curves, plot_interfaces, plot_matrices,
                                plot_pseudolabel)


def _td(cell, tag: str = "td") -> str:
    cls = ""
    if isinstance(cell, tuple):
        cell, cls = cell
    if _is_number(cell) or cell is None:
        cls = f"num {cls}".strip()
    text = cell if isinstance(cell, Markup) else fmt(cell)
    return f'<{tag} class="{cls}">{text}</{tag}>' if cls else f"<{tag}>{text}</{tag}>"


def table(columns, rows, row_classes=None, head: str | None = None, tall: bool = False, kind: str = "") -> str:
    """An HTML table in a scroll box (its header sticks while the box scrolls). A cell is a value
    (formatted by `fmt`), a Markup, or (value, css class); `head` replaces the one-row header; kind
    "kv" (key/value, left-aligned) or "wide" (the full width)."""
    if head is None:
        head = "<tr>" + "".join(f'<th class="num">{esc(c)}</th>' if i else f"<th>{esc(c)}</th>"
                                for i, c in enumerate(columns)) + "</tr>"
    body = []
    for k, row in enumerate(rows):
        cls = (row_classes or [""] * len(rows))[k]
        body.append((f'<tr class="{cls}">' if cls else "<tr>") + "".join(_td(c) for c in row) + "</tr>")
    box = " ".join(["scroll", *(["tall"] if tall else []), *([kind] if kind else [])])
    return f'<div class="{box}"><table><thead>{head}</thead><tbody>{"".join(body)}</tbody></table></div>'


def bwt_cell(x):
    if not _finite(x):
        return x
    return (x, "neg" if x < -FORGETTING_TOL else "pos" if x > FORGETTING_TOL else "")


def img(png: bytes, alt: str, caption: str = "") -> str:
    uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return f'<figure><img alt="{esc(alt)}" src="{uri}">{cap}</figure>'


# ---------------------------------------------------------------------------------------------------
# the findings


def _verdict(bwt) -> str:
    if not _finite(bwt):
        return "undefined"
    return "forgetting" if bwt < -FORGETTING_TOL else "gain" if bwt > FORGETTING_TOL else "none"


VERDICT = {"forgetting": "forgetting shows", "none": f"no forgetting beyond \u00b1{FORGETTING_TOL}",
           "gain": "earlier tasks gained from later arrivals", "undefined": "BWT is undefined"}
VERDICT_SHORT = {"forgetting": "forgetting", "none": "no forgetting", "gain": "a gain"}


def findings(summary: pd.DataFrame, interfaces: list[str], main: str) -> list[str]:
    """One sentence per interface on the main method's ACC and BWT (and its rank by BWT among the
    continual methods: merges and latest_finetune), then one on whether the interfaces agree. Plain
    text, generated from the numbers."""
    look = {(m, i): (a, b) for m, i, a, b in summary[["method", "interface", "acc", "bwt"]].itertuples(index=False)}
    family = dict(zip(summary["method"], summary["family"]))
    continual = [m for m in dict.fromkeys(summary["method"]) if family[m] in ("merge", "finetune")]
    out, verdicts, bwts = [], {}, {}
    for i in interfaces:
        if (main, i) not in look:
            continue
        acc, bwt = look[(main, i)]
        verdicts[i] = _verdict(bwt)
        text = f"Through the {interface_phrase(i)}, {main} ends at ACC {fmt(acc)} with BWT {signed(bwt)}: {VERDICT[verdicts[i]]}"
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
        parts = "; ".join(f"{VERDICT_SHORT[k]} through {', '.join(i for i in verdicts if verdicts[i] == k)}" for k in kinds)
        out.append(f"The interfaces disagree on {main}: {parts}.")
    elif len(bwts) > 1:
        lo, hi = min(bwts, key=bwts.get), max(bwts, key=bwts.get)
        out.append(f"The interfaces agree on {main} ({VERDICT_SHORT[kinds[0]]} through every one); BWT runs from "
                   f"{signed(bwts[lo])} ({lo}) to {signed(bwts[hi])} ({hi}).")
    return out


# ---------------------------------------------------------------------------------------------------
# figures


def _frame(results: dict, key: str) -> pd.DataFrame | None:
    """results[key] checked for its columns; None when absent or empty (its section is omitted)."""
    df = results.get(key)
    if df is None:
        return None
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"results[{key!r}]: expected a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in FRAMES[key] if c not in df.columns]
    if missing:
        raise ValueError(f"results[{key!r}]: missing columns {missing}; expected {FRAMES[key]}")
    return None if df.empty else df.reset_index(drop=True)


def summary_table(summary: pd.DataFrame, interfaces: list[str], main: str) -> str:
    look = {(m, i): (a, b) for m, i, a, b in summary[["method", "interface", "acc", "bwt"]].itertuples(index=False)}
    family = dict(zip(summary["method"], summary["family"]))
    methods = list(dict.fromkeys(summary["method"]))
    best = {i: max((look[(m, i)][0] for m in methods if (m, i) in look and _finite(look[(m, i)][0])), default=None)
            for i in interfaces}
    head = ('<tr><th rowspan="2">method</th><th rowspan="2">family</th>'
            + "".join(f'<th colspan="2" class="group">{esc(interface_label(i))}</th>' for i in interfaces)
            + "</tr><tr>" + '<th class="num">ACC</th><th class="num">BWT</th>' * len(interfaces) + "</tr>")
    rows, classes = [], []
    for m in methods:
        row = [m, family[m]]
        for i in interfaces:
            acc, bwt = look.get((m, i), (None, None))
            row += [(acc, "best") if _finite(acc) and acc == best[i] else acc, bwt_cell(bwt)]
        rows.append(row)
        classes.append("main" if m == main else "main-q" if m.startswith(main + "+") else "")
    return table(None, rows, classes, head=head, kind="wide")


def summary_cards(results: dict, summary: pd.DataFrame | None) -> str:
    main, order = results["main"], results["order"]
    cards = [("deployed model", esc(main), f"{len(order)} tasks: " + " \u2192 ".join(order))]
    if summary is not None:
        look = {(m, i): (a, b) for m, i, a, b in summary[["method", "interface", "acc", "bwt"]].itertuples(index=False)}
        for i in results["interfaces"]:
            if (main, i) in look:
                acc, bwt = look[(main, i)]
                cls = {"forgetting": "neg", "gain": "pos"}.get(_verdict(bwt), "")
                cards.append((f"{interface_label(i)}", fmt(acc), Markup(f'BWT <span class="{cls}">{signed(bwt)}</span>')))
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{v}</div><div class="s">{esc(s)}</div></div>'
        for k, v, s in cards) + "</div>"


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
    return sorted(rows, key=lambda r: (rank.get(r[1], 4), first_method[r[2]] if r[1] == "merge" else 0,
                                       r[3] if r[1] in ("finetune", "merge") else 0))


def variant_tables(cells: pd.DataFrame, order: list[str], interfaces: list[str], main: str) -> str:
    """A table per task: a row per variant evaluated on it, a column per metric (every interface
    side by side); two tables a row when they fit."""
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
        out.append(f'<div><h3>{esc(t)}</h3>{table(["variant", "last arrived", *labels], rows, classes, tall=True)}</div>')
    width = 250 + 66 * len(metrics)  # px: a table's natural width, to decide one or two a row
    return (f'<div class="grid2" style="grid-template-columns:repeat(auto-fit,minmax({width}px,1fr))">'
            + "".join(out) + "</div>")


def quantize_section(q: dict, order: list[str]) -> str:
    parts = []
    acc, mean = q.get("accuracy") or {}, q.get("mean_accuracy") or {}
    if acc:
        tasks = [t for t in order if any(t in a for a in acc.values())]
        tasks += [t for t in dict.fromkeys(t for a in acc.values() for t in a) if t not in tasks]
        rows = [[v, *[a.get(t) for t in tasks], mean.get(v)] for v, a in acc.items()]
        parts.append("<h3>Test accuracy per variant</h3>" + table(["variant", *tasks, "mean"], rows))
    size = q.get("model_mb") or {}
    shares = q.get("recovered_share") or {}
    facts = [("float model (MB)", size.get("float")), ("quantized model (MB)", size.get("quantized"))]
    if _finite(size.get("float")) and _finite(size.get("quantized")) and size["quantized"] > 0:
        facts.append(("compression (float / quantized)", size["float"] / size["quantized"]))
    facts += [("bits per weight (MXFP4 matrices)", q.get("bits_per_weight")),
              ("bits per weight, adapters included", q.get("bits_per_weight_all_in")),
              ("accuracy lost by plain MXFP4", q.get("accuracy_lost_by_mxfp4"))]
    facts += [(f"share of the loss recovered: {k}", v) for k, v in shares.items()]
    parts.append("<h3>Size and recovery</h3>" + table(["quantity", "value"], facts, kind="kv"))
    return '<div class="grid2">' + "".join(f"<div>{p}</div>" for p in parts) + "</div>"


def footer(meta: dict, order: list[str]) -> str:
    parts = [f'<p>git commit <code>{esc(meta.get("git_commit", DASH))}</code></p>']
    evaluate = (meta.get("params") or {}).get("evaluate")
    if evaluate:
        parts.append("<h3>evaluate params</h3>" + table(["param", "value"], flatten(evaluate), kind="kv"))
    n_test, n_probe = meta.get("n_test") or {}, meta.get("n_probe") or {}
    if n_test or n_probe:
        tasks = [t for t in order if t in n_test or t in n_probe]
        tasks += [t for t in dict.fromkeys([*n_test, *n_probe]) if t not in tasks]
        parts.append("<h3>examples per task</h3>" + table(["task", "n_test", "n_probe"],
                                                         [[t, n_test.get(t), n_probe.get(t)] for t in tasks]))
    return '<div class="grid3">' + "".join(f"<div>{p}</div>" for p in parts) + "</div>"


# ---------------------------------------------------------------------------------------------------
# the page


def build_report(results: dict) -> dict[str, bytes]:
    """The report's files, relative to reports/: "index.html" (self-contained) and
    "figures/<name>.png" (interfaces, curves, matrices, ccmmd, pseudolabel; each only when its input
    is there). `results` as in the module docstring. Raises ValueError or TypeError naming the key
    for a missing required key, a frame without its columns, or a figure that is not PNG bytes."""
    for key in ("order", "interfaces", "main"):
        if key not in results:
            raise ValueError(f"results[{key!r}] is missing; the evaluate stage sets order, interfaces and main")
    order, interfaces, main = list(results["order"]), list(results["interfaces"]), str(results["main"])
    frames = {k: _frame(results, k) for k in FRAMES}
    summary, curves = frames["summary"], frames["curves"]
    matrices = results.get("matrices") or {}
    stage_figures = results.get("figures") or {}
    for name, data in stage_figures.items():
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"results['figures'][{name!r}]: expected PNG bytes, got {type(data).__name__}")
        if not bytes(data).startswith(PNG_SIGNATURE):
            raise ValueError(f"results['figures'][{name!r}]: not PNG bytes (starts with {bytes(data[:8])!r})")
    if summary is not None and main not in set(summary["method"]):
        raise ValueError(f"results['main']={main!r} is not a method of results['summary'] "
                         f"({sorted(set(summary['method']))})")

    plt = _pyplot()
    methods = list(dict.fromkeys([*(summary["method"] if summary is not None else []),
                                  *(curves["method"] if curves is not None else []), *matrices]))
    colors = method_colors(methods)
    figures: dict[str, bytes] = {}
    with plt.rc_context(RC):
        if summary is not None:
            figures["interfaces"] = plot_interfaces(summary, interfaces, main, colors)
        if curves is not None:
            figures["curves"] = plot_curves(curves, interfaces, order, main, colors)
        chosen = [m for m in (main, "latest_finetune") if m in matrices]
        merges = [m for m in methods if summary is not None and m in set(summary.loc[summary["family"] == "merge", "method"])]
        chosen += [m for m in dict.fromkeys([*merges, *matrices]) if m in matrices and m not in chosen
                   and m != "base" and "+" not in m][:2]
        if chosen:
            figures["matrices"] = plot_matrices(matrices, chosen, interfaces, order)
        if frames["curation"] is not None:
            figures["ccmmd"] = plot_ccmmd(frames["curation"])
        if frames["pseudolabel"] is not None:
            figures["pseudolabel"] = plot_pseudolabel(frames["pseudolabel"])

    sections: list[tuple[str, str, str]] = []  # (id, title, body)
    placed = set()

    def stage_figure(home: str) -> str:
        out = ""
        for name, data in stage_figures.items():
            if FIGURE_HOME.get(name) == home:
                out += img(bytes(data), f"{name} stage figure", f"from the {name} stage")
                placed.add(name)
        return out

    if summary is not None:
        notes = "".join(f"<li>{esc(s)}</li>" for s in findings(summary, interfaces, main))
        sections.append(("headline", "Headline: continual metrics per interface",
                         f'<ul class="findings">{notes}</ul>' + summary_table(summary, interfaces, main)
                         + '<p class="note">ACC: mean over tasks after the last arrival. BWT: mean over earlier tasks '
                           "of (final \u2212 just after its arrival); negative is forgetting. head and probe are "
                           f"accuracies, clustering interfaces NMI. Highlighted: {esc(main)}, the deployed method; "
                           "bold: the best ACC per interface.</p>"))
        sections.append(("interfaces", "ACC and BWT by interface", img(figures["interfaces"], "ACC and BWT by interface",
                         f"bars per method; {main} outlined; gray band: |BWT| \u2264 {FORGETTING_TOL}")))
    if curves is not None:
        sections.append(("curves", "Accuracy over arrivals",
                         img(figures["curves"], "accuracy curves", f"mean over the arrived tasks; {main} bold")
                         + stage_figure("curves")))
    if "matrices" in figures:
        sections.append(("matrices", "Accuracy matrices", img(figures["matrices"], "accuracy matrices",
                         "R[j][i]: score on task i (column) after arrival j (row); one colour scale for every panel")))
    if frames["cells"] is not None:
        sections.append(("variants", "Every variant on every task",
                         '<p class="note"><code>method@j</code>: the merge after arrival j (0-based), the last task '
                         "to arrive shown beside it. A task's table holds the variants evaluated on it.</p>"
                         + variant_tables(frames["cells"], order, interfaces, main)))
    cur = frames["curation"]
    if cur is not None:
        cur = cur.assign(n_keep=cur["n_keep"].map(count), n_pool=cur["n_pool"].map(count))
        sections.append(("curation", "Curation (CC-MMD)", table(FRAMES["curation"], cur[FRAMES["curation"]].values.tolist())
                         + img(figures["ccmmd"], "CC-MMD per task") + stage_figure("curation")))
    pl = frames["pseudolabel"]
    if pl is not None:
        pl = pl.assign(n_selected=pl["n_selected"].map(count))
        sections.append(("pseudolabel", "Pseudo-labels", table(FRAMES["pseudolabel"], pl[FRAMES["pseudolabel"]].values.tolist())
                         + img(figures["pseudolabel"], "pseudo-label accuracy") + stage_figure("pseudolabel")))
    ft = frames["finetune"]
    if ft is not None:
        ft = ft.assign(steps=ft["steps"].map(count))
        sections.append(("finetune", "Fine-tunes", table(FRAMES["finetune"], ft[FRAMES["finetune"]].values.tolist())
                         + stage_figure("finetune")))
    if results.get("quantize"):
        sections.append(("quantize", "Quantization (MXFP4)", quantize_section(results["quantize"], order)
                         + stage_figure("quantize")))
    if (results.get("moe") or {}).get("enabled"):
        from tasks.report.moe_plots import SUMMARY_COLUMNS, summary_note, summary_rows

        moe = results["moe"]
        sections.append(("moe", "Mixture of experts (MXFP4, routing replay)",
                         table(SUMMARY_COLUMNS, summary_rows(moe)) + f'<p class="note">{esc(summary_note(moe))}</p>'
                         + stage_figure("moe")))
    rest = "".join(img(bytes(d), f"{n} stage figure", f"from the {n} stage") for n, d in stage_figures.items()
                   if n not in placed)
    if rest:
        sections.append(("stage-figures", "Other stage figures", rest))

    meta = results.get("meta") or {}
    toc = "".join(f'<li><a href="#{sid}">{esc(title)}</a></li>' for sid, title, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{esc(title)}</h2>{inner}</section>' for sid, title, inner in sections)
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>crucible report: {esc(main)}</title><style>{CSS}</style></head><body><main>"
            f'<header><h1>crucible report</h1><p class="sub">continual merging of {len(order)} task encoders, '
            f"evaluated through {len(interfaces)} interfaces: {esc(', '.join(interfaces))}</p>"
            f"{summary_cards(results, summary)}</header>"
            f'<nav class="toc"><h2>Contents</h2><ol>{toc}<li><a href="#provenance">Provenance</a></li></ol></nav>'
            f'{body}<footer id="provenance"><h2>Provenance</h2>{footer(meta, order)}</footer>'
            "</main></body></html>\n")
    return {"index.html": page.encode("utf-8"), **{f"figures/{n}.png": b for n, b in figures.items()}}


CSS = """
:root{--fg:#1f2937;--muted:#6b7280;--bg:#f4f5f7;--card:#fff;--line:#e5e7eb;--head:#f3f4f6;--accent:#2563eb;
--hl:#e8f0fe;--hl2:#f4f8ff;--neg:#b91c1c;--pos:#047857}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1280px;margin:0 auto;padding:28px 28px 48px}
h1{font-size:28px;margin:0 0 2px;letter-spacing:-.01em}h2{font-size:20px;margin:0 0 12px}
h3{font-size:15px;margin:14px 0 6px;color:#374151}
.sub,.note,figcaption{color:var(--muted)}.note{font-size:13px;margin:8px 0 0}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(190px,1fr));gap:12px;margin:18px 0}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:12px 16px}
.card .k{font-size:12px;text-transform:uppercase;letter-spacing:.05em;color:var(--muted)}
.card .v{font-size:24px;font-weight:650;font-variant-numeric:tabular-nums}
.card .s{font-size:13px;color:var(--muted)}
nav.toc,section,footer{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:18px 24px;margin:18px 0}
nav.toc h2{font-size:15px;margin:0 0 6px}nav.toc ol{columns:3;margin:0;padding-left:22px}
a{color:var(--accent);text-decoration:none}a:hover{text-decoration:underline}
ul.findings{margin:0 0 14px;padding-left:20px}ul.findings li{margin:3px 0}
.scroll{display:inline-block;vertical-align:top;overflow:auto;border:1px solid var(--line);border-radius:8px;
max-width:100%;margin:6px 0}.scroll.wide{display:block}.scroll.wide table{width:100%}
.kv td,.kv th,.kv td.num,.kv th.num{text-align:left}
.scroll.tall{max-height:34rem}
table{border-collapse:separate;border-spacing:0;font-size:13px;font-variant-numeric:tabular-nums}
th,td{padding:5px 10px;border-bottom:1px solid var(--line);text-align:left;white-space:nowrap}
.grid2 th,.grid2 td{padding:5px 8px}.grid2 th{white-space:normal;vertical-align:bottom}
thead th{position:sticky;top:0;background:var(--head);z-index:1;font-weight:600}
thead tr+tr th{top:31px}th.group{text-align:center;border-left:1px solid var(--line)}
td.num,th.num{text-align:right}tbody tr:nth-child(even) td{background:#fafbfc}
tbody tr:hover td{background:#f1f5f9}
tr.main td{background:var(--hl)!important;font-weight:600}tr.main-q td{background:var(--hl2)!important}
tr.group-start td{border-top:2px solid #d1d5db}
td.neg,.neg{color:var(--neg)}td.pos,.pos{color:var(--pos)}td.best{font-weight:700;text-decoration:underline}
figure{margin:16px 0 4px}figure img{max-width:100%;height:auto;border:1px solid var(--line);border-radius:8px}
figcaption{font-size:13px;margin-top:4px}
.grid2{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:8px 20px}
.grid3{display:grid;grid-template-columns:repeat(auto-fit,minmax(300px,1fr));gap:8px 20px}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px;background:var(--head);
padding:1px 5px;border-radius:4px}
footer{font-size:13px}
@media print{.scroll.tall{max-height:none;overflow:visible}thead th{position:static}}
"""


def find_chromium() -> str | None:
    """The headless browser's path (Debian's package `chromium`), or None."""
    return shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def screenshot(html_path, png_path, width: int = 1400, height: int = 2400, timeout: float = 120) -> bool:
    """Render `html_path` with headless Chromium into `png_path` (width x height pixels). False when
    Chromium is not installed, or it failed or timed out without writing the PNG."""
    chromium = find_chromium()
    if chromium is None:
        return False
    png_path = Path(png_path).resolve()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    png_path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:  # own profile: no lock on a shared one
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               f"--user-data-dir={profile}", f"--screenshot={png_path}", f"--window-size={width},{height}",
               Path(html_path).resolve().as_uri()]
        try:
            subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return False
    return png_path.exists() and png_path.stat().st_size > 0
