// FP8 block-scaled GEMM (the DeepGEMM recipe): D[M, N] (bf16) = (A[M, K] * sA) @ (B[N, K] * sB)^T with A and B
// e4m3 (K-major), sA one fp32 scale per 1x128 group of a row of A, stored M-major (sA[kb * ld_sa + m]), and sB one
// fp32 scale per 128x128 block of B (sB[nb * sb_row + kb * sb_col], any strides).
//
// The structure is gemm.cu's: persistent grid, warpgroup 0 a TMA producer filling a STAGES-deep ring (A, B and
// this k block's sA column), BM / 64 consumer warpgroups each owning 64 rows of the BM x BN tile, grouped tile
// order, optional 2-CTA clusters with TMA multicast (MCAST 1: pairs along M share B; 2: pairs along N share A),
// stmatrix + TMA store epilogue. Per 128-deep k block (one scale block) a consumer runs four wgmma m64nBNk32 into
// a scratch accumulator, waits for them, frees the stage and adds the scratch into its fp32 result scaled by
// sA (per row) x sB (per 128 columns): FP8 wgmma keeps about 14 mantissa bits, so each scale block is summed
// by the tensor cores and promoted to fp32 in registers. TMA zero-fills A, B and sA past M, N and K.
//
// Compile-time parameters: BM (64, 128), BN (16..192, step 16), STAGES, MCAST.
#include "common/gemm_tiles.cuh"
#include "common/wgmma_ops.cuh"

#ifndef MCAST
#define MCAST 0
#endif

constexpr int BK = 128;  // e4m3 elements = bytes: one 128-byte swizzle span, four k32 wgmma steps, one scale block
constexpr int CONSUMERS = BM / 64;
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int A_STAGE = BM * BK;
constexpr int B_STAGE = BN * BK;
constexpr int SA_STAGE = BM * 4;
constexpr int CH = BN % 64 == 0 ? 64 : BN % 32 == 0 ? 32 : 16;  // bf16 output chunk: rows of at most 128 bytes
constexpr int CHUNKS = BN / CH;
constexpr int CHUNK_BYTES = 64 * CH * 2;
constexpr int CLUSTER = MCAST ? 2 : 1;
constexpr int ACC = BN / 2;  // fp32 accumulator registers per thread for m64nBN
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = CONSUMERS == 1 ? 256 : 232;
static_assert(BM == 64 || BM == 128, "BM must be 64 or 128");
static_assert(BN % 16 == 0 && BN >= 16 && BN <= 192, "BN must be a multiple of 16 in 16..192");
static_assert(MCAST == 0 || (MCAST == 1 && BN % 16 == 0) || (MCAST == 2 && BM == 128),
              "multicast halves must be whole 8-row swizzle atoms");

// A tile starts at a multiple of BN, so it crosses at most SB_BLOCKS 128-column scale blocks of B: with
// g = gcd(BN, 128) (the lowest set bit of BN, at most 128) its first column sits at most 128 - g into a block
// (BN = 176: up to three blocks).
constexpr int BN_GCD_128 = (BN & -BN) < 128 ? (BN & -BN) : 128;
constexpr int SB_BLOCKS = (128 - BN_GCD_128 + BN + 127) / 128;
static_assert(SB_BLOCKS <= 3, "a tile spans at most three scale blocks of B");

// Shared memory (from a 1024-byte aligned base): A stages | B stages | sA stages | output chunks | barriers.
constexpr int SMEM_B = STAGES * A_STAGE;
constexpr int SMEM_SA = SMEM_B + STAGES * B_STAGE;
constexpr int SMEM_D = (SMEM_SA + STAGES * SA_STAGE + 1023) / 1024 * 1024;
constexpr int SMEM_BARS = SMEM_D + CONSUMERS * 2 * CHUNK_BYTES;  // then 2 x STAGES mbarriers

// tm_a / tm_b: boxes {128, BM} / {128, BN} (halves under multicast), 128-byte swizzle; tm_sa: the M-major scales
// of A as a [K/128][M] fp32 tensor, box {BM, 1}; tm_d: D in bf16, box {CH, 64}, swizzle CH * 2.
extern "C" __global__ void __launch_bounds__(THREADS, 1) gemm_fp8_kernel(
    const __grid_constant__ CUtensorMap_st tm_a, const __grid_constant__ CUtensorMap_st tm_b,
    const __grid_constant__ CUtensorMap_st tm_sa, const __grid_constant__ CUtensorMap_st tm_d, const float* sb,
    i64 sb_row, i64 sb_col, int M, int N, int K, int group_m) {
  extern __shared__ u8 smem_raw[];
  u8* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  u64* full = reinterpret_cast<u64*>(smem + SMEM_BARS);
  u64* empty = full + STAGES;

  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const int cl_tiles_m = MCAST == 1 ? (tiles_m + 1) / 2 : tiles_m;
  const int cl_tiles_n = MCAST == 2 ? (tiles_n + 1) / 2 : tiles_n;
  const int units = cl_tiles_m * cl_tiles_n;
  const int k_blocks = (K + BK - 1) / BK;
  const int first_unit = blockIdx.x / CLUSTER, unit_step = gridDim.x / CLUSTER;
  const u32 rank = MCAST ? cluster_rank() : 0;
  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    tma_prefetch_map(&tm_a);
    tma_prefetch_map(&tm_b);
    tma_prefetch_map(&tm_sa);
    tma_prefetch_map(&tm_d);
  }
  pipeline_init<MCAST>(full, empty, STAGES, CLUSTER * CONSUMERS * 4);

  if (wg == 0) {
    // ---- producer ----
    regs_decrease<PRODUCER_REGS>();
    if (tid != 0) return;
    int s = 0;
    u32 phase = 0;
    for (int unit = first_unit; unit < units; unit += unit_step) {
      const Work wk = unit_work<MCAST>(unit, 1, cl_tiles_m, cl_tiles_n, group_m, rank);
      const int m0 = wk.tm * BM, n0 = wk.tn * BN;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(&empty[s], phase ^ 1);
        mbar_arrive_expect_tx(&full[s], A_STAGE + B_STAGE + SA_STAGE);
        u8* sa = smem + s * A_STAGE;
        u8* sbt = smem + SMEM_B + s * B_STAGE;
        tma_load_operand<MCAST == 2>(sa, &tm_a, &full[s], kb * BK, m0, BM, A_STAGE, rank);
        tma_load_operand<MCAST == 1>(sbt, &tm_b, &full[s], kb * BK, n0, BN, B_STAGE, rank);
        tma_load_2d(smem + SMEM_SA + s * SA_STAGE, &tm_sa, &full[s], m0, kb);
        if (++s == STAGES) { s = 0; phase ^= 1; }
      }
    }
    producer_drain<MCAST>(empty, s, phase, STAGES);
    return;
  }

  // ---- consumers ----
  regs_increase<CONSUMER_REGS>();
  const int c = wg - 1;  // which 64-row slice of the tile
  const int warp = tid / 32, lane = tid % 32;
  const int n_blocks = (N + 127) / 128;
  u8* d_smem = smem + SMEM_D + c * 2 * CHUNK_BYTES;
  float acc[ACC], part[ACC];

  int s = 0;
  u32 phase = 0;
  u32 chunk_seq = 0;
  for (int unit = first_unit; unit < units; unit += unit_step) {
    const Work wk = unit_work<MCAST>(unit, 1, cl_tiles_m, cl_tiles_n, group_m, rank);
    const int m0 = wk.tm * BM, n0 = wk.tn * BN;
    // Column group i (8 columns) of this tile lies in B's scale block n0 / 128 + (8 i >= first_next) +
    // (8 i >= first_next + 128). Blocks past N are clamped (their columns are not stored).
    const int first_next = 128 - n0 % 128;
    const float* sb0 = sb + min(n0 / 128, n_blocks - 1) * sb_row;
    const float* sb1 = sb + min(n0 / 128 + 1, n_blocks - 1) * sb_row;
    const float* sb2 = sb + min(n0 / 128 + 2, n_blocks - 1) * sb_row;
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;

    for (int kb = 0; kb < k_blocks; ++kb) {
      // B's scales for this k block (L1/L2 hits), loaded before the wait so that their latency overlaps it.
      const float scale_b0 = __ldg(sb0 + kb * sb_col);
      const float scale_b1 = SB_BLOCKS > 1 ? __ldg(sb1 + kb * sb_col) : 0.f;
      const float scale_b2 = SB_BLOCKS > 2 ? __ldg(sb2 + kb * sb_col) : 0.f;
      mbar_wait(&full[s], phase);
      const u64 da = wgmma_desc_sw128(smem + s * A_STAGE + c * 64 * 128);
      const u64 db = wgmma_desc_sw128(smem + SMEM_B + s * B_STAGE);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < BK / 32; ++k)  // 32 e4m3 = 32 bytes = 2 descriptor units along K
        Wgmma<WgE4m3, BN>::template mma<0>(part, da + 2 * k, db + 2 * k, k != 0);
      wgmma_commit();
      const float* sa_stage = reinterpret_cast<const float*>(smem + SMEM_SA + s * SA_STAGE) + c * 64 + warp * 16;
      const float scale_a0 = sa_stage[lane / 4], scale_a1 = sa_stage[lane / 4 + 8];  // rows r and r + 8
      wgmma_wait<0>();
      fence_registers(part);
      if (lane == 0) release_stage<MCAST>(&empty[s], rank);  // sA was read above: the stage is done
      if (++s == STAGES) { s = 0; phase ^= 1; }
#pragma unroll
      for (int i = 0; i < ACC / 4; ++i) {
        const float scale_b = SB_BLOCKS > 2 && 8 * i >= first_next + 128 ? scale_b2
                              : SB_BLOCKS > 1 && 8 * i >= first_next     ? scale_b1
                                                                         : scale_b0;
        const float s0 = scale_a0 * scale_b, s1 = scale_a1 * scale_b;
        acc[4 * i] += part[4 * i] * s0;
        acc[4 * i + 1] += part[4 * i + 1] * s0;
        acc[4 * i + 2] += part[4 * i + 2] * s1;
        acc[4 * i + 3] += part[4 * i + 3] * s1;
      }
    }

    const int row0 = m0 + c * 64;
    if (row0 >= M || n0 >= N) continue;  // a slice past the edge (BM rows beyond M, or a cluster's spare tile)
    tma_store_chunks<CHUNKS, CH, false>(
        &tm_d, d_smem, CHUNK_BYTES, chunk_seq, n0, row0, tid, 1 + c, [&](int j, u8* buf) {
          stmatrix_chunk<CH>(acc, j, buf, warp, lane, [](float a, float b) { return f32x2_to_bf16x2(a, b); });
        });
  }
  if (tid == 0) bulk_wait<0>();
}
