"""The one interface every k policy implements: how many draft tokens each sequence gets (k_i), and why.

A policy decides at three points of a step and learns at a fourth; the engine calls every policy the same way
and never looks at which one it has:

  schedule  <- `plan`: the k_i each of its sequences asks for (the scheduler may cut it to fit the budget);
  propose   <- `draft_stop`: a rule a model-based proposer consults before each draft position (None: draft k_i);
  plan k    <- `keep`: after drafting, how much of each draft to verify (a prefix), seeing the whole step;
  record    <- `observe`: every sampled sequence's outcome and the step's measured cost.

State lives in the policy object, keyed by seq_id (like a proposer's caches): `add` when a request that uses the
policy joins, `release` when it leaves. An engine holds one instance per policy its proposer supports, so a request
can override the engine's policy (`SpecOverride.k_policy`). Which proposers a policy works with, it declares itself
(`unsupported`), against the traits proposers declare (`ProposerTraits`).

Adding a policy: one module with a class implementing this protocol, and one line in speculation/registry.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from specd.config import SpeculationConfig
    from specd.speculation.proposer import DraftStop, ProposerTraits


# The most draft tokens any sequence may get in one step (k_max's upper bound, engine-wide and per request).
MAX_NUM_SPECULATIVE_TOKENS = 64


class EngineLoad(NamedTuple):
    """What a policy sees of the engine when it plans k: the step's sequences are admitted, its batch not yet formed.
    `plan` is asked only about decoding sequences; the prefilling ones are here as load."""

    num_running: int  # sequences holding a KV slot (decoding or prefilling), admissions of this step included
    num_waiting: int  # requests still queued for a slot
    max_num_batched_tokens: int  # the token budget of one step
    num_prefilling: int = 0  # of num_running, the sequences with prompt tokens left: the step carries their chunks
    num_prompt_tokens: int = 0  # prompt tokens those sequences have left (the step prefills what the budget allows)


class StepView(NamedTuple):
    """The step being planned, after drafting: what `keep` can weigh one more verified token against."""

    num_seqs: int  # sequences in the step's target forward (decode and prefill)
    num_new_tokens: int  # tokens that forward processes if every draft proposed so far is kept
    max_num_batched_tokens: int
    decode_only: bool  # no prompt chunk in the step


class DraftSpan(NamedTuple):
    """One sequence's draft as proposed: its length and the proposer's confidence class (0 when none)."""

    seq_id: int
    num_tokens: int
    bucket: int


class DraftOutcome(NamedTuple):
    """What verification did with one sampled sequence's draft this step (k_i = 0 for plain decoding).

    next_matched: when the proposer had made a deterministic draft token just past the verified ones (its draft was
    cut, by `keep` or by a constraint) and every verified one was accepted, whether the token the target emitted in
    its place equals it; None otherwise. For a deterministic draft token that is the same event, in distribution, as
    its acceptance had it been verified (accepted with probability p(d), and the target's own token is d with
    probability p(d)), so a policy can learn the acceptance of drafts it did not pay for. It is not a draft: the
    metrics never count it.
    """

    seq_id: int
    num_drafted: int
    num_accepted: int
    bucket: int
    next_matched: bool | None = None


class StepReport(NamedTuple):
    """One finished step, for `observe`: the outcome of every sequence the step sampled (whichever policy it
    uses) and what the step cost."""

    outcomes: Sequence[DraftOutcome]
    num_new_tokens: int  # tokens in the target forward
    verify_s: float  # wall time of the target forward plus verification
    step_s: float  # wall time of the whole step (propose .. commit)
    num_emitted: int  # tokens the step emitted, all sequences together
    decode_only: bool
    propose_s: float = 0.0  # wall time of drafting (propose, keep, constraint cuts), part of step_s
    num_seqs: int = 0  # sequences in the target forward (decode and prefill); 0: unknown, len(outcomes) then
    after_prompt: bool = False  # the engine's previous step carried prompt chunks (or there was none)

    @property
    def teaches_cost(self) -> bool:
        """Whether the step's time is what a decode or verification step costs: decode-only, and not the first
        after a step with prompt chunks. That one runs with the caches the prompt path filled (the int4 model on an
        AMX CPU prefills through dense bfloat16 copies of the weights): on the default model the forward took
        1.7-2x a warm one and the engine step 3.7x (33 ms against 9), whatever its rows. A fresh engine's first
        decode step explores a draft row, so that time landed in the R = S + 1 cell: with a traced docqa run's
        step times the adaptive fit priced a row at 59 % of a step (the truth: ~10 %), and in one bench/spec.py
        grid a lone docqa request verified no drafts in three fresh engines."""
        return self.decode_only and not self.after_prompt


class KPolicy(Protocol):
    """A k policy. See the module docstring for when each method is called.

    Subclass it to inherit the defaults: works with every proposer, no stop rule, keeps whole drafts, learns
    nothing, shows no estimates.
    """

    @classmethod
    def from_config(cls, spec: SpeculationConfig, traits: ProposerTraits) -> KPolicy:
        """A fresh instance with the engine-wide settings it needs (thresholds, intervals), for a proposer with
        `traits` (which `unsupported` accepted)."""
        ...

    @classmethod
    def unsupported(cls, traits: ProposerTraits) -> str | None:
        """Why this policy cannot work with a proposer that has `traits`, or None when it can."""
        return None

    def add(self, seq_id: int, k_max: int) -> None:
        """A request using this policy joined; k_max (>= 1) caps every k_i it will plan for it."""
        ...

    def plan(self, seq_ids: Sequence[int], load: EngineLoad) -> list[int]:
        """k_i in [0, k_max_i] for each of its decoding sequences, before scheduling. Changes no state its
        decisions depend on (a policy may note what it planned, for its snapshot)."""
        ...

    def draft_stop(self, seq_id: int) -> DraftStop | None:
        """The stop-while-drafting rule for this sequence's next draft, or None to draft all k_i."""
        return None

    def keep(self, drafts: Sequence[DraftSpan], step: StepView) -> list[int]:
        """How many tokens of each (non-empty) draft to verify: a prefix, 0 <= keep_i <= drafts[i].num_tokens.
        May change the policy's own bookkeeping (e.g. how long a sequence has been cut)."""
        return [draft.num_tokens for draft in drafts]

    def observe(self, report: StepReport) -> None:
        """Learn from a finished step. Called every step on every policy of the engine, with every sampled
        sequence: a policy updates its own sequences and may learn from all of them."""
        return None

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence (unknown ids are ignored)."""
        ...

    def snapshot(self) -> dict[str, object] | None:
        """JSON-ready estimates the policy decides from (LLM.get_metrics shows them), or None when it has none."""
        return None
