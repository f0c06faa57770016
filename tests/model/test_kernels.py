"""specd's native block-quantised GEMM kernels: against a float64 model of their maths, row independence, the
scalar build, and the fallback to torch's kernels when the extension cannot be built."""

import functools
import itertools
import warnings

import pytest
import torch

import specd.kernels
from specd.kernels.blockquant import (
    Q4Weight,
    Q8Weight,
    quantize_activations,
    quantize_q4,
    quantize_q8,
    quantize_q8_halves,
    reference_linear,
    unpack_six_bit,
)

VNNI_BUILDS = ("avx512", "avxvnni", "avx512vnni")
BUILD_CPU_FLAGS = {"avx512": set(specd.kernels._AVX512_FLAGS), "avxvnni": {"avx_vnni"},
                   "avx512vnni": {"avx512_vnni", "avx512vl"}}


# Every scale layout the kernels read (quant_gemm.cpp): float16 per block (GGUF Q4_0/Q4_1/Q8_0), float32 per block
# (Q4_K), float32 per 16 inputs in lane order (Q6_K).
quantize_q4_f32 = functools.partial(quantize_q4, scale_dtype=torch.float32)
LAYOUTS = [quantize_q4, quantize_q4_f32, quantize_q8, quantize_q8_halves]
LAYOUT_IDS = ["q4", "q4-f32", "q8", "q8-halves"]


@pytest.fixture(scope="module")
def native():
    module = specd.kernels.build(specd.kernels.cpu_isa())
    if module is None:
        pytest.skip("specd's native kernels did not build here (see the warning)")
    return module


def _weights(out_features=200, in_features=192, seed=0):
    torch.manual_seed(seed)
    return torch.randn(out_features, in_features)


@pytest.mark.parametrize("quantize", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_its_float64_model_up_to_float32_accumulation(native, quantize, dtype):
    weight = quantize(_weights())
    x = torch.randn(7, 192).to(dtype)
    got = weight.linear(native, x, float_out=True)
    assert got.dtype == torch.float32 and got.shape == (7, 200)
    expected = reference_linear(weight, x.float())
    # Integer block dots are exact; what remains is float32 rounding of 6 block terms per output (|y| ~ 30).
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-4 * expected.abs().max().item())
    # Without float_out the result comes back in x's dtype, the same values rounded once.
    torch.testing.assert_close(weight.linear(native, x), got.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("quantize", LAYOUTS, ids=LAYOUT_IDS)
def test_kernel_is_close_to_the_dense_product_within_the_quantisation_error(native, quantize):
    weight = quantize(_weights())
    x = torch.randn(5, 192)
    dense = x.double() @ weight.dequantize().double().t()  # exact weights: only the activations are rounded
    err = (weight.linear(native, x, float_out=True).double() - dense).abs()
    # Each activation moves by at most half a step (max|x| / 254 per block of 32), so |error| <= sum over
    # inputs of |w| * step / 2; the bound is per output row and column.
    step = x.abs().view(5, -1, 32).amax(-1).repeat_interleave(32, dim=1).double() / 127  # [rows, in]
    bound = (step / 2) @ weight.dequantize().double().abs().t()
    assert (err <= bound * 1.001 + 1e-5).all()
    assert err.max() > 0  # the activations really are quantised (a float path would pass the bound trivially)


@pytest.mark.parametrize("quantize", LAYOUTS, ids=LAYOUT_IDS)
def test_a_row_gives_the_same_bits_alone_and_among_others(native, quantize):
    weight = quantize(_weights(out_features=96))
    x = torch.randn(33, 192).to(torch.bfloat16)
    together = weight.linear(native, x, float_out=True)
    for i in (0, 13, 32):
        assert torch.equal(weight.linear(native, x[i : i + 1], float_out=True), together[i : i + 1])
    assert torch.equal(weight.linear(native, x[5:9], float_out=True), together[5:9])


@pytest.mark.parametrize("quantize", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("out_features", [8, 10])  # whole 4-column tiles, and two columns left over
# 1, 2 and 3 blocks alone (a group of one, of two, of two and one), whole groups of four, and whole groups followed
# by each of those; 256 and 352 rows have 8 and 11 blocks (the min term's 8-block loads, whole and with a rest)
@pytest.mark.parametrize("in_features", [32, 64, 96, 256, 288, 320, 352])
def test_every_tile_shape_gives_a_row_the_bits_it_gets_alone(native, quantize, out_features, in_features):
    """Tiles of 1-4 rows (1-8 in the avx512 build) x 1, 2 or 4 columns, groups of four, two and one blocks: each
    row of a 1..9-row call equals the row computed alone, and the call is close to the float64 model of the
    kernel."""
    weight = quantize(_weights(out_features=out_features, in_features=in_features, seed=in_features))
    x = torch.randn(9, in_features).to(torch.bfloat16)
    alone = torch.cat([weight.linear(native, x[i : i + 1], float_out=True) for i in range(9)])
    for rows in range(1, 10):
        assert torch.equal(weight.linear(native, x[:rows], float_out=True), alone[:rows]), f"{rows} rows"
    expected = reference_linear(weight, x.float())
    torch.testing.assert_close(alone.double(), expected, rtol=0, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("isa", ["scalar", "native"])
def test_the_kernels_split_their_columns_over_torchs_threads_with_the_same_bits(native, isa):
    """Built without OpenMP, ATen's parallel_for runs serially: the GEMMs used one core. The loop must really fan
    out over torch's threads, and a row's bits must not depend on how many threads split the columns."""
    module = native if isa == "native" else specd.kernels.build("scalar")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert module.parallel_width(64) == 2
        results = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for quantize in LAYOUTS:
                weight = quantize(_weights(out_features=203, in_features=224, seed=7))
                x = torch.randn(16, 224, generator=torch.Generator().manual_seed(5))
                results.setdefault(quantize, []).append(weight.linear(module, x, float_out=True))
        torch.set_num_threads(1)
        assert module.parallel_width(64) == 1
    finally:
        torch.set_num_threads(before)
    for outputs in results.values():
        assert all(torch.equal(outputs[0], out) for out in outputs[1:])


@pytest.mark.parametrize("quantize", LAYOUTS, ids=LAYOUT_IDS)
def test_the_group_order_is_a_permutation_of_the_block_order(quantize):
    weight = quantize(_weights(out_features=3, in_features=352))  # two groups of four, one of two, one of one
    block_order = weight.block_codes()
    per_block = block_order.shape[1] // 11
    fours, two = slice(0, 8 * per_block), slice(8 * per_block, 10 * per_block)
    assert not torch.equal(weight.codes[:, fours], block_order[:, fours])  # interleaved
    assert not torch.equal(weight.codes[:, two], block_order[:, two])
    assert torch.equal(weight.codes[:, -per_block:], block_order[:, -per_block:])  # a group of one is block order
    assert torch.equal(weight.codes.sort(dim=1).values, block_order.sort(dim=1).values)


def test_a_group_of_two_lays_out_its_inputs_as_documented():
    # int8 codes of a 64-input row (one group of two blocks) labelled by their group-order position: input
    # h*16 + 4u + e of block b sits in vector t = u // 2, lane i = (u % 2) * 2 + b, byte e, at t*32 + h*16 + i*4 + e
    labels = (torch.arange(64) - 32).to(torch.int8).view(1, 64)
    block_order = Q8Weight(labels, torch.ones(1, 2, dtype=torch.float16)).block_codes()[0] + 32
    for block, h, u, e in [(0, 0, 0, 0), (1, 1, 1, 0), (1, 0, 3, 2), (0, 1, 2, 3)]:
        t, lane = u // 2, (u % 2) * 2 + block
        assert block_order[block * 32 + h * 16 + 4 * u + e] == t * 32 + h * 16 + lane * 4 + e


def test_quantisation_recovers_gguf_blocks_exactly():
    torch.manual_seed(3)
    blocks = torch.randint(0, 16, (8, 4, 32)).float()
    blocks[..., 0], blocks[..., 1] = 0, 15  # each block spans the grid, as a Q4_1 block does
    scales, mins = torch.rand(8, 4, 1).half().float(), torch.randn(8, 4, 1).half().float()
    weight = (blocks * scales + mins).view(8, 128)
    q4 = quantize_q4(weight)
    assert torch.equal(q4.dequantize(), weight)
    q8_codes = torch.randint(-127, 128, (8, 4, 32)).float()
    q8_codes[..., 0] = 127
    q8_weight = (q8_codes * scales).view(8, 128)
    q8 = quantize_q8(q8_weight)
    assert torch.equal(q8.block_codes().float(), q8_codes.view(8, 128)) and torch.equal(q8.dequantize(), q8_weight)


def test_activation_model_rounds_like_the_kernel():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, 63.4] + [0.0] * 27])
    assert quantize_activations(x)[0, :5].tolist() == [127.0, 0.0, -0.0, 2.0, 63.0]  # ties to even


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [160, 192, 224, 256], ids=["group+1", "group+2", "group+3", "2 groups"])
def test_every_activation_code_is_the_models(native, dtype, in_features):
    # An identity weight reads each quantised activation back through one product: a code one step off (1/127 of
    # its block's max) is far outside the float32 rounding allowed here. Rows hold ties (x * 127 / max|x| = n + 0.5,
    # rounded to even), zeros, one block of zeros (scale 0) and random values; the inputs span full groups of
    # four blocks and the last, partial group, which sit in different places of the code layout.
    weight = quantize_q8(torch.eye(in_features))
    ties = torch.arange(in_features, dtype=torch.float32).remainder(31) - 15.5  # |x| < 127: n + 0.5 codes
    ties[::32] = 127.0  # each block's max is 127, so x * 127 / max = x
    zeros = torch.randn(in_features)
    zeros[32:64] = 0.0
    x = torch.stack([ties, -ties, zeros, torch.randn(in_features) * 5]).to(dtype)
    got = weight.linear(native, x, float_out=True).double()
    expected = reference_linear(weight, x.float())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)
    assert torch.equal(got[:, 32:64][2], torch.zeros(32, dtype=torch.float64))


def test_bad_arguments_name_the_field(native):
    weight = quantize_q4(_weights(out_features=16, in_features=64))
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        weight.linear(native, torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        weight.linear(native, torch.randn(2, 64).double())
    with pytest.raises(RuntimeError, match="scales and mins"):
        Q4Weight(weight.codes, weight.scales.float(), weight.mins).linear(native, torch.randn(2, 64))


def test_the_scalar_build_agrees_with_the_reference():
    try:
        scalar = specd.kernels.build("scalar")
    except Exception as exc:  # no compiler: the native fixture's tests skip for the same reason
        pytest.skip(f"the scalar build failed: {exc}")
    assert not scalar.uses_avx2()
    for quantize, in_features in itertools.product((quantize_q4, quantize_q8), (192, 224)):  # 4+2 and 4+2+1 blocks
        weight = quantize(_weights(in_features=in_features))
        x = torch.randn(3, in_features)
        expected = reference_linear(weight, x)
        torch.testing.assert_close(weight.linear(scalar, x, float_out=True).double(), expected, rtol=0,
                                   atol=1e-4 * expected.abs().max().item())
    with pytest.raises(ValueError, match="isa"):
        specd.kernels.build("avx1024")


def test_a_failed_build_warns_once_and_returns_none(monkeypatch):
    monkeypatch.setenv(specd.kernels.ENV_VAR, "1")

    def broken(isa):
        raise RuntimeError("Error building extension 'specd_quant_gemm': no compiler\nmore lines")

    monkeypatch.setattr(specd.kernels, "build", broken)
    specd.kernels.native.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built .*no compiler.*torch's slower") as record:
            assert specd.kernels.native() is None
            assert specd.kernels.native() is None  # cached: no second build, no second warning
        assert len(record) == 1
    finally:
        specd.kernels.native.cache_clear()


@pytest.mark.parametrize("setting", ["0", "off"])
def test_the_kernels_are_off_when_opted_out(monkeypatch, setting):
    monkeypatch.setenv(specd.kernels.ENV_VAR, setting)
    specd.kernels.native.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert specd.kernels.native() is None
    finally:
        specd.kernels.native.cache_clear()


def test_the_kernels_are_on_by_default(monkeypatch, native):
    # `native` (the fixture) skips where no compiler builds them; there the default falls back to torch's kernels.
    monkeypatch.delenv(specd.kernels.ENV_VAR, raising=False)
    specd.kernels.native.cache_clear()
    try:
        module = specd.kernels.native()
        assert module is not None and module.uses_avx2() == specd.kernels.cpu_has_avx2()
        assert module.uses_vnni() == (specd.kernels.cpu_isa() in VNNI_BUILDS)
    finally:
        specd.kernels.native.cache_clear()


def test_avx2_opts_out_of_vnni_only(monkeypatch, native):
    monkeypatch.setenv(specd.kernels.ENV_VAR, "avx2")
    specd.kernels.native.cache_clear()
    try:
        module = specd.kernels.native()
        assert module is not None and module.uses_avx2() == specd.kernels.cpu_has_avx2()
        assert not module.uses_vnni()
    finally:
        specd.kernels.native.cache_clear()


def test_the_best_build_follows_the_cpu_flags(monkeypatch):
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    for flags, isa in [({"avx2", "fma", "f16c", "avx_vnni"} | avx512, "avx512"),
                       ({"avx2", "fma", "f16c", "avx_vnni"} | avx512 - {"avx512dq"}, "avxvnni"),
                       ({"avx2", "fma", "f16c", "avx_vnni", "avx512_vnni", "avx512vl"}, "avxvnni"),
                       ({"avx2", "fma", "f16c", "avx512_vnni", "avx512vl"}, "avx512vnni"),
                       ({"avx2", "fma", "f16c", "avx512_vnni"}, "avx2"),  # the 256-bit EVEX form needs VL
                       ({"avx2", "fma", "avx_vnni"}, "scalar"),  # no F16C: no vector build at all
                       (set(), "scalar")]:
        monkeypatch.setattr(specd.kernels, "_cpu_flags", lambda flags=flags: flags)
        assert specd.kernels.cpu_isa() == isa, flags


@pytest.mark.parametrize("isa", VNNI_BUILDS)
def test_a_vnni_build_gives_the_avx2_builds_bits(isa):
    # dpbusd adds the same exact four-byte integer sums as maddubs + madd: every output bit must match, in every
    # tile shape (rows 1..5, 7, 9 and 16; columns not a multiple of 4), group size (192 = 4+2 blocks,
    # 224 = 4+2+1) and min-term load (352 = 11 blocks: 8, then 3).
    # The avx512 build's 4-column tiles hold two columns per 512-bit vector, each lane taking the 256-bit steps.
    flags = specd.kernels._cpu_flags()
    needed = BUILD_CPU_FLAGS[isa]
    if not specd.kernels.cpu_has_avx2() or not needed <= flags:
        pytest.skip(f"this CPU cannot run the {isa} build")
    try:
        vnni, avx2 = specd.kernels.build(isa), specd.kernels.build("avx2")
    except Exception as exc:  # an old compiler without the flag: the default then is still the best that builds
        pytest.skip(f"the {isa} build failed: {exc}")
    assert vnni.uses_vnni() and not avx2.uses_vnni()
    assert vnni.uses_zmm() == (isa == "avx512") and not avx2.uses_zmm()
    torch.manual_seed(3)
    shapes = itertools.product(LAYOUTS, (192, 224, 352), (1, 2, 3, 4, 5, 7, 9, 16))
    for quantize, in_features, rows in shapes:
        weight = quantize(_weights(out_features=203, in_features=in_features, seed=rows))
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, in_features).to(dtype)
            assert torch.equal(weight.linear(vnni, x, float_out=True), weight.linear(avx2, x, float_out=True))


def test_an_int4_model_without_the_kernels_uses_torchs(monkeypatch):
    from specd.model.config import ModelArchConfig
    from specd.model.llama import build_model
    from specd.testing import tiny_hf_config_dict, tiny_hf_model

    cfg = tiny_hf_config_dict()
    hf = tiny_hf_model(cfg)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    monkeypatch.setattr(specd.kernels, "native", lambda: None)
    model = build_model(ModelArchConfig.from_hf_dict(cfg), state, torch.bfloat16, int4=True)
    proj = model.layers[0].qkv_proj
    assert proj.q4 is None and proj.int4 is not None
    logits = model.compute_logits(torch.randn(2, 64).bfloat16())
    assert logits.shape == (2, 320) and torch.isfinite(logits).all()


def test_a_build_lock_left_by_a_killed_build_is_removed_while_a_live_build_is_waited_for(tmp_path, monkeypatch):
    import fcntl

    from torch.utils import cpp_extension

    import specd.kernels as kernels_pkg

    (tmp_path / "lock").touch()  # torch's baton, left by a build that was killed: torch would wait on it forever
    seen: dict[str, bool] = {}

    def fake_load(**kwargs: object) -> str:
        seen["stale lock present"] = (tmp_path / "lock").exists()
        with open(tmp_path / "specd-build.flock") as other:  # another specd process cannot build meanwhile
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["another process could lock"] = True
            except BlockingIOError:
                seen["another process could lock"] = False
        return "module"

    monkeypatch.setattr(kernels_pkg, "build_directory", lambda name: tmp_path)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert kernels_pkg.load_extension("specd_test_ext", tmp_path / "x.cpp", ["-O3"]) == "module"
    assert seen == {"stale lock present": False, "another process could lock": False}


def _q4_k_weight(out_features: int, in_features: int, seed: int = 0) -> Q4Weight:
    """A GGUF Q4_K tensor (random blocks with sane scales) in its compact KBlocks form."""
    import gguf
    import numpy as np

    from specd.model.gguf_blocks import block_weight
    from specd.synthetic import random_blocks

    raw = random_blocks(np.random.default_rng(seed), gguf.GGMLQuantizationType.Q4_K, (out_features, in_features))
    weight = block_weight(torch.from_numpy(raw).flatten(), gguf.GGMLQuantizationType.Q4_K, (out_features, in_features))
    assert isinstance(weight, Q4Weight) and weight.scales.dtype == torch.uint8
    return weight


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_q4_k_compact_scales_give_the_bits_of_their_float32_products(native, isa):
    """KBlocks forms d * sc and -(dmin * m) in the kernel (exact float32 products): every output bit equals the same
    weight with those products stored (F32Blocks), in every tile shape and build."""
    module = native if isa == "native" else specd.kernels.build(isa)
    for in_features in (256, 512, 768):
        compact = _q4_k_weight(out_features=203, in_features=in_features, seed=in_features)
        scales, mins = compact.block_scales()
        stored = Q4Weight(compact.codes, scales.contiguous(), mins.contiguous())
        x = torch.randn(16, in_features).to(torch.bfloat16)
        for rows in (1, 2, 3, 4, 5, 8, 9, 16):
            assert torch.equal(compact.linear(module, x[:rows], float_out=True),
                               stored.linear(module, x[:rows], float_out=True)), (in_features, rows)
        expected = reference_linear(compact, x.float())
        got = compact.linear(module, x, float_out=True).double()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * expected.abs().max().item())
    assert compact.nbytes * 6 == stored.nbytes * 4.5  # 4.5 bits per weight (the file's) against 6


def test_q4_k_compact_scales_need_whole_super_blocks(native):
    compact = _q4_k_weight(out_features=8, in_features=256)
    with pytest.raises(RuntimeError, match="whole super-blocks of 256"):
        native.q4_linear(torch.randn(1, 224), compact.codes[:, :112].contiguous(), compact.scales, compact.mins, True)


def _q6_k_weight(out_features: int, in_features: int, seed: int = 0) -> Q8Weight:
    """A GGUF Q6_K tensor (random blocks with sane scales) in its six-bit form with Q6_K's own scales."""
    import gguf
    import numpy as np

    from specd.model.gguf_blocks import block_weight
    from specd.synthetic import random_blocks

    raw = random_blocks(np.random.default_rng(seed), gguf.GGMLQuantizationType.Q6_K, (out_features, in_features))
    weight = block_weight(torch.from_numpy(raw).flatten(), gguf.GGMLQuantizationType.Q6_K, (out_features, in_features))
    assert isinstance(weight, Q8Weight) and weight.six_bit and weight.scales.dtype == torch.uint8
    return weight


def test_six_bit_codes_pack_and_unpack_every_value_at_every_position():
    grouped = (torch.arange(8 * 256) % 64 - 32).to(torch.int8).view(8, 256)  # each position sees many codes
    grouped = grouped[:, torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    from specd.kernels.blockquant import pack_six_bit

    packed = pack_six_bit(grouped)
    assert packed.shape == (8, 256 // 32 * 24) and packed.dtype == torch.uint8
    assert torch.equal(unpack_six_bit(packed), grouped)


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_q6_k_six_bit_codes_give_the_bits_of_int8_codes_and_float32_lanes(native, isa):
    """Six-bit codes with Q6_K's compact scales (SixBitCodes, Q6Lanes) compute every output bit the same as the
    same values as int8 codes with their float32 products per 16 inputs (F32Lanes), in every tile shape and
    build, and read 6.625 bits a weight against 10."""
    module = native if isa == "native" else specd.kernels.build(isa)
    if module is None:
        pytest.skip(f"the {isa} build is not available here")
    for in_features in (256, 512, 768):
        six = _q6_k_weight(out_features=203, in_features=in_features, seed=in_features)
        wide = Q8Weight(six.grouped_codes(), six.lane_scales().contiguous())
        assert not wide.six_bit and wide.per_half and torch.equal(wide.dequantize(), six.dequantize())
        x = torch.randn(16, in_features).to(torch.bfloat16)
        for rows in (1, 2, 3, 4, 5, 8, 9, 16):
            assert torch.equal(six.linear(module, x[:rows], float_out=True),
                               wide.linear(module, x[:rows], float_out=True)), (in_features, rows)
            assert torch.equal(six.linear(module, x[:rows]), wide.linear(module, x[:rows])), (in_features, rows)
        expected = reference_linear(six, x.float())
        got = six.linear(module, x, float_out=True).double()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * expected.abs().max().item())
    assert six.nbytes * 10 == wide.nbytes * 6.625


def test_q6_k_six_bit_codes_split_over_threads_with_the_same_bits(native):
    six = _q6_k_weight(out_features=203, in_features=512, seed=3)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outputs.append(six.linear(native, x, float_out=True))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])


def test_q6_k_six_bit_codes_name_what_is_wrong(native):
    six = _q6_k_weight(out_features=8, in_features=256)
    with pytest.raises(RuntimeError, match="whole super-blocks of 256"):
        native.q8_linear(torch.randn(1, 224), six.codes[:, :168].contiguous(), six.scales, True)
    with pytest.raises(RuntimeError, match="six-bit codes take Q6_K scales"):
        native.q8_linear(torch.randn(1, 256), six.codes, six.lane_scales().contiguous(), True)
    with pytest.raises(RuntimeError, match="24 bytes per 32 inputs"):
        native.q8_linear(torch.randn(1, 256), six.codes[:, :100].contiguous(), six.scales, True)
    with pytest.raises(RuntimeError, match="x has 128 inputs, the weight 256"):
        six.linear(native, torch.randn(1, 128))
