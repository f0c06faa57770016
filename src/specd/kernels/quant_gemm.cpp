// Block-quantised GEMM for CPU decode: y[m, n] = sum_k x[m, k] * w[n, k].
//
// Weights are stored in blocks of 32 inputs along k with block scales:
//   q4: w = scale * q + min, q in 0..15, two codes per byte
//   q8: w = scale * q,       q in -127..127, one byte per input or (GGUF Q6_K) six bits (see SixBitCodes)
// The scales (and q4's mins) come in the layouts below (F16Blocks, F32Blocks, KBlocks, F32Lanes, Q6Lanes), so
// GGUF's Q4_0, Q4_1, Q4_K, Q8_0 and Q6_K blocks all run with the values their file stores, exactly.
// Each activation row is quantised the same way (symmetric int8 per block of 32, scale dx), so a block's
// product is an integer dot product times scale * dx; q4's `min` term needs only the block's sum (of the quantised
// activations: QuantRows).
// With AVX2 the integer dots are `maddubs` (unsigned byte x signed byte, pairs summed to int16; no overflow:
// 2 * 127 * 127 < 32768) followed by `madd` with ones to int32. Without AVX2 the same sums are computed
// scalar (SPECD_SCALAR, or a compiler without the ISA flags).
//
// Group order. A row's blocks are taken in groups: four at a time (128 inputs), then a group of two if two or
// three are left, then a group of one if one is left. A group of S blocks is S 32-byte vectors; in each, 32-bit
// lane i (0..3) of 128-bit half h belongs to block b = i % S and holds its inputs h*16 + 4u .. h*16 + 4u + 3 with
// u = t * (4 / S) + i / S for vector t. So the vectors' maddubs results add up lane by lane into one vector whose
// eight lanes (h, i) are integer dots of block i % S -- the group reduced with plain adds, one int->float convert
// and one FMA, where block order would need a horizontal sum or a broadcast per block. (S = 1 is block order.)
// q4 bytes hold, in vector t's 16-byte chunk, byte i*4 + e: low nibble input 4u + e, high nibble input
// 16 + 4u + e of block i % S, so unpacking a chunk (low nibbles to half 0, high to half 1) gives vector t.
// The block scales of a group are spread over the same 8 lanes. q4's min term (sum over blocks of min * the block's
// quantised sum, see QuantRows) is added into the same accumulator after the groups, 8 blocks per FMA, and one horizontal sum per
// output ends it; a tile of 4 columns shares that sum's shuffles (horizontal adds of its 4 accumulators).
//
// Every output element is computed by the same instructions in the same order from its own weight row and its
// own activation row, whatever the number of rows in the batch and whichever tile it falls in: a token's result
// does not depend on its neighbours (speculative verification relies on it). Tiles of up to 4 rows (8 in the
// 512-bit build, see SPECD_ZMM) x 4 columns share each unpacked weight group among their rows and, from 3 rows, each
// activation load among their columns (1-2 rows take a tile's columns one by one, see run_tile); work is split over column tiles, on torch's intra-op threads: at::parallel_for is a header template that runs
// its loop on OpenMP threads only where the including file is compiled with -fopenmp, and serially otherwise
// (kernels/__init__.py builds with it; `parallel_width` reports how many threads a loop really ran on).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "group_order.h"
#include "gguf_repack.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(SPECD_SCALAR)
#define SPECD_AVX2 1
#include <immintrin.h>
#else
#define SPECD_AVX2 0
#endif

// VNNI (the "vnni" build: -mavxvnni, or -mavx512vnni -mavx512vl where only the EVEX form exists): one `dpbusd`
// replaces maddubs + madd (+ add), the same four-byte sums in the same int32 lanes, exact in both (maddubs cannot
// saturate here, see the tiles), so the two builds give the same bits; only the instruction count differs.
#if SPECD_AVX2 && defined(__AVXVNNI__)
#define SPECD_VNNI 1
#define SPECD_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#elif SPECD_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECD_VNNI 1
#define SPECD_DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#else
#define SPECD_VNNI 0
#endif

// 512-bit tiles (the "avx512" build: AVX-512 F/BW/VL/DQ and VNNI): a 4-column tile holds two columns per vector,
// column 2p's eight lanes in the lower half and 2p + 1's in the upper, and every lane takes exactly the steps of
// the 256-bit tile's lane (the same dpbusd sums, convert, multiply, FMA, then the same reduce_store), so the bits
// are the 256-bit build's; only half as many instructions issue, and tiles grow to 8 rows. Tiles of 1-2 rows and
// the columns left over past the 4-column tiles take the 256-bit code.
#if SPECD_VNNI && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define SPECD_ZMM 1
#else
#define SPECD_ZMM 0
#endif

namespace {

using namespace specd;  // the group order (group_order.h)

constexpr int64_t kMaxTileRows = SPECD_ZMM ? 8 : 4;  // rows per tile (the 256-bit tiles take at most 4)

inline float half_to_float(at::Half h) {
#if SPECD_AVX2
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// Activation rows quantised per block, codes in group order. Per group, the block scales as 8 float lanes matching
// the integer sums' lanes (h, i): [s0 s1 s2 s3 s0 s1 s2 s3] for four blocks, [s0 s1 s0 s1 ...] for two, [s0 ...]
// for one. The block sums in block order, padded with zeros to a multiple of 8 blocks: each the quantised block's
// sum (scale * the sum of its codes), so q4's min term sees the activations the codes' term sees. (With the exact
// sum of x instead, a block's rounding errors meet the weights' codes q, 0..15, not their centred values scale * q +
// min: ~2x the error of a q4 product on random-weight 1B models, and 3x the next-token KL.)
struct QuantRows {
  int64_t k, groups, sum_stride;
  std::vector<int8_t> codes;   // [rows, k]
  std::vector<float> scales;   // [rows, groups * 8]
  std::vector<float> sums;     // [rows, sum_stride]

  const int8_t* row_codes(int64_t row) const { return codes.data() + row * k; }
  const float* row_scales(int64_t row) const { return scales.data() + row * groups * 8; }
  const float* row_sums(int64_t row) const { return sums.data() + row * sum_stride; }
};

#if SPECD_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// One block of 32 inputs: its codes into `dst` (a row in group order); returns (scale, scale * the codes' sum: the
// quantised block's sum, see QuantRows). The codes and the scale are the scalar loop's (one float product per input,
// rounded to nearest even, |code| <= 127), the sum an exact integer: the same bits. Eight 4-byte stores put the
// codes in group order.
template <typename T>
inline std::pair<float, float> quantize_block(const T* src, int8_t* dst, int64_t block, int64_t blocks) {
  const __m256 v0 = load8(src), v1 = load8(src + 8), v2 = load8(src + 16), v3 = load8(src + 24);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, magnitude), _mm256_and_ps(v1, magnitude)),
                                 _mm256_max_ps(_mm256_and_ps(v2, magnitude), _mm256_and_ps(v3, magnitude)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  // |x| * 127 / amax is 127 at most, up to a rounding: the packs saturate at 127, the max keeps -127 the floor
  const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
  const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
  const __m256i bytes = _mm256_max_epi8(
      _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3)), _mm256_set1_epi8(-127));
  // 4-byte word w of `bytes` holds inputs first_input[w] .. + 3 (the packs interleave the 128-bit halves)
  alignas(32) int32_t words[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(words), bytes);
  constexpr int64_t first_input[8] = {0, 8, 16, 24, 4, 12, 20, 28};
  for (int64_t w = 0; w < 8; ++w) std::memcpy(dst + input_position(block, first_input[w], blocks), &words[w], 4);
  const __m256i quads = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  const float scale = amax / 127.f;
  return {scale, scale * static_cast<float>(_mm_cvtsi128_si32(t))};
}
#else
template <typename T>
inline std::pair<float, float> quantize_block(const T* src, int8_t* dst, int64_t block, int64_t blocks) {
  float values[kBlock];
  float amax = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) {
    values[i] = static_cast<float>(src[i]);
    amax = std::max(amax, std::fabs(values[i]));
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t codes = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int8_t code = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(values[i] * inv))));
    dst[input_position(block, i, blocks)] = code;
    codes += code;
  }
  const float scale = amax / 127.f;
  return {scale, scale * static_cast<float>(codes)};
}
#endif

template <typename T>
QuantRows quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / kBlock, groups = group_count(blocks), sum_stride = (blocks + 7) / 8 * 8;
  QuantRows q{k, groups, sum_stride, std::vector<int8_t>(rows * k), std::vector<float>(rows * groups * 8),
              std::vector<float>(rows * sum_stride, 0.f)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const auto [scale, sum] = quantize_block(x + r * k + b * kBlock, q.codes.data() + r * k, b, blocks);
        const Group g = group_of(b, blocks);
        for (int64_t lane = b - g.first; lane < 8; lane += g.size) q.scales[(r * groups + g.index) * 8 + lane] = scale;
        q.sums[r * sum_stride + b] = sum;
      }
    }
  });
  return q;
}

#if SPECD_AVX2
// The C accumulators of one output row into out[0 .. C-1]. Each lane sum is ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
// (l6 + l7)) whichever C, so a column's bits do not depend on the tile it is in.
template <int C>
inline void reduce_store(const __m256* acc, float* out) {
  static_assert(C == 1 || C == 2 || C == 4, "tiles are 1, 2 or 4 columns wide");
  __m256 h;
  if constexpr (C == 4) {
    h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  } else if constexpr (C == 2) {
    const __m256 pair = _mm256_hadd_ps(acc[0], acc[1]);
    h = _mm256_hadd_ps(pair, pair);
  } else {
    const __m256 one = _mm256_hadd_ps(acc[0], acc[0]);
    h = _mm256_hadd_ps(one, one);
  }
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // [c0 c1 c2 c3]
  if constexpr (C == 4) {
    _mm_storeu_ps(out, sums);
  } else if constexpr (C == 2) {
    _mm_storel_pi(reinterpret_cast<__m64*>(out), sums);
  } else {
    out[0] = _mm_cvtss_f32(sums);
  }
}

// 16 packed q4 bytes -> 32 codes: low nibbles in the lower 128-bit half, high nibbles in the upper.
inline __m256i unpack_q4(const uint8_t* w) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                          _mm256_set1_epi8(0x0F));
}

// Weights stream from memory once per call at few rows, so each group asks for lines it will need soon (a prefetch
// past the last column is harmless): in 4-column tiles, the same group of the column two tiles ahead; a column at
// a time (1-2 rows, one sequential stream), the line kPrefetchBytes ahead (4 KiB: 2-16 KiB measured the same
// within this VM's run-to-run spread of up to 1.5x).
constexpr int64_t kPrefetchColumns = 8;
constexpr int64_t kPrefetchBytes = 4096;

template <int C>
inline int64_t prefetch_distance(int64_t column_bytes) {
  return C == 1 ? kPrefetchBytes : kPrefetchColumns * column_bytes;
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// A group's S float16 block values (scales or mins) spread over its 8 lanes: block i % S in lane (h, i).
template <int S>
inline __m256 group_lanes(const at::Half* p) {
  if constexpr (S == 4) {
    const __m128 v = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_set_m128(v, v);
  } else if constexpr (S == 2) {
    int32_t two;
    std::memcpy(&two, p, sizeof(two));
    const __m128 v = _mm_cvtph_ps(_mm_set1_epi32(two));  // [v0 v1 v0 v1]
    return _mm256_set_m128(v, v);
  } else {
    return _mm256_set1_ps(half_to_float(p[0]));
  }
}

// Up to 8 float16 values as floats, 0 past `count`, without reading past p[count - 1] (the last column's row ends
// the tensor). A short read takes the 8 values ending there when the row has them (`available_before` values
// precede p in its row), and moves them down with a byte shuffle: no store-to-load round trip.
inline __m256 load_halves8(const at::Half* p, int64_t count, int64_t available_before) {
  if (count >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (available_before >= 8 - count) {
    alignas(16) static const int8_t kMoveDown[8][16] = {
        {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
        {14, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
        {12, 13, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
        {10, 11, 12, 13, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
        {8, 9, 10, 11, 12, 13, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1},
        {6, 7, 8, 9, 10, 11, 12, 13, 14, 15, -1, -1, -1, -1, -1, -1},
        {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, -1, -1, -1, -1},
        {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, -1, -1}};
    const __m128i ending = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + count - 8));
    const __m128i mask = _mm_load_si128(reinterpret_cast<const __m128i*>(kMoveDown[count]));
    return _mm256_cvtph_ps(_mm_shuffle_epi8(ending, mask));
  }
  const auto at = [&](int64_t i) -> int16_t { return i < count ? static_cast<int16_t>(p[i].x) : 0; };
  return _mm256_cvtph_ps(_mm_setr_epi16(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7)));
}

// Up to 8 float32 values, 0 past `count`, reading nothing past p[count - 1].
inline __m256 load_floats8(const float* p, int64_t count) {
  if (count >= 8) return _mm256_loadu_ps(p);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, mask);
}

// group_lanes for float32 block values.
template <int S>
inline __m256 group_lanes(const float* p) {
  if constexpr (S == 4) {
    const __m128 v = _mm_loadu_ps(p);
    return _mm256_set_m128(v, v);
  } else if constexpr (S == 2) {
    const __m128 v = _mm_castpd_ps(_mm_load1_pd(reinterpret_cast<const double*>(p)));  // [v0 v1 v0 v1]
    return _mm256_set_m128(v, v);
  } else {
    return _mm256_set1_ps(p[0]);
  }
}
#endif

// The layouts of a weight column's scales (and q4's mins), each a column of `stride(blocks)` values:
//   F16Blocks: one float16 per block of 32 (GGUF Q4_0, Q4_1 and Q8_0 store exactly these);
//   F32Blocks: one float32 per block (GGUF Q4_K's d * sc and dmin * m: exact in float32, not in float16);
//   F32Lanes:  eight float32 per group in the integer sums' lane order: lane (h, i) holds the scale of inputs
//              h*16 .. h*16 + 15 of block i % S, so each 16 inputs of a block have a scale of their own (GGUF
//              Q6_K's sub-blocks of 16). The lanes already split a block's dot by halves, so this costs one load.
//   KBlocks:   GGUF Q4_K's own scales, the file's 16 bytes per 8 blocks (a super-block of 256 inputs): d and dmin as
//              float16, then 12 bytes packing 8 six-bit scales sc and 8 six-bit mins m; scale = d * sc and min =
//              -(dmin * m) are formed in the kernel, the same float32 products as F32Blocks holds (both exact), so the
//              same bits at 0.5 bits of scales per weight instead of 2. The mins live in the same array (q4's `mins`
//              is unused). Rows must be whole super-blocks (inputs a multiple of 256).
//   Q6Lanes:   GGUF Q6_K's own scales, 20 bytes per super-block of 256 inputs (two groups of four blocks): its 16
//              int8 sub-block scales sc in F32Lanes' lane order (group 2s's 8 lanes, then group 2s + 1's), then d as
//              float32; a lane's scale d * sc is formed in the kernel, the float32 product F32Lanes stores (exact:
//              an 11-bit significand times an 8-bit integer), so the same bits at 0.625 bits of scales per weight
//              instead of 2. Rows must be whole super-blocks.
// `lanes<S>` gives a group's 8 lanes (see group_lanes), `eight` 8 blocks' mins from block b (q4's min term),
// `scalar` the scale of half `half` of `block` and `scalar_min` its min (the scalar build).
struct F16Blocks {
  using T = at::Half;
  static constexpr bool kPerHalf = false;
  static int64_t stride(int64_t blocks) { return blocks; }
  static float scalar(const T* column, int64_t block, int64_t, int64_t) { return half_to_float(column[block]); }
  static float scalar_min(const T* column, int64_t block, int64_t) { return half_to_float(column[block]); }
#if SPECD_AVX2
  template <int S>
  static __m256 lanes(const T* column, int64_t, int64_t first) { return group_lanes<S>(column + first); }
  static __m256 eight(const T* column, int64_t b, int64_t blocks) { return load_halves8(column + b, blocks - b, b); }
#endif
};

struct F32Blocks {
  using T = float;
  static constexpr bool kPerHalf = false;
  static int64_t stride(int64_t blocks) { return blocks; }
  static float scalar(const T* column, int64_t block, int64_t, int64_t) { return column[block]; }
  static float scalar_min(const T* column, int64_t block, int64_t) { return column[block]; }
#if SPECD_AVX2
  template <int S>
  static __m256 lanes(const T* column, int64_t, int64_t first) { return group_lanes<S>(column + first); }
  static __m256 eight(const T* column, int64_t b, int64_t blocks) { return load_floats8(column + b, blocks - b); }
#endif
};

inline float float_at(const uint8_t* p) {  // a float32 stored at any byte offset
  float value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

struct KBlocks {
  using T = uint8_t;
  static constexpr bool kPerHalf = false;
  static constexpr int64_t kSuperBytes = 16;
  static int64_t stride(int64_t blocks) { return blocks / 8 * kSuperBytes; }
  static const T* super_of(const T* column, int64_t block) { return column + block / 8 * kSuperBytes; }
  static float d_of(const T* super, int64_t at) {  // d (at 0) or dmin (at 2), float16 -> float32, exact
    uint16_t bits;
    std::memcpy(&bits, super + at, sizeof(bits));
    return half_to_float(at::Half(bits, at::Half::from_bits()));
  }
  // Sub-block j's six-bit scale and min: j < 4 the low six bits of bytes j and j + 4 of the 12; j >= 4 a nibble of
  // byte j + 4 with the top two bits of bytes j - 4 (scale) and j (min).
  static uint8_t sc_of(const T* q, int64_t j) {
    return j < 4 ? q[j] & 63 : static_cast<uint8_t>((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
  }
  static uint8_t m_of(const T* q, int64_t j) {
    return j < 4 ? q[j + 4] & 63 : static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
  static uint32_t word(const T* p) {
    uint32_t value;
    std::memcpy(&value, p, sizeof(value));
    return value;
  }
  static float scalar(const T* column, int64_t block, int64_t, int64_t) {
    const T* super = super_of(column, block);
    return d_of(super, 0) * static_cast<float>(sc_of(super + 4, block % 8));
  }
  static float scalar_min(const T* column, int64_t block, int64_t) {
    const T* super = super_of(column, block);
    return -(d_of(super, 2) * static_cast<float>(m_of(super + 4, block % 8)));
  }
#if SPECD_AVX2
  // sc_of / m_of four sub-blocks at a time, as 32-bit words of four bytes
  static uint32_t four_scales(const T* q, int64_t j0) {  // j0: 0 or 4
    return j0 == 0 ? word(q) & 0x3F3F3F3Fu : (word(q + 8) & 0x0F0F0F0Fu) | (((word(q) >> 6) & 0x03030303u) << 4);
  }
  template <int S>
  static __m256 lanes(const T* column, int64_t, int64_t first) {
    if constexpr (S == 4) {  // whole super-blocks: every group is four blocks of one super-block
      const T* super = super_of(column, first);
      const __m128 sc = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(four_scales(super + 4, first % 8)))));
      return _mm256_mul_ps(_mm256_set_m128(sc, sc), _mm256_set1_ps(d_of(super, 0)));
    } else {  // not reached (rows are whole super-blocks); the scalar values, for completeness
      float v[4];
      for (int i = 0; i < 4; ++i) v[i] = scalar(column, first + i % S, 0, 0);
      const __m128 four = _mm_loadu_ps(v);
      return _mm256_set_m128(four, four);
    }
  }
  static __m256 eight(const T* column, int64_t b, int64_t) {  // b: a multiple of 8, the first block of a super-block
    const T* super = super_of(column, b);
    const T* q = super + 4;
    const uint32_t low = word(q + 4) & 0x3F3F3F3Fu;
    const uint32_t high = ((word(q + 8) >> 4) & 0x0F0F0F0Fu) | (((word(q + 4) >> 6) & 0x03030303u) << 4);
    const __m128i bytes = _mm_set_epi32(0, 0, static_cast<int>(high), static_cast<int>(low));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    return _mm256_mul_ps(m, _mm256_set1_ps(-d_of(super, 2)));
  }
#endif
};

struct F32Lanes {
  using T = float;
  static constexpr bool kPerHalf = true;
  static int64_t stride(int64_t blocks) { return group_count(blocks) * 8; }
  static float scalar(const T* column, int64_t block, int64_t half, int64_t blocks) {
    const Group g = group_of(block, blocks);
    return column[g.index * 8 + half * 4 + (block - g.first)];
  }
#if SPECD_AVX2
  template <int S>
  static __m256 lanes(const T* column, int64_t g, int64_t) { return _mm256_loadu_ps(column + g * 8); }
#endif
};

struct Q6Lanes {
  using T = uint8_t;
  static constexpr bool kPerHalf = true;
  static constexpr int64_t kSuperBytes = 20;
  static int64_t stride(int64_t blocks) { return blocks / 8 * kSuperBytes; }
  static float scalar(const T* column, int64_t block, int64_t half, int64_t) {
    const T* super = column + block / 8 * kSuperBytes;
    const int64_t lane = block % 8 / 4 * 8 + half * 4 + block % 4;
    return float_at(super + 16) * static_cast<float>(static_cast<int8_t>(super[lane]));
  }
#if SPECD_AVX2
  template <int S>
  static __m256 lanes(const T* column, int64_t, int64_t first) {  // S == 4: rows are whole super-blocks
    const T* super = column + first / 8 * kSuperBytes;
    const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + first % 8 / 4 * 8));
    return _mm256_mul_ps(_mm256_set1_ps(float_at(super + 16)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
  }
#endif
};

// How a q8 weight column holds its codes, each 32 of them (one vector of the group order) in kVectorBytes bytes:
//   Int8Codes:   one signed byte per input.
//   SixBitCodes: GGUF Q6_K's codes q - 32 (-32..31) in six bits, 24 bytes per vector: bytes 0..15 hold its codes
//                j (low nibble) and 16 + j (high nibble) as q4 bytes do, then bytes 16..23 the top two bits, code
//                b + 8e in bits 2e, 2e + 1 of byte 16 + b. `load` gives the 32 signed bytes Int8Codes stores, so
//                the dots, sums and bits are Int8Codes'.
// `scalar` is the code at position `pos` of a row in group order (the scalar build).
struct Int8Codes {
  static constexpr int64_t kVectorBytes = 32;
  static int64_t column_bytes(int64_t k) { return k; }
  static int8_t scalar(const int8_t* column, int64_t pos) { return column[pos]; }
#if SPECD_AVX2
  static __m256i load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif
};

struct SixBitCodes {
  static constexpr int64_t kVectorBytes = 24;
  static int64_t column_bytes(int64_t k) { return k / 32 * kVectorBytes; }
  static int8_t scalar(const int8_t* column, int64_t pos) {
    const uint8_t* v = reinterpret_cast<const uint8_t*>(column) + pos / 32 * kVectorBytes;
    const int64_t j = pos % 32;
    const int low = j < 16 ? v[j] & 0x0F : v[j - 16] >> 4;
    const int high = (v[16 + j % 8] >> (2 * (j / 8))) & 3;
    return static_cast<int8_t>((low | (high << 4)) - 32);
  }
#if SPECD_AVX2
  // The nibbles as unpack_q4 gives them, the top bits broadcast to the four 64-bit lanes and shifted by 2e in lane e
  // (so byte 8e + b of the vector holds code b + 8e's), joined and moved down by 32.
  static __m256i load(const int8_t* p) {
    const uint8_t* v = reinterpret_cast<const uint8_t*>(p);
    int64_t bits;
    std::memcpy(&bits, v + 16, sizeof(bits));
    const __m256i high = _mm256_and_si256(
        _mm256_srlv_epi64(_mm256_set1_epi64x(bits), _mm256_setr_epi64x(0, 2, 4, 6)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(unpack_q4(v), _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
  }
#endif
};

#if SPECD_AVX2
// The float step every output element takes once per group: the integer dot times both scales.
inline __m256 accumulate(__m256i sums, __m256 w_scales, const float* x_scales, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(w_scales, _mm256_loadu_ps(x_scales)), acc);
}

// Calls step.template group<S>(group index, first block) for every group of a row of `blocks`, in order.
template <typename Step>
inline void for_each_group(int64_t blocks, const Step& step) {
  const int64_t full = blocks / 4, rest = blocks % 4;
  for (int64_t g = 0; g < full; ++g) step.template group<4>(g, 4 * g);
  int64_t g = full, first = 4 * full;
  if (rest >= 2) step.template group<2>(g++, first), first += 2;
  if (rest % 2 == 1) step.template group<1>(g, first);
}

// q4 tile: rows row0 .. row0 + R - 1 times columns col0 .. col0 + C - 1. Layout: F16Blocks or F32Blocks.
template <typename Layout>
struct Q4Tile {
  using LayoutType = Layout;
  using Scale = typename Layout::T;
  static constexpr bool kQ4 = true;
  const uint8_t* codes;  // [n, k / 2] in group order
  const Scale* scales;   // [n, Layout::stride(blocks)]
  const Scale* mins;     // [n, Layout::stride(blocks)]
  const QuantRows& x;
  int64_t blocks;
  int64_t scale_stride;

  const uint8_t* column_codes(int64_t col) const { return codes + col * (x.k / 2); }

  template <int R, int C>
  struct Step {
    const Q4Tile& tile;
    const uint8_t* w[C];
    const Scale* w_scales[C];
    const int8_t* xq[R];
    const float* x_scales[R];
    __m256* acc;  // [R][C]

    template <int S>
    void group(int64_t g, int64_t first) const {
      [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
      const int64_t prefetch = prefetch_distance<C>(tile.x.k / 2);
      for (int c = 0; c < C; ++c) {
        const uint8_t* wg = w[c] + first * 16;
        _mm_prefetch(reinterpret_cast<const char*>(wg + prefetch), _MM_HINT_T0);
        __m256i u[S];
        for (int t = 0; t < S; ++t) u[t] = unpack_q4(wg + 16 * t);
        const __m256 ws = Layout::template lanes<S>(w_scales[c], g, first);
        for (int r = 0; r < R; ++r) {
          const int8_t* xg = xq[r] + first * kBlock;
#if SPECD_VNNI
          __m256i s = SPECD_DPBUSD(_mm256_setzero_si256(), u[0], load32(xg));
          for (int t = 1; t < S; ++t) s = SPECD_DPBUSD(s, u[t], load32(xg + 32 * t));
          acc[r * C + c] = accumulate(s, ws, x_scales[r] + g * 8, acc[r * C + c]);
#else
          // int16 lanes add to at most 4 * 2 * 15 * 127 = 15240: no overflow before madd widens them.
          __m256i s = _mm256_maddubs_epi16(u[0], load32(xg));
          for (int t = 1; t < S; ++t) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[t], load32(xg + 32 * t)));
          acc[r * C + c] = accumulate(_mm256_madd_epi16(s, ones), ws, x_scales[r] + g * 8, acc[r * C + c]);
#endif
        }
      }
    }
  };

  template <int R, int C>
  void run(int64_t row0, int64_t col0, float* out, int64_t stride) const {  // out: [R, stride], C columns written
    __m256 acc[R * C];
    Step<R, C> step{*this, {}, {}, {}, {}, acc};
    for (int c = 0; c < C; ++c) {
      step.w[c] = column_codes(col0 + c);
      step.w_scales[c] = scales + (col0 + c) * scale_stride;
    }
    for (int r = 0; r < R; ++r) {
      step.xq[r] = x.row_codes(row0 + r);
      step.x_scales[r] = x.row_scales(row0 + r);
    }
    for (int i = 0; i < R * C; ++i) acc[i] = _mm256_setzero_ps();
    for_each_group(blocks, step);
    // the min term, 8 blocks per FMA into the same lanes (which lane a product lands in does not matter: all are
    // summed); the x sums past the last block are 0
    for (int64_t b = 0; b < blocks; b += 8) {
      for (int c = 0; c < C; ++c) {
        const __m256 wm = Layout::eight(mins + (col0 + c) * scale_stride, b, blocks);
        for (int r = 0; r < R; ++r) {
          acc[r * C + c] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(x.row_sums(row0 + r) + b), acc[r * C + c]);
        }
      }
    }
    for (int r = 0; r < R; ++r) reduce_store<C>(acc + r * C, out + r * stride);
  }
};

#if SPECD_ZMM
// Two columns' 256-bit vectors as one 512-bit vector: a in the lower half, b in the upper.
inline __m512 pair_of(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }
// A row's 32 activation codes in both halves (both columns of a pair read the same row).
inline __m512i load32_twice(const int8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load8_twice(const float* p) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }

// unpack_q4 of two columns' 16 bytes at once: [low nibbles of w0, high of w0, low of w1, high of w1].
inline __m512i unpack_q4_pair(const uint8_t* w0, const uint8_t* w1) {
  const __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w0)))),
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w1))), 1);
  return _mm512_and_si512(_mm512_srlv_epi32(both, _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4)),
                          _mm512_set1_epi8(0x0F));
}

// The 256-bit lanes' float step (`accumulate`), two columns at once.
inline __m512 accumulate_pair(__m512i sums, __m512 w_scales, const float* x_scales, __m512 acc) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(w_scales, load8_twice(x_scales)), acc);
}

// The R x 2P accumulators' halves back as 256-bit vectors, reduced and stored exactly as the 256-bit tile does.
template <int R, int P>
inline void reduce_store_pairs(const __m512* acc, float* out, int64_t stride) {
  static_assert(P == 2, "pair tiles are 4 columns wide");
  for (int r = 0; r < R; ++r) {
    const __m256 halves[4] = {_mm512_castps512_ps256(acc[r * P]), _mm512_extractf32x8_ps(acc[r * P], 1),
                              _mm512_castps512_ps256(acc[r * P + 1]), _mm512_extractf32x8_ps(acc[r * P + 1], 1)};
    reduce_store<4>(halves, out + r * stride);
  }
}

// What a pair tile reads: its 2P weight columns (codes, block scales) and R activation rows.
template <typename Code, typename Scale, int R, int P>
struct PairInputs {
  const Code* w[2 * P];
  const Scale* w_scales[2 * P];
  const int8_t* xq[R];
  const float* x_scales[R];

  template <typename Tile>  // Q4Tile or Q8Tile
  PairInputs(const Tile& tile, int64_t row0, int64_t col0) {
    for (int c = 0; c < 2 * P; ++c) {
      w[c] = tile.column_codes(col0 + c);
      w_scales[c] = tile.scales + (col0 + c) * tile.scale_stride;
    }
    for (int r = 0; r < R; ++r) {
      xq[r] = tile.x.row_codes(row0 + r);
      x_scales[r] = tile.x.row_scales(row0 + r);
    }
  }
};

// Q4Tile's 4-column tiles with column pairs in 512-bit vectors (see SPECD_ZMM).
template <typename Layout>
struct Q4PairTile {
  using Tile = Q4Tile<Layout>;
  const Tile& tile;

  template <int R, int P>
  struct Step {
    const Tile& tile;
    const PairInputs<uint8_t, typename Layout::T, R, P>& in;
    __m512* acc;  // [R][P]

    template <int S>
    void group(int64_t g, int64_t first) const {
      const int64_t prefetch = kPrefetchColumns * (tile.x.k / 2);
      const auto& [w, w_scales, xq, x_scales] = in;
      __m512i u[P][S];
      __m512 ws[P];
      for (int p = 0; p < P; ++p) {
        const uint8_t* w0 = w[2 * p] + first * 16;
        const uint8_t* w1 = w[2 * p + 1] + first * 16;
        _mm_prefetch(reinterpret_cast<const char*>(w0 + prefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w1 + prefetch), _MM_HINT_T0);
        for (int t = 0; t < S; ++t) u[p][t] = unpack_q4_pair(w0 + 16 * t, w1 + 16 * t);
        ws[p] = pair_of(Layout::template lanes<S>(w_scales[2 * p], g, first),
                        Layout::template lanes<S>(w_scales[2 * p + 1], g, first));
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xg = xq[r] + first * kBlock;
        __m512i xv[S];
        for (int t = 0; t < S; ++t) xv[t] = load32_twice(xg + 32 * t);
        for (int p = 0; p < P; ++p) {
          __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[p][0], xv[0]);
          for (int t = 1; t < S; ++t) s = _mm512_dpbusd_epi32(s, u[p][t], xv[t]);
          acc[r * P + p] = accumulate_pair(s, ws[p], x_scales[r] + g * 8, acc[r * P + p]);
        }
      }
    }
  };

  template <int R, int P>
  void run(int64_t row0, int64_t col0, float* out, int64_t stride) const {  // out: [R, stride], 2P columns written
    const int64_t blocks = tile.blocks;
    const PairInputs<uint8_t, typename Layout::T, R, P> in(tile, row0, col0);
    __m512 acc[R * P];
    for (int i = 0; i < R * P; ++i) acc[i] = _mm512_setzero_ps();
    for_each_group(blocks, Step<R, P>{tile, in, acc});
    for (int64_t b = 0; b < blocks; b += 8) {  // the min term, as Q4Tile::run
      for (int p = 0; p < P; ++p) {
        const __m512 wm = pair_of(Layout::eight(tile.mins + (col0 + 2 * p) * tile.scale_stride, b, blocks),
                                  Layout::eight(tile.mins + (col0 + 2 * p + 1) * tile.scale_stride, b, blocks));
        for (int r = 0; r < R; ++r) {
          acc[r * P + p] = _mm512_fmadd_ps(wm, load8_twice(tile.x.row_sums(row0 + r) + b), acc[r * P + p]);
        }
      }
    }
    reduce_store_pairs<R, P>(acc, out, stride);
  }
};
#endif

// q8 tile: as Q4Tile, int8 weights (maddubs wants an unsigned operand: |w| times x with w's sign moved onto it;
// pairs reach 2 * 127 * 127 = 32258, so each block is widened to int32 before any sum across blocks).
// Layout: F16Blocks, F32Lanes or Q6Lanes; Codes: Int8Codes or SixBitCodes.
template <typename Layout, typename Codes>
struct Q8Tile {
  using LayoutType = Layout;
  using CodesType = Codes;
  using Scale = typename Layout::T;
  static constexpr bool kQ4 = false;
  const int8_t* codes;  // [n, Codes::column_bytes(k)] in group order
  const Scale* scales;  // [n, Layout::stride(blocks)]
  const QuantRows& x;
  int64_t blocks;
  int64_t scale_stride;
  int64_t first_code_column = 0;  // codes starts at this column (unpacked_tile's few columns)

  const int8_t* column_codes(int64_t col) const { return codes + (col - first_code_column) * Codes::column_bytes(x.k); }

  template <int R, int C>
  struct Step {
    const Q8Tile& tile;
    const int8_t* w[C];
    const Scale* w_scales[C];
    const int8_t* xq[R];
    const float* x_scales[R];
    __m256* acc;  // [R][C]

    template <int S>
    void group(int64_t g, int64_t first) const {
      [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
      const int64_t prefetch = prefetch_distance<C>(Codes::column_bytes(tile.x.k));
      for (int c = 0; c < C; ++c) {
        const int8_t* wg = w[c] + first * Codes::kVectorBytes;
        for (int64_t at = 0; at < S * Codes::kVectorBytes; at += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(wg + prefetch + at), _MM_HINT_T0);
        }
        __m256i signs[S], magnitudes[S];
        for (int t = 0; t < S; ++t) {
          signs[t] = Codes::load(wg + Codes::kVectorBytes * t);
          magnitudes[t] = _mm256_sign_epi8(signs[t], signs[t]);
        }
        const __m256 ws = Layout::template lanes<S>(w_scales[c], g, first);
        for (int r = 0; r < R; ++r) {
          const int8_t* xg = xq[r] + first * kBlock;
#if SPECD_VNNI
          __m256i s = SPECD_DPBUSD(_mm256_setzero_si256(), magnitudes[0], _mm256_sign_epi8(load32(xg), signs[0]));
          for (int t = 1; t < S; ++t) s = SPECD_DPBUSD(s, magnitudes[t], _mm256_sign_epi8(load32(xg + 32 * t), signs[t]));
#else
          __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes[0], _mm256_sign_epi8(load32(xg), signs[0])),
                                        ones);
          for (int t = 1; t < S; ++t) {
            s = _mm256_add_epi32(s, _mm256_madd_epi16(
                                        _mm256_maddubs_epi16(magnitudes[t], _mm256_sign_epi8(load32(xg + 32 * t), signs[t])),
                                        ones));
          }
#endif
          acc[r * C + c] = accumulate(s, ws, x_scales[r] + g * 8, acc[r * C + c]);
        }
      }
    }
  };

  template <int R, int C>
  void run(int64_t row0, int64_t col0, float* out, int64_t stride) const {  // out: [R, stride], C columns written
    __m256 acc[R * C];
    Step<R, C> step{*this, {}, {}, {}, {}, acc};
    for (int c = 0; c < C; ++c) {
      step.w[c] = column_codes(col0 + c);
      step.w_scales[c] = scales + (col0 + c) * scale_stride;
    }
    for (int r = 0; r < R; ++r) {
      step.xq[r] = x.row_codes(row0 + r);
      step.x_scales[r] = x.row_scales(row0 + r);
    }
    for (int i = 0; i < R * C; ++i) acc[i] = _mm256_setzero_ps();
    for_each_group(blocks, step);
    for (int r = 0; r < R; ++r) reduce_store<C>(acc + r * C, out + r * stride);
  }
};

#if SPECD_ZMM
// Q8Tile's 4-column tiles with column pairs in 512-bit vectors. AVX-512 has no sign_epi8: the activation codes are
// negated where the weight is negative (a masked subtract); where it is 0 the magnitude is 0 and so is the product,
// so |w| * (sign-moved x) is w * x, the same integer as the 256-bit tile's.
template <typename Layout, typename Codes>
struct Q8PairTile {
  using Tile = Q8Tile<Layout, Codes>;
  const Tile& tile;

  template <int R, int P>
  struct Step {
    const Tile& tile;
    const PairInputs<int8_t, typename Layout::T, R, P>& in;
    __m512* acc;  // [R][P]

    template <int S>
    void group(int64_t g, int64_t first) const {
      const int64_t prefetch = kPrefetchColumns * Codes::column_bytes(tile.x.k);
      const auto& [w, w_scales, xq, x_scales] = in;
      __m512i magnitudes[P][S];
      __mmask64 negative[P][S];
      __m512 ws[P];
      for (int p = 0; p < P; ++p) {
        const int8_t* w0 = w[2 * p] + first * Codes::kVectorBytes;
        const int8_t* w1 = w[2 * p + 1] + first * Codes::kVectorBytes;
        for (int64_t at = 0; at < S * Codes::kVectorBytes; at += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(w0 + prefetch + at), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(w1 + prefetch + at), _MM_HINT_T0);
        }
        for (int t = 0; t < S; ++t) {
          const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(Codes::load(w0 + Codes::kVectorBytes * t)),
                                                   Codes::load(w1 + Codes::kVectorBytes * t), 1);
          negative[p][t] = _mm512_movepi8_mask(codes);
          magnitudes[p][t] = _mm512_abs_epi8(codes);
        }
        ws[p] = pair_of(Layout::template lanes<S>(w_scales[2 * p], g, first),
                        Layout::template lanes<S>(w_scales[2 * p + 1], g, first));
      }
      const __m512i zero = _mm512_setzero_si512();
      for (int r = 0; r < R; ++r) {
        const int8_t* xg = xq[r] + first * kBlock;
        __m512i xv[S];
        for (int t = 0; t < S; ++t) xv[t] = load32_twice(xg + 32 * t);
        for (int p = 0; p < P; ++p) {
          __m512i s = _mm512_dpbusd_epi32(zero, magnitudes[p][0], _mm512_mask_sub_epi8(xv[0], negative[p][0], zero, xv[0]));
          for (int t = 1; t < S; ++t) {
            s = _mm512_dpbusd_epi32(s, magnitudes[p][t], _mm512_mask_sub_epi8(xv[t], negative[p][t], zero, xv[t]));
          }
          acc[r * P + p] = accumulate_pair(s, ws[p], x_scales[r] + g * 8, acc[r * P + p]);
        }
      }
    }
  };

  template <int R, int P>
  void run(int64_t row0, int64_t col0, float* out, int64_t stride) const {  // out: [R, stride], 2P columns written
    const PairInputs<int8_t, typename Layout::T, R, P> in(tile, row0, col0);
    __m512 acc[R * P];
    for (int i = 0; i < R * P; ++i) acc[i] = _mm512_setzero_ps();
    for_each_group(tile.blocks, Step<R, P>{tile, in, acc});
    reduce_store_pairs<R, P>(acc, out, stride);
  }
};

// A 4-column tile of `rows` (3..8) with column pairs in 512-bit vectors: 32 registers hold 8 rows' accumulators
// (16) beside a group's unpacked weights (8), so each unpacked group serves up to 8 rows (measured: 5-16 rows
// 5-14 % faster than 4-row pair tiles, the same at 1-4).
template <typename PairTile>
void run_pair_tile(const PairTile& pairs, int64_t rows, int64_t row0, int64_t col0, float* out) {
  switch (rows) {
    case 3: return pairs.template run<3, 2>(row0, col0, out, 4);
    case 4: return pairs.template run<4, 2>(row0, col0, out, 4);
    case 5: return pairs.template run<5, 2>(row0, col0, out, 4);
    case 6: return pairs.template run<6, 2>(row0, col0, out, 4);
    case 7: return pairs.template run<7, 2>(row0, col0, out, 4);
    default: return pairs.template run<8, 2>(row0, col0, out, 4);
  }
}
#endif

// One tile of `rows` (1..4) x 4 columns into out [rows, 4]: 1-2 rows a column at a time, 3-4 rows as two halves of
// 2 columns, so a tile's accumulators stay in registers. (Measured: 5-8 rows a column at a time, each unpacked group
// serving 8 rows, ran 4-12% slower than two 4-row tiles.)
template <typename Tile>
void run_tile(const Tile& tile, int64_t rows, int64_t row0, int64_t col0, float* out) {
#if SPECD_ZMM
  // 1-2 rows stay 256-bit: there the pairs' extra shuffles cost more than their halved dots save (measured: q4
  // 3-19 % slower at 1-2 rows, 8-23 % faster at 4-16; bench/gemm_rows.py)
  if (rows >= 3) {
    if constexpr (Tile::kQ4) {
      return run_pair_tile(Q4PairTile<typename Tile::LayoutType>{tile}, rows, row0, col0, out);
    } else {
      return run_pair_tile(Q8PairTile<typename Tile::LayoutType, typename Tile::CodesType>{tile}, rows, row0, col0, out);
    }
  }
#endif
  switch (rows) {
    // 1-2 rows: a column at a time, so the weights stream from memory in one sequential run (a 4-column tile reads
    // four streams a row apart, which the CPU's prefetchers follow worse: measured at 1 row on a 2-core EPYC,
    // 8192 x 2048 q4, cold: 23 GB/s as 4-column tiles, 44 GB/s a column at a time; a column's bits are the same
    // in either, see reduce_store)
    case 1: for (int c = 0; c < 4; ++c) tile.template run<1, 1>(row0, col0 + c, out + c, 4); return;
    case 2: for (int c = 0; c < 4; ++c) tile.template run<2, 1>(row0, col0 + c, out + c, 4); return;
    case 3: for (int h = 0; h < 2; ++h) tile.template run<3, 2>(row0, col0 + 2 * h, out + 2 * h, 4); return;
    default: for (int h = 0; h < 2; ++h) tile.template run<4, 2>(row0, col0 + 2 * h, out + 2 * h, 4);
  }
}

// One column (the last columns when the count is not a multiple of 4) for `rows` rows into out [rows].
template <typename Tile>
void run_column(const Tile& tile, int64_t rows, int64_t row0, int64_t col, float* out) {
  switch (rows) {
    case 1: tile.template run<1, 1>(row0, col, out, 1); return;
    case 2: tile.template run<2, 1>(row0, col, out, 1); return;
    case 3: tile.template run<3, 1>(row0, col, out, 1); return;
    default: tile.template run<4, 1>(row0, col, out, 1);
  }
}

// Six-bit codes at more rows than one tile holds: a 4-column tile's codes are unpacked once into int8 (4 x k bytes,
// which stay in cache) and every row tile reads them as Int8Codes, the same integers and so the same bits; unpacked
// in the tiles instead, each row tile would redo it (measured: prefill through Q6_K weights ~1.5x slower).
template <typename Tile>
constexpr bool kSixBit = false;
template <typename Layout>
constexpr bool kSixBit<Q8Tile<Layout, SixBitCodes>> = true;

template <typename Layout>
Q8Tile<Layout, Int8Codes> unpacked_tile(const Q8Tile<Layout, SixBitCodes>& tile, int8_t* buffer, int64_t col0,
                                        int64_t cols) {
  const int64_t k = tile.x.k, vectors = k / kBlock;
  for (int64_t c = 0; c < cols; ++c) {
    const int8_t* src = tile.column_codes(col0 + c);
    int8_t* dst = buffer + c * k;
    for (int64_t v = 0; v < vectors; ++v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + v * kBlock), SixBitCodes::load(src + v * SixBitCodes::kVectorBytes));
    }
  }
  return Q8Tile<Layout, Int8Codes>{buffer, tile.scales, tile.x, tile.blocks, tile.scale_stride, col0};
}

// Writes out[m, n] for every row and column by tiles of up to kMaxTileRows rows x 4 columns (the columns past the
// last whole tile a column at a time, by up to 4 rows), column tiles split over threads.
template <typename Tile>
at::Tensor run_tiles(const Tile& tile, int64_t rows, int64_t cols, at::ScalarType out_dtype) {
  constexpr int64_t kCols = 4;
  at::Tensor out = at::empty({rows, cols}, at::TensorOptions().dtype(out_dtype));
  const bool bf16 = out_dtype == at::kBFloat16;
  float* out_f = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* out_b = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  const int64_t col_tiles = (cols + kCols - 1) / kCols;
  const bool unpack = kSixBit<Tile> && rows > kMaxTileRows;
  at::parallel_for(0, col_tiles, 2, [&](int64_t begin, int64_t end) {
    float results[kMaxTileRows * kCols];
    std::vector<int8_t> buffer(unpack ? static_cast<size_t>(kCols * tile.x.k) : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t col0 = t * kCols, num_cols = std::min(kCols, cols - col0);
      const auto column_tile = [&](const auto& use) {  // every row of columns col0 .. col0 + num_cols - 1
        for (int64_t row0 = 0; row0 < rows; row0 += kMaxTileRows) {
          const int64_t num_rows = std::min(kMaxTileRows, rows - row0);
          if (num_cols == kCols) {
            run_tile(use, num_rows, row0, col0, results);
          } else {
            float column[4];
            for (int64_t c = 0; c < num_cols; ++c) {
              for (int64_t r0 = 0; r0 < num_rows; r0 += 4) {
                const int64_t n = std::min<int64_t>(4, num_rows - r0);
                run_column(use, n, row0 + r0, col0 + c, column);
                for (int64_t r = 0; r < n; ++r) results[(r0 + r) * kCols + c] = column[r];
              }
            }
          }
          for (int64_t r = 0; r < num_rows; ++r) {
            for (int64_t c = 0; c < num_cols; ++c) {
              const float value = results[r * kCols + c];
              const int64_t index = (row0 + r) * cols + col0 + c;
              if (bf16) {
                out_b[index] = at::BFloat16(value);
              } else {
                out_f[index] = value;
              }
            }
          }
        }
      };
      if constexpr (kSixBit<Tile>) {
        if (unpack) {
          column_tile(unpacked_tile(tile, buffer.data(), col0, num_cols));
          continue;
        }
      }
      column_tile(tile);
    }
  });
  return out;
}
#else
// Scalar: one output element at a time, integer block dots read through the group order.
template <typename Layout>
inline float dot_q4(const uint8_t* w, const typename Layout::T* w_scale, const typename Layout::T* w_min,
                    const QuantRows& x, int64_t row, int64_t blocks) {
  const int8_t* xr = x.row_codes(row);
  float acc = 0.f, min_part = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t dot = 0;
    for (int64_t p = 0; p < 16; ++p) {
      const uint8_t byte = w[q4_byte_position(b, p, blocks)];
      dot += static_cast<int32_t>(byte & 0x0F) * xr[input_position(b, p, blocks)] +
             static_cast<int32_t>(byte >> 4) * xr[input_position(b, p + 16, blocks)];
    }
    const Group g = group_of(b, blocks);
    const int64_t lane = g.index * 8 + (b - g.first);  // the block's first lane
    acc += static_cast<float>(dot) * (Layout::scalar(w_scale, b, 0, blocks) * x.row_scales(row)[lane]);
    min_part += Layout::scalar_min(w_min, b, blocks) * x.row_sums(row)[b];
  }
  return acc + min_part;
}

template <typename Layout, typename Codes>
inline float dot_q8(const int8_t* w, const typename Layout::T* w_scale, const QuantRows& x, int64_t row,
                    int64_t blocks) {
  const int8_t* xr = x.row_codes(row);
  float acc = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t dots[2] = {0, 0};  // inputs 0..15 and 16..31
    // w and x share the group order, so a block's inputs are at the same positions in both
    for (int64_t i = 0; i < kBlock; ++i) {
      const int64_t pos = input_position(b, i, blocks);
      dots[i / 16] += static_cast<int32_t>(Codes::scalar(w, pos)) * xr[pos];
    }
    const Group g = group_of(b, blocks);
    const float x_scale = x.row_scales(row)[g.index * 8 + (b - g.first)];
    if constexpr (Layout::kPerHalf) {
      for (int64_t h = 0; h < 2; ++h) acc += static_cast<float>(dots[h]) * (Layout::scalar(w_scale, b, h, blocks) * x_scale);
    } else {
      acc += static_cast<float>(dots[0] + dots[1]) * (Layout::scalar(w_scale, b, 0, blocks) * x_scale);
    }
  }
  return acc;
}

template <typename Dot>
at::Tensor run_columns(int64_t rows, int64_t cols, at::ScalarType out_dtype, const Dot& dot) {
  at::Tensor out = at::empty({rows, cols}, at::TensorOptions().dtype(out_dtype));
  const bool bf16 = out_dtype == at::kBFloat16;
  float* out_f = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* out_b = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, cols, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < rows; ++m) {
        const float value = dot(m, n);
        if (bf16) {
          out_b[m * cols + n] = at::BFloat16(value);
        } else {
          out_f[m * cols + n] = value;
        }
      }
    }
  });
  return out;
}
#endif

void check_activations(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), op, ": x must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " inputs, the weight ", k);
  TORCH_CHECK(k % kBlock == 0, op, ": inputs must be a multiple of 32, got ", k);
}

QuantRows quantize(const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16) {
    return quantize_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1));
  }
  return quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1));
}

at::ScalarType output_dtype(const at::Tensor& x, bool float_out) {
  return float_out ? at::kFloat : x.scalar_type();
}

}  // namespace

template <typename Layout>
at::Tensor q4_run(const at::Tensor& x, const QuantRows& q, const at::Tensor& codes, const at::Tensor& scales,
                  const at::Tensor& mins, bool float_out) {
  using T = typename Layout::T;
  const int64_t n = codes.size(0), k = codes.size(1) * 2, blocks = k / kBlock, stride = Layout::stride(blocks);
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const T* ws = scales.data_ptr<T>();
  const T* wm = std::is_same_v<Layout, KBlocks> ? ws : mins.data_ptr<T>();  // KBlocks: the mins are in the scales
#if SPECD_AVX2
  return run_tiles(Q4Tile<Layout>{w, ws, wm, q, blocks, stride}, x.size(0), n, output_dtype(x, float_out));
#else
  return run_columns(x.size(0), n, output_dtype(x, float_out), [&](int64_t row, int64_t col) {
    return dot_q4<Layout>(w + col * (k / 2), ws + col * stride, wm + col * stride, q, row, blocks);
  });
#endif
}

// x: [m, k] float32/bfloat16; codes: [n, k / 2] uint8 in group order; scales, mins: [n, k / 32] float16 (F16Blocks)
// or float32 (F32Blocks); or scales [n, k / 256 * 16] uint8 (KBlocks) with mins [n, 0].
// Returns [m, n] in x's dtype, or float32 when float_out.
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     bool float_out) {
  const int64_t n = codes.size(0), k = codes.size(1) * 2, blocks = k / kBlock;
  check_activations(x, k, "q4_linear");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "q4_linear: codes must be contiguous uint8");
  const at::ScalarType scale_type = scales.scalar_type();
  if (scale_type == at::kByte) {
    TORCH_CHECK(blocks % 8 == 0, "q4_linear: K-quant scales need inputs in whole super-blocks of 256, got ", k);
    TORCH_CHECK(scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == n &&
                    scales.size(1) == KBlocks::stride(blocks) && mins.dim() == 2 && mins.size(0) == n &&
                    mins.size(1) == 0,
                "q4_linear: K-quant scales must be contiguous uint8 [", n, ", ", KBlocks::stride(blocks),
                "] and mins [", n, ", 0]");
    const QuantRows q = quantize(x);
    return q4_run<KBlocks>(x, q, codes, scales, mins, float_out);
  }
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK((scale_type == at::kHalf || scale_type == at::kFloat) && t->scalar_type() == scale_type &&
                    t->is_contiguous() && t->dim() == 2 && t->size(0) == n && t->size(1) == blocks,
                "q4_linear: scales and mins must be contiguous [", n, ", ", blocks,
                "], both float16 or both float32");
  }
  const QuantRows q = quantize(x);
  if (scale_type == at::kHalf) return q4_run<F16Blocks>(x, q, codes, scales, mins, float_out);
  return q4_run<F32Blocks>(x, q, codes, scales, mins, float_out);
}

template <typename Layout, typename Codes>
at::Tensor q8_run(const at::Tensor& x, const QuantRows& q, const at::Tensor& codes, const at::Tensor& scales,
                  bool float_out) {
  using T = typename Layout::T;
  const int64_t n = codes.size(0), k = x.size(1), blocks = k / kBlock, stride = Layout::stride(blocks);
  const int8_t* w = static_cast<const int8_t*>(codes.data_ptr());
  const T* ws = scales.data_ptr<T>();
#if SPECD_AVX2
  return run_tiles(Q8Tile<Layout, Codes>{w, ws, q, blocks, stride}, x.size(0), n, output_dtype(x, float_out));
#else
  return run_columns(x.size(0), n, output_dtype(x, float_out), [&](int64_t row, int64_t col) {
    return dot_q8<Layout, Codes>(w + col * Codes::column_bytes(k), ws + col * stride, q, row, blocks);
  });
#endif
}

// x: [m, k] float32/bfloat16; codes: [n, k] int8 in group order with scales [n, k / 32] float16 (F16Blocks) or
// [n, groups * 8] float32 (F32Lanes: a scale per 16 inputs, in lane order); or six-bit codes [n, k / 32 * 24] uint8
// (SixBitCodes) with scales [n, k / 256 * 20] uint8 (Q6Lanes).
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool float_out) {
  const bool six_bit = codes.scalar_type() == at::kByte;
  TORCH_CHECK((six_bit || codes.scalar_type() == at::kChar) && codes.is_contiguous() && codes.dim() == 2,
              "q8_linear: codes must be contiguous 2-D int8, or uint8 (six-bit codes)");
  TORCH_CHECK(!six_bit || codes.size(1) % SixBitCodes::kVectorBytes == 0,
              "q8_linear: six-bit codes must be 24 bytes per 32 inputs, got ", codes.size(1), " bytes a row");
  const int64_t n = codes.size(0), k = six_bit ? codes.size(1) / SixBitCodes::kVectorBytes * kBlock : codes.size(1);
  const int64_t blocks = k / kBlock;
  check_activations(x, k, "q8_linear");
  if (six_bit) {
    TORCH_CHECK(blocks % 8 == 0, "q8_linear: six-bit codes need inputs in whole super-blocks of 256, got ", k);
    TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.dim() == 2 &&
                    scales.size(0) == n && scales.size(1) == Q6Lanes::stride(blocks),
                "q8_linear: six-bit codes take Q6_K scales, contiguous uint8 [", n, ", ", Q6Lanes::stride(blocks),
                "]");
    const QuantRows q = quantize(x);
    return q8_run<Q6Lanes, SixBitCodes>(x, q, codes, scales, float_out);
  }
  const bool lanes = scales.scalar_type() == at::kFloat;
  const int64_t width = lanes ? F32Lanes::stride(blocks) : blocks;
  TORCH_CHECK((lanes || scales.scalar_type() == at::kHalf) && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == width,
              "q8_linear: scales must be contiguous float16 [", n, ", ", blocks, "] or float32 lanes [", n, ", ",
              F32Lanes::stride(blocks), "]");
  const QuantRows q = quantize(x);
  if (lanes) return q8_run<F32Lanes, Int8Codes>(x, q, codes, scales, float_out);
  return q8_run<F16Blocks, Int8Codes>(x, q, codes, scales, float_out);
}

// How many distinct threads at::parallel_for runs a loop of `items` on here (1 in a build without OpenMP).
int64_t parallel_width(int64_t items) {
  std::vector<int> used(static_cast<size_t>(std::max<int64_t>(at::get_num_threads(), 1)), 0);
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    const int thread = at::get_thread_num();
    if (thread >= 0 && thread < static_cast<int>(used.size())) used[thread] = 1;  // each thread writes its own slot
  });
  return std::count(used.begin(), used.end(), 1);
}

bool uses_avx2() { return SPECD_AVX2 != 0; }
bool uses_vnni() { return SPECD_VNNI != 0; }
bool uses_zmm() { return SPECD_ZMM != 0; }

// q4_linear's address for specd's fused decoder layer (fused_ops.cpp), which calls it between its own ops: the
// layer then runs this very code, compiled with this file's flags, so its GEMMs are the same bits as q4_linear's
// from Python. The capsule's name is what the layer checks before it calls through the pointer.
py::capsule q4_linear_capsule() {
  using Q4Linear = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
  const Q4Linear function = &q4_linear;
  return py::capsule(reinterpret_cast<void*>(function), "specd.q4_linear");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "int4-block weight x int8-quantised activation GEMM");
  m.def("q8_linear", &q8_linear, "int8-block weight x int8-quantised activation GEMM");
  m.def("parallel_width", &parallel_width, "how many threads at::parallel_for runs a loop of `items` on");
  m.def("uses_avx2", &uses_avx2, "whether this build runs the AVX2 kernels");
  m.def("uses_vnni", &uses_vnni, "whether its integer dots are VNNI dpbusd (same bits, fewer instructions)");
  m.def("uses_zmm", &uses_zmm, "whether 4-column tiles hold two columns per 512-bit vector (same bits)");
  m.def("q4_linear_capsule", &q4_linear_capsule, "q4_linear's address, for the fused decoder layer");
  m.def("repack_gguf", &repack_gguf, "a GGUF tensor's raw blocks -> the kernels' weight fields (gguf_repack.cpp)");
  m.def("dequantize_gguf", &dequantize_gguf, "a GGUF tensor's raw blocks -> their values, into out");
}
