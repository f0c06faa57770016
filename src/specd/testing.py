"""Tiny random-weight Llama-family models built in-process, for tests and examples (no download)."""

from __future__ import annotations

from typing import Any

import torch

from specd.model.config import ModelArchConfig
from specd.model.llama import LlamaForCausalLM, build_model


def tiny_hf_config_dict(model_type: str = "llama", vocab_size: int = 320, **overrides: Any) -> dict[str, Any]:
    """A small HF-style config.json dict: 2 layers, hidden 64, 4 heads / 2 KV heads."""
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": model_type != "qwen2",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if model_type == "qwen2":
        cfg["attention_bias"] = True
    cfg.update(overrides)
    return cfg


def tiny_hf_model(cfg: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers reference model with random weights (weights scaled up so logits are not flat)."""
    import transformers

    cls_name = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                "mistral": "MistralConfig"}[cfg["model_type"]]
    config_cls = getattr(transformers, cls_name)
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    hf_config = config_cls(**fields)
    # sdpa, not eager: eager softmaxes in float32 even for float64 models.
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            else:
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


def tiny_specd_model(
    cfg: dict[str, Any] | None = None, seed: int = 0, dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """Our model loaded with exactly the weights of `tiny_hf_model(cfg, seed)`."""
    cfg = cfg or tiny_hf_config_dict()
    hf = tiny_hf_model(cfg, seed, torch.float32)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return build_model(ModelArchConfig.from_hf_dict(cfg), sd, dtype)
