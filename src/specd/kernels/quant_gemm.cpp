// Block-quantised GEMM for CPU decode: y[m, n] = sum_k x[m, k] * w[n, k].
//
// Weights are stored in blocks of 32 inputs along k with float16 block scales:
//   q4: w = scale * q + min, q in 0..15, two codes per byte (byte i of a block holds inputs i and i + 16)
//   q8: w = scale * q,       q in -127..127
// Each activation row is quantised the same way (symmetric int8 per block of 32, scale dx), so a block's
// product is an integer dot product times scale * dx; q4's `min` term needs only the block's float sum of x.
// With AVX2 the integer dots are `maddubs` (unsigned byte x signed byte, pairs summed to int16; no overflow:
// 2 * 127 * 127 < 32768) followed by `madd` with ones to int32. Without AVX2 the same sums are computed
// scalar (SPECD_SCALAR, or a compiler without the ISA flags).
//
// Every output element is computed by the same code from its own weight row and its own activation row,
// whatever the number of rows in the batch: a token's result does not depend on its neighbours (speculative
// verification relies on it). Work is split over output columns only.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(SPECD_SCALAR)
#define SPECD_AVX2 1
#include <immintrin.h>
#else
#define SPECD_AVX2 0
#endif

namespace {

constexpr int64_t kBlock = 32;

inline float half_to_float(at::Half h) {
#if SPECD_AVX2
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// One activation row quantised per block: codes, block scales, block float sums.
struct QuantRows {
  std::vector<int8_t> codes;   // [rows, k]
  std::vector<float> scales;   // [rows, k / 32]
  std::vector<float> sums;     // [rows, k / 32]
};

template <typename T>
QuantRows quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  QuantRows q{std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks), std::vector<float>(rows * blocks)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float values[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* src = x + r * k + b * kBlock;
        float amax = 0.f, sum = 0.f;
        for (int64_t i = 0; i < kBlock; ++i) {
          values[i] = static_cast<float>(src[i]);
          amax = std::max(amax, std::fabs(values[i]));
          sum += values[i];
        }
        const float scale = amax / 127.f;
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* dst = q.codes.data() + r * k + b * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) {
          const float v = std::nearbyint(values[i] * inv);
          dst[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, v)));
        }
        q.scales[r * blocks + b] = scale;
        q.sums[r * blocks + b] = sum;
      }
    }
  });
  return q;
}

#if SPECD_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if SPECD_AVX2
// One q4 block times 32 int8 activations, accumulated into acc as 8 float lanes.
inline __m256 q4_block(const uint8_t* w, const int8_t* x, float scale, __m256 acc) {
  // Both 16-byte halves of the register hold the block; shifting the upper half right by 4 bits brings the
  // high nibbles (inputs 16..31) down, so one mask gives all 32 codes in input order.
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                         _mm256_set1_epi8(0x0F));
  const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xs), _mm256_set1_epi16(1));  // 8 x int32
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(pairs), _mm256_set1_ps(scale), acc);
}
#endif

// Dot product of one q4 weight row with one quantised activation row.
inline float dot_q4(const uint8_t* w, const at::Half* w_scale, const at::Half* w_min, const int8_t* x,
                    const float* x_scale, const float* x_sum, int64_t blocks) {
#if SPECD_AVX2
  // Two accumulators, so consecutive blocks' FMAs do not wait on each other.
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    acc0 = q4_block(w + b * 16, x + b * kBlock, half_to_float(w_scale[b]) * x_scale[b], acc0);
    acc1 = q4_block(w + (b + 1) * 16, x + (b + 1) * kBlock, half_to_float(w_scale[b + 1]) * x_scale[b + 1], acc1);
  }
  if (b < blocks) acc0 = q4_block(w + b * 16, x + b * kBlock, half_to_float(w_scale[b]) * x_scale[b], acc0);
  // The min term sum_b min_b * sum(x in block b), eight blocks per instruction.
  __m256 min_acc = _mm256_setzero_ps();
  for (b = 0; b + 8 <= blocks; b += 8) {
    const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w_min + b)));
    min_acc = _mm256_fmadd_ps(mins, _mm256_loadu_ps(x_sum + b), min_acc);
  }
  float min_part = hsum(min_acc);
  for (; b < blocks; ++b) min_part += half_to_float(w_min[b]) * x_sum[b];
  return hsum(_mm256_add_ps(acc0, acc1)) + min_part;
#else
  float acc = 0.f, min_part = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t dot = 0;
    const uint8_t* wb = w + b * 16;
    const int8_t* xb = x + b * kBlock;
    for (int64_t i = 0; i < 16; ++i) {
      dot += static_cast<int32_t>(wb[i] & 0x0F) * xb[i] + static_cast<int32_t>(wb[i] >> 4) * xb[i + 16];
    }
    acc += static_cast<float>(dot) * (half_to_float(w_scale[b]) * x_scale[b]);
    min_part += half_to_float(w_min[b]) * x_sum[b];
  }
  return acc + min_part;
#endif
}

// Dot product of one q8 weight row with one quantised activation row.
inline float dot_q8(const int8_t* w, const at::Half* w_scale, const int8_t* x, const float* x_scale,
                    int64_t blocks) {
#if SPECD_AVX2
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // alternate blocks: independent FMA chains
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i ws = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
    const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * kBlock));
    // maddubs wants an unsigned operand: |w| times x with w's sign moved onto it.
    const __m256i products = _mm256_maddubs_epi16(_mm256_sign_epi8(ws, ws), _mm256_sign_epi8(xs, ws));
    const __m256i pairs = _mm256_madd_epi16(products, _mm256_set1_epi16(1));
    const float scale = half_to_float(w_scale[b]) * x_scale[b];
    acc[b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pairs), _mm256_set1_ps(scale), acc[b & 1]);
  }
  return hsum(_mm256_add_ps(acc[0], acc[1]));
#else
  float acc = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t dot = 0;
    const int8_t* wb = w + b * kBlock;
    const int8_t* xb = x + b * kBlock;
    for (int64_t i = 0; i < kBlock; ++i) dot += static_cast<int32_t>(wb[i]) * xb[i];
    acc += static_cast<float>(dot) * (half_to_float(w_scale[b]) * x_scale[b]);
  }
  return acc;
#endif
}

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

// Writes out[m, n] = dot(m, n) for every row m, splitting the columns n over threads.
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

at::ScalarType output_dtype(const at::Tensor& x, bool float_out) {
  return float_out ? at::kFloat : x.scalar_type();
}

}  // namespace

// x: [m, k] float32/bfloat16; codes: [n, k / 2] uint8; scales, mins: [n, k / 32] float16.
// Returns [m, n] in x's dtype, or float32 when float_out.
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     bool float_out) {
  const int64_t n = codes.size(0), k = codes.size(1) * 2, blocks = k / kBlock;
  check_activations(x, k, "q4_linear");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "q4_linear: codes must be contiguous uint8");
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->size(0) == n && t->size(1) == blocks,
                "q4_linear: scales and mins must be contiguous float16 [", n, ", ", blocks, "]");
  }
  const QuantRows q = quantize(x);
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const at::Half* ws = scales.data_ptr<at::Half>();
  const at::Half* wm = mins.data_ptr<at::Half>();
  return run_columns(x.size(0), n, output_dtype(x, float_out), [&](int64_t row, int64_t col) {
    return dot_q4(w + col * (k / 2), ws + col * blocks, wm + col * blocks, q.codes.data() + row * k,
                  q.scales.data() + row * blocks, q.sums.data() + row * blocks, blocks);
  });
}

// x: [m, k] float32/bfloat16; codes: [n, k] int8; scales: [n, k / 32] float16.
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool float_out) {
  const int64_t n = codes.size(0), k = codes.size(1), blocks = k / kBlock;
  check_activations(x, k, "q8_linear");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(), "q8_linear: codes must be contiguous int8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == n &&
                  scales.size(1) == blocks,
              "q8_linear: scales must be contiguous float16 [", n, ", ", blocks, "]");
  const QuantRows q = quantize(x);
  const int8_t* w = codes.data_ptr<int8_t>();
  const at::Half* ws = scales.data_ptr<at::Half>();
  return run_columns(x.size(0), n, output_dtype(x, float_out), [&](int64_t row, int64_t col) {
    return dot_q8(w + col * k, ws + col * blocks, q.codes.data() + row * k, q.scales.data() + row * blocks, blocks);
  });
}

bool uses_avx2() { return SPECD_AVX2 != 0; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "int4-block weight x int8-quantised activation GEMM");
  m.def("q8_linear", &q8_linear, "int8-block weight x int8-quantised activation GEMM");
  m.def("uses_avx2", &uses_avx2, "whether this build runs the AVX2 kernels");
}
