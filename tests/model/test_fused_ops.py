"""specd's fused bfloat16 layer ops: each against torch's composite it replaces, row independence (what keeps
greedy speculation lossless), the scalar build, the switch, and a whole bfloat16 model with and without them."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import specd.kernels.fused as fused_kernels
from specd.model.attention import AttentionMetadata, ForwardBatch, attend, write_kv
from specd.model.config import ModelArchConfig
from specd.model.kv_cache import KVCache
from specd.model.llama import Rotary, apply_rotary
from specd.testing import tiny_hf_config_dict, tiny_specd_model


@pytest.fixture(scope="module")
def fused():
    ops = fused_kernels.fused_ops()
    if ops is None:
        pytest.skip("specd's fused ops did not build here, or SPECD_NATIVE_KERNELS=0")
    return ops


def _bf16(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(torch.bfloat16)


def _ulps_apart(a, b):  # elementwise distance in bfloat16 units in the last place (same-sign values)
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def test_rms_norm_equals_torchs_fused_kernel_up_to_summation_order(fused):
    torch.manual_seed(0)
    x, weight = _bf16(7, 576, scale=3.0), _bf16(576)
    got = fused.rms_norm(x, weight, 1e-5)
    want = F.rms_norm(x, (576,), weight, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert _ulps_apart(got, want).max() <= 1
    assert (got == want).float().mean() > 0.97  # almost every element is the same bfloat16
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double())
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)


def test_add_rms_norm_returns_the_rounded_sum_and_its_norm(fused):
    torch.manual_seed(1)
    x, delta, weight = _bf16(5, 64), _bf16(5, 64), _bf16(64)
    total, normed = fused.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)  # one rounding of the float32 sum, as torch's bfloat16 add
    assert torch.equal(normed, fused.rms_norm(x + delta, weight, 1e-6))
    assert torch.equal(x, x.clone()) and not total.data_ptr() == x.data_ptr()  # inputs untouched


def test_silu_mul_equals_silu_times_up(fused):
    torch.manual_seed(2)
    gate_up = _bf16(9, 2 * 1536, scale=4.0)
    got = fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (9, 1536)
    assert _ulps_apart(got, want).max() <= 1  # exp differs from torch's by an ulp of float32 at most
    assert (got == want).float().mean() > 0.99


def _cache_with_history(num_slots=3, num_kv_heads=2, head_dim=16, capacity=40, seed=3):
    torch.manual_seed(seed)
    cache = KVCache(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, max_slots=num_slots,
                    max_len=capacity, dtype=torch.bfloat16, grow_step=capacity)
    for _ in range(num_slots):
        cache.allocate()
    cache.reserve(capacity)
    cache.kv[0].copy_(_bf16(*cache.kv[0].shape))  # every position holds some key/value
    return cache


def test_rope_write_kv_equals_apply_rotary_then_write_kv(fused):
    arch = ModelArchConfig.from_hf_dict(tiny_hf_config_dict())  # 4 heads, 2 kv heads, head_dim 16
    rotary = Rotary(arch, 64)
    batch = ForwardBatch.build([[1, 2, 3], [4], [5, 6]], [2, 0, 1], [5, 17, 0], [[2], [0], [1]])
    meta = AttentionMetadata.build(batch)
    num_qk, num_kv = arch.num_heads + arch.num_kv_heads, arch.num_kv_heads
    heads = _bf16(6, num_qk + num_kv, arch.head_dim)
    cos, sin_signed = rotary.tables(batch.positions, torch.bfloat16)
    want_cache, got_cache = _cache_with_history(), _cache_with_history()
    want = heads.clone()
    apply_rotary(want[:, :num_qk], cos, sin_signed, out=want[:, :num_qk])
    write_kv(want[:, arch.num_heads :].reshape(6, 2, num_kv, arch.head_dim), want_cache, 0, meta)
    got = heads.clone()
    fused.rope_write_kv(got, cos, sin_signed, got_cache.kv[0], meta.write_slots, meta.write_positions)
    assert _ulps_apart(got, want).max() <= 1
    assert (got == want).float().mean() > 0.99
    assert torch.equal(got[:, num_qk:], heads[:, num_qk:])  # values are not rotated
    # exactly the written positions changed, to exactly the rotated keys and the values
    untouched = torch.ones(got_cache.kv[0].shape[:-1], dtype=torch.bool)
    untouched[:, meta.write_slots, :, meta.write_positions] = False
    assert torch.equal(got_cache.kv[0][untouched], want_cache.kv[0][untouched])
    written = got_cache.kv[0][:, meta.write_slots, :, meta.write_positions]  # [tokens, 2, kv heads, head_dim]
    assert torch.equal(written, got[:, arch.num_heads :].reshape(6, 2, num_kv, arch.head_dim))


def _reference_attention(query, cache, slots, starts, num_new):  # float64, each row over its keys 0..position
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // cache.num_kv_heads
    rows, t = [], 0
    for slot, start, n in zip(slots, starts, num_new):
        for j in range(n):
            keys = cache.keys[0][slot, :, : start + j + 1].double().repeat_interleave(group, 0)  # [heads, len, d]
            values = cache.values[0][slot, :, : start + j + 1].double().repeat_interleave(group, 0)
            scores = torch.einsum("hd,hld->hl", query[t].double() * head_dim**-0.5, keys)
            rows.append(torch.einsum("hl,hld->hd", scores.softmax(-1), values).reshape(-1))
            t += 1
    return torch.stack(rows)


@pytest.mark.parametrize("num_new", [[1, 1, 1], [3, 1, 5], [1, 4, 2]])
def test_attention_equals_the_float64_reference_and_torchs_grouped_path(fused, num_new):
    cache = _cache_with_history()
    slots, starts = [1, 0, 2], [6, 30, 0]
    batch = ForwardBatch.build([[7] * n for n in num_new], slots, starts, [[0]] * 3)
    query = _bf16(sum(num_new), 4, 16)
    got = attend(query, cache, 0, AttentionMetadata.build(batch, masks=False), fused=fused)
    want = _reference_attention(query, cache, slots, starts, num_new)
    assert got.shape == (sum(num_new), 64) and got.dtype == torch.bfloat16
    # one bfloat16 rounding of the float32 result, where torch's bfloat16 matmuls round scores and probabilities
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-3)
    torch_path = attend(query, cache, 0, AttentionMetadata.build(batch))
    assert (torch_path.double() - want).abs().max() >= (got.double() - want).abs().max()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(3, 3, 64), (4, 2, 32), (9, 3, 64), (8, 2, 16), (5, 1, 48), (6, 2, 24), (2, 1, 8)])
def test_attention_for_every_head_grouping_and_head_size(fused, num_heads, num_kv_heads, head_dim):
    # head_dim % 16 == 0 runs a kv head's query heads together in blocks of 1-4 (SmolLM2: 3 per kv head, 5 here is
    # a block of 4 and one of 1); other sizes run the one-head loop. Both against float64, positions 0..33.
    cache = _cache_with_history(num_kv_heads=num_kv_heads, head_dim=head_dim)
    slots, starts, num_new = [2, 0, 1], [0, 13, 33], [1, 4, 1]
    batch = ForwardBatch.build([[7] * n for n in num_new], slots, starts, [[0]] * 3)
    query = _bf16(sum(num_new), num_heads, head_dim)
    got = attend(query, cache, 0, AttentionMetadata.build(batch, masks=False), fused=fused)
    want = _reference_attention(query, cache, slots, starts, num_new)
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-3)


def test_attention_over_one_key_returns_its_value_in_place_and_keeps_a_nan_its_own(fused):
    # One key: the softmax is 1, so each head's output is its kv head's value row, bit for bit -- which checks that
    # the grouped loop puts every element back where it came from (it splits rows by parity).
    cache = _cache_with_history(num_kv_heads=2, head_dim=32)
    query = _bf16(2, 6, 32)
    query[1, 4] = float("nan")  # head 4 of the second row (kv head 1)
    meta = AttentionMetadata.build(ForwardBatch.build([[1], [2]], [0, 2], [0, 0], [[0], [0]]), masks=False)
    got = attend(query, cache, 0, meta, fused=fused).view(2, 6, 32)
    for row, slot in enumerate((0, 2)):
        for head in range(6):
            value = cache.values[0][slot, head // 3, 0]
            if (row, head) == (1, 4):
                assert torch.isnan(got[row, head]).all()
            else:
                assert torch.equal(got[row, head], value), (row, head)


def test_a_query_row_gives_the_same_bits_alone_in_decode_and_inside_a_verification_batch(fused):
    # A verification row at position p must equal the plain decode row at p, whatever else shares the forward.
    cache = _cache_with_history()
    query = _bf16(6, 4, 16)
    together = attend(query, cache, 0, AttentionMetadata.build(
        ForwardBatch.build([[1] * 4, [2], [3]], [0, 2, 1], [10, 3, 20], [[0], [0], [0]]), masks=False), fused=fused)
    for t, (slot, position) in enumerate([(0, 10), (0, 11), (0, 12), (0, 13), (2, 3), (1, 20)]):
        alone = attend(query[t : t + 1], cache, 0, AttentionMetadata.build(
            ForwardBatch.build([[1]], [slot], [position], [[0]]), masks=False), fused=fused)
        assert torch.equal(alone, together[t : t + 1]), t


def test_a_batch_mixing_decode_rows_with_a_long_prefill_chunk(fused):
    cache = _cache_with_history(capacity=80)
    batch = ForwardBatch.build([[1], list(range(40)), [2, 3]], [0, 1, 2], [30, 0, 5], [[0], [39], [1]])
    query = _bf16(43, 4, 16)
    want = _reference_attention(query, cache, [0, 1, 2], [30, 0, 5], [1, 40, 2])
    # torch's path: the decode rows and the 40-token chunk attend apart (no padding to the chunk's length)
    masked = AttentionMetadata.build(batch)
    assert masked.parts
    torch.testing.assert_close(attend(query, cache, 0, masked).double(), want, rtol=2**-6, atol=2e-3)
    # the fused kernel attends every row itself, the chunk's too: no parts, no masks
    meta = AttentionMetadata.build(batch, masks=False)
    assert not meta.parts and meta.mask is None and meta.pad_index is None
    got = attend(query, cache, 0, meta, fused=fused)
    torch.testing.assert_close(got.double(), want, rtol=2**-6, atol=2e-3)
    with pytest.raises(ValueError, match="fused"):
        attend(query, cache, 0, meta)  # torch's path cannot read metadata without masks


def test_a_prompt_row_gives_the_same_bits_however_the_prompt_was_chunked(fused):
    # Plain decoding and speculation chunk the same prompt differently (verification rows take part of the step's
    # token budget); a prompt row must not care, or greedy speculation stops being token-identical to plain
    # decoding (it did: rewrite prompts of bench/lossless.py in int4 at batch 8, chunks of > 32 rows then ran
    # torch's scaled_dot_product_attention and shorter ones the fused kernel).
    model = tiny_specd_model(tiny_hf_config_dict("llama"), seed=5, dtype=torch.bfloat16)
    prompt = [(7 * i + 3) % 300 + 1 for i in range(90)]
    results = []
    for chunks in ([90], [60, 30], [33, 33, 24], [20, 20, 20, 20, 10]):
        cache = model.make_cache(2, 128)
        slot = cache.allocate()
        cache.reserve(128)
        start, logits = 0, None
        for n in chunks:
            batch = ForwardBatch.build([prompt[start : start + n]], [slot], [start], [list(range(n))])
            rows = model(batch, cache)  # [n, vocab]
            logits = rows if logits is None else torch.cat([logits, rows])
            start += n
        assert logits is not None
        results.append((logits, torch.stack([layer[:, slot, :, :90] for layer in cache.kv])))
    for logits, kv in results[1:]:
        assert torch.equal(logits, results[0][0])
        assert torch.equal(kv, results[0][1])


def test_bad_arguments_name_the_field(fused):
    cache = _cache_with_history()
    query = _bf16(2, 4, 16)
    slots, starts, cu = torch.tensor([0, 1]), torch.tensor([3, 4]), torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match="query: must be bfloat16"):
        fused.attention(query.float(), cache.kv[0], slots, starts, cu, 1.0)
    with pytest.raises(RuntimeError, match="seq_slots: slot 7"):
        fused.attention(query, cache.kv[0], torch.tensor([0, 7]), starts, cu, 1.0)
    with pytest.raises(RuntimeError, match="seq_starts"):
        fused.attention(query, cache.kv[0], slots, torch.tensor([3, 40]), cu, 1.0)
    with pytest.raises(RuntimeError, match="cu_num_new"):
        fused.attention(query, cache.kv[0], slots, starts, torch.tensor([0, 1, 3]), 1.0)
    with pytest.raises(RuntimeError, match="weight: must have 64"):
        fused.rms_norm(_bf16(2, 64), _bf16(32), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up: must have an even"):
        fused.silu_mul(_bf16(2, 63))
    heads, tables = _bf16(1, 8, 16), _bf16(1, 6, 16)
    with pytest.raises(RuntimeError, match="write_positions: position 99"):
        fused.rope_write_kv(heads, tables, tables, cache.kv[0], torch.tensor([0]), torch.tensor([99]))
    with pytest.raises(RuntimeError, match="heads, kv: must be contiguous"):
        fused.rope_write_kv(_bf16(1, 16, 8).transpose(1, 2), tables, tables, cache.kv[0], torch.tensor([0]),
                            torch.tensor([1]))


@pytest.mark.parametrize(("model_type", "overrides"), [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 16})])
def test_a_bfloat16_model_with_the_fused_ops_is_as_close_to_float32_as_without(fused, monkeypatch, model_type,
                                                                              overrides):
    cfg = tiny_hf_config_dict(model_type, **overrides)  # qwen2: q/k/v biases; qwen3: q/k norms before rotary
    models = {dtype: tiny_specd_model(cfg, seed=3, dtype=dtype) for dtype in (torch.bfloat16, torch.float32)}

    def run(model):
        cache = model.make_cache(4, 64)
        slots = [cache.allocate() for _ in range(2)]
        cache.reserve(64)
        prefill = model(ForwardBatch.build([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]], slots, [0, 0], [[6], [2]]), cache)
        verify = model(ForwardBatch.build([[11], [12, 13, 14]], slots, [7, 3], [[0], [0, 1, 2]]), cache)
        return torch.cat([prefill, verify])

    called: set[str] = set()

    class Spy:  # the fused module, noting which ops ran
        def __getattr__(self, name):
            op = getattr(fused, name)
            return lambda *args, **kwargs: (called.add(name), op(*args, **kwargs))[1]

    expected = run(models[torch.float32])
    monkeypatch.setattr(fused_kernels, "for_dtype", lambda dtype: Spy() if dtype == torch.bfloat16 else None)
    with_fused = run(models[torch.bfloat16])
    # the fused path did run (its outputs may equal torch's bit for bit: both round attention once)
    assert {"rms_norm", "add_rms_norm", "silu_mul", "rope_write_kv", "attention"} <= called, called
    monkeypatch.setattr(fused_kernels, "for_dtype", lambda dtype: None)
    without = run(models[torch.bfloat16])
    err_fused, err_torch = (with_fused - expected).abs().max(), (without - expected).abs().max()
    assert err_fused < 1.5 * err_torch + 1e-3, (err_fused, err_torch)


def test_float32_and_float64_models_keep_torchs_ops(fused):
    assert fused_kernels.for_dtype(torch.bfloat16) is fused
    assert fused_kernels.for_dtype(torch.float32) is None and fused_kernels.for_dtype(torch.float64) is None


def test_the_scalar_build_agrees_with_the_avx2_build(fused):
    try:
        scalar = fused_kernels.build("scalar")
    except Exception as exc:  # no compiler: the fused fixture's tests skip for the same reason
        pytest.skip(f"scalar build failed: {exc}")
    assert not scalar.has_avx2()
    torch.manual_seed(4)
    x, weight, gate_up = _bf16(3, 96), _bf16(96), _bf16(3, 2 * 40, scale=3.0)
    assert _ulps_apart(scalar.rms_norm(x, weight, 1e-6), fused.rms_norm(x, weight, 1e-6)).max() <= 1
    assert _ulps_apart(scalar.silu_mul(gate_up), fused.silu_mul(gate_up)).max() <= 1
    cache = _cache_with_history()
    query = _bf16(3, 4, 16)
    args = (cache.kv[0], torch.tensor([0, 2]), torch.tensor([12, 4]), torch.tensor([0, 2, 3]), 0.25)
    torch.testing.assert_close(scalar.attention(query, *args).float(), fused.attention(query, *args).float(),
                               rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("setting", ["0", "off", "no"])
def test_the_switch_turns_the_fused_ops_off(monkeypatch, setting):
    monkeypatch.setenv("SPECD_NATIVE_KERNELS", setting)
    fused_kernels.fused_ops.cache_clear()
    try:
        assert fused_kernels.fused_ops() is None and fused_kernels.for_dtype(torch.bfloat16) is None
    finally:
        fused_kernels.fused_ops.cache_clear()


def test_a_failed_build_warns_once_and_returns_none(monkeypatch):
    monkeypatch.delenv("SPECD_NATIVE_KERNELS", raising=False)

    def broken(isa):
        raise RuntimeError("no compiler here\nmore lines")

    monkeypatch.setattr(fused_kernels, "build", broken)
    fused_kernels.fused_ops.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert fused_kernels.fused_ops() is None
            assert fused_kernels.fused_ops() is None  # cached: no second build, no second warning
        assert len(caught) == 1 and "no compiler here" in str(caught[0].message)
    finally:
        fused_kernels.fused_ops.cache_clear()
