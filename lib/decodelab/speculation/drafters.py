"""Drafters: cheap guesses of the next k tokens that the target model then verifies in one step.

Every drafter implements the `Drafter` protocol below, so the speculative loop (`decodelab.speculation.decode`)
knows nothing about where drafts come from. Shipped here:

- `NGramDrafter`     prompt lookup: copy what followed the latest earlier occurrence of the
                     current n-gram suffix (no model; Saxena 2023, HF `prompt_lookup_num_tokens`).
- `LayerSkipDrafter` self-speculation: a subset of the target's own layers + its final norm and
                     head, with its own KV cache (Draft & Verify, Zhang et al. 2023; no training).
- `ModelDrafter`     any causal LM sharing the target's tokenizer (Leviathan et al. 2023).

The MTP-heads drafter lives in `decodelab.mtp.drafter` and implements the same protocol. `make_drafter` builds the
shipped ones by name with the notebook's defaults (which layers to skip, how deep a draft);
`decodelab.speculation.draft_models` builds or loads the draft model itself.

Protocol, step by step (the loop in `decodelab.speculation.decode.generate` drives it):

    drafter.begin(prompts, max_len=...)      # once, after the target's prefill
    loop: proposal = drafter.propose(ctx, k)  # k >= 1 drafts per row; the target verifies them, row b accepts
          drafter.rollback(n_accepted)        # n_accepted[b] of its drafts: forget the rejected ones

`ctx.tokens[b]` is row b's whole sequence so far: prompt + every token accepted so far, ending with the *pending*
token (the target's latest choice, which has not been fed to the target yet). The drafts continue after it:
`proposal.tokens[b, 0]` is the guess for the token after `ctx.tokens[b][-1]`. `ctx.tokens` only ever grows (accepted
tokens are never taken back), so a drafter may keep incremental state keyed on how much of each row it has already
seen.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from decodelab.core.engine import extend, live_rows, pad_prompts
from decodelab.core.sampling import draw_uniforms
from decodelab.speculation.draft_models import (  # truncated_model: still imported from here by test_speculative
    check_same_tokenizer,
    draft_model_for,
    truncated_model,  # noqa: F401
)
from decodelab.speculation.verify import inverse_cdf


@dataclass
class DraftContext:
    """What a drafter may read at one speculative step.

    tokens       list of B lists of ints: each row's prompt + accepted tokens, ending with the pending
                 token (chosen by the target, not yet in the target's KV cache).
    last_hidden  (B, D) or None: the target's final-normed hidden state (the input of its LM head) at each row's
                 last position in the target's cache, i.e. at index len(tokens[b]) - 2: the state whose LM-head
                 output produced the pending token tokens[b][-1]. MTP heads read it to predict tokens[b][-1]'s
                 successors. None when the loop does not compute it (only `needs_hidden = True` drafters get it).
    active       (B,) bool: rows still generating. Drafts for finished rows are ignored, so a drafter
                 may skip work for them (it must still return B rows).
    sampler      None for greedy drafting, else a `decodelab.core.sampling.Sampler` whose `.probs` gives
                 the drafter's processed distribution q (the same processing as the target's p).
    generator    torch.Generator for the drafter's own sampling (None when greedy), or a list of one
                 per row (draw row b's numbers from generator[b] only, as `sampling.draw_uniforms` does).
    new_hidden   (B, T, D) or None (only for `needs_hidden` drafters): the target's final-normed hidden states of
                 every position it cached since the previous `propose` (at the first propose: the whole prompt),
                 left-aligned per row; row b's valid ones are [:new_hidden_lengths[b]] and belong to positions
                 len(tokens[b]) - 1 - new_hidden_lengths[b] .. len(tokens[b]) - 2 (the pending token is not cached
                 yet). MTP heads feed them to keep their own context complete.
    new_hidden_lengths  (B,) long or None, see new_hidden.
    """

    tokens: list[list[int]]
    last_hidden: torch.Tensor | None = None
    active: torch.Tensor | None = None
    sampler: object | None = None
    generator: torch.Generator | list[torch.Generator] | None = None
    new_hidden: torch.Tensor | None = None
    new_hidden_lengths: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.tokens)


@dataclass
class DraftProposal:
    """k drafted tokens per row.

    tokens   (B, k) long: tokens[b, i] is the guess for position len(ctx.tokens[b]) + i.
    probs    (B, k, V) float or None. The draft distribution q each token was sampled from (rows sum
             to 1). None means the drafts are deterministic: q is one-hot at `tokens`, which is what
             greedy drafting and the n-gram drafter produce; exact rejection sampling still holds
             (accept with probability p(token), else resample from norm(max(p - onehot, 0))).
    lengths  (B,) long or None: row b has only lengths[b] <= k real drafts; positions past it are
             padding that verification always rejects (e.g. an n-gram with no earlier match).
             None means every row has k real drafts.
    kinds    (B,) long or None: the drafter's own class of each row's proposal, for a policy that learns
             acceptance per kind (`RowBudgetPolicy`); the n-gram drafter gives the order of the n-gram it
             matched (0: no match). None means one kind.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    kinds: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]


@runtime_checkable
class Drafter(Protocol):
    """The interface every drafter implements (structural: no need to inherit).

    name          short label used in tables and plots ("ngram", "layer_skip", "draft_model", "mtp").
    needs_hidden  True when `propose` reads `ctx.last_hidden` (the loop then asks the target for it).
    cheap         optional, default False: `propose` costs ~nothing (a lookup), so a per-row policy may
                  ask for the deepest drafts before it decides, to see which rows have real ones.
    """

    name: str
    needs_hidden: bool

    def begin(self, prompts: list[list[int]], *, max_len: int) -> None:
        """Reset for a new batch. `prompts` are the B prompts (token ids, ragged); `max_len` bounds
        len(ctx.tokens[b]) + k for every row and step (size any KV cache with it)."""
        ...

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        """Draft k >= 1 tokens per row continuing ctx.tokens[b]; (B, k) tokens (+ q when sampled)."""
        ...

    def rollback(self, n_accepted: torch.Tensor) -> None:
        """n_accepted (B,) long in [0, k]: how many of the last proposal's drafts row b kept. A drafter
        with a KV cache rolls the rejected ones back here; the next `ctx.tokens` also carries the target's
        correction / bonus token, which the drafter has not seen yet."""
        ...


class DrafterBase:
    """Convenience base: no-op begin/rollback, k validation. Subclasses implement `_propose`."""

    name = "base"
    needs_hidden = False

    def begin(self, prompts: list[list[int]], *, max_len: int) -> None:
        pass

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k={k!r} must be an int >= 1 (k=0 means a plain decode step: don't call propose)")
        return self._propose(ctx, k)

    def _propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        raise NotImplementedError

    def rollback(self, n_accepted: torch.Tensor) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class NGramDrafter(DrafterBase):
    """Prompt lookup: find the latest earlier occurrence of each row's last n tokens (n from `max_ngram` down to
    `min_ngram`) and propose the k tokens that followed it. No model, batched.

    Each row keeps a dict (n-gram -> end index of its latest occurrence with a continuation), updated incrementally as
    ctx.tokens grows, so a step costs O(new tokens) per row, not O(sequence). When the continuation runs into the
    current end of the sequence it wraps around periodically (a repeated pattern keeps repeating). A row with no
    match proposes nothing (`lengths[b] = 0`). match="earliest" copies after the n-gram's first occurrence instead
    (transformers' prompt lookup does, and in code editing the first occurrence is often the passage being copied).
    """

    name = "ngram"
    cheap = True  # a proposal is a dict lookup per row: a per-row policy may ask before it decides

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, match: str = "latest"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"min_ngram={min_ngram!r}, max_ngram={max_ngram!r}: need 1 <= min_ngram <= max_ngram")
        if match not in ("latest", "earliest"):
            raise ValueError(f"match={match!r} must be 'latest' or 'earliest'")
        self.max_ngram, self.min_ngram, self.match = max_ngram, min_ngram, match
        self._index: list[dict] = []
        self._seen: list[int] = []

    def begin(self, prompts: list[list[int]], *, max_len: int = 0) -> None:
        self._index = [{} for _ in prompts]
        self._seen = [0 for _ in prompts]

    def _update(self, b: int, seq: list[int]) -> None:
        index, end = self._index[b], len(seq)
        # Register every n-gram seq[e-n:e] whose continuation seq[e] exists (e <= end - 1);
        # "latest": later occurrences overwrite earlier ones; "earliest": the first one stays.
        keep_first = self.match == "earliest"
        for e in range(max(self._seen[b], 1), end):
            for n in range(self.min_ngram, min(self.max_ngram, e) + 1):
                key = tuple(seq[e - n:e])
                if not (keep_first and key in index):
                    index[key] = e
        self._seen[b] = max(self._seen[b], end)

    def lookup(self, b: int, seq: list[int], k: int) -> list[int]:
        """Up to k tokens continuing row b's sequence `seq`, or [] when no n-gram suffix recurs."""
        return self.lookup_order(b, seq, k)[0]

    def lookup_order(self, b: int, seq: list[int], k: int) -> tuple[list[int], int]:
        """(`lookup`'s tokens, the order n of the n-gram they continue; 0 when none recurs)."""
        if len(self._index) <= b:
            self._index.extend({} for _ in range(b + 1 - len(self._index)))
            self._seen.extend(0 for _ in range(b + 1 - len(self._seen)))
        self._update(b, seq)
        end = len(seq)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            e = self._index[b].get(tuple(seq[end - n:]))
            if e is None:
                continue
            out: list[int] = []
            for i in range(k):
                j = e + i
                out.append(seq[j] if j < end else out[j - end])
            return out, n
        return [], 0

    def _propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        active = [True] * ctx.batch_size if ctx.active is None else ctx.active.tolist()
        rows, lengths, orders = [], [], []
        for b, seq in enumerate(ctx.tokens):  # one tensor built at the end: a step costs O(B) dict lookups
            found, order = self.lookup_order(b, seq, k) if active[b] else ([], 0)
            rows.append(found + [seq[-1]] * (k - len(found)))  # padding, always rejected
            lengths.append(len(found))
            orders.append(order)
        return DraftProposal(tokens=torch.tensor(rows, dtype=torch.long), probs=None,
                             lengths=torch.tensor(lengths, dtype=torch.long), kinds=torch.tensor(orders))


class CachedModelDrafter(DrafterBase):
    """Autoregressive drafting with a causal LM (or a layer subset of one) and its own KV cache.

    The draft cache holds every token of ctx.tokens except, between steps, the not-yet-seen ones: `propose` first feeds
    each row's unseen suffix (ragged: the pending token, plus the last draft when all k were accepted, or everything
    since the last proposal after plain steps) in ONE batched forward, then drafts k tokens one at a time;
    `rollback` truncates the drafts that the target rejected. Steps where the policy chose k = 0 cost the draft
    nothing: it catches up lazily when drafting resumes. Cost per drafting step: one catch-up forward + (k - 1)
    single-token forwards.
    """

    CATCHUP = 16  # spare cache positions beyond max_len: scratch room of the ragged catch-up forward

    def __init__(self, transformer, *, layers=None, target_vocab_size: int | None = None, name: str = "draft_model"):
        self.tr = transformer
        self.layers = list(layers) if layers is not None else None
        self.vocab_size = target_vocab_size or transformer.vocab_size
        self.name = name
        self.cache = None
        self._base: torch.Tensor | None = None
        self.prefills: dict | None = None  # shared with other drafters: {(model, layers): their latest prefill}

    def share_prefills(self, prefills: dict) -> "CachedModelDrafter":
        """Copy a prefill of these prompts by a drafter of this model and layers sharing `prefills`, if any."""
        self.prefills = prefills
        return self

    def begin(self, prompts: list[list[int]], *, max_len: int) -> None:
        # the same prompts as the previous run (a sweep's methods on one batch): the prompt positions were never
        # overwritten (only positions past each prompt are), so the cache rolled back to them is their prefill
        key = (tuple(map(tuple, prompts)), max_len)
        if self.cache is not None and getattr(self, "_prompts_key", None) == key:
            self.cache.truncate(self._prompt_lengths.clone())
            return
        shared = (id(self.tr), None if self.layers is None else tuple(self.layers))
        held = (self.prefills or {}).get(shared)
        if held is not None and held[0] == key:  # another drafter's cache, maybe mid-decode: rolled back, as above
            self.cache = held[1].copy()
            self.cache.truncate(held[2].clone())
        else:
            n_layers = len(self.layers) if self.layers is not None else None
            self.cache = self.tr.new_cache(len(prompts), max_len + self.CATCHUP, n_layers=n_layers)
            tokens, lengths = pad_prompts(prompts, self.tr.device)
            extend(self.tr, self.cache, tokens, n_new=lengths, layers=self.layers, logits_at="none")
            if self.prefills is not None:
                self.prefills[shared] = (key, self.cache, self.cache.lengths.clone())
        self._prompts_key, self._prompt_lengths = key, self.cache.lengths.clone()

    def _logits(self, tokens: torch.Tensor, n_new: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Feed tokens (B, T) -> logits at each row's last valid token, cut/padded to the target's vocab.
        rows: only these rows' logits are computed (finished rows skip the linear layers; theirs are zeros)."""
        if rows is None:
            logits = extend(self.tr, self.cache, tokens, n_new=n_new, layers=self.layers, logits_at="last").float()
        else:
            every = extend(self.tr, self.cache, tokens, n_new=n_new, layers=self.layers, logits_at="all", rows=rows)
            last = (n_new if n_new is not None else torch.full_like(self.cache.lengths, tokens.shape[1])) - 1
            logits = every[torch.arange(tokens.shape[0], device=every.device), last.clamp(min=0)].float()
        V = self.vocab_size
        if logits.shape[-1] > V:  # a draft with a larger (padded) embedding: never propose ids the target lacks
            logits = logits[:, :V]
        elif logits.shape[-1] < V:
            logits = torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))
        return logits

    def _pick(self, logits: torch.Tensor, ctx: DraftContext):
        if ctx.sampler is None:
            return logits.argmax(-1), None
        q = ctx.sampler.probs(logits)
        # one uniform per row: from the one generator, or from row b's own (a list, engine.generate's contract)
        gen = ctx.generator
        u = torch.rand(q.shape[0], device=q.device) if gen is None else draw_uniforms(gen, q.shape[0], q.device)
        return inverse_cdf(q, u), q

    def _propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        device = self.tr.device
        lengths = self.cache.lengths.tolist()
        # finished rows riding along skip the linear layers when that pays and is exact (`engine.live_rows`)
        rows = None if ctx.active is None else live_rows(self.tr, ctx.active.tolist())
        unseen = [seq[n:] for seq, n in zip(ctx.tokens, lengths)]
        logits = None
        while any(unseen):
            # catch up on every unseen token, all rows in one ragged forward; each row writes scratch up to
            # the widest row's length, so the width is capped by the room left (more forwards only then)
            room = max(self.cache.room(), 1)
            chunk = [u[:room] for u in unseen]
            n_new = torch.tensor([len(c) for c in chunk], dtype=torch.long, device=device)
            tokens = torch.zeros(len(chunk), int(n_new.max()), dtype=torch.long)
            for b, c in enumerate(chunk):
                if c:
                    tokens[b, : len(c)] = torch.tensor(c)
            step_logits = self._logits(tokens.to(device), n_new, rows)
            # rows that fed nothing keep the logits of an earlier chunk (only finished rows feed nothing)
            logits = step_logits if logits is None else torch.where((n_new > 0)[:, None], step_logits, logits)
            unseen = [u[room:] for u in unseen]
        self._base = self.cache.lengths.clone()
        drafts, probs = [], []
        for i in range(k):
            token, q = self._pick(logits, ctx)
            drafts.append(token)
            probs.append(q)
            if i < k - 1:
                logits = self._logits(token[:, None], rows=rows)
        return DraftProposal(tokens=torch.stack(drafts, 1),
                             probs=None if ctx.sampler is None else torch.stack(probs, 1))

    def relative_cost(self, target) -> float:
        """Weights a drafted token reads over those a target token (a Transformer) reads, layers run and LM head:
        a draft forward's cost in target forwards where decoding is weight-bound (a policy's prior)."""
        return weight_bytes(self.tr, self.layers) / weight_bytes(target)

    def rollback(self, n_accepted: torch.Tensor) -> None:
        # the cache holds base + (k - 1) drafts; keep the accepted ones (the k-th was never fed)
        fed = self.cache.lengths - self._base
        self.cache.truncate(self._base + torch.minimum(n_accepted.to(fed), fed))


def weight_bytes(tr, layers=None) -> int:
    """Bytes of the weights a token's forward through Transformer `tr` reads: `layers` (None: all), LM head."""
    run = tr.layers if layers is None else [tr.layers[i] for i in layers]
    return sum(p.numel() * p.element_size() for module in [*run, tr.lm_head] for p in module.parameters())


def default_skip_layers(n_layers: int) -> list[int]:
    """The layer-skip drafter's layers when none are given: all but two, the ones at 1/3 and 2/3 depth."""
    return [i for i in range(n_layers) if i not in (n_layers // 3, 2 * n_layers // 3)]


class LayerSkipDrafter(CachedModelDrafter):
    """Self-speculation without training: the target's own `layers` (a subset, in order; None:
    `default_skip_layers`) + its final norm and LM head, with a KV cache of len(layers) slots (Draft & Verify,
    Zhang et al. 2023)."""

    def __init__(self, model, layers=None):
        tr = getattr(model, "transformer", model)
        layers = default_skip_layers(tr.n_layers) if layers is None else list(layers)
        if not layers or any(not 0 <= i < tr.n_layers for i in layers) or layers != sorted(set(layers)):
            raise ValueError(f"layers={layers!r} must be a non-empty increasing list of indices in [0, {tr.n_layers})")
        super().__init__(tr, layers=layers, name="layer_skip")


class ModelDrafter(CachedModelDrafter):
    """Any causal LM sharing the target's tokenizer drafts autoregressively (Leviathan et al. 2023)."""

    def __init__(self, draft, target):
        check_same_tokenizer(target, draft)
        super().__init__(draft.transformer, target_vocab_size=target.transformer.vocab_size, name="draft_model")
        self.model = draft


def make_drafter(name: str, target, **options):
    """Build a drafter by name, with the defaults for every option left out (or None):
    "ngram" (max_ngram, min_ngram, match: `NGramDrafter`'s), "layer_skip" (layers: `default_skip_layers`),
    "draft_model" (draft: a LoadedModel sharing the tokenizer, else draft_layers: the depth of a truncated
    copy of the target, `draft_models.default_draft_layers` when None)."""
    if name == "ngram":
        return NGramDrafter(**{k: v for k, v in options.items() if k in ("max_ngram", "min_ngram", "match")})
    if name == "layer_skip":
        return LayerSkipDrafter(target, options.get("layers"))
    if name == "draft_model":
        draft = options.get("draft")
        if draft is None:
            draft = draft_model_for(target, n_layers=options.get("draft_layers"))
        return ModelDrafter(draft, target)
    raise ValueError(f"drafter={name!r} is unknown; allowed: 'ngram', 'layer_skip', 'draft_model' "
                     "(MTP heads: decodelab.mtp.drafter; the sparse-KV self-draft: decodelab.speculation.sparse_draft)")
