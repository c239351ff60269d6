"""Notebook 04's findings: the sentences its section 7 prints, generated from one run's results."""
from __future__ import annotations

import pandas as pd

from decodelab.common import goals
from decodelab.common.goals import format_value


def findings_markdown(goal_rows: list, distortion_rows, corrected_rows, validity_rows: list[dict],
                      overhead_rows: list[dict], jf_summary: dict, *, awrs_rows: list[dict] | None = None,
                      ops: dict | None = None, crane: dict | None = None) -> list[str]:
    """Markdown lines: the goals' headline, then one line per experiment.

    distortion_rows: `task_distortion` summary rows (a list or DataFrame); corrected_rows: `run_corrector` rows
    with their task (each (task, method)'s largest budget is read); validity_rows: `validity_summary`;
    overhead_rows: `mask_overhead_summary` (compact trajectory shown); jf_summary: `jump_forward_summary`.
    awrs_rows: `corrector_cost.with_wall` rows and ops its `operation_seconds` (AWRS line); crane:
    `crane_study.crane_summary` (reason-then-constrain line). Each optional line is left out when not given.
    """
    table = pd.DataFrame(distortion_rows)
    corrected = pd.DataFrame(corrected_rows)
    worst = table.loc[table.kl_masked.idxmax()]
    final = corrected.loc[corrected.groupby(["task", "method"]).forward_passes.idxmax()]  # each run's largest budget
    fill = [r for r in overhead_rows if r["trajectory"] == "compact"]
    lines = [
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
        f"- Jump-forward on {jf_summary['schemas']} fixed-key schema(s): output-preserving modes save "
        f"{format_value(jf_summary['saved_frac'].get('tokens'), '%')} (one-token masks) and "
        f"{format_value(jf_summary['saved_frac'].get('draft'), '%')} (verified forced-string drafts) of forward "
        "passes (greedy output identical: "
        f"{format_value(jf_summary['greedy_identical'])}); re-tokenizing saves "
        f"{format_value(jf_summary['saved_frac'].get('retokenize'), '%')} and changed the text of "
        f"{jf_summary['changed'].get('retokenize', 0)} and the tokens of "
        f"{jf_summary['changed_tokens'].get('retokenize', 0)} output(s).",
    ]
    if awrs_rows and ops:
        lines.append(awrs_line(awrs_rows, ops))
    if crane:
        lines.append(crane_line(crane))
    return lines


def awrs_line(rows: list[dict], ops: dict) -> str:
    """AWRS against masking: KL at masking's cost, checks per token, and the measured operation times."""
    from decodelab.constrained.corrector_cost import WALL_FACTOR, kl_at_masking_cost

    frame = pd.DataFrame(rows)
    parts = []
    for method in ("awrs_twist", "smc", "awrs_smc", "asap", "rejection", "awrs"):
        kls = kl_at_masking_cost(rows, method)
        if kls:
            parts.append(f"{method} {pd.Series(kls).median():.3g} (worst {max(kls.values()):.3g})")
    checks = {m: frame[frame.method == m].checks_per_token for m in ("awrs_twist", "awrs_smc")}
    names = {"awrs_twist": "twisted AWRS-SMC", "awrs_smc": "AWRS-SMC"}
    asks = [f"{names[m]} {checks[m].mean():.3g}" for m in names if len(checks[m])]
    return (f"- At <= {WALL_FACTOR}x plain masking's wall time, KL to p(x | L) (median over tasks, nats): "
            + ", ".join(parts) + (f". Grammar checks per sampled token: {', '.join(asks)}" if asks else "")
            + f"; measured here: forward {ops['forward'] * 1e3:.3g} ms, full mask {ops['mask'] * 1e6:.3g} µs, "
              f"one check {ops['check'] * 1e6:.3g} µs, one draw {ops['draw'] * 1e6:.3g} µs.")


def crane_line(summary: dict) -> str:
    """Reason-then-constrain against free and fully constrained output: accuracy, validity, tokens, differences."""
    modes = ", ".join(f"{m['mode']} {format_value(m['accuracy'], '%')} (CI {format_value(m['accuracy_ci'][0], '%')}"
                      f"-{format_value(m['accuracy_ci'][1], '%')}; valid {format_value(m['validity'], '%')}; "
                      f"{m['tokens_mean']:.3g} tokens)" for m in summary["modes"])
    diffs = "; ".join(f"{name.replace('_minus_', ' - ')} {format_value(d['difference'], '%')} "
                      f"[{format_value(d['ci_low'], '%')}, {format_value(d['ci_high'], '%')}]"
                      for name, d in summary["differences"].items())
    n = summary["modes"][0]["n"] if summary["modes"] else 0
    line = f"- Arithmetic ({n} problems, greedy, accuracy): {modes}. Paired differences: {diffs}."
    if "disagreements" in summary:
        differ = summary["disagreements"]
        line += (f" The constrained answer field reads another answer than its own free draft in {len(differ)} of "
                 f"{n} problems ({sum(d['free'] == d['truth'] for d in differ)} where the draft was right).")
    return line
