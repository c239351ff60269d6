"""Every method of notebook 06 served over one query stream, in arrival batches: one row per query.

A stream is served `batch_size` queries at a time, every method on a batch before the next batch (interleaved,
one shared prefill of the batch's prompts); a batch retrieves only from traces of earlier batches
(`retrieval.TraceCache`), and after serving adds its own outputs, so each method's cache holds what *that*
method wrote. Methods (all greedy):

    plain              chain-of-thought decoding, the reference
    prompt_ngram       lossless: prompt lookup (n-gram drafts from the prompt + output), speculative verify
    trace_draft        lossless: n-gram drafts from the retrieved traces first (up to trace_draft_k from a full
                       n-gram match), then the prompt (`TraceDrafter`)
    trace_draft_subst  lossless: the same, the traces rewritten with this query's numbers and names and their
                       sums redone (`align.recompute`)
    shared_prefix      lossless: instruction + exemplar prefilled once and shared (`reuse.shared`); plain's
                       output, served first in each batch, is checked on the shared cache in one forward
    exemplar           lossy: the retrieved question + trace replace the fixed worked example in the prompt
    step_reuse         lossy: the retrieved trace's steps proposed whole, accepted above a threshold; between
                       steps, lossless drafts from the retrieved traces (never the prompt)

Cost per query is counted in target forward passes (prefill included): each forward makes exactly one token
the target chose itself (plain step, correction or bonus), so target-chosen tokens = forwards and every other
output token was copied from a draft or a reused step.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

import torch

from decodelab.core import engine
from decodelab.reuse import align, step_reuse
from decodelab.reuse import shared as shared_prefix
from decodelab.reuse.drafting import TraceDrafter
from decodelab.reuse.retrieval import RETRIEVAL_METHODS, Entry, TraceCache, check_method, check_threshold, token_ngrams
from decodelab.speculation import decode as spec_decode
from decodelab.speculation.policy import K_CHOICES
from decodelab.workloads import tasks

METHODS = ("plain", "prompt_ngram", "trace_draft", "trace_draft_subst", "shared_prefix", "exemplar", "step_reuse")
LOSSLESS = ("plain", "prompt_ngram", "trace_draft", "trace_draft_subst", "shared_prefix")
RETRIEVING = ("trace_draft", "trace_draft_subst", "exemplar", "step_reuse")


@dataclass(frozen=True)
class Method:
    """One method setting: kind (METHODS), retrieval method for the retrieving kinds, step threshold."""

    kind: str
    retrieval: str | None = None
    threshold: float | None = None

    @property
    def label(self) -> str:
        parts = [self.kind] + ([self.retrieval] if self.retrieval else []) + (
            [f"t={self.threshold:g}"] if self.threshold is not None else [])
        return parts[0] if len(parts) == 1 else f"{parts[0]}[{', '.join(parts[1:])}]"

    @property
    def lossless(self) -> bool:
        return self.kind in LOSSLESS or (self.threshold is not None and self.threshold >= 1)


def check_method_kind(kind: str) -> str:
    if kind not in METHODS:
        raise ValueError(f"method={kind!r} is not a method; allowed: {list(METHODS)}")
    return kind


@dataclass
class Setup:
    """What every method of one run shares: the model, the stream, its prompts and retrieval features."""

    lm: object
    stream: list  # workloads.families.FamilyProblem, arrival order
    max_new_tokens: int
    draft_k: int = 6
    trace_draft_k: int = 8  # draft tokens from a trace matched on a full max_ngram suffix (TraceDrafter.short_k)
    max_ngram: int = 4
    n_traces: int = 4  # traces retrieved per query; the drafts copy from all, exemplar and step proposals the first
    similarity_threshold: float = 0.5
    embeddings: torch.Tensor | None = None  # (N, D) unit rows of the questions, or None without the embedder

    def __post_init__(self):
        check_threshold(self.similarity_threshold)
        for name in ("draft_k", "trace_draft_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max(K_CHOICES):
                raise ValueError(f"{name}={value!r} must be an int in [1, {max(K_CHOICES)}] (the speculative loop's "
                                 "longest draft, speculation.policy.K_CHOICES)")
        tok = self.lm.tokenizer
        self.prompts = [tasks.arithmetic_prompt(p.question, tok) for p in self.stream]
        self.ngrams = [token_ngrams(tok(p.question, add_special_tokens=False).input_ids) for p in self.stream]
        self.eos = list(getattr(self.lm, "eos_token_ids", None) or [])
        self.piece = lru_cache(maxsize=None)(lambda t: tok.decode([t]))
        self.prefix = common_prefix(self.prompts)

    def text(self, tokens: list[int]) -> str:
        return self.lm.tokenizer.decode(tokens, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self.lm.tokenizer(text, add_special_tokens=False).input_ids)


def common_prefix(prompts: list[list[int]]) -> list[int]:
    """The longest token prefix every prompt shares (the instruction + exemplar), one token short of the
    shortest prompt so every query keeps a suffix to prefill."""
    first, n = prompts[0], min(map(len, prompts)) - 1
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return first[:n]


def serve(setup: Setup, method: Method, *, batch_size: int = 1,
          progress: bool = False) -> tuple[list[dict], list[dict]]:
    """Serve the whole stream with `method` -> (one row per query, one row per batch)."""
    return serve_many(setup, [method], batch_size=batch_size, progress=progress)


def serve_many(setup: Setup, methods: list[Method], *, batch_size: int = 1,
               progress: bool = False) -> tuple[list[dict], list[dict]]:
    """Serve the stream with every method, interleaved batch by batch (so a drift in machine load hits all
    methods alike), each method with its own trace cache. The prompts of a batch are prefilled once and the
    prefill shared by every method that decodes from exactly those prompts (plain, prompt lookup, trace drafts;
    the shared-prefix method times it as its whole-prompt reference): each of them truncates the cache back to
    the prompts, so outputs are what separate prefills would give. -> (query rows, batch rows), method-major."""
    for method in methods:
        check_method_kind(method.kind)
        if method.kind in RETRIEVING:
            check_method(method.retrieval or "")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be >= 1")
    methods = sorted(methods, key=lambda m: m.kind != "plain")  # plain first: its outputs check shared_prefix's
    caches = {m: TraceCache() for m in methods}
    rows = {m: ([], []) for m in methods}
    shared = (shared_prefix.prefix_cache(setup.lm, setup.prefix) if any(m.kind == "shared_prefix" for m in methods)
              else None)
    starts = range(0, len(setup.stream), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"{len(methods)} methods, B={batch_size}", leave=False)
    # room for the longest draft, and for a step-reuse proposal (a step of a trace: at most ~max_new_tokens)
    max_k = max(setup.draft_k, setup.trace_draft_k, setup.max_new_tokens + 16)
    for start in starts:
        idx = list(range(start, min(start + batch_size, len(setup.stream))))
        prefilled = spec_decode.prefill(setup.lm, [setup.prompts[i] for i in idx],
                                        max_new_tokens=setup.max_new_tokens, max_k=max_k)
        plain = None  # this batch's plain outputs, once plain has served it
        for method in methods:
            query_rows, batch_rows = rows[method]
            tokens = _serve_batch(setup, method, idx, caches[method], shared, prefilled, query_rows, batch_rows,
                                  batch_size, plain)
            plain = tokens if method.kind == "plain" else plain
    return [r for m in methods for r in rows[m][0]], [r for m in methods for r in rows[m][1]]


def _serve_batch(setup: Setup, method: Method, idx: list[int], cache: TraceCache, shared, prefilled,
                 query_rows: list[dict], batch_rows: list[dict], batch_size: int, plain=None) -> list[list[int]]:
    """One batch of one method: retrieve from the method's cache, generate, append the rows, cache the traces.
    plain: plain decoding's outputs of this batch, or None. -> the batch's outputs."""
    hits = [_retrieve(setup, cache, method, i) for i in idx]
    out = _run_batch(setup, method, idx, [h[0] for h in hits], shared, prefilled, plain)
    batch_rows.append({"method": method.label, "kind": method.kind, "batch_size": batch_size, "start": idx[0],
                       "rows": len(idx), **{k: v for k, v in out.items() if not isinstance(v, list)}})
    for j, i in enumerate(idx):
        problem, tokens = setup.stream[i], out["tokens"][j]
        text = setup.text(tokens)
        answer = tasks.extract_answer(text)
        best = hits[j][1]  # the nearest earlier query, above the threshold or not
        query_rows.append({
            "method": method.label, "kind": method.kind, "lossless": method.lossless, "batch_size": batch_size,
            "query": i, "id": problem.id, "family": problem.family, "new_tokens": len(tokens),
            "forwards": out["forwards"][j], "reused_tokens": max(0, len(tokens) - out["forwards"][j]),
            "trace_tokens": out["trace_tokens"][j], "prefill_tokens": out["prefill_tokens"][j],
            "similarity": float("nan") if best is None else best.similarity, "hit": bool(hits[j][0]),
            "neighbour_family": None if best is None else best.entry.problem.family,
            "answer": answer, "truth": problem.answer, "correct": answer == problem.answer,
            "tokens": tokens, "text": text,
        })
        trace = [t for t in tokens if t not in setup.eos]
        emb = None if setup.embeddings is None else setup.embeddings[i]
        cache.add(Entry(problem, setup.ngrams[i], emb, trace, setup.text(trace)))
    return out["tokens"]


def _retrieve(setup: Setup, cache: TraceCache, method: Method, i: int):
    if method.kind not in RETRIEVING:
        return [], None
    emb = None if setup.embeddings is None else setup.embeddings[i]
    return cache.retrieve(setup.ngrams[i], emb, method=method.retrieval, top=setup.n_traces,
                          threshold=setup.similarity_threshold)


def substituted(setup: Setup, hit, i: int, *, recompute: bool = False) -> str:
    """The hit's trace with the words its question and query i's question differ in swapped in; with
    `recompute` (lossless drafting only) its sums redone with the new numbers (`align.recompute`)."""
    mapping = align.question_alignment(hit.entry.problem.question, setup.stream[i].question)
    text = align.substitute(hit.entry.trace_text, mapping)
    return align.recompute(text) if recompute else text


def _run_batch(setup: Setup, method: Method, idx: list[int], hits: list[list], shared, prefilled=None,
               plain=None) -> dict:
    """One batch of one method. prefilled: a `spec_decode.Prefilled` of exactly these queries' prompts (shared
    with the other methods of the batch), or None to prefill here; plain: plain's outputs of the batch or None."""
    kind, lm, prompts = method.kind, setup.lm, [setup.prompts[i] for i in idx]
    none = [0] * len(idx)
    if kind in ("plain", "exemplar"):
        if kind == "exemplar":  # its own prompts: its own prefill
            prompts, prefilled = [_exemplar_prompt(setup, i, h) for i, h in zip(idx, hits)], None
        res = spec_decode.generate(lm, None if prefilled else prompts, None, k=0,
                                   max_new_tokens=setup.max_new_tokens, eos_token_ids=setup.eos, prefilled=prefilled)
        return _out(res.tokens, [len(t) for t in res.tokens], none, prompts, res.stats)
    if kind in ("prompt_ngram", "trace_draft", "trace_draft_subst"):
        refs, k, short_k = [[] for _ in idx], setup.draft_k, None
        if kind != "prompt_ngram":  # prompt lookup stays the plain baseline: k drafts from any match
            refs = _draft_references(setup, kind, idx, hits)
            k, short_k = max(setup.draft_k, setup.trace_draft_k), setup.draft_k
        drafter = TraceDrafter(refs, max_ngram=setup.max_ngram, short_k=short_k, name=kind)
        res = spec_decode.generate(lm, None if prefilled else prompts, drafter, k=k,
                                   max_new_tokens=setup.max_new_tokens, eos_token_ids=setup.eos, prefilled=prefilled)
        return _out(res.tokens, [1 + f for f in drafter.forwards], drafter.accepted["trace"], prompts, res.stats)
    if kind == "step_reuse":
        steps = []
        for i, row_hits in zip(idx, hits):
            trace = setup.encode(substituted(setup, row_hits[0], i)) if row_hits else []
            steps.append(align.split_steps(trace, [setup.piece(t) for t in trace]))
        # between proposed steps: lossless drafts from the same traces trace_draft_subst copies (never the
        # prompt, so a query without a hit is plain decoding, the method's cold start)
        refs = _draft_references(setup, "trace_draft_subst", idx, hits)
        longest = max((len(s) for row in steps for s in row), default=0)
        room = prefilled is not None and prefilled.max_k >= max(longest, setup.trace_draft_k) + 1
        tokens, stats = step_reuse.generate(lm, prompts, steps, setup.piece, threshold=method.threshold,
                                            max_new_tokens=setup.max_new_tokens, eos_token_ids=setup.eos,
                                            prefilled=prefilled if room else None, references=refs,
                                            draft_k=setup.trace_draft_k)
        return _out(tokens, stats.forwards, stats.reused_tokens, prompts, stats)
    return _shared_batch(setup, prompts, shared, prefilled, plain)


def _draft_references(setup: Setup, kind: str, idx: list[int], hits: list[list]) -> list[list[list[int]]]:
    """Per row, the retrieved traces a lossless drafter copies from, least similar first (on equal n-grams the
    last reference wins): rewritten with the row's numbers and names and their sums redone (trace_draft_subst)
    or as written (trace_draft)."""
    return [[setup.encode(substituted(setup, h, i, recompute=True)) if kind == "trace_draft_subst"
             else h.entry.trace_tokens for h in reversed(row_hits)] for i, row_hits in zip(idx, hits)]


def _out(tokens, forwards, trace_tokens, prompts, stats, prefill_tokens=None, **extra) -> dict:
    return {"tokens": tokens, "forwards": list(forwards), "trace_tokens": list(trace_tokens),
            "prefill_tokens": prefill_tokens or [len(p) for p in prompts], "new_tokens": stats.new_tokens,
            "prefill_s": stats.prefill_s, "decode_s": stats.decode_s, "steps": len(stats.step_s), **extra}


def _exemplar_prompt(setup: Setup, i: int, row_hits) -> list[int]:
    """Query i's prompt with the retrieved question and its trace as the worked example (the fixed one
    without a hit)."""
    if not row_hits:
        return setup.prompts[i]
    hit = row_hits[0].entry
    messages = [{"role": "user", "content": f"{tasks.COT_INSTRUCTION}\n\nProblem: {hit.problem.question}"},
                {"role": "assistant", "content": hit.trace_text},
                {"role": "user", "content": f"{tasks.COT_INSTRUCTION}\n\nProblem: {setup.stream[i].question}"}]
    return tasks.chat_prompt_ids(setup.lm.tokenizer, messages)


def _shared_batch(setup: Setup, prompts: list[list[int]], shared: dict, prefilled=None, plain=None) -> dict:
    """The shared-prefix method on one batch (`reuse.shared`): plain's outputs, when given, checked in one forward
    on the shared cache instead of decoded again."""
    res = shared_prefix.serve_batch(setup.lm, prompts, setup.prefix, shared, max_new_tokens=setup.max_new_tokens,
                                    eos=setup.eos, prefilled=prefilled, references=plain)
    stats = SimpleNamespace(prefill_s=res["suffix_s"], decode_s=res["decode_s"], new_tokens=res["new_tokens"],
                            step_s=[])
    return _out(res["tokens"], res["forwards"], [0] * len(prompts), prompts, stats,
                prefill_tokens=res["suffix_tokens"], full_prefill_s=res["full_s"], suffix_prefill_s=res["suffix_s"],
                prefix_once_s=shared["once_s"], prefix_tokens=len(setup.prefix), checked=plain is not None)


def plan(retrieval: list[str], step_thresholds: list[float], *, raw_trace_draft: bool = True,
         exemplar: bool = True) -> list[Method]:
    """The methods of one run: plain and prompt lookup, trace-as-draft substituted (every retrieval method) and,
    with `raw_trace_draft`, raw (the substitution's ablation, first retrieval method), the shared prefix,
    with `exemplar` trace-as-exemplar, and one step-reuse setting per threshold (first retrieval method)."""
    if not retrieval:
        raise ValueError(f"retrieval={retrieval!r} is empty; allowed: a non-empty list from ['ngram', 'embedding']")
    for method in retrieval:
        check_method(method)
    for t in step_thresholds:
        check_threshold(t, name="step_thresholds")
    first = retrieval[0]
    return ([Method("plain"), Method("prompt_ngram")] + ([Method("trace_draft", first)] if raw_trace_draft else [])
            + [Method("trace_draft_subst", r) for r in retrieval]
            + [Method("shared_prefix")] + ([Method("exemplar", first)] if exemplar else [])
            + [Method("step_reuse", first, float(t)) for t in step_thresholds])


def serve_all(setup: Setup, methods: list[Method], batch_sizes: list[int], large_batch_kinds: list[str], *,
              progress: bool = False) -> tuple[list[dict], list[dict]]:
    """Every method at batch 1; at every other batch size plain and the kinds in `large_batch_kinds`, those
    that retrieve with the first retrieval method only (the other is a batch-1 comparison) -> (query rows,
    batch rows), plain first at each batch size."""
    for kind in large_batch_kinds:
        check_method_kind(kind)
    first_retrieval = next((m.retrieval for m in methods if m.retrieval), None)
    # One untimed generation first: the first forwards of a process pay one-time costs (allocator, thread
    # pools) that would otherwise be charged to whichever method runs first (plain).
    engine.generate(setup.lm, setup.prompts[:1], max_new_tokens=min(8, setup.max_new_tokens), eos_token_ids=[])
    queries, batches = [], []
    for batch in batch_sizes:
        chosen = [m for m in methods if batch == 1 or m.kind == "plain"
                  or (m.kind in large_batch_kinds and m.retrieval in (None, first_retrieval))]
        q, b = serve_many(setup, chosen, batch_size=batch, progress=progress)
        queries += q
        batches += b
    return queries, batches


def nearest_rows(setup: Setup) -> list[dict]:
    """Per retrieval method whose features the setup holds (n-grams always, embeddings when loaded) and per query,
    the nearest earlier query of the stream at batch 1, with no serving: a similarity depends only on the two
    questions, so these are the similarities every method retrieving that way sees. Rows carry what
    `summary.hit_curve` reads (method "nearest[<retrieval>]", batch_size 1, similarity, family, neighbour_family)."""
    kinds = ["ngram"] + (["embedding"] if setup.embeddings is not None else [])
    out = []
    for kind in kinds:
        cache = TraceCache()
        for i, problem in enumerate(setup.stream):
            emb = None if setup.embeddings is None else setup.embeddings[i]
            _, best = cache.retrieve(setup.ngrams[i], emb, method=kind)
            out.append({"method": f"nearest[{kind}]", "batch_size": 1, "query": i, "family": problem.family,
                        "similarity": float("nan") if best is None else best.similarity,
                        "neighbour_family": None if best is None else best.entry.problem.family})
            cache.add(Entry(problem, setup.ngrams[i], emb, [], ""))
    return out


def left_out(retrieval: list[str], step_thresholds: list[float], *, raw_trace_draft: bool, exemplar: bool) -> list[str]:
    """What this run's `plan` does not serve that a fuller profile can (a parameter each): the other retrieval
    method for trace-as-draft, the raw trace-draft ablation, trace-as-exemplar, a step-reuse sweep of more than
    one threshold. -> short phrases, [] when nothing is left out."""
    out = [f"trace_draft_subst[{r}]" for r in RETRIEVAL_METHODS if r not in retrieval]
    out += [] if raw_trace_draft else ["the raw trace-draft ablation (trace_draft)"]
    out += [] if exemplar else ["trace-as-exemplar"]
    out += [] if len(step_thresholds) > 1 else ["a step-reuse threshold sweep (one threshold served)"]
    return out
