"""Speculative verification maths: greedy and rejection-sampling acceptance of k drafts per row, and the
inverse-CDF draw that drafts and resamples use."""
from __future__ import annotations

import torch


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities, (B,) uniforms in [0, 1) -> (B,) long: smallest i with cdf_i > u * total.

    The cumulative sum runs in token-id order. This is the draw of the draft tokens (drafters) and of the
    residual at a rejection, and it is not `core.sampling.sample_inverse_cdf`, which puts the row's argmax
    first and then the other tokens in vocabulary order (so u near 0 picks the most probable token): the
    same uniform picks a different token under the two, so merging them would change every sampled
    speculative run.
    """
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def _valid_mask(drafts: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """(B, k) bool: draft i of row b is real (i < lengths[b])."""
    B, k = drafts.shape
    if lengths is None:
        return torch.ones(B, k, dtype=torch.bool, device=drafts.device)
    return torch.arange(k, device=drafts.device) < lengths.to(drafts.device).unsqueeze(1)


def _first_rejection(accept: torch.Tensor) -> torch.Tensor:
    """(B, k) bool accept flags -> (B,) long number of leading accepted drafts."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def greedy_verify(
    drafts: torch.Tensor, target_logits: torch.Tensor, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance. drafts (B, k), target_logits (B, k+1, V) -> (n_accepted (B,), next (B,)).

    d_i is accepted while it equals argmax p_i; next = argmax p_{n+1}: the target's own choice at the
    first mismatch (the correction) or after the last draft (the bonus token).
    """
    choice = target_logits.argmax(dim=-1)  # (B, k+1)
    k = drafts.shape[1]
    accept = (choice[:, :k] == drafts) & _valid_mask(drafts, lengths)
    n = _first_rejection(accept)
    return n, choice.gather(1, n.unsqueeze(1)).squeeze(1)


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) elementwise; q(d) > 0 whenever d was drawn from q."""
    return torch.where(q_draft > 0, (p_draft / q_draft.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(p_draft))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) over the last axis; falls back to p where p <= q everywhere (then the
    draft is accepted with probability 1, so the fallback is never sampled in exact arithmetic)."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 1e-12, r / total.clamp_min(1e-30), p)


def verify_uniforms(generator, lengths: torch.Tensor | None, k: int, batch_size: int, *, device=None,
                    dtype=torch.float32) -> torch.Tensor:
    """(B, k+1) uniforms in [0, 1) for `rejection_verify`: u_i decides draft i, u_k the resample.

    generator: None (the global stream), one torch.Generator (one (B, k+1) draw), or a list of B
    (`engine.generate`'s per-row contract). From a list, row b draws only what it uses, m_b + 1 numbers
    (m_b = lengths[b] real drafts, else k), placed at u_0..u_{m_b-1} and u_k: a row's stream then
    depends on its own drafts only, not on how wide the other rows made the step.
    """
    if not isinstance(generator, (list, tuple)):
        gen_device = generator.device if generator is not None else device
        return torch.rand(batch_size, k + 1, generator=generator, device=gen_device, dtype=dtype).to(device)
    if len(generator) != batch_size:
        raise ValueError(f"generator: got a list of {len(generator)} generators, need one per row ({batch_size})")
    real = [k] * batch_size if lengths is None else [min(int(m), k) for m in lengths.tolist()]
    out = torch.full((batch_size, k + 1), 0.5, dtype=dtype)  # positions past m_b are padding: never read
    for b, (g, m) in enumerate(zip(generator, real)):
        u = torch.rand(m + 1, generator=g, device=g.device, dtype=dtype).cpu()
        out[b, :m], out[b, k] = u[:m], u[m]
    return out.to(device)


def rejection_verify(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    *,
    lengths: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling for a batch.

    drafts (B, k) long; draft_probs (B, k, V) q_i, or None for deterministic drafts (q_i one-hot at d_i);
    target_probs (B, k+1, V) p_i (already processed by the sampler: temperature, top-p, ...);
    lengths (B,) real drafts per row (positions past it act as q = 0, i.e. always rejected);
    uniforms (B, k+1) in [0, 1) (drawn from `generator`, one or a list of B, when None; see
    `verify_uniforms`): u_i decides draft i, u_k the resample. -> (n_accepted (B,) in [0, k], next (B,) long).
    """
    B, k = drafts.shape
    V = target_probs.shape[-1]
    device = target_probs.device
    drafts = drafts.to(device)
    if uniforms is None:
        uniforms = verify_uniforms(generator, lengths, k, B, device=device, dtype=target_probs.dtype)
    valid = _valid_mask(drafts, lengths)
    if draft_probs is None:
        q = torch.nn.functional.one_hot(drafts, V).to(target_probs.dtype)
    else:
        q = draft_probs.to(device=device, dtype=target_probs.dtype)
    q = q * valid.unsqueeze(-1)  # padding drafts: q = 0, so p(d)/q(d) -> never accepted, residual = p
    p_d = target_probs[:, :k].gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # (B, k)
    q_d = q.gather(2, drafts.unsqueeze(-1)).squeeze(-1)
    # accept d_i  <=>  u_i < min(1, p_i(d_i) / q_i(d_i))
    accept = (uniforms[:, :k] < acceptance_probability(p_d, q_d)) & valid
    n = _first_rejection(accept)
    # Row b samples from norm(max(p_n - q_n, 0)) at its first rejection n < k, or from p_{k+1} (q := 0)
    # when every draft was accepted: pad q with a zero row at index k so both cases are one gather.
    q_pad = torch.cat([q, torch.zeros(B, 1, V, dtype=q.dtype, device=device)], dim=1)
    rows = torch.arange(B, device=device)
    residual = residual_distribution(target_probs[rows, n], q_pad[rows, n])
    return n, inverse_cdf(residual, uniforms[:, k])
