"""The llguidance engine: an Earley parser over a lexer with a token trie (fast compile, steady per-token cost)."""
from __future__ import annotations

import json

from decodelab.constrained.constraint import Constraint, UnsupportedConstraint
from decodelab.constrained.engines.base import MaskEngine, Matcher


class LLGuidanceEngine(MaskEngine):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size=None, stop_token_ids=None):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._llg = llguidance
        self._fill = llguidance.torch.fill_next_token_bitmask
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=self.stop_token_ids[0])

    def _compile(self, constraint: Constraint):
        LLMatcher = self._llg.LLMatcher
        if constraint.kind == "json":
            flexible = constraint.whitespace == "flexible"
            grammar = LLMatcher.grammar_from_json_schema(
                json.dumps(constraint.spec), defaults={"whitespace_flexible": flexible}
            )
        else:
            grammar = LLMatcher.grammar_from_regex(constraint.pattern)
        error, _warnings = validate_grammar(LLMatcher, grammar, self.tok)
        if error:
            raise UnsupportedConstraint(
                f"engine 'llguidance' cannot compile {constraint.kind} constraint "
                f"{constraint.label}: {error.splitlines()[0][:300]}"
            )
        return grammar

    def matcher(self, compiled) -> "LLGuidanceMatcher":
        matcher = self._llg.LLMatcher(self.tok, compiled)
        if matcher.is_error():
            raise UnsupportedConstraint(f"engine 'llguidance' failed to start a matcher: {matcher.get_error()[:300]}")
        return LLGuidanceMatcher(matcher, self._fill, self.stop_token_ids)


def validate_grammar(LLMatcher, grammar, tok):
    """-> (error message or "", warnings); llguidance versions return either a message or (is_error, messages)."""
    result = LLMatcher.validate_grammar_with_warnings(grammar, tok)
    if isinstance(result, tuple):
        is_error, messages = result
        return ("; ".join(messages) or "invalid grammar") if is_error else "", messages
    return result, []


class LLGuidanceMatcher(Matcher):
    """llguidance's `is_stopped` turns true as soon as only EOS can follow; we count a row as terminated
    only once it has accepted a stop token, as XGrammar does, so every output ends with EOS."""

    def __init__(self, matcher, fill, stop_token_ids):
        self.m = matcher
        self._fill = fill
        self.stops = set(stop_token_ids)
        self.accepted = 0
        self.ended_at: int | None = None

    def fill(self, bitmask, row=0):
        self._fill(self.m, bitmask, row)

    def accept(self, token):
        if self.ended_at is not None:
            return False
        if not (self.m.consume_token(int(token)) and not self.m.is_error()):
            return False
        self.accepted += 1
        if int(token) in self.stops:
            self.ended_at = self.accepted
        return True

    def rollback(self, n):
        if n:
            self.m.rollback(n)
            self.accepted -= n
            if self.ended_at is not None and self.accepted < self.ended_at:
                self.ended_at = None

    def is_terminated(self):
        return self.ended_at is not None

    def forced_string(self):
        return self.m.compute_ff_bytes().decode("utf-8", errors="ignore")
