"""Per-row draft lengths under one batch verify budget: each row's k from its own running acceptance, the
step's width from the step-time model's marginal goodput (TETRIS, ACL 2025; SmartSpec's goodput).

Row b's drafts are accepted one after another with probability a_b each (a geometric model), so its j-th
draft yields a_b^j expected tokens. A step verifying per-row k_b costs T(B, w, S) with w = max_b k_b + 1
(the engine pads every row to the widest: a row with k_b < w - 1 verifies padding that is rejected) plus
w - 1 drafted tokens. For each candidate width the step spends its verify budget (total verified tokens,
sum_b (k_b + 1) <= budget) on the (row, j) drafts with the largest a_b^j: that greedy choice is optimal
because every row's gains fall with j. The width with the best goodput

    goodput(w) = (n_active + sum of the chosen a_b^j) / (r_{w-1} T(B, w, S) + (w - 1) t_draft)

wins if it beats plain decoding's n_active / (r_0 T(B, 1, S)) by more than `margin`; else every k_b = 0 and
the step is a plain decode step. r_k corrects the model online from observed verify times (AdaptivePolicy).
Once the width is chosen, live rows are filled up to it (`fill_to_width`): the padding they would verify
costs the same as drafts, so narrowing a row below the width pays only under a binding verify budget.

Free evidence. A policy that only learns a_b from verified drafts and starts pessimistic never drafts again
after one bad step (every later step is plain, so nothing is verified). A cheap drafter (n-gram lookup) is
therefore asked at every step where drafting could pay at all (`worth_asking`: some width beats plain
decoding even if every draft were accepted); a row whose first real draft was not verified this step is
scored against the token the step emitted instead: for a deterministic draft d_1 the target's token equals
d_1 with probability p(d_1), which is exactly d_1's acceptance probability min(1, p(d_1) / 1), so the match
is an unbiased sample of the row's first-position acceptance, at no forward cost (`update_rows(free=...)`).

Proposal kinds. A drafter may say of each row's proposal what kind it is (`DraftProposal.kinds`; the n-gram
drafter: the order of the n-gram it matched, 0 for none). Acceptance then is estimated per (row, kind), each
shrunk towards its kind's pooled estimate: on code editing a 3-gram match's first draft is accepted ~90% of
the time and a 1-gram match's ~15-40%, so a batch whose first drafts were weak 1-gram guesses need not make
the policy pessimistic about the 3-gram copies that follow. A drafter without kinds is one kind (0).
"""
from __future__ import annotations

import numpy as np
import torch

from decodelab.speculation.policy import K_CHOICES, AdaptivePolicy

PRIOR_ACCEPTANCE = 0.5  # a drafter's per-token acceptance before any evidence
KINDS = 8  # proposal kinds a policy tells apart (DraftProposal.kinds in 0 .. KINDS - 1)
CONTEXT_BLOCK = 64  # contexts the step-time model is tabulated for per call (`model_seconds`)
PLAIN_HOLD_STEPS = 8  # steps a plain decision made by the bound is kept (`RowBudgetPolicy`, hold_steps)


class RowBudgetPolicy(AdaptivePolicy):
    """Choose k_b per row (0 allowed) and the step's width by marginal goodput under `verify_budget`.

    verify_budget: most verified tokens per step (sum over active rows of k_b + 1), None = no limit; it
    must be >= the batch (every row verifies its pending token). min_gain: a draft whose expected yield
    a_b^j is below it is not verified (it would only spend budget). The pooled acceptance (all rows) is
    the prior of every row's estimate; a row's own evidence decays by `decay` per step, so a row that
    stopped drafting returns to the pooled estimate instead of being frozen at its last bad stretch.

    hold_steps: a step found plain by the bound (no width pays even at the best acceptance any row could
    reach: `worth_asking`, `_could_pay`) keeps that decision for this many steps while no row finishes,
    without deciding again (1 = decide every step). A decision runs after a forward, when the CPU's caches
    are cold, and cost ~0.35 ms here (~1% of a batch-1 step) though a plain streak changes its inputs only
    slowly (the context by one position, the plain step time's running correction, decay of old evidence);
    the held steps' times are learned, in order, at the next decision. Speculation resumes at most
    hold_steps - 1 steps late.
    """

    def __init__(self, step_time, *, ks=K_CHOICES, verify_budget: int | None = None, min_gain: float = 0.05,
                 draft_s_per_token: float = 0.0, decay: float = 0.9, prior_strength: float = 2.0,
                 margin: float = 0.05, time_ema: float = 0.25, free_evidence: bool = True,
                 hold_steps: int = PLAIN_HOLD_STEPS):
        self.free_evidence = free_evidence  # learn from unverified first drafts (see the module docstring)
        if isinstance(hold_steps, bool) or not isinstance(hold_steps, int) or hold_steps < 1:
            raise ValueError(f"hold_steps={hold_steps!r} must be an int >= 1 (1: decide every step)")
        self.hold_steps = hold_steps
        if verify_budget is not None and (isinstance(verify_budget, bool) or not isinstance(verify_budget, int)
                                          or verify_budget < 1):
            raise ValueError(f"verify_budget={verify_budget!r} must be None (no limit) or an int >= the batch size")
        if not 0 <= min_gain < 1:
            raise ValueError(f"min_gain={min_gain!r} must be in [0, 1)")
        self.verify_budget, self.min_gain = verify_budget, min_gain
        super().__init__(step_time, ks=ks, draft_s_per_token=draft_s_per_token, decay=decay,
                         prior_strength=prior_strength, probe_budget=0.0, margin=margin, time_ema=time_ema)

    def check_batch(self, batch_size: int) -> None:
        """Raise ValueError before any work when the budget cannot cover every row's pending token."""
        if self.verify_budget is not None and self.verify_budget < batch_size:
            raise ValueError(f"verify_budget={self.verify_budget} is below the batch size {batch_size}: every row "
                             f"verifies at least its pending token; allowed: None or an int >= {batch_size}")

    def begin(self, batch_size: int) -> None:
        self.check_batch(batch_size)
        super().begin(batch_size)
        # numpy, not torch: these are a few dozen floats, and a decision must cost microseconds per step
        self.row_reached = np.zeros((batch_size, KINDS))  # decayed drafts judged per (row, proposal kind)
        self.row_accepted = np.zeros((batch_size, KINDS))
        self.pool_reached, self.pool_accepted = np.zeros(KINDS), np.zeros(KINDS)  # the same over every row
        self._rows = np.arange(batch_size)
        self._kinds = np.zeros(batch_size, dtype=np.int64)  # each row's proposal kind in the step being decided
        self._j = np.arange(1, max(max(self.ks), 1) + 1, dtype=float)
        self._widths = np.arange(1, max(max(self.ks), 1) + 2)
        self._seconds_at: tuple[tuple[float, int], np.ndarray] | None = None  # (first context, batch), T table
        self._ratio_vector: np.ndarray | None = None
        self._borrowed: np.ndarray | None = None  # (k_max + 1,) the observed k whose ratio each k uses
        self._plain_now = False  # worth_asking found no width that can pay: this step is plain (see choose_rows)
        self._undecayed = 0  # plain steps whose decay of the row counts is not applied yet (see _settle)
        self._active_seen: tuple = (None, None, 0)  # (active tensor, its numpy copy, count): `_active_numpy`
        self._hold, self._hold_rows = 0, -1  # steps the last plain decision still holds, for this many rows
        self._held_times: list[tuple[float, float]] = []  # (seconds, context) of held plain steps, not learned yet

    def model_seconds(self, context: float) -> np.ndarray:
        """T(B, n, context) for n = 1 .. k_max + 1.

        The model is tabulated for CONTEXT_BLOCK contexts at once (context, context + 1, ...: a plain step
        moves the mean context by one position) in one vectorized call, and a later context that lands on
        the table is read from it: the policy asks after every forward, when the CPU's caches are cold and
        each step-time call costs tens of microseconds. A model that does not broadcast over contexts is
        asked once per context (per width, if it takes scalars only)."""
        at = self._seconds_at
        if at is not None and at[0][1] == self.batch_size:
            offset = context - at[0][0]
            row = int(round(offset))
            if 0 <= row < len(at[1]) and abs(offset - row) < 1e-9:
                return at[1][row]
        contexts = context + np.arange(CONTEXT_BLOCK, dtype=float)
        try:  # a roofline broadcasts over widths and contexts: one call for the whole table
            table = np.asarray(self.step_time(self.batch_size, self._widths[None, :], contexts[:, None]), dtype=float)
            table = np.broadcast_to(table, (CONTEXT_BLOCK, len(self._widths)))
        except (TypeError, ValueError):
            try:  # a model of one context at a time (it may still take the widths as one array)
                table = np.broadcast_to(np.asarray(self.step_time(self.batch_size, self._widths, context), dtype=float),
                                        self._widths.shape)[None]
            except (TypeError, ValueError):  # a model of scalars only: one call per width
                table = np.array([[float(self.step_time(self.batch_size, int(n), context)) for n in self._widths]])
        self._seconds_at = ((context, self.batch_size), table)
        return table[0]

    def model_seconds_for(self, k: int, context: float) -> float:
        if k < len(self._widths):
            return float(self.model_seconds(context)[k])
        return super().model_seconds_for(k, context)

    def pooled_acceptance(self) -> np.ndarray:
        """(KINDS,) every kind's acceptance over all rows, shrunk towards PRIOR_ACCEPTANCE."""
        s = self.prior_strength
        return np.broadcast_to((self.pool_accepted + s * PRIOR_ACCEPTANCE) / (self.pool_reached + s), (KINDS,))

    def _settle(self) -> None:
        """Apply the decay of the plain steps since the row counts were last read (`update_plain` defers it:
        decay^n at once equals n decays one by one, and a run of plain steps then costs no array work)."""
        if self._undecayed:
            scale = self.decay ** self._undecayed
            self.row_reached *= scale
            self.row_accepted *= scale
            self._undecayed = 0

    def row_acceptance(self) -> np.ndarray:
        """(B,) each row's per-token acceptance for its proposal's kind in this step, shrunk towards that
        kind's pooled estimate."""
        self._settle()
        s, at = self.prior_strength, (self._rows, self._kinds)
        return (self.row_accepted[at] + s * self.pooled_acceptance()[self._kinds]) / (self.row_reached[at] + s)

    def set_kinds(self, kinds) -> None:
        """kinds (B,) long or None (every row kind 0): the proposal kinds of the step being decided; its
        update credits the verified drafts to them."""
        if kinds is None:
            self._kinds[:] = 0
            return
        kinds = np.array(kinds.cpu().numpy() if torch.is_tensor(kinds) else kinds, dtype=np.int64)  # a copy: ours
        if kinds.shape != self._kinds.shape or kinds.min() < 0 or kinds.max() >= KINDS:
            raise ValueError(f"kinds {kinds.tolist()} must be {len(self._kinds)} ints in [0, {KINDS})")
        self._kinds = kinds

    def row_gains(self, active: np.ndarray, caps: np.ndarray | None) -> np.ndarray:
        """(B, k_max) expected tokens of row b's j-th draft, a_b^j; 0 past caps[b] (real drafts), for
        finished rows and below min_gain."""
        a = np.clip(self.row_acceptance(), 0.0, 0.999)
        gains = a[:, None] ** self._j[None]
        usable = active[:, None] & (gains >= self.min_gain)
        if caps is not None:
            usable &= self._j[None] <= caps[:, None]
        return np.where(usable, gains, 0.0)

    def _ratios(self) -> np.ndarray:
        """(k_max + 1,) r_k for k = 0 .. k_max, rebuilt only when a new k was observed (not per step)."""
        if self._ratio_vector is None:
            self._ratio_vector = np.array([self.ratio(int(k)) for k in range(len(self._widths))])
            observed = sorted(self.time_ratio)
            self._borrowed = np.array([min(observed, key=lambda j: (abs(j - k), j)) if observed else -1
                                       for k in range(len(self._widths))])
        return self._ratio_vector

    def learn_time(self, k: int, verify_s: float, context: float) -> None:
        seen = k in self.time_ratio
        super().learn_time(k, verify_s, context)
        if seen and self._ratio_vector is not None:  # the same ks borrow from k as before: update them in place
            self._ratio_vector[self._borrowed == k] = self.time_ratio[k]
        else:
            self._ratio_vector = None

    def _best_rate(self, n_active: int, a: float, context: float) -> float:
        """Upper bound of a step's goodput: every active row drafting at acceptance a, within the budget."""
        k = self._j  # every width a step can take, not only the ks offered
        run = n_active * (1 + k) if a >= 1 else n_active * (1 + a * (1 - a ** k) / (1 - a))
        tokens = np.minimum(run, self.verify_budget if self.verify_budget is not None else np.inf)
        seconds = self._ratios()[1:] * self.model_seconds(context)[1:] + k * self.draft_seconds(context)
        return float((tokens / seconds).max())

    def _holding(self, n_active: int) -> bool:
        """Whether this step keeps the last plain decision (see hold_steps); a finished row ends the hold."""
        if self._hold > 0 and n_active == self._hold_rows:
            self._hold -= 1
            return True
        self._hold = 0
        return False

    def _decide_afresh(self) -> None:
        """Before a decision: learn the held steps' times, in the order they ran."""
        held, self._held_times, self._hold = self._held_times, [], 0
        for seconds, context in held:
            self.learn_time(0, seconds, context)

    def worth_asking(self, n_active: int, *, context: float) -> bool:
        """Could any width beat plain decoding if every draft were accepted? If not, no draft can change
        this step's decision and a drafter need not be asked (nor its drafts scored as evidence)."""
        if n_active == 0:
            return False
        if self._holding(n_active):
            self._plain_now = True
            return False
        self._decide_afresh()
        plain_rate = n_active / (self._ratios()[0] * self.model_seconds(context)[0])
        worth = self._best_rate(n_active, 1.0, context) > (1 + self.margin) * plain_rate
        # no draft can pay even if all were accepted, so no row acceptance (<= 1) can: choose_rows will pick
        # k = 0 for every row; it may skip its own bound until the step's update
        self._plain_now = not worth
        if not worth:
            self._hold, self._hold_rows = self.hold_steps - 1, n_active
        return worth

    def _could_pay(self, act: np.ndarray, n_active: int, plain_rate: float, context: float) -> bool:
        """An upper bound first (every active row drafting at the best row's acceptance, within the budget):
        when no width beats plain decoding even so, the step is plain without any per-row work."""
        if n_active == 0:
            return False
        a = float(np.clip(self.row_acceptance()[act].max(), 0.0, 0.999))
        return self._best_rate(n_active, a, context) > (1 + self.margin) * plain_rate

    def choose_rows(self, active: torch.Tensor, *, context: float, caps: torch.Tensor | None = None,
                    kinds: torch.Tensor | None = None) -> torch.Tensor:
        """active (B,) bool, caps (B,) long or None (real drafts available per row), kinds (B,) long or None
        (each row's proposal kind, `set_kinds`) -> k_b (B,) long (CPU)."""
        unmarked = caps is None and kinds is None  # the bound read no per-step proposal: a decision that can hold
        if self._plain_now or (self._hold and unmarked and self._holding(self._active_numpy(active)[1])):
            # plain by worth_asking this step (no width pays at any acceptance), or a held plain decision
            self._plain_now = False
            self.history.append(0)
            return torch.zeros(len(active), dtype=torch.long)
        self.set_kinds(kinds)
        self._decide_afresh()
        act, n_active = self._active_numpy(active)
        best_rate = n_active / self.verify_seconds(0, context)
        plain_rate, best = best_rate, np.zeros(len(act), dtype=np.int64)
        if not self._could_pay(act, n_active, plain_rate, context):  # the common case at a compute-bound batch
            if unmarked:
                self._hold, self._hold_rows = self.hold_steps - 1, n_active
            self.history.append(0)
            return torch.from_numpy(best)
        gains = self.row_gains(act, None if caps is None else caps.cpu().numpy())
        spare = (self.verify_budget - n_active) if self.verify_budget is not None else gains.size
        draft_s = self.draft_seconds(context)
        for k in self.ks:
            if k == 0:
                continue
            g = gains[:, :k].ravel()
            usable = g > 0
            n_usable = int(usable.sum())
            if n_usable == 0 or spare <= 0:
                continue
            if n_usable > spare:  # the budget binds: keep the `spare` drafts of highest yield
                chosen = np.zeros_like(usable)
                chosen[np.argpartition(-g, spare - 1)[:spare]] = True
            else:
                chosen = usable
            row_k = chosen.reshape(-1, k).sum(1)
            width = int(row_k.max())
            rate = (n_active + float(g[chosen].sum())) / (self.verify_seconds(width, context)
                                                          + width * draft_s)
            if rate > best_rate:
                best_rate, best = rate, row_k
        # speculate only when it clearly pays: a goodput within the margin is noise in the model
        if best_rate <= (1 + self.margin) * plain_rate:
            best = np.zeros_like(best)
        else:
            best = self.fill_to_width(best, act, None if caps is None else caps.cpu().numpy())
        self.history.append(int(best.max()))
        return torch.from_numpy(best)

    def _active_numpy(self, active: torch.Tensor) -> tuple[np.ndarray, int]:
        """active (B,) bool tensor -> (its numpy array, its count); the loop passes one all-true tensor while
        every row is alive, whose conversion is kept (one per step is a visible share of a decision)."""
        if active is not self._active_seen[0]:
            host = active.cpu().numpy()
            self._active_seen = (active, host, int(host.sum()))
        return self._active_seen[1:]

    def fill_to_width(self, row_k: np.ndarray, act: np.ndarray, caps: np.ndarray | None) -> np.ndarray:
        """(B,) row_k with every live row (active, acceptance >= min_gain) raised to the step's width - 1
        drafts (its real drafts at most), when the verify budget allows it (else row_k as chosen).

        The engine pads every row to the widest, so a step of width w costs T(B, w) and w - 1 drafted
        tokens whatever each row verifies: a live row verifying fewer than w - 1 drafts forfeits their
        expected yield a_b^j > 0 for no saving. Only a binding verify budget makes narrowing rows pay."""
        depth = int(row_k.max())
        if depth == 0:
            return row_k
        a = self.row_acceptance()
        room = np.full(len(row_k), depth) if caps is None else np.minimum(caps, depth)
        filled = np.where(act & (a >= self.min_gain), np.maximum(row_k, room), row_k)
        if self.verify_budget is not None and int(filled.sum()) > self.verify_budget - int(act.sum()):
            return row_k
        return filled.astype(row_k.dtype)

    def update_plain(self, *, step_s: float, context: float | None = None) -> None:
        """`update_rows` after a plain step that scored no free evidence (every k_b = 0, nothing drafted):
        the same state change without building per-row arrays, so a run of plain steps stays cheap."""
        self._plain_now = False
        if context is not None:
            if self._hold or self._held_times:  # a held streak: learned at the next decision, in order
                self._held_times.append((step_s, context))
            else:
                self.learn_time(0, step_s, context)
        self._undecayed += 1

    def update_rows(self, row_k: torch.Tensor, n_accepted: torch.Tensor, active: torch.Tensor, *, step_s: float,
                    draft_s: float, context: float | None = None, free=None) -> None:
        """After a step that verified row_k (B,) drafts per row (n_accepted (B,) kept) in step_s seconds.

        free: None or (scored (B,) bool, hit (B,) bool): rows whose first real draft was not verified this
        step and whether it equals the token the step emitted (free first-position evidence, see above)."""
        self._plain_now = False
        self._decide_afresh()
        self._settle()
        ks = row_k.cpu().numpy()
        width = int(ks.max())
        if context is not None:
            self.learn_time(width, step_s - draft_s, context)
        self.row_reached *= self.decay
        self.row_accepted *= self.decay
        reached = np.zeros(len(ks))
        accepted = np.zeros(len(ks))
        if width > 0:
            drafted = active.cpu().numpy() & (ks > 0)
            n = n_accepted.cpu().numpy().astype(float)
            # a row with k_b drafts reached min(n_b + 1, k_b) of them and accepted n_b
            reached += np.where(drafted, np.minimum(n + 1, ks), 0.0)
            accepted += np.where(drafted, n, 0.0)
        if free is not None and self.free_evidence:
            scored, hit = (np.asarray(x.cpu().numpy() if torch.is_tensor(x) else x, dtype=bool) for x in free)
            reached += scored
            accepted += scored & hit
        if width == 0 and not reached.any():
            return
        at = (self._rows, self._kinds)
        self.row_reached[at] += reached
        self.row_accepted[at] += accepted
        self.pool_reached = self.pool_reached * self.decay + np.bincount(self._kinds, reached, minlength=KINDS)
        self.pool_accepted = self.pool_accepted * self.decay + np.bincount(self._kinds, accepted, minlength=KINDS)
        if width == 0:
            return
        self._draft_seen += 1
        per_token = draft_s / width
        self.draft_s_per_token += (per_token - self.draft_s_per_token) / min(self._draft_seen, 10)
