"""The `adaptive` k policy: the k_i that maximise the batch's expected emitted tokens per second of step time,
from what the engine measured about this batch size, these sequences and this proposer. Works with every proposer.

A step with k_i draft tokens for sequence i is expected to emit

    E = sum_i (1 + sum_{j < k_i} v_ij),    v_ij = prod_{l <= j} p_i(l)

tokens (draft j is emitted only if drafts 0..j were all accepted; p_i(l) is this sequence's acceptance at
position l), and to take

    T = F(S, S + sum_i k_i) + D(S_d) * max_i k_i

seconds: F the step besides drafting at S sequences and R new tokens, D what one more draft position costs when
S_d sequences draft (about 0 for prompt lookup, one draft/head forward for a model-based proposer). Both come
from policies/step_cost.py, learned from every step's measured times. The policy picks the k that maximises E / T:
for each cap K on the number of positions (a model-based proposer pays per position, whoever uses it), the draft
tokens below K in falling v_ij, added while v_ij > (E / T) * dF/dR (each one raises the rate); the best cap
wins, and it must beat plain decoding (all k_i = 0) by MARGIN or every k_i is 0. Since v_ij falls with j, every
k_i is a prefix. As S grows, dF/dR grows towards F / S (a CPU forward turns compute-bound) while E / T stays near
its plain value, so the price of a draft token climbs past any v_ij and k falls to 0 within a step of the load
arriving; when the load leaves, the cells measured at small S price drafts cheaply again, so k comes back.

Where it decides: `plan` chooses k_i before drafting, so a model-based proposer drafts no more than pays, into
the rows the step's prompt chunks leave free in the budget; `keep` re-decides after drafting with the step as formed
(its prompt chunks' rows taken from the room) and the draft's bucket (ngram: its match length), counting drafting
as already paid, so it can only cut. Where drafts are free to make (ProposerTraits.free_drafts: prompt lookup),
`plan` asks for what the best bucket seen would earn and leaves the choice to `keep`, which knows the bucket. The
step cost is learnt from decode and verification steps only: a prompt row can cost far less than a verified row
(dense prompt rows of an int4 model on AMX), so steps with prompt chunks would underprice drafts. Acceptance is
counted per (bucket, position), engine-wide and per sequence (shrunk towards the engine-wide value, so a sequence
that copies well earns long drafts and one that does not is cut), with a bucket-blind count for `plan`; one policy
instance serves one engine, so the estimates are also per proposer. A deterministic draft that was cut still
teaches the position past the verified ones (DraftOutcome.next_matched: the target's token there against the cut
one), so a bucket cut after a few misses is measured again every step it is cut, at no cost. A sequence that
drafted nothing for the probe interval steps verifies one token anyway: otherwise a model proposer's acceptance
only changes through verified tokens, and the forward's cost at R > S is only measured by drafting. Probes are not
free (a row each), so the interval grows with what a row costs: at most PROBE_SHARE of the step time goes to them.
Until the forward's cost was measured at three points, one sequence drafts 1, 0, 2 tokens in turn (exploring,
which is how those points get measured: R = S + 1, S, S + 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from specd.speculation.k_policy import DraftSpan, EngineLoad, KPolicy, StepReport, StepView
from specd.speculation.policies.step_cost import DraftCost, ForwardCost, LocalCost

if TYPE_CHECKING:
    from specd.config import SpeculationConfig
    from specd.speculation.proposer import ProposerTraits

MARGIN = 0.12  # drafting must promise this much more than plain decoding: estimates are noisy, a tax is not
# (int4 serving grid: with 0.03 a draft row at 8 sequences, ~8 % of the step, was kept on a promised 3-5 % and
# 8 clients ran at 0.96x of off; with 0.08 every point of the grid held 0.99-1.16x. Int4 with dense prompt rows
# on AMX: at 4 clients a draft can save ~10 % at best, and with 0.08 four cells ran at 0.95-0.98x;
# with 0.12 the grid's cells were within its own A/A spread)
PROBE_INTERVAL = 16  # the shortest probe interval (steps), where a row is nearly free
MAX_PROBE_INTERVAL = 256
PROBE_SHARE = 0.01  # probes may cost at most this share of the step time (int4, 8 sequences: a row is ~1/8 of the
# step, so every sequence probing each 16 steps cost ~6% of the throughput while ~20% of chat's probes were accepted)
EXPLORE_K = 1  # draft tokens per sequence while the forward's cost is unknown: k_max was a 72-row step at 8
# sequences (~7 plain int4 steps) to learn one cell that a 16-row step measures as well
_PRIOR = (1.0, 2.0)  # (accepted, reached) pseudo-counts: an unseen position is worth 0.5
_SEQ_PRIOR_WEIGHT = 4.0
_HALVE_AT = 512.0
_MAX_BUCKET = 64
_ANY_BUCKET = -1  # the bucket-blind counts `plan` reads (the draft's bucket is known only after drafting)
# Caps tried when drafting costs per position; with free drafts only the largest can win.
_CAPS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


@dataclass(slots=True)
class _Counts:
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def add(self, num_drafted: int, num_accepted: int, halve_at: float | None) -> None:
        """Positions 0..min(k, a + 1) - 1 were scored by the target; 0..a - 1 were accepted."""
        reached = min(num_drafted, num_accepted + 1)
        while len(self.reached) < reached:
            self.accepted.append(0.0)
            self.reached.append(0.0)
        for j in range(reached):
            self.reached[j] += 1.0
            self.accepted[j] += 1.0 if j < num_accepted else 0.0
            if halve_at is not None and self.reached[j] > halve_at:
                self.reached[j] /= 2
                self.accepted[j] /= 2


class Acceptance:
    """P(draft position j accepted | reached), per (bucket, position), engine-wide and per sequence."""

    def __init__(self) -> None:
        self._global: dict[int, _Counts] = {}
        self._per_seq: dict[int, dict[int, _Counts]] = {}

    def _global_probs(self, bucket: int, length: int) -> list[float]:
        g = self._global.get(bucket)
        known = 0 if g is None else min(length, len(g.reached))
        out = [(g.accepted[j] + _PRIOR[0]) / (g.reached[j] + _PRIOR[1]) for j in range(known)] if g else []
        return out + [_PRIOR[0] / _PRIOR[1]] * (length - known)

    def prob(self, seq_id: int, bucket: int, position: int) -> float:
        return self._probs(seq_id, bucket, self._global_probs(bucket, position + 1))[position]

    def _probs(self, seq_id: int, bucket: int, global_probs: list[float]) -> list[float]:
        own = self._per_seq.get(seq_id, {}).get(bucket)
        if own is None:
            return global_probs
        mine = min(len(global_probs), len(own.reached))
        return [(own.accepted[j] + _SEQ_PRIOR_WEIGHT * global_probs[j]) / (own.reached[j] + _SEQ_PRIOR_WEIGHT)
                for j in range(mine)] + global_probs[mine:]

    def values(self, seq_id: int, bucket: int, length: int) -> list[float]:
        """v_j = prod_{l <= j} p(l) for j < length: the expected emitted tokens each draft position adds."""
        return self.values_of([seq_id], bucket, [length])[0]

    def best_values(self, length: int) -> list[float]:
        """max over the buckets seen, engine-wide, of v_j for j < length: what the best draft could be worth."""
        best = [0.0] * length
        for bucket in self._global:
            survive = 1.0
            for j, p in enumerate(self._global_probs(bucket, length)):
                survive *= p
                best[j] = max(best[j], survive)
        return best

    def values_of(self, seq_ids: Sequence[int], bucket: int, lengths: Sequence[int]) -> list[list[float]]:
        """`values` for many sequences of one bucket (the engine-wide probabilities are read once)."""
        global_probs = self._global_probs(bucket, max(lengths, default=0))
        out = []
        for seq_id, length in zip(seq_ids, lengths, strict=True):
            row, survive = [], 1.0
            for p in self._probs(seq_id, bucket, global_probs[:length]):
                survive *= p
                row.append(survive)
            out.append(row)
        return out

    def observe(self, seq_id: int, bucket: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        for b in {min(bucket, _MAX_BUCKET), _ANY_BUCKET}:
            self._global.setdefault(b, _Counts()).add(num_drafted, num_accepted, _HALVE_AT)
            self._per_seq.setdefault(seq_id, {}).setdefault(b, _Counts()).add(num_drafted, num_accepted, None)

    def release(self, seq_id: int) -> None:
        self._per_seq.pop(seq_id, None)

    def snapshot(self) -> dict[str, list[float]]:
        return {str(b): [round(self.prob(-1, b, j), 4) for j in range(len(c.reached))]
                for b, c in sorted(self._global.items())}


class Decision(NamedTuple):
    """k_i per sequence, why, and the rates compared (tokens/s predicted; None while exploring)."""

    k: list[int]
    cause: str  # "draft" | "cost" (plain decoding predicted at least as fast) | "explore" (cost not measured yet)
    rate_plain: float | None
    rate_chosen: float | None


class _Price(NamedTuple):
    """The forward's local cost for a step, and plain decoding's seconds and tokens/s read from it."""

    cost: LocalCost
    plain_seconds: float
    rate_plain: float


def _price(lengths: Sequence[int], num_seqs: int, base_rows: int, forward: ForwardCost) -> _Price | None:
    """The forward's cost read halfway between plain decoding and every draft token verified (None: not measured
    yet), and plain decoding's seconds and emitted tokens per second from it."""
    half = sum(lengths) // 2
    cost = forward.at(num_seqs, base_rows + half)
    if cost is None:
        return None
    plain_seconds = max(cost.seconds - cost.seconds_per_row * half, 1e-9)
    return _Price(cost, plain_seconds, num_seqs / plain_seconds)


def _nothing_pays(top_value: float, price: _Price, num_seqs: int, longest: int, draft_per_position: float) -> bool:
    """Whether `choose` would keep no draft token: even the most valuable one (top_value; v_ij never grows with j,
    so it is some sequence's position 0) is worth less than the row it takes, at the cap that makes a row look
    cheapest (the longest: drafting's own seconds only lower a row's price relative to the step). Exact, not a
    heuristic: it is the first test of `choose`'s loop, and lets `plan` skip building every sequence's values
    when the load prices drafts out (at 16 sequences that was ~0.1 ms of Python per step, kept k = 0 or not)."""
    seconds = price.plain_seconds + draft_per_position * longest
    return top_value * seconds <= num_seqs * price.cost.seconds_per_row


def choose(
    values: Sequence[Sequence[float]], num_seqs: int, base_rows: int, max_rows: int,
    forward: ForwardCost, draft_per_position: float,
) -> Decision:
    """The k_i (k_i <= len(values[i])) that maximise expected emitted tokens per second for a step of num_seqs
    sequences and base_rows new tokens besides these drafts, at most max_rows new tokens in all.
    draft_per_position: seconds one more draft position adds (0: drafts are made or free). While the cost is
    unknown, one sequence (the first that can draft) drafts EXPLORE_K, 0, EXPLORE_K + 1 tokens as the observed steps
    count 0, 1, 2 modulo 3 and the others none: the steps then cover three row counts, which the cost fit needs (with
    one fixed k it would see two, forever), at a row or two each (every sequence exploring cost a fresh batch of 16
    ~3 % with k 1, 2, 3, and a batch of 8 ~1.4 % with 1, 0, 2, all of it before the first decision)."""
    lengths = [len(row) for row in values]
    price = _price(lengths, num_seqs, base_rows, forward)
    if price is None:
        explore = [0] * len(values)
        explorer = next((i for i, row in enumerate(values) if row), None)
        if explorer is not None:
            explore_k = (EXPLORE_K, 0, EXPLORE_K + 1)[forward.num_observed % 3]
            explore[explorer] = min(len(values[explorer]), explore_k, max(0, max_rows - base_rows))
        return Decision(explore, "explore", None, None)
    cost, plain_seconds, rate_plain = price
    longest = max(lengths, default=0)
    if _nothing_pays(max((row[0] for row in values if row), default=0.0), price, num_seqs, longest,
                     draft_per_position):
        return Decision([0] * len(values), "cost", rate_plain, rate_plain)
    best = (rate_plain * (1.0 + MARGIN), 0, 0)  # (rate, cap, number of tokens kept)
    # Every draft token, most valuable first; within a sequence position order breaks ties, so kept = prefixes.
    ranked = sorted((-v, j, i) for i, row in enumerate(values) for j, v in enumerate(row))
    caps = [c for c in _CAPS if c < longest] + [longest] if draft_per_position > 0.0 else [longest]
    for cap in caps:
        if cap == 0:
            continue
        emitted, seconds, kept = float(num_seqs), plain_seconds + draft_per_position * cap, 0
        rows = base_rows
        for neg_value, j, _ in ranked:
            if j >= cap:
                continue
            if rows >= max_rows or -neg_value * seconds <= emitted * cost.seconds_per_row:
                break
            emitted, seconds, kept, rows = emitted - neg_value, seconds + cost.seconds_per_row, kept + 1, rows + 1
        if emitted / seconds > best[0]:
            best = (emitted / seconds, cap, kept)
    k = [0] * len(values)
    _, cap, kept = best
    for i in [i for _, j, i in ranked if j < cap][:kept]:
        k[i] += 1
    return Decision(k, "draft" if kept else "cost", rate_plain, best[0] if kept else rate_plain)


class AdaptiveK(KPolicy):
    """The adaptive policy (see the module docstring). Estimates are engine-wide: it learns acceptance from every
    sequence's drafts and cost from every step, whichever policy those sequences use."""

    def __init__(self, free_drafts: bool = False) -> None:
        # free_drafts: the proposer's drafts cost nothing to make (ProposerTraits.free_drafts), so `plan` asks for
        # what the best draft could earn and `keep` decides, knowing the draft's bucket.
        self.free_drafts = free_drafts
        self.forward = ForwardCost()
        self.draft = DraftCost()
        self.acceptance = Acceptance()
        self._k_max: dict[int, int] = {}
        self._idle: dict[int, int] = {}  # seq_id -> consecutive steps it verified no draft token
        self.last_decision: Decision | None = None
        # Sequence-steps that verified no draft token, by cause: "cost" (`plan` or `keep` chose 0: plain decoding
        # predicted as fast), "cut" (planned > 0, but the proposer found nothing or the budget cut it).
        self.zero_k_causes: dict[str, int] = {"cost": 0, "cut": 0}
        self._planned: dict[int, int] = {}  # seq_id -> k_i of its last plan or keep (for the causes above)
        self.num_probes = 0
        self.probe_interval = PROBE_INTERVAL  # steps without a verified draft before a sequence probes; set by plan

    @classmethod
    def from_config(cls, spec: SpeculationConfig, traits: ProposerTraits) -> AdaptiveK:
        return cls(free_drafts=traits.free_drafts)

    def add(self, seq_id: int, k_max: int) -> None:
        self._k_max[seq_id] = k_max
        self._idle[seq_id] = 0

    def _probing(self, seq_id: int) -> bool:
        return self._idle.get(seq_id, 0) >= self.probe_interval

    def _interval(self, num_seqs: int) -> int:
        """The probe interval that keeps probes under PROBE_SHARE of the step time: num_seqs sequences probing
        once every N steps add num_seqs / N rows per step, each costing the forward's measured seconds per row."""
        cost = self.forward.at(num_seqs, num_seqs)
        if cost is None:
            return PROBE_INTERVAL
        interval = num_seqs * cost.seconds_per_row / (PROBE_SHARE * cost.seconds)
        return min(MAX_PROBE_INTERVAL, max(PROBE_INTERVAL, math.ceil(interval)))

    def plan(self, seq_ids: Sequence[int], load: EngineLoad) -> list[int]:
        # Drafts are priced as rows of a decode step of all the step's sequences (a prompt chunk's rows are cheaper
        # than rows that are verified: those also pay the LM head and the sampler, so a step that carries a chunk
        # would underprice them; measured: pricing them in that step's cost cost 7 % of off's throughput at 4-8
        # req/s). They get only the rows the prompts leave free: a draft row that displaced a prompt token would
        # keep that sequence out of the decoding batch a step longer.
        num_decoding = max(load.num_running - load.num_prefilling, len(seq_ids))
        num_seqs = num_decoding + load.num_prefilling  # sequences in the forward
        room = max(0, load.max_num_batched_tokens - num_decoding)
        prompt_rows = min(load.num_prompt_tokens, room)
        # (the scheduler also caps drafts at half the room while prompts are pending)
        draft_room = min(room // 2, room - prompt_rows) if load.num_prefilling else room
        lengths = [self._k_max[sid] for sid in seq_ids]
        drafting = sum(1 for k in lengths if k > 0)
        draft_per_position = self.draft.per_position(drafting)
        decision = self._priced_out(seq_ids, lengths, num_seqs, draft_per_position)
        if decision is None:
            decision = choose(self._plan_values(seq_ids, lengths), num_seqs, num_seqs, num_seqs + draft_room,
                              self.forward, draft_per_position)
        self.last_decision = decision
        self.probe_interval = self._interval(num_decoding)
        ks = list(decision.k)
        for i, sid in enumerate(seq_ids):
            if ks[i] == 0 and self._probing(sid):
                ks[i] = 1
            self._planned[sid] = ks[i]
        return ks

    def _priced_out(self, seq_ids: Sequence[int], lengths: Sequence[int], num_seqs: int,
                    draft_per_position: float) -> Decision | None:
        """`choose`'s decision when no draft token can pay, read from every sequence's first position only;
        None when one might (then `choose` decides from the full values)."""
        price = _price(lengths, num_seqs, num_seqs, self.forward)
        if price is None or not seq_ids:
            return None
        top = max((row[0] for row in self._plan_values(seq_ids, [min(n, 1) for n in lengths]) if row), default=0.0)
        if not _nothing_pays(top, price, num_seqs, max(lengths), draft_per_position):
            return None
        return Decision([0] * len(seq_ids), "cost", price.rate_plain, price.rate_plain)

    def _plan_values(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> list[list[float]]:
        """What `plan` prices each sequence's draft positions at (before drafting, so bucket-blind)."""
        values = self.acceptance.values_of(seq_ids, _ANY_BUCKET, lengths)
        if self.free_drafts and values:
            # Looking drafts up costs nothing, and what one is worth depends on its bucket (ngram: a long match is
            # copied far more reliably than a short one), which only drafting tells: plan for the best bucket and
            # let `keep` cut. Planning from the bucket-blind mean locked a lone docqa request into k = 0 after a
            # few early misses (only probes then measured acceptance: 1.02x against fixed k's 1.27x).
            best = self.acceptance.best_values(max(len(row) for row in values))
            values = [[max(v, b) for v, b in zip(row, best, strict=False)] for row in values]
        return values

    def keep(self, drafts: Sequence[DraftSpan], step: StepView) -> list[int]:
        if not drafts:
            return []
        lengths = [d.num_tokens for d in drafts]
        values = [self.acceptance.values(d.seq_id, min(d.bucket, _MAX_BUCKET), d.num_tokens) for d in drafts]
        # As in `plan`, drafts are priced as rows of a decode step of the step's sequences (one row each), in the
        # room its other tokens (prompt chunks included) leave in the budget.
        room = step.max_num_batched_tokens - (step.num_new_tokens - sum(lengths))
        decision = choose(values, step.num_seqs, step.num_seqs, step.num_seqs + room, self.forward, 0.0)
        kept = [max(k, 1 if self._probing(d.seq_id) and n else 0) for k, d, n in zip(decision.k, drafts, lengths)]
        for d, k in zip(drafts, kept, strict=True):
            if k == 0 and decision.cause != "explore":
                self._planned[d.seq_id] = 0  # cut for its cost, not for want of a draft
        return kept

    def observe(self, report: StepReport) -> None:
        num_seqs = report.num_seqs or len(report.outcomes)
        if report.teaches_cost:
            # Drafts are priced as decode rows, so only decode (and verification) steps teach the cost: a prompt row
            # may cost far less than a verified one (an int4 model on an AMX CPU prefills through dense bfloat16
            # copies at ~1/4 of a q4 row), and steps that carried prompt chunks made draft rows look cheap -- the
            # int4 grid lost 14-21 % of off's throughput past saturation that way. The first decode step after
            # them is left out too (StepReport.teaches_cost): it runs cold, and as a fresh engine's first exploring
            # step it priced a draft row at ~6x its cost.
            self.forward.observe(num_seqs, report.num_new_tokens, report.step_s - report.propose_s)
        drafted = [o.num_drafted for o in report.outcomes if o.num_drafted > 0]
        if drafted:
            self.draft.observe(len(drafted), max(drafted), report.propose_s)
        for outcome in report.outcomes:
            # A cut draft's next token, matched against the target's, counts as one more reached position: the
            # same event in distribution as its acceptance (DraftOutcome), so drafts `keep` cut still teach it --
            # without them a bucket cut after a few early misses was only measured again by probes.
            seen = outcome.next_matched is not None
            self.acceptance.observe(outcome.seq_id, outcome.bucket, outcome.num_drafted + seen,
                                    outcome.num_accepted + bool(outcome.next_matched))
            if outcome.seq_id in self._idle:
                if outcome.num_drafted:
                    self.num_probes += self._probing(outcome.seq_id)
                    self._idle[outcome.seq_id] = 0
                else:
                    self._idle[outcome.seq_id] += 1
                    self.zero_k_causes["cost" if self._planned.get(outcome.seq_id) == 0 else "cut"] += 1

    def release(self, seq_id: int) -> None:
        self._k_max.pop(seq_id, None)
        self._idle.pop(seq_id, None)
        self._planned.pop(seq_id, None)
        self.acceptance.release(seq_id)

    def snapshot(self) -> dict[str, object]:
        last = self.last_decision
        return {
            "last_cause": None if last is None else last.cause,
            "last_k": None if last is None else list(last.k),
            "predicted_tokens_per_s_plain": None if last is None or last.rate_plain is None
            else round(last.rate_plain, 3),
            "predicted_tokens_per_s_chosen": None if last is None or last.rate_chosen is None
            else round(last.rate_chosen, 3),
            "zero_k_sequence_steps": dict(self.zero_k_causes),
            "probes": self.num_probes,
            "probe_interval_steps": self.probe_interval,
            "step_ms_by_seqs_and_rows": self.forward.snapshot(),
            "accept_prob_by_bucket_and_position": self.acceptance.snapshot(),
        }
