"""GGUF files as users bring them: every block type's weights equal gguf's own dequantization, the quantized mode
computes the file's values (and says when it cannot), a load's memory stays within its bound, a model that does not
fit is refused before loading, and a broken file is one clear line."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import specd.kernels
from specd import cli
from specd.errors import ModelLoadError
from specd.kernels.blockquant import Q4Weight, Q8Weight
from specd.llm import LLM
from specd.model import memory
from specd.model.gguf_blocks import block_weight, decode_rows
from specd.sampling.params import SamplingParams
from specd.synthetic import LlamaShape, random_blocks, write_gguf

T = gguf.GGMLQuantizationType
# K-quants need rows of 256 inputs; two layers, so the llama.cpp-style type mixes below vary by layer.
TINY = LlamaShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512, tied=False)
KERNEL_LAYOUTS = {  # type -> (kernel weight, scale dtype)
    T.Q4_0: (Q4Weight, torch.float16), T.Q4_1: (Q4Weight, torch.float16), T.Q8_0: (Q8Weight, torch.float16),
    T.Q4_K: (Q4Weight, torch.uint8), T.Q6_K: (Q8Weight, torch.uint8),  # K-quants: their own compact scales
}


@pytest.fixture(scope="module")
def native():
    module = specd.kernels.native()
    if module is None:
        pytest.skip("specd's native kernels did not build here (see the warning)")
    return module


def _blocks(ggml_type: T, shape: tuple[int, int], seed: int = 0) -> np.ndarray:  # [out, bytes per row] uint8
    rng = np.random.default_rng(seed)
    try:
        return gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32), ggml_type)
    except NotImplementedError:  # gguf cannot quantize K-quants: random blocks with sane scales are valid ones
        return random_blocks(rng, ggml_type, shape)


@pytest.mark.parametrize("ggml_type", list(KERNEL_LAYOUTS), ids=lambda t: t.name)
def test_each_block_type_decodes_to_ggufs_own_dequantization_exactly(ggml_type):
    raw = _blocks(ggml_type, (12, 512))
    weight = block_weight(torch.from_numpy(raw.copy()).flatten(), ggml_type, (12, 512))
    kind, scale_dtype = KERNEL_LAYOUTS[ggml_type]
    assert isinstance(weight, kind) and weight.scales.dtype == scale_dtype
    expected = gguf.quants.dequantize(raw, ggml_type).astype(np.float32)
    assert np.array_equal(weight.dequantize().numpy(), expected)


def test_a_large_tensor_is_decoded_in_chunks_into_the_same_weight(monkeypatch):
    import specd.model.gguf_blocks as blocks_module

    rows = torch.from_numpy(_blocks(T.Q6_K, (40, 512)).copy())
    whole = decode_rows(rows, T.Q6_K, 512)
    monkeypatch.setattr(blocks_module, "_CHUNK_VALUES", 512 * 7)  # 7 rows at a time, the last chunk 5
    chunked = decode_rows(rows, T.Q6_K, 512)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("ggml_type", list(KERNEL_LAYOUTS), ids=lambda t: t.name)
@pytest.mark.parametrize("isa", ["native", "scalar"])
def test_the_native_repack_writes_the_torch_decoders_bytes(native, ggml_type, isa):
    """gguf_repack.cpp against the torch decoders, field for field: every type, rows whose last group has two or
    one block (32-block types at 352 inputs), and a row order (the q/k projections' rotary permutation)."""
    module = native if isa == "native" else specd.kernels.build("scalar")
    widths = (512, 768) if ggml_type in (T.Q4_K, T.Q6_K) else (352, 96, 512)
    for in_features in widths:
        raw = torch.from_numpy(_blocks(ggml_type, (37, in_features), seed=in_features).copy())
        expected = decode_rows(raw, ggml_type, in_features)
        got = module.repack_gguf(raw, int(ggml_type), in_features, torch.empty(0, dtype=torch.long))
        assert len(got) == len(expected)
        for field, want in zip(got, expected):
            assert field.dtype == want.dtype and torch.equal(field, want), (ggml_type.name, in_features)
        order = torch.randperm(37, generator=torch.Generator().manual_seed(1))
        permuted = module.repack_gguf(raw, int(ggml_type), in_features, order)
        assert all(torch.equal(field, want[order]) for field, want in zip(permuted, expected))
    kind = Q8Weight if ggml_type in (T.Q8_0, T.Q6_K) else Q4Weight
    assert isinstance(block_weight(raw.flatten(), ggml_type, (37, in_features)), kind)


@pytest.mark.parametrize("ggml_type", list(KERNEL_LAYOUTS), ids=lambda t: t.name)
@pytest.mark.parametrize("isa", ["native", "scalar"])
def test_the_native_dequantization_gives_ggufs_values(native, ggml_type, isa):
    """dequantize_gguf (the embedding table's load) against gguf's own dequantization, float32 bit for bit, and
    bfloat16 as those values rounded once."""
    module = native if isa == "native" else specd.kernels.build("scalar")
    in_features = 512 if ggml_type in (T.Q4_K, T.Q6_K) else 352
    raw = _blocks(ggml_type, (21, in_features), seed=5)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, ggml_type).astype(np.float32))
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(21, in_features, dtype=dtype)
        module.dequantize_gguf(torch.from_numpy(raw.copy()), int(ggml_type), in_features, out)
        assert torch.equal(out, expected.to(dtype)), dtype
    with pytest.raises(RuntimeError, match="out must be contiguous float32 or bfloat16"):
        module.dequantize_gguf(torch.from_numpy(raw.copy()), int(ggml_type), in_features, torch.empty(21, 8))


def test_the_native_repack_names_what_is_wrong(native):
    raw = torch.from_numpy(_blocks(T.Q4_K, (4, 256)).copy())
    none = torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="no kernel layout"):
        native.repack_gguf(raw, int(T.Q5_K), 256, none)
    with pytest.raises(RuntimeError, match="not a multiple of the type's 256 inputs"):
        native.repack_gguf(raw, int(T.Q4_K), 224, none)
    with pytest.raises(RuntimeError, match="bytes, got"):
        native.repack_gguf(raw, int(T.Q6_K), 256, none)
    with pytest.raises(RuntimeError, match="outside the tensor's 4 rows"):
        native.repack_gguf(raw, int(T.Q4_K), 256, torch.tensor([0, 4]))


def test_types_without_a_kernel_give_no_block_weight():
    for ggml_type in (T.Q5_K, T.F16, T.Q5_0):
        assert block_weight(torch.zeros(10, dtype=torch.uint8), ggml_type, (2, 256)) is None


def _dequantized(linear) -> torch.Tensor:  # the values a quantized projection computes with, float32
    if linear.parts:
        return torch.cat([part.dequantize() for part in linear.parts])
    return (linear.q4 if linear.q4 is not None else linear.q8).dequantize()


def _llama_cpp_mix(name: str) -> T:
    """Q4_K_M's pattern: Q6_K for the LM head and for v and down in some layers, Q4_K elsewhere."""
    if name == "output.weight" or (name.startswith("blk.1.") and name.split(".")[2] in ("attn_v", "ffn_down")):
        return T.Q6_K
    return T.Q4_K


@pytest.mark.parametrize("file_type", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, "Q4_K_M"],
                         ids=lambda t: getattr(t, "name", t))
def test_the_quantized_mode_computes_the_files_values(native, tmp_path, caplog, file_type):
    path = write_gguf(tmp_path / "tiny.gguf", TINY, _llama_cpp_mix if file_type == "Q4_K_M" else file_type)
    with caplog.at_level(logging.WARNING, logger="specd"):
        quantized = LLM(str(path), max_model_len=64, max_num_seqs=1)
    assert not [r for r in caplog.records if "values change" in r.getMessage()]  # nothing converted
    reference = LLM(str(path), max_model_len=64, max_num_seqs=1, dtype="float32")  # the file's values, exactly
    for layer, ref_layer in zip(quantized.model.layers, reference.model.layers):
        for linear, ref in zip(layer.projections, ref_layer.projections):
            assert torch.equal(_dequantized(linear), ref.hf_weight.float())
    assert torch.equal(_dequantized(quantized.model.lm_head), reference.model.lm_head.hf_weight.float())
    assert quantized.model.lm_head.float_out
    # the embedding table: the file's values rounded once to bfloat16 (read_into, the native dequantization)
    assert torch.equal(quantized.model.embed_tokens.weight, reference.model.embed_tokens.weight.to(torch.bfloat16))
    if file_type == "Q4_K_M":  # layer 1's qkv mixes Q4_K (q, k) and Q6_K (v): two GEMMs, outputs joined
        mixed = quantized.model.layers[1].qkv_proj
        assert [type(p) for p in mixed.parts] == [Q4Weight, Q8Weight]
        assert quantized.model.layers[0].qkv_proj.q4 is not None
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = quantized.generate(prompt_token_ids=[[1, 2, 3, 4, 5]], sampling_params=params)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(("file_type", "became"), [(T.F16, "4-bit"), (T.Q5_K, "8-bit")], ids=["F16", "Q5_K"])
def test_a_conversion_that_changes_values_is_said_once_with_how_to_keep_them(native, tmp_path, caplog, file_type,
                                                                           became):
    path = write_gguf(tmp_path / "tiny.gguf", TINY, file_type)
    with caplog.at_level(logging.WARNING, logger="specd"):
        LLM(str(path), max_model_len=64, max_num_seqs=1)
    lines = [r.getMessage() for r in caplog.records if "values change" in r.getMessage()]
    assert lines and all("--dtype" in line for line in lines)
    assert any(f"stored as {file_type.name} run as {became}" in line for line in lines)
    counted = sum(int(line.split(" tensor(s)")[0]) for line in lines)  # said once per kind, with a count
    assert counted == TINY.num_layers * 7 + 1  # every projection and the LM head; the embedding table stays dense


PEAK_SCRIPT = """
import json, sys
from specd.llm import LLM
from specd.model.weights import shape_of
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
llm = LLM(sys.argv[1], max_model_len=64, max_num_seqs=1)
print(json.dumps({"rss": status("VmRSS"), "peak": status("VmHWM")}))
"""


def test_a_loads_peak_stays_within_its_final_memory_and_one_tensors_float32_copy(native, tmp_path):
    shape = LlamaShape(hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=2816,
                       tied=True)  # a 49k x 1024 Q6_K table (the tied head) is the largest tensor, as in Q4_K_M files
    path = write_gguf(tmp_path / "peak.gguf", shape, _llama_cpp_mix)
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True, text=True, check=True)
    usage = json.loads(result.stdout.strip().splitlines()[-1])
    largest_float32 = 4 * shape.vocab_size * shape.hidden_size  # 201 MB; the whole model in float32 is ~1 GB
    assert usage["peak"] - usage["rss"] <= largest_float32, usage


def test_a_model_that_does_not_fit_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 512 * 2**20)
    import specd.llm as llm_module

    monkeypatch.setattr(llm_module, "available_memory", lambda: 512 * 2**20)
    monkeypatch.setattr(llm_module, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ModelLoadError, match=r"needs about .* GiB .* but 0\.5 GiB is available: lower --max-num-seqs"):
        LLM("default", max_num_seqs=64, max_model_len=8192)


def test_the_estimate_counts_the_kv_cache_for_every_slot_and_the_weights_as_built(native):
    from specd.model.llama import build_model
    from specd.model.loader import load_checkpoint

    checkpoint = load_checkpoint("default")
    small = memory.estimate_memory(checkpoint.state_dict, checkpoint.config, torch.bfloat16, True, 1, 1024)
    large = memory.estimate_memory(checkpoint.state_dict, checkpoint.config, torch.bfloat16, True, 8, 1024)
    config = checkpoint.config
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # keys and values, bfloat16
    assert large.kv_cache - small.kv_cache == 7 * 1024 * per_token
    model = build_model(config, checkpoint.state_dict, torch.bfloat16, int4=True)
    blocks = [w for m in model.modules() for w in (getattr(m, "q4", None), getattr(m, "q8", None)) if w is not None]
    built = sum(w.nbytes for w in blocks) + sum(p.numel() * p.element_size() for p in model.parameters())
    assert abs(small.weights - built) <= 0.02 * built, (small.weights, built)


@pytest.mark.parametrize("content", [b"", b"GGUF\x03\x00\x00\x00", b"PK\x03\x04 a zip file, not a model"],
                         ids=["zero-bytes", "truncated", "not-gguf"])
def test_a_broken_file_is_one_clear_line_and_exit_2(capsys, tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    code = cli.main(["generate", "--model", str(path), "hello"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and str(path) in lines[0] and "Traceback" not in captured.err
