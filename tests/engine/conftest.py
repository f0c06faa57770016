import pytest

from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM


@pytest.fixture
def make_llm(tiny_model, tokenizer):
    def make(spec: SpeculationConfig | None = None, model=None, proposer=None, **kw) -> LLM:
        cfg = EngineConfig(speculation=spec or SpeculationConfig(), max_model_len=kw.pop("max_model_len", 256), **kw)
        return LLM.from_model(model or tiny_model, tokenizer, cfg, proposer=proposer)

    return make
