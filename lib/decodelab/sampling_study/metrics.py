"""Diversity and quality of sampled text: distinct-n, self-BLEU, embedding diversity, coherence,
judge NLL.

Sections: lexical diversity; sentence embeddings (the MiniLM embedder itself is
`decodelab.common.embeddings`, re-exported here); judge NLL. The statistics (bootstrap, power, Pareto,
interpolation) are in `decodelab.common.stats`; what a truncation sampler keeps is in `truncation`;
the per-setting tables and tuning of the sampler-grid study are in `tables`, its verdicts in `verdicts`.

Conventions: a "set" of texts is what one sampler setting produced (for one prompt, or pooled);
higher is more diverse for distinct-n and embedding diversity, LOWER is more diverse for self-BLEU.
Quality: higher coherence is better, lower judge NLL is better.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from typing import Sequence

import numpy as np
import torch

# The sentence embedder lives in common (notebook 06 retrieves with it too); re-exported for notebook 02.
from decodelab.common.embeddings import EMBEDDER_PACKAGE, Embedder, embedder_path, load_embedder  # noqa: F401

_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks: the unit of distinct-n and self-BLEU."""
    return _WORD.findall(text.lower())


def ngrams(tokens: Sequence, n: int) -> list[tuple]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: Sequence[Sequence] | Sequence[str], n: int) -> float:
    """Unique n-grams / total n-grams, pooled over the texts (Li et al. 2016). 0.0 when there are none.

    `texts`: strings (split with `words`) or token sequences.
    """
    if n < 1:
        raise ValueError(f"n={n!r} must be >= 1")
    counts: Counter = Counter()
    for text in texts:
        counts.update(ngrams(words(text) if isinstance(text, str) else list(text), n))
    total = sum(counts.values())
    return len(counts) / total if total else 0.0


def bleu(hypothesis: Sequence, references: Sequence[Sequence], max_n: int = 4, epsilon: float = 0.1) -> float:
    """Sentence BLEU of one token sequence against references (Papineni et al. 2002).

    p_n = sum_g min(count_hyp(g), max_ref count_ref(g)) / sum_g count_hyp(g)  (clipped n-gram precision)
    BLEU = BP * exp(mean_n log p_n),  BP = min(1, exp(1 - r / c)), r = the reference length closest to c.
    A zero numerator becomes `epsilon` (NLTK's smoothing method1, as Texygen's self-BLEU uses), so one
    missing 4-gram does not zero the score. Empty hypothesis -> 0.0.
    """
    c = len(hypothesis)
    if c == 0 or not references:
        return 0.0
    log_p = 0.0
    for n in range(1, max_n + 1):
        hyp = Counter(ngrams(hypothesis, n))
        total = sum(hyp.values())
        if total == 0:  # hypothesis shorter than n: NLTK returns 0 for the sentence in this case too
            return 0.0
        max_ref: Counter = Counter()
        for ref in references:
            for gram, count in Counter(ngrams(ref, n)).items():
                max_ref[gram] = max(max_ref[gram], count)
        clipped = sum(min(count, max_ref[gram]) for gram, count in hyp.items())
        log_p += math.log((clipped if clipped > 0 else epsilon) / total)
    r = min((len(ref) for ref in references), key=lambda length: (abs(length - c), length))
    brevity = 1.0 if c > r else math.exp(1 - r / c)
    return brevity * math.exp(log_p / max_n)


def self_bleu(texts: Sequence[Sequence] | Sequence[str], max_n: int = 4) -> float:
    """Mean BLEU of each text against all the others (Zhu et al. 2018). 1 = identical texts; lower = more
    diverse. Needs at least 2 texts."""
    seqs = [words(t) if isinstance(t, str) else list(t) for t in texts]
    if len(seqs) < 2:
        raise ValueError(f"len(texts)={len(seqs)} must be >= 2 for self-BLEU")
    return float(np.mean([bleu(seq, seqs[:i] + seqs[i + 1 :], max_n=max_n) for i, seq in enumerate(seqs)]))


def embedding_diversity(embeddings: torch.Tensor) -> float:
    """Mean pairwise cosine distance 1 - cos(e_i, e_j) over pairs i < j. (N, D) -> float; N >= 2."""
    n = embeddings.shape[0]
    if n < 2:
        raise ValueError(f"embeddings.shape[0]={n} must be >= 2 for pairwise diversity")
    e = torch.nn.functional.normalize(embeddings.float(), dim=-1)
    sims = e @ e.T
    iu = torch.triu_indices(n, n, offset=1)
    return float((1 - sims[iu[0], iu[1]]).mean())


def coherence(prompt_embeddings: torch.Tensor, continuation_embeddings: torch.Tensor) -> torch.Tensor:
    """cos(prompt, continuation) per row (Su et al. 2022, contrastive search). (N, D), (N, D) -> (N,)."""
    p = torch.nn.functional.normalize(prompt_embeddings.float(), dim=-1)
    c = torch.nn.functional.normalize(continuation_embeddings.float(), dim=-1)
    return (p * c).sum(-1)


@torch.no_grad()
def continuation_nll(
    hf_model, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], batch_size: int = 16
) -> torch.Tensor:
    """Mean token NLL (nats) of each continuation given its prompt: -1/|c| sum_t log p(c_t | prompt, c_<t).

    Rows are right-padded into batches (causal attention: padding after a row never affects it).
    Empty continuations give NaN. (N prompts, N continuations) -> (N,) float32.
    """
    if len(prompts) != len(continuations):
        raise ValueError(f"len(prompts)={len(prompts)} != len(continuations)={len(continuations)}")
    device = next(hf_model.parameters()).device
    out = torch.full((len(prompts),), float("nan"))
    for start in range(0, len(prompts), batch_size):
        rows = [list(p) + list(c)
                for p, c in zip(prompts[start : start + batch_size], continuations[start : start + batch_size])]
        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        logits = hf_model(input_ids=tokens.to(device), attention_mask=mask.to(device)).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:].to(device).unsqueeze(-1))[..., 0]
        for i in range(len(rows)):
            n_prompt = len(prompts[start + i])
            n_cont = len(continuations[start + i])
            if n_cont:
                # token at position j is predicted by logits at j - 1
                out[start + i] = -logp[i, n_prompt - 1 : n_prompt - 1 + n_cont].mean().cpu()
    return out


def judge_nll(judge, prompt_texts: Sequence[str], continuation_texts: Sequence[str],
              batch_size: int = 16) -> torch.Tensor:
    """Mean token NLL of each continuation text under a judge `LoadedModel`, given the prompt as a chat
    user turn in the judge's own template (so any judge tokenizer works). -> (N,)"""
    from decodelab.workloads.prompts import user_prompt_ids

    tok = judge.tokenizer
    prompts = [user_prompt_ids(tok, p) for p in prompt_texts]
    continuations = [tok(c, add_special_tokens=False).input_ids for c in continuation_texts]
    return continuation_nll(judge.hf_model, prompts, continuations, batch_size=batch_size)
