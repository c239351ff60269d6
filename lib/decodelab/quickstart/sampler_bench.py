"""Sampler cost against the decode step: what sampling adds to a step, per filter and batch size.

For each batch size the embedded model prefills the decode benchmark's chat prompts, and its next-token
logits (B, V) are the sampler's input: real LM distributions, so the kept sets (and the sampler's
window paths, see decodelab.core.sampling) are those decoding meets. Both sides are timed by the same
clock (`common.timing.alternating_times`: one warm-up each, then `repeats` rounds in alternating order;
the fastest call is kept):

- step: one `engine.decode_step` on that cache (rolled back after each call, so every call sees the
  same context), logits included;
- sampler: one `Sampler.sample` on the step's logits with a fixed generator.

`decodelab bench sample` (decodelab.suite.bench_cli) runs `sampler_cost` and writes the table.
"""
from __future__ import annotations

import torch

from decodelab.common.timing import alternating_times
from decodelab.core.engine import decode_step, prefill
from decodelab.core.sampling import Sampler, SamplerConfig
from decodelab.quickstart import bench as decode_bench

# label -> (config, stage order): the four filters, then the pipelines the notebooks use
SAMPLERS: dict[str, tuple[SamplerConfig, str]] = {
    "temperature 1.0": (SamplerConfig(temperature=1.0), "hf"),
    "top-p 0.9": (SamplerConfig(top_p=0.9), "hf"),
    "top-k 50": (SamplerConfig(top_k=50), "hf"),
    "min-p 0.1": (SamplerConfig(min_p=0.1), "hf"),
    "T 0.7 + top-p 0.9": (SamplerConfig(temperature=0.7, top_p=0.9), "hf"),
    "T 0.7 + min-p 0.1": (SamplerConfig(temperature=0.7, min_p=0.1), "hf"),
    "top-k 50 + top-p 0.9 + min-p 0.05 (hf)": (SamplerConfig(top_k=50, top_p=0.9, min_p=0.05), "hf"),
    "top-k 50 + top-p 0.9 + min-p 0.05 (vllm)": (SamplerConfig(top_k=50, top_p=0.9, min_p=0.05), "vllm"),
}
GREEDY = "argmax (greedy)"  # the reference row: what a greedy step adds


def batch_cost(model, prompts: list[list[int]], samplers: dict[str, tuple[SamplerConfig, str]], *,
               repeats: int, seed: int = 0) -> list[dict]:
    """One batch (its prompts): -> one row per sampler {batch, sampler, order, sampler_ms, step_ms, ratio}."""
    cache, logits = prefill(model, prompts, max_new_tokens=1)
    tokens = logits.argmax(dim=-1)
    lengths = cache.lengths.clone()

    def step():
        out = decode_step(model, cache, tokens)
        cache.truncate(lengths)  # the next call sees the same context
        return out

    step_logits = step()
    generator = torch.Generator(device=step_logits.device).manual_seed(seed)
    greedy = Sampler(SamplerConfig(temperature=0.0))
    calls = {"step": step, GREEDY: lambda: greedy.sample(step_logits, generator)}
    for label, (cfg, order) in samplers.items():
        sampler = Sampler(cfg, order=order)
        calls[label] = lambda s=sampler: s.sample(step_logits, generator)
    times = alternating_times(calls, repeats, step_logits.device)
    step_ms = 1e3 * min(times.pop("step"))
    orders = {GREEDY: "-", **{label: order for label, (_, order) in samplers.items()}}
    return [dict(batch=len(prompts), sampler=label, order=orders[label], sampler_ms=1e3 * min(seconds),
                 step_ms=step_ms, ratio=1e3 * min(seconds) / step_ms, repeats=repeats)
            for label, seconds in times.items()]


def sampler_cost(model, batch_sizes: list[int], *, repeats: int, samplers=None,
                 prompts: list[list[int]] | None = None, progress: bool = True) -> list[dict]:
    """Rows {batch, sampler, order, sampler_ms, step_ms, ratio, repeats} for every batch size and sampler
    (default SAMPLERS, plus the greedy argmax as a reference row). ratio = sampler_ms / step_ms."""
    for batch in batch_sizes:
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch_sizes contains {batch!r}; every batch size must be an integer >= 1")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")
    from tqdm.auto import tqdm

    prompts = prompts if prompts is not None else decode_bench.chat_prompts(model.tokenizer)
    rows = []
    with torch.inference_mode():
        for batch in tqdm(batch_sizes, desc="sampler benchmark", disable=not progress):
            rows += batch_cost(model, decode_bench.prompt_batch(prompts, batch), samplers or SAMPLERS,
                               repeats=repeats)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| batch | sampler | order | sampler ms | decode step ms | sampler / step |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['sampler']} | {r['order']} | {r['sampler_ms']:.2f} | {r['step_ms']:.1f} "
                     f"| {100 * r['ratio']:.1f}% |")
    return "\n".join(lines)
