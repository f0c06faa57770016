"""The eagle proposer: its head KV cache equals a fresh prefill after mixed accepts and rejects, it drafts nothing
without the target's features, only draft-vocabulary tokens carry probability, and heads are found or refused."""

from __future__ import annotations

import pytest
import torch

from specd.config import EngineConfig, SpeculationConfig
from specd.errors import ModelLoadError
from specd.llm import LLM
from specd.model.attention import ForwardBatch
from specd.model.draft_head import DraftHead
from specd.sampling.params import SamplingParams
from specd.speculation.eagle import EagleProposer, build_eagle
from specd.speculation.proposer import SequenceView
from specd.testing import random_draft_head, tiny_hf_config_dict, tiny_specd_model

PROMPTS = ["hello world, hello world, hello", "abcabcabcabc", "the quick brown fox jumps over the lazy dog. the quick"]


def test_head_cache_equals_a_fresh_prefill_after_accepts_and_rejects(tiny_model, tokenizer) -> None:
    proposer = EagleProposer(random_draft_head(tiny_model), 4, 256)
    config = EngineConfig(speculation=SpeculationConfig(method="layerskip", num_speculative_tokens=4,
                                                        k_policy="heuristic"), max_num_seqs=4, max_model_len=256)
    llm = LLM.from_model(tiny_model, tokenizer, config, proposer=proposer)
    for p in PROMPTS:
        llm.add_request(p, SamplingParams(max_tokens=200, temperature=0.8, seed=5, ignore_eos=True))
    for _ in range(12):
        llm.step()
    m = llm.get_metrics()["counters"]
    assert 0 < m["accepted_tokens"] < m["draft_tokens"]  # a mix of accepts and rejects happened
    running = llm.engine.scheduler.running
    assert len(running) == len(PROMPTS)
    for seq in running:
        state = proposer._seqs[seq.seq_id]
        rows = state.rows
        assert len(rows) >= len(PROMPTS[0]) // 2 and rows == seq.token_ids[: len(rows)]
        # Fresh: the target's features of the committed tokens, then the head over rows 0..len(rows)-1.
        cache = tiny_model.make_cache(1, 256)
        cache.reserve(256)
        slot = cache.allocate()
        out = tiny_model.forward_with_hidden(ForwardBatch.build([rows], [slot], [0], [[len(rows) - 1]]), cache,
                                             hidden_layers=(-1,))
        assert out.hidden_states is not None
        previous = torch.cat([out.hidden_states.new_zeros(1, out.hidden_states.shape[1]), out.hidden_states[:-1]])
        head_cache = proposer.head.make_cache(1, 256)
        head_cache.reserve(256)
        head_cache.allocate()
        proposer.head(ForwardBatch.build([rows], [0], [0], [[len(rows) - 1]]), head_cache, previous)
        n = len(rows)
        torch.testing.assert_close(proposer.cache.keys[0][state.slot, :, :n], head_cache.keys[0][0, :, :n])
        torch.testing.assert_close(proposer.cache.values[0][state.slot, :, :n], head_cache.values[0][0, :, :n])


def test_no_features_no_draft_and_probabilities_only_on_the_draft_vocabulary(tiny_model) -> None:
    proposer = EagleProposer(random_draft_head(tiny_model, draft_vocab_size=40), 2, 64)
    params = SamplingParams(temperature=0.7)
    view = SequenceView(seq_id=0, token_ids=[5, 6, 7, 8], params=params, generator=torch.Generator().manual_seed(0))
    assert proposer.propose([view], [3]).draft_token_ids == [[]]  # the target's features never came
    cache = tiny_model.make_cache(1, 64)
    cache.reserve(64)
    slot = cache.allocate()
    out = tiny_model.forward_with_hidden(ForwardBatch.build([[5, 6, 7]], [slot], [0], [[2]]), cache,
                                         hidden_layers=(-1,))
    assert out.hidden_states is not None
    proposer.observe([0], [0], [out.hidden_states])
    proposal = proposer.propose([view], [3])
    assert len(proposal.draft_token_ids[0]) == 3
    in_map = set(proposer.head.token_map.tolist())
    assert set(proposal.draft_token_ids[0]) <= in_map
    assert proposal.draft_probs is not None
    off_map = [t for t in range(tiny_model.config.vocab_size) if t not in in_map]
    assert float(proposal.draft_probs[:, off_map].abs().sum()) == 0.0
    torch.testing.assert_close(proposal.draft_probs.sum(-1), torch.ones(3), atol=1e-6, rtol=0)
    proposer.release(0)
    assert proposer.cache.num_used_slots == 0


def test_build_eagle_finds_no_head_for_a_tiny_model_and_refuses_a_foreign_one(tmp_path, tiny_model) -> None:
    config = EngineConfig(speculation=SpeculationConfig(method="eagle"), max_model_len=64)
    with pytest.raises(ModelLoadError, match=r"speculation\.draft_model: no draft head is shipped"):
        build_eagle(config, tiny_model, None)
    other = tiny_specd_model(tiny_hf_config_dict(), seed=3, dtype=torch.float32)
    DraftHead.initialise(other, torch.arange(16), "other").save(tmp_path / "h")
    config = EngineConfig(speculation=SpeculationConfig(method="eagle", draft_model=str(tmp_path / "h")),
                          max_model_len=64)
    with pytest.raises(ModelLoadError, match="trained for target 'other'"):
        build_eagle(config, tiny_model, None)
    proposer = build_eagle(config, other, None)
    assert proposer.head.config.draft_vocab_size == 16
