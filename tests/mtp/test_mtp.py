"""Multi-token prediction: exact n=1 reduction, sequential vs joint backward, training, retrofit, drafting."""
import pytest
import torch
import torch.nn.functional as F

from decodelab.core import engine
from decodelab.core.models import tiny_model
from decodelab.core.transformer import Transformer
from decodelab.mtp import checkpoint as mtp_checkpoint
from decodelab.mtp import cost as mtp_cost
from decodelab.mtp import drafter as mtp_drafter
from decodelab.mtp import experiment as mtp_experiment
from decodelab.mtp import model as mtp
from decodelab.mtp import self_speculation
from decodelab.mtp import train as mtp_train

VOCAB = 97


def small(style="gloeckle", n_heads=2, seed=0, n_layers=2, peaked=False):
    model = mtp.build_model(vocab_size=VOCAB, d_model=32, n_layers=n_layers, n_heads=n_heads, style=style,
                                  match_params=False, seed=seed)
    if peaked:  # sharper distributions so greedy decoding is not one repeated token
        with torch.no_grad():
            model.trunk.model.embed_tokens.weight.mul_(20.0)
    return model


def batch(rows=3, length=16, seed=0):
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def patterned_blocks(n_rows=64, length=24, seed=0):
    """Learnable data: each row counts up by a row-specific step (1 or 2) from a random start, mod VOCAB."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n_rows, 1), generator=g)
    steps = torch.randint(1, 3, (n_rows, 1), generator=g)
    return (starts + steps * torch.arange(length)) % VOCAB


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("style", mtp.STYLES)
def test_one_head_equals_next_token_model_loss_and_grads_exactly(style):
    model = small(style, n_heads=1)
    tokens = batch()
    out = mtp.mtp_loss(model, tokens, backward="sequential")
    ours = grads(model)
    model.zero_grad(set_to_none=True)
    logits = model.trunk(input_ids=tokens).logits
    reference = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    reference.backward()
    theirs = grads(model)
    assert out["loss"] == reference.item()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


@pytest.mark.parametrize("style,n_heads", [("gloeckle", 4), ("deepseek", 3)])
def test_sequential_backward_grads_allclose_joint_backward(style, n_heads):
    model = small(style, n_heads=n_heads)
    tokens = batch()
    sequential = mtp.mtp_loss(model, tokens, backward="sequential")
    g_seq = grads(model)
    model.zero_grad(set_to_none=True)
    joint = mtp.mtp_loss(model, tokens, backward="joint")
    g_joint = grads(model)
    assert sequential["head_losses"] == pytest.approx(joint["head_losses"], abs=1e-6)
    assert set(g_seq) == set(g_joint) and len(g_seq) == len(list(model.parameters()))
    for name in g_joint:
        torch.testing.assert_close(g_seq[name], g_joint[name], rtol=1e-5, atol=1e-6)


def test_training_loss_decreases():
    model = small("gloeckle", n_heads=2)
    result = mtp_train.train(model, patterned_blocks(),
                             mtp_train.TrainConfig(steps=20, batch_size=8, lr=1e-2, warmup=2))
    assert sum(result.losses[-3:]) / 3 < 0.7 * sum(result.losses[:3]) / 3


def test_fixed_seed_reproduces_loss_curve():
    cfg = mtp_train.TrainConfig(steps=6, batch_size=4, lr=5e-3, warmup=2, seed=3)
    curves = [mtp_train.train(small("deepseek", n_heads=2, seed=1), patterned_blocks(), cfg).losses for _ in range(2)]
    other = mtp_train.train(small("deepseek", n_heads=2, seed=1), patterned_blocks(),
                            mtp_train.TrainConfig(steps=6, batch_size=4, lr=5e-3, warmup=2, seed=4)).losses
    assert curves[0] == curves[1]
    assert curves[0] != other


def test_training_leaves_global_rng_untouched():
    state = torch.random.get_rng_state()
    mtp_train.train(small(), patterned_blocks(), mtp_train.TrainConfig(steps=2, batch_size=4))
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize("style", mtp.STYLES)
def test_retrofit_leaves_frozen_weights_bit_identical(style):
    frozen = tiny_model(seed=0, vocab_size=VOCAB).hf_model
    before = {name: t.clone() for name, t in frozen.state_dict().items()}
    model = mtp.MTPModel(frozen, mtp.MTPConfig(style=style, n_heads=2), frozen_trunk=True)
    heads_before = [p.clone() for p in model.heads.parameters()]
    mtp_train.train(model, patterned_blocks(), mtp_train.TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup=1))
    after = frozen.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert any(not torch.equal(a, b) for a, b in zip(heads_before, model.heads.parameters()))


def test_retrofit_with_precomputed_states_matches_running_the_trunk():
    frozen = tiny_model(seed=0, vocab_size=VOCAB).hf_model
    model = mtp.MTPModel(frozen, mtp.MTPConfig(n_heads=3), frozen_trunk=True)
    tokens = batch()
    direct = mtp.mtp_loss(model, tokens, backward="sequential")
    g_direct = grads(model)
    model.zero_grad(set_to_none=True)
    cached = mtp.mtp_loss(model, tokens, backward="sequential", hidden=mtp_train.trunk_hidden(model, tokens))
    assert direct["head_losses"][1:] == cached["head_losses"][1:]
    assert all(torch.equal(g_direct[n], g) for n, g in grads(model).items())


@pytest.mark.parametrize("style,n_heads", [("gloeckle", 3), ("deepseek", 2)])
def test_drafter_cached_head_states_equal_training_path(style, n_heads):
    model = small(style, n_heads=n_heads)
    tokens = batch(rows=2, length=12)
    hidden = model.hidden(tokens)
    following = torch.roll(tokens, -1, dims=1)
    drafter = mtp_drafter.MTPDrafter(model)
    drafter.begin(tokens.tolist(), max_len=32)
    n = 11  # feed positions 0..10 in two ragged chunks (every state's next token is known)
    drafter.observe(hidden[:, :5], torch.tensor([5, 5]), following[:, :5])
    drafter.observe(hidden[:, 5:n], torch.tensor([n - 5, n - 5]), following[:, 5:n])
    with torch.no_grad():
        reference = model.head_state(2, hidden, tokens)[:, n - 1]
    torch.testing.assert_close(drafter._last[0], reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style,n_heads", [("gloeckle", 4), ("deepseek", 2)])
def test_self_speculative_greedy_equals_plain_greedy(style, n_heads):
    model = small(style, n_heads=n_heads, peaked=True)
    prompts = [[1, 5, 7, 9, 3], [4, 4, 2], [8] * 9, [11]]
    plain = engine.generate(Transformer.from_hf(model.trunk), prompts, max_new_tokens=25, eos_token_ids=[])
    spec = self_speculation.self_speculative_generate(model, prompts, max_new_tokens=25)
    assert spec.tokens == plain.tokens
    assert spec.stats.tau >= 1.0


def test_self_speculative_stops_at_eos_like_plain_greedy():
    model = small("gloeckle", n_heads=3, peaked=True)
    prompts = [[1, 5, 7, 9, 3], [4, 4, 2]]
    plain = engine.generate(Transformer.from_hf(model.trunk), prompts, max_new_tokens=30, eos_token_ids=[])
    eos = plain.tokens[0][6]
    plain = engine.generate(Transformer.from_hf(model.trunk), prompts, max_new_tokens=30, eos_token_ids=[eos])
    spec = self_speculation.self_speculative_generate(model, prompts, max_new_tokens=30, eos_token_ids=[eos])
    assert spec.tokens == plain.tokens


def test_mtp_drafter_in_speculative_loop_keeps_greedy_output():
    from decodelab.speculation import decode as speculative

    model = small("gloeckle", n_heads=3, peaked=True)
    prompts = [[1, 5, 7, 9, 3], [4, 4, 2]]
    tr = Transformer.from_hf(model.trunk)
    plain = engine.generate(tr, prompts, max_new_tokens=20, eos_token_ids=[])
    spec = speculative.generate(tr, prompts, mtp_drafter.MTPDrafter(model), k=3, max_new_tokens=20, eos_token_ids=[])
    assert spec.tokens == plain.tokens


def test_drafter_reads_new_hidden_from_context_like_feed():
    from decodelab.speculation.drafters import DraftContext

    model = small("gloeckle", n_heads=3)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    tokens, lengths = engine.pad_prompts(prompts, torch.device("cpu"))
    with torch.no_grad():
        hidden = model.hidden(tokens)
    pending = [[10], [11]]  # the target's next choices, not yet cached
    fed = mtp_drafter.MTPDrafter(model)
    fed.begin(prompts, max_len=32)
    following = torch.tensor([[2, 3, 4, 5, 6, 10], [8, 9, 11, 0, 0, 0]])
    fed.observe(hidden, lengths, following)
    via_ctx = mtp_drafter.MTPDrafter(model)
    via_ctx.begin(prompts, max_len=32)
    tokens = [p + q for p, q in zip(prompts, pending)]
    ctx = DraftContext(tokens=tokens, new_hidden=hidden, new_hidden_lengths=lengths)  # what speculative.generate passes
    assert torch.equal(fed.propose(DraftContext(tokens=tokens), 2).tokens, via_ctx.propose(ctx, 2).tokens)


@pytest.mark.parametrize("retrofit", [False, True])
def test_checkpoint_round_trip_gives_identical_proposals(tmp_path, retrofit):
    from decodelab.speculation.drafters import DraftContext

    if retrofit:
        frozen = tiny_model(seed=0, vocab_size=VOCAB).hf_model
        model = mtp.MTPModel(frozen, mtp.MTPConfig(n_heads=3), frozen_trunk=True)
    else:
        model = small("gloeckle", n_heads=3)
    mtp_train.train(model, patterned_blocks(), mtp_train.TrainConfig(steps=2, batch_size=4))
    mtp_checkpoint.save_checkpoint(model, tmp_path, retrofit_model="tiny" if retrofit else None)
    drafter = mtp_drafter.load_mtp_drafter(tmp_path, trunk=frozen if retrofit else None)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    outputs = []
    for d in (mtp_drafter.MTPDrafter(model), drafter):
        d.begin(prompts, max_len=32)
        tokens, lengths = engine.pad_prompts(prompts, torch.device("cpu"))
        with torch.no_grad():
            hidden = d.model.hidden(tokens)
        d.observe(hidden, lengths, torch.roll(tokens, -1, dims=1))
        outputs.append(d.propose(DraftContext(tokens=prompts), 2).tokens)
    assert torch.equal(outputs[0], outputs[1])


def test_invalid_parameters_name_the_value():
    with pytest.raises(ValueError, match="mtp_style='medusa'"):
        mtp.MTPConfig(style="medusa")
    with pytest.raises(ValueError, match="n_heads=0"):
        mtp.MTPConfig(n_heads=0)
    with pytest.raises(ValueError, match="n_layers=2"):
        mtp.trunk_layers(2, 4)
    with pytest.raises(ValueError, match="backward='both'"):
        mtp.mtp_loss(small(), batch(), backward="both")
    with pytest.raises(ValueError, match="n_heads=3"):
        mtp_drafter.MTPDrafter(small("deepseek", n_heads=3))


def test_sequential_backward_peak_memory_below_joint():
    # Large vocabulary, tiny width: the (B, T, V) logits dominate, so joint keeps n of them alive.
    model = mtp.build_model(vocab_size=4096, d_model=32, n_layers=1, n_heads=4, match_params=False)
    tokens = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    seq = mtp_cost.measure_step(model, tokens, backward="sequential", repeats=1)
    joint = mtp_cost.measure_step(model, tokens, backward="joint", repeats=1)
    logits_bytes = 2 * 64 * 4096 * 4
    assert joint["peak_bytes"] - seq["peak_bytes"] > 2 * logits_bytes


@pytest.mark.slow
def test_retrofit_on_embedded_model_leaves_it_bit_identical(smol):
    frozen = smol.hf_model
    before = {name: t.clone() for name, t in frozen.state_dict().items()}
    model = mtp.MTPModel(frozen, mtp.MTPConfig(n_heads=2), frozen_trunk=True)
    tokens = torch.tensor([smol.tokenizer("def add(a, b):\n    return a + b\n", add_special_tokens=False).input_ids])
    try:
        mtp_train.train(model, tokens.repeat(2, 1), mtp_train.TrainConfig(steps=1, batch_size=2))
        assert all(torch.equal(before[name], t) for name, t in frozen.state_dict().items())
    finally:
        frozen.requires_grad_(True)  # the fixture is shared by other tests


@pytest.mark.parametrize("style", mtp.STYLES)
def test_identity_init_retrofit_head_starts_as_the_models_own_next_token_guess(style):
    frozen = tiny_model(seed=0, vocab_size=VOCAB).hf_model
    model = mtp.MTPModel(frozen, mtp.MTPConfig(style=style, n_heads=2), frozen_trunk=True)
    tokens = batch()
    with torch.no_grad():
        main, second = model.head_logits(tokens)
    assert torch.equal(main[:, : second.shape[1]].argmax(-1), second.argmax(-1))


def test_experiment_grid_sweeps_gloeckle_and_compares_styles_at_style_heads():
    grid = mtp_experiment.experiment_grid([1, 2, 4], ["gloeckle", "deepseek"], 2)
    assert grid == [("gloeckle", 1), ("gloeckle", 2), ("gloeckle", 4), ("deepseek", 2)]
    with pytest.raises(ValueError, match="mtp_style='eagle'"):
        mtp_experiment.experiment_grid([1], ["eagle"])


@pytest.mark.slow
def test_data_parallel_training_matches_one_process(tmp_path, monkeypatch):
    """torchrun with 2 CPU processes (what `accelerate launch` sets up) gives the single-process curve."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    args = ["--n-heads", "2", "--d-model", "32", "--n-layers", "2", "--seq-len", "32", "--batch-size", "4",
            "--steps", "3", "--vocab-size", "320", "--corpus-bytes", "600000", "--val-blocks", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DECODELAB_CACHE": str(tmp_path / "cache")}
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    monkeypatch.setenv("DECODELAB_CACHE", env["DECODELAB_CACHE"])
    mtp_train.main(["--out", str(tmp_path / "one"), *args])
    subprocess.run([torchrun, "--nproc_per_node", "2", "-m", "decodelab.mtp.train",
                    "--out", str(tmp_path / "two"), *args],
                   check=True, env=env, capture_output=True)
    one, two = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("one", "two"))
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["curve"] == pytest.approx(one["curve"], rel=1e-5)
    assert two["eval"]["head_loss"] == pytest.approx(one["eval"]["head_loss"], rel=1e-4)


def test_drafter_without_hidden_states_names_what_the_context_lacked():
    from decodelab.speculation.drafters import DraftContext

    drafter = mtp_drafter.MTPDrafter(small("gloeckle", n_heads=2))
    drafter.begin([[1, 2]], max_len=8)
    with pytest.raises(ValueError, match="new_hidden or ctx.last_hidden"):
        drafter.propose(DraftContext(tokens=[[1, 2, 3]]), 1)


@pytest.mark.parametrize("style", mtp.STYLES)
def test_one_head_loss_diff_is_exactly_zero(style):
    assert mtp_cost.one_head_loss_diff(small(style, n_heads=1), batch()) == 0.0


def test_one_head_loss_diff_refuses_a_multi_head_model():
    with pytest.raises(ValueError, match="n_heads=2"):
        mtp_cost.one_head_loss_diff(small(n_heads=2), batch())


def test_grad_check_is_float32_noise_for_a_correct_backward():
    assert 0.0 <= mtp_cost.grad_check(small("gloeckle", n_heads=3), batch()) <= 1e-5


def test_grad_check_reports_the_difference_when_the_sequential_backward_is_broken(monkeypatch):
    real = mtp_cost.mtp_loss

    def broken(model, tokens, *, backward="sequential", hidden=None):  # sequential grads 1.5x too large
        out = real(model, tokens, backward=backward, hidden=hidden)
        if backward == "sequential":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.5)
        return out

    monkeypatch.setattr(mtp_cost, "mtp_loss", broken)
    model = small("gloeckle", n_heads=3)
    assert mtp_cost.grad_check(model, batch()) > 1e-3


def test_training_cost_reports_fastest_interleaved_steps_and_exactness_checks():
    cost = mtp_cost.training_cost(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=2,
                                  repeats=2)
    assert [(r["n_heads"], r["backward"]) for r in cost["rows"]] == [(1, "sequential"), (2, "sequential"), (2, "joint")]
    assert all(r["step_s"] <= r["step_s_max"] and r["repeats"] == 2 for r in cost["rows"])
    base, seq, joint = cost["rows"]
    assert cost["step_time_ratio"] == seq["step_s"] / base["step_s"]
    assert cost["peak_mem_ratio_joint"] == joint["total_peak_bytes"] / base["total_peak_bytes"]
    assert cost["step_peak_mem_ratio_joint"] == joint["peak_bytes"] / base["peak_bytes"]
    assert cost["one_head_loss_abs_diff"] == 0.0
    assert cost["grad_check_max_abs_diff"] <= 1e-5
    assert cost["cost_measured_at"]["n_heads"] == 2


def test_self_spec_benchmark_counts_identical_rows_and_keeps_fastest_runs():
    model = small("gloeckle", n_heads=3, peaked=True)
    rows = mtp_cost.self_spec_benchmark(model, [[1, 5, 7, 9, 3], [4, 4, 2]], [1, 3], max_new_tokens=8, repeats=2)
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["greedy_match"] is True and r["rows_identical"] == r["batch"]
        assert r["speedup"] == r["plain_s"] / r["spec_s"]
        assert r["plain_s"] <= r["plain_s_max"] and r["spec_s"] <= r["spec_s_max"]
        assert r["plain_tokens_per_s"] == r["batch"] * 8 / r["plain_s"]
