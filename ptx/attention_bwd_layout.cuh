// Layouts shared by the attention backward's kernels (attention_bwd.cu, attention_bwd_prep.cu).
#pragma once
#include "common/epilogue.cuh"

// The LSE / dPsum rows of a sequence are padded to this many, so a tile of up to STAT_PAD rows never reads the next
// sequence's stats.
constexpr int STAT_PAD = 128;

// The fp32 dQ accumulator: blocks of 64 query rows by 64 head-dim columns (4096 floats), each in the order of an
// m64n64 wgmma accumulator's fragments: float 4 (128 g + t) + k is register 4 g + k of thread t of the warpgroup,
// element (row 16 (t / 32) + (t % 32) / 4 + 8 (k / 2), column 8 g + 2 (t % 4) + k % 2). A consumer adds its
// fragments as they are, 16 bytes a red.global.add and a warp's 32 lanes 512 contiguous bytes, with no staging in
// shared memory; attention_bwd_dq puts the rows back in order. The blocks are [slot][query head][D / 64]: the i-th
// 64-row tile of sequence b (its first row row0 in the packed rows, or b S_q batched) is slot row0 / 64 + b + i, so
// no two sequences share a slot (a tile's rows past its sequence are its own), and slots < rows / 64 + batch.
// The prep kernel clears it before the main kernel, and attention_bwd_dq converts it after.
constexpr int DQ_BLOCK = 64 * 64;

// The first float of query head h's (of `heads`) blocks in the first slot of the sequence b starting at row row0
// (head dim d).
__device__ __forceinline__ i64 dq_sequence(i64 row0, int b, int heads, int h, int d) {
  return (((row0 >> 6) + b) * heads + h) * (d / 64) * DQ_BLOCK;
}

// From there, the block of the sequence's 64-row tile tile64, columns 64 col_block .. 64 col_block + 63.
__device__ __forceinline__ i64 dq_tile(int tile64, int heads, int col_block, int d) {
  return (i64(tile64) * heads * (d / 64) + col_block) * DQ_BLOCK;
}
