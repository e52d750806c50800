"""The report: one self-contained HTML page over the evaluate stage's results (docs/methods.md, evaluate).

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
carry no date, and tasks.runtime.io.figure_png drops their Software key so that they depend on the
data alone; the templates are rendered in a fixed order from the same data).

The markup is in Jinja2 templates (tasks/report/templates/: page.html.j2, the sections'
sections.html.j2, the tables' and figures' blocks.html.j2, style.css.j2), rendered with autoescape:
every string from `results` (task and method names, findings, the git commit) is escaped; numbers
come formatted and escaped by tasks.report.format.fmt. What each section shows is computed in
tasks.report.sections, as plain data.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import pandas as pd

from tasks.report.format import (  # noqa: F401 (FRAMES, PNG_SIGNATURE, fmt re-exported for callers and tests)
    FIGURE_HOME,
    FORGETTING_TOL,
    FRAMES,
    PNG_SIGNATURE,
    count,
    fmt,
)
from tasks.report.plots import (
    RC,
    _pyplot,
    method_colors,
    plot_ccmmd,
    plot_curves,
    plot_interfaces,
    plot_matrices,
    plot_pseudolabel,
)
from tasks.report.sections import (  # noqa: F401 (findings re-exported for callers and tests)
    data_uri,
    findings,
    provenance,
    quantize_tables,
    summary_cards,
    summary_table,
    table,
    value_section,
    variant_tables,
)

TEMPLATES = Path(__file__).resolve().parent / "templates"
TITLES = {
    "value": "Value: the deployed model against the frozen-base probe and the fine-tunes",
    "headline": "Continual merging: metrics per interface",
    "interfaces": "ACC and BWT by interface",
    "curves": "Accuracy over arrivals",
    "matrices": "Accuracy matrices",
    "variants": "Every variant on every task",
    "curation": "Curation (CC-MMD)",
    "pseudolabel": "Pseudo-labels",
    "finetune": "Fine-tunes",
    "quantize": "Quantization (MXFP4)",
    "moe": "Mixture of experts (MXFP4, routing replay)",
    "stage-figures": "Other stage figures",
}


@lru_cache(maxsize=1)
def environment():
    """The templates' Jinja2 environment: autoescape on, an undefined name is an error."""
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES), encoding="utf-8"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


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


def _figures(
    summary, curves, matrices: dict, frames: dict, order: list[str], interfaces: list[str], main: str
) -> dict[str, bytes]:
    """The report's own figures (PNG bytes), each only when its input is there."""
    plt = _pyplot()
    methods = list(
        dict.fromkeys(
            [
                *(summary["method"] if summary is not None else []),
                *(curves["method"] if curves is not None else []),
                *matrices,
            ]
        )
    )
    colors = method_colors(methods)
    figures: dict[str, bytes] = {}
    with plt.rc_context(RC):
        if summary is not None:
            figures["interfaces"] = plot_interfaces(summary, interfaces, main, colors)
        if curves is not None:
            figures["curves"] = plot_curves(curves, interfaces, order, main, colors)
        chosen = [m for m in (main, "latest_finetune") if m in matrices]
        merges = [
            m for m in methods if summary is not None and m in set(summary.loc[summary["family"] == "merge", "method"])
        ]
        chosen += [
            m
            for m in dict.fromkeys([*merges, *matrices])
            if m in matrices and m not in chosen and m != "base" and "+" not in m
        ][:2]
        if chosen:
            figures["matrices"] = plot_matrices(matrices, chosen, interfaces, order)
        if frames["curation"] is not None:
            figures["ccmmd"] = plot_ccmmd(frames["curation"])
        if frames["pseudolabel"] is not None:
            figures["pseudolabel"] = plot_pseudolabel(frames["pseudolabel"])
    return figures


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
        raise ValueError(
            f"results['main']={main!r} is not a method of results['summary'] ({sorted(set(summary['method']))})"
        )
    figures = _figures(summary, curves, matrices, frames, order, interfaces, main)

    placed = set()

    def stage_figures_of(home: str) -> list[dict]:
        out = []
        for name, data in stage_figures.items():
            if FIGURE_HOME.get(name) == home:
                out.append({"name": name, "uri": data_uri(bytes(data))})
                placed.add(name)
        return out

    sections: list[dict] = []  # each: id, title, the macro of sections.html.j2 that renders it, its data

    def add(sid: str, **data) -> None:
        sections.append({"id": sid, "title": TITLES[sid], "macro": sid.replace("-", "_"), **data})

    if results.get("value"):
        add("value", **value_section(results["value"], order, results.get("register_model", "quantized")))
    if summary is not None:
        add(
            "headline",
            findings=findings(summary, interfaces, main),
            summary=summary_table(summary, interfaces, main),
            main=main,
        )
        add("interfaces", uri=data_uri(figures["interfaces"]), main=main, tol=FORGETTING_TOL)
    if curves is not None:
        add("curves", uri=data_uri(figures["curves"]), main=main, stage_figures=stage_figures_of("curves"))
    if "matrices" in figures:
        add("matrices", uri=data_uri(figures["matrices"]))
    if frames["cells"] is not None:
        add("variants", **variant_tables(frames["cells"], order, interfaces, main))
    cur = frames["curation"]
    if cur is not None:
        cur = cur.assign(n_keep=cur["n_keep"].map(count), n_pool=cur["n_pool"].map(count))
        add(
            "curation",
            table=table(FRAMES["curation"], cur[FRAMES["curation"]].values.tolist()),
            uri=data_uri(figures["ccmmd"]),
            stage_figures=stage_figures_of("curation"),
        )
    pl = frames["pseudolabel"]
    if pl is not None:
        pl = pl.assign(n_selected=pl["n_selected"].map(count))
        add(
            "pseudolabel",
            table=table(FRAMES["pseudolabel"], pl[FRAMES["pseudolabel"]].values.tolist()),
            uri=data_uri(figures["pseudolabel"]),
            stage_figures=stage_figures_of("pseudolabel"),
        )
    ft = frames["finetune"]
    if ft is not None:
        ft = ft.assign(steps=ft["steps"].map(count))
        add(
            "finetune",
            table=table(FRAMES["finetune"], ft[FRAMES["finetune"]].values.tolist()),
            stage_figures=stage_figures_of("finetune"),
        )
    if results.get("quantize"):
        add("quantize", tables=quantize_tables(results["quantize"], order), stage_figures=stage_figures_of("quantize"))
    if (results.get("moe") or {}).get("enabled"):
        from tasks.report.moe_plots import SUMMARY_COLUMNS, summary_note, summary_rows

        moe = results["moe"]
        add(
            "moe",
            table=table(SUMMARY_COLUMNS, summary_rows(moe)),
            note=summary_note(moe),
            stage_figures=stage_figures_of("moe"),
        )
    rest = [{"name": n, "uri": data_uri(bytes(d))} for n, d in stage_figures.items() if n not in placed]
    if rest:
        add("stage-figures", stage_figures=rest)

    page = (
        environment()
        .get_template("page.html.j2")
        .render(
            main=main,
            order=order,
            interfaces=interfaces,
            cards=summary_cards(results, summary),
            page_sections=sections,
            provenance=provenance(results.get("meta") or {}, order),
        )
    )
    return {"index.html": page.encode("utf-8"), **{f"figures/{n}.png": b for n, b in figures.items()}}


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
        cmd = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={profile}",
            f"--screenshot={png_path}",
            f"--window-size={width},{height}",
            Path(html_path).resolve().as_uri(),
        ]
        try:
            subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return False
    return png_path.exists() and png_path.stat().st_size > 0
