"""specd: a speculative-decoding LLM inference engine that tells the truth about speculation."""

from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.sampling.params import SamplingParams, SpecOverride, StructuredOutput

__all__ = ["LLM", "EngineConfig", "SamplingParams", "SpecOverride", "SpeculationConfig", "StructuredOutput"]
