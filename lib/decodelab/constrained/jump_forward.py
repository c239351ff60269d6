"""Jump-forward decoding: append what the grammar forces without asking the model.

Two ways (see `constrained.generate`, jump_forward=...):
- `forced_tokens` ("tokens"): while the mask allows exactly one token, that token is the only choice any
  sampler could make, so appending it changes nothing; its forward pass is merged into the next one.
- `retokenize_forward` ("retokenize", SGLang 2024): the grammar forces a string (e.g. '","age":' after
  a string value); append it, re-tokenizing the boundary (the just-sampled token + the forced text) with
  the tokenizer, since e.g. '"' + ',"age":' tokenizes differently from the two parts. The model never
  chose that tokenization, so later tokens can differ from decoding without jump-forward.

- `forced_draft` ("draft", greedy only): the tokenizer's own tokens of the forced string are a draft the
  model verifies in the forward that scores the sampled token (speculative decoding with a draft that costs
  nothing). Position j of that forward gives the masked argmax after the sampled token and the first j draft
  tokens; a draft token is kept while it equals that argmax, and the first mismatch is replaced by the
  argmax itself. Every kept token is the token greedy decoding without jump-forward picks at that position,
  so the output is token-for-token the same as "off"; what "tokens" cannot reach are forced strings the
  mask spells several ways (e.g. '"age":' as one token or as '"', 'age', '":'), which this verifies instead
  of trusting.

All are pure functions of a matcher (and a tokenizer); `constrained.jump_forward_study` measures what
they save.
"""
from __future__ import annotations

from decodelab.constrained.bitmask import allocate_bitmask, bitmask_to_bool


def forced_tokens(matcher, vocab_size: int, budget: int) -> list[int]:
    """Accept tokens while the mask allows exactly one; -> those tokens (at most `budget`)."""
    out = []
    bitmask = allocate_bitmask(1, vocab_size)
    while len(out) < budget and not matcher.is_terminated():
        bitmask.zero_()
        matcher.fill(bitmask, 0)
        allowed = bitmask_to_bool(bitmask, vocab_size)[0].nonzero().flatten()
        if allowed.numel() != 1:
            break
        token = int(allowed[0])
        if not matcher.accept(token):
            break
        out.append(token)
    return out


def retokenize_forward(matcher, pending: list[int], tokenizer, budget: int) -> list[int]:
    """SGLang jump-forward: replace the just-sampled token by tokenize(its text + forced string).

    The sampled token has not been fed to the model yet, so swapping it costs nothing. If the grammar
    rejects the re-tokenized sequence, keep the sampled token and append the forced string's own tokens;
    if that fails too, do not jump.
    """
    forced = matcher.forced_string()
    if not forced or tokenizer is None:
        return pending
    last = pending[-1]
    merged = tokenizer(tokenizer.decode([last]) + forced, add_special_tokens=False).input_ids
    for candidate, drop in ((merged, 1), (tokenizer(forced, add_special_tokens=False).input_ids, 0)):
        if not candidate or len(candidate) - drop > budget:
            continue
        matcher.rollback(drop)
        accepted = 0
        for token in candidate:
            if not matcher.accept(token):
                break
            accepted += 1
        if accepted == len(candidate):
            return pending[: len(pending) - drop] + candidate
        matcher.rollback(accepted)
        if drop:
            matcher.accept(last)
    return pending


def forced_draft(matcher, tokenizer, budget: int) -> list[int]:
    """The tokenizer's tokens of the string the grammar forces next, cut before the first token the grammar
    rejects and at `budget` tokens. The matcher is left where it was (every accepted token is rolled back)."""
    forced = matcher.forced_string()
    if not forced or tokenizer is None or budget < 1:
        return []
    draft = []
    for token in tokenizer(forced, add_special_tokens=False).input_ids[:budget]:
        if not matcher.accept(token):
            break
        draft.append(token)
    if draft:
        matcher.rollback(len(draft))
    return draft
