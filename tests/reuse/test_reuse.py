"""Trace reuse on the tiny model and on text: lossless drafting and step reuse at threshold 1 equal plain greedy
decoding token for token; alignment, retrieval and the stream behave; bad input names parameter, value, allowed."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from decodelab.core import engine
from decodelab.reuse import align, methods, step_reuse, summary
from decodelab.reuse.drafting import ReferenceIndex, TraceDrafter
from decodelab.reuse.retrieval import Entry, TraceCache, check_method, check_threshold, jaccard, token_ngrams
from decodelab.speculation import decode as spec_decode
from decodelab.speculation.drafters import DraftContext, Drafter, NGramDrafter
from decodelab.workloads import families


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in (9, 14, 6)]


def test_trace_drafter_is_a_drafter_and_lossless_on_tiny(tiny):
    prompts = _prompts()
    plain = engine.generate(tiny, prompts, max_new_tokens=24, eos_token_ids=[]).tokens
    # references: each row's own plain output (a perfect trace), a shuffled one, and none
    refs = [[plain[0]], [plain[1][::-1]], []]
    drafter = TraceDrafter(refs, max_ngram=3)
    assert isinstance(drafter, Drafter)
    out = spec_decode.generate(tiny, prompts, drafter, k=5, max_new_tokens=24, eos_token_ids=[])
    assert out.tokens == plain
    assert drafter.accepted["trace"][0] > 0 and drafter.accepted["trace"][2] == 0
    assert drafter.forwards[0] < 24  # the perfect trace saves target forwards


def test_trace_drafter_without_references_is_prompt_lookup(tiny):
    prompts = _prompts()
    ours = spec_decode.generate(tiny, prompts, TraceDrafter([[], [], []], max_ngram=3), k=4, max_new_tokens=20,
                                eos_token_ids=[])
    ngram = spec_decode.generate(tiny, prompts, NGramDrafter(max_ngram=3), k=4, max_new_tokens=20, eos_token_ids=[])
    assert ours.tokens == ngram.tokens and ours.stats.step_k == ngram.stats.step_k


def test_reference_index_prefers_longest_match_then_last_reference():
    index = ReferenceIndex([[1, 2, 3, 4], [9, 2, 3, 7]], max_ngram=3, min_ngram=1)
    assert index.lookup([5, 2, 3], 2) == [7]  # "2 3" occurs in both: the last reference wins
    assert index.lookup([1, 2, 3], 2) == [4]  # the 3-gram only in the first
    assert index.lookup([8], 2) == []


def _piece(t: int) -> str:
    return "." if t % 5 == 0 else "x"


def test_step_reuse_threshold_one_equals_plain_greedy(tiny):
    prompts = _prompts()
    plain = engine.generate(tiny, prompts, max_new_tokens=30, eos_token_ids=[]).tokens
    steps = [align.split_steps(t, [_piece(x) for x in t]) for t in plain]
    steps[1] = [[7, 8, 10], [3, 5]]  # a wrong trace: rejected, output unchanged
    tokens, stats = step_reuse.generate(tiny, prompts, steps, _piece, threshold=1.0, max_new_tokens=30,
                                        eos_token_ids=[])
    assert tokens == plain
    assert stats.accepted_steps == [0, 0, 0]
    assert stats.forwards[0] < 30 and stats.reused_tokens[0] > 0  # its own trace: steps kept by the argmax
    # one target-chosen token per forward (the last may be cut at max_new_tokens), the rest reused
    assert all(len(tokens[b]) <= stats.forwards[b] + stats.reused_tokens[b] <= len(tokens[b]) + 1 for b in range(3))


def test_step_reuse_threshold_zero_accepts_every_proposed_step(tiny):
    prompts = _prompts()[:1]
    steps = [[[11, 12, 15], [21, 22, 25], [31, 32, 35]]]
    first = engine.generate(tiny, prompts, max_new_tokens=1, eos_token_ids=[]).tokens[0][0]
    steps[0][0][0] = first  # the target's own first token opens step 0: its remainder is proposed
    tokens, stats = step_reuse.generate(tiny, prompts, steps, _piece, threshold=0.0, max_new_tokens=20,
                                        eos_token_ids=[])
    assert tokens[0][:3] == steps[0][0] and stats.accepted_steps[0] >= 1
    assert len(tokens[0]) <= stats.forwards[0] + stats.reused_tokens[0] <= len(tokens[0]) + 1


def test_question_alignment_and_substitution():
    old = "Tom has 7 apples. He buys 3 more apples."
    new = "Anna has 12 pears. She buys 5 more pears."
    mapping = align.question_alignment(old, new)
    assert mapping == {"Tom": "Anna", "7": "12", "apples": "pears", "He": "She", "3": "5"}
    trace = "Tom has 7 apples. He buys 3 more, so 7 + 3 = 10."
    assert align.substitute(trace, mapping) == "Anna has 12 pears. She buys 5 more, so 12 + 5 = 10."
    assert align.question_alignment(old, "A different question.") == {}
    assert align.substitute("3 5", {"3": "5", "5": "8"}) == "5 8"  # one pass, no chaining


def test_recompute_redoes_sums_and_carries_new_results_forward():
    trace = "Anna has 12 pears. She buys 5 more, so 12 + 5 = 10.\nThe answer is 10."
    assert align.recompute(trace) == "Anna has 12 pears. She buys 5 more, so 12 + 5 = 17.\nThe answer is 17."
    chained = "2 * 60 = 420 minutes, 420 + 55 = 475. The answer is 475."
    assert align.recompute(chained) == "2 * 60 = 120 minutes, 120 + 55 = 175. The answer is 175."
    assert align.recompute("9 - 4 = 5, no change") == "9 - 4 = 5, no change"
    assert align.recompute("no sums, 3 apples") == "no sums, 3 apples"


def test_trace_drafter_drafts_long_only_from_a_full_trace_match():
    trace = list(range(100, 120))
    full = TraceDrafter([[trace]], max_ngram=3, short_k=2)
    ctx = DraftContext(tokens=[[1, 2, 100, 101, 102]], active=None)
    assert full.propose(ctx, 8).tokens[0, :8].tolist() == trace[3:11]  # 3-token match: up to k
    weak = TraceDrafter([[trace]], max_ngram=3, short_k=2)
    proposal = weak.propose(DraftContext(tokens=[[1, 2, 101, 102]], active=None), 8)  # 2-token match
    assert int(proposal.lengths[0]) == 2 and proposal.tokens[0, :2].tolist() == trace[3:5]
    with pytest.raises(ValueError, match="short_k=0"):
        TraceDrafter([[trace]], short_k=0)


def test_trace_drafter_with_long_trace_drafts_stays_lossless_on_tiny(tiny):
    prompts = _prompts()
    plain = engine.generate(tiny, prompts, max_new_tokens=24, eos_token_ids=[]).tokens
    drafter = TraceDrafter([[plain[0]], [plain[1][3:]], []], max_ngram=3, short_k=2)
    out = spec_decode.generate(tiny, prompts, drafter, k=8, max_new_tokens=24, eos_token_ids=[])
    assert out.tokens == plain and max(out.stats.step_k) <= 8


def test_split_steps_cuts_after_step_ends():
    assert align.split_steps([1, 2, 3, 4, 5], ["a", ".", "b", "\n", "c"]) == [[1, 2], [3, 4], [5]]
    with pytest.raises(ValueError, match="one text per token"):
        align.split_steps([1, 2], ["a"])


def test_retrieval_ranks_by_similarity_and_applies_threshold():
    cache = TraceCache()
    assert cache.retrieve(token_ngrams([1, 2, 3]), None, method="ngram") == ([], None)
    for tokens in ([1, 2, 3, 4], [7, 8, 9], [1, 2, 3, 9]):
        embedding = torch.nn.functional.normalize(torch.tensor(tokens[:3]).float(), dim=0)
        cache.add(Entry(None, token_ngrams(tokens), embedding, tokens, ""))
    hits, best = cache.retrieve(token_ngrams([1, 2, 3, 4]), None, method="ngram", top=2, threshold=0.1)
    assert [h.entry.trace_tokens for h in hits] == [[1, 2, 3, 4], [1, 2, 3, 9]] and best.similarity == 1.0
    hits, _ = cache.retrieve(token_ngrams([7, 8, 9]), None, method="ngram", threshold=0.99)
    assert [h.entry.trace_tokens for h in hits] == [[7, 8, 9]]
    emb = torch.nn.functional.normalize(torch.tensor([1.0, 2.0, 3.0]), dim=0)
    hits, best = cache.retrieve(frozenset(), emb, method="embedding")
    assert 0 <= best.similarity <= 1 and math.isclose(best.similarity, 1.0, abs_tol=1e-6)
    assert jaccard(frozenset(), frozenset()) == 0.0


def test_stream_is_seeded_interleaved_and_answers_compute():
    a, b = families.make_stream(40, seed=0), families.make_stream(40, seed=0)
    assert a == b and len({p.family for p in a}) == len(families.FAMILIES)
    assert a != families.make_stream(40, seed=1)
    for p in a:
        assert p.answer == p.values[-1] and len(set(p.values)) == len(p.values)
    two = [p for p in a if p.family == "two_step"][0]
    x, y, z = two.values[:3]
    assert two.answer == x + y - z and f"{x} " in two.question
    one = [p for p in a if p.family == "one_step"]
    assert one and all(p.answer == p.values[0] + p.values[1] and max(p.values[:2]) <= 20 for p in one)
    shipped = families.load_stream(30)
    assert shipped == families.make_stream(240, seed=0)[:30]  # the data file is the seeded stream


@pytest.mark.parametrize("call, match", [
    (lambda: families.check_families([]), r"families=\[\] is empty; allowed"),
    (lambda: families.check_families(["algebra"]), r"unknown \['algebra'\]; allowed"),
    (lambda: check_threshold(1.5), r"similarity_threshold=1.5 must be a number in \[0, 1\]"),
    (lambda: check_threshold(-0.1, name="step_thresholds"), r"step_thresholds=-0.1"),
    (lambda: check_method("bm25"), r"retrieval='bm25' is not a retrieval method; allowed: \['ngram', 'embedding'\]"),
    (lambda: summary.check_warmup(5, 5), r"n_queries=5 is not longer than the cache warm-up warmup=5; allowed"),
    (lambda: families.load_stream(10_000), r"n_queries=10000 must be between 1 and"),
    (lambda: methods.Setup(None, [], max_new_tokens=8, trace_draft_k=99), r"trace_draft_k=99 must be an int in \[1,"),
    (lambda: methods.Setup(None, [], max_new_tokens=8, similarity_threshold=2), r"similarity_threshold=2 must be"),
    (lambda: methods.plan([], [0.5]), r"retrieval=\[\] is empty; allowed"),
    (lambda: methods.plan(["bm25"], [0.5]), r"retrieval='bm25' is not a retrieval method"),
])
def test_bad_input_names_parameter_value_and_allowed(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_load_stream_rejects_an_empty_family(tmp_path):
    path = families.save_stream(families.make_stream(6, families=["two_step"]), tmp_path / "s.jsonl")
    with pytest.raises(ValueError, match=r"\['running_total'\] have no problems .* \(an empty family\)"):
        families.load_stream(3, families=["two_step", "running_total"], path=path)


def test_amortization_is_paired_against_the_cold_start_and_best_token_cut():
    # trace drafting's cold start is prompt lookup (not plain): the ratio divides by prompt_ngram's forwards
    rows = [{"method": m, "kind": m, "batch_size": 1, "query": q, "forwards": f}
            for q in range(4) for m, f in (("plain", 10), ("prompt_ngram", 6), ("trace_draft", [6, 5, 3, 2][q]))]
    curve = summary.amortization(rows, "trace_draft", 1, window=2)
    assert [c["cold_forwards"] for c in curve] == [6, 6, 6, 6]
    assert [c["window_cost"] for c in curve] == pytest.approx([1.0, 11 / 12, 8 / 12, 5 / 12])
    assert summary.amortization_ratio(curve, 4) == pytest.approx(5 / 12)
    assert summary.amortization_ratio(curve, 5) is None and summary.amortization_ratio(curve, 0) is None
    assert summary.cold_method("step_reuse") == "plain" and summary.cold_method("trace_draft_subst") == "prompt_ngram"
    assert summary.amortization(rows, "missing", 1) == []
    kept = [{"method": "trace_draft", "batch_size": 1, "change_ci_low": 0.0},
            {"method": "lossy", "batch_size": 1, "change_ci_low": -0.5}]
    assert summary.best_amortization({"trace_draft": 0.4, "lossy": 0.1, "none": None}, kept) == ("trace_draft", 0.4)
    table = [{"batch_size": 1, "kind": "a", "method": "a", "target_token_cut": 3.0, "change_ci_low": -0.1},
             {"batch_size": 1, "kind": "b", "method": "b", "target_token_cut": 2.0, "change_ci_low": 0.0}]
    assert summary.best_token_cut(table)["method"] == "b"


@pytest.mark.parametrize("threshold", [1.0, 0.3, 0.0])
def test_step_reuse_drafts_between_steps_change_no_token_and_save_forwards_on_tiny(tiny, threshold):
    prompts = _prompts()
    plain = engine.generate(tiny, prompts, max_new_tokens=30, eos_token_ids=[]).tokens
    other = engine.generate(tiny, [p[::-1] for p in prompts], max_new_tokens=30, eos_token_ids=[]).tokens
    # step proposals from another query's output (mostly rejected or taken lossily); drafts from the row's own
    # plain output (a perfect trace), a shuffled one and none
    steps = [align.split_steps(t, [_piece(x) for x in t]) for t in other]
    refs = [[plain[0]], [plain[1][::-1]], []]
    bare, bare_stats = step_reuse.generate(tiny, prompts, steps, _piece, threshold=threshold, max_new_tokens=30,
                                           eos_token_ids=[])
    drafted, stats = step_reuse.generate(tiny, prompts, steps, _piece, threshold=threshold, max_new_tokens=30,
                                         eos_token_ids=[], references=refs, draft_k=6)
    assert drafted == bare  # a lossless draft keeps only the target's own choices and never skips a step end
    assert stats.accepted_steps == bare_stats.accepted_steps and stats.proposed == bare_stats.proposed
    assert all(f <= g for f, g in zip(stats.forwards, bare_stats.forwards))
    assert stats.forwards[2] == bare_stats.forwards[2]  # no references: plain steps between step proposals
    if threshold == 1.0:
        assert drafted == plain and stats.forwards[0] < bare_stats.forwards[0]
    assert all(len(drafted[b]) <= stats.forwards[b] + stats.reused_tokens[b] <= len(drafted[b]) + 1 for b in range(3))


class _ByteTokenizer:
    """Bytes as token ids (the tiny model's vocab is 256): enough of a tokenizer for `methods.Setup`."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=list(text.encode("utf-8")))

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content'][-60:]}\n" for m in messages) + "<assistant>"


def test_interleaved_serving_with_a_shared_prefill_keeps_every_output(tiny):
    lm = dataclasses.replace(tiny, tokenizer=_ByteTokenizer())
    stream = families.make_stream(5, families=["one_step"])
    setup = methods.Setup(lm, stream, max_new_tokens=10, similarity_threshold=0.0)
    plan = methods.plan(["ngram"], [1.0, 0.2])
    queries, batches = methods.serve_all(setup, plan, [1, 2], ["trace_draft_subst", "shared_prefix"])
    by = {(r["method"], r["batch_size"], r["query"]): r["tokens"] for r in queries}
    for (label, batch, q), tokens in by.items():
        if next(m for m in plan if m.label == label).lossless:
            assert tokens == by[("plain", batch, q)], (label, batch, q)
    assert {r["method"] for r in queries if r["batch_size"] == 2} == {"plain", "trace_draft_subst[ngram]",
                                                                       "shared_prefix"}
    nearest = {r["query"]: r for r in methods.nearest_rows(setup) if r["method"] == "nearest[ngram]"}
    served = [r for r in queries if r["method"] == "trace_draft_subst[ngram]" and r["batch_size"] == 1]
    for r in served:  # retrieval without serving sees the similarities the served method saw
        near = nearest[r["query"]]
        assert r["neighbour_family"] == near["neighbour_family"]
        assert (math.isnan(r["similarity"]) and math.isnan(near["similarity"])) or r["similarity"] == near["similarity"]
    for method in [m for m in plan if m.kind in ("trace_draft_subst", "shared_prefix", "step_reuse")]:
        # one method alone, prefilling by itself, writes exactly what it wrote interleaved
        alone, _ = methods.serve(setup, method, batch_size=1)
        assert [r["tokens"] for r in alone] == [by[(method.label, 1, q)] for q in range(len(stream))]


def test_shared_prefix_check_equals_decoding_and_finds_the_first_disagreement(tiny):
    from decodelab.reuse import shared

    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, 256, (12,), generator=g).tolist()
    prompts = [prefix + torch.randint(1, 256, (n,), generator=g).tolist() for n in (3, 7)]
    cache = shared.prefix_cache(tiny, prefix)
    decoded = shared.serve_batch(tiny, prompts, prefix, cache, max_new_tokens=12, eos=[])
    plain = engine.generate(tiny, prompts, max_new_tokens=12, eos_token_ids=[]).tokens
    assert decoded["tokens"] == plain and decoded["agrees"] is None
    checked = shared.serve_batch(tiny, prompts, prefix, cache, max_new_tokens=12, eos=[], references=plain)
    assert checked["tokens"] == plain and checked["agrees"] == [True, True] and math.isnan(checked["decode_s"])
    wrong = [plain[0][:5] + [(plain[0][5] + 1) % 256] + plain[0][6:], plain[1][:1]]
    out = shared.serve_batch(tiny, prompts, prefix, cache, max_new_tokens=12, eos=[], references=wrong)
    assert out["agrees"] == [False, True] and out["tokens"] == [plain[0][:6], plain[1][:1]]


def test_plan_serves_the_raw_trace_draft_ablation_only_when_asked():
    kinds = lambda **kw: [m.kind for m in methods.plan(["ngram"], [0.5], **kw)]  # noqa: E731
    assert "trace_draft" in kinds() and "trace_draft" not in kinds(raw_trace_draft=False)
    assert "trace_draft_subst" in kinds(raw_trace_draft=False)
    assert "exemplar" in kinds() and "exemplar" not in kinds(exemplar=False)


def test_left_out_names_what_a_plan_does_not_serve():
    full = methods.left_out(["embedding", "ngram"], [0.25, 0.5], raw_trace_draft=True, exemplar=True)
    assert full == []
    cpu = methods.left_out(["embedding"], [0.5], raw_trace_draft=False, exemplar=False)
    assert len(cpu) == 4 and "trace_draft_subst[ngram]" in cpu and "trace-as-exemplar" in cpu
    served = {m.label for m in methods.plan(["embedding"], [0.5], raw_trace_draft=False, exemplar=False)}
    assert "trace_draft_subst[ngram]" not in served and not any(s.startswith("exemplar") for s in served)
