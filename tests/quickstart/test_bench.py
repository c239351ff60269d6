"""The decode benchmark compares like with like: EOS off on both sides, tokens counted as returned, one clock."""

import numpy as np
import pytest

from decodelab.core.engine import generate
from decodelab.core.models import tiny_model
from decodelab.quickstart import bench

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def early_eos_model():
    """A tiny model whose generation_config names as EOS a token greedy decoding emits at step 2 of row 0."""
    model = tiny_model(seed=0)
    free = generate(model, PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=[]).tokens
    eos = free[0][1]
    model.hf_model.generation_config.eos_token_id = eos
    model.hf_model.generation_config.pad_token_id = 0
    return model, free, eos


def test_early_eos_model_really_emits_its_eos_early(early_eos_model):
    """Guard for the tests below: without the EOS fix, HF would stop these rows."""
    model, free, eos = early_eos_model
    assert eos != 0 and free[0].index(eos) == 1
    assert eos in model.eos_token_ids


def test_hf_baseline_decodes_past_the_generation_configs_eos(early_eos_model):
    model, free, _ = early_eos_model
    hf = bench.hf_generate_greedy(model, PROMPTS, MAX_NEW)
    assert [len(row) for row in hf] == [MAX_NEW] * len(PROMPTS)
    assert hf == free


def test_both_sides_return_max_new_tokens_per_row_and_identical_rows(early_eos_model):
    model, _, _ = early_eos_model
    rows = bench.decode_throughput(model, [1, 3], MAX_NEW, repeats=2, prompts=PROMPTS, progress=False)
    assert {(r["batch"], r["impl"]) for r in rows} == {(1, "ours"), (1, "hf"), (3, "ours"), (3, "hf")}
    for r in rows:
        assert r["new_tokens"] == r["batch"] * MAX_NEW
        assert r["identical_rows"] == r["rows"] == r["batch"]
        assert r["tokens_per_s"] == r["new_tokens"] / r["seconds"]


def test_identical_rows_compares_full_rows():
    assert bench.identical_rows([[1, 2, 3], [4, 5]], [[1, 2], [4, 5]]) == 1  # a prefix is not identical
    assert bench.identical_rows([[1, 2]], [[1, 2]]) == 1
    with pytest.raises(ValueError, match="1 rows with 2 rows"):
        bench.identical_rows([[1]], [[1], [1]])


def fake_sides(monkeypatch, seconds: dict, returned: dict):
    """Replace both sides and the clock: each call logs its side; side `s` returns returned[s] rows."""
    calls = []

    def side(name):
        def fn(model, prompts, max_new_tokens):
            calls.append((name, max_new_tokens))
            return returned[name]
        return fn

    timings = {name: iter(values) for name, values in seconds.items()}
    monkeypatch.setattr(bench, "IMPLS", {"ours": side("ours"), "hf": side("hf")})
    monkeypatch.setattr(bench, "wall_clock", lambda fn, model, prompts, n: (
        fn(model, prompts, n), next(timings[calls[-1][0]])))
    return calls


def test_repeats_interleave_the_sides_after_one_warmup_each(monkeypatch):
    rows = [[1] * 4, [2] * 4]
    calls = fake_sides(monkeypatch, {"ours": [1.0] * 3, "hf": [1.0] * 3}, {"ours": rows, "hf": rows})
    bench.compare_greedy(None, [[0], [0]], 4, repeats=3)
    warmup = [("ours", bench.WARMUP_TOKENS), ("hf", bench.WARMUP_TOKENS)]
    assert calls == warmup + [("ours", 4), ("hf", 4)] * 3


def test_fastest_call_is_kept_with_the_spread_and_tokens_counted_as_returned(monkeypatch):
    ours, hf_short = [[1] * 4, [2] * 4], [[1] * 4, [2] * 3]  # HF "stopped" one row a token early
    fake_sides(monkeypatch, {"ours": [2.0, 1.0, 4.0], "hf": [3.0, 5.0, 6.0]}, {"ours": ours, "hf": hf_short})
    by_impl = {r["impl"]: r for r in bench.compare_greedy(None, [[0], [0]], 4, repeats=3)}
    assert (by_impl["ours"]["seconds"], by_impl["ours"]["seconds_max"]) == (1.0, 4.0)
    assert (by_impl["hf"]["seconds"], by_impl["hf"]["seconds_max"]) == (3.0, 6.0)
    assert by_impl["ours"]["spread"] == 3.0 and by_impl["hf"]["spread"] == 1.0
    assert (by_impl["ours"]["new_tokens"], by_impl["hf"]["new_tokens"]) == (8, 7)
    assert by_impl["hf"]["tokens_per_s"] == 7 / 3.0
    assert by_impl["ours"]["identical_rows"] == by_impl["hf"]["identical_rows"] == 1


def test_the_dtype_head_to_head_interleaves_the_dtypes_and_keeps_every_round(monkeypatch):
    import torch

    from decodelab.quickstart import dtype_sweep

    models = {name: tiny_model(seed=0, dtype=getattr(torch, name)) for name in ("float32", "bfloat16")}
    monkeypatch.setattr(dtype_sweep, "load_model", lambda name, device=None, dtype=None: models[dtype])
    monkeypatch.setattr(bench, "chat_prompts", lambda tokenizer: PROMPTS)
    order, real = [], dtype_sweep.generate
    monkeypatch.setattr(dtype_sweep, "generate",
                        lambda model, *a, **kw: order.append(dtype_sweep.dtype_name(model)) or real(model, *a, **kw))
    rows = dtype_sweep.head_to_head("tiny", ["float32", "bfloat16"], 5, rounds=3, batch=2)
    fp32, bf16 = "float32", "bfloat16"
    assert order == [fp32, bf16] + [fp32, bf16, bf16, fp32, fp32, bf16]  # one warm-up each, then flipping rounds
    by = {r["dtype"]: r for r in rows}
    for r in rows:
        assert r["batch"] == 2 and r["rounds"] == 3 and r["same_tokens"] is True
        assert r["seconds"] <= r["seconds_max"] and r["spread"] == r["seconds_max"] / r["seconds"] - 1
        assert r["ours_tokens_per_s"] == 2 * 5 / r["seconds"] and r["new_tokens"] == 2 * 5
        assert len(r["round_seconds"]) == 3 and min(r["round_seconds"]) == r["seconds"]
    assert dtype_sweep.paired_speedup(rows, bf16, fp32, batch=2) == pytest.approx(float(np.median(
        [f / b for f, b in zip(by[fp32]["round_seconds"], by[bf16]["round_seconds"])])))
    assert dtype_sweep.speedup_over(rows, bf16, fp32, batch=2) == (by[bf16]["ours_tokens_per_s"]
                                                                   / by[fp32]["ours_tokens_per_s"])
    with pytest.raises(ValueError, match="rounds"):
        dtype_sweep.head_to_head("tiny", [fp32], 5, rounds=0)


def test_paired_speedup_compares_calls_of_the_same_round():
    from decodelab.quickstart import dtype_sweep

    # bf16 was 1.5x fp32 in every round, but its fastest call fell in a fast spell fp32 never met: the
    # fastest calls' ratio reads 2x
    rows = [{"dtype": "float32", "batch": 1, "new_tokens": 10, "round_seconds": [3.0, 3.0, 3.0],
             "ours_tokens_per_s": 10 / 3.0},
            {"dtype": "bfloat16", "batch": 1, "new_tokens": 10, "round_seconds": [2.0, 1.5, 2.0],
             "ours_tokens_per_s": 10 / 1.5}]
    assert dtype_sweep.paired_speedup(rows, "bfloat16") == pytest.approx(1.5)
    assert dtype_sweep.speedup_over(rows, "bfloat16") == pytest.approx(2.0)
    assert np.isnan(dtype_sweep.paired_speedup(rows, "float16"))
    rows[1]["round_seconds"] = [2.0]
    with pytest.raises(ValueError, match="rounds"):
        dtype_sweep.paired_speedup(rows, "bfloat16")
