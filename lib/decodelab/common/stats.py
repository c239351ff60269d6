"""Statistics every question uses: bootstrap intervals, paired differences, power and sample
size of paired comparisons, Pareto frontiers, interpolation."""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable, Sequence

import numpy as np


def bootstrap_ci(
    values: Sequence[float] | np.ndarray, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
    statistic: Callable[[np.ndarray], np.ndarray] = lambda x: x.mean(axis=-1),
) -> tuple[float, float, float]:
    """(estimate, low, high): percentile bootstrap over units (rows of `values`)."""
    x = np.asarray(values, dtype=float)
    if x.shape[0] == 0:
        raise ValueError("values is empty: need at least one unit to bootstrap")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.shape[0], size=(n_boot, x.shape[0]))
    boots = statistic(x[idx])
    alpha = (1 - level) / 2
    return float(statistic(x[None])[0]), float(np.quantile(boots, alpha)), float(np.quantile(boots, 1 - alpha))


def paired_bootstrap_diff(
    a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, *, n_boot: int = 2000, seed: int = 0,
    level: float = 0.95,
) -> dict:
    """mean(a) - mean(b) with a paired percentile bootstrap interval: the same resampled units
    (problems, prompts) for both, so shared per-unit difficulty cancels.

    Returns {difference, ci_low, ci_high, excludes_zero}.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"a.shape={a.shape} != b.shape={b.shape}: a paired bootstrap needs one value per unit in each")
    diff, low, high = bootstrap_ci(a - b, n_boot=n_boot, seed=seed, level=level)
    return {"difference": diff, "ci_low": low, "ci_high": high, "excludes_zero": bool(low > 0 or high < 0)}


def z_value(level: float = 0.95) -> float:
    """Two-sided normal quantile z_{1 - (1 - level) / 2}: 1.96 at level 0.95."""
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} must be in (0, 1)")
    return NormalDist().inv_cdf(1 - (1 - level) / 2)


def sd_of_differences(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """Sample standard deviation (ddof=1) of the per-unit differences a - b; NaN below two units."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    return float(d.std(ddof=1)) if len(d) >= 2 else float("nan")


def planning_sd(sd_of_differences: float, n: int, *, bounded: bool = True) -> float:
    """The spread to plan with: the observed sd of per-unit differences, but for differences of values
    in [0, 1] (accuracies) at least sqrt(1 / n), the sd one discordant unit out of n would give. A
    sample that shows no disagreement has not shown that there is none (three problems that all
    score 0 under both samplers must not read as "any difference would have been detected")."""
    if not bounded or n < 1 or not math.isfinite(sd_of_differences):
        return sd_of_differences
    return max(sd_of_differences, math.sqrt(1 / n))


def required_pairs(sd_of_differences: float, half_width: float, *, level: float = 0.95) -> int:
    """Units a paired mean difference needs for a CI half-width <= `half_width`: ceil((z sd / h)^2).
    At least 2 (a standard deviation needs two units)."""
    if not half_width > 0:
        raise ValueError(f"half_width={half_width!r} must be > 0")
    if not sd_of_differences >= 0:
        raise ValueError(f"sd_of_differences={sd_of_differences!r} must be >= 0 (and not NaN)")
    return max(2, math.ceil((z_value(level) * sd_of_differences / half_width) ** 2 - 1e-9))


def minimum_detectable_difference(sd_of_differences: float, n: int, *, level: float = 0.95,
                                  power: float = 0.8) -> float:
    """Smallest true mean difference a paired comparison of n units detects (two-sided, at `level`)
    with probability `power`: (z_{1 - alpha/2} + z_power) * sd / sqrt(n). NaN when n < 2 or sd is NaN."""
    if not 0 < power < 1:
        raise ValueError(f"power={power!r} must be in (0, 1)")
    if n < 2 or not math.isfinite(sd_of_differences):
        return float("nan")
    return (z_value(level) + NormalDist().inv_cdf(power)) * sd_of_differences / math.sqrt(n)


def mdd_from_interval(low: float, high: float, *, level: float = 0.95, power: float = 0.8) -> float:
    """The minimum detectable difference implied by a (roughly normal) CI [low, high] of a difference:
    its standard error is (high - low) / (2 z), and MDD = (z + z_power) * SE. For intervals that come
    from a bootstrap of a statistic other than a mean of per-unit differences."""
    z = z_value(level)
    return (z + NormalDist().inv_cdf(power)) * (high - low) / (2 * z)


def pareto_frontier(x: Sequence[float], y: Sequence[float]) -> list[int]:
    """Indices of the points not dominated when both x and y are to be maximized, sorted by x.

    A point is dominated if another is >= in both and > in one. Flip a sign for minimized metrics.
    """
    pts = np.asarray(list(zip(x, y)), dtype=float)
    keep = []
    for i, (xi, yi) in enumerate(pts):
        dominated = np.any((pts[:, 0] >= xi) & (pts[:, 1] >= yi) & ((pts[:, 0] > xi) | (pts[:, 1] > yi)))
        if not dominated:
            keep.append(i)
    return sorted(keep, key=lambda i: (pts[i, 0], -pts[i, 1]))


def interpolate_at(x: Sequence[float], y: Sequence[float], x_target: float) -> float:
    """y at x_target on the piecewise-linear curve through (x, y) sorted by x; NaN outside its range
    (no extrapolation: a sampler that never reaches a diversity level has no value there)."""
    order = np.argsort(x)
    xs, ys = np.asarray(x, dtype=float)[order], np.asarray(y, dtype=float)[order]
    if len(xs) == 0 or not math.isfinite(x_target) or x_target < xs[0] or x_target > xs[-1]:
        return float("nan")
    return float(np.interp(x_target, xs, ys))
