"""The reference engine: for every vocabulary token, check its text against the grammar. Slow on purpose.

For a regex, a pure-Python partial match (independent of both compiled engines, exact for ASCII patterns);
for a JSON schema, XGrammar's character-level automaton stepped token by token (accept, roll back). O(V)
grammar checks per token: it exists to be correct and to show what the compiled engines save.
"""
from __future__ import annotations

import torch

from decodelab.constrained.bitmask import bitmask_to_bool, bool_to_bitmask
from decodelab.constrained.constraint import Constraint
from decodelab.constrained.engines.base import MaskEngine, Matcher
from decodelab.constrained.engines.xgrammar import XGrammarEngine, XGrammarMatcher


class NaiveEngine(MaskEngine):
    """Check every token's text; see the module docstring."""

    name = "naive"

    def __init__(self, tokenizer, vocab_size=None, stop_token_ids=None, xgrammar_engine: XGrammarEngine | None = None):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        self._xg = xgrammar_engine or XGrammarEngine(tokenizer, self.vocab_size, self.stop_token_ids)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = self._xg.info.decoded_vocab
        # token id -> text; None for special / out-of-tokenizer ids (never allowed as text)
        self.texts = [
            None if (i in special or i >= len(vocab)) else vocab[i].decode("utf-8", errors="replace")
            for i in range(self.vocab_size)
        ]

    def _compile(self, constraint: Constraint):
        if constraint.kind == "json":
            return ("json", self._xg._compile(constraint))
        import regex

        return ("regex", regex.compile(constraint.pattern))

    def matcher(self, compiled) -> Matcher:
        kind, grammar = compiled
        if kind == "json":
            fast = self._xg.matcher(grammar)
            keep = None if fast.keep is None else bitmask_to_bool(fast.keep[None], self.vocab_size)[0]
            return NaiveJsonMatcher(fast.m, self.vocab_size, self.stop_token_ids, keep)
        return NaiveRegexMatcher(grammar, self.texts, self.stop_token_ids)


class NaiveRegexMatcher(Matcher):
    """Allows a token when the text so far plus the token's text can still fully match the pattern."""

    def __init__(self, pattern, texts, stop_token_ids):
        self.pattern, self.texts, self.stops = pattern, texts, stop_token_ids
        self.pieces: list[str] = []
        self.done = False

    def _viable(self, text: str) -> bool:
        return self.pattern.fullmatch(text, partial=True) is not None

    def fill(self, bitmask, row=0):
        prefix = "".join(self.pieces)
        allowed = torch.zeros(1, len(self.texts), dtype=torch.bool)
        if not self.done:
            for token, text in enumerate(self.texts):
                if text is not None and text and self._viable(prefix + text):
                    allowed[0, token] = True
            if self.pattern.fullmatch(prefix) is not None:
                allowed[0, self.stops] = True
        bitmask[row] = bool_to_bitmask(allowed)[0]

    def accept(self, token):
        token = int(token)
        if self.done:
            return False
        if token in self.stops:
            if self.pattern.fullmatch("".join(self.pieces)) is None:
                return False
            self.done = True
            self.pieces.append("")
            return True
        text = self.texts[token]
        if text is None or not text or not self._viable("".join(self.pieces) + text):
            return False
        self.pieces.append(text)
        return True

    def rollback(self, n):
        for _ in range(n):
            self.pieces.pop()
            self.done = False

    def is_terminated(self):
        return self.done

    def forced_string(self):
        return ""  # the reference does not jump forward


class NaiveJsonMatcher(XGrammarMatcher):
    """Allows a token when XGrammar's automaton accepts it from the current state (tried, then rolled back).
    Accepting, rolling back and termination are the wrapped matcher's, as in `XGrammarMatcher`."""

    def __init__(self, xgr_matcher, vocab_size, stop_token_ids, keep=None):
        self.m, self.vocab_size, self.stops = xgr_matcher, vocab_size, stop_token_ids
        self.keep = keep.tolist() if keep is not None else [True] * vocab_size

    def fill(self, bitmask, row=0):
        allowed = torch.zeros(1, self.vocab_size, dtype=torch.bool)
        if not self.m.is_terminated():
            for token in range(self.vocab_size):
                if self.keep[token] and self.m.accept_token(token):
                    allowed[0, token] = True
                    self.m.rollback(1)
        bitmask[row] = bool_to_bitmask(allowed)[0]

    def forced_string(self):
        return ""
