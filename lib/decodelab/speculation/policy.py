"""Adaptive draft length: the policy that picks k per step from running acceptance and step costs."""
from __future__ import annotations

K_CHOICES = (0, 1, 2, 4, 8)  # draft lengths the adaptive policy chooses from (0 = a plain decode step)


class AdaptivePolicy:
    """Choose the draft length k per step to maximize goodput (SmartSpec, Liu et al. 2024):

        goodput(k) = E[tokens | k] / (k * t_draft + r_k T(B, k+1, S)),   goodput(0) = 1 / (r_0 T(B, 1, S))
        E[tokens | k] = 1 + sum_{j<=k} prod_{i<=j} a_i

    a_i: running estimate of P(draft i accepted | drafts before it accepted), counts decayed by
    `decay` per step so it follows the text (copying stretches vs free writing); a position never
    reached borrows its predecessor's estimate. T: the step-time model (a fitted roofline),
    t_draft: the measured draft seconds per drafted token (running mean). r_k: an online correction of
    the model, an exponential moving average (weight `time_ema`) of observed / predicted verify time of
    the steps that verified k drafts (a k never observed borrows the nearest observed k's ratio, else 1):
    a roofline fitted on a quiet machine, or off at this context, is pulled towards what the steps take.
    k > 0 is chosen only when its goodput beats plain decoding's by more than `margin`, so where
    speculation cannot clearly pay the policy runs plain steps. After a run of plain steps the policy
    probes with k=1 once the time lost by not speculating could have paid for the probe
    `1 / probe_budget` times over, so probing costs at most ~probe_budget of the run.
    """

    def __init__(self, step_time, *, ks=K_CHOICES, draft_s_per_token: float = 0.0, decay: float = 0.9,
                 prior_strength: float = 2.0, probe_budget: float = 0.02, margin: float = 0.05,
                 time_ema: float = 0.25):
        ks = tuple(sorted(set(ks)))
        if not ks or ks[0] < 0 or any(not isinstance(x, int) for x in ks):
            raise ValueError(f"ks={ks!r} must be non-negative ints")
        if margin < 0:
            raise ValueError(f"margin={margin!r} must be >= 0")
        if not 0 < time_ema <= 1:
            raise ValueError(f"time_ema={time_ema!r} must be in (0, 1]")
        self.step_time, self.ks = step_time, ks
        self.draft0, self.decay = draft_s_per_token, decay
        self.prior_strength, self.probe_budget = prior_strength, probe_budget
        self.margin, self.time_ema = margin, time_ema
        self.begin(1)

    def begin(self, batch_size: int) -> None:
        self.batch_size = batch_size
        depth = max(max(self.ks), 1)
        self.reached, self.accepted = [0.0] * depth, [0.0] * depth
        self.draft_s_per_token = self.draft0
        self._draft_seen = 0
        self._draft_fraction = 0.0  # set_draft_cost: a drafted token's cost in plain steps, until one is timed
        self._plain_run = 0.0
        self.time_ratio: dict[int, float] = {}  # k -> EMA of observed / predicted verify seconds
        self.history: list[int] = []

    def acceptance(self) -> list[float]:
        est, prev = [], 0.5
        for acc, reach in zip(self.accepted, self.reached):
            prev = (acc + self.prior_strength * prev) / (reach + self.prior_strength)
            est.append(prev)
        return est

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.acceptance()[:k]:
            run *= a
            total += run
        return total

    def ratio(self, k: int) -> float:
        """Observed / predicted verify time for k drafts (nearest observed k when k was never run)."""
        if k in self.time_ratio:
            return self.time_ratio[k]
        if not self.time_ratio:
            return 1.0
        return self.time_ratio[min(self.time_ratio, key=lambda j: (abs(j - k), j))]

    def model_seconds_for(self, k: int, context: float) -> float:
        """The step-time model's seconds for verifying k drafts per row (a step of width k + 1)."""
        return float(self.step_time(self.batch_size, k + 1, context))

    def verify_seconds(self, k: int, context: float) -> float:
        return self.ratio(k) * self.model_seconds_for(k, context)

    def set_draft_cost(self, fraction: float) -> None:
        """Before any draft is timed, a drafted token costs `fraction` of a plain decode step (a model drafter's
        `relative_cost`: the weights it reads per token over the target's). Without it the first decision
        takes drafts as free and a drafter that cannot pay is tried at least once; the first timed draft
        replaces it."""
        if not 0 <= fraction:
            raise ValueError(f"fraction={fraction!r} must be >= 0")
        self._draft_fraction = float(fraction)

    def draft_seconds(self, context: float) -> float:
        """Seconds per drafted token: the running mean of timed drafts, or before any the `set_draft_cost` prior."""
        if self._draft_seen == 0 and self._draft_fraction:
            return self._draft_fraction * self.verify_seconds(0, context)
        return self.draft_s_per_token

    def goodput(self, k: int, context: float) -> float:
        seconds = self.verify_seconds(k, context) + k * self.draft_seconds(context)
        return self.expected_tokens(k) / seconds

    def choose_k(self, n_active: int, *, context: float) -> int:
        plain = self.goodput(0, context)
        best = max((x for x in self.ks if x > 0), key=lambda x: self.goodput(x, context), default=0)
        # speculate only when it clearly pays: a goodput within the margin is noise in the model
        k = best if best and self.goodput(best, context) > (1 + self.margin) * plain else 0
        if k == 0 and 1 in self.ks:
            t1 = self.verify_seconds(0, context)
            probe_cost = self.verify_seconds(1, context) + self.draft_seconds(context) - t1
            self._plain_run += t1
            if self._plain_run * self.probe_budget >= max(probe_cost, 0.0):
                self._plain_run, k = 0.0, 1
        else:
            self._plain_run = 0.0
        self.history.append(k)
        return k

    def learn_time(self, k: int, verify_s: float, context: float) -> None:
        """Move r_k (observed / predicted verify seconds of a step of width k + 1) towards this step's."""
        predicted = self.model_seconds_for(k, context)
        if predicted <= 0 or verify_s <= 0:
            return
        prev = self.time_ratio.get(k)
        observed = verify_s / predicted
        if prev is None:
            self.time_ratio[k] = observed
        else:
            # one slow step (a burst of background load) moves the estimate by at most 2x
            observed = min(max(observed, prev / 2), prev * 2)
            self.time_ratio[k] = prev + self.time_ema * (observed - prev)

    def update(self, k: int, n_accepted, active, step_s: float, draft_s: float, lengths=None,
               context: float | None = None) -> None:
        """After a step that verified k drafts (0: a plain step) and took step_s seconds, draft_s of them
        drafting. With `context` (the mean cached length the step was predicted at) the step-time
        correction r_k learns from it too."""
        if context is not None:
            self.learn_time(k, step_s - draft_s, context)
        if k == 0:
            return
        n = n_accepted[active].tolist()
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
        for nb in n:  # padding drafts (no n-gram match) count as rejections: they yield nothing
            for i in range(min(nb + 1, k)):
                self.reached[i] += 1
                self.accepted[i] += int(i < nb)
        self._draft_seen += 1
        per_token = draft_s / k
        self.draft_s_per_token += (per_token - self.draft_s_per_token) / min(self._draft_seen, 10)
