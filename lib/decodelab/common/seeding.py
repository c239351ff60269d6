"""Seeds and generators that do not depend on how rows are batched: one stream per (seed, unit, sample).

A row's generator is seeded by a hash of what the row is (which prompt, which sample), never by its
position in a batch, so two methods that batch differently draw the same numbers, and paired comparisons
see the same randomness on both sides.
"""
from __future__ import annotations

import hashlib

import torch


def row_seed(seed: int, unit, sample: int, *, stream: str = "row") -> int:
    """The generator seed of (unit, sample) under the run's `seed`: a hash, so streams of different
    (stream, seed, unit, sample) never coincide in practice. `stream` names the experiment's family of
    streams (notebooks that must not share draws use different names)."""
    digest = hashlib.sha256(f"decodelab-{stream}-{seed}-{unit}-{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # torch seeds are < 2**64; keep it positive


def row_generator(seed: int, unit, sample: int, *, stream: str = "row", device="cpu") -> torch.Generator:
    """A torch.Generator seeded by `row_seed`."""
    return torch.Generator(device=device).manual_seed(row_seed(seed, unit, sample, stream=stream))
