"""The interface every mask engine implements, and `BatchMasker`, which drives one matcher per batch row.

A `Constraint` is compiled once per engine and tokenizer (`MaskEngine.compile`); a `Matcher` then tracks
one output: `fill(bitmask, row)` writes the allowed-token set, `accept(token)` advances, `rollback(n)`
undoes the last n tokens (so it composes with speculative decoding), `forced_string()` is the text the
grammar forces next (jump-forward).
"""
from __future__ import annotations

import torch

from decodelab.constrained.bitmask import allocate_bitmask, apply_bitmask
from decodelab.constrained.constraint import Constraint, ConstraintError


class Matcher:
    """One output's grammar state. Subclasses wrap an engine's matcher."""

    def fill(self, bitmask: torch.Tensor, row: int = 0) -> None:
        raise NotImplementedError

    def accept(self, token: int) -> bool:
        raise NotImplementedError

    def rollback(self, n: int) -> None:
        raise NotImplementedError

    def is_terminated(self) -> bool:
        raise NotImplementedError

    def forced_string(self) -> str:
        """Longest string the grammar forces from here ("" when the next character is free)."""
        raise NotImplementedError


class MaskEngine:
    """A compiler of constraints for one tokenizer; `matcher(compiled)` starts an output."""

    name = "base"

    def __init__(self, tokenizer, vocab_size: int | None = None, stop_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size or len(tokenizer))
        if stop_token_ids is None:
            stop_token_ids = [tokenizer.eos_token_id]
        self.stop_token_ids = list(stop_token_ids)

    def compile(self, constraint: Constraint):
        """Constraint -> compiled grammar; raises UnsupportedConstraint / ConstraintError (empty language)."""
        compiled = self._compile(constraint)
        self._check_satisfiable(compiled, constraint)
        return compiled

    def _compile(self, constraint: Constraint):
        raise NotImplementedError

    def matcher(self, compiled) -> Matcher:
        raise NotImplementedError

    def _check_satisfiable(self, compiled, constraint: Constraint) -> None:
        matcher = self.matcher(compiled)
        bitmask = allocate_bitmask(1, self.vocab_size)
        bitmask.zero_()
        matcher.fill(bitmask, 0)
        if not bool((bitmask != 0).any()):
            raise ConstraintError(
                f"{constraint.kind} constraint {constraint.label} is unsatisfiable: "
                f"engine {self.name!r} allows no first token (its language is empty)"
            )


class BatchMasker:
    """B matchers (one per row) over one bitmask: fill -> apply to (B, V) logits -> accept sampled tokens."""

    def __init__(self, engine: MaskEngine, compiled: list):
        self.engine = engine
        self.matchers = [engine.matcher(c) for c in compiled]
        self.bitmask = allocate_bitmask(len(self.matchers), engine.vocab_size)

    def fill(self, rows: list[int] | None = None) -> torch.Tensor:
        """Fill the rows' masks (all rows by default) -> the (B, W) int32 bitmask."""
        for row in range(len(self.matchers)) if rows is None else rows:
            self.matchers[row].fill(self.bitmask, row)
        return self.bitmask

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) -> (B, V): fill every row's mask and set disallowed logits to -inf."""
        return apply_bitmask(logits, self.fill())

    def accept(self, tokens) -> list[bool]:
        return [m.accept(int(t)) if not m.is_terminated() else True for m, t in zip(self.matchers, tokens)]

    def rollback(self, counts) -> None:
        for m, n in zip(self.matchers, counts):
            m.rollback(int(n))

    def terminated(self) -> list[bool]:
        return [m.is_terminated() for m in self.matchers]
