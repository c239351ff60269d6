"""The suite's colours and theme: one colour per method name, everywhere."""
from __future__ import annotations

import pytest

from decodelab.common import plots


def test_same_name_same_colour():
    for name in ["min_p", "ours", "some_new_method"]:
        assert plots.color(name) == plots.color(name)


def test_spellings_of_one_name_share_a_colour():
    assert plots.color("top-p") == plots.color("Top P") == plots.color("top_p") == plots.color("nucleus")
    assert plots.color("hf_generate") == plots.color("hf")


def test_known_names_have_distinct_colours():
    colours = [plots.color(name) for name in plots.COLORS]
    assert len(set(colours)) == len(colours)


def test_brief_names_are_all_known():
    names = ("greedy temperature top_p min_p top_k typical eta epsilon ngram layer_skip draft_model mtp adaptive "
             "plain hf ours xgrammar llguidance outlines naive masked exact rejection smc asap majority weighted "
             "esc adaptive_consistency shared unshared hf_num_return_sequences").split()
    assert set(names) <= set(plots.COLORS)


def test_unknown_names_hash_stably_into_the_fallback_palette():
    # sha256 of the name, not Python's per-process salted hash(): the same on every machine and run.
    assert plots.color("beam_search") in plots.FALLBACK
    assert plots.color("beam_search") == plots.FALLBACK[
        int.from_bytes(__import__("hashlib").sha256(b"beam_search").digest()[:4], "big") % len(plots.FALLBACK)
    ]


def test_palette_maps_each_given_name():
    assert plots.palette(["ours", "hf", "ours"]) == {"ours": plots.COLORS["ours"], "hf": plots.COLORS["hf"]}


def test_finish_sets_title_labels_and_legend():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots.use_theme()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [1, 2], label="ours", color=plots.color("ours"))
    plots.finish(ax, "Decode throughput", "batch size", "tokens/s")
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("Decode throughput", "batch size", "tokens/s")
    assert ax.get_legend() is not None
    with pytest.raises(ValueError, match="title"):
        plots.finish(ax, "", "x", "y")
    plt.close(fig)
