"""The MoE branch's figure: routing consistency and hidden-state drift per layer for every variant,
and every compensated matrix's rank (uniform, load-aware) against its expert's load."""

from __future__ import annotations

import pandas as pd

ORDER = ("float", "mxfp4", "uniform", "load_aware", "load_aware_prop", "qat")
COLORS = {
    "float": "#444444",
    "mxfp4": "#d62728",
    "uniform": "#1f77b4",
    "load_aware": "#2ca02c",
    "load_aware_prop": "#ff7f0e",
    "qat": "#9467bd",
}


def figure(tables: dict[str, pd.DataFrame], metrics: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    cons, drift, ranks = tables["consistency"], tables["drift"], tables["ranks"]
    ppl = metrics.get("perplexity", {})
    for name in [v for v in ORDER if v in set(cons["variant"])]:
        rows = cons[cons["variant"] == name].sort_values("layer")
        label = f"{name} (ppl {ppl[name]:.2f})" if name in ppl else name
        axes[0].plot(rows["layer"], rows["set"], marker=".", label=label, color=COLORS.get(name))
    axes[0].set(title="routing consistency (same top-k set)", xlabel="layer", ylabel="share of tokens", ylim=(0, 1.02))
    axes[0].legend(fontsize=7)
    for name in [v for v in ORDER if v in set(drift["variant"]) and v != "float"]:
        rows = drift[drift["variant"] == name].sort_values("layer")
        axes[1].plot(rows["layer"], rows["drift"], marker=".", label=name, color=COLORS.get(name))
    axes[1].set(title="hidden-state drift vs the float MoE", xlabel="layer", ylabel="||h - h_float|| / ||h_float||")
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=7)
    experts = ranks[ranks["expert"].notna()] if "expert" in ranks else ranks
    for col, marker, color in (
        ("uniform", "o", COLORS["uniform"]),
        ("load_aware", "^", COLORS["load_aware"]),
        ("load_aware_prop", "v", COLORS["load_aware_prop"]),
    ):
        if col not in experts:
            continue
        axes[2].scatter(experts["load"], experts[col], s=10, marker=marker, alpha=0.6, color=color, label=col)
    axes[2].set(
        title=f"rank per expert matrix vs load (total {metrics.get('rank_budget')})",
        xlabel="expert load (share of tokens)",
        ylabel="adapter rank",
    )
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig


SUMMARY_COLUMNS = [
    "variant",
    "perplexity",
    "routing consistency (set)",
    "top-1 agreement",
    "drift (last layer)",
    "bits / weight",
    "MB",
]


def summary_rows(moe: dict) -> list[list]:
    """One row per variant for the report's MoE section (dense first: perplexity only)."""
    rows = []
    ppl = moe.get("perplexity", {})
    if "dense" in ppl:
        rows.append(["dense", ppl["dense"], None, None, None, None, None])
    variants = moe.get("variants", {})
    for name in [v for v in ORDER if v in variants]:
        v = variants[name]
        c = v.get("consistency_mean") or {}
        size = (v.get("bytes") or {}).get("total")
        rows.append(
            [
                name,
                v.get("perplexity"),
                c.get("set"),
                c.get("top1"),
                v.get("drift_last"),
                v.get("bits_per_weight"),
                None if size is None else size / 1e6,
            ]
        )
    return rows


def summary_note(moe: dict) -> str:
    ranks = moe.get("ranks", {})
    qat = moe.get("qat") or {}
    return (
        f"{moe.get('source', 'the source model')} split into {moe.get('n_experts', '?')} experts, top-"
        f"{moe.get('top_k', '?')}. uniform, load_aware (routed loads) and load_aware_prop (routed share x "
        f"output-gradient sensitivity): the same total adapter rank ({ranks.get('budget')}); qat: "
        f"{qat.get('start', 'load_aware')} (lowest calibration KL) + {qat.get('steps', 0)} steps of routing replay QAT "
        f"({qat.get('loss', '')} loss). Consistency and drift are measured without replay, against the "
        "float MoE's routes and hidden states on the same held-out tokens."
    )
