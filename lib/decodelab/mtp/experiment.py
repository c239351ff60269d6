"""Notebook 03's experiment drivers: the from-scratch grid, one train-evaluate-checkpoint step, the retrofit
experiment on a frozen pretrained model, and the per-config summaries the notebook logs.

`bootstrap_mean` lives here, not in `decodelab.common.stats`: `stats.bootstrap_ci` draws with numpy's
generator, this one with torch's, so the two give different intervals for the same seed, and notebook 03's
recorded numbers (val_loss ci95, frozen_next_token_val_loss) come from this one.
"""
from __future__ import annotations

from pathlib import Path

import torch

from decodelab.common.timing import timed
from decodelab.core.models import default_device
from decodelab.mtp.checkpoint import save_checkpoint
from decodelab.mtp.cost import self_spec_benchmark
from decodelab.mtp.model import MTPConfig, MTPModel, config_name
from decodelab.mtp.train import TrainConfig, evaluate, train, trunk_hidden


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


def config_summary(model: MTPModel) -> dict:
    """Parameter counts for tables: trunk, heads, total (tied embedding counted once)."""
    trunk = sum(p.numel() for p in model.trunk.parameters())
    heads = sum(p.numel() for p in model.heads.parameters())
    return {"style": model.config.style, "n_heads": model.n_heads, "trunk_layers": model.trunk.config.num_hidden_layers,
            "trunk_params": trunk, "head_params": heads, "params": trunk + heads}


def train_and_evaluate(model: MTPModel, train_blocks: torch.Tensor, val_blocks: torch.Tensor, cfg: TrainConfig, *,
                       name: str, induction: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                       val_hidden: torch.Tensor | None = None, checkpoint_dir: str | Path | None = None,
                       retrofit_model: str | None = None, progress: bool = False) -> dict:
    """Train, evaluate on validation, checkpoint: -> {"name", "curve", "eval", "train_s", "tokens", ...}.

    retrofit_model: the frozen model's name, recorded in a frozen-trunk model's checkpoint (see
    `save_checkpoint`). The per-block main-head losses come back too ("val_block_loss") so the notebook can
    bootstrap a spread when only one seed fits the budget.
    """
    result, train_s = timed(lambda: train(model, train_blocks, cfg, hidden=hidden, progress=progress, desc=name),
                            default_device())
    metrics = evaluate(model, val_blocks, induction=induction, hidden=val_hidden)
    if checkpoint_dir is not None:
        save_checkpoint(model, checkpoint_dir, retrofit_model=retrofit_model, extra={"name": name, "seed": cfg.seed})
    return {"name": name, "seed": cfg.seed, "curve": result.losses, "head_curves": result.head_losses,
            "train_s": train_s, "step_s": sorted(result.step_s)[len(result.step_s) // 2], "tokens": result.tokens,
            "eval": metrics, **config_summary(model)}


def retrofit_experiment(retrofit_model: str, corpus, *, styles: list[str], n_heads: int, seq_len: int,
                        train_tokens: int, val_tokens: int, steps: int, batch_size: int, lr: float, seed: int,
                        spec_batch_sizes: list[int], spec_new_tokens: int, timing_repeats: int,
                        other_repeats: int | None = None, mixed_precision: str = "no",
                        checkpoint_root: str | Path | None = None, loaded=None, progress: bool = False) -> dict:
    """Medusa-1-style retrofit: train `n_heads - 1` extra heads of each design in `styles` on the frozen
    `retrofit_model`, evaluate them, checkpoint them, and benchmark them as drafters for that model.

    retrofit_model: the frozen model (an embedded name, local dir or hub id), loaded in float32 (the heads
    train in its dtype) unless `loaded` (a `decodelab.core.models.LoadedModel` with a tokenizer) is given;
    its name goes into every checkpoint. corpus: a `decodelab.mtp.data.Corpus`, tokenized with the model's
    own tokenizer: `train_tokens // seq_len` training and `val_tokens // seq_len` validation blocks (at
    least 1 each). The frozen model's states are computed once and reused by every design; the heads train
    for `steps` steps of min(batch_size, blocks) blocks at peak `lr` (warmup steps // 8), seeded by `seed`.
    Designs that can draft (Gloeckle heads; DeepSeek at depth 1 only) run `self_spec_benchmark` on
    prompts cut from the validation blocks' first seq_len // 4 tokens: `timing_repeats` interleaved runs per
    side at batch 1 (where the speedup goal is judged), `other_repeats` (default: timing_repeats) at the other
    batch sizes, whose acceptance and tau do not change between runs.
    checkpoint_root: where each design's checkpoint goes (checkpoint_root / "retrofit-<style>-<n>").
    -> {"results": `train_and_evaluate` outputs per design, "draft_rows": `self_spec_benchmark` rows,
        "frozen_bit_identical": whether every weight of the frozen model is bit for bit what it was}.
    """
    from decodelab.mtp import data as mtp_data

    if loaded is None:
        from decodelab.core.models import load_model

        loaded = load_model(retrofit_model, dtype=torch.float32)
    frozen = loaded.hf_model
    frozen_before = {k: v.clone() for k, v in frozen.state_dict().items()}
    r_train = mtp_data.tokenized_blocks(corpus, loaded.tokenizer, "train", seq_len,
                                        max_blocks=max(1, train_tokens // seq_len))
    r_val = mtp_data.tokenized_blocks(corpus, loaded.tokenizer, "val", seq_len,
                                      max_blocks=max(1, val_tokens // seq_len))
    r_hidden = trunk_hidden(frozen, r_train, progress=progress)
    r_val_hidden = trunk_hidden(frozen, r_val)
    cfg = TrainConfig(steps=steps, batch_size=min(batch_size, len(r_train)), lr=lr, warmup=max(1, steps // 8),
                      seed=seed, mixed_precision=mixed_precision)
    results, draft_rows = [], []
    for style in styles:
        name = f"retrofit-{config_name(style, n_heads)}"
        model = MTPModel(frozen, MTPConfig(style=style, n_heads=n_heads), frozen_trunk=True, seed=seed)
        results.append(train_and_evaluate(
            model, r_train, r_val, cfg, name=name, hidden=r_hidden, val_hidden=r_val_hidden, progress=progress,
            checkpoint_dir=None if checkpoint_root is None else Path(checkpoint_root) / name,
            retrofit_model=retrofit_model))
        if style == "gloeckle" or n_heads == 2:  # DeepSeek modules draft with depth 1 only
            prompts = [row[: seq_len // 4].tolist() for row in r_val[: max(spec_batch_sizes)]]
            for batch in spec_batch_sizes:
                repeats = timing_repeats if batch == 1 or other_repeats is None else other_repeats
                draft_rows += self_spec_benchmark(model, prompts, [batch], max_new_tokens=spec_new_tokens,
                                                  name=name, repeats=repeats)
    frozen_identical = all(torch.equal(frozen_before[k], v) for k, v in frozen.state_dict().items())
    return {"results": results, "draft_rows": draft_rows, "frozen_bit_identical": frozen_identical}


def bootstrap_mean(values: list[float], *, n_boot: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): a 95% percentile bootstrap interval of the mean over `values` (torch's generator)."""
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
