// Decode-shaped GEMM: D[M, N] = A[M, K] @ B[N, K]^T (+ C) for M <= 16, A and B bf16 or fp16 (K-major), fp32
// accumulation, D bf16, fp16 or fp32.
//
// With at most 16 rows of A the GEMM is a stream of B through the SMs at DRAM speed; the wgmma kernel would
// need a 64-row tile (3/4 of it padding) and split-K across CTAs with a global reduction to spread B over the
// GPU. Here each CTA owns 8 * G rows of B (G groups of 8) over the whole of K, its warps split K between them,
// and the partial sums meet in shared memory: no workspace, no counters, results independent of timing.
//
// Each lane loads 16-byte pieces of A and B straight into registers (no shared-memory staging) and feeds them to
// mma.sync m16n8k16 (A: the M rows, zero beyond M; B: 8 rows of B per group). The MMA's k order is a
// permutation of memory order (lane quad q holds k = 8q .. 8q + 7 of each 32-wide half of a 64-wide k step),
// the same for A and B, so the dot products are unchanged. DEPTH k steps per warp are in flight at once.
//
// Loads ask L2 for 256-byte fills (the next pieces of each row are the neighbouring warps'): 16x4096x8192 27.9 ->
// 26.9 us (H100).
//
// Compile-time parameters: IN_KIND, OUT_KIND, C_KIND (KIND_NONE or C's dtype), G (groups of 8 rows of B per
// CTA), WARPS, DEPTH.
#include "common/memory.cuh"
#include "common/sm90.cuh"

#define KIND_NONE -1
#ifndef C_KIND
#define C_KIND KIND_NONE
#endif

constexpr int KSTEP = 64;                 // k elements per step: two 16-byte pieces per row per lane quad
constexpr int THREADS = 32 * WARPS;
constexpr int BN = 8 * G;

struct Step {
  u32x4 a[2][2];  // [row r / r + 8][k half]
  u32x4 b[G][2];  // [group][k half]
};

// Lane (r, q) = (lane / 4, lane % 4) of a warp at k step `ks`: A rows r and r + 8, B rows n0 + 8g + r, each at
// k = ks * 64 + 32h + 8q for the halves h. Pieces past M, N or K are zero (K is a multiple of 8, so a piece is
// wholly in or out).
__device__ __forceinline__ void load_step(Step& s, const u16* a, i64 lda, const u16* b, i64 ldb, int M, int N,
                                          int K, int n0, int ks, int r, int q) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int k = ks * KSTEP + 32 * h + 8 * q;
    const bool k_in = k < K;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = r + 8 * i;
      s.a[i][h] = k_in && row < M ? ld_stream_256(a + row * lda + k) : u32x4{0, 0, 0, 0};
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int n = n0 + 8 * g + r;
      s.b[g][h] = k_in && n < N ? ld_stream_256(b + n * ldb + k) : u32x4{0, 0, 0, 0};
    }
  }
}

__device__ __forceinline__ void mma_step(float (&acc)[G][4], const Step& s) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // Pieces hold k 8q + 0..7; registers x, y (k 0..3) feed one MMA, z, w (k 4..7) the next.
#pragma unroll
    for (int g = 0; g < G; ++g) {
      mma_m16n8k16<IN_KIND>(acc[g], s.a[0][h].x, s.a[1][h].x, s.a[0][h].y, s.a[1][h].y, s.b[g][h].x, s.b[g][h].y);
      mma_m16n8k16<IN_KIND>(acc[g], s.a[0][h].z, s.a[1][h].z, s.a[0][h].w, s.a[1][h].w, s.b[g][h].z, s.b[g][h].w);
    }
  }
}

template <int KIND>
__device__ __forceinline__ void store_elem(void* base, i64 idx, float v) {
  if constexpr (KIND == KIND_FP32) {
    reinterpret_cast<float*>(base)[idx] = v;
  } else if constexpr (KIND == KIND_BF16) {
    reinterpret_cast<u16*>(base)[idx] = u16(f32x2_to_bf16x2(v, 0.f));
  } else {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    reinterpret_cast<u16*>(base)[idx] = h;
  }
}

// Grid: ceil(N / BN) CTAs; a, b, c, d with element strides lda, ldb, ld_c, ld_d (a, b 16-byte aligned, lda and ldb
// multiples of 8). c may alias d (D += A @ B^T for an fp32 D: each element is read, then written, by one thread).
extern "C" __global__ void __launch_bounds__(THREADS) gemm_decode_kernel(
    const u16* __restrict__ a, i64 lda, const u16* __restrict__ b, i64 ldb, void* d, i64 ld_d, const void* c,
    i64 ld_c, int M, int N, int K) {
  __shared__ alignas(16) float partial[WARPS][G][32][4];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, q = lane % 4;
  const int n0 = blockIdx.x * BN;
  // Warp w takes k steps w, w + WARPS, ...: at any time the CTA's warps read neighbouring pieces of each row.
  const int steps = (K + KSTEP - 1) / KSTEP;
  const int first = warp, stride = WARPS, count = (steps - warp + WARPS - 1) / WARPS;

  float acc[G][4];
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;

  pdl_wait();
  // A ring of DEPTH k steps in registers: the warp's j-th step lives in ring[j % DEPTH], refilled once used.
  Step ring[DEPTH];
#pragma unroll
  for (int i = 0; i < DEPTH; ++i)
    if (i < count) load_step(ring[i], a, lda, b, ldb, M, N, K, n0, first + i * stride, r, q);
  for (int base = 0; base < count; base += DEPTH) {
#pragma unroll
    for (int i = 0; i < DEPTH; ++i) {
      if (base + i < count) {
        mma_step(acc, ring[i]);
        const int j = base + i + DEPTH;
        if (j < count) load_step(ring[i], a, lda, b, ldb, M, N, K, n0, first + j * stride, r, q);
      }
    }
  }

  // Sum the warps' partials in a fixed order, then D = sum (+ C).
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 4; ++e) partial[warp][g][lane][e] = acc[g][e];
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * 32 * 4; idx += THREADS) {
    const int g = idx / 128, l = idx / 4 % 32, e = idx % 4;
    const int m = l / 4 + (e >= 2 ? 8 : 0), n = n0 + 8 * g + (l % 4) * 2 + (e & 1);
    if (m >= M || n >= N) continue;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += (&partial[w][g][l][0])[e];
#if C_KIND != KIND_NONE
    v += load_elem<C_KIND>(c, m * ld_c + n);
#endif
    store_elem<OUT_KIND>(d, m * ld_d + n, v);
  }
}
