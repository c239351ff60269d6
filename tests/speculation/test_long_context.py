"""The long-context sweep (on the tiny model with a stand-in workload), its memory check and goal rows, and the
GPU roofline of the sparse-KV self-draft (MagicDec's regime: speedup grows with batch at long context)."""
import math

import pytest
import torch

from decodelab.core import engine
from decodelab.speculation import decode as speculative
from decodelab.speculation import heldout, roofline
from decodelab.speculation import long_context as lc
from decodelab.workloads.long_context import LongContextWorkload


def _workload(context, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 256, (context - 6,), generator=g).tolist()
    suffixes = [torch.randint(3, 256, (3 + b % 3,), generator=g).tolist() for b in range(batch)]
    return LongContextWorkload(prefix=prefix, suffixes=suffixes, functions=["f"] * batch, context=context,
                               module="stand-in", task="edit")


@pytest.fixture
def standin(monkeypatch, tiny):
    monkeypatch.setattr(lc, "long_context_workload", lambda tok, *, context, batch, task: _workload(context, batch))
    return tiny


def test_sweep_rows_are_exact_and_carry_a_ci(standin):
    rows = lc.long_context_sweep(standin, contexts=[48], batches=[1, 3], drafters=["ngram", "sparse_kv"], k=2,
                                 max_new_tokens=6, repeats=2, sink=2, window=8)
    cells = [(r["batch"], r["drafter"]) for r in rows]
    assert cells == [(1, "ngram"), (1, "sparse_kv"), (3, "ngram"), (3, "sparse_kv")]
    for r in rows:
        assert r["matches_plain"] is True
        # the pooled t interval is centred on the geometric mean of the paired per-round ratios
        assert len(r["ratios"]) == 2
        assert r["speedup_low"] <= math.exp(sum(map(math.log, r["ratios"])) / 2) <= r["speedup_high"]
        assert r["speedup"] > 0 and r["tau"] >= 1.0 and r["draft_s_per_token"] >= 0
    # the rows carry what the roofline's held-out check reads (one cell per drafter held out here)
    shape = roofline.ModelShape.from_config(standin.hf_model.config, bytes_per_param=4)
    hw = roofline.Hardware("test", peak=1e10, bandwidth=1e10, overhead=1e-4)
    check = heldout.validate(rows, shape, hw, seed=0)
    assert check.n_heldout == 2 and check.insample_error is not None and check.heldout_error is not None
    read = lc.predict_long_rows(rows, shape, hw, sink=2, window=8)
    assert all(r["verify_ratio"] >= 1.0 and 0 < r["alpha"] < 1 or r["tau"] == 1.0 for r in read)


def test_a_capped_drafter_runs_only_up_to_its_batch(standin):
    rows = lc.long_context_sweep(standin, contexts=[48], batches=[1, 3], drafters=["ngram", "sparse_kv"], k=2,
                                 max_new_tokens=4, repeats=1, sink=2, window=8, max_batch={"sparse_kv": 1})
    assert [(r["batch"], r["drafter"]) for r in rows] == [(1, "ngram"), (1, "sparse_kv"), (3, "ngram")]
    assert all(r["matches_plain"] for r in rows)


def test_a_bf16_sparse_draft_of_an_fp32_target_stays_exact(standin):
    taus = {}
    for dtype in (None, "bfloat16"):
        rows = lc.long_context_sweep(standin, contexts=[48], batches=[1, 3], drafters=["sparse_kv"], k=2,
                                     max_new_tokens=6, repeats=1, sink=2, window=40, sparse_dtype=dtype)
        assert [r["matches_plain"] for r in rows] == [True, True]
        taus[dtype] = [r["tau"] for r in rows]
    assert min(taus[None]) > 1.0 and min(taus["bfloat16"]) > 1.0  # the rounded copy drafts the target's tokens too
    assert lc.bytes_per_param("bfloat16") == 2.0 and lc.bytes_per_param(None) is None
    with pytest.raises(ValueError, match="float8"):
        lc.long_context_sweep(standin, contexts=[48], batches=[1], drafters=["sparse_kv"], k=2, max_new_tokens=4,
                              repeats=1, sink=2, window=8, sparse_dtype="float8")


def test_shared_prefill_decodes_like_a_plain_prefill(tiny):
    prompts = _workload(40, 3).prompts
    pre = lc.shared_prefill(tiny, prompts, max_new_tokens=8, max_k=3)
    ref = engine.generate(tiny, prompts, max_new_tokens=8, eos_token_ids=[])
    two = lc.batch_prefilled(pre, 2)
    assert two.cache.keys.data_ptr() == pre.cache.keys.data_ptr()  # a view of the prefill's rows, not a copy
    out = speculative.generate(tiny, drafter=None, k=0, max_new_tokens=8, prefilled=two, eos_token_ids=[])
    assert out.tokens == ref.tokens[:2]
    # the smaller batch's run wrote only scratch positions: the whole batch, drafting, still decodes the same
    out = speculative.generate(tiny, drafter=lc.SparseKVDrafter(tiny, sink=2, window=8).share(pre.cache), k=3,
                               max_new_tokens=8, prefilled=lc.batch_prefilled(pre, 3), eos_token_ids=[])
    assert out.tokens == ref.tokens
    with pytest.raises(ValueError, match=r"batch=4 must be in \[1, 3\]"):
        pre.cache.first_rows(4)


def test_memory_check_says_how_much_is_needed(tiny):
    per_token = lc.kv_bytes_per_token(tiny)
    tr = tiny.transformer
    assert per_token == 2 * tr.n_layers * tr.n_kv_heads * tr.head_dim * 4
    # the 32-row prefill, and at batch 32 a copy per run side by side: plain, its twin, sparse_kv (ngram stops at 1)
    rows = lc.kv_rows_needed([1, 32], ["ngram", "sparse_kv"], {"ngram": 1})
    assert rows == 32 + 3 * 32 and lc.kv_rows_needed([1, 32], ["ngram", "sparse_kv"]) == 32 + 4 * 32
    assert lc.kv_rows_needed([1, 2], ["ngram"] * 3, {"ngram": 1}) == 2 + 5  # batch 1's five runs outweigh batch 2's
    need = rows * (4096 + 8 + 3 + 1) * per_token
    with pytest.raises(ValueError, match=rf"context=4096 at batch=32 needs {need / 2**30:.1f} GiB"):
        lc.check_memory(tiny, [4096], [1, 32], max_new_tokens=8, max_k=3, drafters=["ngram", "sparse_kv"],
                        max_batch={"ngram": 1}, available=int(need))
    lc.check_memory(tiny, [4096], [1, 32], max_new_tokens=8, max_k=3, drafters=["ngram", "sparse_kv"],
                    max_batch={"ngram": 1}, available=int(2 * need))


def test_bad_grid_names_the_parameter():
    with pytest.raises(ValueError, match="long_drafters=\\['mtp'\\]"):
        lc.check_grid([1024], [1], ["mtp"], 3)
    with pytest.raises(ValueError, match="batches=\\[0\\]"):
        lc.check_grid([1024], [0], ["ngram"], 3)
    with pytest.raises(ValueError, match="names 'layer_skip', which is not in long_drafters"):
        lc.check_grid([1024], [1], ["ngram"], 3, {"layer_skip": 4})
    with pytest.raises(ValueError, match="must be an int >= the smallest batch"):
        lc.check_grid([1024], [2, 4], ["ngram"], 3, {"ngram": 1})


def _row(context, batch, drafter, speedup, low=None):
    return {"context": context, "batch": batch, "drafter": drafter, "speedup": speedup,
            "speedup_low": speedup if low is None else low, "matches_plain": True}


def test_goal_rows_use_the_longest_context_and_the_ci_low():
    rows = [_row(1024, 1, "ngram", 2.0), _row(1024, 16, "ngram", 3.0),
            _row(2048, 1, "ngram", 1.5), _row(2048, 16, "ngram", 1.4, low=1.2), _row(2048, 16, "sparse_kv", 0.9),
            _row(2048, 1, "sparse_kv", 0.7)]
    goals = {g.name: g for g in lc.long_context_goals(rows)}
    b16, grows = goals["long_context_speedup_b16"], goals["long_context_speedup_grows"]
    assert b16.value == pytest.approx(1.2) and b16.met is False
    assert grows.value == pytest.approx(-0.1) and grows.met is False
    assert goals["long_context_exact"].met is True
    assert all(g.value is None for g in lc.long_context_goals([_row(1024, 16, "ngram", 3.0)])[:2])


def test_paying_batch_by_hand():
    assert lc.paying_batch([1, 4, 16], [0.5, 0.8, 1.1]) == pytest.approx(math.exp(math.log(4) + 2 / 3 * math.log(4)))
    assert lc.paying_batch([1, 4], [1.2, 1.3]) == 1.0 and lc.paying_batch([1, 4], [0.5, 0.9]) is None


def test_gpu_sparse_draft_gains_with_batch_at_long_context_only():
    rows, crossovers = lc.gpu_long_context(("H200",), contexts=(1024, 16384), alpha=0.7)
    cx = {(c["model"], c["context"]): c for c in crossovers}
    for model in ("8B", "70B"):
        assert cx[(model, 16384)]["grows"]  # KV reads dominate: the sparse draft gets relatively cheaper with batch
        long_pays = cx[(model, 16384)]["crossover"]
        short_pays = cx[(model, 1024)]["crossover"]
        assert long_pays is not None and (short_pays is None or long_pays < short_pays)
    at_one = [r["speedup"] for r in rows if r["batch"] == 1]
    assert max(at_one) < 1.05  # at batch 1 a full-weight draft step costs about a target step


@pytest.mark.slow
def test_workload_shares_a_document_and_asks_about_functions_inside_it(smol):
    from decodelab.workloads.long_context import long_context_workload

    tok = smol.tokenizer
    w = long_context_workload(tok, context=1024, batch=5)
    lengths = [len(p) for p in w.prompts]
    assert max(lengths) <= 1024 and min(lengths) >= 1024 - 64
    assert all(p[: len(w.prefix)] == w.prefix for p in w.prompts)
    document = tok.decode(w.prefix)
    assert len(set(w.functions)) == 5 and all(f"def {name}(" in document for name in w.functions)
    assert all(f"`{name}`" in tok.decode(s) for name, s in zip(w.functions, w.suffixes))
    with pytest.raises(ValueError, match="task='summarize' is unknown"):
        long_context_workload(tok, context=1024, batch=2, task="summarize")
    with pytest.raises(ValueError, match="context=100 must be an int >= 256"):
        long_context_workload(tok, context=100, batch=2)
