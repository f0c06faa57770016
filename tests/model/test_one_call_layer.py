"""The one-call int4 decoder layers (fused_ops' `decoder_layers`): the same bits as the op-by-op fused path
(`DecoderLayer._forward_fused`) for the layers' outputs and the KV they write, in decode, verification and ragged
prefill batches; that the model really takes it; that layers it cannot run keep the old path; the scalar build."""

from collections import Counter

import pytest
import torch

import specd.kernels as kernels
import specd.kernels.fused as fused_kernels
from specd.model.attention import AttentionMetadata, ForwardBatch
from specd.model.config import ModelArchConfig
from specd.model.llama import LlamaForCausalLM, build_model
from specd.testing import tiny_hf_config_dict, tiny_hf_model

# hidden 64 / intermediate 128: projections of 2 and 4 input blocks; hidden 160 / intermediate 288 (head_dim 40): 5
# and 9 blocks, so the GEMMs run full groups of four blocks and partial last groups
CONFIGS = {"small": {}, "odd": {"hidden_size": 160, "intermediate_size": 288}}
NO_ROWS = torch.empty(0, dtype=torch.long)  # decoder_layers' row split when no row is a prompt row


@pytest.fixture(scope="module")
def fused():
    ops = fused_kernels.fused_ops()
    if ops is None or kernels.native() is None:
        pytest.skip("specd's native kernels did not build here, or SPECD_NATIVE_KERNELS=0")
    return ops


def _int4_model(model_type: str = "llama", seed: int = 3, **overrides) -> LlamaForCausalLM:
    cfg = tiny_hf_config_dict(model_type, **overrides)
    state = {k: v.detach().clone() for k, v in tiny_hf_model(cfg, seed).state_dict().items()}
    return build_model(ModelArchConfig.from_hf_dict(cfg), state, torch.bfloat16, int4=True)


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, fused):
    return _int4_model(**CONFIGS[request.param])


# Three sequences through: a ragged prefill (chunks of 7, 3 and 12 tokens, the last one's prompt in two chunks), one
# decode row each, a multi-row verification beside decode rows, then prefill beside decode and verification rows.
# (tokens, start positions, which sequences' tokens are prompt chunks)
STEPS = [
    ([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [(5 * i) % 300 + 3 for i in range(12)]], [0, 0, 0], [True, True, True]),
    ([[11], [12], [(7 * i) % 300 + 4 for i in range(9)]], [7, 3, 12], [False, False, True]),
    ([[13], [14], [15]], [8, 4, 21], [False, False, False]),
    ([[16, 17, 18, 19], [20], [21, 22, 23]], [9, 5, 22], [False, False, False]),
    ([[24], list(range(30, 70)), [25, 26]], [13, 6, 25], [False, True, False]),
]


def _run(model: LlamaForCausalLM, one_call: bool):
    """Logits of every row, the residual streams of every layer and the final norm, and the KV cache."""
    assert model.prepare_one_call_layers(one_call) == (len(model.layers) if one_call else 0)
    cache = model.make_cache(4, 96)
    slots = [cache.allocate() for _ in range(3)]
    cache.reserve(96)
    logits, hidden = [], []
    for tokens, starts, prompts in STEPS:
        batch = ForwardBatch.build(tokens, slots, starts, [list(range(len(t))) for t in tokens], prompts)
        out = model.forward_with_hidden(batch, cache, hidden_layers=[*range(len(model.layers)), -1])
        logits.append(out.logits)
        hidden.append(out.hidden_states)
    model.prepare_one_call_layers()
    return torch.cat(logits), torch.cat(hidden), torch.stack(cache.kv)


@pytest.mark.parametrize("dense_prompts", [False, True])
def test_the_model_gives_the_same_bits_with_one_call_layers(model, dense_prompts):
    was = model.dense_prompt_rows
    assert model.set_dense_prompt_rows(dense_prompts) == dense_prompts
    try:
        with_one_call, op_by_op = _run(model, True), _run(model, False)
    finally:
        model.set_dense_prompt_rows(was)
    for got, want in zip(with_one_call, op_by_op, strict=True):
        assert torch.equal(got, want)
    assert with_one_call[2].abs().amax() > 0  # the caches were written


def test_one_layer_gives_the_same_output_and_kv_as_forward_fused(model, fused):
    torch.manual_seed(0)
    layer = model.layers[1]
    batch = ForwardBatch.build([[1, 2, 3], [4], [5] * 6], [2, 0, 1], [5, 17, 0], [[0], [0], [0]])
    meta = AttentionMetadata.build(batch, masks=False)
    hidden = (torch.randn(10, model.config.hidden_size) * 2).bfloat16()  # [tokens, hidden_size]
    rope = model.rotary.tables(batch.positions, torch.bfloat16)
    results = []
    for one_call in (True, False):
        cache = model.make_cache(3, 32)
        for _ in range(3):
            cache.allocate()
        cache.reserve(32)
        torch.manual_seed(1)
        for kv in cache.kv:
            kv.copy_(torch.randn(kv.shape).bfloat16())  # a history for the new rows to attend to
        if one_call:
            out = fused.decoder_layers(model.one_call_stack, 1, 2, hidden, *rope, cache.kv, meta.write_slots,
                                       meta.write_positions, meta.slot_index, meta.seq_starts, meta.cu_num_new,
                                       NO_ROWS, NO_ROWS)
        else:
            out = layer._forward_fused(fused, hidden, rope, cache, meta)
        results.append((out, torch.stack(cache.kv)))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])  # layer 1's cache written alike, layer 0's untouched


class _Spy:
    """The fused ops module, counting which ops the model calls."""

    def __init__(self, ops):
        self.ops, self.calls = ops, Counter()

    def __getattr__(self, name):
        op = getattr(self.ops, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return op(*args, **kwargs)

        return counted


def _spied_forward(model: LlamaForCausalLM, fused, monkeypatch) -> Counter:
    spy = _Spy(fused)
    monkeypatch.setattr(fused_kernels, "for_dtype", lambda dtype: spy if dtype == torch.bfloat16 else None)
    cache = model.make_cache(2, 32)
    slot = cache.allocate()
    cache.reserve(32)
    model(ForwardBatch.build([[1, 2, 3]], [slot], [0], [[2]]), cache)
    model(ForwardBatch.build([[4]], [slot], [3], [[0]]), cache)
    return spy.calls


def test_the_model_runs_its_layers_in_one_call(model, fused, monkeypatch):
    calls = _spied_forward(model, fused, monkeypatch)
    assert calls == Counter({"decoder_layers": 2})  # one per forward, no op from Python
    model.prepare_one_call_layers(False)
    try:
        calls = _spied_forward(model, fused, monkeypatch)
    finally:
        model.prepare_one_call_layers()
    assert "decoder_layers" not in calls and calls["attention"] == 2 * len(model.layers)


def test_captured_layers_split_the_native_runs(model, fused, monkeypatch):
    spy = _Spy(fused)
    runs: list[tuple[int, int]] = []
    original = fused.decoder_layers

    def recorded(stack, first, end, *args):
        runs.append((first, end))
        return original(stack, first, end, *args)

    spy.decoder_layers = recorded  # instance attribute: __getattr__ is not consulted
    monkeypatch.setattr(fused_kernels, "for_dtype", lambda dtype: spy if dtype == torch.bfloat16 else None)
    cache = model.make_cache(1, 16)
    slot = cache.allocate()
    cache.reserve(16)
    model.forward_with_hidden(ForwardBatch.build([[1, 2]], [slot], [0], [[1]]), cache, hidden_layers=[-1, 0])
    assert runs == [(0, 1), (1, len(model.layers))]
    runs.clear()
    model.forward_with_hidden(ForwardBatch.build([[3]], [slot], [2], [[0]]), cache, num_layers=1)
    assert runs == [(0, 1)]  # self-speculation's first N layers


@pytest.mark.parametrize(("model_type", "overrides"), [("qwen2", {}), ("qwen3", {"head_dim": 16})])
def test_a_layer_with_biases_or_qk_norms_keeps_the_op_by_op_path(fused, monkeypatch, model_type, overrides):
    model = _int4_model(model_type, **overrides)  # qwen2: q/k/v biases; qwen3: q/k norms
    assert model.layers[0].qkv_proj.q4 is not None  # int4 with the native GEMMs, as the default model
    assert model.prepare_one_call_layers() == 0 and model.one_call_stack is None
    assert all(layer.one_call_weights() is None for layer in model.layers)
    calls = _spied_forward(model, fused, monkeypatch)
    assert "decoder_layers" not in calls and calls["rms_norm"] == 2 * len(model.layers)


def test_a_bfloat16_model_keeps_the_op_by_op_path(fused):
    cfg = tiny_hf_config_dict()
    state = {k: v.detach().clone() for k, v in tiny_hf_model(cfg).state_dict().items()}
    model = build_model(ModelArchConfig.from_hf_dict(cfg), state, torch.bfloat16)  # oneDNN projections, no q4
    assert model.prepare_one_call_layers() == 0


def test_the_scalar_builds_give_the_same_bits_with_one_call_layers(fused, monkeypatch):
    try:
        scalar_gemm, scalar_ops = kernels.build("scalar"), fused_kernels.build("scalar")
    except Exception as exc:  # no compiler: the fixture's tests skip for the same reason
        pytest.skip(f"a scalar build failed: {exc}")
    assert not scalar_gemm.uses_avx2() and not scalar_ops.has_avx2()
    monkeypatch.setattr(kernels, "native", lambda: scalar_gemm)
    monkeypatch.setattr(fused_kernels, "for_dtype", lambda dtype: scalar_ops if dtype == torch.bfloat16 else None)
    model = _int4_model(**CONFIGS["odd"])
    with_one_call, op_by_op = _run(model, True), _run(model, False)
    for got, want in zip(with_one_call, op_by_op, strict=True):
        assert torch.equal(got, want)


def test_bad_arguments_name_the_field(model, fused):
    weights = [layer.one_call_weights() for layer in model.layers]
    capsule = kernels.native().q4_linear_capsule()
    with pytest.raises(RuntimeError, match="weights: each layer must have 14 tensors"):
        fused.make_layer_stack([weights[0][:-1]], [], 1e-6, 4, capsule)
    with pytest.raises(RuntimeError, match="q4_linear: must be the capsule"):
        fused.make_layer_stack(weights, [], 1e-6, 4, _foreign_capsule())
    cache = model.make_cache(1, 8)
    slot = cache.allocate()
    cache.reserve(8)
    meta = AttentionMetadata.build(ForwardBatch.build([[1]], [slot], [0], [[0]]), masks=False)
    cos, sin_signed = model.rotary.tables(torch.tensor([0]), torch.bfloat16)
    hidden = torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)  # [tokens, hidden_size]

    num_layers = len(model.layers)

    def call(stack=model.one_call_stack, first=0, end=num_layers, kv=cache.kv):
        return fused.decoder_layers(stack, first, end, hidden, cos, sin_signed, kv, meta.write_slots,
                                    meta.write_positions, meta.slot_index, meta.seq_starts, meta.cu_num_new, NO_ROWS,
                                    NO_ROWS)

    assert call().shape == hidden.shape
    with pytest.raises(RuntimeError, match="first, end: must satisfy"):
        call(first=1, end=num_layers + 1)
    with pytest.raises(RuntimeError, match="kv: the cache has 1 layers"):
        call(kv=cache.kv[:1])
    with pytest.raises(RuntimeError, match="weights: qkv has"):
        call(stack=fused.make_layer_stack(weights, [], 1e-6, 5, capsule))  # 5 query heads: the qkv rows disagree
    dense = [[torch.zeros(1, 1, dtype=torch.bfloat16)] * 4 for _ in weights]
    with pytest.raises(RuntimeError, match="dense: one entry per layer"):
        fused.make_layer_stack(weights, dense[:-1], 1e-6, 4, capsule)
    with pytest.raises(RuntimeError, match="dense: each layer must have 4 weights"):
        fused.make_layer_stack(weights, [d[:3] for d in dense], 1e-6, 4, capsule)
    with pytest.raises(RuntimeError, match="prompt_rows, other_rows: 1-d int64 row indices that split the 1 rows"):
        fused.decoder_layers(model.one_call_stack, 0, num_layers, hidden, cos, sin_signed, cache.kv, meta.write_slots,
                             meta.write_positions, meta.slot_index, meta.seq_starts, meta.cu_num_new,
                             torch.tensor([0]), torch.tensor([0]))


def _foreign_capsule():  # a capsule of another name: the layer must not call through its pointer
    import ctypes

    make = ctypes.pythonapi.PyCapsule_New
    make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return make(1, b"something.else", None)
