"""The k policies as objects behind KPolicy: what each plans, stops, keeps and learns, without an engine."""

from __future__ import annotations

import pytest

from specd.config import SpeculationConfig
from specd.speculation.k_policy import DraftOutcome, DraftSpan, EngineLoad, StepReport, StepView
from specd.speculation.policies import K_POLICIES
from specd.speculation.policies.adaptive import EXPLORE_K
from specd.speculation.policies.confidence import ConfidenceK
from specd.speculation.policies.goodput import GoodputK
from specd.speculation.policies.heuristic import HeuristicK
from specd.speculation.proposer import ProposerTraits

LOAD = EngineLoad(num_running=1, num_waiting=0, max_num_batched_tokens=512)


def _step(*outcomes: DraftOutcome, decode_only: bool = True) -> StepReport:
    return StepReport(outcomes, num_new_tokens=4, verify_s=0.01, step_s=0.02, num_emitted=2, decode_only=decode_only)


def test_every_registered_policy_is_built_from_the_config_and_plans_within_k_max() -> None:
    spec = SpeculationConfig()
    for name, policy_class in K_POLICIES.items():
        policy = policy_class.from_config(spec, ProposerTraits())
        policy.add(7, 5)
        # Every policy starts at k_max, except adaptive, which explores with EXPLORE_K tokens until it has
        # measured what a verified row costs.
        assert policy.plan([7], LOAD) == [EXPLORE_K if name == "adaptive" else 5], name
        assert policy.keep([DraftSpan(7, 0, 0)], StepView(1, 1, 512, True)) == [0], name
        policy.release(7)
        policy.release(7)  # unknown ids are ignored


def test_heuristic_grows_after_full_acceptance_shrinks_after_rejection_and_probes_from_zero() -> None:
    policy = HeuristicK(probe_interval=3)
    policy.add(1, 4)
    policy.add(2, 4)
    history = []
    for drafted, accepted in [(4, 1), (3, 3), (4, 4), (0, 0), (4, 0), (3, 0), (2, 0), (1, 0)]:
        policy.observe(_step(DraftOutcome(1, drafted, accepted, 0), DraftOutcome(99, 4, 4, 0)))
        history.append(policy.plan([1], LOAD)[0])
    # 4 -1 -> 3, +2 -> 4 (capped), +2 -> 4, no draft: kept, then -1 per rejection down to 0.
    assert history == [3, 4, 4, 4, 3, 2, 1, 0]
    idle = []
    for _ in range(3):
        policy.observe(_step(DraftOutcome(1, 0, 0, 0)))
        idle.append(policy.plan([1], LOAD)[0])
    assert idle == [0, 0, 1]  # after probe_interval steps at 0 it asks for one token again
    assert policy.plan([2], LOAD) == [4]  # a sequence without outcomes keeps its state


def test_confidence_stops_below_its_threshold_and_needs_a_proposer_that_can_stop() -> None:
    policy = ConfidenceK(threshold=0.4)
    policy.add(1, 3)
    stop = policy.draft_stop(1)
    assert stop is not None and stop.stop(0, 0.39) and not stop.stop(0, 0.4)
    assert ConfidenceK.unsupported(ProposerTraits(stops_while_drafting=True)) is None
    assert ConfidenceK.unsupported(ProposerTraits(free_drafts=True)) is not None


def test_goodput_keeps_what_pays_given_the_rest_of_the_step_and_learns_from_every_sequence() -> None:
    policy = GoodputK()
    assert GoodputK.unsupported(ProposerTraits(free_drafts=True)) is None
    assert GoodputK.unsupported(ProposerTraits(stops_while_drafting=True)) is not None
    seen: dict[str, object] = {}

    def plan(seq_ids, buckets, draft_lengths, base_tokens):
        seen["base_tokens"] = base_tokens
        return type("Plan", (), {"keep": [1 for _ in seq_ids]})()

    policy.planner.plan = plan  # type: ignore[method-assign]
    keep = policy.keep([DraftSpan(1, 3, 2), DraftSpan(2, 4, 1)], StepView(3, 20, 512, True))
    assert keep == [1, 1] and seen["base_tokens"] == 20 - 3 - 4  # the step's tokens besides these drafts
    policy.observe(_step(DraftOutcome(5, 4, 4, 3)))  # a sequence of another policy still teaches acceptance
    assert policy.planner.accept_prob(6, 3, 0) > 0.5
    policy.observe(_step(DraftOutcome(5, 4, 4, 3), decode_only=False))
    assert set(policy.planner.snapshot()["forward_ms_by_new_tokens"]) == {"4"}  # prefill steps teach no cost


@pytest.mark.parametrize("name", sorted(K_POLICIES))
def test_snapshots_are_json_ready_or_none(name: str) -> None:
    import json

    snapshot = K_POLICIES[name].from_config(SpeculationConfig(), ProposerTraits()).snapshot()
    assert snapshot is None or json.loads(json.dumps(snapshot)) == snapshot
