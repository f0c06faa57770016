// GGUF blocks -> the q4/q8 kernels' weight fields (gguf_repack.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

// raw: [rows, bytes per row] uint8, a tensor's GGUF blocks; ggml_type: GGUF's type number (Q4_0 2, Q4_1 3, Q8_0 8,
// Q4_K 12, Q6_K 14); row_order: [out] int64 (output row r is raw row row_order[r]) or empty (the rows as they are).
// Returns model/gguf_blocks.py's fields for the type, bit for bit: Q4Weight (codes, scales, mins) or Q8Weight
// (codes, scales).
std::vector<at::Tensor> repack_gguf(const at::Tensor& raw, int64_t ggml_type, int64_t in_features,
                                    const at::Tensor& row_order);

// The same types' values into out ([rows, in_features] float32 or bfloat16, each value's float32 dequantization
// rounded once): GGUF's dequantization, on torch's threads.
void dequantize_gguf(const at::Tensor& raw, int64_t ggml_type, int64_t in_features, const at::Tensor& out);
