"""Shared-prefix decoding: n samples of one prompt read the prompt's KV once (Hydragen-style attention).

Self-consistency samples n continuations of the same prompt. A plain batch (or transformers'
`generate(num_return_sequences=n)`) prefills the prompt n times and stores n copies of its KV. Here the
prompt is prefilled once (one row per distinct prompt) and forked: each of the n rows keeps only its own
suffix KV, and attention splits in two (Hydragen, Juravsky et al. 2024; FlashInfer cascade attention):

- prefix part: the queries of all n rows of a prompt are stacked and multiplied with the prompt's keys
  once, (K, n*G*T, D) @ (K, D, S_p); suffix part: each row against its own suffix, as usual;
- the two partial softmaxes are merged exactly with their log-sum-exps (see `merge_attention`).

`SharedPrefixKVCache` is an `AttentionCache`, so `Transformer.forward` and `engine.decode_step` run on it unchanged.

Shapes: P distinct prompts, B = sum of n_p rows (the rows of prompt p are contiguous), H query heads,
K key/value heads, G = H / K, T new tokens per row, S_p prefix positions, S_s suffix positions, D head dim.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from decodelab.core.kv_cache import ForwardPlan, KVCache, causal_visible, check_truncate, grouped_mask


def partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one block of keys, returning the block's log-sum-exp too.

    q: (..., M, D); keys, values: (..., S, D); visible: broadcastable to (..., M, S) bool, or None when every
    key is visible -> out (..., M, D), lse (..., M, 1).

    out = softmax(s) @ v over visible keys and lse = log sum_j exp(s_j), with s = scale * q k^T.
    A query that sees no key in this block gets out = 0 and lse = -inf, so it carries zero weight
    in the merge (no NaN from softmax over an empty set). Half-precision inputs are computed in float32
    (as fused attention kernels accumulate) and the output cast back; lse stays float32.
    """
    out_dtype = q.dtype
    if q.dtype in (torch.float16, torch.bfloat16):
        q, keys, values = q.float(), keys.float(), values.float()
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if visible is not None:  # None: every key visible (a shared prompt seen whole), no masking work
        scores = scores.masked_fill(~visible, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)  # a row seeing no key: 0, not -inf
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, values) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return out.to(out_dtype), peak + torch.log(total)


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`partial_attention`'s (out, lse) for 4-D inputs, through PyTorch's fused CPU flash kernel (which also
    returns the lse) on CPU, float32 and bf16 (float32 accumulation and lse, no float32 copy of the prompt KV:
    129 against 1293 us at 48 queries x 1024 keys x 3 KV heads, quiet Intel Xeon); float16 keeps the explicit
    path. A query that sees no key gets lse = -inf (the kernel returns 0): zero weight in the merge."""
    kernel = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if kernel is None or q.device.type != "cpu" or q.dtype == torch.float16 or q.dim() != 4:
        return partial_attention(q, keys, values, visible, scale)
    bias = None
    if visible is not None:
        bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out, lse = kernel(q, keys, values, attn_mask=bias, scale=scale)
    lse = lse[..., None]
    if visible is not None:
        lse = lse.masked_fill(~visible.any(dim=-1, keepdim=True), float("-inf"))
    return out, lse


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Exact softmax over the union of two disjoint key blocks from their partial results.

    With Z_a = sum_{j in a} exp(s_j) = exp(lse_a) (same for b), attention over a u b is
        (sum_{a} e^{s_j} v_j + sum_{b} e^{s_j} v_j) / (Z_a + Z_b)
      = w_a * out_a + (1 - w_a) * out_b,   w_a = Z_a / (Z_a + Z_b) = sigmoid(lse_a - lse_b),
    i.e. out_b + w_a * (out_a - out_b): only the lse difference is exponentiated (no overflow), and an empty
    block (lse = -inf) gets weight exactly 0. out: (..., M, D), lse: (..., M, 1).
    """
    return torch.addcmul(out_b, torch.sigmoid(lse_a - lse_b), out_a - out_b)


def _fold_heads(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, H, T, D) -> (B, K, G*T, D): the G query heads sharing a KV head become extra queries."""
    batch, n_heads, n_new, head_dim = q.shape
    return q.reshape(batch, n_kv, (n_heads // n_kv) * n_new, head_dim)


def shared_prefix_attention(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                            suffix_k: torch.Tensor, suffix_v: torch.Tensor, suffix_mask: torch.Tensor,
                            *, row_counts, prefix_mask: torch.Tensor | None = None,
                            scale: float | None = None) -> torch.Tensor:
    """Attention of B rows over [their prompt's shared prefix KV ; their own suffix KV].

    q: (B, H, T, D); prefix_k, prefix_v: (P, K, S_p, D); prefix_mask: (P, S_p) bool (None = all valid;
    every suffix query sees the whole valid prefix); suffix_k, suffix_v: (B, K, S_s, D);
    suffix_mask: (B, T, S_s) bool (query t of row b sees suffix slot j), or already folded by
    `kv_cache.grouped_mask` (B, 1, G*T, S_s) (the cache folds it once per forward), or None (every query
    sees every suffix slot: a decode step of rows of equal length, no masking work); row_counts: P ints summing to B,
    rows of prompt p are rows [sum(row_counts[:p]), sum(row_counts[:p+1])). -> (B, H, T, D).

    Equal to standard attention over the concatenated keys (up to float rounding; see `merge_attention`).
    """
    batch, n_heads, n_new, head_dim = q.shape
    n_prompts, n_kv, prefix_len, _ = prefix_k.shape
    row_counts = [int(c) for c in row_counts]
    if len(row_counts) != n_prompts or sum(row_counts) != batch or min(row_counts) < 1:
        raise ValueError(
            f"row_counts={row_counts} must hold {n_prompts} positive counts (one per prompt) summing to B={batch}"
        )
    if n_heads % n_kv:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = n_heads // n_kv
    folded = _fold_heads(q, n_kv)  # (B, K, G*T, D)

    # Prefix: stack the n_p rows' queries of prompt p -> (K, n_p*G*T, D), one product with its keys.
    if len(set(row_counts)) == 1:  # uniform n: all prompts in one batched product (P, K, n*G*T, D)
        n = row_counts[0]
        stacked = folded.reshape(n_prompts, n, n_kv, group * n_new, head_dim).transpose(1, 2)
        stacked = stacked.reshape(n_prompts, n_kv, n * group * n_new, head_dim)
        visible = None if prefix_mask is None else prefix_mask[:, None, None, :]
        out_p, lse_p = block_attention(stacked, prefix_k, prefix_v, visible, scale)
        out_p = out_p.reshape(n_prompts, n_kv, n, -1, head_dim).transpose(1, 2).reshape(batch, n_kv, -1, head_dim)
        lse_p = lse_p.reshape(n_prompts, n_kv, n, group * n_new, 1).transpose(1, 2).reshape(batch, n_kv, -1, 1)
    else:  # ragged n: one product per prompt
        outs, lses, start = [], [], 0
        for p, n in enumerate(row_counts):
            stacked = folded[start:start + n].transpose(0, 1).reshape(1, n_kv, n * group * n_new, head_dim)
            visible = None if prefix_mask is None else prefix_mask[p][None, None, None, :]
            out, lse = block_attention(stacked, prefix_k[p:p + 1], prefix_v[p:p + 1], visible, scale)
            outs.append(out.reshape(n_kv, n, group * n_new, head_dim).transpose(0, 1))
            lses.append(lse.reshape(n_kv, n, group * n_new, 1).transpose(0, 1))
            start += n
        out_p, lse_p = torch.cat(outs), torch.cat(lses)

    # Suffix: each row against its own keys; the mask (B, T, S_s) repeats over the G folded heads.
    mask = suffix_mask if suffix_mask is None or suffix_mask.dim() == 4 else grouped_mask(suffix_mask, group)
    out_s, lse_s = block_attention(folded, suffix_k, suffix_v, mask, scale)

    wide = lse_p.dtype  # float32 for half-precision inputs, else the input dtype
    out = merge_attention(out_p.to(wide), lse_p, out_s.to(wide), lse_s).to(q.dtype)
    return out.reshape(batch, n_heads, n_new, head_dim)


class SharedPrefixKVCache:
    """A KV cache whose rows share their prompt's KV: prefix (n_layers, P, K, S_p, D) held once per distinct
    prompt, suffix (n_layers, B, K, S_s, D) per row.

    Same interface as `KVCache` for `Transformer.forward`: row b's absolute positions (for RoPE) continue
    after its prompt, `lengths[b] = prefix_len[prompt of b] + suffix length`. Writes go to the suffix only;
    truncating into the prompt is refused (the prompt is shared, a row cannot roll it back).
    Build one with `fork(prefix_cache, row_counts, max_new_tokens)` after prefilling the P prompts.
    """

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor, prefix_lengths: torch.Tensor,
                 row_counts, max_new_tokens: int):
        row_counts = [int(c) for c in row_counts]
        n_layers, n_prompts, n_kv, _, head_dim = prefix_keys.shape
        if len(row_counts) != n_prompts or min(row_counts, default=0) < 1:
            raise ValueError(f"row_counts={row_counts} must hold one count >= 1 per prompt ({n_prompts} prompts)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be >= 1")
        device = prefix_keys.device
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values
        self.prefix_lengths = prefix_lengths.to(device=device, dtype=torch.long)
        self.row_counts = row_counts
        self.row_prompt = torch.repeat_interleave(
            torch.arange(n_prompts, device=device), torch.tensor(row_counts, device=device))
        shape = (n_layers, sum(row_counts), n_kv, max_new_tokens, head_dim)
        self.suffix_keys = torch.zeros(shape, dtype=prefix_keys.dtype, device=device)
        self.suffix_values = torch.zeros(shape, dtype=prefix_keys.dtype, device=device)
        self._row_prefix = self.prefix_lengths[self.row_prompt]  # (B,)
        self.lengths = self._row_prefix.clone()
        self._rows = torch.arange(sum(row_counts), device=device)
        mask = torch.arange(prefix_keys.shape[3], device=device)[None, :] < self.prefix_lengths[:, None]
        self._prefix_mask = None if bool(mask.all()) else mask  # None: all prompts equally long, nothing to mask

    @classmethod
    def fork(cls, prefix_cache: KVCache, row_counts, max_new_tokens: int) -> "SharedPrefixKVCache":
        """Fork the P rows of a prefilled `KVCache` into row_counts[p] rows each; the prompt KV is not copied
        (the new cache holds views of `prefix_cache`'s tensors, up to its longest prompt)."""
        span = int(prefix_cache.lengths.max())
        keys, values = prefix_cache.keys[:, :, :, :span], prefix_cache.values[:, :, :, :span]
        return cls(keys, values, prefix_cache.lengths, row_counts, max_new_tokens)

    def select(self, rows: torch.Tensor | list[int]) -> "SharedPrefixKVCache":
        """A new cache holding only `rows` (increasing, so each prompt's rows stay contiguous): their suffixes
        are copied, prompts left without a row are dropped, and the kept prompts' KV stays shared (a view when
        every prompt keeps a row). This is what lets the token loop drop finished rows (compaction)."""
        rows = [int(r) for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)]
        if rows != sorted(set(rows)) or (rows and not 0 <= rows[0] <= rows[-1] < self.batch_size):
            raise ValueError(f"select(rows={rows}) needs increasing distinct rows in [0, {self.batch_size})")
        device = self.lengths.device
        index = torch.tensor(rows, device=device, dtype=torch.long)
        old_prompt = self.row_prompt[index]
        kept_prompts = sorted(set(old_prompt.tolist()))
        out = SharedPrefixKVCache.__new__(SharedPrefixKVCache)
        chosen = torch.tensor(kept_prompts, device=device, dtype=torch.long)
        whole = len(kept_prompts) == self.n_prompts  # every prompt keeps a row: its KV stays a view
        out.prefix_keys = self.prefix_keys if whole else self.prefix_keys[:, chosen]
        out.prefix_values = self.prefix_values if whole else self.prefix_values[:, chosen]
        renumber = {p: i for i, p in enumerate(kept_prompts)}
        out.prefix_lengths = self.prefix_lengths[chosen]
        out.row_prompt = torch.tensor([renumber[p] for p in old_prompt.tolist()], device=device, dtype=torch.long)
        out.row_counts = [int((out.row_prompt == i).sum()) for i in range(len(kept_prompts))]
        out.suffix_keys, out.suffix_values = self.suffix_keys[:, index].clone(), self.suffix_values[:, index].clone()
        out._row_prefix, out.lengths = self._row_prefix[index].clone(), self.lengths[index].clone()
        out._rows = torch.arange(len(rows), device=device)
        mask = torch.arange(out.prefix_keys.shape[3], device=device)[None, :] < out.prefix_lengths[:, None]
        out._prefix_mask = None if bool(mask.all()) else mask
        return out

    @property
    def batch_size(self) -> int:
        return self.suffix_keys.shape[1]

    @property
    def n_prompts(self) -> int:
        return self.prefix_keys.shape[1]

    @property
    def max_len(self) -> int:
        """Longest row this cache can hold: longest prompt + suffix capacity."""
        return self.prefix_keys.shape[3] + self.suffix_keys.shape[3]

    def _per_position_bytes(self) -> int:
        layers, _, n_kv, _, head_dim = self.suffix_keys.shape
        return layers * n_kv * head_dim * self.suffix_keys.element_size() * 2

    def nbytes(self) -> int:
        """Bytes allocated for keys and values: one prefix per prompt + every row's suffix capacity."""
        positions = self.prefix_keys.shape[1] * self.prefix_keys.shape[3] + self.batch_size * self.suffix_keys.shape[3]
        return positions * self._per_position_bytes()

    def used_nbytes(self) -> int:
        """Bytes of valid keys and values: each prompt once + each row's suffix (analytic shared KV size)."""
        suffix = int((self.lengths - self._row_prefix).sum())
        return (int(self.prefix_lengths.sum()) + suffix) * self._per_position_bytes()

    def positions(self, n_tokens: int) -> torch.Tensor:
        """Absolute positions of the next `n_tokens` of each row: (B, T)."""
        return self.lengths[:, None] + torch.arange(n_tokens, device=self.lengths.device)

    def _check_prompt(self, new_lengths: torch.Tensor) -> torch.Tensor:
        if bool((new_lengths < self._row_prefix).any()):
            raise ValueError(f"truncate to {new_lengths.tolist()} falls below a row's prompt length "
                             f"{self._row_prefix.tolist()}: the shared prompt KV cannot be rolled back per row")
        return new_lengths

    def advance(self, n_new: torch.Tensor) -> None:
        """Count n_new (B,) freshly written positions of each row as valid."""
        self.lengths = self.lengths + n_new.to(self.lengths)

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll rows back to new_lengths (B,), never below a row's prompt length nor above its length."""
        self.lengths = self._check_prompt(check_truncate(new_lengths, self.lengths))

    def begin_forward(self, positions: torch.Tensor, group: int = 1) -> ForwardPlan:
        """positions (B, T) absolute -> the plan: suffix slots, span, and the suffix mask folded for `group`
        query heads per KV head; query t of row b sees suffix slot j iff j <= its slot."""
        slots = positions - self._row_prefix[:, None]
        span = int(slots[:, -1].max()) + 1  # the one host sync of a forward
        if span > self.suffix_keys.shape[3]:
            raise ValueError(f"shared-prefix cache overflow: need {span} suffix positions, "
                             f"capacity max_new_tokens={self.suffix_keys.shape[3]}")
        if bool((slots[:, 0] < 0).any()):
            raise ValueError("a shared-prefix cache only appends after the prompt; positions fall inside it")
        plan = ForwardPlan(positions=positions, slots=slots, span=span, visible=causal_visible(span, slots))
        plan.grouped_mask(group)
        return plan

    def attend(self, slot: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               plan: ForwardPlan) -> torch.Tensor:
        """Write this call's keys/values into each row's suffix, attend over [shared prompt ; own suffix].

        q: (B, H, T, D); k_new, v_new: (B, K, T, D); plan: from `begin_forward` -> (B, H, T, D).
        """
        keys, values = self.suffix_keys[slot], self.suffix_values[slot]
        rows = self._rows[:, None]
        keys[rows, :, plan.slots] = k_new.transpose(1, 2)
        values[rows, :, plan.slots] = v_new.transpose(1, 2)
        span = plan.span
        group = q.shape[1] // keys.shape[1]
        # None when every row sees its whole suffix (the plan checks once per forward, not per layer).
        mask = None if plan.attention_bias(group, q.dtype) is None else plan.grouped_mask(group)
        return shared_prefix_attention(
            q, self.prefix_keys[slot], self.prefix_values[slot], keys[:, :, :span], values[:, :, :span],
            mask, row_counts=self.row_counts, prefix_mask=self._prefix_mask)


@dataclass
class SampleResult:
    """n samples per prompt. Rows are grouped by prompt: row_prompt[b] is the prompt row b continues."""

    tokens: list[list[int]]  # new tokens per row, EOS included when hit, nothing after it
    logprobs: list[float]  # sum over each row's kept tokens of log p_model(token) (temperature 1, unfiltered)
    finished: list[bool]
    row_prompt: list[int]
    stats: object  # engine.DecodeStats
    kv_bytes: int  # analytic KV bytes holding valid positions at the end (cache.used_nbytes())
    cache_bytes: int  # measured: bytes of the storage behind the cache's key/value tensors (`cache_bytes`)


def expand_counts(n, n_prompts: int) -> list[int]:
    """n (int, same for every prompt) or one int per prompt -> list of P counts, each >= 1."""
    counts = [n] * n_prompts if isinstance(n, int) else [int(c) for c in n]
    if len(counts) != n_prompts:
        raise ValueError(f"n={n!r} must be an int or one count per prompt ({n_prompts} prompts)")
    if min(counts, default=1) < 1:
        raise ValueError(f"n={n!r}: every prompt needs n >= 1 samples")
    return counts


@torch.no_grad()
def generate_shared(model, prompts: list[list[int]], n, *, max_new_tokens: int = 64, sampler=None,
                    generator=None, eos_token_ids: list[int] | None = None, shared: bool = True,
                    progress: bool = False, return_logprobs: bool = True) -> SampleResult:
    """Sample n continuations of each prompt, prefilling each prompt once (shared=True).

    prompts: P token lists; n: int or P ints; generator: one torch.Generator or one per row (B = sum n).
    The decode loop is `engine.generate`'s, started from our own prefill, so with the same per-row
    generators the tokens equal `engine.generate(prompts repeated n times)`. shared=False prefills every
    repeated prompt into a plain KVCache (the unshared reference). return_logprobs=False skips the log-prob
    bookkeeping (logprobs None), for cost runs against decoders that do not compute it."""
    from decodelab.core import engine

    engine.validate_generation_args(prompts, max_new_tokens)
    counts = expand_counts(n, len(prompts))
    tr = engine.as_transformer(model)
    row_prompt = [p for p, count in enumerate(counts) for _ in range(count)]
    rows = [prompts[p] for p in row_prompt]

    engine.synchronize(tr.device)
    start = time.perf_counter()
    if shared:
        prefix_cache, logits = engine.prefill(tr, prompts, max_new_tokens=0)
        cache = SharedPrefixKVCache.fork(prefix_cache, counts, max_new_tokens)
        logits = logits[cache.row_prompt]
    else:
        cache, logits = engine.prefill(tr, rows, max_new_tokens=max_new_tokens)
    engine.synchronize(tr.device)
    prefill_s = time.perf_counter() - start
    result = engine.generate(model, rows, max_new_tokens=max_new_tokens, sampler=sampler, generator=generator,
                             eos_token_ids=eos_token_ids, progress=progress, prefilled=(cache, logits),
                             return_logprobs=return_logprobs)
    result.stats.prefill_s += prefill_s
    return SampleResult(tokens=result.tokens, logprobs=result.logprobs, finished=result.finished,
                        row_prompt=row_prompt, stats=result.stats, kv_bytes=cache.used_nbytes(),
                        cache_bytes=cache_bytes(cache))


def cache_tensors(cache) -> list[torch.Tensor]:
    """The key/value tensors a cache holds: a `SharedPrefixKVCache` (prefix + suffix), a `KVCache`, a
    transformers `Cache` (`DynamicCache`: `.layers[i].keys/.values`; older versions `.key_cache/.value_cache`)
    or the legacy tuple of (key, value) per layer."""
    if isinstance(cache, SharedPrefixKVCache):
        return [cache.prefix_keys, cache.prefix_values, cache.suffix_keys, cache.suffix_values]
    if isinstance(cache, KVCache):
        return [cache.keys, cache.values]
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if isinstance(t, torch.Tensor)]
    if hasattr(cache, "key_cache"):
        return [t for t in (*cache.key_cache, *cache.value_cache) if isinstance(t, torch.Tensor)]
    if isinstance(cache, (tuple, list)):
        return [t for layer in cache for t in layer if isinstance(t, torch.Tensor)]
    raise TypeError(f"cache of type {type(cache).__name__} is not a SharedPrefixKVCache, KVCache, "
                    "transformers Cache or tuple of (key, value) per layer")


def storage_bytes(tensors) -> int:
    """Bytes of the memory behind `tensors`, each storage counted once: a view of a tensor already counted
    (the shared prompt KV that forked rows read) adds nothing, a view of a larger buffer counts the buffer."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def cache_bytes(cache) -> int:
    """Measured KV bytes of a cache: the storage behind its key/value tensors (see `cache_tensors`)."""
    return storage_bytes(cache_tensors(cache))


def kv_bytes_per_token(model) -> int:
    """Analytic KV bytes one position costs: 2 (K and V) * layers * KV heads * head dim * element size."""
    from decodelab.core import engine

    tr = engine.as_transformer(model)
    return 2 * tr.n_layers * tr.n_kv_heads * tr.head_dim * torch.empty((), dtype=tr.dtype).element_size()


def analytic_kv_bytes(per_token: int, prompt_len: int, n: int, new_tokens: int, *, shared: bool) -> int:
    """Analytic KV bytes of n samples of one prompt: shared (P + n*new) or unshared n*(P + new) positions.
    A formula, not a measurement: `cache_bytes` measures what a cache actually holds."""
    positions = prompt_len + n * new_tokens if shared else n * (prompt_len + new_tokens)
    return positions * per_token
