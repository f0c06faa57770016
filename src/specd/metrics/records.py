"""Typed, frozen results of the speculation metrics layer: counters, per-request stats and snapshots.

Vocabulary (docs/metrics.md has the full definitions and a worked example). Per verification step each
sequence i gets k_i draft tokens, the verifier accepts a prefix of a_i of them (before stop truncation)
and e_i tokens are emitted (after stop truncation, bonus/correction token included). A *draft* is a
(sequence, step) pair with k_i >= 1; a sequence-step with k_i == 0 is *non-speculative*.

Per-position arrays are 0-indexed in Python and JSON: index j - 1 holds position j (1..k_max).
Every derived value is None when its denominator is 0. Per-request stats and snapshots: snapshots.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

# Scalar derived metrics that exist both pooled (over all drafts) and as a mean of per-request values.
SCALAR_METRICS = (
    "acceptance_rate",
    "accepted_tokens_per_draft",
    "mean_acceptance_length",
    "emitted_per_draft",
    "mean_proposed_length",
    "tokens_per_seq_step",
)

# Deprecated output keys kept for one release (docs/metrics.md "Renamed"): old name -> the metric it repeats.
DEPRECATED_ALIASES = {"mean_accepted_length": "accepted_tokens_per_draft"}


# Why a sequence-step verified no draft token (k_i = 0), decided by the engine in pipeline order (the first that
# applies): docs/metrics.md "Why k = 0". "other" is for callers that do not say (and traces written before causes).
K0Cause = Literal["first_token", "disabled", "policy", "max_tokens", "budget", "no_match", "grammar", "other"]
K0_CAUSES: tuple[K0Cause, ...] = get_args(K0Cause)


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when the denominator is 0 (never NaN, never a fake 0)."""
    return numerator / denominator if denominator else None


@dataclass(frozen=True, slots=True)
class StepPhaseTimes:
    """Seconds this step spent proposing, in the target forward and in rejection sampling.

    One target forward serves both the prompt chunks being prefilled and the rows being verified; its time is
    split between `prefill_s` and `verify_s` in proportion to their tokens (the engine cannot time the two
    apart inside one forward). A step without prefill has prefill_s = 0; a prefill-only step has verify_s = 0.
    """

    propose_s: float
    verify_s: float
    sample_s: float
    prefill_s: float = 0.0

    def __post_init__(self) -> None:
        # One chained check on the fast path; NaN fails every comparison and is rejected too.
        if (
            0.0 <= self.propose_s < math.inf and 0.0 <= self.verify_s < math.inf and 0.0 <= self.sample_s < math.inf
            and 0.0 <= self.prefill_s < math.inf
        ):
            return
        for name in ("propose_s", "verify_s", "sample_s", "prefill_s"):
            value = getattr(self, name)
            if not 0.0 <= value < math.inf:
                raise ValueError(f"{name}: must be a finite number of seconds >= 0, got {value!r}")


class StepDetail(NamedTuple):
    """One step of one request, kept only for requests asked for in detail (debugging)."""

    step: int
    k: int
    accepted: int
    emitted: int


class StepRecord(NamedTuple):
    """What every sink receives once per step. Read-only: sinks must not mutate the lists.

    The three count lists are aligned with request_ids ([num_seqs] each); they are empty for a step that
    only prefilled prompt chunks (num_prefill_tokens > 0, no sequence sampled).
    """

    step: int  # 0-based index of this step in the recorder
    time_s: float  # wall-clock (Unix) time the step was recorded
    request_ids: Sequence[str]
    num_draft_tokens: Sequence[int]  # k_i
    num_accepted_tokens: Sequence[int]  # a_i, the verifier's decision (before stop truncation)
    num_emitted_tokens: Sequence[int]  # e_i, after stop truncation, bonus/correction included
    times: StepPhaseTimes
    num_prefill_tokens: int = 0  # prompt tokens this step's forward prefilled, all chunks together
    num_proposed_tokens: Sequence[int] = ()  # p_i >= k_i, the proposer's tokens before any cut (() = k_i)
    num_grammar_cut_tokens: Sequence[int] = ()  # of p_i, cut by a grammar before verification (() = 0s)
    k0_causes: Sequence[K0Cause] = ()  # per sequence, the cause when k_i == 0 (() = "other")
    speedup_decode_s: float = 0.0  # this step's share of SpeedupTotals.decode_s (metrics/speedup.py)
    speedup_plain_decode_s: float = 0.0  # and of plain_decode_s
    num_draft_forwards: int = 0  # draft-model forward passes run to propose this step (0: lookup or no drafting)
    num_computed_draft_tokens: int = 0  # draft positions those forwards computed, stop-rule drops included


def add_tuples(left: tuple[int, ...], right: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(left, right))


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """Additive per-sequence counters over one window (a request, an interval or the whole run).

    The same class serves every window, and `+` merges two windows, so request sums, interval sums and
    the cumulative totals are consistent by construction. It holds no step-level quantities (those do
    not add up across requests); see StepTotals.
    """

    k_max: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int  # emitted by drafts only
    nonspec_seq_steps: int
    nonspec_tokens: int
    drafted_at: tuple[int, ...]  # [k_max]: drafts with k_i >= j
    reached_at: tuple[int, ...]  # [k_max]: drafts with k_i >= j and a_i >= j - 1
    accepted_at: tuple[int, ...]  # [k_max]: drafts with a_i >= j
    accepted_length_hist: tuple[int, ...]  # [k_max + 1]: drafts with a_i == a
    joint_hist: tuple[tuple[int, ...], ...]  # [k_max][k_max + 1]: joint_hist[k - 1][a] drafts with (k, a)
    proposed_tokens: int  # P = T + cut_policy_tokens + cut_grammar_tokens, over every sequence-step
    cut_grammar_tokens: int  # proposed, then cut by a grammar (structured outputs) before verification
    nonspec_by_cause: tuple[int, ...]  # [len(K0_CAUSES)]: sequence-steps with k_i = 0, by cause; sums to nonspec

    def __post_init__(self) -> None:
        width = self.k_max + 1
        for name, value, length in (
            ("drafted_at", self.drafted_at, self.k_max),
            ("reached_at", self.reached_at, self.k_max),
            ("accepted_at", self.accepted_at, self.k_max),
            ("accepted_length_hist", self.accepted_length_hist, width),
            ("joint_hist", self.joint_hist, self.k_max),
        ):
            if len(value) != length:
                raise ValueError(f"{name}: expected length {length} for k_max={self.k_max}, got {len(value)}")
        if any(len(row) != width for row in self.joint_hist):
            raise ValueError(f"joint_hist: every row must have length {width}")
        if len(self.nonspec_by_cause) != len(K0_CAUSES):
            raise ValueError(f"nonspec_by_cause: expected length {len(K0_CAUSES)}, got {len(self.nonspec_by_cause)}")

    @classmethod
    def zero(cls, k_max: int) -> SpecCounters:
        if k_max < 0:
            raise ValueError(f"k_max: must be >= 0, got {k_max}")
        empty = (0,) * k_max
        return cls(
            k_max,
            0,
            0,
            0,
            0,
            0,
            0,
            empty,
            empty,
            empty,
            (0,) * (k_max + 1),
            tuple((0,) * (k_max + 1) for _ in range(k_max)),
            0,
            0,
            (0,) * len(K0_CAUSES),
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        if not isinstance(other, SpecCounters):
            return NotImplemented
        if other.k_max != self.k_max:
            raise ValueError(f"k_max: cannot add counters with k_max {self.k_max} and {other.k_max}")
        return SpecCounters(
            self.k_max,
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted_tokens + other.accepted_tokens,
            self.emitted_tokens + other.emitted_tokens,
            self.nonspec_seq_steps + other.nonspec_seq_steps,
            self.nonspec_tokens + other.nonspec_tokens,
            add_tuples(self.drafted_at, other.drafted_at),
            add_tuples(self.reached_at, other.reached_at),
            add_tuples(self.accepted_at, other.accepted_at),
            add_tuples(self.accepted_length_hist, other.accepted_length_hist),
            tuple(add_tuples(x, y) for x, y in zip(self.joint_hist, other.joint_hist)),
            self.proposed_tokens + other.proposed_tokens,
            self.cut_grammar_tokens + other.cut_grammar_tokens,
            add_tuples(self.nonspec_by_cause, other.nonspec_by_cause),
        )

    @property
    def target_forward_seq_steps(self) -> int:
        """Every sequence-step, speculative or not: one row of one target forward each."""
        return self.drafts + self.nonspec_seq_steps

    @property
    def rejected_tokens(self) -> int:
        """Wasted verification: verified draft tokens the verifier rejected, T - A."""
        return self.draft_tokens - self.accepted_tokens

    @property
    def past_stop_tokens(self) -> int:
        """Wasted work past a stop: tokens the target computed and the verifier kept (accepted drafts and the
        bonus/correction token, or a plain step's token) that a stop token, stop string or max_tokens then threw
        away: (A + D - E) over drafts plus (nonspec_seq_steps - nonspec_tokens)."""
        return (self.accepted_tokens + self.drafts - self.emitted_tokens) + (self.nonspec_seq_steps
                                                                            - self.nonspec_tokens)

    @property
    def cut_policy_tokens(self) -> int:
        """Proposed, then cut by the k policy (or a confidence stop) before verification."""
        return self.proposed_tokens - self.draft_tokens - self.cut_grammar_tokens

    @property
    def total_emitted_tokens(self) -> int:
        return self.emitted_tokens + self.nonspec_tokens

    @property
    def acceptance_rate(self) -> float | None:
        return ratio(self.accepted_tokens, self.draft_tokens)

    @property
    def accepted_tokens_per_draft(self) -> float | None:
        """A / D: accepted draft tokens per draft, 0..k, bonus token excluded."""
        return ratio(self.accepted_tokens, self.drafts)

    @property
    def mean_accepted_length(self) -> float | None:
        """Deprecated alias of accepted_tokens_per_draft (A / D), kept one release."""
        return self.accepted_tokens_per_draft

    @property
    def mean_acceptance_length(self) -> float | None:
        """tau = 1 + A / D (EAGLE / vLLM-v1 convention: the bonus token included)."""
        mean = ratio(self.accepted_tokens, self.drafts)
        return None if mean is None else 1.0 + mean

    @property
    def emitted_per_draft(self) -> float | None:
        return ratio(self.emitted_tokens, self.drafts)

    @property
    def mean_proposed_length(self) -> float | None:
        return ratio(self.draft_tokens, self.drafts)

    @property
    def tokens_per_seq_step(self) -> float | None:
        """Tokens emitted per sequence-step (one row of a target forward per sequence). Not per forward: a
        forward serves a whole batch; SpecMetricsSnapshot.tokens_per_target_forward divides by forwards."""
        return ratio(self.total_emitted_tokens, self.target_forward_seq_steps)

    @property
    def per_position_acceptance(self) -> tuple[float | None, ...]:
        """accepted_at[j] / drafted_at[j]: of the drafts that proposed position j, the share accepted."""
        return tuple(ratio(a, d) for a, d in zip(self.accepted_at, self.drafted_at))

    @property
    def conditional_acceptance(self) -> tuple[float | None, ...]:
        """accepted_at[j] / reached_at[j]: acceptance at j given positions 1..j-1 were accepted."""
        return tuple(ratio(a, r) for a, r in zip(self.accepted_at, self.reached_at))

    def to_dict(self) -> dict[str, Any]:
        return {
            "k_max": self.k_max,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
            "nonspec_seq_steps": self.nonspec_seq_steps,
            "nonspec_tokens": self.nonspec_tokens,
            "target_forward_seq_steps": self.target_forward_seq_steps,
            "proposed_tokens": self.proposed_tokens,
            "cut_policy_tokens": self.cut_policy_tokens,
            "cut_grammar_tokens": self.cut_grammar_tokens,
            "rejected_tokens": self.rejected_tokens,
            "past_stop_tokens": self.past_stop_tokens,
            "nonspec_by_cause": dict(zip(K0_CAUSES, self.nonspec_by_cause)),
            "drafted_at": list(self.drafted_at),
            "reached_at": list(self.reached_at),
            "accepted_at": list(self.accepted_at),
            "accepted_length_hist": list(self.accepted_length_hist),
            "joint_hist": [list(row) for row in self.joint_hist],
        }


@dataclass(frozen=True, slots=True)
class StepTotals:
    """Step-level (batch-level) totals of a window; they add across windows, not across requests."""

    steps: int = 0  # every engine step with a forward, prefill-only ones included
    spec_steps: int = 0  # steps with at least one draft
    propose_s: float = 0.0
    verify_s: float = 0.0
    sample_s: float = 0.0
    prefill_steps: int = 0  # steps whose forward prefilled at least one prompt chunk
    prefill_only_steps: int = 0  # of those, steps that sampled no sequence at all
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    draft_forwards: int = 0  # draft-model forward passes (Proposal.num_draft_forwards); 0 for prompt lookup
    draft_tokens_computed: int = 0  # draft positions they computed, tokens a stop rule dropped included

    def __add__(self, other: StepTotals) -> StepTotals:
        if not isinstance(other, StepTotals):
            return NotImplemented
        return StepTotals(
            self.steps + other.steps,
            self.spec_steps + other.spec_steps,
            self.propose_s + other.propose_s,
            self.verify_s + other.verify_s,
            self.sample_s + other.sample_s,
            self.prefill_steps + other.prefill_steps,
            self.prefill_only_steps + other.prefill_only_steps,
            self.prefill_tokens + other.prefill_tokens,
            self.prefill_s + other.prefill_s,
            self.draft_forwards + other.draft_forwards,
            self.draft_tokens_computed + other.draft_tokens_computed,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "spec_steps": self.spec_steps,
            "propose_s": self.propose_s,
            "verify_s": self.verify_s,
            "sample_s": self.sample_s,
            "prefill_steps": self.prefill_steps,
            "prefill_only_steps": self.prefill_only_steps,
            "prefill_tokens": self.prefill_tokens,
            "prefill_s": self.prefill_s,
            "draft_forwards": self.draft_forwards,
            "draft_tokens_computed": self.draft_tokens_computed,
        }
