"""Exact distributions over a small finite language L: the target p(x | x in L) and what masking samples.

A string s in L can be spelled by many token sequences (byte-level BPE: "yes" = [yes] = [y, es] = ...).
The model's probability of the string sums over all of them:

    p(s) = sum_{t : decode(t) = s} prod_i p(t_i | prompt, t_<i) * p(EOS | prompt, t)
    p(s | L) = p(s) / p(L),   p(L) = sum_{s in L} p(s)

Masked decoding samples token by token from the locally renormalized distribution: at a prefix t_<i
the mask keeps the tokens that can still end in L (every tokenization counts) plus EOS when the text
so far is in L, so

    q(t) = prod_i p(t_i | t_<i) / Z(t_<i),   Z(t_<i) = sum_{allowed a} p(a | t_<i),   q(s) = sum_t q(t)

and q != p(. | L) whenever the Z's differ between paths (Park et al., NeurIPS 2024).

All token sequences spelling a prefix of some s in L form a trie (`build_trie`); every node needs one
model evaluation. `score_trie` runs all of them in a few forward passes with tree attention: the prompt's
KV cache is computed once and each trie node attends to the prompt plus its own ancestors (the KV cache
is shared along the token tree), with RoPE position = prompt length + depth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from decodelab.core.engine import as_transformer, extend, prefill
from decodelab.core.tree_cache import TreeCache
from decodelab.workloads.prompts import user_prompt_ids

OFF_TOKENS = 256  # forbidden tokens kept per trie node for AWRS (the rest of their mass is one lump)


@dataclass
class TokenTrie:
    """Node 0 is the root (the empty continuation). Nodes are numbered parents-first."""

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])
    complete: list[str | None] = field(default_factory=lambda: [None])  # the string of L a node spells in full
    strings: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # filled by score_trie: log p(token | node) for each child token and for EOS (sum over stop ids)
    child_logp: list[dict[int, float]] | None = None
    eos_logp: list[float] | None = None
    # also filled by score_trie: the largest log-probs of tokens the mask forbids at each node (descending; EOS
    # of an incomplete node included): what AWRS draws and rejects, so its grammar checks can be counted
    off_logp: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def add_child(self, node: int, token: int) -> int:
        child = self.children[node].get(token)
        if child is None:
            child = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(node)
            self.depths.append(self.depths[node] + 1)
            self.children.append({})
            self.complete.append(None)
            self.children[node][token] = child
        return child

    def path(self, node: int) -> list[int]:
        """Token ids from the root to `node`."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def find(self, tokens: list[int]) -> int | None:
        node = 0
        for token in tokens:
            node = self.children[node].get(token)
            if node is None:
                return None
        return node

    @property
    def scored(self) -> bool:
        return self.child_logp is not None

    def allowed_logp(self, node: int) -> dict[int, float]:
        """log p of each token the mask allows at `node` (EOS under key -1 when the node completes a string)."""
        out = dict(self.child_logp[node])
        if self.complete[node] is not None:
            out[-1] = self.eos_logp[node]
        return out

    def log_z(self, node: int) -> float:
        """log Z(node): log of the probability mass the mask keeps at `node`."""
        return _logsumexp(list(self.allowed_logp(node).values()))


def _logsumexp(values: list[float]) -> float:
    if not values:
        return -math.inf
    top = max(values)
    if top == -math.inf:
        return -math.inf
    return top + math.log(sum(math.exp(v - top) for v in values))


def token_bytes_table(tokenizer, vocab_size: int | None = None) -> list[bytes | None]:
    """Each token id's bytes (None for special tokens): what the token spells in the output."""
    import xgrammar as xgr

    vocab_size = vocab_size or len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoded = info.decoded_vocab
    return [None if i in special or i >= len(decoded) or not decoded[i] else bytes(decoded[i])
            for i in range(vocab_size)]


def build_trie(strings: list[str], token_bytes: list[bytes | None], stop_token_ids: list[int], *,
               max_nodes: int = 20_000) -> TokenTrie:
    """The trie of every token sequence that spells a prefix of some string in `strings`.

    token_bytes[i]: token i's bytes (None = never used as text). A node spelling a whole string is
    marked complete (EOS allowed there). Raises ValueError past `max_nodes` (too many tokenizations).
    """
    if not strings:
        raise ValueError("strings=[] must hold at least one string")
    if len(set(strings)) != len(strings):
        duplicates = sorted({s for s in strings if strings.count(s) > 1})
        raise ValueError(f"strings must be distinct; duplicates: {duplicates}")
    by_bytes: dict[bytes, list[int]] = {}
    for token, piece in enumerate(token_bytes):
        if piece:
            by_bytes.setdefault(piece, []).append(token)
    longest = max(len(piece) for piece in by_bytes)
    trie = TokenTrie(strings=list(strings), stop_token_ids=list(stop_token_ids))

    def spell(node: int, rest: bytes, string: str) -> None:
        if not rest:
            trie.complete[node] = string
            return
        for size in range(1, min(longest, len(rest)) + 1):
            for token in by_bytes.get(rest[:size], ()):
                spell(trie.add_child(node, token), rest[size:], string)
                if len(trie) > max_nodes:
                    raise ValueError(
                        f"the token trie of strings={strings[:5]!r}... exceeds max_nodes={max_nodes}: too many "
                        "tokenizations to enumerate exactly; use shorter strings or raise max_nodes"
                    )

    for string in strings:
        spell(0, string.encode("utf-8"), string)
    missing = [s for s in strings if s not in set(c for c in trie.complete if c is not None)]
    if missing:
        raise ValueError(f"strings {missing!r} cannot be spelled with this vocabulary")
    return trie


@torch.inference_mode()
def score_trie(model, prompt: list[int], trie: TokenTrie, *, chunk_size: int = 256,
               off_tokens: int = OFF_TOKENS) -> TokenTrie:
    """Fill trie.child_logp / trie.eos_logp with the model's next-token log-probs at every node, and
    trie.off_logp with the `off_tokens` most likely forbidden tokens' log-probs.

    One prefill of the prompt, then ceil((N - 1) / chunk_size) tree-attention forwards. Returns the trie.
    """
    tr = as_transformer(model)
    n = len(trie)
    cache, root_logits = prefill(tr, [prompt], max_new_tokens=n)  # room for every trie node after the prompt
    tree = TreeCache(cache, len(prompt), trie.parents, trie.depths)
    logps = [torch.log_softmax(root_logits[0].float(), -1)]
    for start in range(1, n, chunk_size):
        stop = min(n, start + chunk_size)
        tree.set_chunk(start, stop)
        tokens = torch.tensor([trie.tokens[start:stop]], device=tr.device)
        logits = extend(tr, tree, tokens, logits_at="all")[0]
        logps.extend(torch.log_softmax(logits.float(), -1))
    stops = list(trie.stop_token_ids)
    trie.child_logp = []
    trie.eos_logp = []
    trie.off_logp = []
    for node, logp in enumerate(logps):
        kids = trie.children[node]
        ids = list(kids)
        values = logp[ids].tolist() if ids else []
        trie.child_logp.append(dict(zip(ids, values)))
        trie.eos_logp.append(float(torch.logsumexp(logp[stops], 0)))
        off = logp.clone()
        off[ids] = -math.inf
        if trie.complete[node] is not None:
            off[stops] = -math.inf  # EOS is allowed here (a whole string is spelled)
        trie.off_logp.append(torch.topk(off, min(off_tokens, off.numel())).values.tolist())
    return trie


@dataclass
class ExactDistributions:
    """Probabilities over L (dicts string -> probability, each summing to 1) and the mass of L."""

    strings: list[str]
    target: dict[str, float]            # p(s | L), all tokenizations
    target_canonical: dict[str, float]  # p(canonical(s)) renormalized over L: what canonical-only scoring gives
    masked: dict[str, float]            # q(s): masked sampling, all tokenizations allowed
    masked_canonical: dict[str, float]  # masked sampling when the mask keeps only canonical-token paths
    log_p_language: float               # log p(L) under unconstrained sampling
    n_tokenizations: dict[str, int]
    noncanonical_mass: float            # share of masked samples whose tokens are not the canonical ones

    def table(self):
        import pandas as pd

        return pd.DataFrame({
            "string": self.strings,
            "target": [self.target[s] for s in self.strings],
            "target_canonical": [self.target_canonical[s] for s in self.strings],
            "masked": [self.masked[s] for s in self.strings],
            "masked_canonical": [self.masked_canonical[s] for s in self.strings],
            "n_tokenizations": [self.n_tokenizations[s] for s in self.strings],
        })


def exact_distributions(trie: TokenTrie, canonical: dict[str, list[int]]) -> ExactDistributions:
    """Enumerate every complete path of a scored trie. canonical: string -> its canonical token ids."""
    if not trie.scored:
        raise ValueError("trie is not scored: call score_trie(model, prompt, trie) first")
    log_z = [trie.log_z(node) for node in range(len(trie))]
    # forward pass over nodes (parents first): log p(path) and log q(path) from the root
    log_p = [0.0] * len(trie)
    log_q = [0.0] * len(trie)
    for node in range(1, len(trie)):
        parent, token = trie.parents[node], trie.tokens[node]
        step = trie.child_logp[parent][token]
        log_p[node] = log_p[parent] + step
        log_q[node] = log_q[parent] + step - log_z[parent]
    p_string = {s: [] for s in trie.strings}
    q_string = {s: [] for s in trie.strings}
    for node, string in enumerate(trie.complete):
        if string is not None:
            p_string[string].append(log_p[node] + trie.eos_logp[node])
            q_string[string].append(log_q[node] + trie.eos_logp[node] - log_z[node])
    log_p_s = {s: _logsumexp(v) for s, v in p_string.items()}
    log_p_lang = _logsumexp(list(log_p_s.values()))
    target = {s: math.exp(v - log_p_lang) for s, v in log_p_s.items()}
    masked = {s: math.exp(_logsumexp(v)) for s, v in q_string.items()}

    canon_nodes = {}
    for s in trie.strings:
        node = trie.find(list(canonical[s]))
        if node is None or trie.complete[node] != s:
            raise ValueError(f"canonical tokens {canonical[s]} of {s!r} do not spell it in this trie")
        canon_nodes[s] = node
    canon_log_p = {s: log_p[canon_nodes[s]] + trie.eos_logp[canon_nodes[s]] for s in trie.strings}
    norm = _logsumexp(list(canon_log_p.values()))
    target_canonical = {s: math.exp(v - norm) for s, v in canon_log_p.items()}
    masked_canonical = _masked_on_paths(trie, canon_nodes)
    noncanonical = 1.0 - sum(
        math.exp(log_q[canon_nodes[s]] + trie.eos_logp[canon_nodes[s]] - log_z[canon_nodes[s]]) for s in trie.strings
    )
    return ExactDistributions(
        strings=list(trie.strings), target=target, target_canonical=target_canonical, masked=masked,
        masked_canonical=masked_canonical, log_p_language=log_p_lang,
        n_tokenizations={s: len(v) for s, v in p_string.items()}, noncanonical_mass=max(0.0, noncanonical),
    )


def _masked_on_paths(trie: TokenTrie, ends: dict[str, int]) -> dict[str, float]:
    """Masked sampling restricted to the sub-trie of the given paths (one end node per string)."""
    keep: set[int] = set()
    for node in ends.values():
        while node >= 0:
            keep.add(node)
            node = trie.parents[node]
    end_nodes = set(ends.values())
    out = {}
    for s, end in ends.items():
        path = []
        node = end
        while node > 0:
            path.append(node)
            node = trie.parents[node]
        logq = 0.0
        for child in reversed(path):
            parent = trie.parents[child]
            allowed = [lp for tok, lp in trie.child_logp[parent].items() if trie.children[parent][tok] in keep]
            if parent in end_nodes:
                allowed.append(trie.eos_logp[parent])
            logq += trie.child_logp[parent][trie.tokens[child]] - _logsumexp(allowed)
        allowed = [lp for tok, lp in trie.child_logp[end].items() if trie.children[end][tok] in keep]
        allowed.append(trie.eos_logp[end])
        logq += trie.eos_logp[end] - _logsumexp(allowed)
        out[s] = math.exp(logq)
    return out


def kl(p: dict[str, float], q: dict[str, float]) -> float:
    """KL(p || q) = sum_s p(s) log(p(s) / q(s)) in nats (inf if q misses mass p has)."""
    total = 0.0
    for s, ps in p.items():
        if ps <= 0:
            continue
        qs = q.get(s, 0.0)
        if qs <= 0:
            return math.inf
        total += ps * math.log(ps / qs)
    # Gibbs: KL >= 0 for distributions that each sum to 1. Only rounding may dip below 0; a clearly negative
    # sum means p or q is not normalized, and is returned as it is so that a check on KL >= 0 catches it.
    return 0.0 if -1e-9 < total < 0 else total


def tv(p: dict[str, float], q: dict[str, float]) -> float:
    """Total variation 0.5 * sum_s |p(s) - q(s)|."""
    keys = dict.fromkeys([*p, *q])  # a fixed summation order: a set's would vary with string hashing
    return 0.5 * sum(abs(p.get(s, 0.0) - q.get(s, 0.0)) for s in keys)


def task_distortion(model, tokenizer, task: dict, token_bytes: list[bytes | None], stop_token_ids: list[int],
                    *, max_nodes: int = 20_000) -> tuple[TokenTrie, ExactDistributions, dict]:
    """Build, score and enumerate one task's trie -> (trie, exact distributions, summary row)."""
    trie = build_trie(task["strings"], token_bytes, stop_token_ids, max_nodes=max_nodes)
    score_trie(model, user_prompt_ids(tokenizer, task["question"]), trie)
    canonical = {s: tokenizer(s, add_special_tokens=False).input_ids for s in task["strings"]}
    exact = exact_distributions(trie, canonical)
    row = {
        "task": task["name"], "category": task.get("category", ""), "strings": len(task["strings"]),
        "trie_nodes": len(trie), "tokenizations": sum(exact.n_tokenizations.values()),
        "p_language": math.exp(exact.log_p_language),
        "kl_masked": kl(exact.target, exact.masked), "tv_masked": tv(exact.target, exact.masked),
        "kl_masked_canonical": kl(exact.target, exact.masked_canonical),
        "tv_masked_canonical": tv(exact.target, exact.masked_canonical),
        "kl_canonical_target": kl(exact.target, exact.target_canonical),
        "noncanonical_mass": exact.noncanonical_mass,
        "top_target": max(exact.target, key=exact.target.get), "top_masked": max(exact.masked, key=exact.masked.get),
    }
    return trie, exact, row


STOP = -1  # the key of "end here" (EOS) among a node's allowed next steps


def allowed_next(trie: TokenTrie, node: int) -> tuple[list[int], list[float]]:
    """A scored node's allowed next steps: (keys, log-probs), keys the child node ids then STOP when the text
    so far is already in L (its log p(EOS | node))."""
    keys = [trie.children[node][tok] for tok in trie.child_logp[node]]
    logps = list(trie.child_logp[node].values())
    if trie.complete[node] is not None:
        keys.append(STOP)
        logps.append(trie.eos_logp[node])
    return keys, logps
