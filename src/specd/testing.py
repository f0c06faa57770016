"""Helpers for tests and examples, kept out of the modules users run: tiny random-weight Llama-family models
built in-process (no download), an offline byte tokenizer, the inverse of the weight loader and of the metrics
log line, and seeded generators."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from specd.config import EngineConfig
from specd.engine.outputs import RequestDelta
from specd.errors import InvalidParameterError
from specd.metrics.log_sink import NOT_AVAILABLE, PREFIX
from specd.metrics.records import K0_CAUSES
from specd.model.config import ModelArchConfig
from specd.model.llama import LlamaForCausalLM, build_model
from specd.model.tokenizer import Tokenizer, byte_level_alphabet

_NUM_SPECIAL_TEST_TOKENS = 3  # byte_tokenizer: <pad>, <bos>, <eos>
_TEST_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_LOG_FIELD = re.compile(r"(\w+)=(\[[^\]]*\]|\S+)")
# Log-line keys whose values are integer counters (or lists of them); everything else parses as float / None.
_LOG_INT_KEYS = frozenset({
    "steps", "spec_steps", "drafts", "draft_tokens", "accepted", "emitted", "nonspec_seq_steps", "nonspec_tokens",
    "drafted_at", "reached_at", "accepted_at", "accepted_len_hist", "finished_requests",
    "prefill_steps", "prefill_only_steps", "prefill_tokens", "proposed", "cut_policy", "cut_grammar",
    *(f"k0_{cause}" for cause in K0_CAUSES),
})

if TYPE_CHECKING:
    from specd.llm import LLM
    from specd.metrics.stats import StatsSink
    from specd.model.draft_head import DraftHead


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


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The inverse of `load_hf_state_dict`: the fused weights under HF names (views, or dense copies once packed)."""
    c = model.config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.hf_weight
    for i, layer in enumerate(model.layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        for n, w in zip("qkv", layer.qkv_proj.hf_weight.split([q_size, kv_size, kv_size])):
            out[a + f"{n}_proj.weight"] = w
        if layer.qkv_proj.bias is not None:
            for n, b in zip("qkv", layer.qkv_proj.bias.split([q_size, kv_size, kv_size])):
                out[a + f"{n}_proj.bias"] = b
        out[a + "o_proj.weight"] = layer.o_proj.hf_weight
        if layer.q_norm is not None and layer.k_norm is not None:
            out[a + "q_norm.weight"] = layer.q_norm.weight
            out[a + "k_norm.weight"] = layer.k_norm.weight
        gate, up = layer.gate_up_proj.hf_weight.chunk(2, 0)
        out[p + "mlp.gate_proj.weight"] = gate
        out[p + "mlp.up_proj.weight"] = up
        out[p + "mlp.down_proj.weight"] = layer.down_proj.hf_weight
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    return out


def lm_head_weight(model: LlamaForCausalLM) -> torch.Tensor:  # [vocab_size, hidden_size]
    """The LM head's dense weight (the embedding table when tied; a dense copy when the head is packed)."""
    return model.embed_tokens.weight if model.lm_head is None else model.lm_head.hf_weight


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """Offline byte tokenizer: 0 <pad>, 1 <bos> (added by encode), 2 <eos>, 3..258 the bytes 0..255,
    259.. '<tok{id}>' (so random-weight models can emit every id). Needs no files."""
    num_byte_ids = _NUM_SPECIAL_TEST_TOKENS + 256
    if vocab_size < num_byte_ids:
        raise InvalidParameterError("vocab_size", f"must be >= {num_byte_ids} for the byte tokenizer")
    specials = ["<pad>", "<bos>", "<eos>"]
    alphabet = byte_level_alphabet()
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({alphabet[byte]: _NUM_SPECIAL_TEST_TOKENS + byte for byte in range(256)})
    extra = [f"<tok{i}>" for i in range(num_byte_ids, vocab_size)]
    vocab.update({token: num_byte_ids + i for i, token in enumerate(extra)})
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    # One pre-token per text and no merges: every byte becomes exactly its own id.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B:1", special_tokens=[("<bos>", 1)]
    )
    return Tokenizer(
        backend,
        eos_token_ids=(2,),
        bos_token_id=1,
        chat_template=_TEST_CHAT_TEMPLATE,
        special_tokens={"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"},
    )


def _parse_log_scalar(key: str, text: str) -> int | float | None:
    if text == NOT_AVAILABLE:
        return None
    return int(text) if key in _LOG_INT_KEYS else float(text)


def parse_log_line(line: str) -> dict[str, Any]:
    """Inverse of `metrics.log_sink.format_log_line`: {key: int | float | None | list}. Raises ValueError on a
    foreign line."""
    start = line.find(PREFIX)
    if start < 0:
        raise ValueError(f"not a speculation metrics line (no {PREFIX.strip()!r}): {line!r}")
    parsed: dict[str, Any] = {}
    for key, text in _LOG_FIELD.findall(line[start + len(PREFIX) :]):
        if text.startswith("["):
            items = text[1:-1].split(",") if len(text) > 2 else []
            parsed[key] = [_parse_log_scalar(key, item) for item in items]
        else:
            parsed[key] = _parse_log_scalar(key, text)
    return parsed


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator seeded with `seed` on `device`, or None (torch's default RNG) for unseeded requests.

    Accepts the full signed 64-bit range SamplingParams allows; torch maps negative seeds to unsigned.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def generators_per_row(
    generators: Sequence[torch.Generator | None], rows_per_seq: Sequence[int]
) -> list[torch.Generator | None]:
    """Repeat each sequence's generator for its rows, matching `build_sampling_batch`'s row layout."""
    if len(generators) != len(rows_per_seq):
        raise ValueError(f"got {len(generators)} generators for {len(rows_per_seq)} sequences")
    return [generator for generator, num_rows in zip(generators, rows_per_seq) for _ in range(num_rows)]


def tiny_llm(config: EngineConfig, stats_sinks: Sequence[StatsSink] = (), step_delay_s: float = 0.0) -> LLM:
    """An LLM over the float64 tiny model (seed 0) and the byte test tokenizer: the same weights in every process,
    so replicas built from it (specd.cluster's llm_factory) generate what an in-process one does.
    `config.model` is not read. `step_delay_s` sleeps before every engine step, so a request is still running
    when a test acts on it."""
    from specd.llm import LLM

    llm = LLM.from_model(tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float64),
                         byte_tokenizer(320), config, stats_sinks=stats_sinks)
    if step_delay_s > 0:
        step = llm.step

        def slow_step() -> list[RequestDelta]:
            time.sleep(step_delay_s)
            return step()

        llm.step = slow_step  # type: ignore[method-assign]
    return llm


def random_draft_head(target: LlamaForCausalLM, draft_vocab_size: int | None = None, seed: int = 0) -> DraftHead:
    """An untrained draft head for `target`, ready for inference: the target's last layer with noise added, over a
    random draft vocabulary (all tokens by default). It agrees with the target sometimes, not always."""
    from specd.model.draft_head import DraftHead

    vocab = target.config.vocab_size
    token_map = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: draft_vocab_size or vocab]
    head = DraftHead.initialise(target, token_map, "tiny", seed=seed)
    with torch.no_grad():
        noise = torch.Generator().manual_seed(seed + 1)
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=noise) * 0.02)
    return head.for_inference(target.dtype)


class CountingModel:
    """Test helper: wraps a draft model; counts forward calls and the rows of logits they returned (one per drafting
    sequence)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls = 0
        self.rows = 0

    def make_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.make_cache(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = self.model(*args, **kwargs)  # [num_active, vocab_size]
        self.calls += 1
        self.rows += logits.shape[0]
        return logits


class _LineCapture(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self._lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self._lines.append(record.getMessage())


@contextmanager
def capture_specd_log() -> Iterator[list[str]]:
    """Test helper: collects the messages the "specd" logger emits at INFO and above while the block runs (caplog
    is function-scoped; module-scoped fixtures need this), and restores the logger's level afterwards."""
    lines: list[str] = []
    handler = _LineCapture(lines)
    logger = logging.getLogger("specd")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
