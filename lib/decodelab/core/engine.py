"""The decode engine: batched prefill, one decode step, a multi-token verify step, and `generate`.

It knows nothing about drafters, grammars or votes: those drive `prefill`, `decode_step`,
`verify_step` and `KVCache.crop` themselves. Rows are ragged: each has its own prompt length and its
own cache length, so a row can advance or roll back on its own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from decodelab.core.kv_cache import KVCache
from decodelab.core.sampling import argmax_rows
from decodelab.core.transformer import Transformer


@dataclass
class DecodeStats:
    """Timing of one generation. Step times are wall seconds per decode step (host-synchronized)."""

    batch_size: int
    prompt_tokens: int
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    new_tokens: int = 0  # tokens produced across rows, EOS included, nothing after it

    @property
    def decode_s(self) -> float:
        return sum(self.step_s)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of the whole generation, prefill included."""
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    def as_dict(self) -> dict:
        return {
            "batch_size": self.batch_size, "prompt_tokens": self.prompt_tokens, "prefill_s": self.prefill_s,
            "decode_s": self.decode_s, "steps": len(self.step_s), "new_tokens": self.new_tokens,
            "tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
        }


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row, EOS included when hit, nothing after it
    stats: DecodeStats
    finished: list[bool]  # whether each row stopped on EOS
    logprobs: list[float] | None = None  # per row: sum of log p(token) under the model's raw logits


def as_transformer(model) -> Transformer:
    """Accept a LoadedModel or a Transformer."""
    return model if isinstance(model, Transformer) else model.transformer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pad_prompts(prompts: list[list[int]], device: torch.device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ragged prompts: -> tokens (B, T_max) long, lengths (B,) long."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    tokens = torch.full((len(prompts), int(lengths.max())), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
    return tokens.to(device), lengths.to(device)


def prefill(model, prompts: list[list[int]], *, max_new_tokens: int, extra: int = 0,
            cache: KVCache | None = None, layers=None) -> tuple[KVCache, torch.Tensor]:
    """Run ragged prompts through the model: -> (cache, logits of each row's last prompt token (B, V)).

    The cache is sized for the longest prompt + max_new_tokens + extra (room for speculative drafts).
    """
    tr = as_transformer(model)
    tokens, lengths = pad_prompts(prompts, tr.device)
    if cache is None:
        n_layers = None if layers is None else len(layers)
        cache = tr.new_cache(len(prompts), tokens.shape[1] + max_new_tokens + extra, n_layers=n_layers)
    logits = tr.forward(tokens, cache, n_new=lengths, layers=layers, logits_at="last")
    return cache, logits


def extend(model, cache, tokens: torch.Tensor, *, n_new: torch.Tensor | None = None, layers=None,
           logits_at: str = "all", return_hidden: bool = False):
    """Append tokens (B, T) to each row of `cache` (n_new (B,) valid per row, right padding past it is scratch)
    and score them: the one way research code runs the model forward. logits_at: "all" (B, T, V), "last"
    (B, V) at each row's last valid token, "none". With return_hidden also the final-normed hidden (B, T, E)."""
    return as_transformer(model).forward(tokens, cache, n_new=n_new, layers=layers, logits_at=logits_at,
                                         return_hidden=return_hidden)


def decode_step(model, cache: KVCache, tokens: torch.Tensor, *, layers=None) -> torch.Tensor:
    """Append one token per row: tokens (B,) -> next-token logits (B, V)."""
    return as_transformer(model).forward(tokens[:, None], cache, layers=layers, logits_at="all")[:, 0]


def verify_step(model, cache: KVCache, tokens: torch.Tensor, *, layers=None, return_hidden: bool = False):
    """Append T tokens per row and score each: tokens (B, T) -> logits (B, T, V).

    logits[:, t] is the distribution after tokens[:, :t+1]. Every row advances by T; the caller rolls
    rejected positions back with `cache.crop`.
    """
    return as_transformer(model).forward(tokens, cache, layers=layers, logits_at="all", return_hidden=return_hidden)


def validate_generation_args(prompts, max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if len(prompts) < 1:
        raise ValueError(f"batch size={len(prompts)} must be >= 1 (got no prompts)")


@torch.no_grad()
def generate(model, prompts: list[list[int]], *, max_new_tokens: int = 64, sampler=None, generator=None,
             eos_token_ids: list[int] | None = None, progress: bool = False, prefilled=None,
             return_logprobs: bool = False) -> GenerationResult:
    """Batched decoding of ragged prompts with a KV cache.

    sampler: a `decodelab.core.sampling.Sampler` (None = greedy argmax); generator: torch.Generator or a list
    of one per row. eos_token_ids: tokens that end a row (default: the model's; [] = never stop early).
    A row that finished keeps riding in the batch (its tokens are ignored); the loop ends when every row
    has finished or after max_new_tokens steps.
    prefilled: (cache, last_logits (B, V)) from the caller's own prefill (e.g. a shared-prefix cache with
    room for max_new_tokens); the prompts then only count prompt tokens and the caller times the prefill.
    return_logprobs: also sum each row's log softmax(logits)[token] over its tokens.
    """
    validate_generation_args(prompts, max_new_tokens)
    tr = as_transformer(model)
    if eos_token_ids is None:
        eos_token_ids = getattr(model, "eos_token_ids", None) or []
    eos = torch.tensor(eos_token_ids, dtype=torch.long, device=tr.device)
    stats = DecodeStats(batch_size=len(prompts), prompt_tokens=sum(len(p) for p in prompts))

    synchronize(tr.device)
    start = time.perf_counter()
    cache, logits = prefilled if prefilled is not None else prefill(tr, prompts, max_new_tokens=max_new_tokens)
    next_tokens = pick_tokens(logits, sampler, generator)
    synchronize(tr.device)
    stats.prefill_s = time.perf_counter() - start

    produced = torch.empty((len(prompts), max_new_tokens), dtype=torch.long, device=tr.device)
    produced[:, 0] = next_tokens
    token_logprobs = torch.zeros((len(prompts), max_new_tokens), dtype=torch.float32) if return_logprobs else None
    if return_logprobs:
        token_logprobs[:, 0] = chosen_logprob(logits, next_tokens).cpu()
    done = torch.isin(next_tokens, eos)
    n_steps = 1
    steps = range(1, max_new_tokens)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=f"decode B={len(prompts)}", leave=False)
    for step in steps:
        if bool(done.all()):  # the one host sync of a step
            break
        start = time.perf_counter()
        logits = decode_step(tr, cache, next_tokens)
        next_tokens = pick_tokens(logits, sampler, generator)
        produced[:, step] = next_tokens
        if return_logprobs:
            token_logprobs[:, step] = chosen_logprob(logits, next_tokens).cpu()
        done |= torch.isin(next_tokens, eos)
        synchronize(tr.device)
        stats.step_s.append(time.perf_counter() - start)
        n_steps += 1

    tokens, finished = trim_at_eos(produced[:, :n_steps], eos_token_ids)
    stats.new_tokens = sum(len(row) for row in tokens)
    logprobs = None
    if return_logprobs:
        logprobs = [float(token_logprobs[row, : len(toks)].sum()) for row, toks in enumerate(tokens)]
    return GenerationResult(tokens=tokens, stats=stats, finished=finished, logprobs=logprobs)


def chosen_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, V), (B,) -> (B,): log softmax(logits)[token], in float32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None])[:, 0]


def pick_tokens(logits: torch.Tensor, sampler, generator) -> torch.Tensor:
    """(B, V) -> (B,): greedy argmax without a sampler, else the sampler's draw."""
    if sampler is None:
        return argmax_rows(logits)
    return sampler.sample(logits, generator)


def trim_at_eos(produced: torch.Tensor, eos_token_ids: list[int]) -> tuple[list[list[int]], list[bool]]:
    """(B, N) produced tokens -> per-row lists cut after the first EOS, and whether each row hit one."""
    eos = set(eos_token_ids)
    rows, finished = [], []
    for row in produced.tolist():
        cut = next((i for i, token in enumerate(row) if token in eos), None)
        rows.append(row if cut is None else row[: cut + 1])
        finished.append(cut is not None)
    return rows, finished
