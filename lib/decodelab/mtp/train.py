"""Training and evaluation of MTP models (notebook 03).

- `train`: AdamW + warmup/cosine on `accelerate` (one process here; `accelerate launch` / `torchrun`
  run it data-parallel: each rank takes its slice of every global batch drawn from a shared seeded
  permutation, and gradients are averaged with `accelerator.reduce` after the (possibly sequential)
  backward, since MTP's several backward calls per step don't fit DDP's one-backward hooks).
  `python -m decodelab.mtp.train` (see `main`) is the launchable entry point.
- `evaluate`: per-head validation loss and top-1 accuracy, and the induction probe.
- `trunk_hidden`: a frozen trunk's states, computed once for a retrofit.
Checkpoints are `decodelab.mtp.checkpoint`'s, step cost `decodelab.mtp.cost`'s, and notebook 03's
experiment steps `decodelab.mtp.experiment`'s.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decodelab.common.timing import timed
from decodelab.mtp.model import MTPModel, mtp_loss


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    backward: str = "sequential"
    mixed_precision: str = "no"  # "no" or "bf16" (no fp16: the sequential backward does no loss scaling)


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # weighted total per step
    head_losses: list[list[float]] = field(default_factory=list)  # per step, head 1 first
    step_s: list[float] = field(default_factory=list)
    tokens: int = 0  # training tokens seen (all ranks)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine decay to 10% of lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_indices(n_rows: int, cfg: TrainConfig, rank: int = 0, world: int = 1):
    """Yield cfg.steps index tensors (batch_size // world rows each) from seeded per-epoch permutations."""
    per_rank = cfg.batch_size // world
    if per_rank < 1:
        raise ValueError(f"batch_size={cfg.batch_size} must be >= the number of processes ({world})")
    if n_rows < cfg.batch_size:
        raise ValueError(f"batch_size={cfg.batch_size} exceeds the {n_rows} training blocks")
    generator = torch.Generator().manual_seed(cfg.seed)
    order, cursor = torch.randperm(n_rows, generator=generator), 0
    for _ in range(cfg.steps):
        if cursor + cfg.batch_size > n_rows:
            order, cursor = torch.randperm(n_rows, generator=generator), 0
        batch = order[cursor:cursor + cfg.batch_size]
        cursor += cfg.batch_size
        yield batch[rank * per_rank:(rank + 1) * per_rank]


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer every MTP training step uses (AdamW, betas (0.9, 0.95); lr is set per step by `lr_at`)."""
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def finish_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """After the backward: clip the gradient norm (cfg.grad_clip; 0 = off) and take the optimizer step."""
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()


def train(model: MTPModel, blocks: torch.Tensor, cfg: TrainConfig, *, hidden: torch.Tensor | None = None,
          accelerator=None, progress: bool = False, desc: str = "train") -> TrainResult:
    """Train model's trainable parameters on blocks (N, T) for cfg.steps steps.

    hidden (N, T, D), optional: precomputed trunk states for a frozen trunk (retrofit), so the 135M
    trunk runs once per block instead of once per epoch.
    """
    from accelerate import Accelerator

    from decodelab.mtp.data import to_dataset

    if hidden is not None and not model.frozen_trunk:
        raise ValueError("hidden= is only valid for a frozen trunk (retrofit)")
    accelerator = accelerator or Accelerator(mixed_precision=cfg.mixed_precision, cpu=not torch.cuda.is_available())
    model.to(accelerator.device)
    dataset = to_dataset(blocks)
    params = model.trainable_parameters()
    optimizer = make_optimizer(params, cfg)
    result = TrainResult()
    steps = enumerate(batch_indices(len(dataset), cfg, accelerator.process_index, accelerator.num_processes))
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, total=cfg.steps, desc=desc, leave=False, disable=not accelerator.is_main_process)

    def optimizer_step(step: int, rows: torch.Tensor):
        """One optimizer step on the blocks `rows`: -> (logged losses, tokens this rank saw)."""
        tokens = dataset[rows]["input_ids"].to(accelerator.device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        optimizer.zero_grad(set_to_none=True)
        with accelerator.autocast():
            out = mtp_loss(model, tokens, backward=cfg.backward,
                           hidden=None if hidden is None else hidden[rows].to(accelerator.device))
        if accelerator.num_processes > 1:  # average gradients and the logged losses over ranks
            for p in params:
                if p.grad is not None:
                    p.grad = accelerator.reduce(p.grad, reduction="mean")
            logged = torch.tensor([out["loss"], *out["head_losses"]], device=accelerator.device)
            logged = accelerator.reduce(logged, reduction="mean").tolist()
            out = {"loss": logged[0], "head_losses": logged[1:]}
        finish_step(params, optimizer, cfg)
        return out, tokens.numel()

    model.train()
    for step, rows in steps:
        (out, n_tokens), seconds = timed(lambda: optimizer_step(step, rows), accelerator.device)
        result.step_s.append(seconds)
        result.losses.append(out["loss"])
        result.head_losses.append(out["head_losses"])
        result.tokens += n_tokens * accelerator.num_processes
    model.eval()
    return result


@torch.no_grad()
def evaluate(model: MTPModel, blocks: torch.Tensor, *, batch_size: int = 16,
             induction: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> dict:
    """Validation metrics over blocks (N, T).

    -> {"head_loss": [per head], "head_accuracy": [top-1 per head], "induction_score": main-head accuracy
    on the positions of `induction` (N, T-1) bool (None if not given), "induction_cases": count,
    "val_block_loss": main-head loss per block}.
    """
    model.eval()
    n = model.n_heads
    loss_sum, correct, counts = [0.0] * n, [0] * n, [0] * n
    ind_correct = ind_total = 0
    block_loss: list[float] = []
    for start in range(0, len(blocks), batch_size):
        tokens = blocks[start:start + batch_size].to(model.device)
        h = None if hidden is None else hidden[start:start + batch_size].to(model.device)
        for j, logits in enumerate(model.head_logits(tokens, hidden=h), start=1):
            valid = tokens.shape[1] - j
            logits, target = logits[:, :valid].float(), tokens[:, j:j + valid]
            token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            loss_sum[j - 1] += float(token_loss.sum())
            if j == 1:
                block_loss.extend(token_loss.mean(1).tolist())
            hit = logits.argmax(-1) == target
            correct[j - 1] += int(hit.sum())
            counts[j - 1] += target.numel()
            if j == 1 and induction is not None:
                mask = induction[start:start + batch_size].to(hit.device)
                ind_correct += int(hit[mask].sum())
                ind_total += int(mask.sum())
    return {
        "head_loss": [s / c for s, c in zip(loss_sum, counts)],
        "head_accuracy": [k / c for k, c in zip(correct, counts)],
        "induction_score": ind_correct / ind_total if ind_total else None,
        "induction_cases": ind_total,
        "val_block_loss": block_loss,  # main-head mean loss per block, for bootstrap spreads
    }


@torch.no_grad()
def trunk_hidden(model, blocks: torch.Tensor, *, batch_size: int = 8, progress: bool = False) -> torch.Tensor:
    """Frozen trunk states for every block: (N, T) -> final-normed (N, T, D) on CPU (computed once for retrofit).

    model: an MTPModel or the trunk itself (a transformers causal LM).
    """
    hidden = model.hidden if isinstance(model, MTPModel) else lambda x: model.model(input_ids=x).last_hidden_state
    device = next(model.parameters()).device
    chunks = range(0, len(blocks), batch_size)
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, desc="trunk states", leave=False)
    return torch.cat([hidden(blocks[i:i + batch_size].to(device)).float().cpu() for i in chunks])


def main(argv: list[str] | None = None) -> None:
    """Train one from-scratch MTP model on the stdlib corpus, data-parallel under `accelerate launch`:

        accelerate launch --num_processes 8 -m decodelab.mtp.train --n-heads 4 --out results/mtp/launch
        python -m decodelab.mtp.train --n-heads 2 --style deepseek --steps 50 --out /tmp/mtp   # one process

    Writes the checkpoint (rank 0) and metrics.json (training curve + validation) into --out.
    """
    import argparse

    from accelerate import Accelerator

    from decodelab.mtp import data as mtp_data
    from decodelab.mtp.checkpoint import save_checkpoint
    from decodelab.mtp.model import build_model, config_name

    parser = argparse.ArgumentParser(prog="python -m decodelab.mtp.train", description=main.__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory (checkpoint + metrics.json)")
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--style", choices=("gloeckle", "deepseek"), default="gloeckle")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (blocks), split across processes")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--val-blocks", type=int, default=64)
    parser.add_argument("--corpus-bytes", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no")
    args = parser.parse_args(argv)

    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available())
    corpus = mtp_data.load_corpus(max_bytes=args.corpus_bytes)
    with accelerator.main_process_first():  # rank 0 trains the tokenizer and fills the cache
        tokenizer = mtp_data.train_bpe_tokenizer(corpus, args.vocab_size)
        train_blocks = mtp_data.tokenized_blocks(corpus, tokenizer, "train", args.seq_len,
                                                 max_blocks=args.steps * args.batch_size)
        val_blocks = mtp_data.tokenized_blocks(corpus, tokenizer, "val", args.seq_len, max_blocks=args.val_blocks)
    model = build_model(vocab_size=tokenizer.get_vocab_size(), d_model=args.d_model, n_layers=args.n_layers,
                        n_heads=args.n_heads, style=args.style, max_len=max(1024, 2 * args.seq_len), seed=args.seed)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=max(1, args.steps // 10),
                      seed=args.seed, mixed_precision=args.mixed_precision)
    result = train(model, train_blocks, cfg, accelerator=accelerator, progress=True)
    if accelerator.is_main_process:
        metrics = evaluate(model, val_blocks)
        out = Path(args.out)
        save_checkpoint(model, out / "checkpoint",
                        extra={"name": config_name(args.style, args.n_heads), "seed": args.seed})
        payload = {"args": vars(args), "processes": accelerator.num_processes, "tokens": result.tokens,
                   "curve": result.losses, "step_s": result.step_s, "eval": metrics, "corpus": corpus.provenance()}
        (out / "metrics.json").write_text(json.dumps(payload, indent=2))
        print(f"val head losses {metrics['head_loss']}, accuracies {metrics['head_accuracy']} -> {out}")


if __name__ == "__main__":
    main()
