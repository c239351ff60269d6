"""What each notebook asks, which figure answers it, which numbers support the answer, and which of
them are timings (not comparable when the machine was loaded). Read by the report and the findings.
"""
from __future__ import annotations

from dataclasses import dataclass

# Names (metric keys, goal names, figure stems) that measure time: published from a loaded run only
# with `decodelab findings --allow-loaded`. Quality numbers (accuracy, KL, tau, loss) are not timings.
TIMING_METRICS = ("*speedup*", "*tokens_per_s*", "*tok_s*", "*seconds*", "*_s", "*_ms", "*_us", "*time*",
                  "*slowdown*", "*overhead*", "*throughput*", "*latency*", "*ours_over_hf*")
TIMING_FIGURES = ("*speedup*", "*throughput*", "*time*", "*latency*", "*cost*", "*overhead*", "*slowdown*")


@dataclass(frozen=True)
class Question:
    """What one notebook asks and which figure answers it."""

    name: str  # runner name
    title: str
    question: str  # one sentence
    headline: tuple[str, ...]  # figure stems, in order; the first figure saved is the fallback
    # the few numbers that support the answer, in order: dotted names into metrics.json, shell-style
    # patterns allowed ("ours_over_hf.*"), each optionally paired with a readable label whose {0}, {1}
    # are the parts the `*`s matched; empty -> the first few top-level scalars
    key_metrics: tuple[str | tuple[str, str], ...] = ()
    timing_metrics: tuple[str, ...] = TIMING_METRICS  # patterns over metric keys and goal names
    timing_figures: tuple[str, ...] = TIMING_FIGURES  # patterns over figure stems


QUESTIONS: dict[str, Question] = {q.name: q for q in (
    Question(
        "quickstart", "00 · Quickstart: the decode engine",
        "How fast does the embedded model decode on this machine, and how does throughput grow with batch size?",
        ("throughput_vs_batch",),
        (("greedy_match", "greedy tokens identical to HF generate() in every row"),
         ("ours_over_hf.*", "ours / HF tokens/s at batch {0}"),
         ("identical_greedy_rows.*", "identical greedy rows at batch {0}")),
    ),
    Question(
        "speculation", "01 · Speculative decoding vs batch size",
        "Does speculative decoding still speed up generation as the batch grows, and does any draft-length "
        "policy avoid losing to plain decoding?",
        ("speedup_vs_batch",),
        (("greedy_match", "speculative greedy tokens identical to plain greedy"),
         ("acceptance_alpha.*", "acceptance rate alpha ({0})"),
         ("crossover_batch.*.measured", "measured crossover batch ({0})"),
         ("crossover_batch.*.predicted", "predicted crossover batch ({0})"),
         ("roofline_heldout_error", "roofline median error on held-out cells"),
         ("roofline_insample_error", "roofline median error in sample")),
        TIMING_METRICS + ("*crossover*", "*roofline*"),
    ),
    Question(
        "sampling", "02 · min-p vs top-p",
        "Is min-p sampling better than top-p across temperatures once both are tuned fairly?",
        ("accuracy_vs_temperature",),
        (("greedy_accuracy", "greedy accuracy"), ("difficulty", "problem difficulty"),
         ("matched_min_p", "min-p matched to top-p"), ("matched_min_p.*", "min-p matched to top-p ({0})"),
         ("generation_tokens_per_s", "generation tokens/s")),
        TIMING_METRICS + ("sampler_cost*",),
    ),
    Question(
        "mtp", "03 · Multi-token prediction",
        "Does training with multi-token prediction hurt or help a small model, and do its heads make useful drafters?",
        ("loss_curves",),
        (("val_loss.*.mean", "validation loss ({0})"), ("head_accuracy.*", "head accuracy ({0})"),
         ("retrofit.*.head_2_accuracy", "retrofit head-2 accuracy on held-out text ({0})"),
         ("frozen_next_token_val_loss.mean", "frozen model's own next-token loss (unchanged by the retrofit)"),
         ("retrofit_frozen_bit_identical", "frozen weights bit-identical after the retrofit"),
         ("step_time_ratio", "training step time, MTP / next-token"),
         ("peak_mem_ratio", "peak memory, MTP / next-token")),
    ),
    Question(
        "masking", "04 · Distortion under masking",
        "How far does constrained decoding by token masking move the output distribution from the model's "
        "distribution conditioned on the grammar, per task?",
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
    ),
    Question(
        "consistency", "05 · Self-consistency with a shared prompt KV cache",
        "How cheap does sharing the prompt's KV cache make self-consistency, and how does accuracy grow with "
        "the number of samples?",
        ("cost_vs_n",),
        (("shared_equals_unshared", "shared-prefix samples identical to unshared"),
         ("speedup_vs_hf", "speedup vs HF"), ("kv_ratio_vs_hf_measured", "KV bytes vs HF (measured)"),
         ("kv_ratio_vs_hf_analytic", "KV bytes vs HF (analytic)"), ("peak_ratio_vs_hf", "peak memory ratio vs HF"),
         ("goal_measured_at.prompt_len", "measured at prompt length"), ("goal_measured_at.n", "measured at n samples"),
         ("greedy_accuracy", "greedy accuracy"), ("no_answer_rate", "no-answer rate")),
        TIMING_METRICS + ("cost*",),
    ),
)}


def run_command(name: str, profile: str = "cpu") -> str:
    """The command that produces a run of notebook `name`."""
    return f"decodelab run {name} --profile {profile}"
