"""The notebook registry: one record per notebook, the only place the suite learns what notebooks exist.

A record says which file the notebook is, what it asks, which figure answers it, which numbers support
the answer, which of them are timings (not comparable when the machine was loaded), which question
subpackage holds its code, and how `scripts/gpu_check.sh` cuts it down. The runner, `decodelab list`,
the report, the findings, the Makefile and the GPU check all iterate `NOTEBOOKS`.

Adding a notebook = the notebook + its `notebooks/params/<name>/` folder + one `Notebook` record here
(+ its subpackage under `decodelab/`). The suite refers to question subpackages only by the name strings
below (resolved with importlib where needed), never by import.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

# Names (metric keys, goal names, figure stems) that measure time: published from a loaded run only
# with `decodelab findings --allow-loaded`. Quality numbers (accuracy, KL, tau, loss) are not timings.
TIMING_METRICS = ("*speedup*", "*tokens_per_s*", "*tok_s*", "*seconds*", "*_s", "*_ms", "*_us", "*time*",
                  "*slowdown*", "*overhead*", "*throughput*", "*latency*", "*ours_over_hf*")
TIMING_FIGURES = ("*speedup*", "*throughput*", "*time*", "*latency*", "*cost*", "*overhead*", "*slowdown*")


@dataclass(frozen=True)
class Notebook:
    """One notebook: its runner name, file, question, headline figure and supporting numbers."""

    name: str  # runner name: `decodelab run NAME`, notebooks/params/NAME/, results/NAME/
    file: str  # the notebook under notebooks/
    title: str
    question: str  # one sentence
    headline: tuple[str, ...]  # figure stems, in order; the first figure saved is the fallback
    # the few numbers that support the answer, in order: dotted names into metrics.json, shell-style
    # patterns allowed ("ours_over_hf.*"), each optionally paired with a readable label whose {0}, {1}
    # are the parts the `*`s matched; empty -> the first few top-level scalars
    key_metrics: tuple[str | tuple[str, str], ...] = ()
    timing_metrics: tuple[str, ...] = TIMING_METRICS  # patterns over metric keys and goal names
    timing_figures: tuple[str, ...] = TIMING_FIGURES  # patterns over figure stems
    package: str = ""  # the question subpackage under decodelab/ holding the notebook's code
    # `-p key=value` items that cut the gpu profile down for scripts/gpu_check.sh (< 8 minutes in all)
    gpu_check: tuple[str, ...] = ()
    # `decodelab bench COMMAND` measured by this notebook's code: (COMMAND, module of the measurement)
    bench: tuple[str, str] | None = None


NOTEBOOKS: dict[str, Notebook] = {nb.name: nb for nb in (
    Notebook(
        "quickstart", "00_quickstart.ipynb", "00 · Quickstart: the decode engine",
        "How fast does the embedded model decode on this machine, and how does throughput grow with batch size?",
        ("throughput_vs_batch",),
        (("greedy_match", "greedy tokens identical to HF generate() in every row"),
         ("ours_over_hf.*", "ours / HF tokens/s at batch {0}"),
         ("identical_greedy_rows.*", "identical greedy rows at batch {0}")),
        package="quickstart", bench=("decode", "decodelab.quickstart.bench"),
        gpu_check=("max_new_tokens=64", "batch_sizes=[1,16,128]"),
    ),
    Notebook(
        "speculation", "01_speculation_vs_batch.ipynb", "01 · Speculative decoding vs batch size",
        "Does speculative decoding still speed up generation as the batch grows, does a per-row draft-length "
        "policy avoid losing to plain decoding, and does speculation gain with batch at long context?",
        ("speedup_vs_batch",),
        (("greedy_match", "speculative greedy tokens identical to plain greedy"),
         ("acceptance_alpha.*", "acceptance rate alpha ({0})"),
         ("crossover_batch.*.measured", "measured crossover batch ({0}; 'not measured' = no loss at any swept batch)"),
         ("crossover_batch.*.predicted", "predicted crossover batch ({0}; 'not measured' = none up to batch 8192)"),
         ("roofline_heldout_error", "roofline median error on held-out cells"),
         ("roofline_insample_error", "roofline median error in sample")),
        TIMING_METRICS + ("*crossover*", "*roofline*"),
        package="speculation",
        gpu_check=("batch_sizes=[1,16,128]", "ks=[2,4]", "max_new_tokens=64", "calibration_repeats=2"),
    ),
    Notebook(
        "sampling", "02_minp_vs_topp.ipynb", "02 · min-p vs top-p",
        "Is min-p sampling better than top-p across temperatures once both are tuned fairly?",
        ("accuracy_vs_temperature",),
        (("greedy_accuracy", "greedy accuracy"), ("difficulty", "problem difficulty"),
         ("matched_min_p", "min-p matched to top-p"), ("matched_min_p.*", "min-p matched to top-p ({0})"),
         ("generation_tokens_per_s", "generation tokens/s")),
        TIMING_METRICS + ("sampler_cost*",),
        package="sampling_study",
        gpu_check=("n_problems=32", "temperatures=[0.7,1.5]", "n_writing_prompts=8", "writing_samples=4",
                   "confidence_steps=512", "n_boot=200"),
    ),
    Notebook(
        "mtp", "03_mtp_training.ipynb", "03 · Multi-token prediction",
        "Does training with multi-token prediction hurt or help a small model, do its heads make useful drafters, "
        "and can MTP be retrofitted onto the embedded model?",
        ("loss_curves",),
        (("val_loss.*.mean", "validation loss ({0})"), ("head_accuracy.*", "head accuracy ({0})"),
         ("retrofit.*.head_2_accuracy", "retrofit head-2 accuracy on held-out text ({0})"),
         ("frozen_next_token_val_loss.mean", "frozen model's own next-token loss (unchanged by the retrofit)"),
         ("retrofit_frozen_bit_identical", "frozen weights bit-identical after the retrofit"),
         ("retrofit_module_frozen_logits_identical", "next-token logits bit-identical with the module attached"),
         ("retrofit_module_greedy_match", "self-speculation with the shipped module: greedy identical to plain"),
         ("step_time_ratio", "training step time, MTP / next-token"),
         ("peak_mem_ratio", "peak memory, MTP / next-token")),
        package="mtp",
        gpu_check=("n_heads=[1,4]", "mtp_style=[gloeckle]", "train_tokens=1048576", "seeds=[0]",
                   "retrofit_tokens=131072", "retrofit_steps=50", "spec_batch_sizes=[1,8]"),
    ),
    Notebook(
        "masking", "04_masking_distortion.ipynb", "04 · Distortion under masking",
        "How far does constrained decoding by token masking move the output distribution from the model's "
        "distribution conditioned on the grammar, what does an exact fix cost, and does reasoning freely "
        "before a constrained answer remove the accuracy loss?",
        ("distortion_per_task",),
        (("kl_masked.*", "KL, masked vs grammar-conditioned ({0})"),
         ("tv_masked.*", "total variation, masked vs grammar-conditioned ({0})"),
         ("jump_forward_greedy_identical", "jump-forward greedy identical (output-preserving mode)"),
         ("jump_forward_saved_frac_tokens", "forward passes saved by jump-forward (output-preserving)"),
         ("jump_forward_saved_frac_retokenize", "forward passes saved by jump-forward (re-tokenizing)"),
         ("jump_forward_outputs_changed", "outputs the re-tokenizing mode changed"),
         ("mask_overhead_mean.*.*", "mask overhead, mean fill, {0}, {1}"),
         ("naive_slowdown", "naive mask slowdown"), ("naive_slowdown.*", "naive mask slowdown ({0})")),
        TIMING_METRICS + ("mask_us*", "decode_step*"),
        package="constrained", gpu_check=("n_samples=8", "max_new_tokens=64"),
    ),
    Notebook(
        "consistency", "05_self_consistency_kv.ipynb", "05 · Self-consistency with a shared prompt KV cache",
        "How cheap does sharing the prompt's KV cache make self-consistency (against one sample), how does "
        "accuracy grow with the number of samples, and how much do stopping rules and confidence filtering save?",
        ("cost_vs_n",),
        (("shared_equals_unshared", "shared-prefix samples identical to unshared"),
         ("speedup_vs_hf", "speedup vs HF"), ("kv_ratio_vs_hf_measured", "KV bytes vs HF (measured)"),
         ("kv_ratio_vs_hf_analytic", "KV bytes vs HF (analytic)"), ("peak_ratio_vs_hf", "peak memory ratio vs HF"),
         ("goal_measured_at.prompt_len", "measured at prompt length"), ("goal_measured_at.n", "measured at n samples"),
         ("greedy_accuracy", "greedy accuracy"), ("no_answer_rate", "no-answer rate")),
        TIMING_METRICS + ("cost*",),
        package="consistency",
        gpu_check=("n_problems=16", "n_values=[1,4,16]", "prompt_lengths=[512,2048]", "cost_n_values=[1,16]"),
    ),
    Notebook(
        "reuse", "06_trace_reuse.ipynb", "06 · Reasoning-trace reuse",
        "Can answered problems make the next similar one cheaper: which reuse of earlier reasoning traces cuts "
        "target forward passes per query, at what accuracy, and how fast does the cost fall as the stream grows?",
        ("amortization_curve", "forwards_and_speedup"),
        (("lossless_all_identical", "lossless methods' greedy output identical to plain"),
         ("amortization_ratio", "cost per query after N queries / first query's"),
         ("shared_prefix.B=1.saved", "prefill time saved by the shared prefix (batch 1)"),
         ("plain_accuracy_by_family.*", "plain chain-of-thought accuracy ({0})")),
        TIMING_METRICS + ("shared_prefix*",),
        package="reuse",
        gpu_check=("n_queries=60", "max_new_tokens=128", "step_thresholds=[0.5]", "batch_sizes=[1,16]"),
    ),
)}


def check_name(name: str) -> Notebook:
    """The record of runner name `name`; ValueError listing the registered names otherwise."""
    if name not in NOTEBOOKS:
        raise ValueError(f"notebook={name!r} is not registered; allowed: {sorted(NOTEBOOKS)}")
    return NOTEBOOKS[name]


def bench_record(command: str) -> Notebook:
    """The notebook whose code measures `decodelab bench COMMAND`."""
    commands = {nb.bench[0]: nb for nb in NOTEBOOKS.values() if nb.bench}
    if command not in commands:
        raise ValueError(f"bench command {command!r} is not registered; allowed: {sorted(commands)}")
    return commands[command]


def bench_module(command: str) -> ModuleType:
    """The module of `decodelab bench COMMAND`'s measurement, imported by its registered name."""
    return importlib.import_module(bench_record(command).bench[1])


def run_command(name: str, profile: str = "cpu") -> str:
    """The command that produces a run of notebook `name`."""
    return f"decodelab run {name} --profile {profile}"
