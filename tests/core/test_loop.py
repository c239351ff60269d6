"""The cache seam (one plan per forward, truncate never grows a row) and the one token loop's per-row state
(forced-token queue, rows that finish stop producing)."""
import pytest
import torch

from decodelab.core import engine
from decodelab.core import kv_cache as kv
from decodelab.core.shared_prefix import SharedPrefixKVCache

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [200]]


@pytest.fixture
def counted(monkeypatch):
    """Counts of begin_forward calls and grouped-mask builds (every cache builds its mask through kv_cache)."""
    counts = {"plans": 0, "masks": 0}
    build = kv.grouped_mask

    def counting_mask(visible, group):
        counts["masks"] += 1
        return build(visible, group)

    monkeypatch.setattr(kv, "grouped_mask", counting_mask)
    for cls in (kv.KVCache, SharedPrefixKVCache):
        plan = cls.begin_forward

        def counting_plan(self, positions, group=1, _plan=plan):
            counts["plans"] += 1
            return _plan(self, positions, group)

        monkeypatch.setattr(cls, "begin_forward", counting_plan)
    return counts


def test_one_plan_and_one_gqa_mask_per_forward(tiny, counted):
    tr = tiny.transformer
    assert tr.n_layers > 1 and tr.n_heads > tr.n_kv_heads  # several layers share a grouped mask
    cache, _ = engine.prefill(tiny, PROMPTS, max_new_tokens=8)
    engine.decode_step(tiny, cache, torch.tensor([1, 2, 3, 4]))
    engine.verify_step(tiny, cache, torch.tensor([[1, 2, 3]] * 4))
    assert counted == {"plans": 3, "masks": 3}


def test_one_plan_per_forward_on_the_shared_prefix_cache(tiny, counted):
    prefix, _ = engine.prefill(tiny, PROMPTS[:2], max_new_tokens=0)
    cache = SharedPrefixKVCache.fork(prefix, [2, 3], max_new_tokens=4)
    before = dict(counted)
    engine.decode_step(tiny, cache, torch.zeros(5, dtype=torch.long))
    assert counted["plans"] - before["plans"] == 1 and counted["masks"] - before["masks"] == 1


def test_plan_is_returned_not_stashed(tiny):
    cache, _ = engine.prefill(tiny, PROMPTS, max_new_tokens=4)
    plan = cache.begin_forward(cache.positions(2), group=2)
    assert isinstance(plan, kv.ForwardPlan) and plan.span == int(cache.lengths.max()) + 2
    assert plan.grouped_mask(2).shape == (4, 1, 4, plan.span)
    assert plan.grouped_mask(2) is plan.grouped_mask(2)  # built once, shared by every layer
    assert not hasattr(cache, "_visible") and not hasattr(cache, "_span")
    assert isinstance(cache, kv.AttentionCache)


def test_truncate_refuses_to_grow_a_row(tiny):
    cache, _ = engine.prefill(tiny, PROMPTS, max_new_tokens=4)
    with pytest.raises(ValueError, match="only rolls rows back"):
        cache.truncate(cache.lengths + torch.tensor([0, 1, 0, 0]))
    cache.advance(torch.tensor([0, 1, 0, 0]))
    cache.truncate(cache.lengths - torch.tensor([0, 1, 0, 0]))
    assert cache.lengths.tolist() == [len(p) for p in PROMPTS]
    prefix, _ = engine.prefill(tiny, PROMPTS[:2], max_new_tokens=0)
    shared = SharedPrefixKVCache.fork(prefix, [1, 1], max_new_tokens=4)
    with pytest.raises(ValueError, match="only rolls rows back"):
        shared.truncate(shared.lengths + 1)


class ForcingPolicy(engine.SamplePolicy):
    """Greedy decoding that queues `forced` tokens for row 0 after its first pick; counts sampler draws."""

    def __init__(self, forced, stop_row=None, stop_after=None):
        super().__init__()
        self.forced, self.draws, self.stop_row, self.stop_after = forced, [], stop_row, stop_after

    def first(self, loop, logits):
        picks = loop.pick(logits).tolist()
        self.draws.append(len(picks))
        emitted = dict(zip(loop.rows, ([t] for t in picks)))
        if not loop.tokens[0]:
            loop.force(0, self.forced)
        return emitted

    def feed(self, loop):
        tokens, n_new = loop.pending_batch()
        return engine.Feed(tokens, mode="last", n_new=n_new)

    def accept(self, loop, logits, hidden):
        return self.first(loop, logits)

    def stopped(self, loop, row):
        return row == self.stop_row and len(loop.tokens[row]) >= self.stop_after


def run(tiny, policy, max_new_tokens, prompts=PROMPTS):
    stats = engine.DecodeStats(batch_size=len(prompts), prompt_tokens=sum(map(len, prompts)))
    return engine.run_loop(tiny, prompts, policy, max_new_tokens=max_new_tokens, stats=stats, eos_token_ids=[])


def test_forced_tokens_join_the_output_without_a_sampler_draw(tiny):
    plain = engine.generate(tiny, PROMPTS, max_new_tokens=12, eos_token_ids=[]).tokens
    policy = ForcingPolicy([42, 43, 44])
    loop = run(tiny, policy, 12)
    first = plain[0][0]
    assert loop.tokens[0][:4] == [first, 42, 43, 44]
    after = engine.generate(tiny, [PROMPTS[0] + [first, 42, 43, 44]], max_new_tokens=8, eos_token_ids=[]).tokens[0]
    assert loop.tokens[0][4:] == after  # the model continues after the forced tokens, fed in one forward
    assert loop.tokens[1:] == plain[1:]  # the other rows are untouched
    assert len(policy.draws) == 12 and len(loop.tokens[0]) == 12  # 3 of row 0's tokens were never drawn
    assert len(loop.forward_s) == 11


def test_forced_tokens_stop_at_max_new_tokens(tiny):
    loop = run(tiny, ForcingPolicy(list(range(50, 70))), 6)
    assert loop.tokens[0][1:] == [50, 51, 52, 53, 54] and loop.done[0]


def test_a_finished_row_stops_producing_while_the_others_go_on(tiny):
    plain = engine.generate(tiny, PROMPTS, max_new_tokens=10, eos_token_ids=[]).tokens
    loop = run(tiny, ForcingPolicy([], stop_row=1, stop_after=3), 10)
    assert loop.tokens[1] == plain[1][:3] and loop.finished[1]
    assert [loop.tokens[r] for r in (0, 2, 3)] == [plain[r] for r in (0, 2, 3)]
    assert loop.finished == [False, True, False, False] and all(loop.done)


def test_eos_ends_only_its_row_in_the_loop(tiny):
    plain = engine.generate(tiny, PROMPTS, max_new_tokens=10, eos_token_ids=[]).tokens
    eos = plain[2][1]
    result = engine.generate(tiny, PROMPTS, max_new_tokens=10, eos_token_ids=[eos])
    for full, cut, ended in zip(plain, result.tokens, result.finished):
        assert cut == (full[: full.index(eos) + 1] if eos in full else full) and ended == (eos in full)


def test_prefill_returns_hidden_states_on_request(tiny):
    cache, logits, hidden = engine.prefill(tiny, PROMPTS, max_new_tokens=2, return_hidden=True)
    _, reference = engine.prefill(tiny, PROMPTS, max_new_tokens=2)
    assert torch.equal(logits, reference) and hidden.shape[:2] == (4, max(map(len, PROMPTS)))
    lengths = torch.tensor([len(p) for p in PROMPTS])
    torch.testing.assert_close(tiny.transformer.lm_head(hidden[torch.arange(4), lengths - 1]), logits)


@pytest.mark.parametrize("bad", [0, -3, 1.5])
def test_every_decoder_validates_max_new_tokens_the_same_way(tiny, bad):
    from decodelab.speculation import decode as speculative

    for call in (lambda: engine.generate(tiny, PROMPTS, max_new_tokens=bad),
                 lambda: speculative.generate(tiny, PROMPTS, None, k=0, max_new_tokens=bad),
                 lambda: engine.validate_generation_args(PROMPTS, bad)):
        with pytest.raises(ValueError, match="max_new_tokens=.* must be an integer >= 1"):
            call()



def test_loop_runs_in_inference_mode_and_its_state_stays_usable_outside(tiny, monkeypatch):
    # The token loop runs under torch.inference_mode (less per-op bookkeeping than no_grad). What outlives it
    # must stay usable by ordinary code: a sampler's reused scratch buffers (written in place), a caller's
    # prefilled cache (decoded into, rolled back, decoded again to the same tokens).
    from decodelab.core.sampling import Sampler, SamplerConfig
    from decodelab.core.transformer import Transformer

    modes, forward = [], Transformer.forward
    monkeypatch.setattr(Transformer, "forward",
                        lambda self, *a, **k: modes.append(torch.is_inference_mode_enabled()) or forward(self, *a, **k))
    sampler = Sampler(SamplerConfig(temperature=0.8))
    engine.generate(tiny, [[1, 2, 3], [4, 5]], max_new_tokens=4, sampler=sampler, eos_token_ids=[],
                    generator=[torch.Generator().manual_seed(s) for s in range(2)])
    assert modes and all(modes) and not torch.is_inference_mode_enabled()
    logits = torch.randn(2, engine.as_transformer(tiny).vocab_size)
    sampler.sample(logits, [torch.Generator().manual_seed(s) for s in range(2)])  # its scratch, outside the loop
    cache, last = engine.prefill(engine.as_transformer(tiny), [[1, 2, 3]], max_new_tokens=4)
    start = cache.lengths.clone()
    first = engine.generate(tiny, [[1, 2, 3]], max_new_tokens=4, eos_token_ids=[], prefilled=(cache, last)).tokens
    cache.truncate(start)
    again = engine.generate(tiny, [[1, 2, 3]], max_new_tokens=4, eos_token_ids=[], prefilled=(cache, last)).tokens
    assert first == again
