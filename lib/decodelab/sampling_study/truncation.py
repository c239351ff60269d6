"""What a truncation sampler keeps, on real next-token distributions: kept-set size and mass,
confidence buckets, entropy matching between samplers, the order of temperature and truncation, and
what a sampler costs next to a decode step.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

# --- what a truncation sampler keeps ----------------------------------------------------------------


def kept_set_stats(probs: torch.Tensor, processed_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row: size and original probability mass of the kept set.

    probs: (N, V) the distribution before truncation (after temperature, or the raw model
    distribution, as the caller decides); processed_logits: (N, V) a sampler's output, removed = -inf.
    -> {"size": (N,) long, "mass": (N,) float, "max_prob": (N,) float}
    """
    kept = torch.isfinite(processed_logits)
    return {
        "size": kept.sum(-1),
        "mass": (probs * kept).sum(-1),
        "max_prob": probs.max(-1).values,
    }


def bucket_by(values: torch.Tensor | np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """Bucket index per value: bucket k holds edges[k] <= v < edges[k+1] (the last bucket includes its
    right edge). (N,) -> (N,) int in [0, len(edges) - 2]."""
    v = np.asarray(values, dtype=float)
    return np.clip(np.searchsorted(np.asarray(edges, dtype=float), v, side="right") - 1, 0, len(edges) - 2)


# --- confidence analysis: kept sets on real next-token distributions -------------------------------


@torch.no_grad()
def collect_step_logits(model, prompts: list[list[int]], continuations: list[list[int]], *,
                        max_steps: int = 512, seed: int = 0, batch_size: int = 16) -> torch.Tensor:
    """Next-token logits at the positions where continuation tokens were chosen (teacher forcing through
    our transformer), a random subset of at most max_steps of them. -> (N, V) float32 on CPU."""
    steps = [(i, t) for i, c in enumerate(continuations) for t in range(len(c))]
    rng = np.random.default_rng(seed)
    if len(steps) > max_steps:
        steps = [steps[k] for k in sorted(rng.choice(len(steps), size=max_steps, replace=False))]
    wanted: dict[int, list[int]] = {}
    for i, t in steps:
        wanted.setdefault(i, []).append(t)
    from decodelab.core.engine import as_transformer, extend

    tr = as_transformer(model)
    out = []
    rows = sorted(wanted)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        # prompt + continuation minus its last token: logits at position len(prompt) - 1 + t predict token t
        seqs = [list(prompts[i]) + list(continuations[i][:-1]) for i in chunk]
        cache = tr.new_cache(len(seqs), max(len(s) for s in seqs))
        width = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            tokens[r, : len(s)] = torch.tensor(s)
        n_new = torch.tensor([len(s) for s in seqs])
        logits = extend(tr, cache, tokens.to(tr.device), n_new=n_new.to(tr.device), logits_at="all")
        for r, i in enumerate(chunk):
            positions = [len(prompts[i]) - 1 + t for t in wanted[i]]
            out.append(logits[r, positions].float().cpu())
    return torch.cat(out) if out else torch.empty(0)


def kept_set_table(logits: torch.Tensor, samplers: dict, *, temperature: float = 1.0):
    """One row per (step, sampler name): max_prob and entropy of the model's distribution at `temperature`,
    and the sampler's kept-set size, kept mass (of that distribution) and the entropy (nats) of what it
    samples from. samplers: {name: decodelab.core.sampling.Sampler}. logits: (N, V)."""
    import pandas as pd

    base = torch.softmax(logits.float() / temperature, dim=-1)
    max_prob = base.max(-1).values.numpy()
    model_entropy = torch.special.entr(base).sum(-1).numpy()
    frames = []
    for name, sampler in samplers.items():
        processed = sampler.process(logits)
        stats = kept_set_stats(base, processed)
        probs = processed.softmax(-1)
        frames.append(pd.DataFrame({
            "step": np.arange(len(logits)), "sampler": name, "max_prob": max_prob, "model_entropy": model_entropy,
            "size": stats["size"].numpy(), "mass": stats["mass"].numpy(),
            "entropy": torch.special.entr(probs).sum(-1).numpy(),
        }))
    return pd.concat(frames, ignore_index=True)


def mean_sampling_entropy(logits: torch.Tensor, config) -> float:
    """Mean entropy (nats) of the distribution a SamplerConfig samples from, over the rows of logits."""
    from decodelab.core.sampling import Sampler

    return float(torch.special.entr(Sampler(config).probs(logits)).sum(-1).mean())


def match_entropy(logits: torch.Tensor, reference, make_config: Callable[[float], object], lo: float, hi: float,
                  *, iters: int = 20) -> float:
    """The knob value v in [lo, hi] whose config make_config(v) has the same mean sampling entropy on
    `logits` as the `reference` config: matched average diversity, found by bisection. Assumes entropy
    is monotone in v over [lo, hi] (true for every truncation threshold)."""
    target = mean_sampling_entropy(logits, reference)
    f_lo = mean_sampling_entropy(logits, make_config(lo)) - target
    f_hi = mean_sampling_entropy(logits, make_config(hi)) - target
    if f_lo * f_hi > 0:
        raise ValueError(f"no value in [{lo}, {hi}] matches the reference entropy {target:.3f} nats "
                         f"(ends give {f_lo + target:.3f} and {f_hi + target:.3f})")
    for _ in range(iters):
        mid = (lo + hi) / 2
        f_mid = mean_sampling_entropy(logits, make_config(mid)) - target
        if f_mid * f_lo > 0:
            lo, f_lo = mid, f_mid
        else:
            hi = mid
    return (lo + hi) / 2


def confidence_buckets(table, edges: Sequence[float] = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0)):
    """Per (sampler, max-prob bucket): steps, mean/median kept-set size, mean kept mass, mean entropy.
    -> list of dicts (JSON-ready), buckets labelled by their [lo, hi) edges."""
    t = table.assign(bucket=bucket_by(table["max_prob"], edges))
    out = []
    for (name, b), g in t.groupby(["sampler", "bucket"]):
        out.append({"sampler": name, "bucket": int(b), "lo": float(edges[b]), "hi": float(edges[b + 1]),
                    "n_steps": int(len(g)), "size_mean": float(g["size"].mean()),
                    "size_median": float(g["size"].median()), "mass_mean": float(g["mass"].mean()),
                    "entropy_mean": float(g["entropy"].mean())})
    return out


def kept_size_vs_temperature(logits: torch.Tensor, settings: dict[str, float], temperatures: Sequence[float]):
    """Mean kept-set size and sampling entropy on `logits` (N, V) for each {sampler: value} at each
    temperature, temperature first (HF/vLLM) vs truncation first. -> DataFrame(sampler, value, order,
    temperature, size_mean, size_median, entropy)."""
    import pandas as pd

    from decodelab.core.sampling import Sampler, SamplerConfig
    from decodelab.sampling_study.grid import SAMPLER_FIELDS, TRUNCATE_FIRST

    rows = []
    for name, value in settings.items():
        field = SAMPLER_FIELDS[name]
        for t in temperatures:
            cfg = SamplerConfig(temperature=float(t), **{field: int(value) if field == "top_k" else value})
            for order_name, order in (("hf", "hf"), ("truncate_first", TRUNCATE_FIRST)):
                processed = Sampler(cfg, order=order).process(logits)
                size = torch.isfinite(processed).sum(-1).float()
                entropy = torch.special.entr(processed.softmax(-1)).sum(-1)
                rows.append({"sampler": name, "value": value, "order": order_name, "temperature": float(t),
                             "size_mean": float(size.mean()), "size_median": float(size.median()),
                             "entropy": float(entropy.mean())})
    return pd.DataFrame(rows)


def kept_set_disagreement(logits: torch.Tensor, config, order_a="hf", order_b="vllm") -> dict:
    """How often two stage orders keep different token sets for the same config on `logits` (N, V):
    {fraction_rows_differ, mean_size_a, mean_size_b}. Single filters never differ between "hf" and
    "vllm" (both apply temperature first); combined filters can."""
    from decodelab.core.sampling import Sampler

    a = torch.isfinite(Sampler(config, order=order_a).process(logits))
    b = torch.isfinite(Sampler(config, order=order_b).process(logits))
    return {"fraction_rows_differ": float((a != b).any(-1).float().mean()),
            "mean_size_a": float(a.sum(-1).float().mean()), "mean_size_b": float(b.sum(-1).float().mean())}


# --- sampler cost -----------------------------------------------------------------------------------


@torch.no_grad()
def sampler_cost(model, samplers: dict, prompts: list[list[int]], *, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Seconds per `Sampler.sample` call on real logits (B, V), for each {name: Sampler}, against one engine
    decode step over the same B = len(prompts) rows; the best of `repeats` each (the least disturbed by
    other load), the two timed in alternating order by one clock.

    The prompts are prefilled and the logits sampled are those of the decode step that follows: the
    distributions this notebook's runs sample from (a cache of zeros gives near-flat logits whose top-p
    nucleus holds thousands of tokens, which no real prompt here does, and would misstate top-p's cost).
    The step is rolled back after each call, so every call sees the same context.
    -> [{sampler, batch_size, vocab_size, context, sample_s, step_s, ratio}], context = mean prompt length
    """
    from decodelab.common.timing import alternating_times
    from decodelab.core.engine import as_transformer, decode_step, prefill

    if not prompts:
        raise ValueError("sampler_cost needs at least one prompt (its rows are the benchmark's batch)")
    tr = as_transformer(model)
    cache, first = prefill(tr, prompts, max_new_tokens=1)
    tokens, lengths = first.argmax(dim=-1), cache.lengths.clone()

    def step():
        out = decode_step(tr, cache, tokens)
        cache.truncate(lengths)
        return out

    logits = step()
    gens = [torch.Generator(device=tr.device).manual_seed(seed + r) for r in range(len(prompts))]
    calls = {"step": step, **{name: (lambda s=sampler: s.sample(logits, gens)) for name, sampler in samplers.items()}}
    times = alternating_times(calls, repeats, tr.device)
    step_s = min(times.pop("step"))
    context = float(lengths.float().mean())
    return [{"sampler": name, "batch_size": len(prompts), "vocab_size": int(logits.shape[-1]), "context": context,
             "sample_s": min(seconds), "step_s": step_s, "ratio": min(seconds) / step_s}
            for name, seconds in times.items()]
