"""Mask engines behind one interface (`MaskEngine`, `Matcher` in `engines.base`): which tokens may come next.

One module per engine:
- "xgrammar" (`engines.xgrammar`): compiled pushdown automaton with a per-state token-mask cache.
- "llguidance" (`engines.llguidance`): Earley parser over a lexer with a token trie.
- "naive" (`engines.naive`): the reference, checking every vocabulary token's text.

A new engine: a module here with a `MaskEngine` subclass and its `Matcher`, and one entry in `ENGINE_CLASSES`.
"""
from __future__ import annotations

from decodelab.constrained.engines.base import BatchMasker, MaskEngine, Matcher
from decodelab.constrained.engines.llguidance import LLGuidanceEngine
from decodelab.constrained.engines.naive import NaiveEngine
from decodelab.constrained.engines.xgrammar import XGrammarEngine

ENGINE_CLASSES = {"xgrammar": XGrammarEngine, "llguidance": LLGuidanceEngine, "naive": NaiveEngine}
ENGINES = tuple(ENGINE_CLASSES)

__all__ = ["ENGINES", "ENGINE_CLASSES", "BatchMasker", "LLGuidanceEngine", "MaskEngine", "Matcher", "NaiveEngine",
           "XGrammarEngine", "make_engine", "make_engines"]


def make_engine(name: str, tokenizer, vocab_size: int | None = None,
                stop_token_ids: list[int] | None = None) -> MaskEngine:
    """Engine by name: one of ENGINES."""
    if name not in ENGINE_CLASSES:
        raise ValueError(f"engine={name!r} is not a mask engine; allowed: {list(ENGINES)}")
    return ENGINE_CLASSES[name](tokenizer, vocab_size, stop_token_ids)


def make_engines(names: list[str], tokenizer, vocab_size: int | None = None,
                 stop_token_ids: list[int] | None = None) -> dict[str, MaskEngine]:
    """{name: engine} for several names; the naive engine reuses the XGrammar engine's tokenizer tables."""
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        raise ValueError(f"engines={names!r} must be a non-empty list drawn from {list(ENGINES)}")
    out = {n: make_engine(n, tokenizer, vocab_size, stop_token_ids) for n in names if n != "naive"}
    if "naive" in names:
        out["naive"] = NaiveEngine(tokenizer, vocab_size, stop_token_ids, xgrammar_engine=out.get("xgrammar"))
    return {n: out[n] for n in names}
