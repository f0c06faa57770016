// A GGUF tensor's raw blocks -> the q4/q8 kernels' weight fields, the same bytes model/gguf_blocks.py makes with
// torch ops, in one pass per row on torch's threads (a 1B model's ~200 tensors: a fraction of a second where the
// torch path takes seconds). Each row: its codes decoded into block order in a row buffer, then moved into the
// group order (group_order.h) a 4-byte chunk at a time, and its scales written in the kernels' layouts
// (quant_gemm.cpp: F16Blocks, KBlocks, Q6Lanes; SixBitCodes).
#include "gguf_repack.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "group_order.h"

namespace {

using namespace specd;

enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

at::Half half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return at::Half(bits, at::Half::from_bits());
}

void put_float(uint8_t* p, float value) { std::memcpy(p, &value, sizeof(value)); }

// int8 codes of a row, block order -> group order. In a whole group of four blocks input h*16 + 4u + e of block b
// moves to u*32 + h*16 + b*4 + e: 4-byte chunks; a row's last group of two or one goes through input_position.
void q8_to_groups(const int8_t* block_order, int8_t* out, int64_t blocks) {
  const int64_t full = blocks / 4 * 4;
  for (int64_t first = 0; first < full; first += 4) {
    const int8_t* src = block_order + first * kBlock;
    int8_t* dst = out + first * kBlock;
    for (int64_t b = 0; b < 4; ++b) {
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t u = 0; u < 4; ++u) std::memcpy(dst + u * 32 + h * 16 + b * 4, src + b * 32 + h * 16 + u * 4, 4);
      }
    }
  }
  for (int64_t b = full; b < blocks; ++b) {
    for (int64_t i = 0; i < kBlock; ++i) out[input_position(b, i, blocks)] = block_order[b * kBlock + i];
  }
}

// q4 bytes of a row (block order: byte p of a block holds inputs p and p + 16) -> group order: in a whole group,
// bytes 4u .. 4u + 3 of block b move to u*16 + b*4; the last group of two or one through q4_byte_position.
void q4_to_groups(const uint8_t* block_order, uint8_t* out, int64_t blocks) {
  const int64_t full = blocks / 4 * 4;
  for (int64_t first = 0; first < full; first += 4) {
    const uint8_t* src = block_order + first * 16;
    uint8_t* dst = out + first * 16;
    for (int64_t b = 0; b < 4; ++b) {
      for (int64_t u = 0; u < 4; ++u) std::memcpy(dst + u * 16 + b * 4, src + b * 16 + u * 4, 4);
    }
  }
  for (int64_t b = full; b < blocks; ++b) {
    for (int64_t p = 0; p < 16; ++p) out[q4_byte_position(b, p, blocks)] = block_order[b * 16 + p];
  }
}

// Six-bit codes (SixBitCodes) of a row of int8 codes -32..31 in group order: per 32, 16 bytes of nibbles of q + 32
// (code j low, code 16 + j high), then 8 bytes with code b + 8e's top two bits at bits 2e, 2e + 1 of byte b.
void pack_six_bit(const int8_t* grouped, uint8_t* out, int64_t k) {
  for (int64_t v = 0; v < k / kBlock; ++v) {
    const int8_t* codes = grouped + v * kBlock;
    uint8_t* dst = out + v * 24;
    uint8_t u[32];
    for (int j = 0; j < 32; ++j) u[j] = static_cast<uint8_t>(codes[j] + 32);
    for (int j = 0; j < 16; ++j) dst[j] = static_cast<uint8_t>((u[j] & 0x0F) | ((u[16 + j] & 0x0F) << 4));
    for (int b = 0; b < 8; ++b) {
      uint8_t high = 0;
      for (int e = 0; e < 4; ++e) high |= static_cast<uint8_t>((u[b + 8 * e] >> 4) << (2 * e));
      dst[16 + b] = high;
    }
  }
}

struct Layout {
  int64_t block_inputs, block_bytes;  // GGUF's block
};

Layout layout_of(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ6_K: return {256, 210};
    default: TORCH_CHECK(false, "repack_gguf: ggml type ", type, " has no kernel layout (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)");
  }
  return {0, 0};
}

// Q4_K / Q5_K's 12 bytes -> sub-block j's six-bit scale and min (sub-blocks 4..7 take their top two bits from
// bits 6-7 of bytes j - 4 and j).
void k_scale_min(const uint8_t* q, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q6_K's code of input i (0..255) of a super-block, -32..31: in half n = i / 128, input 32k + l takes the low
// nibble of ql[64n + l] (k 0) or ql[64n + 32 + l] (k 1), their high nibbles (k 2, 3), and bits 2k, 2k + 1 of
// qh[32n + l] on top (ql: the super-block's first 128 bytes, qh the next 64).
inline int8_t q6_code(const uint8_t* super, int64_t i) {
  const int64_t n = i / 128, kk = i % 128 / 32, l = i % 32;
  const uint8_t byte = super[64 * n + 32 * (kk % 2) + l];
  const int low = kk < 2 ? byte & 0x0F : byte >> 4;
  const int high = (super[128 + 32 * n + l] >> (2 * kk)) & 3;
  return static_cast<int8_t>((low | (high << 4)) - 32);
}

// One row's values in input order: GGUF's dequantization (gguf-py's, llama.cpp's), each value one float32 product
// of the file's integers and float16 scales (exact: at most 23 significant bits), plus Q4_0/Q4_1/Q4_K's min
// added in one rounding, as the torch decoders' dequantize() computes them.
template <typename Out>
void dequantize_row(const uint8_t* in, int64_t type, int64_t k, Out* out) {
  const auto put = [&](int64_t i, float value) { out[i] = static_cast<Out>(value); };
  switch (type) {
    case kQ4_0:
    case kQ4_1:
      for (int64_t b = 0; b < k / kBlock; ++b) {
        const uint8_t* block = in + b * (type == kQ4_0 ? 18 : 20);
        const float d = static_cast<float>(half_at(block));
        const float m = type == kQ4_0 ? static_cast<float>(at::Half(d * -8.0f)) : static_cast<float>(half_at(block + 2));
        const uint8_t* qs = block + (type == kQ4_0 ? 2 : 4);
        for (int p = 0; p < 16; ++p) {
          put(b * kBlock + p, static_cast<float>(qs[p] & 0x0F) * d + m);
          put(b * kBlock + p + 16, static_cast<float>(qs[p] >> 4) * d + m);
        }
      }
      return;
    case kQ8_0:
      for (int64_t b = 0; b < k / kBlock; ++b) {
        const uint8_t* block = in + b * 34;
        const float d = static_cast<float>(half_at(block));
        for (int i = 0; i < kBlock; ++i) put(b * kBlock + i, static_cast<float>(static_cast<int8_t>(block[2 + i])) * d);
      }
      return;
    case kQ4_K:
      for (int64_t s = 0; s < k / 256; ++s) {
        const uint8_t* super = in + s * 144;
        const float d = static_cast<float>(half_at(super)), dmin = static_cast<float>(half_at(super + 2));
        const uint8_t* qs = super + 16;
        for (int j = 0; j < 8; ++j) {  // sub-block j: chunk j / 2's low (even j) or high (odd j) nibbles
          uint8_t sc, m;
          k_scale_min(super + 4, j, &sc, &m);
          const float scale = d * static_cast<float>(sc), min = -(dmin * static_cast<float>(m));
          for (int l = 0; l < 32; ++l) {
            const uint8_t byte = qs[j / 2 * 32 + l];
            put(s * 256 + j * 32 + l, static_cast<float>(j % 2 ? byte >> 4 : byte & 0x0F) * scale + min);
          }
        }
      }
      return;
    default:  // Q6_K
      for (int64_t s = 0; s < k / 256; ++s) {
        const uint8_t* super = in + s * 210;
        const float d = static_cast<float>(half_at(super + 208));
        const int8_t* sc = reinterpret_cast<const int8_t*>(super + 192);
        for (int64_t i = 0; i < 256; ++i) {  // sub-block i / 16
          put(s * 256 + i, static_cast<float>(q6_code(super, i)) * (d * static_cast<float>(sc[i / 16])));
        }
      }
  }
}

}  // namespace

void dequantize_gguf(const at::Tensor& raw, int64_t ggml_type, int64_t in_features, const at::Tensor& out) {
  const Layout layout = layout_of(ggml_type);
  TORCH_CHECK(in_features > 0 && in_features % layout.block_inputs == 0, "dequantize_gguf: in_features ",
              in_features, " is not a multiple of the type's ", layout.block_inputs, " inputs per block");
  const int64_t row_bytes = in_features / layout.block_inputs * layout.block_bytes;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() && raw.size(1) == row_bytes,
              "dequantize_gguf: raw must be contiguous uint8 [rows, ", row_bytes, "]");
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == raw.size(0) && out.size(1) == in_features,
              "dequantize_gguf: out must be contiguous float32 or bfloat16 [", raw.size(0), ", ", in_features, "]");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, raw.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (bf16) {
        dequantize_row(src + r * row_bytes, ggml_type, in_features, out.data_ptr<at::BFloat16>() + r * in_features);
      } else {
        dequantize_row(src + r * row_bytes, ggml_type, in_features, out.data_ptr<float>() + r * in_features);
      }
    }
  });
}

std::vector<at::Tensor> repack_gguf(const at::Tensor& raw, int64_t ggml_type, int64_t in_features,
                                    const at::Tensor& row_order) {
  const Layout layout = layout_of(ggml_type);
  TORCH_CHECK(in_features > 0 && in_features % layout.block_inputs == 0, "repack_gguf: in_features ", in_features,
              " is not a multiple of the type's ", layout.block_inputs, " inputs per block");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(),
              "repack_gguf: raw must be contiguous 2-D uint8");
  const int64_t row_bytes = in_features / layout.block_inputs * layout.block_bytes;
  TORCH_CHECK(raw.size(1) == row_bytes, "repack_gguf: rows of ", in_features, " inputs are ", row_bytes,
              " bytes, got ", raw.size(1));
  const bool ordered = row_order.numel() > 0;
  const int64_t rows = ordered ? row_order.size(0) : raw.size(0);
  const int64_t* order = nullptr;
  if (ordered) {
    TORCH_CHECK(row_order.scalar_type() == at::kLong && row_order.dim() == 1 && row_order.is_contiguous(),
                "repack_gguf: row_order must be contiguous 1-D int64");
    order = row_order.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(order[r] >= 0 && order[r] < raw.size(0), "repack_gguf: row_order[", r, "] = ", order[r],
                  " is outside the tensor's ", raw.size(0), " rows");
    }
  }
  const int64_t k = in_features, blocks = k / kBlock, supers = k / 256;
  const uint8_t* src = raw.data_ptr<uint8_t>();
  const auto u8 = at::TensorOptions().dtype(at::kByte);
  const auto f16 = at::TensorOptions().dtype(at::kHalf);
  std::vector<at::Tensor> fields;
  switch (ggml_type) {
    case kQ4_0:
    case kQ4_1: fields = {at::empty({rows, k / 2}, u8), at::empty({rows, blocks}, f16), at::empty({rows, blocks}, f16)}; break;
    case kQ8_0: fields = {at::empty({rows, k}, at::TensorOptions().dtype(at::kChar)), at::empty({rows, blocks}, f16)}; break;
    case kQ4_K: fields = {at::empty({rows, k / 2}, u8), at::empty({rows, supers * 16}, u8), at::empty({rows, 0}, u8)}; break;
    default: fields = {at::empty({rows, k / kBlock * 24}, u8), at::empty({rows, supers * 20}, u8)};  // Q6_K
  }
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row_buffer(static_cast<size_t>(2 * k));  // block-order codes, then group-order ones
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* in = src + (ordered ? order[r] : r) * row_bytes;
      switch (ggml_type) {
        case kQ4_0:
        case kQ4_1: {
          const int64_t head = ggml_type == kQ4_0 ? 2 : 4;
          at::Half* scales = fields[1].data_ptr<at::Half>() + r * blocks;
          at::Half* mins = fields[2].data_ptr<at::Half>() + r * blocks;
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = in + b * layout.block_bytes;
            scales[b] = half_at(block);
            // Q4_0: d * (q - 8), the min -8 * d rounded to float16 as torch's float16 product is (exact)
            mins[b] = ggml_type == kQ4_0 ? at::Half(static_cast<float>(scales[b]) * -8.0f) : half_at(block + 2);
            std::memcpy(row_buffer.data() + b * 16, block + head, 16);
          }
          q4_to_groups(row_buffer.data(), fields[0].data_ptr<uint8_t>() + r * (k / 2), blocks);
          break;
        }
        case kQ8_0: {
          at::Half* scales = fields[1].data_ptr<at::Half>() + r * blocks;
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = in + b * layout.block_bytes;
            scales[b] = half_at(block);
            std::memcpy(row_buffer.data() + b * kBlock, block + 2, kBlock);
          }
          q8_to_groups(reinterpret_cast<const int8_t*>(row_buffer.data()), fields[0].data_ptr<int8_t>() + r * k,
                       blocks);
          break;
        }
        case kQ4_K: {
          uint8_t* scales = fields[1].data_ptr<uint8_t>() + r * supers * 16;
          for (int64_t s = 0; s < supers; ++s) {
            const uint8_t* super = in + s * layout.block_bytes;
            std::memcpy(scales + s * 16, super, 16);  // d, dmin and the packed scales, as the file has them
            // chunk c of 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones (byte l: input l)
            const uint8_t* qs = super + 16;
            for (int c = 0; c < 4; ++c) {
              uint8_t* even = row_buffer.data() + (s * 8 + 2 * c) * 16;
              uint8_t* odd = even + 16;
              for (int p = 0; p < 16; ++p) {
                const uint8_t lo = qs[c * 32 + p], hi = qs[c * 32 + p + 16];
                even[p] = static_cast<uint8_t>((lo & 0x0F) | ((hi & 0x0F) << 4));
                odd[p] = static_cast<uint8_t>((lo >> 4) | (hi & 0xF0));
              }
            }
          }
          q4_to_groups(row_buffer.data(), fields[0].data_ptr<uint8_t>() + r * (k / 2), blocks);
          break;
        }
        default: {  // Q6_K
          int8_t* codes = reinterpret_cast<int8_t*>(row_buffer.data());
          uint8_t* scales = fields[1].data_ptr<uint8_t>() + r * supers * 20;
          for (int64_t s = 0; s < supers; ++s) {
            const uint8_t* super = in + s * layout.block_bytes;
            const int8_t* sc = reinterpret_cast<const int8_t*>(super + 192);
            for (int64_t i = 0; i < 256; ++i) codes[s * 256 + i] = q6_code(super, i);
            uint8_t* packed = scales + s * 20;
            // lane gi*8 + h*4 + i: half h of block 4gi + i, Q6_K's sub-block 2 * (4gi + i) + h
            for (int gi = 0; gi < 2; ++gi) {
              for (int h = 0; h < 2; ++h) {
                for (int i = 0; i < 4; ++i) packed[gi * 8 + h * 4 + i] = static_cast<uint8_t>(sc[(gi * 4 + i) * 2 + h]);
              }
            }
            put_float(packed + 16, static_cast<float>(half_at(super + 208)));
          }
          int8_t* grouped = codes + k;
          q8_to_groups(codes, grouped, blocks);
          pack_six_bit(grouped, fields[0].data_ptr<uint8_t>() + r * (k / kBlock * 24), k);
        }
      }
    }
  });
  return fields;
}
