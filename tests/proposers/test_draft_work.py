"""Every proposer reports what drafting cost through its Proposal: model forward passes (a batched pass counts
once) and draft positions computed, a position a stop rule dropped included; prompt lookup reports 0."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.sampling.params import SamplingParams
from specd.speculation.draft import DraftModelProposer
from specd.speculation.eagle import EagleProposer
from specd.speculation.hybrid import HybridProposer
from specd.speculation.ngram import NgramConfig, NgramProposer
from specd.speculation.proposer import SequenceView
from specd.testing import CountingModel, random_draft_head

TOKENS = ([3, 4, 5, 6, 7, 9, 3, 4, 5], [10, 11, 12, 13, 14])


class StopAt:
    """A DraftStop that ends the draft before `position` whatever the probability."""

    def __init__(self, position: int) -> None:
        self.position = position

    def stop(self, position: int, top_prob: float) -> bool:
        return position >= self.position



def _views(stops: Sequence[StopAt | None] = (None, None)) -> list[SequenceView]:
    return [
        SequenceView(i, tokens, SamplingParams(temperature=0.0), None, stop)
        for i, (tokens, stop) in enumerate(zip(TOKENS, stops))
    ]


def test_a_draft_model_counts_batched_forwards_and_every_position_it_computed(tiny_model) -> None:
    counting = CountingModel(tiny_model)
    proposer = DraftModelProposer(counting, 4, 64, num_layers=1)  # type: ignore[arg-type]
    proposal = proposer.propose(_views(), [3, 2])
    assert [len(d) for d in proposal.draft_token_ids] == [3, 2]
    # Three passes (the first also catches up on the prompts), 2 + 2 + 1 positions.
    assert (proposal.num_draft_forwards, proposal.num_computed_draft_tokens) == (3, 5)
    assert (counting.calls, counting.rows) == (3, 5)


def test_a_position_a_stop_rule_drops_was_still_computed(tiny_model) -> None:
    counting = CountingModel(tiny_model)
    proposer = DraftModelProposer(counting, 4, 64, num_layers=1)  # type: ignore[arg-type]
    proposal = proposer.propose(_views((StopAt(1), None)), [3, 3])
    assert [len(d) for d in proposal.draft_token_ids] == [1, 3]
    # Pass 2 computed sequence 0's position 2 before its stop rule dropped it: 2 + 2 + 1 computed, 4 drafted.
    assert (proposal.num_draft_forwards, proposal.num_computed_draft_tokens) == (3, 5)
    assert (counting.calls, counting.rows) == (3, 5)


def test_prompt_lookup_reports_no_drafting_work() -> None:
    proposal = NgramProposer(NgramConfig(1, 4)).propose(_views(), [3, 3])
    assert proposal.draft_token_ids[0] == [6, 7, 9]
    assert (proposal.num_draft_forwards, proposal.num_computed_draft_tokens) == (0, 0)


def _fed_eagle(tiny_model) -> EagleProposer:
    eagle = EagleProposer(random_draft_head(tiny_model), 4, 64)
    hidden = tiny_model.config.hidden_size
    for i, tokens in enumerate(TOKENS):  # the target's features, as the engine hands them over each step
        eagle.observe([i], [0], [torch.randn(len(tokens) - 1, hidden, generator=torch.Generator().manual_seed(i))])
    return eagle


def test_eagle_counts_its_head_passes_and_dropped_positions(tiny_model) -> None:
    proposal = _fed_eagle(tiny_model).propose(_views((StopAt(2), None)), [4, 1])
    assert [len(d) for d in proposal.draft_token_ids] == [2, 1]
    # Pass 1: both sequences; pass 2: sequence 0; pass 3: sequence 0's position 3, dropped by its stop rule.
    assert (proposal.num_draft_forwards, proposal.num_computed_draft_tokens) == (3, 4)


def test_hybrid_reports_its_model_part_only(tiny_model) -> None:
    hybrid = HybridProposer(NgramProposer(NgramConfig(1, 4)), _fed_eagle(tiny_model), tiny_model.config.vocab_size, 3)
    proposal = hybrid.propose(_views(), [3, 2])
    assert proposal.draft_token_ids[0] == [6, 7, 9]  # copied: no forward
    assert len(proposal.draft_token_ids[1]) == 2
    assert (proposal.num_draft_forwards, proposal.num_computed_draft_tokens) == (2, 2)
    all_copied = hybrid.propose(_views()[:1], [3])
    assert (all_copied.num_draft_forwards, all_copied.num_computed_draft_tokens) == (0, 0)
