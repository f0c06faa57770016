// Fused per-layer ops for a bfloat16 decoder layer on CPU: one call where torch's composite makes several.
//
//   rms_norm        y = x * rsqrt(mean(x^2) + eps) * w                         (float32 inside, one rounding)
//   add_rms_norm    h = bf16(x + delta); y = rms_norm(h)                         (the residual add and the next norm)
//   silu_mul        y = bf16(bf16(silu(gate)) * up) over the fused gate|up projection output
//   rope_write_kv   rotate the q and k heads in place (rotate-half, tables from Rotary.tables), then copy each
//                   token's k and v heads into the KV cache at (slot, position)
//   attention       each query row over its own sequence's cached keys 0..its position: no padding, no mask,
//                   scores, softmax and the weighted sum of values in float32, one rounding at the end
//   decoder_layers  a run of an int4 model's decoder layers in one call: per layer the ops above and specd's
//                   q4 GEMM (quant_gemm.cpp, called through the address its extension hands out) in the order
//                   DecoderLayer._forward_fused calls them from Python, so the same bits without ~14 Python
//                   calls per layer
//   prompt_linear   prompt rows through a dense bfloat16 copy of a q4 weight (oneDNN: AMX tiles where the CPU has
//                   them, ~10x less time per row than the q4 kernel there), in tiles of a fixed kPromptTile rows
//                   so that a row's result never depends on how many rows share the call; decoder_layers sends a
//                   step's prompt rows through it when the stack holds the dense copies
//
// The roundings to bfloat16 are where torch's composite rounds (a residual sum, SiLU's output, each rotary
// product), so these ops agree with it up to float32 summation order; attention rounds less often than torch's
// bfloat16 matmuls (its scores and probabilities stay float32).
//
// Every output row is computed by the same code from its own inputs, whatever else is in the batch and however
// the work is split over threads: a token's result does not depend on its neighbours, which keeps greedy
// speculative verification token-identical to plain decoding. With AVX2 + FMA the inner loops are intrinsics;
// without them (SPECD_SCALAR, or a compiler without the ISA flags) the same arithmetic runs as scalar loops.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(SPECD_SCALAR)
#define SPECD_AVX2 1
#include <immintrin.h>
#else
#define SPECD_AVX2 0
#endif

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kSerialWork = 1 << 16;  // below this many multiply-adds an op runs on the calling thread

inline float to_float(bf16 v) { return static_cast<float>(v); }

// Rows per parallel chunk so that a chunk holds at least kSerialWork of work (small batches stay serial).
inline int64_t grain_rows(int64_t work_per_row) { return std::max<int64_t>(1, kSerialWork / std::max<int64_t>(1, work_per_row)); }

#if SPECD_AVX2
inline __m256 load8(const bf16* p) {  // 8 bfloat16 -> 8 float32 (exact)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 88: Cody-Waite reduction by ln 2 and a degree-6 polynomial (the Cephes expf constants),
// within 2 float32 ulp; inputs below -87.3 give 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  const __m256 too_small = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(too_small, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}
#endif

// sum_i a[i] * b[i], a float32, b bfloat16.
inline float dot(const float* a, const bf16* b, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if SPECD_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
  total = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) total += a[i] * to_float(b[i]);
  return total;
}

// acc[i] += w * b[i], b bfloat16.
inline void axpy(float* acc, float w, const bf16* b, int64_t n) {
  int64_t i = 0;
#if SPECD_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, load8(b + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += w * to_float(b[i]);
}

// scores[i] = exp(scores[i] - max); returns the sum.
inline float exp_shifted(float* scores, int64_t n, float max_score) {
  int64_t i = 0;
  float total = 0.f;
#if SPECD_AVX2
  const __m256 m = _mm256_set1_ps(max_score);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), m));
    _mm256_storeu_ps(scores + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) {
    scores[i] = std::exp(scores[i] - max_score);
    total += scores[i];
  }
  return total;
}

// sum of squares of a bfloat16 row, in float32.
inline float sum_squares(const bf16* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if SPECD_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) total += to_float(x[i]) * to_float(x[i]);
  return total;
}

void check_bf16(const torch::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu(), name, ": must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, ": must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dims, name, ": must have ", dims, " dimensions, got ", t.dim());
}

void check_index(const torch::Tensor& t, const char* name, int64_t length) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(), name,
              ": must be a contiguous 1-d int64 CPU tensor");
  TORCH_CHECK(t.size(0) == length, name, ": must have ", length, " entries, got ", t.size(0));
}

void norm_row(const bf16* x, const bf16* w, bf16* y, int64_t d, float eps) {
  const float rstd = 1.f / std::sqrt(sum_squares(x, d) / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = bf16(to_float(x[i]) * rstd * to_float(w[i]));
}

torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& weight_in, double eps) {
  // x: [rows, d] bfloat16; weight: [d] bfloat16 -> [rows, d]
  check_bf16(x_in, "x", 2);
  check_bf16(weight_in, "weight", 1);
  const auto x = x_in.contiguous();
  const auto weight = weight_in.contiguous();
  const int64_t rows = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.size(0) == d, "weight: must have ", d, " entries, got ", weight.size(0));
  auto y = torch::empty_like(x);
  const bf16 *xp = x.data_ptr<bf16>(), *wp = weight.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * d, wp, yp + r * d, d, static_cast<float>(eps));
  });
  return y;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x_in, const torch::Tensor& delta_in,
                                                      const torch::Tensor& weight_in, double eps) {
  // x, delta: [rows, d] bfloat16; weight: [d] -> (x + delta [rows, d], rms_norm(x + delta) [rows, d])
  check_bf16(x_in, "x", 2);
  check_bf16(delta_in, "delta", 2);
  check_bf16(weight_in, "weight", 1);
  const auto x = x_in.contiguous();
  const auto delta = delta_in.contiguous();
  const auto weight = weight_in.contiguous();
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta: must have x's shape ", x.sizes(), ", got ", delta.sizes());
  const int64_t rows = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.size(0) == d, "weight: must have ", d, " entries, got ", weight.size(0));
  auto sum = torch::empty_like(x);
  auto y = torch::empty_like(x);
  const bf16 *xp = x.data_ptr<bf16>(), *dp = delta.data_ptr<bf16>(), *wp = weight.data_ptr<bf16>();
  bf16 *sp = sum.data_ptr<bf16>(), *yp = y.data_ptr<bf16>();
  at::parallel_for(0, rows, grain_rows(3 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < d; ++i) sp[r * d + i] = bf16(to_float(xp[r * d + i]) + to_float(dp[r * d + i]));
      norm_row(sp + r * d, wp, yp + r * d, d, static_cast<float>(eps));
    }
  });
  return {sum, y};
}

torch::Tensor silu_mul(const torch::Tensor& gate_up_in) {
  // gate_up: [rows, 2 * inner] bfloat16 (gate columns, then up columns) -> [rows, inner]
  check_bf16(gate_up_in, "gate_up", 2);
  const auto gate_up = gate_up_in.contiguous();
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: must have an even number of columns, got ", gate_up.size(1));
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto y = torch::empty({rows, inner}, gate_up.options());
  const bf16* gp = gate_up.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, rows, grain_rows(8 * inner), [&](int64_t begin, int64_t end) {
    std::vector<float> e(inner);
    for (int64_t r = begin; r < end; ++r) {
      const bf16* gate = gp + r * 2 * inner;
      const bf16* up = gate + inner;
      int64_t i = 0;
#if SPECD_AVX2
      for (; i + 8 <= inner; i += 8) _mm256_storeu_ps(e.data() + i, exp8(_mm256_sub_ps(_mm256_setzero_ps(), load8(gate + i))));
#endif
      for (; i < inner; ++i) e[i] = std::exp(-to_float(gate[i]));
      for (i = 0; i < inner; ++i) {
        const bf16 silu = bf16(to_float(gate[i]) / (1.f + e[i]));  // torch rounds SiLU's output before the product
        yp[r * inner + i] = bf16(to_float(silu) * to_float(up[i]));
      }
    }
  });
  return y;
}

void rope_write_kv(torch::Tensor heads, const torch::Tensor& cos_in, const torch::Tensor& sin_in, torch::Tensor kv,
                   const torch::Tensor& write_slots, const torch::Tensor& write_positions) {
  // heads: [tokens, num_heads + 2 * num_kv_heads, head_dim] bfloat16 contiguous: q heads, k heads, v heads.
  // cos, sin_signed: [tokens, num_heads + num_kv_heads, head_dim] (Rotary.tables). kv: [2, slots, num_kv_heads,
  // capacity, head_dim] contiguous. write_slots, write_positions: [tokens] int64.
  check_bf16(heads, "heads", 3);
  check_bf16(cos_in, "cos", 3);
  check_bf16(sin_in, "sin_signed", 3);
  check_bf16(kv, "kv", 5);
  TORCH_CHECK(heads.is_contiguous() && kv.is_contiguous(), "heads, kv: must be contiguous (both are written)");
  const auto cos = cos_in.contiguous();
  const auto sin_signed = sin_in.contiguous();
  const int64_t tokens = heads.size(0), head_dim = heads.size(2);
  const int64_t num_kv_heads = kv.size(2), num_slots = kv.size(1), capacity = kv.size(3);
  const int64_t num_qk = heads.size(1) - num_kv_heads;
  TORCH_CHECK(kv.size(0) == 2 && kv.size(4) == head_dim, "kv: must be [2, slots, kv heads, capacity, ", head_dim,
              "], got ", kv.sizes());
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "heads: head_dim must be even and <= ", kMaxHeadDim);
  TORCH_CHECK(num_qk > num_kv_heads, "heads: must hold q, k and v heads for ", num_kv_heads, " kv heads");
  TORCH_CHECK(cos.sizes() == sin_signed.sizes() && cos.size(0) == tokens && cos.size(1) == num_qk &&
                  cos.size(2) == head_dim,
              "cos, sin_signed: must be [", tokens, ", ", num_qk, ", ", head_dim, "], got ", cos.sizes());
  check_index(write_slots, "write_slots", tokens);
  check_index(write_positions, "write_positions", tokens);
  const int64_t* slots = write_slots.data_ptr<int64_t>();
  const int64_t* positions = write_positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_slots: slot ", slots[t], " outside 0..", num_slots - 1);
    TORCH_CHECK(positions[t] >= 0 && positions[t] < capacity, "write_positions: position ", positions[t],
                " outside the cache's capacity ", capacity);
  }
  bf16* hp = heads.data_ptr<bf16>();
  const bf16 *cp = cos.data_ptr<bf16>(), *sp = sin_signed.data_ptr<bf16>();
  bf16* kvp = kv.data_ptr<bf16>();
  const int64_t half = head_dim / 2, row = heads.size(1) * head_dim;
  at::parallel_for(0, tokens, grain_rows(3 * num_qk * head_dim), [&](int64_t begin, int64_t end) {
    float x[kMaxHeadDim];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < num_qk; ++h) {
        bf16* head = hp + t * row + h * head_dim;
        const bf16* c = cp + (t * num_qk + h) * head_dim;
        const bf16* s = sp + (t * num_qk + h) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) x[i] = to_float(head[i]);
        for (int64_t i = 0; i < head_dim; ++i) {
          const float x_cos = to_float(bf16(x[i] * to_float(c[i])));  // torch rounds x * cos before the addcmul
          const float rolled = x[i < half ? i + half : i - half];
          head[i] = bf16(x_cos + rolled * to_float(s[i]));
        }
      }
      for (int64_t which = 0; which < 2; ++which) {  // keys, then values
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const bf16* src = hp + t * row + (num_qk - num_kv_heads + which * num_kv_heads + h) * head_dim;
          bf16* dst = kvp + (((which * num_slots + slots[t]) * num_kv_heads + h) * capacity + positions[t]) * head_dim;
          std::memcpy(dst, src, head_dim * sizeof(bf16));
        }
      }
    }
  });
}

#if SPECD_AVX2
constexpr int64_t kMaxHeads = 4;  // query heads of one kv head attended together (their sums fill 8-12 registers)

// float32 -> bfloat16 bits in the upper half of each lane, rounded as at::BFloat16(float) rounds: to nearest,
// ties to even, any NaN to 0x7FC0.
inline __m256i round_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
}

// The inverse of load16_split: elements 0, 2, .., 14 from `even`, 1, 3, .., 15 from `odd`, each rounded to bfloat16.
inline void store16_merged(bf16* p, __m256 even, __m256 odd) {
  const __m256i merged = _mm256_or_si256(_mm256_srli_epi32(round_bf16(even), 16),
                                         _mm256_and_si256(round_bf16(odd), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), merged);
}

inline float max_of(const float* x, int64_t n) {  // n >= 1
  int64_t i = 0;
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  float out = hmax(m);
  for (; i < n; ++i) out = std::max(out, x[i]);
  return out;
}

// 16 bfloat16 -> float32, split by parity: (even) elements 0, 2, .., 14 and (odd) 1, 3, .., 15. Two bit operations
// and no shuffle (load8's widening is a lane-crossing shuffle: the attention loops were bound by it).
inline void load16_split(const bf16* p, __m256& even, __m256& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// NH query heads over the same len keys and values: q [NH, d] float32 (scaled, each 16-element chunk split by
// parity as load16_split splits a key), keys/values [len, d] bfloat16, scores [NH, len] scratch, out [NH, d]
// bfloat16; d % 16 == 0. A score sums each parity's products per lane over the chunks in order, then
// hsum(even + odd); each output element sums weight x value over the keys in order (as axpy does), then one
// rounding. A head's arithmetic does not depend on the heads beside it, the keys' count or the batch.
template <int NH>
void attend_heads(const float* q, const bf16* keys, const bf16* values, int64_t len, int64_t d, float* scores,
                  bf16* out) {
  // The running sums are named variables, not arrays: GCC kept array elements in registers but also stored them
  // to the stack on every key, which made the value loop store-bound.
  static_assert(NH >= 1 && NH <= kMaxHeads, "NH: 1..kMaxHeads heads");
  const __m256 zero = _mm256_setzero_ps();
  const auto record = [&](int h, int64_t p, __m256 even, __m256 odd) {
    scores[h * len + p] = hsum(_mm256_add_ps(even, odd));
  };
  for (int64_t p = 0; p < len; ++p) {
    const bf16* key = keys + p * d;
    // This key's value row, read after the softmax 16 elements at a time (a strided walk the hardware prefetcher
    // does not follow; the cache comes from memory, each step reads it once): in cache by then. Prefetching the
    // keys ahead measured no faster, they are read in order.
    const char* value_row = reinterpret_cast<const char*>(values + p * d);
    for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(bf16)); b += 64) _mm_prefetch(value_row + b, _MM_HINT_T1);
    __m256 e0 = zero, o0 = zero, e1 = zero, o1 = zero, e2 = zero, o2 = zero, e3 = zero, o3 = zero;
    for (int64_t i = 0; i < d; i += 16) {
      __m256 ke, ko;
      load16_split(key + i, ke, ko);
      e0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), ke, e0);
      o0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), ko, o0);
      if constexpr (NH > 1) {
        e1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + i), ke, e1);
        o1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + i + 8), ko, o1);
      }
      if constexpr (NH > 2) {
        e2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * d + i), ke, e2);
        o2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * d + i + 8), ko, o2);
      }
      if constexpr (NH > 3) {
        e3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * d + i), ke, e3);
        o3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * d + i + 8), ko, o3);
      }
    }
    record(0, p, e0, o0);
    if constexpr (NH > 1) record(1, p, e1, o1);
    if constexpr (NH > 2) record(2, p, e2, o2);
    if constexpr (NH > 3) record(3, p, e3, o3);
  }
  float inv_total[NH];
  for (int h = 0; h < NH; ++h) {  // the maximum after the loop: kept in it, it was a store-load chain per key
    inv_total[h] = 1.f / exp_shifted(scores + h * len, len, max_of(scores + h * len, len));
  }
  const auto emit = [&](int h, int64_t i, __m256 even, __m256 odd) {
    const __m256 scale = _mm256_set1_ps(inv_total[h]);
    store16_merged(out + h * d + i, _mm256_mul_ps(even, scale), _mm256_mul_ps(odd, scale));
  };
  const float* w0 = scores;
  const float* w1 = scores + len;
  const float* w2 = scores + 2 * len;
  const float* w3 = scores + 3 * len;
  for (int64_t i = 0; i < d; i += 16) {
    __m256 e0 = zero, o0 = zero, e1 = zero, o1 = zero, e2 = zero, o2 = zero, e3 = zero, o3 = zero;
    for (int64_t p = 0; p < len; ++p) {
      __m256 ve, vo;
      load16_split(values + p * d + i, ve, vo);
      __m256 w = _mm256_broadcast_ss(w0 + p);
      e0 = _mm256_fmadd_ps(w, ve, e0);
      o0 = _mm256_fmadd_ps(w, vo, o0);
      if constexpr (NH > 1) {
        w = _mm256_broadcast_ss(w1 + p);
        e1 = _mm256_fmadd_ps(w, ve, e1);
        o1 = _mm256_fmadd_ps(w, vo, o1);
      }
      if constexpr (NH > 2) {
        w = _mm256_broadcast_ss(w2 + p);
        e2 = _mm256_fmadd_ps(w, ve, e2);
        o2 = _mm256_fmadd_ps(w, vo, o2);
      }
      if constexpr (NH > 3) {
        w = _mm256_broadcast_ss(w3 + p);
        e3 = _mm256_fmadd_ps(w, ve, e3);
        o3 = _mm256_fmadd_ps(w, vo, o3);
      }
    }
    emit(0, i, e0, o0);
    if constexpr (NH > 1) emit(1, i, e1, o1);
    if constexpr (NH > 2) emit(2, i, e2, o2);
    if constexpr (NH > 3) emit(3, i, e3, o3);
  }
}
#endif

torch::Tensor attention(const torch::Tensor& query, const torch::Tensor& kv, const torch::Tensor& seq_slots,
                        const torch::Tensor& seq_starts, const torch::Tensor& cu_num_new, double scale) {
  // query: [tokens, num_heads, head_dim] bfloat16, rows may be strided (a view of the projection), last dim
  // contiguous; already scaled when scale == 1. kv: [2, slots, num_kv_heads, capacity, head_dim] contiguous.
  // seq_slots, seq_starts: [num_seqs] int64; cu_num_new: [num_seqs + 1] int64, sequence i's new tokens are query
  // rows cu_num_new[i] .. cu_num_new[i + 1] - 1 at positions seq_starts[i] + 0, 1, ...; each row attends to its
  // sequence's keys 0 .. its position. Returns [tokens, num_heads * head_dim].
  check_bf16(query, "query", 3);
  check_bf16(kv, "kv", 5);
  TORCH_CHECK(kv.is_contiguous(), "kv: must be contiguous");
  TORCH_CHECK(query.stride(2) == 1, "query: its last dimension must be contiguous");
  const int64_t tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_slots = kv.size(1), num_kv_heads = kv.size(2), capacity = kv.size(3);
  TORCH_CHECK(kv.size(0) == 2 && kv.size(4) == head_dim, "kv: must be [2, slots, kv heads, capacity, ", head_dim,
              "], got ", kv.sizes());
  TORCH_CHECK(head_dim <= kMaxHeadDim, "query: head_dim must be <= ", kMaxHeadDim);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "query: ", num_heads,
              " heads are not a multiple of ", num_kv_heads, " kv heads");
  const int64_t num_seqs = seq_slots.size(0);
  check_index(seq_slots, "seq_slots", num_seqs);
  check_index(seq_starts, "seq_starts", num_seqs);
  check_index(cu_num_new, "cu_num_new", num_seqs + 1);
  const int64_t *slots = seq_slots.data_ptr<int64_t>(), *starts = seq_starts.data_ptr<int64_t>();
  const int64_t* cu = cu_num_new.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] == tokens, "cu_num_new: must run from 0 to ", tokens);
  std::vector<int64_t> token_seq(tokens);
  int64_t max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(cu[s + 1] >= cu[s], "cu_num_new: must not decrease");
    TORCH_CHECK(slots[s] >= 0 && slots[s] < num_slots, "seq_slots: slot ", slots[s], " outside 0..", num_slots - 1);
    TORCH_CHECK(starts[s] >= 0 && starts[s] + cu[s + 1] - cu[s] <= capacity, "seq_starts: sequence ", s,
                " reads past the cache's capacity ", capacity);
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) token_seq[t] = s;
    max_len = std::max(max_len, starts[s] + cu[s + 1] - cu[s]);
  }
  auto out = torch::empty({tokens, num_heads * head_dim}, query.options());
  const bf16* qp = query.data_ptr<bf16>();
  const bf16* kvp = kv.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1), group = num_heads / num_kv_heads;
  const int64_t plane = num_slots * num_kv_heads * capacity * head_dim;  // keys -> values
  const float qscale = static_cast<float>(scale);
#if SPECD_AVX2
  if (head_dim % 16 == 0) {
    // One item per (token, kv head): the group's query heads read each key and value once (a bfloat16 -> float32
    // conversion and a load shared by up to kMaxHeads heads), with the running sums in registers.
    at::parallel_for(0, tokens * num_kv_heads, grain_rows(2 * max_len * head_dim * group),
                     [&](int64_t begin, int64_t end) {
      std::vector<float> scores(kMaxHeads * std::max<int64_t>(max_len, 1));
      float q[kMaxHeads * kMaxHeadDim];
      for (int64_t item = begin; item < end; ++item) {
        const int64_t t = item / num_kv_heads, g = item % num_kv_heads, s = token_seq[t];
        const int64_t len = starts[s] + (t - cu[s]) + 1;  // keys 0 .. this token's position
        const bf16* keys = kvp + (slots[s] * num_kv_heads + g) * capacity * head_dim;
        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += kMaxHeads) {
          const int64_t nh = std::min<int64_t>(kMaxHeads, (g + 1) * group - h0);
          for (int64_t h = 0; h < nh; ++h) {
            const bf16* qrow = qp + t * q_row + (h0 + h) * q_head;
            for (int64_t i = 0; i < head_dim; i += 16) {  // split by parity, as the keys will be
              __m256 even, odd;
              load16_split(qrow + i, even, odd);
              _mm256_storeu_ps(q + h * head_dim + i, _mm256_mul_ps(even, _mm256_set1_ps(qscale)));
              _mm256_storeu_ps(q + h * head_dim + i + 8, _mm256_mul_ps(odd, _mm256_set1_ps(qscale)));
            }
          }
          bf16* dst = op + t * num_heads * head_dim + h0 * head_dim;
          switch (nh) {
            case 1: attend_heads<1>(q, keys, keys + plane, len, head_dim, scores.data(), dst); break;
            case 2: attend_heads<2>(q, keys, keys + plane, len, head_dim, scores.data(), dst); break;
            case 3: attend_heads<3>(q, keys, keys + plane, len, head_dim, scores.data(), dst); break;
            default: attend_heads<4>(q, keys, keys + plane, len, head_dim, scores.data(), dst); break;
          }
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, tokens * num_heads, grain_rows(2 * max_len * head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> scores(std::max<int64_t>(max_len, 1));
    float q[kMaxHeadDim], acc[kMaxHeadDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_heads, h = item % num_heads, s = token_seq[t];
      const int64_t len = starts[s] + (t - cu[s]) + 1;  // keys 0 .. this token's position
      const bf16* keys = kvp + (slots[s] * num_kv_heads + h / group) * capacity * head_dim;
      const bf16* values = keys + plane;
      const bf16* qrow = qp + t * q_row + h * q_head;
      for (int64_t i = 0; i < head_dim; ++i) q[i] = to_float(qrow[i]) * qscale;
      float max_score = -INFINITY;
      for (int64_t p = 0; p < len; ++p) {
        scores[p] = dot(q, keys + p * head_dim, head_dim);
        max_score = std::max(max_score, scores[p]);
      }
      const float inv_total = 1.f / exp_shifted(scores.data(), len, max_score);
      std::fill(acc, acc + head_dim, 0.f);
      for (int64_t p = 0; p < len; ++p) axpy(acc, scores[p], values + p * head_dim, head_dim);
      bf16* dst = op + t * num_heads * head_dim + h * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) dst[i] = bf16(acc[i] * inv_total);
    }
  });
  return out;
}

torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& delta) {
  // x, delta: [rows, d] bfloat16 contiguous -> bf16(x + delta): one rounding of the float32 sum, as torch's
  // bfloat16 add (serial: a decode step's few rows are less work than waking a thread)
  auto sum = torch::empty_like(x);
  const bf16 *xp = x.data_ptr<bf16>(), *dp = delta.data_ptr<bf16>();
  bf16* sp = sum.data_ptr<bf16>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) sp[i] = bf16(to_float(xp[i]) + to_float(dp[i]));
  return sum;
}

// quant_gemm.cpp's q4_linear(x, codes, scales, mins, float_out), reached through the capsule its extension makes.
using Q4Linear = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
constexpr const char* kQ4LinearCapsule = "specd.q4_linear";
// A layer's weights, in this order: input norm; qkv codes, scales, mins; o ...; post-attention norm; gate_up ...;
// down ... (each projection a Q4Weight: codes [out, in / 2] uint8, scales and mins [out, in / 32] float16).
constexpr size_t kLayerWeights = 14;

// The weights of a model's decoder layers and the GEMM they run with, gathered once (LlamaForCausalLM's
// prepare_one_call_layers) so that a forward passes them as one object instead of 14 tensors per layer.
struct LayerStack {
  std::vector<std::vector<torch::Tensor>> weights;  // [num_layers][kLayerWeights]
  std::vector<std::vector<torch::Tensor>> dense;    // [num_layers][4]: qkv, o, gate_up, down for prompt rows; or empty
  double eps;
  int64_t num_heads;
  Q4Linear gemm;
};

LayerStack make_layer_stack(std::vector<std::vector<torch::Tensor>> weights,
                            std::vector<std::vector<torch::Tensor>> dense, double eps, int64_t num_heads,
                            const py::capsule& q4_linear) {
  TORCH_CHECK(q4_linear.name() != nullptr && std::strcmp(q4_linear.name(), kQ4LinearCapsule) == 0,
              "q4_linear: must be the capsule of specd's q4_linear_capsule()");
  for (const auto& layer : weights) {
    TORCH_CHECK(layer.size() == kLayerWeights, "weights: each layer must have ", kLayerWeights, " tensors, got ",
                layer.size());
  }
  TORCH_CHECK(dense.empty() || dense.size() == weights.size(), "dense: one entry per layer (", weights.size(),
              ") or none, got ", dense.size());
  for (const auto& layer : dense) {
    TORCH_CHECK(layer.size() == 4, "dense: each layer must have 4 weights (qkv, o, gate_up, down), got ",
                layer.size());
  }
  TORCH_CHECK(num_heads > 0, "num_heads: must be positive, got ", num_heads);
  return {std::move(weights), std::move(dense), eps, num_heads, reinterpret_cast<Q4Linear>(q4_linear.get_pointer())};
}

// The rows of one prompt_linear call: fixed, so that oneDNN picks the same blocking (and so the same summation
// order) for every call, whatever the number of prompt rows. A shorter last tile is padded with zero rows.
constexpr int64_t kPromptTile = 32;

// y = x W^T for a dense bfloat16 weight: oneDNN's pre-blocked copy (mkldnn_pack; torch.ops.mkldnn._linear_pointwise)
// or, where oneDNN has no bfloat16 support, the plain [out, in] tensor (at::linear).
torch::Tensor dense_tile(const torch::Tensor& x, const torch::Tensor& weight) {
  if (!weight.is_mkldnn()) return at::linear(x, weight);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string())};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

torch::Tensor prompt_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  // x [rows, in] bfloat16 -> [rows, out] bfloat16, kPromptTile rows per GEMM call.
  check_bf16(x, "x", 2);
  const int64_t rows = x.size(0), padded = (rows + kPromptTile - 1) / kPromptTile * kPromptTile;
  torch::Tensor input = x.contiguous();
  if (padded != rows) input = at::constant_pad_nd(input, {0, 0, 0, padded - rows}, 0);
  std::vector<torch::Tensor> tiles;
  tiles.reserve(static_cast<size_t>(padded / kPromptTile));
  for (int64_t r = 0; r < padded; r += kPromptTile) tiles.push_back(dense_tile(input.narrow(0, r, kPromptTile), weight));
  return at::cat(tiles, 0).narrow(0, 0, rows);
}

// Which rows of a step are prompt rows (through the dense copies) and which are not (through the q4 GEMM).
struct RowSplit {
  torch::Tensor prompt, other;  // [n_prompt], [n_other] int64 row indices; prompt empty: every row takes the q4 GEMM
};

// One decoder layer: the steps and roundings of DecoderLayer._forward_fused, one by one. The sub-steps are named
// for torch's profiler (bench/profile_step.py) as the Python path labels its calls; without a profiler a label
// costs a check of a flag.
torch::Tensor run_layer(const LayerStack& stack, const std::vector<torch::Tensor>& w, const torch::Tensor& hidden,
                        const torch::Tensor& cos, const torch::Tensor& sin_signed, torch::Tensor kv,
                        const torch::Tensor& write_slots, const torch::Tensor& write_positions,
                        const torch::Tensor& seq_slots, const torch::Tensor& seq_starts,
                        const torch::Tensor& cu_num_new, const std::vector<torch::Tensor>* dense,
                        const RowSplit& split) {
  const auto project = [&](const torch::Tensor& x, size_t first, size_t projection) {
    if (dense == nullptr || split.prompt.numel() == 0) {
      RECORD_FUNCTION("specd::q4_linear", std::vector<c10::IValue>());
      return stack.gemm(x, w[first], w[first + 1], w[first + 2], false);
    }
    torch::Tensor prompt_out;  // [n_prompt, out]
    {
      RECORD_FUNCTION("specd::prompt_linear", std::vector<c10::IValue>());
      prompt_out = prompt_linear(x.index_select(0, split.prompt), (*dense)[projection]);
    }
    if (split.other.numel() == 0) return prompt_out;  // every row is a prompt row, in order
    torch::Tensor out = at::empty({x.size(0), prompt_out.size(1)}, x.options());
    out.index_copy_(0, split.prompt, prompt_out);
    RECORD_FUNCTION("specd::q4_linear", std::vector<c10::IValue>());
    out.index_copy_(0, split.other, stack.gemm(x.index_select(0, split.other), w[first], w[first + 1], w[first + 2],
                                               false));
    return out;
  };
  check_bf16(kv, "kv", 5);
  const int64_t tokens = hidden.size(0), num_heads = stack.num_heads, num_kv_heads = kv.size(2);
  const int64_t head_dim = kv.size(4);
  torch::Tensor normed;  // [tokens, hidden_size]
  {
    RECORD_FUNCTION("specd::rms_norm", std::vector<c10::IValue>());
    normed = rms_norm(hidden, w[0], stack.eps);
  }
  const torch::Tensor qkv = project(normed, 1, 0);  // [tokens, (num_heads + 2 * num_kv_heads) * head_dim]
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "weights: qkv has ", qkv.size(1),
              " outputs, not (", num_heads, " + 2 * ", num_kv_heads, ") * ", head_dim);
  const torch::Tensor heads = qkv.view({tokens, num_heads + 2 * num_kv_heads, head_dim});  // q, k, v heads
  {
    RECORD_FUNCTION("specd::rope_write_kv", std::vector<c10::IValue>());
    rope_write_kv(heads, cos, sin_signed, kv, write_slots, write_positions);
  }
  torch::Tensor attn;  // [tokens, num_heads * head_dim]
  {
    RECORD_FUNCTION("specd::attention", std::vector<c10::IValue>());
    attn = attention(heads.narrow(1, 0, num_heads), kv, seq_slots, seq_starts, cu_num_new, 1.0);
  }
  const torch::Tensor attn_out = project(attn, 4, 1);  // [tokens, hidden_size]
  torch::Tensor residual, post_normed;  // [tokens, hidden_size] each
  {
    RECORD_FUNCTION("specd::add_rms_norm", std::vector<c10::IValue>());
    std::tie(residual, post_normed) = add_rms_norm(hidden, attn_out, w[7], stack.eps);
  }
  const torch::Tensor gate_up = project(post_normed, 8, 2);  // [tokens, 2 * intermediate_size]
  torch::Tensor activated;  // [tokens, intermediate_size]
  {
    RECORD_FUNCTION("specd::silu_mul", std::vector<c10::IValue>());
    activated = silu_mul(gate_up);
  }
  const torch::Tensor down = project(activated, 11, 3);  // [tokens, hidden_size]
  RECORD_FUNCTION("specd::residual_add", std::vector<c10::IValue>());
  return residual_add(residual, down);
}

torch::Tensor decoder_layers(const LayerStack& stack, int64_t first, int64_t end, const torch::Tensor& hidden_in,
                             const torch::Tensor& cos, const torch::Tensor& sin_signed,
                             const std::vector<torch::Tensor>& kv, const torch::Tensor& write_slots,
                             const torch::Tensor& write_positions, const torch::Tensor& seq_slots,
                             const torch::Tensor& seq_starts, const torch::Tensor& cu_num_new,
                             const torch::Tensor& prompt_rows, const torch::Tensor& other_rows) {
  // Layers first .. end - 1 of the stack over hidden [tokens, hidden_size] bfloat16; returns the last one's output
  // [tokens, hidden_size]. cos, sin_signed: Rotary.tables, [tokens, num_heads + num_kv_heads, head_dim]. kv: the
  // cache's layers, layer i's [2, slots, num_kv_heads, capacity, head_dim] written at (write_slots[t],
  // write_positions[t]). seq_slots, seq_starts, cu_num_new: as for attention. prompt_rows, other_rows: int64 row
  // indices, together every row once (prompt_rows empty: all rows take the q4 GEMM); with the stack's dense copies,
  // the projections of prompt rows run prompt_linear.
  check_bf16(hidden_in, "hidden", 2);
  const int64_t num_layers = static_cast<int64_t>(stack.weights.size());
  TORCH_CHECK(0 <= first && first <= end && end <= num_layers, "first, end: must satisfy 0 <= first <= end <= ",
              num_layers, ", got ", first, ", ", end);
  TORCH_CHECK(end <= static_cast<int64_t>(kv.size()), "kv: the cache has ", kv.size(), " layers, not ", end);
  TORCH_CHECK(prompt_rows.scalar_type() == at::kLong && other_rows.scalar_type() == at::kLong &&
              prompt_rows.dim() == 1 && other_rows.dim() == 1 &&
              (prompt_rows.numel() == 0 || prompt_rows.numel() + other_rows.numel() == hidden_in.size(0)),
              "prompt_rows, other_rows: 1-d int64 row indices that split the ", hidden_in.size(0), " rows, got ",
              prompt_rows.numel(), " and ", other_rows.numel());
  const RowSplit split{prompt_rows, other_rows};
  torch::Tensor hidden = hidden_in.contiguous();
  for (int64_t i = first; i < end; ++i) {
    const std::vector<torch::Tensor>* dense = stack.dense.empty() ? nullptr : &stack.dense[static_cast<size_t>(i)];
    hidden = run_layer(stack, stack.weights[i], hidden, cos, sin_signed, kv[i], write_slots, write_positions,
                       seq_slots, seq_starts, cu_num_new, dense, split);
  }
  return hidden;
}

bool has_avx2() { return SPECD_AVX2 != 0; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of bfloat16 rows", py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta)) of bfloat16 rows", py::arg("x"),
        py::arg("delta"), py::arg("weight"), py::arg("eps"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up over a fused gate|up output", py::arg("gate_up"));
  m.def("rope_write_kv", &rope_write_kv, "rotate q/k heads in place and write k/v heads into the cache",
        py::arg("heads"), py::arg("cos"), py::arg("sin_signed"), py::arg("kv"), py::arg("write_slots"),
        py::arg("write_positions"));
  m.def("attention", &attention, "ragged causal attention of new rows over each sequence's cached keys",
        py::arg("query"), py::arg("kv"), py::arg("seq_slots"), py::arg("seq_starts"), py::arg("cu_num_new"),
        py::arg("scale"));
  py::class_<LayerStack>(m, "LayerStack", "a model's int4 decoder layers' weights and their GEMM, for decoder_layers");
  m.def("make_layer_stack", &make_layer_stack, "gather the decoder layers' weights once", py::arg("weights"),
        py::arg("dense"), py::arg("eps"), py::arg("num_heads"), py::arg("q4_linear"));
  m.def("prompt_linear", &prompt_linear, "prompt rows through a dense bfloat16 weight, in fixed tiles of rows",
        py::arg("x"), py::arg("weight"));
  m.attr("PROMPT_TILE") = kPromptTile;
  m.def("decoder_layers", &decoder_layers, "int4 decoder layers first .. end - 1: norms, q4 GEMMs, rotary + KV "
        "write, attention, each as DecoderLayer._forward_fused", py::arg("stack"), py::arg("first"), py::arg("end"),
        py::arg("hidden"), py::arg("cos"), py::arg("sin_signed"), py::arg("kv"), py::arg("write_slots"),
        py::arg("write_positions"), py::arg("seq_slots"), py::arg("seq_starts"), py::arg("cu_num_new"),
        py::arg("prompt_rows"), py::arg("other_rows"));
  m.def("has_avx2", &has_avx2, "whether this build uses the AVX2 loops");
}
