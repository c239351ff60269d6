"""What MTP costs and buys in wall time and memory (notebook 03, sections 2 and 4).

- `measure_step` / `training_cost`: step time (fastest of interleaved repeats, slowest beside it) and peak
  memory of one training step as `decodelab.mtp.train.train` runs it (forward + backward + gradient clipping +
  AdamW step), next-token vs n heads (sequential and joint head backward), with `step_flops`'s matmul count
  beside the measured ratio (where the two agree, the model's compute, not per-op overhead, sets the cost).
  Peak memory: everything alive at the step's peak = parameters + optimizer state (`state_bytes`) + what the
  step allocates above them (`step_peak_bytes`: activations, logits, gradients, temporaries).
- `one_head_loss_diff` / `grad_check`: the exactness checks `training_cost` runs on the same batch.
- `self_spec_benchmark`: self-speculative vs plain greedy decoding of the trunk, on one wall clock.
Timers are `decodelab.common.timing`'s (host-synchronized; compared calls interleave).
"""
from __future__ import annotations

import torch

from decodelab.common.timing import PeakMemory, alternating_times, repeat_times
from decodelab.mtp.model import MTPModel, build_model, mtp_loss
from decodelab.mtp.train import TrainConfig, finish_step, make_optimizer


def step_peak_bytes(fn, device) -> int:
    """Peak bytes fn() holds above what was live when it started (`PeakMemory`, how="allocator": CUDA
    max_memory_allocated above entry; CPU the allocator trace's running total above its value at the block's
    first allocation event)."""
    with PeakMemory(device, how="allocator") as memory:
        fn()
    return memory.peak_bytes


def state_bytes(model: MTPModel, optimizer: torch.optim.Optimizer) -> int:
    """Bytes alive between training steps: parameters (a tied embedding once) + the optimizer's state tensors."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                  if torch.is_tensor(t))
    return params + moments


def train_step(model: MTPModel, tokens: torch.Tensor, backward: str, optimizer: torch.optim.Optimizer,
               cfg: TrainConfig | None = None):
    """One training step as `train` runs it on one process: forward + backward with the given head-backward
    order, gradient clipping, optimizer step: -> a callable.

    The gradients are set to None at the end of the step (`train` does it at the start of the next one: the
    same work), so each step starts from parameters + optimizer state alone and its peak counts the gradient
    buffers it allocates, as a real training step's does.
    """
    cfg = cfg or TrainConfig()
    params = model.trainable_parameters()

    def step():
        mtp_loss(model, tokens, backward=backward)
        finish_step(params, optimizer, cfg)
        optimizer.zero_grad(set_to_none=True)
    return step


def measure_step(model: MTPModel, tokens: torch.Tensor, *, backward: str = "sequential", repeats: int = 3) -> dict:
    """Fastest of `repeats` training steps, and the peak memory of one:
    -> {"step_s", "step_s_max", "peak_bytes" (above parameters + optimizer state), "state_bytes"}.

    A warm-up step creates the optimizer state first, so it counts in `state_bytes`, not in the peak.
    """
    tokens = tokens.to(model.device)
    model.train()
    optimizer = make_optimizer(model.trainable_parameters(), TrainConfig())
    step = train_step(model, tokens, backward, optimizer)
    times = repeat_times(step, repeats, tokens.device, warmup=1)
    peak = step_peak_bytes(step, tokens.device)
    model.eval()
    return {"step_s": min(times), "step_s_max": max(times), "peak_bytes": peak,
            "state_bytes": state_bytes(model, optimizer)}


def step_flops(config, n_heads: int, batch_size: int, seq_len: int) -> dict:
    """Matmul FLOPs of one training step (backward = 2x forward) of a trunk with Llama `config` and n_heads
    Gloeckle heads (one layer each, sharing the unembedding): -> {"layer", "unembed" (one head's d x V
    projection), "next_token" (n = 1), "mtp" (n heads), "ratio" (mtp / next_token)}.

    Per token, forward: a layer costs 2 (2 d^2 + 2 d d_kv + 3 d d_ff) for its projections plus 4 d (t + 1)
    for causal attention at position t (scores, then values); an unembedding costs 2 d V. Norms, softmax,
    the loss and the optimizer are not counted: the measured ratio above this one is their share and per-op
    overhead. The next-token step is L layers + 1 unembedding; n heads add n - 1 of each.
    """
    d, d_ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    d_kv = d * config.num_key_value_heads // config.num_attention_heads
    tokens = batch_size * seq_len
    layer = 3 * (2 * tokens * (2 * d * d + 2 * d * d_kv + 3 * d * d_ff) + 2 * d * batch_size * seq_len * (seq_len + 1))
    unembed = 3 * 2 * tokens * d * vocab
    trunk = config.num_hidden_layers * layer
    next_token, mtp = trunk + unembed, trunk + n_heads * unembed + (n_heads - 1) * layer
    return {"layer": layer, "unembed": unembed, "next_token": next_token, "mtp": mtp, "ratio": mtp / next_token}


def training_cost(*, vocab_size: int, d_model: int, n_layers: int, n_heads: int, seq_len: int, batch_size: int,
                  style: str = "gloeckle", seed: int = 0, device=None, repeats: int = 3) -> dict:
    """Next-token vs n-head training at the same trunk (n_layers layers): step time and peak memory of one
    training step (`train_step`: forward + backward + clipping + AdamW, as `train` runs it).

    Three variants on one batch: n = 1, n heads with the sequential head backward, n heads with the
    joint one (the same model and optimizer as the sequential variant). After one warm-up step each (it
    creates the optimizer state), their timed steps are interleaved, the order reversed every repeat, and
    each variant's fastest step is its cost (the slowest is kept as spread). Peak memory is the whole
    training state at the step's peak: `state_bytes` (parameters + AdamW moments) + `step_peak_bytes`.
    -> {"step_time_ratio": n-head sequential / next-token (fastest steps), "peak_mem_ratio": same for the
        peak memory, "step_peak_mem_ratio": same for the step's own allocations (activations, logits,
        gradients) without the state, their "_joint" counterparts for the all-heads-at-once backward,
        "flop_ratio": `step_flops`'s ratio, "grad_check_max_abs_diff": max |g_seq - g_joint|,
        "one_head_loss_abs_diff": |n=1 MTP loss - the trunk's own next-token loss|, "cost_measured_at":
        the size, "rows": per-variant measurements}.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator).to(device)
    models = {n: build_model(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n, style=style,
                             match_params=False, max_len=max(1024, seq_len), seed=seed).to(device).train()
              for n in (1, n_heads)}
    optimizers = {n: make_optimizer(model.trainable_parameters(), TrainConfig()) for n, model in models.items()}
    variants = [(1, "sequential"), (n_heads, "sequential"), (n_heads, "joint")]
    steps = {f"{n}-{backward}": train_step(models[n], tokens, backward, optimizers[n]) for n, backward in variants}
    times = alternating_times(steps, repeats, device)  # one warm-up step each first: optimizer state exists
    rows = []
    for (n, backward), key in zip(variants, steps):
        peak, state = step_peak_bytes(steps[key], device), state_bytes(models[n], optimizers[n])
        rows.append({"n_heads": n, "backward": backward, "params": sum(p.numel() for p in models[n].parameters()),
                     "step_s": min(times[key]), "step_s_max": max(times[key]), "repeats": repeats,
                     "peak_bytes": peak, "state_bytes": state, "total_peak_bytes": state + peak})
    n1_diff = one_head_loss_diff(models[1], tokens)
    grad_diff = grad_check(models[n_heads], tokens)
    for model in models.values():
        model.zero_grad(set_to_none=True)
        model.eval()
    base, seq, joint = rows
    flops = step_flops(models[n_heads].trunk.config, n_heads, batch_size, seq_len)
    return {"step_time_ratio": seq["step_s"] / base["step_s"],
            "peak_mem_ratio": seq["total_peak_bytes"] / base["total_peak_bytes"],
            "step_peak_mem_ratio": seq["peak_bytes"] / base["peak_bytes"],
            "step_time_ratio_joint": joint["step_s"] / base["step_s"],
            "peak_mem_ratio_joint": joint["total_peak_bytes"] / base["total_peak_bytes"],
            "step_peak_mem_ratio_joint": joint["peak_bytes"] / base["peak_bytes"],
            "flop_ratio": flops["ratio"], "flops": {k: v for k, v in flops.items() if k != "ratio"},
            "grad_check_max_abs_diff": grad_diff, "one_head_loss_abs_diff": n1_diff,
            "cost_measured_at": {"n_heads": n_heads, "d_model": d_model, "n_layers": n_layers, "seq_len": seq_len,
                                 "batch_size": batch_size, "vocab_size": vocab_size, "device": device.type,
                                 "repeats": repeats}, "rows": rows}


@torch.no_grad()
def one_head_loss_diff(model: MTPModel, tokens: torch.Tensor) -> float:
    """|n = 1 MTP loss - the trunk's own next-token loss| on tokens (B, T); 0.0 when n = 1 reduces exactly.

    The reference is the textbook loss: cross-entropy of the trunk's logits at positions 0..T-2 against
    tokens 1..T-1, computed from `model.trunk(input_ids=...)` (transformers' own forward, on purpose: the
    reference must share no code with MTP or with decodelab's engine).
    """
    if model.n_heads != 1:
        raise ValueError(f"one_head_loss_diff needs an n_heads=1 model, got n_heads={model.n_heads}")
    ours = mtp_loss(model, tokens, backward="none")["head_losses"][0]
    logits = model.trunk(input_ids=tokens).logits
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                  tokens[:, 1:].reshape(-1))
    return abs(ours - float(reference))


def grad_check(model: MTPModel, tokens: torch.Tensor) -> float:
    """max |grad_sequential - grad_joint| over every parameter (float32 summation-order noise expected)."""
    model.zero_grad(set_to_none=True)
    mtp_loss(model, tokens, backward="sequential")
    seq = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    mtp_loss(model, tokens, backward="joint")
    joint = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if set(seq) != set(joint):
        raise RuntimeError(f"the two backward orders reached different parameters: {sorted(set(seq) ^ set(joint))}")
    diff = max(float((seq[n] - joint[n]).abs().max()) for n in joint)
    model.zero_grad(set_to_none=True)
    return diff


def self_spec_benchmark(model: MTPModel, prompts: list[list[int]], batch_sizes: list[int], *, max_new_tokens: int,
                        eos_token_ids: list[int] | None = None, name: str = "mtp", repeats: int = 3) -> list[dict]:
    """Self-speculative vs plain greedy decoding of the trunk at each batch size (prompts cycled).

    Both sides get the same prompts, the same `max_new_tokens` and EOS set, and one outer wall clock
    around the whole call (prefill included); their runs alternate, the order reversed every repeat,
    and the fastest run of each is its cost. Throughput counts the tokens each side returned.
    -> one dict per batch: {"model", "batch", "heads", "tau", "acceptance" (per draft position),
    "speedup" (plain seconds / self-spec seconds, fastest runs), "plain_s", "spec_s" (+ "_max": slowest),
    "greedy_match" (every row's tokens equal), "rows_identical" (how many rows equal)}.
    """
    from decodelab.core.engine import generate
    from decodelab.core.transformer import Transformer
    from decodelab.mtp.self_speculation import self_speculative_generate

    tr = Transformer.from_hf(model.trunk)
    eos = list(eos_token_ids or [])
    rows = []
    for batch in batch_sizes:
        chosen = [prompts[i % len(prompts)] for i in range(batch)]
        runners = {"plain": lambda: generate(tr, chosen, max_new_tokens=max_new_tokens, eos_token_ids=eos),
                   "spec": lambda: self_speculative_generate(model, chosen, max_new_tokens=max_new_tokens,
                                                             eos_token_ids=eos)}
        generate(tr, chosen[:1], max_new_tokens=2, eos_token_ids=[])  # warm-up, both paths
        self_speculative_generate(model, chosen[:1], max_new_tokens=2)
        outputs: dict = {}

        def keeping(method):  # the timed call, keeping its output for the greedy comparison
            def call():
                outputs[method] = runners[method]()
            return call

        times = alternating_times({method: keeping(method) for method in runners}, repeats, tr.device, warmup=False)
        plain, spec = outputs["plain"], outputs["spec"]
        plain_s, spec_s = min(times["plain"]), min(times["spec"])
        same = sum(a == b for a, b in zip(spec.tokens, plain.tokens))
        rows.append({"model": name, "batch": batch, "heads": model.n_heads, "tau": spec.stats.tau,
                     "acceptance": spec.stats.acceptance_per_position[:model.n_heads - 1],
                     "speedup": plain_s / spec_s, "plain_s": plain_s, "spec_s": spec_s,
                     "plain_s_max": max(times["plain"]), "spec_s_max": max(times["spec"]), "repeats": repeats,
                     "plain_tokens_per_s": sum(map(len, plain.tokens)) / plain_s,
                     "spec_tokens_per_s": sum(map(len, spec.tokens)) / spec_s,
                     "greedy_match": same == batch, "rows_identical": same})
    return rows
