"""Notebook 04's findings: the sentences its section 7 prints, generated from one run's results."""
from __future__ import annotations

import pandas as pd

from decodelab.common import goals
from decodelab.common.goals import format_value


def findings_markdown(goal_rows: list, distortion_rows, corrected_rows, validity_rows: list[dict],
                      overhead_rows: list[dict], jf_summary: dict) -> list[str]:
    """Markdown lines: the goals' headline, then one line per experiment.

    distortion_rows: `task_distortion` summary rows (a list or DataFrame); corrected_rows: `run_corrector` rows
    with their task (each (task, method)'s largest budget is read); validity_rows: `validity_summary`;
    overhead_rows: `mask_overhead_summary` (compact trajectory shown); jf_summary: `jump_forward_summary`.
    """
    table = pd.DataFrame(distortion_rows)
    corrected = pd.DataFrame(corrected_rows)
    worst = table.loc[table.kl_masked.idxmax()]
    final = corrected.loc[corrected.groupby(["task", "method"]).forward_passes.idxmax()]  # each run's largest budget
    fill = [r for r in overhead_rows if r["trajectory"] == "compact"]
    return [
        f"**{goals.headline(goal_rows)}**",
        f"- Exact distortion over {len(table)} task(s): masked sampling's KL to p(x | L) is "
        f"{table.kl_masked.min():.3g} to {table.kl_masked.max():.3g} nats (largest: `{worst.task}`, "
        f"TV {worst.tv_masked:.2f}); masking to canonical tokenizations only: {table.kl_masked_canonical.min():.3g} "
        f"to {table.kl_masked_canonical.max():.3g} nats.",
        "- Estimate KL at each corrector's largest budget (median over tasks): "
        + ", ".join(f"{m} {v:.3g}" for m, v in final.groupby("method").kl.median().sort_values().items()) + " nats.",
        "- Validity of finished outputs: " + ", ".join(
            f"{r['engine']} {format_value(r['validity_rate'], '%')} ({r['valid']}/{r['finished']}; {r['truncated']} "
            f"of {r['n']} truncated)" for r in validity_rows) + ".",
        "- Mask fill per token, compact JSON (mean / p50 / p99): " + ", ".join(
            f"{r['engine']} {r['mean_us']:.3g} / {r['p50_us']:.3g} / {r['p99_us']:.3g} µs" for r in fill) + ".",
        f"- Jump-forward on {jf_summary['schemas']} fixed-key schema(s): output-preserving mode saves "
        f"{format_value(jf_summary['saved_frac'].get('tokens'), '%')} of forward passes (greedy output identical: "
        f"{format_value(jf_summary['greedy_identical'])}); re-tokenizing saves "
        f"{format_value(jf_summary['saved_frac'].get('retokenize'), '%')} and changed the text of "
        f"{jf_summary['changed'].get('retokenize', 0)} and the tokens of "
        f"{jf_summary['changed_tokens'].get('retokenize', 0)} output(s).",
    ]
