// The kernels' group order (quant_gemm.cpp, top): where each input of a row of blocks of 32 sits in memory.
// Shared by the GEMMs and by the GGUF repacking (gguf_repack.cpp) that writes weights in it.
#pragma once

#include <cstdint>

namespace specd {

constexpr int64_t kBlock = 32;

// The group block `block` of a row of `blocks` falls in: its first block, its size S and its index.
struct Group {
  int64_t first, size, index;
};
inline Group group_of(int64_t block, int64_t blocks) {
  const int64_t full = blocks / 4 * 4, rest = blocks - full;
  if (block < full) return {block / 4 * 4, 4, block / 4};
  if (rest >= 2 && block < full + 2) return {full, 2, full / 4};
  return {block, 1, full / 4 + (rest >= 2 ? 1 : 0)};
}
inline int64_t group_count(int64_t blocks) {
  const int64_t rest = blocks % 4;
  return blocks / 4 + (rest >= 2 ? 1 : 0) + rest % 2;
}

// Where input `input` (0..31) of block `block` sits in a row stored in group order: vector t, lane i, byte e.
inline int64_t input_position(int64_t block, int64_t input, int64_t blocks) {
  const Group g = group_of(block, blocks);
  const int64_t per_lane = 4 / g.size, u = (input % 16) / 4;
  const int64_t t = u / per_lane, i = (u % per_lane) * g.size + (block - g.first);
  return g.first * kBlock + t * 32 + (input / 16) * 16 + i * 4 + input % 4;
}

// Where the q4 byte holding inputs p and p + 16 (p in 0..15) of `block` sits in a packed row in group order.
inline int64_t q4_byte_position(int64_t block, int64_t p, int64_t blocks) {
  const Group g = group_of(block, blocks);
  const int64_t per_lane = 4 / g.size, u = p / 4;
  const int64_t t = u / per_lane, i = (u % per_lane) * g.size + (block - g.first);
  return g.first * 16 + t * 16 + i * 4 + p % 4;
}

}  // namespace specd
