"""Verify at a padded width: the real positions' logits and the cache are what the unpadded forward gives."""

import re

import pytest
import torch

from decodelab.core import machine, verify_width
from decodelab.core.engine import prefill, verify_step
from decodelab.core.models import tiny_model
from decodelab.core.verify_width import PAD_MARGIN, cheapest_widths, load_table, padded_width, save_table, table_path

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
ISSUE_MS = {1: 58, 2: 88, 3: 106, 4: 81, 5: 71, 6: 79, 7: 99, 8: 78, 9: 86}  # issue 15, batch 1, context 256


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def test_cheapest_widths_pads_up_to_the_cheapest_wider_forward():
    exact = cheapest_widths(ISSUE_MS, margin=0.0)
    assert exact == {1: 1, 2: 5, 3: 5, 4: 5, 5: 5, 6: 8, 7: 8, 8: 8, 9: 9}
    padded = [ISSUE_MS[exact[t]] for t in sorted(exact)]
    assert padded == sorted(padded)  # monotone in T
    widths = cheapest_widths(ISSUE_MS)  # 6 -> 8 would save 1 ms of 79: within the noise margin, not padded
    assert widths == {**exact, 6: 6}
    padded = [ISSUE_MS[widths[t]] for t in sorted(widths)]
    assert all(b >= a * (1 - PAD_MARGIN) for a, b in zip(padded, padded[1:]))  # monotone within the margin
    assert all(ISSUE_MS[widths[t]] <= ISSUE_MS[t] for t in widths)  # never costlier than unpadded


def test_cheapest_widths_take_the_smallest_of_widths_alike_within_the_margin():
    # this machine's fastest calls in one run (ms): widths 4, 5 and 6 within 3% of each other
    costs = {1: 44.2, 2: 50.4, 3: 48.7, 4: 43.9, 5: 43.5, 6: 44.9, 7: 54.4, 8: 56.7, 9: 57.2}
    widths = cheapest_widths(costs)
    assert widths == {1: 1, 2: 4, 3: 4, 4: 4, 5: 5, 6: 6, 7: 7, 8: 8, 9: 9}  # not 2, 3 -> 5 past a width 4 kept as is
    assert cheapest_widths(costs, margin=0.0)[3] == 5  # without a margin: the cheapest, noise or not


def test_cheapest_widths_rejects_an_empty_or_invalid_table():
    with pytest.raises(ValueError, match="widths >= 1"):
        cheapest_widths({})
    with pytest.raises(ValueError, match="widths >= 1"):
        cheapest_widths({0: 1.0})
    with pytest.raises(ValueError, match="margin=1"):
        cheapest_widths({1: 1.0}, margin=1)


@pytest.mark.parametrize("n_tokens, width", [(2, 5), (3, 4), (1, 3)])
def test_padded_verify_returns_the_unpadded_logits_and_cache(model, n_tokens, width):
    plain, _ = prefill(model, PROMPTS, max_new_tokens=8)
    padded, _ = prefill(model, PROMPTS, max_new_tokens=8)
    tokens = torch.tensor([[20 + t + r for t in range(n_tokens)] for r in range(len(PROMPTS))])
    assert padded_width(n_tokens, {n_tokens: width}, padded) == width
    want = verify_step(model, plain, tokens)
    got, hidden = verify_step(model, padded, tokens, widths={n_tokens: width}, return_hidden=True)
    assert got.shape == want.shape and hidden.shape[1] == n_tokens
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(padded.lengths, plain.lengths)
    for row, length in enumerate(plain.lengths.tolist()):  # every valid entry; the rest is scratch
        torch.testing.assert_close(padded.keys[:, row, :, :length], plain.keys[:, row, :, :length])
        torch.testing.assert_close(padded.values[:, row, :, :length], plain.values[:, row, :, :length])
    # and the next forward sees the same cache
    nxt = torch.tensor([[3]] * len(PROMPTS))
    torch.testing.assert_close(verify_step(model, padded, nxt), verify_step(model, plain, nxt), atol=1e-5, rtol=1e-5)


def test_no_padding_without_room_in_the_cache(model):
    cache, _ = prefill(model, PROMPTS, max_new_tokens=3)
    assert padded_width(2, {2: 5}, cache) == 2
    assert padded_width(2, {2: 3}, cache) == 3
    assert padded_width(2, None, cache) == 2


def test_width_table_round_trips_through_json(tmp_path):
    path = table_path(tmp_path, "m-float32-B1")
    save_table(path, {k: v / 1e3 for k, v in ISSUE_MS.items()}, {"context": 256})
    assert load_table(path) == cheapest_widths(ISSUE_MS)
    assert load_table(tmp_path / "missing.json") is None


def test_machine_key_tells_cpu_models_apart_and_is_a_file_name(monkeypatch):
    keys = {}
    for cpu in ("AMD EPYC 9R14", "Intel(R) Xeon(R) Platinum 8488C @ 2.4GHz"):
        monkeypatch.setattr(verify_width, "cpu_model", lambda cpu=cpu: cpu)
        keys[cpu] = verify_width.machine_key("org/model", torch.float32, 16)
    assert len(set(keys.values())) == 2
    for key in keys.values():
        assert re.fullmatch(r"[A-Za-z0-9.+_-]+", key), key
        assert key.startswith("org_model-float32-B16-")


def test_cpu_model_reads_the_model_name_where_linux_has_one():
    model = machine.cpu_model()
    assert model and model.strip() == model
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
    except OSError:
        names = []
    if names:
        assert model == names[0]
