"""The XGrammar engine: a compiled pushdown automaton with a per-state token-mask cache (fast on average)."""
from __future__ import annotations

import json

import torch

from decodelab.constrained.bitmask import bool_to_bitmask
from decodelab.constrained.constraint import Constraint, UnsupportedConstraint
from decodelab.constrained.engines.base import MaskEngine, Matcher


class XGrammarEngine(MaskEngine):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size=None, stop_token_ids=None, max_threads: int = 1):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import xgrammar as xgr

        self._xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)

    def _compile(self, constraint: Constraint):
        if constraint.kind == "json" and uses_multi_allof(constraint.spec):
            # XGrammar 0.2.9 only warns ("support for allOf with multiple options is still ongoing") and then
            # ignores part of the schema, so its outputs could violate it: report unsupported instead.
            raise UnsupportedConstraint(
                f"engine 'xgrammar' cannot compile json constraint {constraint.label}: "
                "allOf with several subschemas is not supported"
            )
        try:
            if constraint.kind == "json":
                if constraint.whitespace == "compact":
                    grammar = self.compiler.compile_json_schema(
                        json.dumps(constraint.spec), any_whitespace=False, separators=(",", ":")
                    )
                else:
                    grammar = self.compiler.compile_json_schema(json.dumps(constraint.spec), any_whitespace=True)
                return grammar, self._json_keep(constraint.whitespace)
            return self.compiler.compile_regex(constraint.pattern), None
        except (RuntimeError, ValueError, TypeError) as error:
            raise UnsupportedConstraint(
                f"engine 'xgrammar' cannot compile {constraint.kind} constraint {constraint.label}: "
                f"{str(error).splitlines()[0][:300]}"
            ) from None

    def _json_keep(self, whitespace: str) -> torch.Tensor:
        """(W,) int32 bitmask of tokens free of raw control bytes (0x00-0x1f; flexible keeps tab, LF, CR).

        XGrammar 0.2.9 lets such bytes into JSON strings (e.g. token 'ę' = 0x19 in byte-level BPE), which
        JSON forbids unescaped and json.loads rejects; AND-ing this into every JSON mask keeps outputs valid.
        """
        cached = getattr(self, "_keep_" + whitespace, None)
        if cached is None:
            allowed_ws = {9, 10, 13} if whitespace == "flexible" else set()
            vocab = self.info.decoded_vocab
            special = set(self.info.special_token_ids) | set(self.stop_token_ids)
            keep = torch.ones(1, self.vocab_size, dtype=torch.bool)
            for token in range(min(len(vocab), self.vocab_size)):
                if token not in special and any(b < 32 and b not in allowed_ws for b in vocab[token]):
                    keep[0, token] = False
            cached = bool_to_bitmask(keep)[0]
            setattr(self, "_keep_" + whitespace, cached)
        return cached

    def matcher(self, compiled) -> "XGrammarMatcher":
        grammar, keep = compiled
        return XGrammarMatcher(self._xgr.GrammarMatcher(grammar), keep)


def uses_multi_allof(schema) -> bool:
    """Does the schema (at any depth) hold an allOf with more than one subschema?"""
    if isinstance(schema, dict):
        if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
            return True
        return any(uses_multi_allof(v) for v in schema.values())
    if isinstance(schema, list):
        return any(uses_multi_allof(v) for v in schema)
    return False


class XGrammarMatcher(Matcher):
    """An xgrammar.GrammarMatcher; `keep` (W,) is AND-ed into every mask it fills (None: nothing to drop)."""

    def __init__(self, matcher, keep: torch.Tensor | None = None):
        self.m = matcher
        self.keep = keep

    def fill(self, bitmask, row=0):
        self.m.fill_next_token_bitmask(bitmask, row)
        if self.keep is not None:
            bitmask[row] &= self.keep

    def accept(self, token):
        return bool(self.m.accept_token(int(token)))

    def rollback(self, n):
        if n:
            self.m.rollback(n)

    def is_terminated(self):
        return bool(self.m.is_terminated())

    def forced_string(self):
        return self.m.find_jump_forward_string()
