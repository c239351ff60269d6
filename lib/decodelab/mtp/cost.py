"""What MTP costs and buys in wall time and memory (notebook 03, sections 2 and 4).

- `measure_step` / `training_cost`: step time (fastest of interleaved repeats, slowest beside it) and peak
  memory of one forward + backward, next-token vs n heads (sequential and joint head backward). Peak memory
  is `decodelab.common.timing.PeakMemory(how="allocator")`: CUDA max_memory_allocated, on CPU the
  allocator's trace (its docstring says why RSS would not see these differences).
- `one_head_loss_diff` / `grad_check`: the exactness checks `training_cost` runs on the same batch.
- `self_spec_benchmark`: self-speculative vs plain greedy decoding of the trunk, on one wall clock.
Timers are `decodelab.common.timing`'s (host-synchronized; compared calls interleave).
"""
from __future__ import annotations

import torch

from decodelab.common.timing import PeakMemory, alternating_times, repeat_times
from decodelab.mtp.model import MTPModel, build_model, mtp_loss


def step_peak_bytes(fn, device) -> int:
    """Peak bytes the allocator holds while fn() runs (see `PeakMemory`, how="allocator")."""
    with PeakMemory(device, how="allocator") as memory:
        fn()
    return memory.peak_bytes


def train_step(model: MTPModel, tokens: torch.Tensor, backward: str):
    """One forward + backward with the given head-backward order (gradients zeroed, buffers kept): -> a callable."""
    def step():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        mtp_loss(model, tokens, backward=backward)
    return step


def measure_step(model: MTPModel, tokens: torch.Tensor, *, backward: str = "sequential", repeats: int = 3) -> dict:
    """Fastest of `repeats` forward + backward steps, and its peak memory: -> {"step_s", "step_s_max", "peak_bytes"}.

    Gradients exist before each measured step (a warm-up step allocates them), so peak memory counts
    activations, logits and temporaries, not the parameter gradients every variant shares.
    """
    tokens = tokens.to(model.device)
    model.train()
    step = train_step(model, tokens, backward)
    times = repeat_times(step, repeats, tokens.device, warmup=1)  # warm-up: .grad buffers and lazy state
    peak = step_peak_bytes(step, tokens.device)
    model.zero_grad(set_to_none=True)
    model.eval()
    return {"step_s": min(times), "step_s_max": max(times), "peak_bytes": peak}


def training_cost(*, vocab_size: int, d_model: int, n_layers: int, n_heads: int, seq_len: int, batch_size: int,
                  style: str = "gloeckle", seed: int = 0, device=None, repeats: int = 3) -> dict:
    """Next-token vs n-head training at the same trunk: step time and peak memory of one fwd + bwd.

    Three variants on one batch: n = 1, n heads with the sequential head backward, n heads with the
    joint one (the same model as the sequential variant). Their timed steps are interleaved, the order
    reversed every repeat, and each variant's fastest step is its cost (the slowest is kept as spread).
    -> {"step_time_ratio": n-head sequential / next-token (fastest steps), "peak_mem_ratio": same for peak
        memory, "step_time_ratio_joint" / "peak_mem_ratio_joint": the naive all-heads backward,
        "grad_check_max_abs_diff": max |g_seq - g_joint|, "one_head_loss_abs_diff": |n=1 MTP loss -
        the trunk's own next-token loss|, "rows": per-variant measurements}.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator).to(device)
    models = {n: build_model(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n, style=style,
                             match_params=False, max_len=max(1024, seq_len), seed=seed).to(device).train()
              for n in (1, n_heads)}
    variants = [(1, "sequential"), (n_heads, "sequential"), (n_heads, "joint")]
    steps = {f"{n}-{backward}": train_step(models[n], tokens, backward) for n, backward in variants}
    # warm-up first (.grad buffers and lazy state exist before anything is timed), then interleaved repeats
    times = alternating_times(steps, repeats, device)
    rows = [{"n_heads": n, "backward": backward, "step_s": min(times[key]), "step_s_max": max(times[key]),
             "repeats": repeats, "peak_bytes": step_peak_bytes(steps[key], device)}
            for (n, backward), key in zip(variants, steps)]
    n1_diff = one_head_loss_diff(models[1], tokens)
    grad_diff = grad_check(models[n_heads], tokens)
    for model in models.values():
        model.zero_grad(set_to_none=True)
        model.eval()
    base, seq, joint = rows
    return {"step_time_ratio": seq["step_s"] / base["step_s"], "peak_mem_ratio": seq["peak_bytes"] / base["peak_bytes"],
            "step_time_ratio_joint": joint["step_s"] / base["step_s"],
            "peak_mem_ratio_joint": joint["peak_bytes"] / base["peak_bytes"], "grad_check_max_abs_diff": grad_diff,
            "one_head_loss_abs_diff": n1_diff, "cost_measured_at": {"n_heads": n_heads, "d_model": d_model,
            "n_layers": n_layers, "seq_len": seq_len, "batch_size": batch_size, "vocab_size": vocab_size,
            "device": device.type, "repeats": repeats}, "rows": rows}


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
