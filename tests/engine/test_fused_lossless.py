"""Greedy speculation stays token-identical to plain decoding in the int4 mode with specd's fused layer ops on:
every op computes a row from its own inputs alone, and attention reads each query row's own keys, unpadded."""

import pytest
import torch

import specd.kernels.fused as fused_kernels
from specd.config import SpeculationConfig
from specd.model.config import ModelArchConfig
from specd.model.llama import build_model
from specd.sampling.params import SamplingParams
from specd.speculation.draft import DraftModelProposer
from specd.testing import hf_state_dict, tiny_hf_config_dict, tiny_specd_model

PROMPTS = ["hello world, hello world, hello", "abcabcabcabc", "the quick brown fox jumps over the lazy dog. the quick",
           "Zebra", "x = 1; y = 2; x = 1; y ="]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def int4_model():
    if fused_kernels.fused_ops() is None:
        pytest.skip("specd's fused ops did not build here, or SPECD_NATIVE_KERNELS=0")
    cfg = tiny_hf_config_dict()
    source = tiny_specd_model(cfg, seed=0, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in hf_state_dict(source).items()}
    return build_model(ModelArchConfig.from_hf_dict(cfg), state, torch.bfloat16, int4=True)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("method", ["ngram", "layerskip", "draft"])
def test_int4_greedy_speculation_with_fused_ops_equals_plain_decoding(make_llm, int4_model, method, k):
    plain_llm = make_llm(model=int4_model, max_num_seqs=4)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS, GREEDY)]
    proposer = DraftModelProposer(int4_model, 8, 256) if method == "draft" else None  # itself: long drafts
    spec = SpeculationConfig(method="layerskip" if method == "draft" else method, num_speculative_tokens=k,
                             k_policy="fixed", draft_layers=1)
    llm = make_llm(spec, model=int4_model, proposer=proposer, max_num_seqs=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert llm.get_metrics()["counters"]["drafts"] > 0


@pytest.mark.parametrize("budget", [8, 512])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_dense_prompt_rows_keep_greedy_speculation_token_identical(make_llm, int4_model, method, budget):
    # Prompt rows through the dense bfloat16 copies (as on AMX CPUs by default): with a budget of 8 tokens the
    # prompts are chunked, and differently with speculation on (verification rows take part of each step), and the
    # fifth prompt is prefilled beside whichever sequences are then decoding. A prompt row's result must not change.
    was = int4_model.dense_prompt_rows
    assert int4_model.set_dense_prompt_rows(True)
    try:
        plain_llm = make_llm(model=int4_model, max_num_seqs=4, max_num_batched_tokens=budget)
        plain = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS, GREEDY)]
        proposer = DraftModelProposer(int4_model, 8, 256) if method == "draft" else None
        spec = SpeculationConfig(method="layerskip" if method == "draft" else method, num_speculative_tokens=4,
                                 k_policy="fixed", draft_layers=1)
        llm = make_llm(spec, model=int4_model, proposer=proposer, max_num_seqs=4, max_num_batched_tokens=budget)
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        int4_model.set_dense_prompt_rows(was)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert llm.get_metrics()["counters"]["drafts"] > 0
