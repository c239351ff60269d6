"""Speculation workloads (data/spec_workloads.jsonl): prompts by category, as chat-prompt ids."""
from __future__ import annotations

import json
from pathlib import Path

from decodelab.workloads.paths import data_file
from decodelab.workloads.prompts import user_prompt_ids


def load_workloads(path=None, categories=None) -> list[dict]:
    """data/spec_workloads.jsonl rows {id, category, source, prompt}, optionally of some categories."""
    path = Path(path) if path is not None else data_file("spec_workloads.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if categories is not None:
        known = sorted({r["category"] for r in rows})
        unknown = sorted(set(categories) - set(known))
        if unknown:
            raise ValueError(f"categories={list(categories)!r}: {unknown} unknown; allowed: {known}")
        rows = [r for r in rows if r["category"] in categories]
    return rows


def workload_prompts(tokenizer, items: list[dict], batch_size: int, *, offset: int = 0) -> list[list[int]]:
    """batch_size chat-formatted prompt token lists (one user turn each), cycling through items (ragged lengths)."""
    return [user_prompt_ids(tokenizer, items[(offset + i) % len(items)]["prompt"]) for i in range(batch_size)]
