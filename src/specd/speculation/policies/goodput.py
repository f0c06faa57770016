"""The `goodput` k policy: verify a draft token only when what it is expected to add pays for what it costs.

After the proposer has drafted, each sequence i holds a draft of L_i tokens in bucket b_i (ngram: the length of
the matched suffix, the proposer's own confidence signal). Draft token j of sequence i is worth

    v_ij = prod_{l <= j} P_i(accept position l | position l reached, bucket b_i)

expected emitted tokens (it is emitted only if every earlier draft token was accepted too). Verifying one more
token makes the target forward longer by b seconds (the slope of its cost in new tokens around this step's
size), time in which the engine would otherwise emit rate * b tokens at its current throughput `rate`. So the
plan keeps exactly the draft tokens with

    v_ij > price = rate * b.

v_ij falls with j within a sequence, so the kept tokens are a prefix of every draft: drafts are only ever
shortened, never changed. A sequence whose drafts were cut to nothing for PROBE_INTERVAL steps in a row verifies
one token anyway, so a bucket judged not worth it keeps being measured and can recover. Everything is
estimated online from what the engine measures anyway:

- acceptance per (bucket, position), engine-wide, as counts halved when they grow large (so the estimate
  follows the workload), plus the same counts per sequence, shrunk towards the engine-wide value with weight
  `_SEQ_PRIOR_WEIGHT` (a sequence that copies well earns long drafts, one that does not is cut short);
- the slope b: the mean wall time of a decode/verification step's target forward plus its verification
  (rejection sampling) is kept per number of new tokens N (an EMA per N), and b is the slope of a
  least-squares line through the means with N in [N0, N0 + drafted], N0 being the step's tokens without
  drafts (all measured N when that window holds fewer than two). A local line, because the cost is not
  linear in N (flat while weights dominate, then steep, then flatter: see docs/benchmarks.md), and a fitted
  one, because single forwards on a shared CPU vary by +-30%. With one N
  measured the slope is 0, so the first steps draft fully and thereby measure what drafting costs;
- rate, emitted tokens per second of step time, as the ratio of two EMAs (tokens and seconds per step; an
  EMA of per-step ratios would be dominated by the steps that happened to accept a lot).

This is why the policy suits a cheap, deterministic proposer (ngram) whose draft costs nothing to cut; with a
model-based proposer the draft tokens it would cut were already paid for (use `confidence` there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specd.speculation.k_policy import DraftSpan, EngineLoad, KPolicy, StepReport, StepView

if TYPE_CHECKING:
    from specd.config import SpeculationConfig
    from specd.speculation.proposer import ProposerTraits

_FORWARD_EMA = 0.2  # weight of a new forward time in its N's mean, once the mean has _FORWARD_WARM samples
_FORWARD_WARM = 5
_FORWARD_MAX_WEIGHT = 20  # an N's weight in the slope fit: its sample count, capped
_EMA_RATE = 0.1  # weight of a new step's throughput
_PRIOR_ACCEPT = (1.0, 2.0)  # (accepted, reached) pseudo-counts of an unseen (bucket, position): optimistic 0.5
_SEQ_PRIOR_WEIGHT = 4.0  # a sequence's own counts are shrunk towards the engine-wide estimate with this weight
_HALVE_AT = 512.0  # engine-wide counts are halved past this many reaches, so old evidence fades
_MAX_BUCKET = 64
# A sequence whose drafts were cut to nothing this many steps in a row verifies one draft token anyway: estimates
# only change through verified tokens, so without probing a cut bucket would stay cut forever.
PROBE_INTERVAL = 8


@dataclass(slots=True)
class _Counts:
    """accepted[j] / reached[j] per draft position j (0-based) for one bucket."""

    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def ensure(self, positions: int) -> None:
        while len(self.reached) < positions:
            self.accepted.append(0.0)
            self.reached.append(0.0)

    def prob(self, position: int) -> float:
        """P(accept | reached) at `position`, with the (1, 2) prior; 0.5 where nothing was seen yet."""
        seen = position < len(self.reached)
        accepted = self.accepted[position] if seen else 0.0
        reached = self.reached[position] if seen else 0.0
        return (accepted + _PRIOR_ACCEPT[0]) / (reached + _PRIOR_ACCEPT[1])

    def add(self, num_drafted: int, num_accepted: int, halve_at: float | None) -> None:
        """Positions 0..min(k, a + 1) - 1 were reached (scored by the target); 0..a - 1 were accepted."""
        reached = min(num_drafted, num_accepted + 1)
        self.ensure(reached)
        for j in range(reached):
            self.reached[j] += 1.0
            if j < num_accepted:
                self.accepted[j] += 1.0
            if halve_at is not None and self.reached[j] > halve_at:
                self.reached[j] /= 2
                self.accepted[j] /= 2


@dataclass(frozen=True, slots=True)
class GoodputPlan:
    """Kept draft lengths (one per planned sequence) and the estimates the decision used."""

    keep: list[int]
    values: list[list[float]]  # v_ij for every proposed draft token, kept or not
    price: float  # what verifying one more token costs, in expected tokens (rate * slope); kept: v_ij > price


class GoodputPlanner:
    """Engine-wide estimator and planner for the goodput policy. Owned by one engine thread."""

    def __init__(self) -> None:
        self._global: dict[int, _Counts] = {}
        self._per_seq: dict[int, dict[int, _Counts]] = {}
        self._forward: dict[int, tuple[float, int]] = {}  # new tokens N -> (mean seconds, samples)
        self.last_price: float | None = None
        self._idle_steps: dict[int, int] = {}  # seq_id -> consecutive steps whose draft was cut to nothing
        self._step_tokens: float | None = None  # EMA of emitted tokens per step
        self._step_seconds = 0.0  # EMA of step seconds

    # ---------------------------------------------------------------- estimates
    def accept_prob(self, seq_id: int, bucket: int, position: int) -> float:
        """P(draft position `position` (0-based) is accepted | it is reached), for this sequence and bucket."""
        bucket = min(bucket, _MAX_BUCKET)
        g = self._global.get(bucket)
        p_global = g.prob(position) if g is not None else _PRIOR_ACCEPT[0] / _PRIOR_ACCEPT[1]
        s = self._per_seq.get(seq_id, {}).get(bucket)
        if s is None or position >= len(s.reached):
            return p_global
        return (s.accepted[position] + _SEQ_PRIOR_WEIGHT * p_global) / (s.reached[position] + _SEQ_PRIOR_WEIGHT)

    def marginal_seconds(self, base_tokens: int, max_extra: int) -> float:
        """Seconds one more new token adds to a forward of about base_tokens .. base_tokens + max_extra tokens
        (>= 0; 0 while fewer than two sizes have been measured)."""
        window = [(n, t, c) for n, (t, c) in self._forward.items() if base_tokens <= n <= base_tokens + max_extra]
        if len({n for n, _, _ in window}) < 2:
            window = [(n, t, c) for n, (t, c) in self._forward.items()]
        if len(window) < 2:
            return 0.0
        weights = [float(min(c, _FORWARD_MAX_WEIGHT)) for _, _, c in window]
        total = sum(weights)
        mean_n = sum(w * n for w, (n, _, _) in zip(weights, window)) / total
        mean_t = sum(w * t for w, (_, t, _) in zip(weights, window)) / total
        var_n = sum(w * (n - mean_n) ** 2 for w, (n, _, _) in zip(weights, window))
        cov = sum(w * (n - mean_n) * (t - mean_t) for w, (n, t, _) in zip(weights, window))
        return max(0.0, cov / var_n) if var_n > 0 else 0.0

    # ---------------------------------------------------------------- planning
    def plan(
        self,
        seq_ids: Sequence[int],
        buckets: Sequence[int],
        draft_lengths: Sequence[int],
        base_tokens: int,
    ) -> GoodputPlan:
        """How many of each sequence's drafted tokens to verify (a prefix of each draft). base_tokens: the
        step's new tokens besides these drafts (one per decoding sequence, prefill chunks)."""
        values: list[list[float]] = []
        candidates: list[tuple[float, int, int]] = []  # (-value, position, sequence index)
        for i, (seq_id, bucket, length) in enumerate(zip(seq_ids, buckets, draft_lengths, strict=True)):
            survive = 1.0
            row: list[float] = []
            for j in range(length):
                survive *= self.accept_prob(seq_id, bucket, j)
                row.append(survive)
                candidates.append((-survive, j, i))
            values.append(row)
        candidates.sort()  # most valuable first; within a sequence position order breaks ties (prefixes)
        price = (self.rate or 0.0) * self.marginal_seconds(base_tokens, sum(draft_lengths))
        self.last_price = price
        keep = [0] * len(seq_ids)
        for neg_value, _, i in candidates:
            if -neg_value <= price:
                break
            keep[i] += 1
        for i, seq_id in enumerate(seq_ids):
            if keep[i] or not draft_lengths[i]:
                self._idle_steps[seq_id] = 0
                continue
            idle = self._idle_steps.get(seq_id, 0) + 1
            if idle >= PROBE_INTERVAL:  # probe: one token keeps the estimate of a cut bucket measured
                keep[i], idle = 1, 0
            self._idle_steps[seq_id] = idle
        return GoodputPlan(keep=keep, values=values, price=price)

    # ---------------------------------------------------------------- observations
    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        """A decode/verification step over num_tokens new tokens spent `seconds` in the target forward and
        verification (prefill steps are left out: attention over long prompts is not what a draft token costs)."""
        mean, count = self._forward.get(num_tokens, (0.0, 0))
        count += 1
        weight = 1.0 / count if count <= _FORWARD_WARM else _FORWARD_EMA  # a plain mean first, then an EMA
        self._forward[num_tokens] = (mean + weight * (seconds - mean), count)

    @property
    def rate(self) -> float | None:
        """Emitted tokens per second of step time; None before the first step."""
        if self._step_tokens is None or self._step_seconds <= 0.0:
            return None
        return self._step_tokens / self._step_seconds

    def observe_step(self, num_emitted: int, seconds: float) -> None:
        if seconds <= 0.0:
            return
        if self._step_tokens is None:
            self._step_tokens, self._step_seconds = float(num_emitted), seconds
        else:
            self._step_tokens += _EMA_RATE * (num_emitted - self._step_tokens)
            self._step_seconds += _EMA_RATE * (seconds - self._step_seconds)

    def observe_draft(self, seq_id: int, bucket: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        bucket = min(bucket, _MAX_BUCKET)
        self._global.setdefault(bucket, _Counts()).add(num_drafted, num_accepted, _HALVE_AT)
        self._per_seq.setdefault(seq_id, {}).setdefault(bucket, _Counts()).add(num_drafted, num_accepted, None)

    def release(self, seq_id: int) -> None:
        self._per_seq.pop(seq_id, None)
        self._idle_steps.pop(seq_id, None)

    def snapshot(self) -> dict[str, object]:
        """The current estimates, JSON-ready: what the policy believes and therefore why it drafts what it does."""
        acceptance = {str(b): [round(c.prob(j), 4) for j in range(len(c.reached))]
                      for b, c in sorted(self._global.items())}
        return {
            "rate_tokens_per_s": None if self.rate is None else round(self.rate, 3),
            "last_price_tokens": None if self.last_price is None else round(self.last_price, 4),
            "forward_ms_by_new_tokens": {str(n): round(t * 1e3, 3) for n, (t, _) in sorted(self._forward.items())},
            "accept_prob_by_bucket_and_position": acceptance,
        }


class GoodputK(KPolicy):
    """The goodput policy: ask for k_max, draft, then verify only what pays (see the module docstring).

    Its estimates are engine-wide: it learns acceptance from every sequence's drafts and cost from every
    decode-only step, whichever policy those sequences use, so a request switching to goodput starts informed.
    """

    def __init__(self) -> None:
        self.planner = GoodputPlanner()
        self._k_max: dict[int, int] = {}

    @classmethod
    def from_config(cls, spec: SpeculationConfig, traits: ProposerTraits) -> GoodputK:
        return cls()

    @classmethod
    def unsupported(cls, traits: ProposerTraits) -> str | None:
        if traits.free_drafts:
            return None
        return "it cuts drafts after they are made, which pays only when drafting costs nothing (prompt lookup)"

    def add(self, seq_id: int, k_max: int) -> None:
        self._k_max[seq_id] = k_max

    def plan(self, seq_ids: Sequence[int], load: EngineLoad) -> list[int]:
        return [self._k_max[seq_id] for seq_id in seq_ids]

    def keep(self, drafts: Sequence[DraftSpan], step: StepView) -> list[int]:
        lengths = [draft.num_tokens for draft in drafts]
        plan = self.planner.plan(
            [draft.seq_id for draft in drafts], [draft.bucket for draft in drafts], lengths,
            base_tokens=step.num_new_tokens - sum(lengths),
        )
        return plan.keep

    def observe(self, report: StepReport) -> None:
        # Only warm decode/verification steps feed the cost and throughput estimates: prefill time is not what
        # drafting competes with, and the step after a prefill runs cold (StepReport.teaches_cost).
        if report.teaches_cost:
            self.planner.observe_forward(report.num_new_tokens, report.verify_s)
        for outcome in report.outcomes:
            self.planner.observe_draft(outcome.seq_id, outcome.bucket, outcome.num_drafted, outcome.num_accepted)
        if report.teaches_cost:
            self.planner.observe_step(report.num_emitted, report.step_s)

    def release(self, seq_id: int) -> None:
        self._k_max.pop(seq_id, None)
        self.planner.release(seq_id)

    def snapshot(self) -> dict[str, object] | None:
        return self.planner.snapshot()
