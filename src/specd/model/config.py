"""Architecture description of a Llama-family model, built from an HF config.json dict or GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specd.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. kind is "default", "linear" or "llama3"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"rope_scaling.rope_type: unsupported RoPE scaling {self.kind!r}")
        if self.factor <= 0:
            raise ModelLoadError("rope_scaling.factor: must be > 0")


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """Everything the forward pass needs to know about a Llama-family checkpoint.

    qkv_bias: Qwen2-style biases on q/k/v projections. qk_norm: Qwen3-style RMSNorm on q and k per head.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ModelLoadError(f"head_dim: must be even for RoPE, got {self.head_dim}")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token per element byte (multiply by the dtype's element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> ModelArchConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
        model_type = str(cfg.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model_type: {model_type!r} is not a supported Llama-family architecture "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        scaling_dict = cfg.get("rope_scaling") or rope_params or {}
        kind = str(scaling_dict.get("rope_type") or scaling_dict.get("type") or "default")
        if kind == "default" or not scaling_dict:
            scaling = RopeScaling()
        else:
            scaling = RopeScaling(
                kind=kind,
                factor=float(scaling_dict.get("factor", 1.0)),
                low_freq_factor=float(scaling_dict.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling_dict.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    scaling_dict.get("original_max_position_embeddings", 8192)
                ),
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return ModelArchConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @staticmethod
    def from_gguf_metadata(
        metadata: Mapping[str, Any],
        *,
        tie_word_embeddings: bool,
        qkv_bias: bool = False,
        qk_norm: bool = False,
    ) -> ModelArchConfig:
        """Build from GGUF metadata (llama.cpp key names, `{arch}.block_count` etc.).

        Facts that GGUF states only through which tensors exist (a tied head, q/k/v biases, q/k norms) are
        passed by the loader, which has the tensor table.
        """
        arch = str(metadata.get("general.architecture", ""))
        if arch not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"general.architecture: {arch!r} is not a supported Llama-family architecture "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )

        def field(key: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"{arch}.{key}: missing from the GGUF metadata")
            return value

        hidden = int(field("embedding_length"))
        num_heads = int(field("attention.head_count"))
        head_dim = int(field("attention.key_length", hidden // num_heads))
        rotary_dim = int(field("rope.dimension_count", head_dim))
        if rotary_dim != head_dim:
            raise ModelLoadError(
                f"{arch}.rope.dimension_count: partial rotary ({rotary_dim} of head_dim {head_dim}) "
                "is not supported"
            )
        scaling_kind = str(field("rope.scaling.type", "none"))
        if scaling_kind == "none":
            scaling = RopeScaling()
        elif scaling_kind == "linear":
            scaling = RopeScaling(kind="linear", factor=float(field("rope.scaling.factor")))
        else:
            raise ModelLoadError(f"{arch}.rope.scaling.type: unsupported RoPE scaling {scaling_kind!r}")
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens) if isinstance(tokens, list) else int(field("vocab_size"))
        # llama.cpp keeps several end-of-generation ids; a chat model may emit any of them.
        eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        eos_ids = tuple(dict.fromkeys(int(metadata[f"tokenizer.ggml.{k}"]) for k in eos_keys
                                      if f"tokenizer.ggml.{k}" in metadata))
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        return ModelArchConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(field("feed_forward_length")),
            num_layers=int(field("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(field("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(field("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(field("context_length", 2048)),
            tie_word_embeddings=tie_word_embeddings,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            model_type=arch,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )
