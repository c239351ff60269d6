"""What a generation returns: its tokens per row and the timing of its prefill and decode steps."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    """Timing of one generation. Step times are wall seconds per decode step (host-synchronized)."""

    batch_size: int
    prompt_tokens: int
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    new_tokens: int = 0  # tokens produced across rows, EOS included, nothing after it

    @property
    def decode_s(self) -> float:
        return sum(self.step_s)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of the whole generation, prefill included."""
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    def as_dict(self) -> dict:
        return {
            "batch_size": self.batch_size, "prompt_tokens": self.prompt_tokens, "prefill_s": self.prefill_s,
            "decode_s": self.decode_s, "steps": len(self.step_s), "new_tokens": self.new_tokens,
            "tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
        }


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row, EOS included when hit, nothing after it
    stats: DecodeStats
    finished: list[bool]  # whether each row stopped on EOS
    logprobs: list[float] | None = None  # per row: sum of log p(token) under the model's raw logits
    compile: dict | None = None  # with compile=True: StaticStep.status() (compiled or why not), for env.json
