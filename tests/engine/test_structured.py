"""Structured outputs in the engine: constrained output parses and obeys its schema, and speculation keeps it
token-identical to plain constrained decoding for every proposer."""

from __future__ import annotations

import json

import pytest
import torch

from specd.config import SpeculationConfig
from specd.errors import InvalidParameterError
from specd.sampling.params import SamplingParams, StructuredOutput
from specd.speculation.draft import DraftModelProposer
from specd.speculation.eagle import EagleProposer
from specd.speculation.hybrid import HybridProposer
from specd.speculation.ngram import NgramConfig, NgramProposer
from specd.testing import random_draft_head, tiny_hf_config_dict, tiny_specd_model

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"enum": ["red", "green", "blue"]},
                   "ok": {"type": "boolean"}},
    "required": ["id", "tag", "ok"], "additionalProperties": False,
}
PROMPTS = ["hello world, hello world", '{"id": 12, "tag": "red", "ok": true} {"id": 1', "Zebra", "x = 1; y = 2;"]


def _params(**kw) -> SamplingParams:
    kw.setdefault("structured", StructuredOutput("json_schema", SCHEMA))
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=60, **kw)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_specd_model(tiny_hf_config_dict(), seed=7, dtype=torch.float64)


def _texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


def test_constrained_output_parses_and_obeys_the_schema(make_llm):
    outs = make_llm().generate(PROMPTS, _params())
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"id", "tag", "ok"} and 0 <= value["id"] <= 999 and value["tag"] in SCHEMA[
            "properties"]["tag"]["enum"] and isinstance(value["ok"], bool)
    # The same model unconstrained writes something else entirely.
    free = make_llm().generate(PROMPTS, SamplingParams(max_tokens=60, temperature=0.0))
    assert _texts(free) != _texts(outs)


@pytest.mark.parametrize("method", ["ngram", "layerskip", "draft", "eagle", "hybrid"])
def test_speculation_is_token_identical_to_plain_constrained_decoding(make_llm, draft_model, tiny_model, method):
    plain = make_llm().generate(PROMPTS, _params())
    proposer = None
    if method == "draft":
        proposer = DraftModelProposer(draft_model, 8, 256)
    elif method in ("eagle", "hybrid"):
        proposer = EagleProposer(random_draft_head(tiny_model, 200), 8, 256)
        if method == "hybrid":
            proposer = HybridProposer(NgramProposer(NgramConfig(1, 4)), proposer, tiny_model.config.vocab_size, 2)
    spec = SpeculationConfig(method=method if proposer is None else "layerskip", num_speculative_tokens=4,
                             draft_layers=1)
    llm = make_llm(spec, proposer=proposer, max_num_seqs=4)
    outs = llm.generate(PROMPTS, _params())
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["counters"]["drafts"] > 0


def test_sampled_constrained_output_is_always_valid_with_a_model_draft(make_llm, draft_model):
    llm = make_llm(SpeculationConfig(method="layerskip", num_speculative_tokens=4, draft_layers=1),
                   proposer=DraftModelProposer(draft_model, 8, 256), max_num_seqs=4)
    params = [_params(temperature=1.0, seed=seed) for seed in range(12)]
    outs = llm.generate(["hello"] * 12, params)
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            assert set(json.loads(out.outputs[0].text)) == {"id", "tag", "ok"}
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 6
    assert llm.get_metrics()["counters"]["draft_tokens"] > 0


def test_other_constraints(make_llm):
    llm = make_llm()
    choice = llm.generate(PROMPTS, _params(structured=StructuredOutput("choice", ["yes", "no", "maybe"])))
    assert all(o.outputs[0].text in ("yes", "no", "maybe") for o in choice)
    digits = llm.generate(PROMPTS, _params(structured=StructuredOutput("regex", r"[0-9]{2,4}-[a-c]")))
    assert all(len(o.outputs[0].text.split("-")[0]) in (2, 3, 4) for o in digits)
    anything = llm.generate(PROMPTS[:2], _params(structured=StructuredOutput("json_object")))
    assert all(isinstance(json.loads(o.outputs[0].text), dict) for o in anything
               if o.outputs[0].finish_reason == "stop")


def test_bad_constraints_name_the_field(make_llm):
    llm = make_llm()
    with pytest.raises(InvalidParameterError) as info:
        llm.generate(["hi"], _params(structured=StructuredOutput("json_schema", {"type": "nope"}, field="rf.schema")))
    assert info.value.field == "rf.schema"
    with pytest.raises(InvalidParameterError) as info:
        StructuredOutput("yaml", "a: b")
    assert info.value.field == "structured_output"
    with pytest.raises(InvalidParameterError) as info:
        _params(ignore_eos=True)
    assert info.value.field == "ignore_eos"


def test_drafts_the_grammar_cuts_are_counted_as_proposed_and_cut(make_llm):
    """The n-gram proposer copies the prompt's JSON, which the schema partly forbids: what cut_drafts removes
    before verification is counted (cut_grammar_tokens, and k = 0 steps with cause "grammar"), and proposed =
    verified + cut by the policy + cut by the grammar."""
    spec = SpeculationConfig(method="ngram", num_speculative_tokens=4)
    llm = make_llm(spec, max_num_seqs=4)
    prompts = ['{"id": 12, "tag": "red", "ok": true, "x": 1} {"id": 12, "tag": "red", "ok": true, "x": 1} {"id": 12']
    llm.generate(prompts * 2, _params())
    c = llm.get_metrics()["counters"]
    assert c["cut_grammar_tokens"] > 0
    assert c["proposed_tokens"] == c["draft_tokens"] + c["cut_policy_tokens"] + c["cut_grammar_tokens"]
    assert sum(c["nonspec_by_cause"].values()) == c["nonspec_seq_steps"]
    assert c["nonspec_by_cause"]["first_token"] == 2
