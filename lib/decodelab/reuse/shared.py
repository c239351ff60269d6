"""Shared-prefix KV reuse (lossless) for notebook 06: the instruction + worked example prefilled once per
stream, each query prefilling only its suffix onto it (`core.shared_prefix.SharedPrefixKVCache`).

What the method changes is the prefill: time to first token and prefill compute. Decoding from the shared cache
is plain greedy decoding over the same keys and values, so its forwards are plain's. When plain decoding's
output of the same queries is at hand it is *checked* instead of decoded again: one forward over the plain
output on the shared cache (`greedy_check`), exact by induction on the position, at the cost of one forward
instead of one per token.
"""
from __future__ import annotations

import torch

from decodelab.common.timing import timed
from decodelab.core import engine
from decodelab.core.shared_prefix import SharedPrefixKVCache


def prefix_cache(lm, prefix: list[int]) -> dict:
    """The shared prefix prefilled once (its seconds are paid once per stream): {"cache", "once_s"}."""
    (cache, _logits), seconds = timed(lambda: engine.prefill(lm, [prefix], max_new_tokens=0), lm.device)
    return {"cache": cache, "once_s": seconds}


def greedy_check(lm, cache, logits: torch.Tensor, references: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
    """Greedy decoding from (cache, last logits (B, V)), checked against reference outputs in one forward.

    references[b]: n_b >= 1 new tokens (plain greedy decoding's). Greedy decoding from here writes ref_b
    exactly when argmax logits_b = ref_b[0] and, with ref_b[:-1] fed after the prompt, the argmax at position
    j equals ref_b[j+1] for every j < n_b - 1: each token is then the greedy choice given the ones before it
    (induction on j), and the stop (EOS or the budget) falls where it fell. -> (tokens, agrees): ref_b where
    it agrees, else ref_b up to the first disagreement + the model's own token there."""
    first = logits.argmax(-1).tolist()
    fed = [r[:-1] or r[:1] for r in references]  # a 1-token reference needs no check: feed a scratch token
    tokens, lengths = engine.pad_prompts(fed, lm.device)
    with torch.inference_mode():
        preds = engine.extend(lm, cache, tokens, n_new=lengths, logits_at="all").argmax(-1).tolist()
    out, agrees = [], []
    for b, ref in enumerate(references):
        greedy = [first[b]] + preds[b][:len(ref) - 1]
        j = next((i for i, (g, r) in enumerate(zip(greedy, ref)) if g != r), None)
        out.append(list(ref) if j is None else list(ref[:j]) + [greedy[j]])
        agrees.append(j is None)
    return out, agrees


def serve_batch(lm, prompts: list[list[int]], prefix: list[int], shared: dict, *, max_new_tokens: int,
                eos: list[int], prefilled=None, references: list[list[int]] | None = None) -> dict:
    """One batch: the whole prompts' prefill is the reference time to first token (the batch's shared prefill
    when given, else timed here and dropped); then each prompt's suffix is prefilled onto the shared prefix.
    With `references` (plain's outputs of these prompts) the output is checked in one forward (`greedy_check`,
    decode_s = nan: nothing was decoded), else decoded by the engine from the shared cache.
    -> {"tokens", "forwards", "full_s", "suffix_s", "decode_s", "new_tokens", "suffix_tokens", "agrees"}."""
    device, P = lm.device, len(prefix)
    if prefilled is not None:
        full_s = prefilled.prefill_s
    else:
        _, full_s = timed(lambda: engine.prefill(lm, prompts, max_new_tokens=0), device)
    suffixes = [p[P:] for p in prompts]

    def prefill_suffixes():
        cache = SharedPrefixKVCache.fork(shared["cache"], [len(prompts)],
                                         max(map(len, suffixes)) + max_new_tokens + 1)
        tokens, lengths = engine.pad_prompts(suffixes, device)
        return cache, engine.extend(lm, cache, tokens, n_new=lengths, logits_at="last")

    (cache, logits), suffix_s = timed(prefill_suffixes, device)
    if references is not None:
        tokens, agrees = greedy_check(lm, cache, logits, references)
        decode_s = float("nan")
    else:
        res = engine.generate(lm, prompts, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                              prefilled=(cache, logits))
        tokens, agrees, decode_s = res.tokens, None, res.stats.decode_s
    return {"tokens": tokens, "forwards": [len(t) for t in tokens], "full_s": full_s, "suffix_s": suffix_s,
            "decode_s": decode_s, "new_tokens": sum(map(len, tokens)), "suffix_tokens": [len(s) for s in suffixes],
            "agrees": agrees}
