"""The MoE build's figure: perplexity over the dense model's against the share of the FFN a token
uses, for the MoE as built (one point per top-k, the same experts and routers) and after the refit
and the recovery at the configured top-k."""

from __future__ import annotations


def curve_figure(build: dict):
    """build: models/moe/build/build.json (its `curve`, `perplexity`, `active_share`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = build["perplexity"]["dense"]
    points = sorted(build["curve"], key=lambda r: r["active_share"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [100 * r["active_share"] for r in points],
        [r["perplexity"] / dense for r in points],
        marker="o",
        color="#1f77b4",
        label="as built (training-free), per top-k",
    )
    share = 100 * build["active_share"]
    for key, marker, color, label in (
        ("moe_refit", "s", "#ff7f0e", "+ least-squares refit"),
        ("moe_float", "*", "#2ca02c", "+ refit + recovery (the stage's MoE)"),
    ):
        if key in build["perplexity"]:
            ax.scatter(
                [share], [build["perplexity"][key] / dense], marker=marker, s=90, color=color, label=label, zorder=3
            )
    ax.axhline(1.0, color="#444444", lw=0.8, ls="--", label=f"dense (perplexity {dense:.1f})")
    ax.set(
        xlabel="active share of the FFN (%)",
        ylabel="perplexity / dense perplexity",
        yscale="log",
        title=f"MoE perplexity vs active share ({build.get('n_experts')} routed experts, shared "
        f"{100 * build.get('shared_share', 0):.1f}%)",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
