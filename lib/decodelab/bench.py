"""Decode throughput: our engine against transformers' `generate()`, greedy, same prompts and lengths.

Both sides decode exactly `max_new_tokens` per row (EOS does not stop a row), so they do the same work
and their outputs can be compared token for token. `decodelab bench decode` writes the table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from decodelab.engine import generate, synchronize

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


def chat_prompts(tokenizer, batch_size: int, questions: list[str] = BENCH_QUESTIONS) -> list[list[int]]:
    """`batch_size` chat-formatted prompts cycling through `questions` (ragged lengths)."""
    prompts = []
    for row in range(batch_size):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": questions[row % len(questions)]}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


def hf_generate_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
    """transformers `generate()` on left-padded prompts, greedy, no early stop: -> (tokens per row, seconds)."""
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
                              eos_token_id=None, pad_token_id=pad_id)
    synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf_model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                generation_config=config)
    synchronize(device)
    seconds = time.perf_counter() - start
    return out[:, width:].tolist(), seconds


def decode_throughput(model, batch_sizes: list[int], max_new_tokens: int = 128, *, repeats: int = 1,
                      progress: bool = True) -> list[dict]:
    """Greedy tokens/s of our engine and of HF `generate()` per batch size, and whether outputs agree.

    Returns rows {batch, impl, tokens_per_s, seconds, new_tokens, identical_rows, rows}; `identical_rows`
    counts rows whose tokens are equal token for token (on the `ours` row, compared with HF).
    Each implementation gets one warm-up call; the best of `repeats` timed calls is kept.
    """
    for batch in batch_sizes:
        if int(batch) < 1:
            raise ValueError(f"batch_sizes contains {batch!r}; every batch size must be >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be >= 1")
    from tqdm.auto import tqdm

    rows = []
    warm = chat_prompts(model.tokenizer, 1)
    generate(model, warm, max_new_tokens=4, eos_token_ids=[])
    hf_generate_greedy(model, warm, 4)
    for batch in tqdm(batch_sizes, desc="decode benchmark", disable=not progress):
        prompts = chat_prompts(model.tokenizer, batch)
        ours_s, hf_s = float("inf"), float("inf")
        for _ in range(repeats):
            result = generate(model, prompts, max_new_tokens=max_new_tokens, eos_token_ids=[])
            ours_s = min(ours_s, result.stats.total_s)
            hf_tokens, seconds = hf_generate_greedy(model, prompts, max_new_tokens)
            hf_s = min(hf_s, seconds)
        identical = sum(a == b for a, b in zip(result.tokens, hf_tokens))
        new_tokens = batch * max_new_tokens
        rows.append(dict(batch=batch, impl="ours", tokens_per_s=new_tokens / ours_s, seconds=ours_s,
                         new_tokens=new_tokens, identical_rows=identical, rows=batch))
        rows.append(dict(batch=batch, impl="hf", tokens_per_s=new_tokens / hf_s, seconds=hf_s,
                         new_tokens=new_tokens, identical_rows=identical, rows=batch))
    return rows


def ratio_table(rows: list[dict]) -> list[dict]:
    """Per batch size: ours and HF tokens/s, their ratio, and identical-output rows."""
    by_batch: dict[int, dict] = {}
    for row in rows:
        entry = by_batch.setdefault(row["batch"], {"batch": row["batch"]})
        entry[f"{row['impl']}_tokens_per_s"] = row["tokens_per_s"]
        entry["identical_rows"] = f"{row['identical_rows']}/{row['rows']}"
    for entry in by_batch.values():
        entry["ratio"] = entry["ours_tokens_per_s"] / entry["hf_tokens_per_s"]
    return list(by_batch.values())


def markdown_table(table: list[dict]) -> str:
    lines = ["| batch | ours tok/s | HF generate tok/s | ours / HF | identical greedy rows |", "|---|---|---|---|---|"]
    for e in table:
        lines.append(f"| {e['batch']} | {e['ours_tokens_per_s']:.1f} | {e['hf_tokens_per_s']:.1f} | "
                     f"{e['ratio']:.2f} | {e['identical_rows']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="decodelab bench", description="Benchmarks of the decode engine.")
    parser.add_argument("what", choices=["decode"], help="decode: tokens/s of our engine vs transformers generate()")
    parser.add_argument("--model", default="smollm2-135m", help="embedded name, local path or hub id")
    parser.add_argument("--batch-sizes", default="1,4,16,64", help="comma-separated, each >= 1")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per batch size; the best is kept")
    parser.add_argument("--out", default=None, help="output folder (default results/bench/decode-<stamp>)")
    args = parser.parse_args(argv)
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes={args.batch_sizes!r} must be comma-separated integers, e.g. 1,4,16,64")

    from decodelab.models import load_model
    from decodelab.provenance import environment_info
    from decodelab.runs import results_root

    model = load_model(args.model)
    rows = decode_throughput(model, batch_sizes, args.max_new_tokens, repeats=args.repeats)
    table = ratio_table(rows)
    out = Path(args.out) if args.out else results_root() / "bench" / time.strftime("decode-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    import pandas as pd

    pd.DataFrame(table).to_csv(out / "decode.csv", index=False)
    (out / "decode.md").write_text(markdown_table(table) + "\n")
    (out / "env.json").write_text(json.dumps(
        {**environment_info(), "params": vars(args)}, indent=2, default=str))
    print(markdown_table(table))
    print(f"\nwritten to {out}")
    return 0
