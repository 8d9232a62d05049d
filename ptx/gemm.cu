// D[M, N] = A[M, K] @ B[N, K]^T with fp32 accumulation; A and B bf16 or fp16 (K-major), D bf16, fp16 or fp32.
//
// Warp-specialised and persistent: warpgroup 0 is the producer (one thread issues TMA loads into a STAGES-deep
// ring of shared-memory stages); warpgroups 1..BM/64 are consumers, each owning 64 rows of the BM x BN tile and
// issuing wgmma m64nBNk16 on 128-byte-swizzled tiles. The epilogue writes the tile to shared memory and one
// thread per consumer stores it with TMA, which overlaps the next tile's main loop. TMA zero-fills loads and
// clips stores outside the tensor, so every M, N, K tail is handled in the kernel.
//
// Compile-time parameters: IN_KIND, OUT_KIND (KIND_*), BM (64, 128, 192, 256), BN (8..256, step 8), STAGES.
#include "common/sm90.cuh"
#include "common/wgmma_ops.cuh"

#if IN_KIND == KIND_BF16
typedef WgBf16 WgIn;
#else
typedef WgFp16 WgIn;
#endif

constexpr int BK = 64;  // 64 16-bit elements = 128 bytes: one swizzle span, four k16 wgmma steps
constexpr int CONSUMERS = BM / 64;
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int OUT_BYTES = OUT_KIND == KIND_FP32 ? 4 : 2;
constexpr int A_STAGE = BM * BK * 2;
constexpr int B_STAGE = BN * BK * 2;
constexpr int D_ROWS_BYTES = 64 * BN * OUT_BYTES;  // one consumer's part of the output tile
constexpr int ACC = BN / 2;                          // fp32 accumulators per thread for m64nBN
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = CONSUMERS == 1 ? 256 : (CONSUMERS == 2 ? 232 : 160);
static_assert(BN % 8 == 0 && BN >= 8 && BN <= 256, "BN must be a multiple of 8 in 8..256");
static_assert(BM % 64 == 0 && BM >= 64 && BM <= 256, "BM must be 64, 128, 192 or 256");

// Shared memory (from a 1024-byte aligned base): A stages | B stages | D tile | full barriers | empty barriers.
constexpr int SMEM_B = STAGES * A_STAGE;
constexpr int SMEM_D = SMEM_B + STAGES * B_STAGE;
constexpr int SMEM_BARS = SMEM_D + CONSUMERS * D_ROWS_BYTES;
constexpr int SMEM_BYTES = SMEM_BARS + 2 * STAGES * 8;

__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int& m0, int& n0) {
  m0 = (tile % tiles_m) * BM;
  n0 = (tile / tiles_m) * BN;
}

__device__ __forceinline__ u32 pack_out(float a, float b) {
#if OUT_KIND == KIND_BF16
  return f32x2_to_bf16x2(a, b);
#else
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) gemm_kernel(
    const __grid_constant__ CUtensorMap_st tm_a, const __grid_constant__ CUtensorMap_st tm_b,
    const __grid_constant__ CUtensorMap_st tm_d, int M, int N, int K) {
  extern __shared__ u8 smem_raw[];
  u8* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  u64* full = reinterpret_cast<u64*>(smem + SMEM_BARS);
  u64* empty = full + STAGES;

  const int tiles_m = (M + BM - 1) / BM;
  const int tiles = tiles_m * ((N + BN - 1) / BN);
  const int k_blocks = (K + BK - 1) / BK;
  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CONSUMERS * 4);  // one arrival per consumer warp
    }
    fence_barrier_init();
    tma_prefetch_map(&tm_a);
    tma_prefetch_map(&tm_b);
    tma_prefetch_map(&tm_d);
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer ----
    regs_decrease<PRODUCER_REGS>();
    if (tid != 0) return;
    int s = 0;
    u32 phase = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      int m0, n0;
      tile_coords(tile, tiles_m, m0, n0);
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(&empty[s], phase ^ 1);
        mbar_arrive_expect_tx(&full[s], A_STAGE + B_STAGE);
        tma_load_2d(smem + s * A_STAGE, &tm_a, &full[s], kb * BK, m0);
        tma_load_2d(smem + SMEM_B + s * B_STAGE, &tm_b, &full[s], kb * BK, n0);
        if (++s == STAGES) { s = 0; phase ^= 1; }
      }
    }
    return;
  }

  // ---- consumers ----
  regs_increase<CONSUMER_REGS>();
  const int c = wg - 1;          // which 64-row slice of the tile
  const int warp = tid / 32, lane = tid % 32;
  u8* d_smem = smem + SMEM_D + c * D_ROWS_BYTES;
  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.f;

  int s = 0;
  u32 phase = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int m0, n0;
    tile_coords(tile, tiles_m, m0, n0);
    for (int kb = 0; kb < k_blocks; ++kb) {
      mbar_wait(&full[s], phase);
      const u64 da = wgmma_desc_sw128(smem + s * A_STAGE + c * 64 * 128);
      const u64 db = wgmma_desc_sw128(smem + SMEM_B + s * B_STAGE);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < BK / 16; ++k)  // 16 elements = 32 bytes = 2 descriptor units along K
        Wgmma<WgIn, BN>::template mma<0>(acc, da + 2 * k, db + 2 * k, (kb | k) != 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(acc);
      if (lane == 0) mbar_arrive(&empty[s]);
      if (++s == STAGES) { s = 0; phase ^= 1; }
    }

    // Epilogue: registers -> shared (row-major 64 x BN) -> TMA store. The previous tile's store must have
    // finished reading this buffer first.
    if (tid == 0) bulk_wait_read<0>();
    named_barrier(1 + c, 128);
    const int r = warp * 16 + lane / 4;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      const int col = i * 8 + (lane % 4) * 2;
#if OUT_KIND == KIND_FP32
      float* p0 = reinterpret_cast<float*>(d_smem + (r * BN + col) * 4);
      float* p1 = reinterpret_cast<float*>(d_smem + ((r + 8) * BN + col) * 4);
      p0[0] = acc[4 * i + 0]; p0[1] = acc[4 * i + 1];
      p1[0] = acc[4 * i + 2]; p1[1] = acc[4 * i + 3];
#else
      *reinterpret_cast<u32*>(d_smem + (r * BN + col) * 2) = pack_out(acc[4 * i + 0], acc[4 * i + 1]);
      *reinterpret_cast<u32*>(d_smem + ((r + 8) * BN + col) * 2) = pack_out(acc[4 * i + 2], acc[4 * i + 3]);
#endif
    }
    fence_proxy_async_smem();
    named_barrier(1 + c, 128);
    if (tid == 0) {
      tma_store_2d(&tm_d, d_smem, n0, m0 + c * 64);
      bulk_commit();
    }
  }
  if (tid == 0) bulk_wait<0>();
}
