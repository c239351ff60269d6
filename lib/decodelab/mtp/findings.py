"""What notebook 03's numbers say: the retrofit reported by its new heads, and findings generated from a run.

- `retrofit_report` / `retrofit_table`: per retrofit design, the new heads' held-out top-1 accuracy and their value as a
  drafter (tau, per-position acceptance, speedup, greedy identity per batch size).
- `frozen_next_token_loss`: the frozen model's own next-token validation loss. The heads cannot change it
  (the trunk is frozen), so it is shown labelled as the frozen model's, never as the retrofit's result.
- `draft_value`: one number from the self-speculative rows (e.g. the acceptance of head 2 at the largest batch).
- `cost_lines`: what section 2's training-cost measurement says, as sentences (size, measured vs predicted ratio).
- `identical_rows` / `summary`: the caption's and the closing findings' text, generated from the numbers.
"""
from __future__ import annotations

from decodelab.common.goals import Goal, format_value, headline

GRAD_CHECK_TOLERANCE = 1e-5  # max |g_sequential - g_joint| allowed: float32 summation-order noise only


def retrofit_report(results: list[dict], draft_rows: list[dict]) -> dict:
    """{config: {"head_accuracy": [head 1 (the frozen LM head), head 2, ...], "head_2_accuracy",
    "head_loss": [...], "draft": [{"batch", "tau", "acceptance", "speedup", "greedy_match"}]}}.

    results: `decodelab.mtp.experiment.train_and_evaluate` outputs of the retrofit configs; draft_rows:
    `decodelab.mtp.cost.self_spec_benchmark` rows (rows of other models are ignored).
    """
    out = {}
    for r in results:
        accuracy = list(r["eval"]["head_accuracy"])
        out[r["name"]] = {
            "head_accuracy": accuracy,
            "head_2_accuracy": accuracy[1] if len(accuracy) > 1 else None,
            "head_loss": list(r["eval"]["head_loss"]),
            "draft": [{key: row[key] for key in ("batch", "tau", "acceptance", "speedup", "greedy_match")}
                      for row in draft_rows if row["model"] == r["name"]],
        }
    return out


def retrofit_table(report: dict) -> list[dict]:
    """Rows for display: per retrofit design, each head's held-out accuracy (head 1 = the frozen LM head's
    own) and loss from head 2 on, then the drafting numbers at the largest batch."""
    rows = []
    for name, entry in report.items():
        row = {"config": name}
        row.update({f"head_{j + 1}_accuracy": a for j, a in enumerate(entry["head_accuracy"])})
        row.update({f"head_{j + 1}_loss": v for j, v in enumerate(entry["head_loss"]) if j >= 1})
        if entry["draft"]:
            draft = max(entry["draft"], key=lambda d: d["batch"])
            row.update({"draft_batch": draft["batch"], "tau": draft["tau"], "speedup": draft["speedup"],
                        "greedy_match": draft["greedy_match"]})
            row.update({f"acceptance_pos_{i + 1}": a for i, a in enumerate(draft["acceptance"])})
        rows.append(row)
    return rows


def frozen_next_token_loss(results: list[dict], model: str | None = None) -> dict | None:
    """The frozen trunk's next-token validation loss (head 1 of any retrofit config: they share the trunk).

    -> {"model", "mean", "ci95" (bootstrap over validation blocks), "configs"}; None without retrofit results.
    Raises ValueError if two configs disagree, which would mean the trunk did not stay frozen.
    """
    from decodelab.mtp.experiment import bootstrap_mean

    if not results:
        return None
    losses = {r["name"]: r["eval"]["head_loss"][0] for r in results}
    if len(set(losses.values())) > 1:
        raise ValueError(f"retrofit configs report different frozen next-token losses {losses}: the trunk changed")
    _, low, high = bootstrap_mean(results[0]["eval"]["val_block_loss"])
    return {"model": model, "mean": results[0]["eval"]["head_loss"][0], "ci95": [low, high], "configs": list(losses)}


def draft_value(rows: list[dict], model: str, key: str, *, batch: int | str = "max", position: int | None = None):
    """One value of `model`'s self-speculative rows at `batch` ("max" = the largest batch, which covers the
    most prompts), or None if there is no such row. position: index into a per-position list (acceptance)."""
    mine = [row for row in rows if row["model"] == model]
    if batch == "max" and mine:
        batch = max(row["batch"] for row in mine)
    chosen = [row for row in mine if row["batch"] == batch]
    if not chosen:
        return None
    value = chosen[0][key]
    if position is not None:
        value = value[position] if len(value) > position else None
    return None if value != value else value  # NaN (no draft reached the position) -> None


def identical_rows(rows: list[dict]) -> tuple[int, int]:
    """(decoded rows identical to plain greedy, decoded rows) over self-speculative benchmark rows."""
    return sum(row["rows_identical"] for row in rows), sum(row["batch"] for row in rows)


def _interval(entry: dict) -> str:
    return f"{entry['mean']:.3f} [{entry['ci95'][0]:.3f}, {entry['ci95'][1]:.3f}]"


def _scratch_lines(metrics: dict, params: dict) -> list[str]:
    losses = metrics.get("val_loss") or {}
    if not losses:
        return []
    lines = []
    base = losses.get("ntp")
    for name, entry in losses.items():
        if name == "ntp" or base is None:
            continue
        diff = entry["mean"] - base["mean"]
        apart = entry["ci95"][0] > base["ci95"][1] or entry["ci95"][1] < base["ci95"][0]
        verdict = ("higher" if diff > 0 else "lower") + (" (95% intervals do not overlap)" if apart
                                                         else " (95% intervals overlap: no difference shown)")
        lines.append(f"{name}: main-head validation loss {_interval(entry)} vs next-token {_interval(base)} nats, "
                     f"{abs(diff):.3f} {verdict}.")
    if params:
        lines.append(f"From-scratch models hold {params['min']:,}-{params['max']:,} parameters; Gloeckle et al. "
                     "report multi-token training hurting quality at 0.3B and helping from 1.3B "
                     "(docs/RESEARCH.md, section 3).")
    return lines


def cost_lines(cost: dict) -> list[str]:
    """Section 2's findings from a `decodelab.mtp.cost.training_cost` result: the size it was measured at, the
    measured step-time ratio beside the matmul-FLOP prediction, and the memory ratio split into its parts."""
    at, (base, seq, joint) = cost["cost_measured_at"], cost["rows"]
    flops = cost["flops"]
    gap = cost["step_time_ratio"] / cost["flop_ratio"] - 1
    extra = at["n_heads"] - 1
    return [
        f"Measured at: a {at['n_layers']}-layer trunk, d_model={at['d_model']}, vocabulary {at['vocab_size']} "
        f"({base['params']:,} parameters; {seq['params']:,} with {extra} extra head{'s' * (extra != 1)}), "
        f"{at['batch_size']}x{at['seq_len']} tokens per step, on {at['device']}; the next-token step takes "
        f"{base['step_s'] * 1e3:.0f} ms (fastest of {at['repeats']}, slowest {base['step_s_max'] * 1e3:.0f} ms).",
        f"Step time with {at['n_heads']} heads: {cost['step_time_ratio']:.2f}x the next-token step (sequential "
        f"backward; {cost['step_time_ratio_joint']:.2f}x joint). Matmul FLOPs predict {cost['flop_ratio']:.2f}x: "
        f"each extra head adds one layer and one unembedding, {flops['unembed'] / flops['layer']:.2f} of a layer's "
        f"FLOPs, to a trunk of {at['n_layers']} layers; the measured ratio is {abs(gap):.0%} "
        f"{'above' if gap > 0 else 'below'} the prediction (norms, loss, optimizer and per-op overhead).",
        f"Peak memory with {at['n_heads']} heads: {cost['peak_mem_ratio']:.2f}x the next-token step's "
        f"({seq['total_peak_bytes'] / 2**20:.1f} vs {base['total_peak_bytes'] / 2**20:.1f} MiB: parameters + AdamW "
        f"moments {seq['state_bytes'] / base['state_bytes']:.2f}x, the step's own allocations "
        f"{cost['step_peak_mem_ratio']:.2f}x); joint backward {cost['peak_mem_ratio_joint']:.2f}x "
        f"({joint['total_peak_bytes'] / 2**20:.1f} MiB).",
    ]


def summary(metrics: dict, goal_rows: list[Goal], *, scratch_params: dict | None = None) -> list[str]:
    """The closing findings as sentences, every figure read from `metrics` (metrics.json) and `goal_rows`."""
    lines = [headline(goal_rows)]
    if "step_time_ratio" in metrics:
        at = metrics.get("cost_measured_at", {})
        lines.append(
            f"A training step with {at.get('n_heads')} heads costs {metrics['step_time_ratio']:.2f}x the next-token "
            f"step with the sequential head backward ({metrics['step_time_ratio_joint']:.2f}x joint) and "
            f"{metrics['peak_mem_ratio']:.2f}x its peak memory ({metrics['peak_mem_ratio_joint']:.2f}x joint), at "
            f"d_model={at.get('d_model')}, a {at.get('n_layers')}-layer trunk, {at.get('batch_size')}x"
            f"{at.get('seq_len')} tokens, vocabulary {at.get('vocab_size')}, on {at.get('device')} (fastest of "
            f"{at.get('repeats')})"
            + (f"; matmul FLOPs predict {metrics['flop_ratio']:.2f}x." if "flop_ratio" in metrics else "."))
    if "grad_check_max_abs_diff" in metrics:
        diff = metrics["grad_check_max_abs_diff"]
        ok = "within" if diff <= GRAD_CHECK_TOLERANCE else "OUTSIDE"
        lines.append(f"Sequential and joint backward gradients differ by at most {diff:.2g}, {ok} the tolerance "
                     f"{GRAD_CHECK_TOLERANCE:g}; the one-head loss differs from the plain next-token loss by "
                     f"{metrics.get('one_head_loss_abs_diff', float('nan')):.2g}.")
    lines += _scratch_lines(metrics, scratch_params or {})
    rows = metrics.get("self_spec") or []
    if rows:
        same, total = metrics.get("self_spec_rows_identical", [None, None])
        taus = [row["tau"] for row in rows]
        speedups = [row["speedup"] for row in rows]
        lines.append(f"Self-speculative greedy decoding: {same}/{total} decoded rows identical to plain greedy; "
                     f"tau {min(taus):.2f}-{max(taus):.2f}, speedup {min(speedups):.2f}-{max(speedups):.2f}x "
                     "over plain greedy (fastest runs).")
    for name, entry in (metrics.get("retrofit") or {}).items():
        draft = max(entry["draft"], key=lambda d: d["batch"]) if entry["draft"] else None
        text = f"{name}: head 2 top-1 accuracy {format_value(entry['head_2_accuracy'], '%')} on held-out text"
        if draft is not None:
            acc = draft["acceptance"][0] if draft["acceptance"] else None
            text += (f"; as a drafter at batch {draft['batch']}: head-2 acceptance "
                     f"{format_value(acc if acc == acc else None, '%')}, tau {draft['tau']:.2f}, "
                     f"speedup {draft['speedup']:.2f}x")
        lines.append(text + ".")
    frozen = metrics.get("frozen_next_token_val_loss")
    if frozen:
        identical = metrics.get("retrofit_frozen_bit_identical")
        lines.append(f"The frozen {frozen['model']}'s own next-token validation loss is {_interval(frozen)} nats; "
                     f"the retrofit cannot change it (frozen weights bit-identical after training: "
                     f"{format_value(identical)}).")
    return lines


def _pct(value) -> str:
    return format_value(value, "%")


def module_claim(module: dict, rows: list[dict], *, category: str = "code_edit",
                 acceptance: dict | None = None) -> list[str]:
    """Sentences answering the brief's "can't retrofit" from the shipped module's numbers.

    module: {"name", "source", "record"} (`decodelab.mtp.shipped.obtain_module`'s, record = record.json);
    rows: `decodelab.mtp.draft_eval.drafter_rows` (drafters "mtp", "ngram", "layer_skip");
    acceptance: `decodelab.mtp.draft_eval.prompt_acceptance` on `category` (the wider sample the acceptance goal
    reads), or None to read position 1 from the timed rows.
    """
    from decodelab.mtp.draft_eval import best_k, pick

    record = module["record"]
    spec = record["spec"]
    lines = [f"Module {record['name']} ({module['source']}, sha256 {record['sha256'][:12]}...): one DeepSeek-style "
             f"block on the frozen {record['model']}, trained {spec['steps']} steps by "
             f"{'KL self-distillation' if spec['loss'] == 'kl' else 'plain next-token labels'} on "
             f"{record['distill_set']['tokens']:,} tokens in {record['train_s'] / 60:.1f} min "
             f"(+{record['data_s'] / 60:.1f} min to build its data: the model's answers, the frozen model's states"
             f"{', as the cached set recorded its build' if record.get('data_from_cache') else ''}; "
             f"load average {record['load_average']})."]
    batch1 = pick(rows, "batch", drafter="mtp", category=category)
    acc = pick(rows, "acceptance", drafter="mtp", category=category) or []
    tau = pick(rows, "tau", drafter="mtp", category=category)
    speed = pick(rows, "speedup", drafter="mtp", category=category)
    if tau is None:
        return lines
    positions = ", ".join(f"{_pct(a)}" for a in acc)
    text = (f"On {category} at batch {batch1} it drafts k={len(acc)} tokens per step with acceptance {positions} "
            f"at positions 1-{len(acc)}, tau {tau:.2f}, speedup {speed:.2f}x over plain greedy")
    others = []
    for name in ("ngram", "layer_skip"):
        t = pick(rows, "tau", drafter=name, category=category)
        s = pick(rows, "speedup", drafter=name, category=category)
        if t is not None:
            others.append(f"{name} tau {t:.2f}, {s:.2f}x")
    lines.append(text + (f" ({'; '.join(others)})." if others else "."))
    fastest = best_k(rows, drafter="mtp", category=category, batch=batch1)
    if fastest is not None and fastest["k"] != len(acc):
        lines.append(f"Its fastest draft length at batch {batch1} is k={fastest['k']}: {fastest['speedup']:.2f}x "
                     f"(tau {fastest['tau']:.2f}).")
        speed = fastest["speedup"]
    first = acc[0] if acc else None
    if acceptance is not None and acceptance["acceptance"][0] is not None:
        first = acceptance["acceptance"][0]
        low, high = acceptance["ci"][0]
        lines.append(f"Over {acceptance['prompts']} {category} prompts decoded alone (untimed, k={acceptance['k']}), "
                     f"position-1 acceptance is {_pct(first)} ({acceptance['level']:.0%} interval over prompts "
                     f"{_pct(low)}-{_pct(high)}), tau {acceptance['tau']:.2f}.")
    if first is not None and first >= 0.60 and speed >= 1.3:
        verdict = ("yes: a module trained after the fact on the model's own outputs drafts at DeepSeek's "
                   "reused-module level and pays for itself")
    elif first is not None and first >= 0.60:
        verdict = ("partly: the acceptance is there, but at this size the module's own forward eats the gain")
    elif speed is not None and speed >= 1.0:
        verdict = "partly: it pays for itself, below the 60% acceptance DeepSeek's jointly trained module reaches"
    else:
        verdict = (f"not with this training budget: position-1 acceptance {_pct(first)} is below the 60% target and "
                   "decoding is not faster; the frozen trunk's states were trained for one token only")
    lines.append(f"Can MTP be retrofitted onto a model trained for one token? {verdict} (next-token output "
                 "unchanged by construction: the trunk is frozen and greedy output is identical).")
    return lines
