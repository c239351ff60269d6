"""The suite's look: one seaborn theme and one fixed colour per method name across notebooks.

    plots.use_theme()
    ax.plot(x, y, color=plots.color("min_p"), label="min_p")
    sns.lineplot(data=df, x="batch", y="tokens_per_s", hue="impl", palette=plots.palette(df.impl.unique()))
    plots.finish(ax, "Decode throughput", "batch size", "tokens/s")

The same sampler, drafter or engine gets the same colour in every figure; names outside the table
below get a colour hashed from the name (stable across processes and machines).
"""
from __future__ import annotations

import hashlib

# Grouped by the notebooks they meet in: colours are distinct within a group (and across all
# known names), baselines are greys, ground truth is black.
COLORS = {
    # samplers (quickstart, min-p vs top-p)
    "greedy": "#4d4d4d",
    "temperature": "#1f77b4",
    "top_k": "#ff7f0e",
    "top_p": "#2ca02c",
    "min_p": "#d62728",
    "typical": "#9467bd",
    "eta": "#8c564b",
    "epsilon": "#e377c2",
    # drafters (speculation, MTP)
    "plain": "#7f7f7f",
    "ngram": "#1b9e77",
    "layer_skip": "#d95f02",
    "draft_model": "#7570b3",
    "mtp": "#e7298a",
    "adaptive": "#66a61e",
    # engines (quickstart, benchmark)
    "hf": "#bab0ac",
    "ours": "#4e79a7",
    # constrained decoding
    "xgrammar": "#e41a1c",
    "llguidance": "#377eb8",
    "outlines": "#4daf4a",
    "naive": "#984ea3",
    "masked": "#ff7f00",
    "exact": "#000000",
    "rejection": "#a65628",
    "smc": "#f781bf",
    "asap": "#17becf",
    "importance": "#fb9a99",
    "awrs": "#8a3ffc",
    "awrs_smc": "#33a02c",
    "awrs_twist": "#0173b2",
    # self-consistency and shared-prefix KV
    "majority": "#59a14f",
    "weighted": "#edc948",
    "esc": "#b07aa1",
    "adaptive_consistency": "#76b7b2",
    "shared": "#e15759",
    "unshared": "#9c755f",
    "hf_num_return_sequences": "#ff9da7",
}
ALIASES = {
    "temp": "temperature",
    "topk": "top_k",
    "topp": "top_p",
    "nucleus": "top_p",
    "minp": "min_p",
    "typical_p": "typical",
    "eta_sampling": "eta",
    "epsilon_sampling": "epsilon",
    "argmax": "greedy",
    "baseline": "plain",
    "none": "plain",
    "n_gram": "ngram",
    "prompt_lookup": "ngram",
    "layerskip": "layer_skip",
    "self_speculative": "layer_skip",
    "draft": "draft_model",
    "hf_generate": "hf",
    "transformers": "hf",
    "decodelab": "ours",
    "engine": "ours",
    "unconstrained": "naive",
}
# For names not in COLORS: seaborn's "colorblind" and tab10-like tones, picked by a hash of the name.
FALLBACK = (
    "#0173b2", "#de8f05", "#029e73", "#d55e00", "#cc78bc", "#ca9161", "#fbafe4", "#949494",
    "#ece133", "#56b4e9", "#006d5b", "#8a3ffc", "#b8860b", "#6a3d9a", "#33a02c", "#fb9a99",
)


def normalize(name: str) -> str:
    """"Top-P", "top p", "top_p" -> "top_p"; aliases ("nucleus", "hf_generate") -> their canonical name."""
    key = str(name).strip().lower().replace("-", "_").replace(" ", "_")
    return ALIASES.get(key, key)


def color(name: str) -> str:
    """The suite's fixed colour (hex) for a method / drafter / sampler / engine name."""
    key = normalize(name)
    if key in COLORS:
        return COLORS[key]
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return FALLBACK[int.from_bytes(digest[:4], "big") % len(FALLBACK)]


def palette(names) -> dict[str, str]:
    """{name: colour} for seaborn's `palette=` (keys are the names exactly as given)."""
    return {name: color(name) for name in dict.fromkeys(names)}


def use_theme(context: str = "notebook") -> None:
    """Apply the suite's seaborn theme (white grid, readable fonts, stable SVG output)."""
    import seaborn as sns

    sns.set_theme(
        context=context,
        style="whitegrid",
        palette=list(FALLBACK[:10]),
        rc={
            "figure.figsize": (7.0, 4.2),
            "figure.dpi": 100,
            "savefig.dpi": 150,
            "savefig.bbox": "tight",
            "axes.titleweight": "bold",
            "axes.spines.top": False,
            "axes.spines.right": False,
            "legend.frameon": False,
            "svg.hashsalt": "decodelab",
        },
    )


def finish(ax, title: str, xlabel: str, ylabel: str, *, legend: bool | str = "auto", legend_title: str | None = None):
    """Title and axis labels (give units: "tokens/s", "batch size"), legend when there are labelled artists."""
    if not title or not xlabel or not ylabel:
        raise ValueError("every figure needs a title and axis labels; "
                         f"got title={title!r} xlabel={xlabel!r} ylabel={ylabel!r}")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    handles, labels = ax.get_legend_handles_labels()
    wanted = legend is True or (legend == "auto" and any(not lbl.startswith("_") for lbl in labels))
    if wanted:
        ax.legend(title=legend_title)
    elif ax.get_legend() is not None:
        ax.get_legend().remove()
    ax.figure.tight_layout()
    return ax
