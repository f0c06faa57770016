import pytest
import torch

from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.model.tokenizer import Tokenizer
from specd.testing import tiny_hf_config_dict, tiny_specd_model


@pytest.fixture(scope="session")
def tiny_model():
    # float64 so near-ties cannot flip between batched and unbatched runs.
    return tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float64)


@pytest.fixture(scope="session")
def tokenizer():
    return Tokenizer.for_tests(320)


@pytest.fixture
def make_llm(tiny_model, tokenizer):
    def make(spec: SpeculationConfig | None = None, model=None, proposer=None, **kw) -> LLM:
        cfg = EngineConfig(speculation=spec or SpeculationConfig(), max_model_len=kw.pop("max_model_len", 256), **kw)
        return LLM.from_model(model or tiny_model, tokenizer, cfg, proposer=proposer)

    return make
