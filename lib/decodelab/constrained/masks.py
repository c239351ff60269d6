"""Mask engines behind one interface: which tokens may come next under a grammar.

A `Constraint` (JSON schema, regex, or a finite list of strings) is compiled once per engine and
tokenizer; a `Matcher` then tracks one output: `fill(bitmask, row)` writes the allowed-token set,
`accept(token)` advances, `rollback(n)` undoes the last n tokens (so it composes with speculative
decoding), `forced_string()` is the text the grammar forces next (jump-forward).

Bitmasks are the format XGrammar and llguidance share: int32 (B, ceil(V / 32)), bit j of word w set
<=> token 32 * w + j allowed.

Engines:
- "xgrammar": compiled pushdown automaton with a per-state token-mask cache (fast on average).
- "llguidance": Earley parser over a lexer with a token trie (fast compile, steady per-token cost).
- "naive": the reference. For every vocabulary token, check its text against the grammar: for a regex
  with a pure-Python partial match (independent of both engines, exact for ASCII patterns), for a JSON
  schema by stepping XGrammar's character-level automaton token by token (accept, roll back). O(V)
  grammar checks per token; it exists to be correct and to show what the compiled engines save.

Errors: a malformed constraint raises `ConstraintError` (a ValueError) before any engine runs; a
well-formed one an engine cannot handle raises `UnsupportedConstraint`; one whose language is empty
raises `ConstraintError` at compile time, before generation starts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

ENGINES = ("xgrammar", "llguidance", "naive")
WHITESPACE = ("compact", "flexible")


class ConstraintError(ValueError):
    """A malformed or unsatisfiable schema / regex / choice list."""


class UnsupportedConstraint(ConstraintError):
    """A well-formed constraint that one engine cannot compile (reported, never generated from)."""


@dataclass(frozen=True)
class Constraint:
    """What an output must match. kind: "json" (spec: schema dict), "regex" (spec: pattern),
    "choices" (spec: strings)."""

    kind: str
    spec: Any = field(hash=False)
    name: str = ""
    whitespace: str = "compact"  # JSON only: "compact" (separators "," ":") or "flexible" (any whitespace)

    @classmethod
    def json(cls, schema: dict | str, name: str = "", whitespace: str = "compact") -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ConstraintError(f"schema={schema[:80]!r} is not valid JSON: {error}") from None
        return cls("json", schema, name, whitespace).checked()

    @classmethod
    def regex(cls, pattern: str, name: str = "") -> "Constraint":
        return cls("regex", pattern, name).checked()

    @classmethod
    def choices(cls, strings: list[str], name: str = "") -> "Constraint":
        return cls("choices", list(strings), name).checked()

    @property
    def pattern(self) -> str:
        """Regex source for "regex" and "choices" constraints."""
        import re

        if self.kind == "regex":
            return self.spec
        if self.kind == "choices":
            return "(" + "|".join(re.escape(s) for s in self.spec) + ")"
        raise ValueError(f"Constraint kind={self.kind!r} has no regex pattern; allowed for 'regex' and 'choices'")

    def checked(self) -> "Constraint":
        """Validate the constraint itself (independent of any engine); raise ConstraintError if malformed."""
        if self.kind not in ("json", "regex", "choices"):
            raise ConstraintError(f"kind={self.kind!r} is not a constraint kind; allowed: 'json', 'regex', 'choices'")
        if self.whitespace not in WHITESPACE:
            raise ConstraintError(f"whitespace={self.whitespace!r} must be one of {WHITESPACE}")
        if self.kind == "json":
            import jsonschema

            if not isinstance(self.spec, (dict, bool)):
                raise ConstraintError(f"schema={self.spec!r} must be a JSON object (dict) or boolean")
            try:
                jsonschema.validators.validator_for(self.spec).check_schema(self.spec)
            except jsonschema.SchemaError as error:
                raise ConstraintError(f"schema {self.name or ''} is malformed: {error.message}") from None
        elif self.kind == "choices":
            if not self.spec or not all(isinstance(s, str) and s for s in self.spec):
                raise ConstraintError(f"choices={self.spec!r} must be a non-empty list of non-empty strings")
        else:
            import regex

            if not isinstance(self.spec, str):
                raise ConstraintError(f"pattern={self.spec!r} must be a string")
            try:
                regex.compile(self.spec)
            except regex.error as error:
                raise ConstraintError(f"pattern={self.spec!r} is not a valid regex: {error}") from None
        return self


# ---------------------------------------------------------------- bitmasks

def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask (B, ceil(V / 32))."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, W) int32 -> (B, V) bool, True = allowed (bit j of word w is token 32 w + j)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def bool_to_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """(B, V) bool -> (B, ceil(V / 32)) int32."""
    batch, vocab = allowed.shape
    padded = torch.zeros(batch, (vocab + 31) // 32 * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    words = (padded.view(batch, -1, 32) * weights).sum(-1)
    # words are in [0, 2^32); reinterpret as int32 two's complement
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """(B, V) logits, (B, W) bitmask -> (B, V) logits with disallowed tokens at -inf (a new tensor).

    Model vocabularies may be padded beyond the tokenizer's (Qwen2.5: 151,936 vs 151,665): bits past the
    bitmask's end count as disallowed.
    """
    vocab = logits.shape[-1]
    bitmask = bitmask.to(logits.device)
    if vocab <= bitmask.shape[-1] * 32 and logits.dtype == torch.float32 and logits.is_contiguous():
        try:  # XGrammar's fused kernel (CPU / CUDA): same result, no (B, V) bool tensor
            import xgrammar as xgr

            out = logits.clone()
            xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab)
            return out
        except Exception:  # noqa: BLE001 - no kernel for this device/dtype: fall back to the torch path
            pass
    allowed = bitmask_to_bool(bitmask, min(vocab, bitmask.shape[-1] * 32))
    if allowed.shape[-1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    return logits.masked_fill(~allowed, float("-inf"))


# ---------------------------------------------------------------- engines

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
                f"{constraint.kind} constraint {constraint.name or _short(constraint.spec)} is unsatisfiable: "
                f"engine {self.name!r} allows no first token (its language is empty)"
            )


def _short(spec) -> str:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    return repr(text[:80])


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
        if constraint.kind == "json" and _uses_multi_allof(constraint.spec):
            # XGrammar 0.2.9 only warns ("support for allOf with multiple options is still ongoing") and then
            # ignores part of the schema, so its outputs could violate it: report unsupported instead.
            raise UnsupportedConstraint(
                f"engine 'xgrammar' cannot compile json constraint {constraint.name or _short(constraint.spec)}: "
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
                f"engine 'xgrammar' cannot compile {constraint.kind} constraint "
                f"{constraint.name or _short(constraint.spec)}: "
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

    def matcher(self, compiled) -> Matcher:
        grammar, keep = compiled
        return _XGrammarMatcher(self._xgr.GrammarMatcher(grammar), keep)


def _uses_multi_allof(schema) -> bool:
    if isinstance(schema, dict):
        if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
            return True
        return any(_uses_multi_allof(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_uses_multi_allof(v) for v in schema)
    return False


class _XGrammarMatcher(Matcher):
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
        error, _warnings = _validate_llg(LLMatcher, grammar, self.tok)
        if error:
            raise UnsupportedConstraint(
                f"engine 'llguidance' cannot compile {constraint.kind} constraint "
                f"{constraint.name or _short(constraint.spec)}: {error.splitlines()[0][:300]}"
            )
        return grammar

    def matcher(self, compiled) -> Matcher:
        matcher = self._llg.LLMatcher(self.tok, compiled)
        if matcher.is_error():
            raise UnsupportedConstraint(f"engine 'llguidance' failed to start a matcher: {matcher.get_error()[:300]}")
        return _LLGuidanceMatcher(matcher, self._fill, self.stop_token_ids)


def _validate_llg(LLMatcher, grammar, tok):
    """-> (error message or "", warnings)."""
    result = LLMatcher.validate_grammar_with_warnings(grammar, tok)
    if isinstance(result, tuple):
        is_error, messages = result
        return ("; ".join(messages) or "invalid grammar") if is_error else "", messages
    return result, []


class _LLGuidanceMatcher(Matcher):
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


class NaiveEngine(MaskEngine):
    """Check every token's text; see the module docstring. Slow on purpose."""

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
            return _NaiveJsonMatcher(fast.m, self.vocab_size, self.stop_token_ids, keep)
        return _NaiveRegexMatcher(grammar, self.texts, self.stop_token_ids)


class _NaiveRegexMatcher(Matcher):
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


class _NaiveJsonMatcher(Matcher):
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

    def accept(self, token):
        return bool(self.m.accept_token(int(token)))

    def rollback(self, n):
        if n:
            self.m.rollback(n)

    def is_terminated(self):
        return bool(self.m.is_terminated())

    def forced_string(self):
        return ""


def make_engine(name: str, tokenizer, vocab_size: int | None = None,
                stop_token_ids: list[int] | None = None) -> MaskEngine:
    """Engine by name: one of ENGINES."""
    classes = {"xgrammar": XGrammarEngine, "llguidance": LLGuidanceEngine, "naive": NaiveEngine}
    if name not in classes:
        raise ValueError(f"engine={name!r} is not a mask engine; allowed: {list(ENGINES)}")
    return classes[name](tokenizer, vocab_size, stop_token_ids)


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


def replay_mask_times(engine: MaskEngine, compiled, tokens: list[int], *, max_steps: int | None = None) -> list[float]:
    """Seconds to fill one row's mask at each prefix of `tokens` (a recorded output), accepting as it goes.

    Replaying the same token sequence through every engine gives paired timings on identical states.
    Stops early at max_steps (the naive engine takes ~0.1-0.4 s per step) or when a token is rejected.
    """
    import time

    matcher = engine.matcher(compiled)
    bitmask = allocate_bitmask(1, engine.vocab_size)
    out = []
    for token in tokens[: max_steps or len(tokens)]:
        start = time.perf_counter()
        matcher.fill(bitmask, 0)
        out.append(time.perf_counter() - start)
        if not matcher.accept(token):
            break
    return out
