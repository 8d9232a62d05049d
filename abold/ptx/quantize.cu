// FP8 (e4m3) quantization with DeepGEMM's scaling: per 1x128 group of a row (activations) or per 128x128 block
// (weights): scale = max(amax, 1e-4) / 448, q = x * (448 / max(amax, 1e-4)) rounded to nearest even.
//
// Compile-time parameters: IN_KIND (KIND_BF16 / KIND_FP16 / KIND_FP32).
// Every thread moves 16 input bytes per access; K (elements) is a multiple of that vector, so a vector is either
// wholly inside a row or wholly past its end.
#include "common/memory.cuh"

#ifndef IN_KIND
#define IN_KIND KIND_BF16
#endif

constexpr int IN_BYTES = IN_KIND == KIND_FP32 ? 4 : 2;
constexpr int VEC = 16 / IN_BYTES;        // elements per 16-byte load: 8 (16-bit input) or 4 (fp32)
constexpr int GROUP = 128;                // quantization group width
constexpr int TPG = GROUP / VEC;          // threads covering one 128-wide row segment: 16 or 32
#ifndef THREADS
#define THREADS 256
#endif
constexpr int SLOTS = THREADS / TPG;      // row segments per pass of the block
constexpr float FP8_MAX = 448.0f;
constexpr float AMAX_FLOOR = 1e-4f;       // all-zero groups get a finite scale

struct Vec { float v[VEC]; };

__device__ __forceinline__ void widen2(u32 w, float& first, float& second) {
#if IN_KIND == KIND_BF16
  bf16x2_to_f32(w, first, second);
#else
  fp16x2_to_f32(w, first, second);
#endif
}

__device__ __forceinline__ Vec unpack(u32x4 raw) {
  Vec r;
#if IN_KIND == KIND_FP32
  r.v[0] = __uint_as_float(raw.x); r.v[1] = __uint_as_float(raw.y);
  r.v[2] = __uint_as_float(raw.z); r.v[3] = __uint_as_float(raw.w);
#else
  widen2(raw.x, r.v[0], r.v[1]);
  widen2(raw.y, r.v[2], r.v[3]);
  widen2(raw.z, r.v[4], r.v[5]);
  widen2(raw.w, r.v[6], r.v[7]);
#endif
  return r;
}

__device__ __forceinline__ float vec_amax(const Vec& x) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) m = fmaxf(m, fabsf(x.v[i]));
  return m;
}

// Quantize one vector with multiplier `inv` and store its VEC fp8 bytes.
__device__ __forceinline__ void store_q(u8* dst, const Vec& x, float inv) {
  const u32 lo = pack_e4m3x4(x.v[0] * inv, x.v[1] * inv, x.v[2] * inv, x.v[3] * inv);
  if constexpr (VEC == 8) {
    st_8(dst, lo, pack_e4m3x4(x.v[4] * inv, x.v[5] * inv, x.v[6] * inv, x.v[7] * inv));
  } else {
    st_4(dst, lo);
  }
}

// ---- per token: one scale per (row, 128-column group) ---------------------------------------------------------
// A block covers 2^log2_gpb consecutive groups of rows_per_block rows (groups fastest, so the blocks running
// together read whole rows); each thread keeps UNROLL 16-byte loads in flight, one per row it visits.
// Grid: x = ceil(G / 2^log2_gpb), y = min(ceil(M / rows_per_block), 65535),
// rows_per_block = (SLOTS >> log2_gpb) * UNROLL.
#ifndef UNROLL
#define UNROLL 4
#endif

extern "C" __global__ void __launch_bounds__(THREADS) quantize_per_token(
    const u8* __restrict__ x, i64 x_row_stride,          // bytes
    u8* __restrict__ q, i64 q_row_stride,                // bytes
    float* __restrict__ scales, i64 s_stride_m, i64 s_stride_g,  // elements: M-major or row-major
    int M, int K, int log2_gpb) {
  const int lane = threadIdx.x % TPG;
  const int slot = threadIdx.x / TPG;
  const int g = (blockIdx.x << log2_gpb) + (slot & ((1 << log2_gpb) - 1));
  const int col = g * GROUP + lane * VEC;
  const bool col_ok = col < K;
  const int rows_per_pass = SLOTS >> log2_gpb;
  const i64 rows_per_block = i64(rows_per_pass) * UNROLL;
  const int sub = slot >> log2_gpb;
  // grid.y is capped at 65535, so blocks stride over row tiles. The loop bound is block-uniform: the warp
  // shuffles inside need every lane.
  for (i64 tile = blockIdx.y * rows_per_block; tile < M; tile += i64(gridDim.y) * rows_per_block) {
    const i64 row0 = tile + sub;
    u32x4 raw[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const i64 row = row0 + j * rows_per_pass;
      raw[j] = u32x4{0, 0, 0, 0};
      if (row < M && col_ok) raw[j] = ld_stream_16(x + row * x_row_stride + i64(col) * IN_BYTES);
    }
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const i64 row = row0 + j * rows_per_pass;
      const Vec v = unpack(raw[j]);
      const float amax = fmaxf(group_max<TPG>(vec_amax(v)), AMAX_FLOOR);
      if (row < M && col_ok) {
        if (lane == 0) scales[row * s_stride_m + g * s_stride_g] = amax / FP8_MAX;
        store_q(q + row * q_row_stride + col, v, FP8_MAX / amax);
      }
    }
  }
}

// ---- per block: one scale per 128x128 tile ----------------------------------------------------------------------
// Grid: x = ceil(K / 128), y = ceil(N / 128): neighbouring blocks share rows, so together they read whole rows.
// The whole tile stays in registers between the amax pass and the quantize pass.
constexpr int PASSES = GROUP / SLOTS;     // rows per thread: 8 (16-bit input) or 16 (fp32)

extern "C" __global__ void __launch_bounds__(THREADS, 2) quantize_per_block(
    const u8* __restrict__ x, i64 x_row_stride, u8* __restrict__ q, i64 q_row_stride,
    float* __restrict__ scales, i64 s_stride_n, i64 s_stride_k, int N, int K) {
  __shared__ float warp_amax[THREADS / 32];
  const int lane = threadIdx.x % TPG;
  const int slot = threadIdx.x / TPG;
  const int col = blockIdx.x * GROUP + lane * VEC;
  const bool col_ok = col < K;
  const i64 row0 = i64(blockIdx.y) * GROUP + slot;

  u32x4 raw[PASSES];
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const i64 row = row0 + p * SLOTS;
    raw[p] = u32x4{0, 0, 0, 0};
    if (row < N && col_ok) raw[p] = ld_stream_16(x + row * x_row_stride + i64(col) * IN_BYTES);
  }
  float m = 0.f;
#pragma unroll
  for (int p = 0; p < PASSES; ++p) m = fmaxf(m, vec_amax(unpack(raw[p])));
  m = group_max<32>(m);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = m;
  __syncthreads();
  float amax = warp_amax[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
  amax = fmaxf(amax, AMAX_FLOOR);
  if (threadIdx.x == 0) scales[blockIdx.y * s_stride_n + blockIdx.x * s_stride_k] = amax / FP8_MAX;
  const float inv = FP8_MAX / amax;
  if (!col_ok) return;
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const i64 row = row0 + p * SLOTS;
    if (row < N) store_q(q + row * q_row_stride + col, unpack(raw[p]), inv);
  }
}
