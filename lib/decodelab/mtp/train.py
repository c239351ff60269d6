"""Training, evaluation, cost measurement and checkpoints for MTP models (notebook 03).

- `train`: AdamW + warmup/cosine on `accelerate` (one process here; `accelerate launch` / `torchrun`
  run it data-parallel: each rank takes its slice of every global batch drawn from a shared seeded
  permutation, and gradients are averaged with `accelerator.reduce` after the (possibly sequential)
  backward, since MTP's several backward calls per step don't fit DDP's one-backward hooks).
  `python -m decodelab.mtp.train` (see `main`) is the launchable entry point.
- `evaluate`: per-head validation loss and top-1 accuracy, and the induction probe.
- `measure_step`: wall time (fastest of repeats) and peak memory of one forward + backward (CUDA:
  max_memory_allocated; CPU: the profiler's allocator trace, see `peak_memory_bytes`).
- `save_checkpoint` / `load_checkpoint`: safetensors + JSON in the run directory.
- experiment steps for notebook 03: `experiment_grid`, `train_and_evaluate`, `training_cost` (with the
  exactness checks `one_head_loss_diff` and `grad_check`), `self_spec_benchmark`, `summarize_runs`,
  `val_loss_metrics`, `head_accuracy_metrics`. Timed comparisons interleave their sides on one wall clock
  and keep the fastest run of each, with the slowest beside it as the spread.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decodelab.mtp.model import MTPConfig, MTPModel, build_trunk, mtp_loss


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
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    result = TrainResult()
    steps = enumerate(batch_indices(len(dataset), cfg, accelerator.process_index, accelerator.num_processes))
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, total=cfg.steps, desc=desc, leave=False, disable=not accelerator.is_main_process)
    model.train()
    for step, rows in steps:
        start = time.perf_counter()
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
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        result.step_s.append(time.perf_counter() - start)
        result.losses.append(out["loss"])
        result.head_losses.append(out["head_losses"])
        result.tokens += tokens.numel() * accelerator.num_processes
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


# -- cost ------------------------------------------------------------------------------------------
def peak_memory_bytes(fn, device: torch.device) -> int:
    """Peak bytes allocated above the starting level while fn() runs.

    CUDA: torch.cuda.max_memory_allocated after a reset (exact, from the caching allocator).
    CPU: torch.profiler with profile_memory records every allocation and free of the CPU allocator with
    the running "Total Allocated" counter; its maximum is the peak. Chosen over tracemalloc (does not see
    tensor storage) and ru_maxrss (a process-lifetime high-water mark, blurred by glibc's reuse).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as handle:
            events = json.load(handle)["traceEvents"]
    finally:
        os.unlink(path)
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0]
    return int(max([0, *totals]))


def _train_step(model: MTPModel, tokens: torch.Tensor, backward: str):
    """One forward + backward with the given head-backward order (gradients zeroed, buffers kept)."""
    def step():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        mtp_loss(model, tokens, backward=backward)
    return step


def _timed(fn, device: torch.device) -> float:
    """Seconds of fn() on one wall clock, the device synchronized on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure_step(model: MTPModel, tokens: torch.Tensor, *, backward: str = "sequential", repeats: int = 3) -> dict:
    """Fastest of `repeats` forward + backward steps, and its peak memory: -> {"step_s", "step_s_max", "peak_bytes"}.

    Gradients exist before each measured step (a warm-up step allocates them), so peak memory counts
    activations, logits and temporaries, not the parameter gradients every variant shares.
    """
    tokens = tokens.to(model.device)
    model.train()
    step = _train_step(model, tokens, backward)
    step()  # warm-up: allocates .grad buffers and any lazy state
    times = [_timed(step, tokens.device) for _ in range(repeats)]
    peak = peak_memory_bytes(step, tokens.device)
    model.zero_grad(set_to_none=True)
    model.eval()
    return {"step_s": min(times), "step_s_max": max(times), "peak_bytes": peak}


# -- checkpoints -----------------------------------------------------------------------------------
def save_checkpoint(model: MTPModel, directory: str | Path, *, extra: dict | None = None) -> Path:
    """Write model.safetensors (+ mtp_config.json) into directory; a retrofit saves only its heads.

    From scratch: the whole MTP model (trunk + heads; tied embedding stored once) and the trunk's
    LlamaConfig. Retrofit: the heads, plus the name of the frozen model they sit on.
    """
    from safetensors.torch import save_model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"mtp": model.config.as_dict(), "frozen_trunk": model.frozen_trunk, **(extra or {})}
    if model.frozen_trunk:
        save_model(model.heads, str(directory / "heads.safetensors"))
        meta["trunk_config"] = model.trunk.config.to_dict()
    else:
        save_model(model, str(directory / "model.safetensors"))
        meta["trunk_config"] = model.trunk.config.to_dict()
    (directory / "mtp_config.json").write_text(json.dumps(meta, indent=2, default=str))
    return directory


def load_checkpoint(directory: str | Path, *, device: str | torch.device | None = None, trunk=None) -> MTPModel:
    """Rebuild an MTPModel from `save_checkpoint`'s directory.

    A retrofit checkpoint needs its frozen trunk: pass `trunk` (a LlamaForCausalLM), else the model
    named in the checkpoint (`retrofit_model`) is loaded with `decodelab.core.models.load_model`.
    """
    from safetensors.torch import load_model as load_safetensors
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    meta_path = directory / "mtp_config.json"
    if not meta_path.exists():
        raise ValueError(f"checkpoint_dir={str(directory)!r} has no mtp_config.json (not an MTP checkpoint)")
    meta = json.loads(meta_path.read_text())
    config = MTPConfig(**meta["mtp"])
    if meta["frozen_trunk"]:
        if trunk is None:
            from decodelab.core.models import load_model

            trunk = load_model(meta["retrofit_model"], device=device, dtype=torch.float32).hf_model
        model = MTPModel(trunk, config, frozen_trunk=True)
        load_safetensors(model.heads, str(directory / "heads.safetensors"))
    else:
        trunk_config = {k: v for k, v in meta["trunk_config"].items()
                        if k not in ("architectures", "transformers_version")}
        trunk = LlamaForCausalLM(LlamaConfig(**trunk_config))
        model = MTPModel(trunk, config)
        load_safetensors(model, str(directory / "model.safetensors"))
    if device is not None:
        model.to(device)
    return model.eval()


def config_summary(model: MTPModel) -> dict:
    """Parameter counts for tables: trunk, heads, total (tied embedding counted once)."""
    trunk = sum(p.numel() for p in model.trunk.parameters())
    heads = sum(p.numel() for p in model.heads.parameters())
    return {"style": model.config.style, "n_heads": model.n_heads, "trunk_layers": model.trunk.config.num_hidden_layers,
            "trunk_params": trunk, "head_params": heads, "params": trunk + heads}


def build_model(*, vocab_size: int, d_model: int, n_layers: int, n_heads: int, style: str = "gloeckle",
                match_params: bool = True, n_attn_heads: int = 4, n_kv_heads: int = 2, max_len: int = 1024,
                mtp_weight: float | None = None, seed: int = 0) -> MTPModel:
    """A from-scratch MTP model; with match_params the n - 1 head layers come out of the n_layers budget."""
    from decodelab.mtp.model import trunk_layers

    trunk = build_trunk(vocab_size=vocab_size, d_model=d_model, n_attn_heads=n_attn_heads, n_kv_heads=n_kv_heads,
                        n_layers=trunk_layers(n_layers, n_heads, match_params), max_len=max_len, seed=seed)
    return MTPModel(trunk, MTPConfig(style=style, n_heads=n_heads, mtp_weight=mtp_weight), seed=seed)


# -- experiment steps the notebook strings together ------------------------------------------------
def config_name(style: str, n_heads: int) -> str:
    """"ntp" for the next-token baseline, else "<style>-<n>" (e.g. "gloeckle-4")."""
    return "ntp" if n_heads == 1 else f"{style}-{n_heads}"


def experiment_grid(n_heads: list[int], styles: list[str], style_heads: int = 2) -> list[tuple[str, int]]:
    """(style, n) pairs: the Gloeckle sweep over n_heads (n = 1 is the next-token baseline), then every
    other style in `styles` at n = style_heads (the equal-parameter style comparison)."""
    bad = [n for n in n_heads if not isinstance(n, int) or n < 1]
    if bad or not n_heads:
        raise ValueError(f"n_heads={n_heads!r} must be a non-empty list of ints >= 1")
    if not isinstance(style_heads, int) or style_heads < 2:
        raise ValueError(f"style_heads={style_heads!r} must be an int >= 2")
    for style in styles:
        MTPConfig(style=style)  # validates the name
    grid = [("gloeckle", n) for n in sorted(set(n_heads))]
    grid += [(style, style_heads) for style in dict.fromkeys(styles) if style != "gloeckle"]
    if "gloeckle" in styles and style_heads not in n_heads:
        grid.append(("gloeckle", style_heads))
    return grid


def train_and_evaluate(model: MTPModel, train_blocks: torch.Tensor, val_blocks: torch.Tensor, cfg: TrainConfig, *,
                       name: str, induction: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                       val_hidden: torch.Tensor | None = None, checkpoint_dir: str | Path | None = None,
                       checkpoint_extra: dict | None = None, progress: bool = False) -> dict:
    """Train, evaluate on validation, checkpoint: -> {"name", "curve", "eval", "train_s", "tokens", ...}.

    The per-block main-head losses come back too ("val_block_loss") so the notebook can bootstrap a
    spread when only one seed fits the budget.
    """
    start = time.perf_counter()
    result = train(model, train_blocks, cfg, hidden=hidden, progress=progress, desc=name)
    train_s = time.perf_counter() - start
    metrics = evaluate(model, val_blocks, induction=induction, hidden=val_hidden)
    if checkpoint_dir is not None:
        save_checkpoint(model, checkpoint_dir, extra={"name": name, "seed": cfg.seed, **(checkpoint_extra or {})})
    return {"name": name, "seed": cfg.seed, "curve": result.losses, "head_curves": result.head_losses,
            "train_s": train_s, "step_s": sorted(result.step_s)[len(result.step_s) // 2], "tokens": result.tokens,
            "eval": metrics, **config_summary(model)}


def training_cost(*, vocab_size: int, d_model: int, n_layers: int, n_heads: int, seq_len: int, batch_size: int,
                  style: str = "gloeckle", seed: int = 0, device=None, repeats: int = 3) -> dict:
    """Next-token vs n-head training at the same trunk: step time and peak memory of one fwd + bwd.

    Three variants on one batch: n = 1, n heads with the sequential head backward, n heads with the
    joint one (the same model as the sequential variant). Their timed steps are interleaved, the order
    reversed every repeat, and each variant's fastest step is its cost (the slowest is kept as spread).
    -> {"step_time_ratio": n-head sequential / next-token (fastest steps), "peak_mem_ratio": same for peak
        memory, "step_time_ratio_joint" / "peak_mem_ratio_joint": the naive all-heads backward,
        "grad_check_max_abs_diff": max |g_seq - g_joint|, "one_head_loss_abs_diff": |n=1 MTP loss -
        the trunk's own next-token loss|, "rows": per-variant measurements}.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator).to(device)
    models = {n: build_model(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n, style=style,
                             match_params=False, max_len=max(1024, seq_len), seed=seed).to(device).train()
              for n in (1, n_heads)}
    variants = [(1, "sequential"), (n_heads, "sequential"), (n_heads, "joint")]
    steps = [_train_step(models[n], tokens, backward) for n, backward in variants]
    for step in steps:
        step()  # warm-up: .grad buffers and lazy state exist before anything is timed
    times: list[list[float]] = [[] for _ in variants]
    for r in range(repeats):
        order = range(len(variants)) if r % 2 == 0 else reversed(range(len(variants)))
        for i in order:
            times[i].append(_timed(steps[i], device))
    rows = [{"n_heads": n, "backward": backward, "step_s": min(t), "step_s_max": max(t), "repeats": repeats,
             "peak_bytes": peak_memory_bytes(step, device)}
            for (n, backward), t, step in zip(variants, times, steps)]
    n1_diff = one_head_loss_diff(models[1], tokens)
    grad_diff = grad_check(models[n_heads], tokens)
    for model in models.values():
        model.zero_grad(set_to_none=True)
        model.eval()
    base, seq, joint = rows
    return {"step_time_ratio": seq["step_s"] / base["step_s"], "peak_mem_ratio": seq["peak_bytes"] / base["peak_bytes"],
            "step_time_ratio_joint": joint["step_s"] / base["step_s"],
            "peak_mem_ratio_joint": joint["peak_bytes"] / base["peak_bytes"], "grad_check_max_abs_diff": grad_diff,
            "one_head_loss_abs_diff": n1_diff, "cost_measured_at": {"n_heads": n_heads, "d_model": d_model,
            "n_layers": n_layers, "seq_len": seq_len, "batch_size": batch_size, "vocab_size": vocab_size,
            "device": device.type, "repeats": repeats}, "rows": rows}


@torch.no_grad()
def one_head_loss_diff(model: MTPModel, tokens: torch.Tensor) -> float:
    """|n = 1 MTP loss - the trunk's own next-token loss| on tokens (B, T); 0.0 when n = 1 reduces exactly.

    The reference is the textbook loss: cross-entropy of the trunk's logits at positions 0..T-2 against
    tokens 1..T-1, computed from `model.trunk(input_ids=...)` without any MTP code.
    """
    if model.n_heads != 1:
        raise ValueError(f"one_head_loss_diff needs an n_heads=1 model, got n_heads={model.n_heads}")
    ours = mtp_loss(model, tokens, backward="none")["head_losses"][0]
    logits = model.trunk(input_ids=tokens).logits
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                  tokens[:, 1:].reshape(-1))
    return abs(ours - float(reference))


def grad_check(model: MTPModel, tokens: torch.Tensor) -> float:
    """max |grad_sequential - grad_joint| over every parameter (float32 summation-order noise expected)."""
    model.zero_grad(set_to_none=True)
    mtp_loss(model, tokens, backward="sequential")
    seq = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    mtp_loss(model, tokens, backward="joint")
    joint = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if set(seq) != set(joint):
        raise RuntimeError(f"the two backward orders reached different parameters: {sorted(set(seq) ^ set(joint))}")
    diff = max(float((seq[n] - joint[n]).abs().max()) for n in joint)
    model.zero_grad(set_to_none=True)
    return diff


def self_spec_benchmark(model: MTPModel, prompts: list[list[int]], batch_sizes: list[int], *, max_new_tokens: int,
                        eos_token_ids: list[int] | None = None, name: str = "mtp", repeats: int = 3) -> list[dict]:
    """Self-speculative vs plain greedy decoding of the trunk at each batch size (prompts cycled).

    Both sides get the same prompts, the same `max_new_tokens` and EOS set, and one outer wall clock
    around the whole call (prefill included); their runs alternate, the order reversed every repeat,
    and the fastest run of each is its cost. Throughput counts the tokens each side returned.
    -> one dict per batch: {"model", "batch", "heads", "tau", "acceptance" (per draft position),
    "speedup" (plain seconds / self-spec seconds, fastest runs), "plain_s", "spec_s" (+ "_max": slowest),
    "greedy_match" (every row's tokens equal), "rows_identical" (how many rows equal)}.
    """
    from decodelab.core.engine import generate
    from decodelab.core.transformer import Transformer
    from decodelab.mtp.self_speculation import self_speculative_generate

    tr = Transformer.from_hf(model.trunk)
    eos = list(eos_token_ids or [])
    rows = []
    for batch in batch_sizes:
        chosen = [prompts[i % len(prompts)] for i in range(batch)]
        runners = {"plain": lambda: generate(tr, chosen, max_new_tokens=max_new_tokens, eos_token_ids=eos),
                   "spec": lambda: self_speculative_generate(model, chosen, max_new_tokens=max_new_tokens,
                                                             eos_token_ids=eos)}
        generate(tr, chosen[:1], max_new_tokens=2, eos_token_ids=[])  # warm-up, both paths
        self_speculative_generate(model, chosen[:1], max_new_tokens=2)
        times: dict[str, list[float]] = {"plain": [], "spec": []}
        outputs = {}
        for r in range(repeats):
            for method in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                start = time.perf_counter()
                outputs[method] = runners[method]()
                if tr.device.type == "cuda":
                    torch.cuda.synchronize(tr.device)
                times[method].append(time.perf_counter() - start)
        plain, spec = outputs["plain"], outputs["spec"]
        plain_s, spec_s = min(times["plain"]), min(times["spec"])
        same = sum(a == b for a, b in zip(spec.tokens, plain.tokens))
        rows.append({"model": name, "batch": batch, "heads": model.n_heads, "tau": spec.stats.tau,
                     "acceptance": spec.stats.acceptance_per_position[:model.n_heads - 1],
                     "speedup": plain_s / spec_s, "plain_s": plain_s, "spec_s": spec_s,
                     "plain_s_max": max(times["plain"]), "spec_s_max": max(times["spec"]), "repeats": repeats,
                     "plain_tokens_per_s": sum(map(len, plain.tokens)) / plain_s,
                     "spec_tokens_per_s": sum(map(len, spec.tokens)) / spec_s,
                     "greedy_match": same == batch, "rows_identical": same})
    return rows


def bootstrap_mean(values: list[float], *, n_boot: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): a 95% percentile bootstrap interval of the mean over `values`."""
    data = torch.tensor(values, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(data), (n_boot, len(data)), generator=generator)
    means = data[idx].mean(1)
    return float(data.mean()), float(means.quantile(0.025)), float(means.quantile(0.975))


def _by_config(results: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["name"], []).append(r)
    return groups


def val_loss_metrics(results: list[dict]) -> dict:
    """{config: {"mean", "std" (across seeds, None for one seed), "ci95" (bootstrap over validation blocks of
    the seed-averaged per-block loss), "per_seed"}} of the main head's validation loss."""
    out = {}
    for name, runs_ in _by_config(results).items():
        per_seed = [r["eval"]["head_loss"][0] for r in runs_]
        blocks = torch.tensor([r["eval"]["val_block_loss"] for r in runs_]).mean(0).tolist()
        _, low, high = bootstrap_mean(blocks)
        mean = sum(per_seed) / len(per_seed)
        std = float(torch.tensor(per_seed).std()) if len(per_seed) > 1 else None
        out[name] = {"mean": mean, "std": std, "ci95": [low, high], "per_seed": per_seed}
    return out


def head_accuracy_metrics(results: list[dict]) -> dict:
    """{config: [top-1 accuracy of head 1, head 2, ...] averaged over seeds}."""
    return {name: torch.tensor([r["eval"]["head_accuracy"] for r in runs_]).mean(0).tolist()
            for name, runs_ in _by_config(results).items()}


def summarize_runs(results: list[dict]):
    """One row per config: parameters, validation loss (mean, seed std, bootstrap CI), head accuracies,
    induction score, training time. -> pandas DataFrame."""
    import pandas as pd

    losses, accuracy = val_loss_metrics(results), head_accuracy_metrics(results)
    rows = []
    for name, runs_ in _by_config(results).items():
        first = runs_[0]
        inductions = [r["eval"]["induction_score"] for r in runs_ if r["eval"]["induction_score"] is not None]
        row = {"config": name, "style": first["style"], "n_heads": first["n_heads"],
               "trunk_layers": first["trunk_layers"], "params": first["params"], "seeds": len(runs_),
               "val_loss": losses[name]["mean"],
               "val_loss_seed_std": losses[name]["std"], "val_loss_ci_low": losses[name]["ci95"][0],
               "val_loss_ci_high": losses[name]["ci95"][1],
               "induction_score": sum(inductions) / len(inductions) if inductions else None,
               "train_s": sum(r["train_s"] for r in runs_) / len(runs_),
               "step_s": sum(r["step_s"] for r in runs_) / len(runs_)}
        row.update({f"head_{j + 1}_accuracy": a for j, a in enumerate(accuracy[name])})
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    """Train one from-scratch MTP model on the stdlib corpus, data-parallel under `accelerate launch`:

        accelerate launch --num_processes 8 -m decodelab.mtp.train --n-heads 4 --out results/mtp/launch
        python -m decodelab.mtp.train --n-heads 2 --style deepseek --steps 50 --out /tmp/mtp   # one process

    Writes the checkpoint (rank 0) and metrics.json (training curve + validation) into --out.
    """
    import argparse

    from accelerate import Accelerator

    from decodelab.mtp import data as mtp_data

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
