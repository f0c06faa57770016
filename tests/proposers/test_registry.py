"""Adding a proposer or a k policy is one class and one registry line: a test-only pair, registered here, runs
end to end (config, CLI flags, engine), and the proposer that asks for the target's hidden states gets exactly
the rows the target kept."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from specd.cli import build_parser
from specd.config import EngineConfig, SpeculationConfig
from specd.config_args import engine_config_from_args
from specd.errors import InvalidParameterError
from specd.llm import LLM
from specd.model.attention import ForwardBatch
from specd.sampling.params import SamplingParams
from specd.speculation.k_policy import EngineLoad, KPolicy
from specd.speculation.policies import K_POLICIES
from specd.speculation.proposer import Proposal, Proposer, ProposerTraits
from specd.speculation.registry import PROPOSERS, ProposerEntry

PROMPTS = ["hello world, hello world, hello", "abcabcabcabc", "the quick brown fox jumps over the lazy dog"]
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, spec_detail=True)
HIDDEN_LAYERS = (0, -1)


class ReplayProposer(Proposer):
    """Test-only: drafts the known greedy continuation, wrong at one position that moves every step, so every
    accepted length from 0 to k occurs. Asks for the target's first-layer and final hidden states."""

    traits = ProposerTraits(free_drafts=True)
    hidden_layers = HIDDEN_LAYERS

    def __init__(self, reference: list[list[int]], vocab_size: int) -> None:
        self.reference = reference
        self.vocab_size = vocab_size
        self.observed: dict[int, list[tuple[int, torch.Tensor]]] = {}  # seq_id -> (start position, rows)

    def propose(self, seqs, num_draft_tokens):
        drafts = []
        for view, k in zip(seqs, num_draft_tokens):
            tokens = list(view.token_ids)
            full = next(ref for ref in self.reference if ref[: len(tokens)] == tokens)
            draft = full[len(tokens) : len(tokens) + k]
            wrong = len(tokens) % (k + 1)
            if wrong < len(draft):
                draft[wrong] = (draft[wrong] + 1) % self.vocab_size
            drafts.append(draft)
        return Proposal(drafts, None)

    def observe(self, seq_ids, start_positions, hidden_per_seq):
        for seq_id, start, rows in zip(seq_ids, start_positions, hidden_per_seq):
            self.observed.setdefault(seq_id, []).append((start, rows.clone()))

    def release(self, seq_id):
        pass


class HalfK(KPolicy):
    """Test-only: half of k_max (at least one), for proposers whose drafts are free to make."""

    def __init__(self) -> None:
        self._k_max: dict[int, int] = {}

    @classmethod
    def from_config(cls, spec, traits):
        return cls()

    @classmethod
    def unsupported(cls, traits):
        return None if traits.free_drafts else "it wants drafts that cost nothing"

    def add(self, seq_id, k_max):
        self._k_max[seq_id] = k_max

    def plan(self, seq_ids, load: EngineLoad):
        return [max(1, self._k_max[seq_id] // 2) for seq_id in seq_ids]

    def release(self, seq_id):
        self._k_max.pop(seq_id, None)


class RecordingHalfK(HalfK):
    """HalfK that notes what every `plan` call was asked: the sequence ids and the load."""

    seen: ClassVar[list[tuple[list[int], EngineLoad]]] = []

    def plan(self, seq_ids, load: EngineLoad):
        RecordingHalfK.seen.append((list(seq_ids), load))
        return super().plan(seq_ids, load)


@pytest.fixture
def registered(monkeypatch, tiny_model, tokenizer):
    """Registers `replay` and `half` (one line each) and returns the greedy reference outputs."""
    plain = LLM.from_model(tiny_model, tokenizer, EngineConfig(max_model_len=256)).generate(PROMPTS, GREEDY)
    reference = [o.prompt_token_ids + o.outputs[0].token_ids for o in plain]
    built: list[ReplayProposer] = []

    def build_replay(config, target, tokenizer):
        built.append(ReplayProposer(reference, target.config.vocab_size))
        return built[-1]

    monkeypatch.setitem(PROPOSERS, "replay", ProposerEntry(ReplayProposer.traits, build_replay))
    monkeypatch.setitem(K_POLICIES, "half", HalfK)
    monkeypatch.setitem(K_POLICIES, "recording-half", RecordingHalfK)
    RecordingHalfK.seen = []
    return plain, built


def test_a_registered_proposer_and_policy_run_end_to_end(registered, tiny_model, tokenizer):
    plain, built = registered
    config = EngineConfig(max_model_len=256, max_num_seqs=4,
                          speculation=SpeculationConfig(method="replay", num_speculative_tokens=4, k_policy="half"))
    llm = LLM.from_model(tiny_model, tokenizer, config)  # the proposer comes from the registry
    assert len(built) == 1
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    ks = {step.k for o in outs for step in o.spec_stats.steps}
    assert max(ks) == 2 and ks <= {0, 1, 2}  # the policy's k_max // 2, cut only near max_tokens
    accepted = {step.accepted for o in outs for step in o.spec_stats.steps if step.k == 2}
    assert accepted == {0, 1, 2}  # the wrong draft token moves: every acceptance length occurs


def test_a_registered_policy_declares_which_proposers_it_works_with(registered):
    with pytest.raises(InvalidParameterError) as err:
        SpeculationConfig(method="layerskip", k_policy="half")
    assert err.value.field == "speculation.k_policy" and "replay" in err.value.message  # who it works with
    with pytest.raises(InvalidParameterError) as err:
        SpeculationConfig(method="replay", k_policy="confidence")  # replay cannot stop while drafting
    assert err.value.field == "speculation.k_policy"


def test_the_cli_offers_what_is_registered(registered):
    args = build_parser().parse_args(["generate", "x", "--spec", "replay", "--k-policy", "half"])
    spec = engine_config_from_args(args).speculation
    assert (spec.method, spec.k_policy) == ("replay", "half")


def test_hidden_states_of_the_kept_rows_reach_the_proposer(registered, tiny_model, tokenizer):
    _, built = registered
    config = EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,  # chunked prefill
                          speculation=SpeculationConfig(method="replay", num_speculative_tokens=3))
    llm = LLM.from_model(tiny_model, tokenizer, config)
    outs = llm.generate(PROMPTS, GREEDY)
    proposer = built[-1]
    assert sum(o.spec_stats.accepted_tokens for o in outs) > 0
    for seq_id, out in enumerate(outs):
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        calls = proposer.observed[seq_id]
        # Every position the target cached gets its feature exactly once, in order; the last step (the one that
        # finished the request) is not handed over.
        positions = [start + row for start, rows in calls for row in range(rows.shape[0])]
        assert positions == list(range(len(positions)))
        assert len(out.prompt_token_ids) <= len(positions) < len(tokens) - 1
        # ... and equals the features of a fresh forward over the committed tokens.
        cache = tiny_model.make_cache(1, 256)
        slot = cache.allocate()
        cache.reserve(len(tokens))
        batch = ForwardBatch.build([tokens], [slot], [0], [[len(tokens) - 1]])
        reference = tiny_model.forward_with_hidden(batch, cache, hidden_layers=HIDDEN_LAYERS).hidden_states
        observed = torch.cat([rows for _, rows in calls])  # [num_positions, 2 * hidden_size]
        assert observed.shape == (len(positions), 2 * tiny_model.config.hidden_size)
        torch.testing.assert_close(observed, reference[: len(positions)])


def test_proposers_that_do_not_ask_get_no_hidden_states(make_llm_with_spy):
    llm, calls = make_llm_with_spy(SpeculationConfig(method="ngram", num_speculative_tokens=3))
    llm.generate(PROMPTS, GREEDY)
    assert calls and all(hidden_layers is None for hidden_layers in calls)


@pytest.fixture
def make_llm_with_spy(monkeypatch, tiny_model, tokenizer):
    """An LLM whose target records the hidden_layers every forward was asked for."""
    calls: list[object] = []
    forward_with_hidden = type(tiny_model).forward_with_hidden

    def spy(self, batch, cache, num_layers=None, hidden_layers=None):
        calls.append(hidden_layers)
        return forward_with_hidden(self, batch, cache, num_layers, hidden_layers)

    monkeypatch.setattr(type(tiny_model), "forward_with_hidden", spy)

    def make(spec: SpeculationConfig) -> tuple[LLM, list[object]]:
        return LLM.from_model(tiny_model, tokenizer, EngineConfig(max_model_len=256, speculation=spec)), calls

    return make


def test_plan_sees_only_decoding_sequences_and_the_prompt_chunks_the_step_will_carry(registered, tiny_model,
                                                                                    tokenizer):
    """The scheduler admits before k is planned: `plan` is asked about the decoding sequences only, and the load
    names the prompts still being prefilled and their tokens left, the chunks the step will carry."""
    budget = 16
    config = EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=budget,  # chunked prefill
                          speculation=SpeculationConfig(method="replay", num_speculative_tokens=4,
                                                        k_policy="recording-half"))
    llm = LLM.from_model(tiny_model, tokenizer, config)
    outs = llm.generate(PROMPTS, GREEDY)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    assert prompt_tokens > budget + 1  # so a step prefills while another sequence decodes
    seen = RecordingHalfK.seen
    assert seen and all(seq_ids for seq_ids, _ in seen)  # never asked about a step with no decoding sequence
    for seq_ids, load in seen:
        assert load.num_running == len(seq_ids) + load.num_prefilling
        assert (load.num_prompt_tokens > 0) == (load.num_prefilling > 0)
        assert load.max_num_batched_tokens == budget
    # The first plan comes once the first prompt is prefilled: after that many prefill-only steps, each of which
    # spent the whole budget on prompt tokens.
    first_ids, first = seen[0]
    prefill_steps = -(-len(outs[0].prompt_token_ids) // budget)
    assert first.num_running == len(PROMPTS) and first.num_waiting == 0  # all admitted before planning
    assert first.num_prefilling >= 1 and first.num_prompt_tokens == prompt_tokens - prefill_steps * budget
    assert len(first_ids) == len(PROMPTS) - first.num_prefilling
    assert seen[-1][1].num_prefilling == 0
