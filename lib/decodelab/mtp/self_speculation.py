"""Self-speculative decoding with an MTP model's own heads (Gloeckle et al. 2024): the heads draft, the trunk verifies.

There is no loop here: the engine's token loop runs it, with the speculative policy
(`decodelab.speculation.decode.generate`) and the heads as its drafter (`decodelab.mtp.drafter.MTPDrafter`).
"""
from __future__ import annotations

from decodelab.mtp.drafter import MTPDrafter
from decodelab.mtp.model import MTPModel


def self_speculative_generate(model: MTPModel, prompts: list[list[int]], *, max_new_tokens: int = 64,
                              k: int | None = None, eos_token_ids: list[int] | None = None):
    """Greedy self-speculative decoding (Stern et al. 2018, Gloeckle et al. 2024): heads 2.. draft k tokens,
    the trunk's own LM head verifies them in one forward, whose hidden states feed the heads next.
    Output equals plain greedy decoding of the trunk token for token.

    k: drafts per step in [1, n_heads - 1] (default n_heads - 1); eos_token_ids: default none.
    -> `decodelab.speculation.decode.SpecResult` (tokens per row, SpecStats with tau and acceptance per head,
    drafter "mtp-<style>").
    """
    from decodelab.core.engine import validate_generation_args
    from decodelab.speculation.decode import generate

    validate_generation_args(prompts, max_new_tokens)
    k = model.n_heads - 1 if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= model.n_heads - 1:
        raise ValueError(f"k={k!r} must be in [1, n_heads - 1 = {model.n_heads - 1}]")
    drafter = MTPDrafter(model)
    return generate(drafter.target(), prompts, drafter, k=k, max_new_tokens=max_new_tokens,
                    eos_token_ids=list(eos_token_ids or []), name=f"mtp-{model.config.style}")
