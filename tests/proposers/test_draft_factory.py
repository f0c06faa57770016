"""`--spec draft --draft-model PATH` through the factory: a real checkpoint directory, vocabulary checks."""

import pytest
import transformers

from specd.config import SpeculationConfig
from specd.errors import ModelLoadError
from specd.llm import LLM
from specd.sampling.params import SamplingParams
from specd.testing import byte_tokenizer, tiny_hf_config_dict, tiny_hf_model


def _save(directory, seed, vocab_size=320):
    tiny_hf_model(tiny_hf_config_dict(vocab_size=vocab_size), seed=seed).save_pretrained(directory)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(320).backend, eos_token="</s>")
    tok.chat_template = byte_tokenizer(320).chat_template
    tok.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    return {
        "target": _save(base / "target", seed=0),
        "draft": _save(base / "draft", seed=7),
        "other_vocab": _save(base / "other", seed=7, vocab_size=352),
    }


def test_draft_model_from_path_is_lossless(dirs):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["hello hello hello", "abcdef", "the quick brown fox"]
    plain = LLM(dirs["target"], dtype="float64", max_model_len=128).generate(prompts, params)
    spec_llm = LLM(dirs["target"], dtype="float64", max_model_len=128,
                   speculation=SpeculationConfig(method="draft", draft_model=dirs["draft"], num_speculative_tokens=3))
    spec = spec_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    counters = spec_llm.get_metrics()["counters"]
    assert counters["drafts"] > 0 and counters["draft_tokens"] > 0


def test_draft_model_with_another_vocabulary_is_refused(dirs):
    with pytest.raises(ModelLoadError, match="vocabulary"):
        LLM(dirs["target"], dtype="float64", max_model_len=128,
            speculation=SpeculationConfig(method="draft", draft_model=dirs["other_vocab"]))


def test_layerskip_needs_fewer_layers_than_the_target(dirs):
    from specd.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError) as e:
        LLM(dirs["target"], max_model_len=128, speculation=SpeculationConfig(method="layerskip", draft_layers=2))
    assert e.value.field == "speculation.draft_layers"
