"""What a decoder plugs into THE token loop (`core.engine.iter_loop`): the `Feed` a policy asks a forward for,
the `LoopPolicy` hooks the loop calls, and `PolicyBase`'s defaults. `core.engine` re-exports all three. Every
hook's `loop` is the engine's `TokenLoop` (not imported here: the two modules would import each other)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Feed:
    """One forward's input, chosen by the policy: tokens (B', T) of the batch's current rows.

    mode "step": T = 1, logits (B', V); "all": every row feeds T, logits (B', T, V) (a verify step);
    "last": row i feeds n_new[i] (0 allowed), logits at its last token (B', V). return_hidden: also the
    final-normed hidden states (B', T, E). rows ("step" / "all"): the batch positions whose logits are wanted,
    None = all; the other rows ride along (their logits are zeros), e.g. `engine.live_rows`.
    """

    tokens: torch.Tensor
    mode: str = "step"
    n_new: torch.Tensor | None = None
    return_hidden: bool = False
    rows: torch.Tensor | None = None


class LoopPolicy(Protocol):
    """What makes a decoder: the hooks `run_loop` calls. `emitted` maps a row (its index in the prompts) to
    the tokens it produced this step; the engine cuts them at EOS / max_new_tokens and appends forced ones.

    first(loop, logits (B, V) at each prompt's last token) -> emitted: each row's first token(s).
    feed(loop) -> Feed: what every current batch row feeds (pending tokens, drafts, forced tokens).
    accept(loop, logits, hidden) -> emitted after the forward (rolling the cache back past rejected drafts).
    stopped(loop, row) -> bool: the row ends after this step's tokens (a grammar terminated, JSON closed).
    end_step(loop): after a step's bookkeeping (policy updates, parking finished rows).
    extra: cache room beyond the longest prompt + max_new_tokens; compact: drop finished rows from the
    batch once a quarter of it finished (else they ride along, as shared random streams need).
    """

    extra: int
    compact: bool

    def first(self, loop, logits: torch.Tensor) -> dict[int, list[int]]: ...

    def feed(self, loop) -> Feed: ...

    def accept(self, loop, logits: torch.Tensor, hidden) -> dict[int, list[int]]: ...

    def stopped(self, loop, row: int) -> bool: ...

    def end_step(self, loop) -> None: ...


class PolicyBase:
    """Defaults of a `LoopPolicy`: no extra cache room, finished rows ride along, accept picks like first,
    no row-level stop, nothing after a step."""

    extra, compact = 0, False

    def accept(self, loop, logits: torch.Tensor, hidden) -> dict[int, list[int]]:
        return self.first(loop, logits)

    def stopped(self, loop, row: int) -> bool:
        return False

    def end_step(self, loop) -> None:
        pass
