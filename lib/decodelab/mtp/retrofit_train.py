"""Training a DeepSeek-style MTP module on a frozen model by self-distillation, resumable and cached by content hash.

The module (one decoder block of the model's width, `decodelab.mtp.model.DeepSeekModule`) reads
[RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))] and predicts t_{i+2} through the frozen final norm + LM head. Its loss at
position i (`distill_loss`):

    "kl": KL(p_target(. | t_<=i+1) || q_module(. | h_i, t_{i+1})), p over the teacher's top-k (renormalized),
          the teacher being the frozen model one position later (cached by `decodelab.mtp.distill`);
    "ce": cross-entropy on the text's own token t_{i+2} (the plain-label ablation);
    + feature_weight * SmoothL1(FinalNorm(s_i), h_{i+1}) when feature_weight > 0 (EAGLE-1/2's feature regression:
          the module's state against the trunk's own state one position later).

With `feature_layers` the module's state input is EAGLE-3's fused feature: the trunk's residual streams after
those layers, each RMS-normed, concatenated with h_i and projected to the width (`DeepSeekModule.fused`).

Only a random `loss_fraction` of positions is scored per step (the 49k-token LM head's forward and backward
dominate the cost; the module itself runs over every position, so attention sees the whole block).

`train_retrofit` checkpoints every `save_every` steps into its run directory (module, optimizer, step; written
to a temporary name, then renamed) and resumes from there, reaching the same final weights as an uninterrupted
run: batch order and position samples are functions of (seed, step), not of a generator's history.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from decodelab.mtp.distill import DistillData
from decodelab.mtp.model import MTPConfig, MTPModel

LOSSES = ("kl", "ce")
# RetrofitSpec fields added after format 2, with the value every spec had before them: a record without one
# means this value, and `as_dict` leaves it out, so records and hashes written before them still match
ADDED_FIELDS = {"feature_layers": [], "feature_weight": 0.0}


@dataclass(frozen=True)
class RetrofitSpec:
    """Everything that defines a trained retrofit module (with the model id and corpus hash: its content hash)."""

    data: DistillData = DistillData()
    loss: str = "kl"  # "kl" (self-distillation) or "ce" (plain labels, the ablation)
    # live code-edit acceptance of the first draft (8 prompts, k = 1) grew with steps and data: 1152 steps on 768
    # blocks 46%, 2304 50%, 6912 54%; 6912 on 1024 blocks holding twice the own answers 60%; 8192 on 1217 blocks,
    # 1280 of them own answers, 64%. On 24 prompts at k = 3 (position 1), 8192 steps on those 1217 blocks 55.7%;
    # 7680 steps on 3584 blocks holding 2048 own answers (class methods renamed too, the data built in bfloat16) 60.5%
    steps: int = 7680
    batch_size: int = 2  # blocks per step
    lr: float = 2e-3
    warmup: int = 10
    loss_fraction: float = 0.25  # positions scored per step
    grad_clip: float = 1.0
    seed: int = 0
    val_blocks: int = 8  # the distillation set's last blocks, never trained on: the record's held-out agreement
    init_layer: int | None = None  # trunk layer the module's block starts as a copy of (-1: the last); None: identity
    feature_layers: tuple[int, ...] = ()  # trunk layers fused into the module's input (EAGLE-3); () = final state only
    # weight of the smooth-L1 regression of the trunk's next state (EAGLE-1); 0 = none. 3.0: the best of the A/B at
    # 0 / 1 / 3 (live code-edit acceptance, notebook 03 5b's measure): it mostly helps the chained drafts 2..k
    feature_weight: float = 3.0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss={self.loss!r} must be one of {LOSSES}")
        for name in ("steps", "batch_size", "warmup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not 0 < self.loss_fraction <= 1:
            raise ValueError(f"loss_fraction={self.loss_fraction!r} must be in (0, 1]")
        if self.init_layer is not None and (isinstance(self.init_layer, bool) or not isinstance(self.init_layer, int)):
            raise ValueError(f"init_layer={self.init_layer!r} must be an int (a trunk layer index, -1 = last) or None")
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))  # JSON gives a list
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.feature_layers):
            raise ValueError(f"feature_layers={self.feature_layers!r} must be trunk layer indices >= 0")
        if not self.feature_weight >= 0:
            raise ValueError(f"feature_weight={self.feature_weight!r} must be >= 0")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if isinstance(self.val_blocks, bool) or not isinstance(self.val_blocks, int) or \
                not 0 <= self.val_blocks < self.data.n_blocks:
            raise ValueError(f"val_blocks={self.val_blocks!r} must be an int in [0, n_blocks={self.data.n_blocks})")

    def as_dict(self) -> dict:
        out = {**asdict(self), "data": self.data.as_dict(), "feature_layers": list(self.feature_layers)}
        for name in ADDED_FIELDS:
            if out[name] == ADDED_FIELDS[name]:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "RetrofitSpec":
        return cls(**{**ADDED_FIELDS, **d, "data": DistillData(**d["data"])})  # absent: as before the field


def spec_hash(spec: RetrofitSpec, model_name: str, corpus_hash: str) -> str:
    """16 hex digits naming a trained module: spec + frozen model + corpus."""
    # format 2: the distillation set skips the evaluation workloads' files
    key = {"spec": spec.as_dict(), "model": model_name, "corpus": corpus_hash, "format": 2}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def lr_at(step: int, spec: RetrofitSpec) -> float:
    """Linear warmup, then cosine decay to 10% of lr."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def step_rows(step: int, n_rows: int, spec: RetrofitSpec) -> torch.Tensor:
    """The blocks of `step`: a slice of the seeded permutation of its epoch (a pure function of seed, step)."""
    per_epoch = max(1, n_rows // spec.batch_size)
    epoch, slot = divmod(step, per_epoch)
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(spec.seed * 7919 + epoch))
    return order[slot * spec.batch_size:(slot + 1) * spec.batch_size]


def scored_positions(step: int, valid: torch.Tensor, spec: RetrofitSpec) -> torch.Tensor:
    """valid (B, T') bool -> the subset scored at `step` (each valid position kept with prob loss_fraction)."""
    if spec.loss_fraction >= 1:
        return valid
    draw = torch.rand(valid.shape, generator=torch.Generator().manual_seed(spec.seed * 104729 + step))
    return valid & (draw < spec.loss_fraction)


def distill_loss(model: MTPModel, tokens: torch.Tensor, hidden: torch.Tensor, top_ids: torch.Tensor,
                 top_logp: torch.Tensor, scored: torch.Tensor, loss: str = "kl", *,
                 features: torch.Tensor | None = None, feature_weight: float = 0.0) -> torch.Tensor:
    """Mean loss of module 1 over the scored positions.

    tokens (B, T); hidden (B, T, D) the frozen final-normed states; top_ids / top_logp (B, T, K) the frozen
    model's next-token top-k at each position; scored (B, T-1) bool over module positions i = 0..T-2
    (position i predicts t_{i+2}; for "ce" the last position has no label and must not be scored).
    features (B, T, n D): the trunk's intermediate states, for a fused module (`MTPConfig.feature_layers`).
    feature_weight w adds EAGLE's feature regression: w * SmoothL1(FinalNorm(s_i), h_{i+1}), the module's state
    against the state the trunk itself reaches one position later (the one its LM head turns into t_{i+2}).
    """
    dtype = model.trunk.dtype
    state = model.head_state(2, hidden.to(dtype), tokens,
                             None if features is None else features.to(dtype))  # (B, T-1, D)
    rows, cols = scored.nonzero(as_tuple=True)
    normed = model.trunk.model.norm(state[rows, cols])  # (P, D): the LM head's input
    logq = torch.log_softmax(model.trunk.lm_head(normed).float(), -1)  # (P, V)
    if loss == "ce":
        out = F.nll_loss(logq, tokens[rows, cols + 2])
    else:
        p_logp = torch.log_softmax(top_logp[rows, cols + 1].float(), -1)  # teacher renormalized over its top-k
        q_logp = logq.gather(-1, top_ids[rows, cols + 1].long())
        out = (p_logp.exp() * (p_logp - q_logp)).sum(-1).mean()
    if feature_weight:
        out = out + feature_weight * F.smooth_l1_loss(normed.float(), hidden[rows, cols + 1].float())
    return out


def valid_positions(mask: torch.Tensor, loss: str) -> torch.Tensor:
    """mask (B, T) real tokens -> (B, T-1) module positions with a teacher (t_{i+1} real; "ce": t_{i+2} real)."""
    valid = mask[:, 1:].clone()
    if loss == "ce":
        valid[:, :-1] &= mask[:, 2:]
        valid[:, -1] = False
    return valid


def new_module_model(trunk, seed: int, init_layer: int | None = None, feature_layers=()) -> MTPModel:
    """The frozen trunk plus one DeepSeek module. init_layer None: identity-initialized (Medusa-style start: the
    model's own guess); an int: the block starts as a copy of that trunk layer (a trained layer, not noise), the
    combine projection still W = [I, 0], so the module first reads the state alone, as the layer it copies did."""
    n_layers = len(trunk.model.layers)
    if any(i >= n_layers for i in feature_layers):
        raise ValueError(f"feature_layers={tuple(feature_layers)!r} must be < {n_layers} for this trunk")
    model = MTPModel(trunk, MTPConfig(style="deepseek", n_heads=2, feature_layers=tuple(feature_layers)),
                     frozen_trunk=True, seed=seed)
    if init_layer is not None:
        layers = trunk.model.layers
        if not -len(layers) <= init_layer < len(layers):
            raise ValueError(f"init_layer={init_layer} must be in [-{len(layers)}, {len(layers)}) for this trunk")
        state = {k: v.detach().clone() for k, v in layers[init_layer].state_dict().items()}
        model.heads[0].block.load_state_dict(state)  # a copy: the trunk's own layer stays frozen and untouched
    return model


def _save_state(path: Path, model: MTPModel, optimizer, step: int, losses: list[float], elapsed: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"heads": model.heads.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "losses": losses, "elapsed_s": elapsed}, tmp)
    os.replace(tmp, path)


def train_retrofit(model: MTPModel, dataset: dict, spec: RetrofitSpec, *, run_dir: str | Path,
                   save_every: int = 20, stop_after: int | None = None, progress: bool = False) -> dict:
    """Train model's module on `dataset` (`decodelab.mtp.distill.build_distill_set`) for spec.steps steps.

    run_dir: holds state.pt, the resumable state (an existing one is resumed from its step);
    stop_after: stop once this many steps are done in all (simulates an interruption; the state is saved).
    -> {"losses": per step, "steps_done", "elapsed_s" (training time over all sessions), "resumed_from"}.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    state_path = run_dir / "state.pt"
    params = model.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0, betas=(0.9, 0.95))
    start, losses, elapsed = 0, [], 0.0
    if state_path.exists():
        state = torch.load(state_path, map_location=model.device, weights_only=True)
        model.heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        start, losses, elapsed = state["step"], list(state["losses"]), state["elapsed_s"]
    resumed_from = start
    end = spec.steps if stop_after is None else min(spec.steps, stop_after)
    tokens, mask = dataset["tokens"], dataset["mask"]
    n_train = len(tokens) - spec.val_blocks  # the last val_blocks blocks are held out
    if n_train < 1:
        raise ValueError(f"val_blocks={spec.val_blocks} leaves no training block of the {len(tokens)} in the set")
    steps = range(start, end)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, initial=start, total=spec.steps, desc=f"train-mtp ({spec.loss})")
    model.train()
    began = time.perf_counter()
    for step in steps:
        rows = step_rows(step, n_train, spec)
        scored = scored_positions(step, valid_positions(mask[rows], spec.loss), spec)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        optimizer.zero_grad(set_to_none=True)
        features = dataset["features"][rows].to(model.device) if spec.feature_layers else None
        loss = distill_loss(model, tokens[rows].to(model.device), dataset["hidden"][rows].to(model.device),
                            dataset["top_ids"][rows].to(model.device), dataset["top_logp"][rows].to(model.device),
                            scored.to(model.device), spec.loss, features=features,
                            feature_weight=spec.feature_weight)
        loss.backward()
        if spec.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        if progress:
            steps.set_postfix(loss=f"{losses[-1]:.3f}")
        done = step + 1
        if done % save_every == 0 or done == end:
            _save_state(state_path, model, optimizer, done, losses, elapsed + time.perf_counter() - began)
    model.eval()
    return {"losses": losses, "steps_done": end, "elapsed_s": elapsed + time.perf_counter() - began,
            "resumed_from": resumed_from}


def split_blocks(dataset: dict, spec: RetrofitSpec, *, max_blocks: int | None = None) -> tuple[dict, dict]:
    """(training blocks, held-out blocks) of a distillation set: the held-out ones are its last spec.val_blocks;
    max_blocks caps each part (agreement over the LM head costs a 49k-vocab projection per position)."""
    n_train = len(dataset["tokens"]) - spec.val_blocks
    tensors = [k for k, v in dataset.items() if isinstance(v, torch.Tensor)]
    cap = max_blocks if max_blocks is not None else len(dataset["tokens"])
    train = {k: dataset[k][:min(n_train, cap)] for k in tensors}
    held = {k: dataset[k][n_train:n_train + cap] for k in tensors}
    return train, held


@torch.no_grad()
def module_agreement(model: MTPModel, dataset: dict, *, batch_size: int = 4) -> dict:
    """Teacher-forced agreement of module 1 with the frozen model on `dataset`: the fraction of positions
    where argmax q_module(. | h_i, t_{i+1}) equals the frozen model's argmax at i + 1 (what a greedy verifier
    accepts), and the mean KL to its top-k. -> {"agreement", "kl", "positions"}."""
    hits = total = 0
    kl_sum = 0.0
    for start in range(0, len(dataset["tokens"]), batch_size):
        sl = slice(start, start + batch_size)
        tokens, valid = dataset["tokens"][sl].to(model.device), valid_positions(dataset["mask"][sl], "kl")
        features = dataset.get("features")
        features = None if features is None else features[sl].to(model.device, model.trunk.dtype)
        state = model.head_state(2, dataset["hidden"][sl].to(model.device, model.trunk.dtype), tokens, features)
        logits = model.unembed(state, 2).float()  # (B, T-1, V)
        teacher_top1 = dataset["top_ids"][sl][:, 1:, 0].long().to(model.device)
        hit = (logits.argmax(-1) == teacher_top1) & valid.to(model.device)
        hits += int(hit.sum())
        total += int(valid.sum())
        rows, cols = valid.nonzero(as_tuple=True)
        logq = torch.log_softmax(logits[rows, cols], -1)
        p = torch.log_softmax(dataset["top_logp"][sl][rows, cols + 1].float(), -1)
        kl_sum += float((p.exp() * (p - logq.gather(-1, dataset["top_ids"][sl][rows, cols + 1].long()))).sum())
    return {"agreement": hits / max(1, total), "kl": kl_sum / max(1, total), "positions": total}
