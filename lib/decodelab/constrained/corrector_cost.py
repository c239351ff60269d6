"""Wall time of the correctors: each operation they perform, timed on this machine, times how often they do it.

The correctors run on the scored trie (`constrained.correctors`), which counts what a real decode would do
per sampled token instead of redoing it: one model forward, one softmax over the vocabulary, draws, and
either one full mask (masked, SMC, importance, ASAp: the grammar engine checks the whole vocabulary and the
bitmask is applied) or single-token grammar checks (rejection: the sampled token; AWRS: every draw). Each of
these operations is timed here with the model and the grammar engine of the run, on the tasks' own
constraints, and a run's wall time is assembled from its counts:

    wall = forward_passes * (t_forward + t_softmax) + draws * t_draw + masks * t_mask + checks * t_check

draws = forward_passes otherwise; AWRS instead pays one CDF per sampled token (t_cdf) and, per check, one
draw from that CDF with the rejected tokens skipped (t_awrs_draw: `awrs.Remaining.draw`, a walk past R and
a binary search, not a new pass over the vocabulary). The twisted AWRS-SMC is charged the same (its draws
from the tokens it already knows need the softmax and one draw, which the CDF's cost covers). The forward is the fastest
timed decode step at batch 1 (the same for every method, so it sets the scale; the per-token differences
between methods are the mask against the checks).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from decodelab.common.goals import Goal
from decodelab.constrained.awrs import Remaining
from decodelab.constrained.bitmask import allocate_bitmask, apply_bitmask
from decodelab.constrained.constraint import Constraint

KL_TARGET = 0.01      # nats: "exact" for the goal
WALL_FACTOR = 1.5     # ... within this multiple of plain masking's wall time
AWRS_METHODS = ("awrs", "awrs_smc", "awrs_twist")
JUDGED = "awrs_twist"  # the exact AWRS sampler the goal is judged on; GOAL_PAIR run to the larger budget
GOAL_PAIR = ("masked", JUDGED)
REMOVED_WHEN_TIMED = 16  # rejected tokens an AWRS draw walks past when timed (about a step's rejections)


def budgets_for(method: str, max_forward_passes: int, goal_forward_passes: int | None = None) -> list[int]:
    """Forward-pass budgets of one corrector's KL curve: up to goal_forward_passes for the goal's pair (masked
    and the judged sampler), up to max_forward_passes for the others.

    Why two: the goal reads KL at masking's largest budget, and a KL estimated from n samples cannot fall
    below an exact sampler's floor there (about (|L| - 1) / 2n nats: 0.045 on month_day's 366 dates at 20k
    passes), so the pair needs a budget whose floor is under KL_TARGET; the other correctors' curves only
    need to show their trend, and per-step AWRS draws cost ~30 draws a token in this simulation."""
    if goal_forward_passes is not None and goal_forward_passes < max_forward_passes:
        raise ValueError(f"goal_forward_passes={goal_forward_passes!r} must be >= max_forward_passes="
                         f"{max_forward_passes!r} (or None: the same budget)")
    from decodelab.constrained.correctors import budgets_up_to

    top = goal_forward_passes if goal_forward_passes is not None and method in GOAL_PAIR else max_forward_passes
    return budgets_up_to(top)


def _mean_seconds(fn, repeats: int) -> float:
    """Mean wall seconds of fn() over `repeats` calls (after one warm-up call)."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def operation_seconds(engine, tasks: list[dict], vocab_size: int, forward_s: float, *, repeats: int = 100,
                      seed: int = 0) -> dict[str, float]:
    """{forward, softmax, draw, cdf, awrs_draw, mask, check}: seconds of one of each operation (module doc).

    mask and check are averaged over the tasks' choice constraints at their start state: a full bitmask fill
    plus its application to (1, V) logits; one `accept` of a token drawn uniformly from the vocabulary
    (almost always rejected, as most AWRS checks are) or of an allowed token followed by `rollback(1)`."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, vocab_size, generator=gen)
    probs = torch.softmax(logits[0], -1)
    bitmask = allocate_bitmask(1, vocab_size)
    masks, checks = [], []
    rng = np.random.default_rng(seed)
    for task in tasks:
        matcher = engine.matcher(engine.compile(Constraint.choices(task["strings"], name=task["name"])))

        def fill_apply():
            matcher.fill(bitmask, 0)
            apply_bitmask(logits, bitmask)

        masks.append(_mean_seconds(fill_apply, repeats))
        matcher.fill(bitmask, 0)
        allowed = int(torch.nonzero(apply_bitmask(logits, bitmask)[0] > -torch.inf)[0])
        tokens = rng.integers(0, vocab_size, size=repeats + 1).tolist()

        def check_random():
            if matcher.accept(tokens.pop()):
                matcher.rollback(1)

        checks.append(_mean_seconds(check_random, repeats))

        def check_allowed():
            matcher.accept(allowed)
            matcher.rollback(1)

        checks.append(_mean_seconds(check_allowed, repeats))
    p = probs.double().numpy()
    left = Remaining(p)
    for token in np.argsort(-p)[:REMOVED_WHEN_TIMED]:  # a step that already rejected its likeliest tokens
        left.remove(int(token))
    return {"forward": forward_s,
            "softmax": _mean_seconds(lambda: torch.softmax(logits, -1), repeats),
            "draw": _mean_seconds(lambda: torch.multinomial(probs, 1, generator=gen), repeats),
            "cdf": _mean_seconds(lambda: Remaining(p), repeats),
            "awrs_draw": _mean_seconds(lambda: left.draw(rng), repeats),
            "mask": float(np.mean(masks)), "check": float(np.mean(checks))}


def wall_seconds(row: dict, ops: dict[str, float]) -> float:
    """A corrector row's (forward_passes, masks, checks) -> its wall seconds under `ops`."""
    passes = row["forward_passes"]
    base = passes * (ops["forward"] + ops["softmax"]) + row["masks"] * ops["mask"] + row["checks"] * ops["check"]
    if row["method"] in AWRS_METHODS:
        return base + passes * ops.get("cdf", 0.0) + row["checks"] * ops.get("awrs_draw", ops["draw"])
    return base + passes * ops["draw"]


def with_wall(rows: list[dict], ops: dict[str, float]) -> list[dict]:
    """Corrector rows with wall_s and checks_per_token added."""
    return [{**r, "wall_s": wall_seconds(r, ops), "checks_per_token": r["checks"] / r["forward_passes"]}
            for r in rows]


def kl_at_masking_cost(rows: list[dict], method: str, *, factor: float = WALL_FACTOR,
                       column: str = "kl") -> dict[str, float]:
    """{task: `column` (kl, or kl_floor: the exact-sampler floor at the same samples) of `method` at its largest
    budget whose wall time <= factor x masked's at its largest budget} (inf when even its smallest budget
    costs more). rows: `with_wall` rows with a task column."""
    out = {}
    for task in dict.fromkeys(r["task"] for r in rows):
        masked = [r for r in rows if r["task"] == task and r["method"] == "masked"]
        mine = [r for r in rows if r["task"] == task and r["method"] == method]
        if not masked or not mine:
            continue
        limit = factor * max(masked, key=lambda r: r["forward_passes"])["wall_s"]
        within = [r for r in mine if r["wall_s"] <= limit]
        out[task] = max(within, key=lambda r: r["forward_passes"])[column] if within else float("inf")
    return out


def awrs_goals(rows: list[dict], vocab_size: int, method: str = JUDGED) -> list[Goal]:
    """`method` (the twisted AWRS-SMC): KL <= KL_TARGET at <= WALL_FACTOR x masking's wall time on every task
    (the worst task is the value); its grammar checks per token against the vocabulary a full mask scans."""
    name = {"awrs_twist": "AWRS twisted SMC", "awrs_smc": "AWRS-SMC"}.get(method, method)
    kls = kl_at_masking_cost(rows, method)
    worst = max(kls, key=kls.get) if kls else None
    met = [t for t, v in kls.items() if v <= KL_TARGET]
    # the raw KL is judged; the floor (a perfect sampler's KL at the same samples) says how much of it is the
    # histogram's noise, which no sampler can remove at this budget
    floors = kl_at_masking_cost(rows, method, column="kl_floor") if all("kl_floor" in r for r in rows) else {}
    floor_note = (f"; judged: raw KL; exact-sampler floor on {worst} {floors[worst]:.3g} nats (excess "
                  f"{kls[worst] - floors[worst]:.3g}); tasks whose floor exceeds {KL_TARGET}: "
                  f"{sorted(t for t, v in floors.items() if v > KL_TARGET) or 'none'}") if worst in floors else ""
    per_token = [r["checks_per_token"] for r in rows if r["method"] == method]
    return [
        Goal.check("awrs_kl_at_masking_cost", kls.get(worst), "<=", KL_TARGET, unit="nats",
                   label=f"{name}: KL to p(x | L) at <= {WALL_FACTOR}x plain masking's wall time (worst task)",
                   note=f"worst: {worst}; {len(met)} of {len(kls)} tasks within {KL_TARGET} nats; median "
                        f"{np.median(list(kls.values())) if kls else float('nan'):.3g} nats{floor_note}"),
        Goal.check("awrs_checks_per_token", float(np.mean(per_token)) if per_token else None, "<=",
                   0.01 * vocab_size, unit="",
                   label=f"{name} grammar checks per token (a full mask checks all {vocab_size}; target 1% of that)"),
    ]
