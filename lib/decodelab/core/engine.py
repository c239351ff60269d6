"""The decode engine: batched prefill, one decode step, a multi-token verify step, and THE token loop.

Every decoder of the suite runs `run_loop` (prefill -> pick -> stop/EOS bookkeeping -> forward); what
differs between them is a `LoopPolicy`: plain sampling (`generate` here), speculative and MTP
self-speculative decoding (`speculation.decode`), constrained decoding with jump-forward and
free-until-the-JSON-closes sampling (`constrained.decode`). The engine knows nothing about drafters,
grammars or votes. Rows are ragged: each has its own prompt length and its own cache length, so a row can
advance (`cache.advance`) or roll back (`cache.truncate`) on its own.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from decodelab.core.decode_stats import DecodeStats, GenerationResult
from decodelab.core.draw import chosen_logprob, pick_tokens  # noqa: F401  (engine.pick_tokens: public here too)
from decodelab.core.kv_cache import KVCache
from decodelab.core.loop_policy import Feed, LoopPolicy, PolicyBase  # noqa: F401  (engine.Feed etc.: public here)
from decodelab.core.static_step import static_step_for
from decodelab.core.transformer import Transformer
from decodelab.core.verify_width import pad_tokens, padded_width


def as_transformer(model) -> Transformer:
    """Accept a LoadedModel or a Transformer."""
    return model if isinstance(model, Transformer) else model.transformer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # CPU ops are synchronous
        torch.cuda.synchronize(device)


def pad_prompts(prompts: list[list[int]], device: torch.device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ragged prompts: -> tokens (B, T_max) long, lengths (B,) long."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    tokens = torch.full((len(prompts), int(lengths.max())), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
    return tokens.to(device), lengths.to(device)


def prefill(model, prompts: list[list[int]], *, max_new_tokens: int, extra: int = 0,
            cache: KVCache | None = None, layers=None, return_hidden: bool = False):
    """Run ragged prompts through the model: -> (cache, logits of each row's last prompt token (B, V)),
    and with return_hidden also the final-normed hidden states of every prompt position (B, T, E).

    The cache is sized for the longest prompt + max_new_tokens + extra (room for speculative drafts).
    """
    tr = as_transformer(model)
    tokens, lengths = pad_prompts(prompts, tr.device)
    if cache is None:
        n_layers = None if layers is None else len(layers)
        cache = tr.new_cache(len(prompts), tokens.shape[1] + max_new_tokens + extra, n_layers=n_layers)
    out = tr.forward(tokens, cache, n_new=lengths, layers=layers, logits_at="last", return_hidden=return_hidden)
    return (cache, *out) if return_hidden else (cache, out)


def extend(model, cache, tokens: torch.Tensor, *, n_new: torch.Tensor | None = None, layers=None,
           logits_at: str = "all", return_hidden: bool = False, rows: torch.Tensor | None = None):
    """Append tokens (B, T) to each row of `cache` (n_new (B,) valid per row, right padding past it is scratch)
    and score them: the one way research code runs the model forward. logits_at: "all" (B, T, V), "last"
    (B, V) at each row's last valid token, "none". With return_hidden also the final-normed hidden (B, T, E).
    rows: only these rows' outputs are computed (`Transformer.forward`); the others' logits are zeros."""
    return as_transformer(model).forward(tokens, cache, n_new=n_new, layers=layers, logits_at=logits_at,
                                         return_hidden=return_hidden, rows=rows)


def extend_last(model, cache, tokens: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
    """Append each row's n_new (B,) tokens of tokens (B, T) (right-padded) -> logits after each row's last
    new token (B, V). A row may pass n_new = 0 (a finished row still in the batch): it writes one scratch
    position that is truncated away again, and its logits are meaningless."""
    if tokens.shape[1] == 1 and bool((n_new == 1).all()):
        return extend(model, cache, tokens, logits_at="all")[:, 0]
    safe = torch.clamp(n_new, min=1)
    logits = extend(model, cache, tokens, n_new=safe, logits_at="last")
    cache.truncate(cache.lengths - (safe - n_new))
    return logits


def decode_step(model, cache: KVCache, tokens: torch.Tensor, *, layers=None) -> torch.Tensor:
    """Append one token per row: tokens (B,) -> next-token logits (B, V)."""
    return extend(model, cache, tokens[:, None], layers=layers, logits_at="all")[:, 0]


def verify_step(model, cache: KVCache, tokens: torch.Tensor, *, layers=None, return_hidden: bool = False,
                widths: dict[int, int] | None = None, rows: torch.Tensor | None = None):
    """Append T tokens per row and score each: tokens (B, T) -> logits (B, T, V).

    logits[:, t] is the distribution after tokens[:, :t+1]. Every row advances by T; the caller rolls
    rejected positions back with `cache.truncate`. widths: a calibrated {T: W} table (`core.verify_width`):
    run the forward padded to the cheaper width W >= T (same real logits and cache; plain KVCache only).
    rows: only these rows' logits are computed (finished rows riding along: see `live_rows`).
    """
    n_tokens, width = tokens.shape[1], padded_width(tokens.shape[1], widths, cache)
    if width == n_tokens:
        return extend(model, cache, tokens, layers=layers, logits_at="all", return_hidden=return_hidden, rows=rows)
    # the plain causal forward at W (a ragged n_new takes the slower masked path), rolled back to T after; the
    # LM head runs at W rows too: at T rows it would pay the very matmul-shape penalty the padding avoids
    # (measured: a padded T=2 verify unembedding 2 rows took 57 ms where the same forward at W=6 took 37)
    advanced = cache.lengths + n_tokens
    logits, hidden = extend(model, cache, pad_tokens(tokens, width), layers=layers, logits_at="all",
                            return_hidden=True, rows=rows)
    cache.truncate(advanced)
    logits, hidden = logits[:, :n_tokens], hidden[:, :n_tokens]
    return (logits, hidden) if return_hidden else logits


def validate_generation_args(prompts, max_new_tokens: int) -> None:
    """The one check of a generation's arguments (every decoder calls it before any work)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if prompts is not None and len(prompts) < 1:
        raise ValueError(f"batch size={len(prompts)} must be >= 1 (got no prompts)")


# -- the token loop ------------------------------------------------------------------------------------
LIVE_ROWS_BELOW = 0.75  # run the linear layers on the live rows alone once fewer than this share are live


def live_rows(model, alive: list[bool]) -> torch.Tensor | None:
    """The batch positions whose outputs a step needs, when skipping the others pays and is exact: fewer than
    LIVE_ROWS_BELOW of the rows are live and the model's linear path is row-invariant (`Transformer.forward`'s
    rows). Why: rows finish at different steps (EOS; each row accepting its own drafts), and a finished row
    riding along makes the slowest rows pay a full-batch forward to the end (measured at batch 64, code
    editing: the last dozen speculative steps decoded 2-18 live rows at the cost of 64). None = every row."""
    n_live, tr = sum(alive), as_transformer(model)
    if n_live >= LIVE_ROWS_BELOW * len(alive) or n_live == 0 or not tr.linear.enabled:
        return None
    return torch.tensor([i for i, a in enumerate(alive) if a], device=tr.device)


class TokenLoop:
    """Per-row state of one generation: emitted tokens, finished rows, a forced-token queue per row.

    rows: the prompt index of each batch row of the cache (compaction drops finished rows);
    sequences[r]: prompt + emitted tokens; pending[r]: this step's kept tokens, not yet in the cache.
    Forced tokens (`force`) join a row's output after its emitted tokens, without a sampler draw, and ride
    in the next forward with them.
    """

    def __init__(self, model, prompts, *, max_new_tokens: int, eos_token_ids, sampler=None, generator=None,
                 static_step=None, widths=None):
        self.model, self.tr = model, as_transformer(model)
        self.prompts = [list(p) for p in prompts]
        self.batch = len(prompts)
        if isinstance(generator, (list, tuple)) and len(generator) != self.batch:
            raise ValueError(f"generator: got a list of {len(generator)} generators, need one per row "
                             f"({self.batch} prompts)")
        self.max_new_tokens, self.eos = max_new_tokens, set(eos_token_ids)
        self.sampler, self.generator = sampler, generator
        self.rows = list(range(self.batch))
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.sequences = [list(p) for p in prompts]
        self.pending: list[list[int]] = [[] for _ in prompts]
        self.forced = [deque() for _ in prompts]
        self.done, self.finished = [False] * self.batch, [False] * self.batch
        self.cache = None
        self.forward_s: list[float] = []
        self.static_step = static_step  # a core.static_step.StaticStep for "step" feeds on a plain KVCache
        self.widths = widths  # a calibrated {T: W} table for "all" feeds (see verify_step)

    @property
    def device(self) -> torch.device:
        return self.tr.device

    @property
    def alive(self) -> list[int]:
        return [r for r in self.rows if not self.done[r]]

    def generators(self):
        """The generators of the current batch rows: a per-row list follows its rows; one shared is shared."""
        if isinstance(self.generator, (list, tuple)):
            return [self.generator[r] for r in self.rows]
        return self.generator

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """(B', V) -> (B',): greedy without a sampler, else one draw per current batch row (a logits hook,
        such as a grammar mask, runs in the policy before it calls pick)."""
        return pick_tokens(logits, self.sampler, self.generators())

    def force(self, row: int, tokens) -> None:
        """Queue tokens that `row` emits next without a sampler draw (jump-forward, injected text)."""
        self.forced[row].extend(tokens)

    def record(self, emitted: dict[int, list[int]], policy) -> None:
        """Append each alive row's emitted then forced tokens, cut at EOS or max_new_tokens; end rows."""
        for r in self.alive:
            kept = []
            for token in [*emitted.get(r, []), *self.forced[r]]:
                kept.append(token)
                if token in self.eos:
                    self.finished[r] = True
                if self.finished[r] or len(self.tokens[r]) + len(kept) >= self.max_new_tokens:
                    break
            self.forced[r].clear()
            self.tokens[r] += kept
            self.sequences[r] += kept
            self.pending[r] = kept
            if not self.finished[r] and policy.stopped(self, r):
                self.finished[r] = True
            self.done[r] = self.finished[r] or len(self.tokens[r]) >= self.max_new_tokens
        for r in self.rows:
            if self.done[r]:
                self.pending[r] = []

    def pending_batch(self, fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Each batch row's pending tokens, right-padded with `fill`: -> tokens (B', T), n_new (B',) long."""
        lengths = [len(self.pending[r]) for r in self.rows]
        tokens = torch.full((len(self.rows), max(max(lengths), 1)), fill, dtype=torch.long)
        for i, r in enumerate(self.rows):
            if lengths[i]:
                tokens[i, : lengths[i]] = torch.tensor(self.pending[r], dtype=torch.long)
        return tokens.to(self.device), torch.tensor(lengths, dtype=torch.long, device=self.device)

    def compact(self) -> None:
        """Drop finished rows from the batch once they are a quarter of it: they would otherwise ride along
        in every forward until the slowest row ends (on CPU a forward costs about linearly in the rows).
        `select` copies the kept rows' cache, so this runs O(log B) times per generation."""
        keep = [i for i, r in enumerate(self.rows) if not self.done[r]]
        if len(self.rows) - len(keep) >= max(1, len(self.rows) // 4):
            self.cache = self.cache.select(keep)
            self.rows = [self.rows[i] for i in keep]

    def forward(self, feed: Feed):
        """Run the policy's feed through the model: -> (logits, hidden or None)."""
        start = time.perf_counter()
        if feed.mode == "last":
            logits, hidden = extend_last(self.tr, self.cache, feed.tokens, feed.n_new), None
        elif feed.mode == "step" and self.static_step is not None and type(self.cache) is KVCache \
                and not feed.return_hidden and feed.rows is None:
            logits, hidden = self.static_step(self.cache, feed.tokens[:, 0]), None
        elif feed.mode in ("step", "all"):
            out = verify_step(self.tr, self.cache, feed.tokens, return_hidden=feed.return_hidden,
                              widths=self.widths if feed.mode == "all" else None, rows=feed.rows)
            logits, hidden = out if feed.return_hidden else (out, None)
            logits = logits[:, 0] if feed.mode == "step" else logits
        else:
            raise ValueError(f"Feed.mode={feed.mode!r} must be 'step', 'all' or 'last'")
        synchronize(self.device)
        self.forward_s.append(time.perf_counter() - start)
        return logits, hidden


def run_loop(*args, **kwargs) -> TokenLoop:
    """THE token loop, run to the end: `iter_loop`'s arguments -> the finished TokenLoop."""
    return drive(iter_loop(*args, **kwargs))


def drive(steps):
    """Run a step generator (`iter_loop`, `speculation.decode.generate_steps`) to its end -> its return value."""
    return side_by_side({0: steps})[0]


def side_by_side(runs: dict) -> dict:
    """{key: step generator} -> {key: its return value}, advancing the live generators one step each in
    turn (in the dict's order) until all have returned."""
    live, out = dict(runs), {}
    while live:
        for key in list(live):
            try:
                next(live[key])
            except StopIteration as stop:
                out[key] = stop.value
                del live[key]
    return out


@torch.inference_mode()  # not no_grad: ~2000 small ops a step skip their version/view bookkeeping (~5% at batch 1)
def iter_loop(model, prompts: list[list[int]], policy: LoopPolicy, *, max_new_tokens: int, stats: DecodeStats,
              eos_token_ids: list[int] | None = None, sampler=None, generator=None, prefilled=None,
              progress: bool = False, desc: str = "decode", compile: bool = False, widths=None):
    """THE token loop: prefill -> policy.first -> [feed -> forward -> accept -> record] until every row is done.

    A generator: it yields (None) after each timed step and returns the finished TokenLoop, so a benchmark
    can interleave several decodes step by step (`speculation.bench.run_methods`); `run_loop` runs it out.

    compile: one-token "step" feeds on a plain KVCache run the static-shape step (`core.static_step`),
    compiled with torch.compile; where no compiler works, a warning and the same step eagerly
    (`loop.static_step.status()` records which ran). widths: a {T: W} table for verify ("all") feeds.
    prefilled: (cache, last_logits (B, V)) from the caller's own prefill (its time is the caller's).
    eos_token_ids: tokens that end a row (default: the model's; [] = never stop early). Fills stats.prefill_s
    (prefill + first pick), stats.step_s (one per forward, top to bottom) and stats.new_tokens.
    """
    validate_generation_args(prompts, max_new_tokens)
    if eos_token_ids is None:
        eos_token_ids = getattr(model, "eos_token_ids", None) or []
    static_step = static_step_for(as_transformer(model), compile=True) if compile else None
    loop = TokenLoop(model, prompts, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, sampler=sampler,
                     generator=generator, static_step=static_step, widths=widths)
    synchronize(loop.device)
    start = time.perf_counter()
    if prefilled is None:
        loop.cache, logits = prefill(loop.tr, prompts, max_new_tokens=max_new_tokens, extra=policy.extra)
    else:
        loop.cache, logits = prefilled
    loop.record(policy.first(loop, logits), policy)
    policy.end_step(loop)
    synchronize(loop.device)
    stats.prefill_s += time.perf_counter() - start
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens, desc=f"{desc} B={loop.batch}", leave=False)
    while not all(loop.done):
        start = time.perf_counter()
        if policy.compact:
            loop.compact()
        logits, hidden = loop.forward(policy.feed(loop))
        loop.record(policy.accept(loop, logits, hidden), policy)
        policy.end_step(loop)
        synchronize(loop.device)
        stats.step_s.append(time.perf_counter() - start)
        if bar is not None:
            bar.update(max(0, max(map(len, loop.tokens)) - bar.n))
        yield
    if bar is not None:
        bar.close()
    stats.new_tokens = sum(map(len, loop.tokens))
    return loop


class SamplePolicy(PolicyBase):
    """Plain decoding: one picked token per row per forward; finished rows ride along (and keep drawing, so a
    shared generator's stream does not depend on when rows finish). Optionally sums log-probs."""

    def __init__(self, return_logprobs: bool = False):
        self.return_logprobs = return_logprobs
        self.logprobs: list[torch.Tensor] = []
        self.next_tokens = None

    def first(self, loop: TokenLoop, logits: torch.Tensor) -> dict[int, list[int]]:
        self.next_tokens = loop.pick(logits)
        if self.return_logprobs:
            self.logprobs.append(chosen_logprob(logits, self.next_tokens).cpu())
        return dict(zip(loop.rows, ([t] for t in self.next_tokens.tolist())))

    def feed(self, loop: TokenLoop) -> Feed:
        # greedy: rows that finished (EOS) ride along without their linear layers; sampled rows keep drawing
        # from real logits, so a shared generator's stream and each draw's cost stay as they were
        rows = live_rows(loop.model, [not loop.done[r] for r in loop.rows]) \
            if any(loop.done) and (loop.sampler is None or loop.sampler.is_greedy) else None
        return Feed(self.next_tokens[:, None], mode="step", rows=rows)

    def row_logprobs(self, loop: TokenLoop) -> list[float]:
        """Per row: the sum of log p(token) over its kept tokens."""
        table = torch.stack(self.logprobs, dim=1)  # (B, steps)
        return [float(table[row, : len(toks)].sum()) for row, toks in enumerate(loop.tokens)]


def generate(*args, **kwargs) -> GenerationResult:
    """Plain decoding run to the end: `generate_steps`' arguments -> its GenerationResult."""
    return drive(generate_steps(*args, **kwargs))


@torch.inference_mode()
def generate_steps(model, prompts: list[list[int]], *, max_new_tokens: int = 64, sampler=None, generator=None,
                   eos_token_ids: list[int] | None = None, progress: bool = False, prefilled=None,
                   return_logprobs: bool = False, compile: bool = False):
    """Batched decoding of ragged prompts with a KV cache (`iter_loop` with a `SamplePolicy`), as a generator
    over its steps (returns the GenerationResult) so a benchmark can step it beside another decode.

    sampler: a `decodelab.core.sampling.Sampler` (None = greedy argmax); generator: torch.Generator or a list
    of one per row. eos_token_ids: tokens that end a row (default: the model's; [] = never stop early).
    A row that finished keeps riding in the batch (its tokens are ignored); the loop ends when every row
    has finished or after max_new_tokens steps.
    prefilled: (cache, last_logits (B, V)) from the caller's own prefill (e.g. a shared-prefix cache with
    room for max_new_tokens); the prompts then only count prompt tokens and the caller times the prefill.
    return_logprobs: also sum each row's log softmax(logits)[token] over its tokens.
    compile: decode steps through the compiled static-shape step (see `run_loop`); result.compile says
    whether it compiled (for env.json).
    """
    validate_generation_args(prompts, max_new_tokens)
    stats = DecodeStats(batch_size=len(prompts), prompt_tokens=sum(len(p) for p in prompts))
    policy = SamplePolicy(return_logprobs)
    loop = yield from iter_loop(model, prompts, policy, max_new_tokens=max_new_tokens, stats=stats,
                                eos_token_ids=eos_token_ids, sampler=sampler, generator=generator, prefilled=prefilled,
                                progress=progress, compile=compile)
    logprobs = policy.row_logprobs(loop) if return_logprobs else None
    status = loop.static_step.status() if loop.static_step is not None else None
    return GenerationResult(tokens=loop.tokens, stats=stats, finished=loop.finished, logprobs=logprobs,
                            compile=status)
