"""The training-cost measurement: what one step is, what its peak memory counts, the FLOP model, Gloeckle's order."""
import pytest
import torch

from decodelab.mtp import cost as mtp_cost
from decodelab.mtp import findings as mtp_findings
from decodelab.mtp import model as mtp
from decodelab.mtp.train import TrainConfig, make_optimizer

VOCAB = 97


def small(n_heads=4, n_layers=2, d_model=32):
    return mtp.build_model(vocab_size=VOCAB, d_model=d_model, n_layers=n_layers, n_heads=n_heads, match_params=False)


def batch(rows=2, length=16):
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))


def test_step_peak_bytes_does_not_charge_bytes_an_earlier_trace_left_in_the_counter():
    kept = []
    mtp_cost.step_peak_bytes(lambda: kept.append(torch.ones(1 << 20)), "cpu")  # 4 MiB allocated in a trace
    kept.clear()  # ... and freed outside one: the profiler's counter keeps its bytes
    peak = mtp_cost.step_peak_bytes(lambda: torch.ones(1 << 18).sum(), "cpu")  # a 1 MiB block
    assert (1 << 20) <= peak < (1 << 20) + (64 << 10)


def test_train_step_counts_the_gradient_buffers_it_allocates_and_leaves_none():
    model = small().train()
    optimizer = make_optimizer(model.trainable_parameters(), TrainConfig())
    step = mtp_cost.train_step(model, batch(), "sequential", optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    step()  # warm-up: creates the AdamW moments
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # the optimizer stepped
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mtp_cost.step_peak_bytes(step, "cpu") >= param_bytes  # every gradient is alive after the backward
    state = mtp_cost.state_bytes(model, optimizer)
    assert 3 * param_bytes <= state <= 3 * param_bytes + 8 * len(list(model.parameters()))  # + exp_avg, exp_avg_sq


def test_step_flops_counts_each_layer_projection_and_the_unembedding_of_the_real_model():
    model = small(n_heads=4, n_layers=3, d_model=32)
    config, rows, length = model.trunk.config, 2, 16
    flops = mtp_cost.step_flops(config, 4, rows, length)
    layer = model.trunk.model.layers[0]
    projection_params = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    attention = 3 * 4 * config.hidden_size * rows * length * (length + 1) // 2  # fwd + bwd, scores and values
    assert flops["layer"] == 6 * rows * length * projection_params + attention
    assert flops["unembed"] == 6 * rows * length * model.trunk.lm_head.weight.numel()
    assert flops["next_token"] == 3 * flops["layer"] + flops["unembed"]
    assert flops["mtp"] - flops["next_token"] == 3 * (flops["layer"] + flops["unembed"])
    assert mtp_cost.step_flops(config, 1, rows, length)["ratio"] == 1.0


def test_sequential_backward_runs_the_trunk_forward_and_backward_once_and_each_head_once():
    model = small(n_heads=4).train()
    calls = {"trunk_forward": 0, "trunk_backward": 0, "head_forward": 0}
    model.trunk.model.register_forward_hook(lambda *_: calls.__setitem__("trunk_forward", calls["trunk_forward"] + 1))
    model.trunk.model.layers[0].register_full_backward_hook(
        lambda *_: calls.__setitem__("trunk_backward", calls["trunk_backward"] + 1))
    for head in model.heads:  # a head layer runs functionally (`layer_forward`); its MLP is called as a module
        head.mlp.register_forward_hook(lambda *_: calls.__setitem__("head_forward", calls["head_forward"] + 1))
    mtp.mtp_loss(model, batch(), backward="sequential")
    assert calls == {"trunk_forward": 1, "trunk_backward": 1, "head_forward": 3}


def test_training_cost_peak_memory_is_the_whole_training_state_at_the_step_peak():
    cost = mtp_cost.training_cost(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=3, seq_len=16, batch_size=2,
                                  repeats=1)
    base, seq, joint = cost["rows"]
    for row in cost["rows"]:
        assert row["total_peak_bytes"] == row["state_bytes"] + row["peak_bytes"]
        assert row["peak_bytes"] >= 4 * row["params"]  # the gradient buffers the step allocates
    assert seq["state_bytes"] == joint["state_bytes"] > base["state_bytes"]
    assert cost["peak_mem_ratio"] == seq["total_peak_bytes"] / base["total_peak_bytes"]
    assert cost["step_peak_mem_ratio"] == seq["peak_bytes"] / base["peak_bytes"]
    assert cost["flop_ratio"] == mtp_cost.step_flops(small(3).trunk.config, 3, 2, 16)["ratio"]
    lines = mtp_findings.cost_lines(cost)
    assert f"{cost['step_time_ratio']:.2f}x the next-token step" in lines[1]
    assert f"Matmul FLOPs predict {cost['flop_ratio']:.2f}x" in lines[1]
    assert f"{base['params']:,} parameters" in lines[0] and "2-layer trunk, d_model=32" in lines[0]
    assert f"{cost['peak_mem_ratio']:.2f}x" in lines[2]


@pytest.mark.parametrize("gap, word", [(1.5, "above"), (0.8, "below")])
def test_cost_lines_say_which_side_of_the_flop_prediction_the_measurement_falls(gap, word):
    row = {"params": 10, "step_s": 0.1, "step_s_max": 0.2, "state_bytes": 2**20, "total_peak_bytes": 2**21}
    cost = {"cost_measured_at": {"n_layers": 8, "d_model": 64, "vocab_size": 100, "n_heads": 4, "batch_size": 2,
                                 "seq_len": 8, "device": "cpu", "repeats": 3},
            "rows": [row, row, row], "flops": {"layer": 4.0, "unembed": 1.0}, "flop_ratio": 1.2,
            "step_time_ratio": 1.2 * gap, "step_time_ratio_joint": 2.0, "peak_mem_ratio": 1.1,
            "step_peak_mem_ratio": 1.05, "peak_mem_ratio_joint": 1.3}
    assert f"{abs(gap - 1):.0%} {word} the prediction" in mtp_findings.cost_lines(cost)[1]
    assert "0.25 of a layer's FLOPs" in mtp_findings.cost_lines(cost)[1]
