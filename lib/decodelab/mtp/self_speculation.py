"""Self-speculative decoding with an MTP model's own heads (Gloeckle et al. 2024): one forward drafts and verifies."""
from __future__ import annotations

import torch

from decodelab.mtp.drafter import MTPDrafter
from decodelab.mtp.model import MTPModel


@torch.inference_mode()
def self_speculative_generate(model: MTPModel, prompts: list[list[int]], *, max_new_tokens: int = 64,
                              k: int | None = None, eos_token_ids: list[int] | None = None):
    """Greedy self-speculative decoding (Stern et al. 2018, Gloeckle et al. 2024): the heads draft,
    the trunk's own LM head verifies all drafts in one forward, which also yields the states the heads
    need next. Output equals plain greedy decoding of the trunk token for token.

    -> `decodelab.speculation.decode.SpecResult` (tokens per row, SpecStats with tau and acceptance per head).
    """
    import time

    from decodelab.core.engine import pad_prompts, synchronize
    from decodelab.core.transformer import Transformer
    from decodelab.speculation.decode import SpecResult, SpecStats
    from decodelab.speculation.drafters import DraftContext
    from decodelab.speculation.verify import greedy_verify

    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    k = model.n_heads - 1 if k is None else k
    if not isinstance(k, int) or not 1 <= k <= model.n_heads - 1:
        raise ValueError(f"k={k!r} must be in [1, n_heads - 1 = {model.n_heads - 1}]")
    eos = set(eos_token_ids or [])
    tr = Transformer.from_hf(model.trunk)
    drafter = MTPDrafter(model)
    device, B = tr.device, len(prompts)
    stats = SpecStats(batch_size=B, prompt_tokens=sum(map(len, prompts)), drafter=f"mtp-{model.config.style}")
    synchronize(device)
    start = time.perf_counter()
    tokens, lengths = pad_prompts(prompts, device)
    cache = tr.new_cache(B, tokens.shape[1] + max_new_tokens + 2 * k + 2)
    logits, hidden = tr.forward(tokens, cache, n_new=lengths, logits_at="all", return_hidden=True)
    rows = torch.arange(B, device=device)
    pending = logits[rows, lengths - 1].argmax(-1)
    following = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # token after each prompt position
    following[rows, lengths - 1] = pending
    drafter.begin(prompts, max_len=cache.max_len)
    drafter.observe(hidden, lengths, following)
    synchronize(device)
    stats.prefill_s = time.perf_counter() - start
    generated = [[] for _ in range(B)]
    done = [False] * B
    while not all(done):
        start = time.perf_counter()
        active = torch.tensor([not d for d in done], device=device)
        old = cache.lengths.clone()
        proposal = drafter.propose(DraftContext(tokens=[[0]] * B, active=active), k)
        t_draft = time.perf_counter()
        inputs = torch.cat([pending[:, None], proposal.tokens], dim=1)  # (B, k+1)
        logits, hidden = tr.forward(inputs, cache, logits_at="all", return_hidden=True)
        n, nxt = greedy_verify(proposal.tokens, logits, proposal.lengths)
        cache.crop(torch.where(active, old + 1 + n, old))
        # positions kept: pending + n drafts; the token after position i of `inputs` is the target's argmax
        drafter.observe(hidden, torch.where(active, 1 + n, torch.zeros_like(n)), logits.argmax(-1))
        emitted = torch.cat([pending[:, None], proposal.tokens], dim=1).tolist()
        n_list = n.tolist()
        synchronize(device)
        end = time.perf_counter()
        stats.step_k.append(k)
        stats.draft_s.append(t_draft - start)
        stats.verify_s.append(end - t_draft)
        stats.step_s.append(end - start)
        for b in range(B):
            if done[b]:
                continue
            stats.row_steps += 1
            stats.emitted += n_list[b] + 1
            for i in range(min(n_list[b] + 1, k)):
                stats.reached[i] += 1
                stats.accepted[i] += int(i < n_list[b])
            for t in emitted[b][: n_list[b] + 1]:
                generated[b].append(t)
                if t in eos or len(generated[b]) >= max_new_tokens:
                    done[b] = True
                    break
        pending = nxt
    stats.new_tokens = sum(map(len, generated))
    return SpecResult(tokens=generated, stats=stats, finished=[any(t in eos for t in row) for row in generated])
