"""Our forward equals transformers' reference implementation for the same weights."""

import pytest
import torch

from specd.model.attention import ForwardBatch
from specd.model.config import ModelArchConfig
from specd.model.kv_cache import KVCache, KVCacheFullError
from specd.model.llama import build_model
from specd.testing import hf_state_dict, lm_head_weight, tiny_hf_config_dict, tiny_hf_model

ARCHS = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 16}),
    ("mistral", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
]


def _pair(model_type, overrides, dtype=torch.float64):
    cfg = tiny_hf_config_dict(model_type, **overrides)
    hf = tiny_hf_model(cfg, dtype=dtype)
    sd = {k: v.detach().clone().to(torch.float32) for k, v in hf.state_dict().items()}
    ours = build_model(ModelArchConfig.from_hf_dict(cfg), sd, dtype)
    return hf, ours


def _run(ours, cache, slot, tokens, start, rows=None, num_layers=None):
    rows = list(range(len(tokens))) if rows is None else rows
    cache.reserve(start + len(tokens))
    logits = ours(ForwardBatch.build([tokens], [slot], [start], [rows]), cache, num_layers=num_layers)
    cache.set_len(slot, start + len(tokens))
    return logits


@pytest.mark.parametrize(("model_type", "overrides"), ARCHS)
def test_prefill_decode_and_chunks_match_transformers(model_type, overrides):
    hf, ours = _pair(model_type, overrides)
    torch.manual_seed(1)
    ids = torch.randint(0, 320, (1, 40))
    ref = hf(ids).logits[0]  # [40, vocab]
    cache = ours.make_cache(2, 128)
    slot = cache.allocate()
    parts = [_run(ours, cache, slot, ids[0, :17].tolist(), 0)]  # prefill
    parts.append(_run(ours, cache, slot, ids[0, 17:18].tolist(), 17))  # single-token decode
    parts.append(_run(ours, cache, slot, ids[0, 18:23].tolist(), 18))  # multi-token (verification) chunk
    for t in range(23, 40):
        parts.append(_run(ours, cache, slot, ids[0, t : t + 1].tolist(), t))
    torch.testing.assert_close(torch.cat(parts), ref, rtol=1e-9, atol=1e-9)


def test_float32_matches_transformers_tightly():
    hf, ours = _pair("llama", {}, dtype=torch.float32)
    ids = torch.randint(0, 320, (1, 20))
    ref = hf(ids).logits[0]
    cache = ours.make_cache(1, 64)
    out = _run(ours, cache, cache.allocate(), ids[0].tolist(), 0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # tied LM head; untied LM head + q/k/v bias
def test_packed_float32_weights_match_transformers_for_decode_and_verification(model_type):
    hf, ours = _pair(model_type, {}, dtype=torch.float32)
    if torch.backends.mkldnn.is_available():
        # pack() swapped the dense weights for oneDNN's blocked copies: no second copy stays in memory.
        assert ours.layers[0].qkv_proj.weight is None and ours.layers[0].qkv_proj.packed is not None
        assert (ours.lm_head is None) == (ours.tied_head is not None and ours.tied_head.packed is not None)
    reference = {k: v.float() for k, v in hf.state_dict().items()}
    ours_dense = hf_state_dict(ours)
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        torch.testing.assert_close(ours_dense[name], reference[name], rtol=0, atol=0)
    torch.manual_seed(4)
    ids = torch.randint(0, 320, (1, 24))
    ref = hf(ids).logits[0]
    cache = ours.make_cache(1, 64)
    slot = cache.allocate()
    parts = [_run(ours, cache, slot, ids[0, :12].tolist(), 0)]
    parts += [_run(ours, cache, slot, ids[0, t : t + 1].tolist(), t) for t in range(12, 18)]  # 1-row GEMMs
    parts.append(_run(ours, cache, slot, ids[0, 18:24].tolist(), 18))  # a 6-row verification chunk
    torch.testing.assert_close(torch.cat(parts), ref, rtol=1e-4, atol=1e-4)


def test_ragged_batch_equals_each_alone():
    hf, ours = _pair("qwen2", {})
    torch.manual_seed(2)
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (5, 11, 3)]
    cache = ours.make_cache(4, 64)
    slots = [cache.allocate() for _ in prompts]
    # Prefill all three in one ragged forward, logits for every token.
    cache.reserve(11)
    batch = ForwardBatch.build(prompts, slots, [0, 0, 0], [list(range(len(p))) for p in prompts])
    logits = ours(batch, cache)
    for s, p in zip(slots, prompts):
        cache.set_len(s, len(p))
    offset = 0
    for p in prompts:
        ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits[offset : offset + len(p)], ref, rtol=1e-9, atol=1e-9)
        offset += len(p)
    # Then a mixed step: seq 0 decodes 1 token, seq 1 verifies 4, seq 2 prefills 2 more (non-contiguous order).
    news = [[7], [8, 9, 10, 11], [12, 13]]
    order = [2, 0, 1]
    cache.reserve(20)
    batch = ForwardBatch.build(
        [news[i] for i in order], [slots[i] for i in order], [len(prompts[i]) for i in order],
        [list(range(len(news[i]))) for i in order],
    )
    logits = ours(batch, cache)
    offset = 0
    for i in order:
        full = prompts[i] + news[i]
        ref = hf(torch.tensor([full])).logits[0, len(prompts[i]) :]
        torch.testing.assert_close(logits[offset : offset + len(news[i])], ref, rtol=1e-9, atol=1e-9)
        offset += len(news[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verified_query_row_attends_exactly_as_it_does_alone(dtype):
    # Greedy speculation is lossless only if a token verified among k + 1 rows gets the result plain decoding gives
    # it. A verification attends over kv_len = its last row's length, later keys masked for earlier rows; torch's
    # bmm blocks that reduction by kv_len, so the masked zeros moved the rounding of almost every float32 row and
    # of ~1 bfloat16 row in 200 (enough to flip the default model's 12th output token under layerskip, eagle
    # and hybrid). The default model's attention shape: 9 query heads over 3 KV heads of 64.
    from specd.model.attention import AttentionMetadata, attend

    torch.manual_seed(3)
    num_heads, num_kv_heads, head_dim, max_len = 9, 3, 64, 400
    cache = KVCache(1, num_kv_heads, head_dim, max_slots=1, max_len=max_len, dtype=dtype)
    slot = cache.allocate()
    cache.reserve(max_len)
    cache.kv[0].copy_(torch.randn(cache.kv[0].shape) * 2)
    query = (torch.randn(max_len, num_heads, head_dim) * 0.5).to(dtype)  # [positions, heads, head_dim]
    for start in range(20, max_len - 8, 7):
        num_rows = start % 8 + 2  # drafts of 1..8 tokens
        batch = ForwardBatch.build([[0] * num_rows], [slot], [start], [[]])
        together = attend(query[start : start + num_rows], cache, 0, AttentionMetadata.build(batch), scale=1.0)
        for i in range(num_rows):
            alone_batch = ForwardBatch.build([[0]], [slot], [start + i], [[]])
            alone = attend(query[start + i : start + i + 1], cache, 0, AttentionMetadata.build(alone_batch), scale=1.0)
            assert torch.equal(together[i : i + 1], alone), (start, num_rows, i)


def test_decode_rows_beside_a_long_prefill_chunk_attend_apart_and_equal_the_reference():
    from specd.model.attention import GROUPED_MAX_NEW, AttentionMetadata

    hf, ours = _pair("llama", {})
    torch.manual_seed(3)
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (6, 9, 4)]
    cache = ours.make_cache(4, 128)
    slots = [cache.allocate() for _ in prompts]
    for s, p in zip(slots, prompts):
        _run(ours, cache, s, p, 0)
    # seq 0 decodes 1 token, seq 1 verifies 3, seq 2 prefills a chunk longer than the grouped path takes.
    news = [[7], [8, 9, 10], torch.randint(0, 320, (GROUPED_MAX_NEW + 9,)).tolist()]
    order = [1, 2, 0]
    cache.reserve(64)
    batch = ForwardBatch.build([news[i] for i in order], [slots[i] for i in order],
                               [len(prompts[i]) for i in order], [list(range(len(news[i]))) for i in order])
    meta = AttentionMetadata.build(batch)
    # Two parts: the short rows (seqs 1 and 0, flat rows 0-2 and the last) and the chunk's rows, unpadded.
    assert [rows.tolist() for rows, _ in meta.parts] == [[0, 1, 2, 3 + len(news[2])],
                                                         list(range(3, 3 + len(news[2])))]
    assert [part.max_new for _, part in meta.parts] == [3, len(news[2])]
    logits = ours(batch, cache)
    offset = 0
    for i in order:
        full = prompts[i] + news[i]
        ref = hf(torch.tensor([full])).logits[0, len(prompts[i]) :]
        torch.testing.assert_close(logits[offset : offset + len(news[i])], ref, rtol=1e-9, atol=1e-9)
        offset += len(news[i])
    # All-short or all-long batches attend in one part, as before.
    assert AttentionMetadata.build(ForwardBatch.build([[1], [2, 3]], [0, 1], [6, 9], [[0], [1]])).parts == ()


def test_rollback_then_continue_equals_never_written():
    hf, ours = _pair("llama", {})
    torch.manual_seed(3)
    prompt = torch.randint(0, 320, (9,)).tolist()
    cache = ours.make_cache(1, 64)
    slot = cache.allocate()
    _run(ours, cache, slot, prompt, 0)
    _run(ours, cache, slot, [5, 6, 7, 8], 9)  # speculative tokens, then rejected
    cache.set_len(slot, 10)  # keep only the first (O(1) rollback)
    out = _run(ours, cache, slot, [99, 100], 10)
    ref = hf(torch.tensor([[*prompt, 5, 99, 100]])).logits[0, 10:]
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def test_logits_only_for_selected_rows():
    _, ours = _pair("llama", {})
    cache = ours.make_cache(1, 64)
    slot = cache.allocate()
    toks = list(range(3, 13))
    full = _run(ours, cache, slot, toks, 0)
    cache.set_len(slot, 0)
    last = _run(ours, cache, slot, toks, 0, rows=[9])
    torch.testing.assert_close(last, full[9:10])


def test_layer_subset_runs_first_layers_with_shared_weights():
    _, ours = _pair("llama", {})
    cache = ours.make_cache(1, 64, num_layers=1)
    out = _run(ours, cache, cache.allocate(), [4, 5, 6], 0, num_layers=1)
    # Reference: the same computation by hand with the first layer only.
    full_cache = ours.make_cache(1, 64)
    hidden = ours.embed_tokens(torch.tensor([4, 5, 6]))
    from specd.model.attention import AttentionMetadata
    batch = ForwardBatch.build([[4, 5, 6]], [full_cache.allocate()], [0], [[0, 1, 2]])
    full_cache.reserve(3)
    with torch.inference_mode():
        rope = ours.rotary.tables(batch.positions, hidden.dtype)
        hidden = ours.layers[0](hidden, rope, full_cache, AttentionMetadata.build(batch))
        ref = torch.nn.functional.linear(ours.norm(hidden), lm_head_weight(ours))
    torch.testing.assert_close(out, ref)
    assert len(cache.keys) == 1


def test_kv_cache_grows_with_use_and_frees():
    cache = KVCache(2, 2, 8, max_slots=4, max_len=1000, dtype=torch.float32, grow_step=100)
    assert cache.bytes_allocated() == 0
    a = cache.allocate()
    cache.reserve(150)
    assert cache.capacity == 200 and cache.num_slots == 1
    b = cache.allocate()
    assert cache.num_slots == 2 and b == 1
    cache.free(a)
    assert cache.allocate() == 0  # lowest free slot is reused
    with pytest.raises(KVCacheFullError):
        cache.reserve(1001)
    with pytest.raises(ValueError):
        cache.free(3)


def _snap_to_int4_grid(weight):
    """Round a weight onto a per-32-group int4 grid, as a Q4_1 GGUF's dequantized weights are."""
    g = weight.view(weight.shape[0], -1, 32)
    low = g.amin(-1, keepdim=True)
    scale = (g.amax(-1, keepdim=True) - low) / 15
    return (((g - low) / scale).round() * scale + low).view_as(weight)


@pytest.fixture(params=["native", "torch"])
def int4_backend(request, monkeypatch):
    """Runs an int4 test with specd's native kernels, then with them unavailable (torch's kernels instead)."""
    import specd.kernels

    if request.param == "torch":
        monkeypatch.setattr(specd.kernels, "native", lambda: None)
        return request.param
    monkeypatch.setenv(specd.kernels.ENV_VAR, "1")  # on, even where the environment running the tests opted out
    specd.kernels.native.cache_clear()
    request.addfinalizer(specd.kernels.native.cache_clear)
    if specd.kernels.native() is None:
        pytest.skip("specd's native kernels did not build here (see the warning)")
    return request.param


def _quantized(linear, backend, head=False):
    """The quantized copy the backend made (q4/q8 native, int4/int8 torch), checking the other one is absent."""
    native, torch_copy = (linear.q8, linear.int8) if head else (linear.q4, linear.int4)
    return (native, torch_copy) if backend == "native" else (torch_copy, native)


def test_int4_quantization_is_exact_on_a_q4_grid():
    from specd.model.llama import INT4_GROUP, quantize_int4

    torch.manual_seed(5)
    weight = _snap_to_int4_grid(torch.randn(48, 96))
    packed, scales_and_zeros = quantize_int4(weight)
    # Multiplying the identity through the kernel reads the weight back (float32 path: exact up to rounding).
    eye = torch.eye(96)
    recovered = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, INT4_GROUP, scales_and_zeros).t()
    torch.testing.assert_close(recovered, weight, rtol=1e-5, atol=1e-5)


def test_int4_model_is_as_close_to_float32_as_dense_bfloat16(int4_backend):
    cfg = tiny_hf_config_dict()
    hf = tiny_hf_model(cfg)
    sd = {k: (_snap_to_int4_grid(v) if v.dim() == 2 and "embed" not in k else v).detach().clone()
          for k, v in hf.state_dict().items()}
    arch = ModelArchConfig.from_hf_dict(cfg)
    ref, dense, quant = (build_model(arch, sd, torch.float32), build_model(arch, sd, torch.bfloat16),
                         build_model(arch, sd, torch.bfloat16, int4=True))
    made, other = _quantized(quant.layers[0].qkv_proj, int4_backend)
    assert made is not None and other is None and dense.layers[0].qkv_proj.int4 is None
    assert dense.layers[0].qkv_proj.q4 is None

    def decode(model, tokens):
        cache = model.make_cache(1, 64)
        slot = cache.allocate()
        return torch.cat([_run(model, cache, slot, [t], i) for i, t in enumerate(tokens)])  # 1 row: int4 path

    tokens = list(range(3, 23))
    expected = decode(ref, tokens)
    err_dense = (decode(dense, tokens) - expected).abs().max()
    err_int4 = (decode(quant, tokens) - expected).abs().max()
    # The native kernels also round activations to int8 per block of 32 (step max|x| / 127, ~5x a bfloat16
    # rounding of a typical element), so their logits sit further from float32 than weight-only int4's.
    factor = 6 if int4_backend == "native" else 2
    assert err_int4 < factor * err_dense + 1e-3, (err_int4, err_dense)
    with pytest.raises(Exception, match="bfloat16"):
        build_model(arch, sd, torch.float32, int4=True)


def test_without_onednn_the_dense_weights_are_kept_and_give_the_same_logits(monkeypatch):
    cfg = tiny_hf_config_dict()
    hf = tiny_hf_model(cfg)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    arch = ModelArchConfig.from_hf_dict(cfg)
    packed = build_model(arch, sd, torch.float32)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    dense = build_model(arch, sd, torch.float32)
    assert dense.layers[0].qkv_proj.packed is None and dense.layers[0].qkv_proj.weight is not None
    assert dense.tied_head is not None and dense.tied_head.packed is None
    tokens = list(range(3, 15))
    out = []
    for model in (packed, dense):
        cache = model.make_cache(1, 64)
        out.append(_run(model, cache, cache.allocate(), tokens, 0))
    torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)


def test_hidden_states_are_the_reference_hidden_states_of_every_new_token():
    hf, ours = _pair("llama", {})
    torch.manual_seed(3)
    ids = torch.randint(0, 320, (1, 12))
    ref = hf(ids, output_hidden_states=True).hidden_states  # embeddings, layer 0 .. layer L-1 (last one normed)
    num_layers = ours.config.num_layers
    cache = ours.make_cache(1, 64)
    slot = cache.allocate()
    cache.reserve(12)
    batch = ForwardBatch.build([ids[0].tolist()], [slot], [0], [[11]])
    out = ours.forward_with_hidden(batch, cache, hidden_layers=(0, -1))
    hidden = ours.config.hidden_size
    assert out.hidden_states is not None and out.hidden_states.shape == (12, 2 * hidden)
    torch.testing.assert_close(out.hidden_states[:, :hidden], ref[1][0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out.hidden_states[:, hidden:], ref[num_layers][0], rtol=1e-9, atol=1e-9)
    # The LM head over the final feature of the logit row gives the same logits as the forward.
    with torch.inference_mode():
        torch.testing.assert_close(ours.compute_logits(out.hidden_states[11:, hidden:]), out.logits)
    assert ours.forward_with_hidden(batch, cache).hidden_states is None
    with pytest.raises(ValueError, match="hidden_layers"):
        ours.forward_with_hidden(batch, cache, hidden_layers=(num_layers,))


def test_keys_and_values_share_one_tensor_per_layer_and_survive_growth():
    from specd.model.attention import AttentionMetadata, write_kv

    cache = KVCache(2, 3, 4, max_slots=4, max_len=64, dtype=torch.float32, grow_step=8)
    slots = [cache.allocate(), cache.allocate()]
    cache.reserve(5)
    batch = ForwardBatch.build([[7, 8], [9]], slots, [3, 4], [[1], [0]])
    key_value = torch.randn(3, 2, 3, 4)  # [num_tokens, keys/values, num_kv_heads, head_dim]
    write_kv(key_value, cache, 1, AttentionMetadata.build(batch))
    for token, (slot, pos) in enumerate([(slots[0], 3), (slots[0], 4), (slots[1], 4)]):
        assert torch.equal(cache.keys[1][slot, :, pos], key_value[token, 0])
        assert torch.equal(cache.values[1][slot, :, pos], key_value[token, 1])
    assert cache.keys[1].data_ptr() == cache.kv[1].data_ptr()  # a view, not a copy
    cache.reserve(20)  # grows capacity: the views must follow the new tensor, contents kept
    cache.allocate()
    assert cache.keys[1].shape == (4, 3, 24, 4) and cache.keys[1].data_ptr() == cache.kv[1].data_ptr()
    assert torch.equal(cache.values[1][slots[1], :, 4], key_value[2, 1])
    assert cache.bytes_allocated() == 2 * 2 * 4 * 3 * 24 * 4 * 4


def test_rotary_tables_carry_the_softmax_scale_on_query_heads_only():
    from specd.model.llama import Rotary

    arch = ModelArchConfig.from_hf_dict(tiny_hf_config_dict())
    rotary = Rotary(arch, 32)
    cos, sin_signed = rotary.tables(torch.tensor([0, 5]), torch.float64)
    assert cos.shape == (2, arch.num_heads + arch.num_kv_heads, arch.head_dim)
    scale = arch.head_dim**-0.5
    torch.testing.assert_close(cos[:, : arch.num_heads], rotary.cos[[0, 5]].double().unsqueeze(1).expand(
        2, arch.num_heads, -1) * scale)
    torch.testing.assert_close(sin_signed[:, arch.num_heads :], rotary.sin_signed[[0, 5]].double().unsqueeze(1).expand(
        2, arch.num_kv_heads, -1))


def test_int8_quantization_recovers_weights_on_an_int8_grid():
    from specd.model.llama import quantize_int8

    torch.manual_seed(6)
    scales = torch.rand(40) + 0.5
    codes = torch.randint(-127, 128, (40, 64)).float()
    codes[:, 0] = 127  # every row reaches the grid's end, so its scale is recovered exactly
    weight = codes * scales.unsqueeze(1)
    q, got_scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and torch.equal(q.float(), codes)
    recovered = torch.ops.aten._weight_int8pack_mm(torch.eye(64), q, got_scales).t()  # the kernel reads it back
    torch.testing.assert_close(recovered, weight, rtol=1e-6, atol=1e-6)


def test_int4_mode_quantized_rows_do_not_depend_on_how_many_rows_share_the_matmul(int4_backend):
    cfg = tiny_hf_config_dict()
    hf = tiny_hf_model(cfg)
    sd = {k: (_snap_to_int4_grid(v) if v.dim() == 2 and "embed" not in k else v).detach().clone()
          for k, v in hf.state_dict().items()}
    arch = ModelArchConfig.from_hf_dict(cfg)
    quant = build_model(arch, sd, torch.bfloat16, int4=True)
    head = quant.lm_head if quant.lm_head is not None else quant.tied_head
    assert head is not None and head.int4 is None and head.q4 is None
    made, other = _quantized(head, int4_backend, head=True)
    assert made is not None and other is None
    proj = quant.layers[0].gate_up_proj
    made, other = _quantized(proj, int4_backend)
    assert made is not None and other is None and proj.weight is None  # the int4 copy replaced the dense weight
    # hf_weight dequantizes: the Q4 grid comes back up to bfloat16 rounding
    grid = sd["model.layers.0.mlp.gate_proj.weight"]
    torch.testing.assert_close(proj.hf_weight[: grid.shape[0]].float(), grid, rtol=1e-2, atol=1e-2)
    hidden = torch.randn(40, arch.hidden_size).to(torch.bfloat16)
    # One row alone equals the same row among 40 (prefill- and verification-sized), for both kernels: a token's
    # logits cannot depend on the batch it was verified in.
    assert torch.equal(head(hidden[:1]), head(hidden)[:1])
    assert torch.equal(proj(hidden[:1]), proj(hidden)[:1])
    dense = hidden.float() @ lm_head_weight(quant).float().t()  # [40, vocab]
    assert (quant.compute_logits(hidden) - dense).abs().max() < 0.02 * dense.abs().max()


def test_int4_skips_shapes_the_kernel_cannot_tile(int4_backend):
    from specd.model.llama import Linear

    odd = Linear(40, 16, bias=False)  # 40 inputs: not a whole number of 32-wide groups
    odd.add_int4()
    assert odd.int4 is None and odd.q4 is None and odd.weight is not None
    ok = Linear(64, 16, bias=False)
    torch.nn.init.normal_(ok.hf_weight)
    ok.add_int4()
    assert _quantized(ok, int4_backend)[0] is not None
