"""Build the configured proposer. The engine receives a `Proposer` and never looks at its name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specd.config import EngineConfig
from specd.errors import InvalidParameterError, ModelLoadError
from specd.model.llama import LlamaForCausalLM, build_model
from specd.model.tokenizer import Tokenizer
from specd.speculation.draft import DraftModelProposer
from specd.speculation.ngram import NgramConfig, NgramProposer
from specd.speculation.proposer import Proposer

ProposerBuilder = Callable[[EngineConfig, LlamaForCausalLM, "Tokenizer | None"], Proposer]


def _confidence(config: EngineConfig) -> float | None:
    spec = config.speculation
    return spec.confidence_threshold if spec.k_policy == "confidence" else None


def _ngram(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Tokenizer | None) -> Proposer:
    spec = config.speculation
    return NgramProposer(NgramConfig(min_match=spec.ngram_min_match, max_match=spec.ngram_max_match))


def _layerskip(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Tokenizer | None) -> Proposer:
    n = config.speculation.draft_layers
    total = target.config.num_layers
    if n is None:
        n = max(1, total // 4)
    if n >= total:
        raise InvalidParameterError("speculation.draft_layers", f"must be < the target's {total} layers")
    return DraftModelProposer(
        target, config.max_num_seqs, config.max_model_len, num_layers=n,
        confidence_threshold=_confidence(config),
    )


def _draft(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Tokenizer | None) -> Proposer:
    from specd.model.loader import load_checkpoint

    path = config.speculation.draft_model or ""
    ckpt = load_checkpoint(path, torch.float32 if config.int4_weights else config.torch_dtype)
    check_same_vocabulary(target, tokenizer, ckpt.config.vocab_size, ckpt.tokenizer)
    draft = build_model(
        ckpt.config, ckpt.state_dict, config.torch_dtype, max_positions=config.max_model_len,
        int4=config.int4_weights,
    )
    return DraftModelProposer(
        draft, config.max_num_seqs, config.max_model_len, confidence_threshold=_confidence(config)
    )


def check_same_vocabulary(
    target: LlamaForCausalLM, tokenizer: Tokenizer | None, draft_vocab_size: int, draft_tokenizer: Tokenizer | None
) -> None:
    """A draft model must share the target's vocabulary, or its token ids mean something else."""
    if draft_vocab_size != target.config.vocab_size:
        raise ModelLoadError(
            f"speculation.draft_model: vocabulary size {draft_vocab_size} differs from the target's "
            f"{target.config.vocab_size}; a draft model must share the target's tokenizer"
        )
    if tokenizer is not None and draft_tokenizer is not None:
        probe = "Hello, world! def f(x): return x ** 2  # ünïcødé 1234"
        if tokenizer.encode(probe, add_special_tokens=False) != draft_tokenizer.encode(probe, add_special_tokens=False):
            raise ModelLoadError("speculation.draft_model: its tokenizer encodes text differently from the target's")


PROPOSERS: dict[str, ProposerBuilder] = {"ngram": _ngram, "layerskip": _layerskip, "draft": _draft}


def make_proposer(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Tokenizer | None) -> Proposer | None:
    method = config.speculation.method
    if method == "off":
        return None
    return PROPOSERS[method](config, target, tokenizer)
