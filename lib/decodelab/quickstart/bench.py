"""Decode throughput: our engine against transformers' `generate()`, greedy, same prompts and lengths.

Like with like: both sides decode the same prompts for exactly `max_new_tokens` per row with EOS
disabled (neither stops a row early), in the model's dtype, timed by ONE outer wall clock around the
whole call (prefill included) on each side. Repeats interleave the sides (ours, hf, ours, hf, ...);
each side keeps its fastest call and reports the spread (slowest / fastest). Throughput counts the
tokens each side actually returned, and `identical_rows` compares full rows token for token.

The settings (batch sizes, new tokens, repeats, model) have one home: notebook 00's parameters cell,
with the profile deltas in notebooks/params/quickstart/. `decodelab bench decode` (decodelab.suite.bench_cli)
runs these functions with those settings and writes the table.
"""
from __future__ import annotations

from typing import Callable

import torch

from decodelab.common.timing import timed
from decodelab.core.engine import generate

BENCH_QUESTIONS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "List five tips for writing clean Python code.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe the water cycle for a ten-year-old.",
    "Give me a recipe for a simple tomato soup.",
    "Why do leaves change colour in autumn?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
]
WARMUP_TOKENS = 2  # one untimed call per side and batch size: allocations for that shape happen here
# The warm-up feeds the full prompts: the timed call's prefill shape must be warm too (bf16 builds one oneDNN
# primitive per matmul shape); with a warm-up on short prompts (the prefill shapes left to the timed call) bf16 at
# batch 1 read 0.79x fp32 in a quiet run, against 1.07x with full-prompt warm-ups in the run before.


def chat_prompts(tokenizer, questions: list[str] = BENCH_QUESTIONS) -> list[list[int]]:
    """One chat-formatted prompt per question (ragged lengths)."""
    from decodelab.workloads.prompts import user_prompt_ids

    return [user_prompt_ids(tokenizer, q) for q in questions]


def prompt_batch(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """`batch_size` prompts cycling through `prompts`."""
    return [prompts[row % len(prompts)] for row in range(batch_size)]


def ours_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Our engine, greedy, EOS disabled (`eos_token_ids=[]`): every row gets max_new_tokens tokens."""
    return generate(model, prompts, max_new_tokens=max_new_tokens, eos_token_ids=[]).tokens


def hf_generate_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers `generate()` on left-padded prompts, greedy, EOS disabled: -> new tokens per row.

    EOS must be disabled explicitly: `generate` fills an unset (None) `eos_token_id` from the model's
    own generation_config, and would then stop (and pad) rows at EOS. An empty list survives that
    merge and gives an EOS criterion that never fires. (`min_new_tokens` is no substitute: it masks the
    EOS logits, which changes the argmax.)
    """
    from transformers import GenerationConfig

    hf_model, device = model.hf_model, model.device
    pad_id = model.tokenizer.pad_token_id if model.tokenizer is not None else 0
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                              eos_token_id=[], pad_token_id=pad_id)
    with torch.no_grad():
        out = hf_model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                generation_config=config)
    return out[:, width:].tolist()


IMPLS: dict[str, Callable] = {"ours": ours_greedy, "hf": hf_generate_greedy}


def wall_clock(fn: Callable, model, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
    """The one outer clock both sides share: device-synchronized wall seconds of the whole call."""
    return timed(lambda: fn(model, prompts, max_new_tokens), model.device)


def identical_rows(a: list[list[int]], b: list[list[int]]) -> int:
    """How many rows are equal in full (same length, same tokens); raises if the row counts differ."""
    if len(a) != len(b):
        raise ValueError(f"cannot compare {len(a)} rows with {len(b)} rows")
    return sum(row_a == row_b for row_a, row_b in zip(a, b))


def compare_greedy(model, prompts: list[list[int]], max_new_tokens: int, *, repeats: int) -> list[dict]:
    """Time both sides on one batch, interleaved: -> one row per side (see `decode_throughput`)."""
    for fn in IMPLS.values():
        fn(model, prompts, WARMUP_TOKENS)
    seconds: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    tokens: dict[str, list[list[list[int]]]] = {impl: [] for impl in IMPLS}
    for _ in range(repeats):
        for impl, fn in IMPLS.items():  # ours, hf, ours, hf, ...
            out, s = wall_clock(fn, model, prompts, max_new_tokens)
            seconds[impl].append(s)
            tokens[impl].append(out)
    # a row counts as identical only if it is equal in every repeat
    same = min(identical_rows(ours, hf) for ours, hf in zip(tokens["ours"], tokens["hf"]))
    rows = []
    for impl in IMPLS:
        fastest, slowest = min(seconds[impl]), max(seconds[impl])
        new_tokens = sum(len(row) for row in tokens[impl][0])
        rows.append(dict(batch=len(prompts), impl=impl, tokens_per_s=new_tokens / fastest, seconds=fastest,
                         seconds_max=slowest, spread=slowest / fastest - 1, repeats=repeats,
                         new_tokens=new_tokens, identical_rows=same, rows=len(prompts)))
    return rows


def decode_throughput(model, batch_sizes: list[int], max_new_tokens: int, *, repeats: int,
                      prompts: list[list[int]] | None = None, progress: bool = True) -> list[dict]:
    """Greedy tokens/s of our engine and of HF `generate()` per batch size, and whether outputs agree.

    prompts: token-id prompts each batch cycles through (default: the chat-formatted BENCH_QUESTIONS).
    Returns rows {batch, impl, tokens_per_s, seconds, seconds_max, spread, repeats, new_tokens,
    identical_rows, rows}: `seconds` is the fastest of `repeats` timed calls, `seconds_max` the slowest,
    `spread` = seconds_max / seconds - 1; `new_tokens` the tokens that side returned (all rows), and
    tokens_per_s = new_tokens / seconds. `identical_rows` (same on both sides' rows) counts rows whose
    full token lists are equal in every repeat. Each side gets one untimed warm-up call per batch size.
    """
    for batch in batch_sizes:
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch_sizes contains {batch!r}; every batch size must be an integer >= 1")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")
    from tqdm.auto import tqdm

    prompts = prompts if prompts is not None else chat_prompts(model.tokenizer)
    rows = []
    for batch in tqdm(batch_sizes, desc="decode benchmark", disable=not progress):
        rows += compare_greedy(model, prompt_batch(prompts, batch), max_new_tokens, repeats=repeats)
    return rows


def ratio_table(rows: list[dict]) -> list[dict]:
    """Per batch size: each side's tokens/s and seconds (fastest, slowest), ours/HF, identical rows."""
    by_batch: dict[int, dict] = {}
    for row in rows:
        entry = by_batch.setdefault(row["batch"], {"batch": row["batch"]})
        for key in ("tokens_per_s", "seconds", "seconds_max", "new_tokens"):
            entry[f"{row['impl']}_{key}"] = row[key]
        entry["identical_rows"] = f"{row['identical_rows']}/{row['rows']}"
    for entry in by_batch.values():
        entry["ratio"] = entry["ours_tokens_per_s"] / entry["hf_tokens_per_s"]
    return list(by_batch.values())


def markdown_table(table: list[dict]) -> str:
    lines = ["| batch | ours tok/s | HF generate tok/s | ours / HF | ours s (min-max) | HF s (min-max) "
             "| new tokens (ours / HF) | identical greedy rows |",
             "|---|---|---|---|---|---|---|---|"]
    for e in table:
        lines.append(
            f"| {e['batch']} | {e['ours_tokens_per_s']:.1f} | {e['hf_tokens_per_s']:.1f} | {e['ratio']:.2f} "
            f"| {e['ours_seconds']:.2f}-{e['ours_seconds_max']:.2f} | {e['hf_seconds']:.2f}-{e['hf_seconds_max']:.2f} "
            f"| {e['ours_new_tokens']} / {e['hf_new_tokens']} | {e['identical_rows']} |")
    return "\n".join(lines)
