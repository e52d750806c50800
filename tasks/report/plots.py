"""The evaluate report's figures (matplotlib, Agg): ACC and BWT by interface, the accuracy curves,
the accuracy matrices, CC-MMD and the pseudo-label estimates. Each returns PNG bytes that depend on
the data alone (tasks.runtime.io.figure_png: no date, no Software key)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from tasks.report.format import FORGETTING_TOL, _finite, interface_label
from tasks.runtime.io import figure_png


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


RC = {
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "font.size": 9,
}


def method_colors(methods: list[str]) -> dict:
    plt = _pyplot()
    palette = [c for k, c in enumerate(plt.cm.tab10.colors) if k != 7]  # tab10's gray is base's
    if len(methods) > len(palette):
        palette = list(plt.cm.tab20.colors)
    colors, k = {}, 0
    for m in methods:
        if m in ("base", "latest_finetune"):
            colors[m] = {"base": "#9ca3af", "latest_finetune": "#111827"}[m]
        else:
            colors[m], k = palette[k % len(palette)], k + 1
    return colors


def _legend_below(fig, ax, n: int) -> None:
    handles, labels = ax.get_legend_handles_labels()
    ncol = -(-n // -(-n // 7))  # at most 7 a row, the rows balanced
    fig.legend(handles, labels, loc="lower center", ncol=ncol, bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.05 * -(-n // ncol) + 0.02, 1, 1))


def plot_interfaces(summary: pd.DataFrame, interfaces: list[str], main: str, colors: dict) -> bytes:
    """Two panels, ACC and BWT: a group of bars per interface, a bar per method (main outlined)."""
    plt = _pyplot()
    methods = list(dict.fromkeys(summary["method"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    x, width = np.arange(len(interfaces)), 0.84 / len(methods)
    for ax, col, title in zip(
        axes, ("acc", "bwt"), ("ACC: mean over tasks after the last arrival", "BWT: final minus just after arrival")
    ):
        look = dict(zip(zip(summary["method"], summary["interface"]), summary[col]))
        for k, m in enumerate(methods):
            vals = [float(v) if _finite(v := look.get((m, i))) else np.nan for i in interfaces]
            ax.bar(
                x + (k - (len(methods) - 1) / 2) * width,
                vals,
                width,
                color=colors[m],
                label=m,
                edgecolor="black" if m == main else "none",
                linewidth=1.6 if m == main else 0,
                zorder=3,
            )
        ax.set_xticks(x, [interface_label(i) for i in interfaces])
        ax.set_title(title)
        ax.set_ylabel(col.upper() + " (accuracy or NMI)")
        if col == "bwt":
            ax.axhline(0, color="black", lw=0.8, zorder=4)
            ax.axhspan(-FORGETTING_TOL, FORGETTING_TOL, color="#9ca3af", alpha=0.2, lw=0, zorder=1)
    _legend_below(fig, axes[0], len(methods))
    return figure_png(fig)


def plot_curves(curves: pd.DataFrame, interfaces: list[str], order: list[str], main: str, colors: dict) -> bytes:
    """A panel per interface: the mean over the arrived tasks after each arrival, a line per method;
    one y scale for all panels, so that a flat probe curve beside a falling head curve reads as such."""
    plt = _pyplot()
    methods = list(dict.fromkeys(curves["method"]))
    cols = min(len(interfaces), 2)
    rows = -(-len(interfaces) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.6 * rows + 0.6), squeeze=False, sharey=True)
    for ax, i in zip(axes.flat, interfaces):
        sub = curves[curves["interface"] == i]
        for m in methods:
            g = sub[sub["method"] == m].sort_values("arrival")
            if len(g):
                bold = m == main
                ax.plot(
                    g["arrival"] + 1,
                    g["acc"],
                    marker="o",
                    ms=6 if bold else 4,
                    lw=3 if bold else 1.4,
                    color=colors.get(m, "black"),
                    label=m,
                    zorder=5 if bold else 3,
                    ls="--" if m == "latest_finetune" else "-",
                )
        ax.set_title(interface_label(i))
        ax.set_xticks(range(1, len(order) + 1), [f"{j + 1}\n{t}" for j, t in enumerate(order)])
        ax.set_xlim(0.7, len(order) + 0.3)
        ax.set_xlabel("after arrival")
        ax.set_ylabel("mean over arrived tasks")
        ax.yaxis.set_tick_params(labelleft=True)
    spare = list(axes.flat)[len(interfaces) :]
    for extra in spare:
        extra.axis("off")
    if spare:
        spare[0].legend(*axes.flat[0].get_legend_handles_labels(), loc="center", fontsize=10, title="method")
        fig.tight_layout()
    else:
        _legend_below(fig, axes.flat[0], len(methods))
    return figure_png(fig)


def plot_matrices(matrices: dict, methods: list[str], interfaces: list[str], order: list[str]) -> bytes:
    """Heatmaps of R[j][i] (row: after arrival j; column: task i), a row per method and a column per
    interface, all on one colour scale: a probe that holds its accuracy while the head loses it then
    reads as such (accuracy and NMI both lie in [0, 1])."""
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(methods), len(interfaces), figsize=(3.1 * len(interfaces) + 1.2, 2.9 * len(methods) + 0.4), squeeze=False
    )
    stack = [np.asarray(matrices[m].get(i, []), dtype=float).ravel() for m in methods for i in interfaces]
    finite = np.concatenate([s[np.isfinite(s)] for s in stack] + [np.zeros(0)])
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1e-9
    image = None
    for c, i in enumerate(interfaces):
        for r, m in enumerate(methods):
            ax = axes[r, c]
            ax.grid(False)
            R = np.asarray(matrices[m].get(i, []), dtype=float)
            if R.ndim != 2 or R.size == 0:
                ax.axis("off")
                ax.text(0.5, 0.5, f"{m}: no {i} matrix", ha="center", va="center", transform=ax.transAxes)
                continue
            image = ax.imshow(np.ma.masked_invalid(R), cmap="viridis", vmin=lo, vmax=hi, aspect="auto")
            for (j, t), v in np.ndenumerate(R):
                if np.isfinite(v):
                    light = (v - lo) / (hi - lo) > 0.6
                    ax.text(t, j, f"{v:.2f}", ha="center", va="center", fontsize=8, color="black" if light else "white")
            names = order if R.shape[1] == len(order) else [str(k) for k in range(R.shape[1])]
            ax.set_xticks(range(R.shape[1]), names, rotation=30 if len(names) > 3 else 0, fontsize=8)
            ax.set_yticks(
                range(R.shape[0]),
                [f"after {n}" for n in names[: R.shape[0]]] if R.shape[0] <= len(names) else range(R.shape[0]),
                fontsize=8,
            )
            ax.set_title(f"{m} \u00b7 {interface_label(i)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    if image is not None:
        bar = fig.colorbar(image, cax=fig.add_axes((0.945, 0.25, 0.012, 0.5)))
        bar.set_label("accuracy or NMI")
    return figure_png(fig)


def plot_ccmmd(curation: pd.DataFrame) -> bytes:
    """Per task: CC-MMD^2 with its interval beside the naive, audit-only and oracle estimates; and the
    estimated contamination rate against the true one."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.7, 1]})
    x = np.arange(len(curation))
    err = np.vstack([curation["ccmmd"] - curation["ccmmd_ci_low"], curation["ccmmd_ci_high"] - curation["ccmmd"]])
    ax1.errorbar(
        x - 0.15,
        curation["ccmmd"],
        yerr=np.clip(err.astype(float), 0, None),
        fmt="o",
        capsize=4,
        color="tab:blue",
        label="CC-MMD\u00b2 (interval)",
        zorder=4,
    )
    ax1.scatter(x - 0.05, curation["naive"], marker="s", color="tab:red", label="naive (raw pool)", zorder=4)
    ax1.scatter(x + 0.05, curation["audit_only"], marker="^", color="tab:orange", label="audit only", zorder=4)
    ax1.scatter(
        x + 0.15, curation["oracle"], marker="D", facecolors="none", edgecolors="black", label="oracle", zorder=4
    )
    ax1.set_xticks(x, curation["task"])
    ax1.set_ylabel("MMD\u00b2 between pool and target")
    ax1.set_title("contamination-corrected MMD\u00b2 per task")
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4)
    ax2.scatter(curation["eps_true"], curation["eps_hat"], color="tab:blue", zorder=4)
    for k, (t, a, b) in enumerate(zip(curation["task"], curation["eps_true"], curation["eps_hat"])):
        ax2.annotate(str(t), (a, b), textcoords="offset points", xytext=(6, 4 if k % 2 == 0 else -11), fontsize=8)
    top = (
        float(np.nanmax(np.r_[curation["eps_true"].to_numpy(float), curation["eps_hat"].to_numpy(float), 0.05])) * 1.15
    )
    ax2.plot([0, top], [0, top], ls="--", color="gray", lw=1, label="y = x")
    ax2.set_xlim(0, top)
    ax2.set_ylim(0, top)
    ax2.set_aspect("equal")
    ax2.set_xlabel("true contamination rate")
    ax2.set_ylabel("estimated contamination rate")
    ax2.set_title("estimated vs true contamination")
    ax2.legend(loc="upper left")
    fig.tight_layout()
    return figure_png(fig)


def plot_pseudolabel(pl: pd.DataFrame) -> bytes:
    """Per task: the audit-corrected pseudo-label accuracy with its interval, the truth and the naive estimate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(7.5, 1.6 * len(pl) + 2.5), 4.2))
    x = np.arange(len(pl))
    err = np.vstack([pl["accuracy"] - pl["accuracy_ci_low"], pl["accuracy_ci_high"] - pl["accuracy"]])
    ax.errorbar(
        x - 0.1,
        pl["accuracy"],
        yerr=np.clip(err.astype(float), 0, None),
        fmt="o",
        capsize=4,
        color="tab:blue",
        label="audit-corrected estimate (interval)",
        zorder=4,
    )
    ax.scatter(x, pl["accuracy_true"], marker="D", facecolors="none", edgecolors="black", label="true", zorder=4)
    ax.scatter(x + 0.1, pl["naive_accuracy"], marker="s", color="tab:red", label="naive", zorder=4)
    ax.set_xticks(x, pl["task"])
    ax.set_xlim(-0.6, len(pl) - 0.4)
    ax.set_ylabel("pseudo-label accuracy")
    ax.set_title("pseudo-label accuracy: estimate vs truth")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    fig.tight_layout()
    return figure_png(fig)


# ---------------------------------------------------------------------------------------------------
# sections
