// D[M, N] = A[M, K] @ B[N, K]^T with fp32 accumulation; A and B bf16 or fp16 (K-major), D bf16, fp16 or fp32.
//
// Warp-specialised and persistent: warpgroup 0 is the producer (one thread issues TMA loads into a STAGES-deep
// ring of shared-memory stages); warpgroups 1..BM/64 are consumers, each owning 64 rows of the BM x BN tile and
// issuing wgmma m64nBNk16 on 128-byte-swizzled tiles. The epilogue writes the tile to shared memory (stmatrix,
// in the TMA swizzle so that no two lanes of a warp hit one bank) and one thread per consumer stores it with TMA,
// which overlaps the next tile's main loop. TMA zero-fills loads and clips stores outside the tensor, so every
// M, N, K tail is handled in the kernel (the A and B boxes that cross M or N are loaded through edge maps of
// exactly the rows left, and boxes wholly past them not at all: tma_load_rows).
// Tiles run in a grouped order (GROUP_M cluster tiles along M at a time, runtime argument) so that the CTAs of a
// wave share A and B panels in L2.
//
// MCAST (2-CTA clusters): 1 pairs two tiles along M that share a B tile, 2 pairs two tiles along N that share
// an A tile. Each CTA loads half of the shared tile and multicasts it to both; a stage is free again only when
// the consumers of both CTAs released it (remote mbarrier arrivals), and before exiting the producer waits for
// every stage to be released so that no arrival targets an exited CTA.
//
// Epilogues (EPI):
// - EPI_STORE: D = acc (+ C), through shared memory and a TMA store.
// - EPI_ACCUMULATE: D += acc for an fp32 D, through a TMA reduce-add (split-K partials add straight into D).
// - EPI_SPLIT: split-K partials are reduce-added into a zeroed fp32 workspace W and counted per 64-row slice;
//   then D = W (+ C) is written and W zeroed again, so W stays clean for the next call. When every unit is
//   resident at once, all splits of a slice wait for the count and each finishes 1/S of the rows (the splits'
//   second count resets the counter); otherwise the last split finishes the whole slice. Partials are published
//   with a full bulk wait, a proxy fence and a gpu-scope release before the counter.
// DETERMINISTIC: splits of a slice add in K order (a turnstile on the counter), so results are bitwise stable.
// Work units are (tile, split) pairs, split fastest: a unit only ever waits on a unit with a smaller index, which
// a resident CTA of this persistent grid has already started, so the turnstile cannot deadlock.
//
// B_KN = 1 reads B as [K, N] (N contiguous): it is loaded as ceil(BN / 64) panels of 64 N x 64 K and fed to
// wgmma as an MN-major operand (transposed B).
//
// STREAM_B = 1 loads B with an evict-first L2 policy (`l2_evict_first`; the host sets it where all of a B tile's
// readers run in one wave).
//
// BM = 192 (three consumers, BN <= 192) fits M in 129..192 (and 2 x 192 rows) without padding it to 256 rows: a
// 128-row tile there computes a second, mostly empty, row block.
//
// Compile-time parameters: IN_KIND, OUT_KIND (KIND_*), BM (64, 128 or 192), BN (8..256, step 8), STAGES, EPI,
// C_KIND (KIND_NONE or the dtype of C), DETERMINISTIC, B_KN, MCAST, STREAM_B.
#include "common/gemm_tiles.cuh"
#include "common/memory.cuh"
#include "common/wgmma_ops.cuh"

#ifndef STREAM_B
#define STREAM_B 0
#endif
#define EPI_STORE 0
#define EPI_ACCUMULATE 1
#define EPI_SPLIT 2
#define KIND_NONE -1
#ifndef EPI
#define EPI EPI_STORE
#endif
#ifndef C_KIND
#define C_KIND KIND_NONE
#endif
#ifndef DETERMINISTIC
#define DETERMINISTIC 0
#endif
#ifndef B_KN
#define B_KN 0
#endif
#ifndef MCAST
#define MCAST 0
#endif

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
constexpr int B_PANELS = (BN + 63) / 64;                   // [K, N] B: 64-column panels of BK rows
constexpr int B_PANEL_BYTES = BK * 128;
constexpr int B_STAGE = B_KN ? B_PANELS * B_PANEL_BYTES : BN * BK * 2;
constexpr int EPI_BYTES = EPI == EPI_STORE ? OUT_BYTES : 4;  // what the shared-memory output chunks hold
// The epilogue moves a consumer's 64 x BN result in chunks of 64 x CH through two alternating buffers, so the
// output needs 2 x 64 x CH x EPI_BYTES of shared memory per consumer instead of 64 x BN x EPI_BYTES. A chunk row
// is at most 128 bytes (one swizzle span): CH is the largest power of two dividing BN up to that.
constexpr int CH_MAX = 128 / EPI_BYTES;
constexpr int CH = BN % CH_MAX == 0 ? CH_MAX : BN % 32 == 0 ? 32 : BN % 16 == 0 ? 16 : 8;
constexpr int CHUNKS = BN / CH;
constexpr int CHUNK_ROW_BYTES = CH * EPI_BYTES;  // also the output map's swizzle span (none below 32)
constexpr int CHUNK_BYTES = 64 * CHUNK_ROW_BYTES;
constexpr int D_ROWS_BYTES = 2 * CHUNK_BYTES;
constexpr int CLUSTER = MCAST ? 2 : 1;
static_assert(MCAST == 0 || (MCAST == 1 && BN % 16 == 0 && !B_KN) || (MCAST == 2 && BM >= 128),
              "multicast halves must be whole 8-row swizzle atoms");
constexpr int ACC = BN / 2;                          // fp32 accumulators per thread for m64nBN
constexpr int PRODUCER_REGS = 40;
// setmaxnreg: the producer's 128 threads keep 40 registers, the consumers share the rest of the 64 K.
constexpr int CONSUMER_REGS = CONSUMERS == 1 ? 256 : CONSUMERS == 2 ? 232 : 152;
static_assert(BN % 8 == 0 && BN >= 8 && BN <= 256, "BN must be a multiple of 8 in 8..256");
// Three consumers get 152 registers each: 64 x BN accumulators up to BN = 192. Four would not fit (setmaxnreg
// would wait forever for registers that the producer cannot free).
static_assert(BM == 64 || BM == 128 || (BM == 192 && BN <= 192), "BM must be 64, 128 or 192 (with BN <= 192)");
static_assert(BM != 192 || EPI != EPI_SPLIT || BN <= 160, "192-row split-K tiles: BN <= 160 (the finish spills)");
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= 65536, "setmaxnreg beyond the register file");

// Shared memory (from a 1024-byte aligned base):
// A stages | B stages | output tile | full barriers | empty barriers | one flag per consumer.
constexpr int SMEM_B = STAGES * A_STAGE;
constexpr int SMEM_D = SMEM_B + STAGES * B_STAGE;
constexpr int SMEM_BARS = SMEM_D + CONSUMERS * D_ROWS_BYTES;
constexpr int SMEM_FLAGS = SMEM_BARS + 2 * STAGES * 8;
constexpr int SMEM_BYTES = SMEM_FLAGS + 16;
constexpr bool COUNTED = EPI == EPI_SPLIT || (EPI == EPI_ACCUMULATE && DETERMINISTIC);

// Four consecutive elements of a row (16-byte aligned for fp32, 8-byte for 16-bit types).
template <int KIND>
__device__ __forceinline__ f32x4 load4(const void* base, i64 idx) {
  if constexpr (KIND == KIND_FP32) {
    return *reinterpret_cast<const f32x4*>(reinterpret_cast<const float*>(base) + idx);
  } else {
    const u32x2 raw = *reinterpret_cast<const u32x2*>(reinterpret_cast<const u16*>(base) + idx);
    f32x4 v;
    if constexpr (KIND == KIND_BF16) {
      bf16x2_to_f32(raw.x, v.x, v.y);
      bf16x2_to_f32(raw.y, v.z, v.w);
    } else {
      fp16x2_to_f32(raw.x, v.x, v.y);
      fp16x2_to_f32(raw.y, v.z, v.w);
    }
    return v;
  }
}

__device__ __forceinline__ u32 pack_out(float a, float b);

template <int KIND>
__device__ __forceinline__ void store4(void* base, i64 idx, f32x4 v) {
  if constexpr (KIND == KIND_FP32) {
    *reinterpret_cast<f32x4*>(reinterpret_cast<float*>(base) + idx) = v;
  } else {
    *reinterpret_cast<u32x2*>(reinterpret_cast<u16*>(base) + idx) = u32x2{pack_out(v.x, v.y), pack_out(v.z, v.w)};
  }
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

// Write this consumer's chunk j (columns j*CH .. j*CH+CH-1 of its 64 x BN accumulator) into `buf`, laid out as
// the output map's swizzle expects: 16-bit outputs with stmatrix, fp32 as 8-byte pairs.
__device__ __forceinline__ void chunk_to_smem(const float* acc, int j, u8* buf, int warp, int lane) {
#if EPI == EPI_STORE && OUT_KIND != KIND_FP32
  stmatrix_chunk<CH>(acc, j, buf, warp, lane, [](float a, float b) { return pack_out(a, b); });
#else
  f32_chunk<CH>(acc, j, buf, warp, lane);
#endif
}

// tm_a / tm_b: A and [N, K] B with boxes {BK, rows a CTA loads of a tile} (its half when shared), 128-byte
// swizzle; [K, N] B: boxes {64, BK}. tm_a_edge / tm_b_edge: the same tensors with boxes of M (N) modulo those rows,
// for the box across the last row (tma_load_rows; unused for [K, N] B). tm_out: EPI_STORE the D map (out dtype),
// EPI_ACCUMULATE the fp32 D map, EPI_SPLIT the fp32 workspace map; all with box {CH, 64} and swizzle
// CHUNK_ROW_BYTES (0 below 32). d / ld_d: D for the split-K finalisation; w / ld_w: the workspace; c / ld_c: C (or
// null); counters: one int per 64-row slice of every tile, zero between launches; group_m: cluster-tile rows per
// group of the tile order.
extern "C" __global__ void __launch_bounds__(THREADS, 1) gemm_kernel(
    const __grid_constant__ CUtensorMap_st tm_a, const __grid_constant__ CUtensorMap_st tm_b,
    const __grid_constant__ CUtensorMap_st tm_a_edge, const __grid_constant__ CUtensorMap_st tm_b_edge,
    const __grid_constant__ CUtensorMap_st tm_out, void* d, i64 ld_d, float* w, i64 ld_w, const void* c_ptr,
    i64 ld_c, int* counters, int M, int N, int K, int splits, int group_m) {
  extern __shared__ u8 smem_raw[];
  u8* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  u64* full = reinterpret_cast<u64*>(smem + SMEM_BARS);
  u64* empty = full + STAGES;
  int* flags = reinterpret_cast<int*>(smem + SMEM_FLAGS);

  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const int cl_tiles_m = MCAST == 1 ? (tiles_m + 1) / 2 : tiles_m;
  const int cl_tiles_n = MCAST == 2 ? (tiles_n + 1) / 2 : tiles_n;
  const int units = cl_tiles_m * cl_tiles_n * splits;
  const int k_blocks = (K + BK - 1) / BK;
  const int first_unit = blockIdx.x / CLUSTER, unit_step = gridDim.x / CLUSTER;
  const u32 rank = MCAST ? cluster_rank() : 0;
  const int wg = warpgroup_index();
  const int tid = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    tma_prefetch_map(&tm_a);
    tma_prefetch_map(&tm_b);
    tma_prefetch_map(&tm_a_edge);
    tma_prefetch_map(&tm_b_edge);
    tma_prefetch_map(&tm_out);
  }
  pipeline_init<MCAST != 0>(full, empty, STAGES, CLUSTER * CONSUMERS * 4);
  pdl_wait();  // programmatic dependent launch: the previous kernel's writes (and reads) are done from here on

  if (wg == 0) {
    // ---- producer ----
    regs_decrease<PRODUCER_REGS>();
    if (tid != 0) return;
    int s = 0;
    u32 phase = 0;
    for (int unit = first_unit; unit < units; unit += unit_step) {
      const Work wk = unit_work<MCAST>(unit, splits, cl_tiles_m, cl_tiles_n, group_m, rank);
      const int m0 = wk.tm * BM, n0 = wk.tn * BN;
      for (int kb = wk.split * k_blocks / splits; kb < (wk.split + 1) * k_blocks / splits; ++kb) {
        mbar_wait(&empty[s], phase ^ 1);
        u8* sa = smem + s * A_STAGE;
        u8* sb = smem + SMEM_B + s * B_STAGE;
        // [K, N] B: panels wholly past N are not loaded
        const int b_bytes = B_KN ? min(B_PANELS, max(0, (N - n0 + 63) / 64)) * B_PANEL_BYTES
                                 : rows_in_bounds(n0, BN, N) * 128;
        mbar_arrive_expect_tx(&full[s], rows_in_bounds(m0, BM, M) * 128 + b_bytes);
        tma_load_rows<MCAST == 2>(sa, &tm_a, &tm_a_edge, &full[s], kb * BK, m0, BM, M, rank);
#if B_KN
        for (int p = 0; p * B_PANEL_BYTES < b_bytes; ++p)
          tma_load_2d<STREAM_B>(sb + p * B_PANEL_BYTES, &tm_b, &full[s], n0 + p * 64, kb * BK);
#else
        tma_load_rows<MCAST == 1, STREAM_B>(sb, &tm_b, &tm_b_edge, &full[s], kb * BK, n0, BN, N, rank);
#endif
        if (++s == STAGES) { s = 0; phase ^= 1; }
      }
    }
    producer_finish<MCAST>(empty, s, phase, STAGES);
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
  u32 chunk_seq = 0;  // every output chunk this consumer issues; picks the buffer
  for (int unit = first_unit; unit < units; unit += unit_step) {
    const Work wk = unit_work<MCAST>(unit, splits, cl_tiles_m, cl_tiles_n, group_m, rank);
    const int split = wk.split;
    const int m0 = wk.tm * BM, n0 = wk.tn * BN;
    const int kb0 = split * k_blocks / splits, kb1 = (split + 1) * k_blocks / splits;
    // With two or more consumers each waits for its own group and frees the stage at once: the other consumers'
    // groups keep the tensor pipe busy meanwhile, and the stage goes back to the producer a k block sooner
    // (measured: 3-13% faster on large shapes than keeping a group in flight). A lone consumer keeps one group in
    // flight (after issuing k block kb, it waits for kb-1's group and releases that stage).
    constexpr int IN_FLIGHT = CONSUMERS > 1 ? 0 : 1;
    int prev = -1;
    for (int kb = kb0; kb < kb1; ++kb) {
      mbar_wait(&full[s], phase);
      const u64 da = wgmma_desc_sw128(smem + s * A_STAGE + c * 64 * 128);
#if B_KN
      const u64 db = wgmma_desc_mn_sw128(smem + SMEM_B + s * B_STAGE, B_PANEL_BYTES);
      constexpr u64 DB_STEP = (16 * 128) >> 4;  // 16 K rows of 128 bytes
#else
      const u64 db = wgmma_desc_sw128(smem + SMEM_B + s * B_STAGE);
      constexpr u64 DB_STEP = 2;                // 16 K elements = 32 bytes
#endif
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < BK / 16; ++k)  // A: 16 elements = 32 bytes = 2 descriptor units along K
        Wgmma<WgIn, BN>::template mma<B_KN>(acc, da + 2 * k, db + DB_STEP * k, (kb != kb0) || k != 0);
      wgmma_commit();
      wgmma_wait<IN_FLIGHT>();
      if (IN_FLIGHT == 0 && lane == 0) release_stage<MCAST>(&empty[s], rank);
      if (IN_FLIGHT == 1 && prev >= 0 && lane == 0) release_stage<MCAST>(&empty[prev], rank);
      prev = s;
      if (++s == STAGES) { s = 0; phase ^= 1; }
    }
    wgmma_wait<0>();
    fence_registers(acc);
    if (IN_FLIGHT == 1 && prev >= 0 && lane == 0) release_stage<MCAST>(&empty[prev], rank);

    const int row0 = m0 + c * 64;  // first row of this consumer's slice
    if (row0 >= M || n0 >= N) continue;  // a slice past the edge (BM rows beyond M, or a cluster's spare tile)
#if EPI == EPI_STORE && C_KIND != KIND_NONE
    {  // D = acc + C: add C into the accumulators (fragment layout: rows r and r + 8, column pairs)
      const int r = row0 + warp * 16 + lane / 4;
#pragma unroll
      for (int i = 0; i < ACC / 4; ++i) {
        const int gc = n0 + i * 8 + (lane % 4) * 2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (r + 8 * h < M && gc < N) {  // N is even, so gc + 1 < N too
            acc[4 * i + 2 * h] += load_elem<C_KIND>(c_ptr, (r + 8 * h) * ld_c + gc);
            acc[4 * i + 2 * h + 1] += load_elem<C_KIND>(c_ptr, (r + 8 * h) * ld_c + gc + 1);
          }
        }
      }
    }
#endif

    // Epilogue: registers -> shared (64 x CH chunks, two buffers) -> TMA store or reduce-add.
#if EPI != EPI_STORE
    const int slice = (wk.tn * tiles_m + wk.tm) * CONSUMERS + c;
    // The waits below spin in the whole of warp 0 on a warp-uniform value, not in thread 0 alone: a spin loop in
    // one thread makes the consumer's control flow divergent to ptxas, which then keeps the main loop's stage and
    // wgmma descriptors in ordinary registers (R2UR before every wgmma).
    const bool lead_warp = warp_uniform(warp) == 0;
    if (DETERMINISTIC && splits > 1 && lead_warp) {
      while (warp_uniform(load_acquire_gpu(&counters[slice])) != split) {  // K order: the previous split's add
      }
    }
#endif
    tma_store_chunks<CHUNKS, CH, EPI != EPI_STORE>(&tm_out, d_smem, CHUNK_BYTES, chunk_seq, n0, row0, tid, 1 + c,
                                                   [&](int j, u8* buf) { chunk_to_smem(acc, j, buf, warp, lane); });
#if EPI != EPI_STORE
    // With every unit resident at once (one wave), all splits of a slice wait until the last partial is in and each
    // then finishes 1/S of its rows; otherwise (forced splits beyond one wave) the last split finishes the slice.
    const bool spread = EPI == EPI_SPLIT && units <= unit_step;
    int passed = 0;  // spread: splits past the wait before this one (second round of counts, read after the finish)
    if (lead_warp && COUNTED && splits > 1) {
      bulk_wait<0>();  // the partial is in global memory, not just read out of shared memory (thread 0's stores)
      fence_proxy_async_global();
      fence_acq_rel_gpu();
      bool last = false;
      if (DETERMINISTIC) {
        last = split == splits - 1;
        if ((!last || spread) && lane == 0) store_release_gpu(&counters[slice], split + 1);
      } else if (spread) {
        if (lane == 0) red_add_relaxed_gpu(&counters[slice], 1);  // no reply to wait for: every split polls below
      } else {
        last = warp_uniform(lane == 0 ? atomic_add_relaxed_gpu(&counters[slice], 1) : 0) == splits - 1;
      }
      if (spread) {  // the acquire orders the finish's reads of W (generic loads) after the other partials
        while (warp_uniform(load_acquire_gpu(&counters[slice])) < splits) {
          __nanosleep(32);  // fewer polls of a hot line while the partials still stream into L2
        }
        if (lane == 0) passed = atomic_add_relaxed_gpu(&counters[slice], 1);  // its reply overlaps the finish
      } else if (last) {
        fence_acq_rel_gpu();
        fence_proxy_async_global();
      }
      if (lane == 0) flags[c] = last || spread;
    }
#if EPI == EPI_SPLIT
    if (splits > 1) {
      named_barrier(1 + c, 128);  // every thread sees flags[c], after tid 0's acquire
      if (flags[c]) {
        // D = W (+ C) for this slice's rows [r_lo, r_hi), then zero them in W. FIN_LOADS independent 16-byte loads
        // per thread are in flight before any store (the latency, not the bytes, is what this step costs). N is a
        // multiple of 4, so a 4-column group is wholly in or out.
        const int r_lo = spread ? split * 64 / splits : 0, r_hi = spread ? (split + 1) * 64 / splits : 64;
        const int groups = (r_hi - r_lo) * (BN / 4);
        constexpr int FIN_LOADS = 64 * BN / 4 >= 128 * 8 && CONSUMERS < 3 ? 8 : 4;  // three consumers: 152 registers
        for (int base = tid; base < groups; base += 128 * FIN_LOADS) {
          f32x4 v[FIN_LOADS];
          i64 wi[FIN_LOADS], di[FIN_LOADS], ci[FIN_LOADS];
          bool ok[FIN_LOADS];
#pragma unroll
          for (int j = 0; j < FIN_LOADS; ++j) {
            const int g = base + j * 128;
            const int gr = row0 + r_lo + g / (BN / 4), gc = n0 + (g % (BN / 4)) * 4;
            ok[j] = g < groups && gr < M && gc < N;
            wi[j] = gr * ld_w + gc;
            di[j] = gr * ld_d + gc;
            ci[j] = gr * ld_c + gc;
            if (ok[j]) v[j] = ld_cg_f32x4(w + wi[j]);
          }
#pragma unroll
          for (int j = 0; j < FIN_LOADS; ++j) {
            if (!ok[j]) continue;
#if C_KIND != KIND_NONE
            const f32x4 cv = load4<C_KIND>(c_ptr, ci[j]);
            v[j].x += cv.x; v[j].y += cv.y; v[j].z += cv.z; v[j].w += cv.w;
#endif
            store4<OUT_KIND>(d, di[j], v[j]);
            *reinterpret_cast<f32x4*>(w + wi[j]) = f32x4{0.f, 0.f, 0.f, 0.f};
          }
        }
        if (tid == 0) {
          if (!spread || passed == 2 * splits - 1) counters[slice] = 0;  // (spread: every split is past its wait)
        }
      }
    }
#else
    if (DETERMINISTIC && splits > 1 && tid == 0 && flags[c]) counters[slice] = 0;
#endif
#endif
  }
  if (tid == 0) bulk_wait<0>();
}
