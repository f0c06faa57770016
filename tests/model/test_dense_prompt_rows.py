"""An int4 model's prompt rows through dense bfloat16 copies of its projections (set_dense_prompt_rows): what a prompt
row computes depends on its own inputs only, never on how its prompt was chunked or what shared the step; the
result stays close to the q4 kernel's; SPECD_INT4_PROMPT chooses, AMX CPUs default to it."""

import pytest
import torch

import specd.kernels as kernels
import specd.kernels.fused as fused_kernels
import specd.model.llama as llama
from specd.errors import ModelLoadError
from specd.model.attention import ForwardBatch
from specd.model.config import ModelArchConfig
from specd.model.llama import PROMPT_TILE, LlamaForCausalLM, build_model, prompt_linear
from specd.testing import tiny_hf_config_dict, tiny_hf_model


def _int4_model(**overrides) -> LlamaForCausalLM:
    cfg = tiny_hf_config_dict("llama", **overrides)
    state = {k: v.detach().clone() for k, v in tiny_hf_model(cfg, 5).state_dict().items()}
    return build_model(ModelArchConfig.from_hf_dict(cfg), state, torch.bfloat16, int4=True)


@pytest.fixture(scope="module")
def model():
    if kernels.native() is None or fused_kernels.fused_ops() is None:
        pytest.skip("specd's native kernels did not build here, or SPECD_NATIVE_KERNELS=0")
    built = _int4_model(hidden_size=160, intermediate_size=288)  # 5 and 9 input blocks: partial groups too
    assert built.set_dense_prompt_rows(True)
    return built


PROMPT = [(11 * i) % 300 + 2 for i in range(45)]  # more than one PROMPT_TILE


def _prefill(model: LlamaForCausalLM, chunks: list[int], neighbours: bool):
    """Prefill PROMPT into slot 0 in chunks of the given sizes, each step beside decode / verification rows of two
    other sequences when `neighbours`; returns the last prompt row's logits and slot 0's KV."""
    cache = model.make_cache(3, 96)
    slots = [cache.allocate() for _ in range(3)]
    cache.reserve(96)
    done = 0
    for step, size in enumerate(chunks):
        tokens = [PROMPT[done : done + size]]
        starts, prompts, logit_rows = [done], [True], [[size - 1]]
        if neighbours:  # a decode row and a 3-row verification, at positions that grow with the step
            tokens += [[7 + step], [8, 9, 10 + step]]
            starts += [step, 4 * step]
            prompts += [False, False]
            logit_rows += [[0], [0, 1, 2]]
        batch = ForwardBatch.build(tokens, slots[: len(tokens)], starts, logit_rows, prompts)
        logits = model(batch, cache)
        done += size
    assert done == len(PROMPT)
    return logits[0], torch.stack([kv[:, slots[0], :, : len(PROMPT)] for kv in cache.kv])


@pytest.fixture(params=["blocked", "plain"])
def layout(request, model):
    """The dense copies as made (oneDNN's blocked layout where it has bfloat16 support), or as plain [out, in]
    tensors: what a CPU without oneDNN bfloat16 gets (at::linear / F.linear then)."""
    if request.param == "blocked":
        yield request.param
        return
    projections = [p for layer in model.layers for p in layer.projections]
    for projection in projections:
        projection.prompt_weight = projection.q4.dequantize().to(torch.bfloat16).contiguous()
    model.prepare_one_call_layers()
    try:
        yield request.param
    finally:
        model.set_dense_prompt_rows(True)


@pytest.mark.parametrize("one_call", [True, False])
def test_a_prompt_row_does_not_depend_on_its_chunking_or_its_neighbours(model, one_call, layout):
    assert model.prepare_one_call_layers(one_call) == (len(model.layers) if one_call else 0)
    try:
        alone = _prefill(model, [len(PROMPT)], neighbours=False)
        for chunks in ([13, 32], [1, 31, 13], [40, 5]):
            for neighbours in (False, True):
                logits, kv = _prefill(model, chunks, neighbours)
                assert torch.equal(logits, alone[0]), (chunks, neighbours)
                assert torch.equal(kv, alone[1]), (chunks, neighbours)
    finally:
        model.prepare_one_call_layers()


def test_dense_prompt_rows_are_as_close_to_the_exact_product_as_the_q4_kernel(model):
    # Per projection, against float64 over the same dequantized weights: the dense copy rounds each weight to
    # bfloat16 once, the q4 kernel rounds the activations to int8 per block of 32; neither is worse than the other.
    native = kernels.native()
    for projection in (model.layers[0].qkv_proj, model.layers[1].down_proj):
        q4 = projection.q4
        exact_weight = q4.dequantize().double()  # [out, in]
        x = (torch.randn(40, exact_weight.shape[1]) * 2).bfloat16()  # [rows, in]
        exact = x.double() @ exact_weight.T
        dense_error = (prompt_linear(x, projection.prompt_weight).double() - exact).abs().mean()
        q4_error = (q4.linear(native, x).double() - exact).abs().mean()
        assert dense_error < 1.5 * q4_error, (dense_error, q4_error)
    # and a whole prefill differs from the q4 path's (the dense path ran), without a wild row
    dense_kv = _prefill(model, [len(PROMPT)], neighbours=False)[1]
    model.set_dense_prompt_rows(False)
    try:
        q4_kv = _prefill(model, [len(PROMPT)], neighbours=False)[1]
    finally:
        assert model.set_dense_prompt_rows(True)
    assert not torch.equal(dense_kv, q4_kv)
    assert torch.isfinite(dense_kv.float()).all()


def test_the_decode_rows_of_a_mixed_step_keep_the_q4_kernel_bits(model):
    # the same decode and verification rows, once beside a prompt chunk (dense path) and once without it
    def run(with_prompt: bool):
        cache = model.make_cache(3, 64)
        slots = [cache.allocate() for _ in range(3)]
        cache.reserve(64)
        tokens, starts, prompts, rows = [[5], [6, 7, 8]], [3, 9], [False, False], [[0], [0, 1, 2]]
        if with_prompt:
            tokens, starts, prompts, rows = [*tokens, PROMPT[:20]], [*starts, 0], [*prompts, True], [*rows, [19]]
        return model(ForwardBatch.build(tokens, slots[: len(tokens)], starts, rows, prompts), cache)[:4]

    assert torch.equal(run(True), run(False))


def test_the_torch_fallback_tiles_as_the_native_op_does(model, monkeypatch):
    weight = model.layers[0].gate_up_proj.prompt_weight
    x = (torch.randn(2 * PROMPT_TILE + 3, model.config.hidden_size) * 3).bfloat16()  # [rows, hidden_size]
    native = prompt_linear(x, weight)
    monkeypatch.setattr(fused_kernels, "fused_ops", lambda: None)
    assert torch.equal(prompt_linear(x, weight), native)
    # and a row's bits are those of any other call of PROMPT_TILE rows holding it
    assert torch.equal(prompt_linear(x[5:6], weight), native[5:6])


def test_the_setting_chooses_and_amx_cpus_default_to_dense(monkeypatch):
    if kernels.native() is None:
        pytest.skip("specd's native kernels did not build here, or SPECD_NATIVE_KERNELS=0")
    monkeypatch.setenv(llama.PROMPT_ENV_VAR, "q4")
    assert not _int4_model().dense_prompt_rows
    monkeypatch.setenv(llama.PROMPT_ENV_VAR, "bf16")
    assert _int4_model().dense_prompt_rows
    monkeypatch.setenv(llama.PROMPT_ENV_VAR, "auto")
    for amx in (True, False):
        monkeypatch.setattr(kernels, "cpu_has_amx_bf16", lambda amx=amx: amx)
        assert llama.dense_prompt_rows() is amx
    monkeypatch.setenv(llama.PROMPT_ENV_VAR, "fast")
    with pytest.raises(ModelLoadError, match="SPECD_INT4_PROMPT: 'fast' is not auto, bf16 or q4"):
        _int4_model()


def test_only_an_all_q4_model_takes_dense_prompt_rows():
    cfg = tiny_hf_config_dict("llama")
    state = {k: v.detach().clone() for k, v in tiny_hf_model(cfg, 5).state_dict().items()}
    bf16 = build_model(ModelArchConfig.from_hf_dict(cfg), state, torch.bfloat16)
    assert not bf16.set_dense_prompt_rows(True)
    assert all(layer.qkv_proj.prompt_weight is None for layer in bf16.layers)
