"""The trace cache of a query stream: what earlier queries asked and what the model wrote, and retrieval of
the most similar earlier traces by token n-grams or by sentence embeddings.

Similarities live in [0, 1]: the Jaccard index of two questions' token n-gram sets, or the cosine of their
all-MiniLM-L6-v2 embeddings clipped at 0. A retrieval is a *hit* when the best similarity clears the threshold.
The cache only ever holds queries that arrived before the one being served (`add` after serving).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

RETRIEVAL_METHODS = ("ngram", "embedding")
NGRAM = 2  # question token n-grams compared by Jaccard


def check_method(method: str, *, name: str = "retrieval") -> str:
    if method not in RETRIEVAL_METHODS:
        raise ValueError(f"{name}={method!r} is not a retrieval method; allowed: {list(RETRIEVAL_METHODS)}")
    return method


def check_threshold(value, *, name: str = "similarity_threshold") -> float:
    """A similarity threshold: a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name}={value!r} must be a number in [0, 1] (a similarity: Jaccard or clipped cosine)")
    return float(value)


def token_ngrams(tokens: list[int], n: int = NGRAM) -> frozenset:
    """The set of n-grams of a token list (the whole list when shorter than n)."""
    if len(tokens) < n:
        return frozenset([tuple(tokens)])
    return frozenset(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    """|a & b| / |a | b| (0 for two empty sets)."""
    union = len(a | b)
    return len(a & b) / union if union else 0.0


@dataclass
class Entry:
    """One served query: its problem, question n-grams and embedding, and the trace the model wrote."""

    problem: object  # workloads.families.FamilyProblem
    ngrams: frozenset
    embedding: torch.Tensor | None
    trace_tokens: list[int]
    trace_text: str


@dataclass
class Hit:
    """A retrieved entry and its similarity to the query."""

    entry: Entry
    similarity: float


@dataclass
class TraceCache:
    """Entries in arrival order; `retrieve` ranks them for a new query."""

    entries: list[Entry] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)

    def similarities(self, ngrams: frozenset, embedding: torch.Tensor | None, method: str) -> list[float]:
        """Similarity of the query to every entry, in arrival order."""
        check_method(method)
        if method == "ngram":
            return [jaccard(ngrams, e.ngrams) for e in self.entries]
        if embedding is None:
            raise ValueError("retrieval='embedding' needs the query's embedding (got None)")
        if not self.entries:
            return []
        table = torch.stack([e.embedding for e in self.entries])  # (N, D), unit rows
        return (table @ embedding).clamp(min=0.0, max=1.0).tolist()

    def retrieve(self, ngrams: frozenset, embedding: torch.Tensor | None, *, method: str, top: int = 1,
                 threshold: float = 0.0) -> tuple[list[Hit], Hit | None]:
        """(up to `top` entries with similarity >= threshold, most similar first; the most similar entry
        whatever its similarity, None for an empty cache). Ties go to the later entry (the most recent trace)."""
        check_threshold(threshold)
        if top < 1:
            raise ValueError(f"n_traces={top!r} must be >= 1")
        sims = self.similarities(ngrams, embedding, method)
        if not sims:
            return [], None
        order = sorted(range(len(sims)), key=lambda i: (sims[i], i), reverse=True)
        hits = [Hit(self.entries[i], sims[i]) for i in order[:top] if sims[i] >= threshold]
        return hits, Hit(self.entries[order[0]], sims[order[0]])
