"""Interactive controls for the notebooks, each with a static fallback for papermill runs.

`kept_set_explorer` puts sliders over temperature, top-p and min-p next to a real next-token
distribution and shows which tokens each sampler keeps. In JupyterLab (`interactive=True`) it is an
ipywidgets panel; under papermill or in an exported report (`interactive=False`) it draws one static
figure for a few fixed settings, so the executed notebook still shows the idea.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class NextToken:
    """One real next-token distribution: the context it follows and its logits (V,)."""

    context: str
    logits: torch.Tensor


@torch.no_grad()
def next_token_logits(model, prompt: str, answer_start: str = "") -> NextToken:
    """The model's next-token logits after a chat user turn `prompt` and the beginning of its answer
    `answer_start` (mid-sentence distributions are the interesting ones) -> NextToken."""
    from decodelab.core.engine import prefill
    from decodelab.workloads.prompts import chat_text

    tok = model.tokenizer
    text = chat_text(tok, [{"role": "user", "content": prompt}]) + answer_start
    ids = tok(text, add_special_tokens=False).input_ids
    _, logits = prefill(model, [ids], max_new_tokens=1)
    return NextToken(context=text, logits=logits[0].float().cpu())


def kept_sets(logits: torch.Tensor, temperature: float, top_p: float, min_p: float) -> dict[str, torch.Tensor]:
    """(V,) -> {"probs": (V,) softmax(logits / T), "top_p": (V,) bool kept, "min_p": (V,) bool kept},
    each filter alone after temperature (Hugging Face's order)."""
    from decodelab.core.sampling import Sampler, SamplerConfig

    row = logits.float().reshape(1, -1)
    out = {"probs": torch.softmax(row[0] / temperature, -1)}
    for name, cfg in (("top_p", SamplerConfig(temperature=temperature, top_p=top_p)),
                      ("min_p", SamplerConfig(temperature=temperature, min_p=min_p))):
        out[name] = torch.isfinite(Sampler(cfg).process(row)[0])
    return out


def _token_label(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return str(token_id)
    return repr(tokenizer.decode([token_id]))[1:-1][:12] or "<empty>"


def draw_kept_sets(ax, dist: NextToken, tokenizer, temperature: float, top_p: float, min_p: float, *, n_show: int = 25):
    """Bar chart of the n_show most probable tokens at `temperature`, marking which of them top-p and
    min-p keep; the title gives each kept set's size and mass."""
    from decodelab.common import plots

    sets = kept_sets(dist.logits, temperature, top_p, min_p)
    probs = sets["probs"]
    top = torch.argsort(probs, descending=True)[:n_show]
    x = torch.arange(len(top)).numpy()
    ax.bar(x, probs[top].numpy(), color="#d9d9d9", label="probability (after T)")
    heights = probs[top].numpy()
    for name, offset, marker in (("top_p", 0.09, "v"), ("min_p", 0.03, "o")):
        kept = sets[name][top].numpy()
        ax.scatter(x[kept], heights[kept] + offset * heights.max(), color=plots.color(name),
                   marker=marker, s=22, label=f"kept by {name}")
    ax.set_xticks(x, [_token_label(tokenizer, int(i)) for i in top], rotation=70, fontsize=7)
    summary = "\n".join(
        f"{name} keeps {int(sets[name].sum())} tokens, mass {float(probs[sets[name]].sum()):.2f}"
        for name in ("top_p", "min_p")
    )
    plots.finish(ax, f"T={temperature:g}, top_p={top_p:g}, min_p={min_p:g}\n{summary}",
                 f"the {n_show} most probable next tokens", "probability (after temperature)")
    ax.title.set_fontsize(10)


def static_kept_sets(dist: NextToken, tokenizer, settings: list[tuple[float, float, float]], *, n_show: int = 25):
    """One panel per (temperature, top_p, min_p) setting: the static form of the explorer -> Figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 4.2), squeeze=False)
    for ax, (t, p, m) in zip(axes[0], settings):
        draw_kept_sets(ax, dist, tokenizer, t, p, m, n_show=n_show)
    axes[0][-1].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    return fig


def kept_set_explorer(dist: NextToken, tokenizer, *, interactive: bool = True, temperature: float = 1.0,
                      top_p: float = 0.9, min_p: float = 0.1, n_show: int = 25,
                      static_settings: list[tuple[float, float, float]] | None = None):
    """Sliders over temperature / top-p / min-p showing the kept sets on `dist` (JupyterLab), or, with
    interactive=False or without ipywidgets, a static figure of `static_settings` (default: the given
    setting at T = 1 and T = 2). Returns the widget, or the static Figure."""
    if interactive:
        try:
            import ipywidgets as w
        except ImportError:  # static output is always a correct answer
            interactive = False
    if not interactive:
        return static_kept_sets(dist, tokenizer, static_settings or [(1.0, top_p, min_p), (2.0, top_p, min_p)],
                                n_show=n_show)
    import matplotlib.pyplot as plt
    from IPython.display import display

    def show(temperature, top_p, min_p):
        fig, ax = plt.subplots(figsize=(8, 4))
        draw_kept_sets(ax, dist, tokenizer, temperature, top_p, min_p, n_show=n_show)
        ax.legend(loc="upper right", fontsize=7)
        plt.show()

    sliders = dict(
        temperature=w.FloatSlider(value=temperature, min=0.1, max=3.0, step=0.1, description="temperature"),
        top_p=w.FloatSlider(value=top_p, min=0.05, max=1.0, step=0.01, description="top_p"),
        min_p=w.FloatSlider(value=min_p, min=0.0, max=0.5, step=0.01, description="min_p"),
    )
    panel = w.interactive(show, **sliders)
    display(panel)
    return panel
