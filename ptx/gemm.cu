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
// MCAST (clusters): 1 pairs two tiles along M that share a B tile, 2 pairs two tiles along N that share an A
// tile, 3 groups four tiles along M that share a B tile. Each CTA loads its part of the shared tile and multicasts
// it to all; a stage is free again only when the consumers of every CTA released it (remote mbarrier arrivals),
// and before exiting the producer waits for every stage to be released so that no arrival targets an exited CTA.
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
// TRANS_OUT = 1 (16-bit D) writes the tile transposed through a map over D^T: the host runs D = A B^T as
// D^T = B A^T (A and B swapped, M and N too), so that D's rows are the tile's columns, which come in steps of 8
// (wgmma's N) instead of 64: M = 300 takes two 152-column tiles (304 rows) where 128-row tiles compute 384. With
// EPI_SPLIT the workspace is in D's orientation too (partials reduce-added transposed), so the finish is the same
// row-major pass over D with the slice's rows and columns exchanged.
//
// B_KN = 1 reads B as [K, N] (N contiguous): it is loaded as ceil(BN / 64) panels of 64 N x 64 K and fed to
// wgmma as an MN-major operand (transposed B). A pair sharing B (MCAST 1) splits the panels, each CTA multicasting
// every other one. A_MN = 1 reads A as [K, M] the same way, one panel per consumer (pairs sharing A, MCAST 2,
// split them): a [K, N] B with swapped operands (TRANS_OUT), so that its tiles need not be multiples of 64 wide.
//
// STREAM_B = 1 loads B with an evict-first L2 policy (`l2_evict_first`; the host sets it where all of a B tile's
// readers run in one wave).
//
// L2_WARM = 1 (launched with PDL): before pdl_wait, a producer warp prefetches B's first k block into L2 (A's,
// the weights, with TRANS_OUT).
//
// BM = 192 (three consumers, BN <= 192) fits M in 129..192 (and 2 x 192 rows) without padding it to 256 rows: a
// 128-row tile there computes a second, mostly empty, row block. BM = 256 (four consumers, BN <= 112, stored): tall,
// narrow tiles of swapped operands (TRANS_OUT), e.g. three columns of 88 over M = 257.
//
// Compile-time parameters: IN_KIND, OUT_KIND (KIND_*), BM (64, 128, 192 or 256), BN (8..256, step 8), STAGES, EPI,
// C_KIND (KIND_NONE or the dtype of C), DETERMINISTIC, B_KN, A_MN, MCAST, STREAM_B, L2_WARM, TRANS_OUT.
#include "common/epilogue.cuh"
#include "common/pipeline.cuh"
#include "common/scheduler.cuh"
#include "common/wgmma_ops.cuh"

#ifndef STREAM_B
#define STREAM_B 0
#endif
#define EPI_STORE 0
#define EPI_ACCUMULATE 1
#define EPI_SPLIT 2
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
#ifndef A_MN
#define A_MN 0
#endif
#ifndef L2_WARM
#define L2_WARM 0
#endif
#ifndef MCAST
#define MCAST 0
#endif
#ifndef TRANS_OUT
#define TRANS_OUT 0
#endif

typedef Wg16<IN_KIND>::type WgIn;

constexpr int BK = 64;  // 64 16-bit elements = 128 bytes: one swizzle span, four k16 wgmma steps
constexpr int CONSUMERS = BM / 64;
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int OUT_BYTES = OUT_KIND == KIND_FP32 ? 4 : 2;
constexpr int A_STAGE = BM * BK * 2;
constexpr int PANEL_BYTES = BK * 128;                      // MN-major operands: 64-column panels of BK rows
constexpr int B_PANELS = (BN + 63) / 64;
constexpr int B_STAGE = B_KN ? B_PANELS * PANEL_BYTES : BN * BK * 2;
constexpr int CHUNK_KIND = EPI == EPI_STORE ? OUT_KIND : KIND_FP32;  // what the shared-memory output chunks hold
constexpr int EPI_BYTES = EPI == EPI_STORE ? OUT_BYTES : 4;
// The epilogue moves a consumer's 64 x BN result in chunks of 64 x CH through two alternating buffers, so the
// output needs 2 x 64 x CH x EPI_BYTES of shared memory per consumer instead of 64 x BN x EPI_BYTES. A chunk row
// is at most 128 bytes (one swizzle span): CH is the largest power of two dividing BN up to that.
constexpr int CH_MAX = 128 / EPI_BYTES;
constexpr int CH = BN % CH_MAX == 0 ? CH_MAX : BN % 32 == 0 ? 32 : BN % 16 == 0 ? 16 : 8;
constexpr int CHUNKS = BN / CH;
constexpr int CHUNK_ROW_BYTES = CH * EPI_BYTES;  // also the output map's swizzle span (none below 32)
constexpr int CHUNK_BYTES = 64 * CHUNK_ROW_BYTES;
constexpr int D_ROWS_BYTES = 2 * CHUNK_BYTES;
constexpr int CLUSTER = cluster_ctas(MCAST);
static_assert(MCAST == 0 || (MCAST == 1 && (B_KN ? B_PANELS >= 2 : BN % 16 == 0)) || (MCAST == 2 && BM >= 128) ||
                  (MCAST == 3 && BN % 32 == 0 && !B_KN),
              "multicast parts must be whole 8-row swizzle atoms ([K, N] B: whole panels, one pair)");
constexpr int ACC = BN / 2;                          // fp32 accumulators per thread for m64nBN
constexpr int PRODUCER_REGS = 40;
// setmaxnreg: the producer's 128 threads keep 40 registers, the consumers share the rest of the CTA's allocation.
constexpr int CONSUMER_REGS = CONSUMERS == 1 ? 256 : CONSUMERS == 2 ? 232 : CONSUMERS == 3 ? 152 : 104;
static_assert(BN % 8 == 0 && BN >= 8 && BN <= 256, "BN must be a multiple of 8 in 8..256");
// Three consumers get 152 registers each: 64 x BN accumulators up to BN = 192; four (BM = 256, stored tiles) get 104
// (launch_regs(640) = 96): up to BN = 112.
static_assert(BM == 64 || BM == 128 || (BM == 192 && BN <= 192) || (BM == 256 && BN <= 112 && EPI == EPI_STORE),
              "BM must be 64, 128, 192 (with BN <= 192) or 256 (BN <= 112, EPI_STORE)");
static_assert(BM != 192 || EPI != EPI_SPLIT || BN <= 160, "192-row split-K tiles: BN <= 160 (the finish spills)");
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= THREADS * launch_regs(THREADS),
              "setmaxnreg beyond the CTA's register allocation");
static_assert(!TRANS_OUT || (EPI != EPI_ACCUMULATE && OUT_BYTES == 2), "transposed tiles: stored or split, 16-bit D");
static_assert(!A_MN || !B_KN, "one MN-major operand at most");

// Shared memory (from a 1024-byte aligned base):
// A stages | B stages | output tile | full barriers | empty barriers | one flag per consumer.
constexpr int SMEM_B = STAGES * A_STAGE;
constexpr int SMEM_D = SMEM_B + STAGES * B_STAGE;
constexpr int SMEM_BARS = SMEM_D + CONSUMERS * D_ROWS_BYTES;
constexpr int SMEM_FLAGS = SMEM_BARS + 2 * STAGES * 8;
constexpr int SMEM_BYTES = SMEM_FLAGS + 16;

typedef StageRing<STAGES, MCAST> Ring;
typedef PipeState<STAGES> Pipe;

// MN-major operand tiles: the panels of PANELS from column col0 that start before col_end.
template <int PANELS>
__device__ __forceinline__ int panels_in_bounds(int col0, int col_end) {
  return min(PANELS, max(0, (col_end - col0 + 63) / 64));
}

// `panels` panels of 64 columns x BK rows from column col0, k row k0; SHARERS = 2 (a pair): each CTA loads every
// other panel for both.
template <int SHARERS, bool EVICT_FIRST = false>
__device__ __forceinline__ void tma_load_panels(u8* dst, const CUtensorMap_st* map, u64* bar, int col0, int k0,
                                                int panels, u32 rank) {
  static_assert(SHARERS == 1 || SHARERS == 2, "MN-major panels are shared by a pair at most");
  for (int p = SHARERS > 1 ? int(rank) : 0; p < panels; p += SHARERS) {
    if constexpr (SHARERS > 1) {
      tma_load_2d_multicast<EVICT_FIRST>(dst + p * PANEL_BYTES, map, bar, col0 + p * 64, k0, 0b11);
    } else {
      tma_load_2d<EVICT_FIRST>(dst + p * PANEL_BYTES, map, bar, col0 + p * 64, k0);
    }
  }
}

// Producer: k block kb of the tile at (m0, n0) into stage st (boxes wholly past M or N are not loaded).
__device__ __forceinline__ void load_k_block(const Ring& ring, Pipe st, u8* smem, const CUtensorMap_st* tm_a,
                                             const CUtensorMap_st* tm_b, const CUtensorMap_st* tm_a_edge,
                                             const CUtensorMap_st* tm_b_edge, int kb, int m0, int n0, int M, int N,
                                             u32 rank) {
  u8* sa = smem + st.stage * A_STAGE;
  u8* sb = smem + SMEM_B + st.stage * B_STAGE;
  const int a_panels = panels_in_bounds<BM / 64>(m0, M), b_panels = panels_in_bounds<B_PANELS>(n0, N);
  const int a_bytes = A_MN ? a_panels * PANEL_BYTES : rows_in_bounds(m0, BM, M) * 128;
  const int b_bytes = B_KN ? b_panels * PANEL_BYTES : rows_in_bounds(n0, BN, N) * 128;
  u64* bar = ring.acquire(st, a_bytes + b_bytes);
  if constexpr (A_MN) {
    tma_load_panels<a_sharers(MCAST)>(sa, tm_a, bar, m0, kb * BK, a_panels, rank);
  } else {
    tma_load_rows<a_sharers(MCAST)>(sa, tm_a, tm_a_edge, bar, kb * BK, m0, BM, M, rank);
  }
  if constexpr (B_KN) {
    tma_load_panels<b_sharers(MCAST), STREAM_B>(sb, tm_b, bar, n0, kb * BK, b_panels, rank);
  } else {
    tma_load_rows<b_sharers(MCAST), STREAM_B>(sb, tm_b, tm_b_edge, bar, kb * BK, n0, BN, N, rank);
  }
}

// Consumer c: k blocks [kb0, kb1) of a tile into acc (the first wgmma overwrites it). With two or more consumers
// each waits for its own group and frees the stage at once: the other consumers' groups keep the tensor pipe busy
// meanwhile, and the stage goes back to the producer a k block sooner (measured: 3-13% faster on large shapes
// than keeping a group in flight). A lone consumer keeps one group in flight (after issuing k block kb, it waits
// for kb-1's group and releases that stage). A consumer whose rows are all past M (`idle`: the last row of tiles)
// issues nothing and frees each stage once it is filled, so such a tile costs the tensor pipe only the rows it has.
__device__ __forceinline__ void mma_k_blocks(float (&acc)[ACC], const Ring& ring, Pipe& st, u8* smem, int kb0,
                                             int kb1, int c, int lane, u32 empty_bar, bool idle) {
  constexpr int IN_FLIGHT = CONSUMERS > 1 ? 0 : 1;
  if (CONSUMERS > 1 && idle) {  // rows all past M: only hand each stage back (after its fill, for the phases)
    for (int kb = kb0; kb < kb1; ++kb) {
      ring.wait(st);
      ring.release_predicated_at(empty_bar + st.stage * 8, lane);
      st.advance();
    }
    return;
  }
  int prev = -1;
  for (int kb = kb0; kb < kb1; ++kb) {
    ring.wait(st);
#if A_MN
    const u64 da = wgmma_desc_mn_sw128(smem + st.stage * A_STAGE + c * PANEL_BYTES, PANEL_BYTES);
    constexpr u64 DA_STEP = (16 * 128) >> 4;  // 16 K rows of 128 bytes
#else
    const u64 da = wgmma_desc_sw128(smem + st.stage * A_STAGE + c * 64 * 128);
    constexpr u64 DA_STEP = 2;                // 16 K elements = 32 bytes
#endif
#if B_KN
    const u64 db = wgmma_desc_mn_sw128(smem + SMEM_B + st.stage * B_STAGE, PANEL_BYTES);
    constexpr u64 DB_STEP = (16 * 128) >> 4;  // 16 K rows of 128 bytes
#else
    const u64 db = wgmma_desc_sw128(smem + SMEM_B + st.stage * B_STAGE);
    constexpr u64 DB_STEP = 2;                // 16 K elements = 32 bytes
#endif
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < BK / 16; ++k)
      Wgmma<WgIn, BN>::template mma<B_KN, A_MN>(acc, da + DA_STEP * k, db + DB_STEP * k, (kb != kb0) || k != 0);
    wgmma_commit();
    wgmma_wait<IN_FLIGHT>();
    if (IN_FLIGHT == 0) ring.release_predicated_at(empty_bar + st.stage * 8, lane);
    if (IN_FLIGHT == 1 && prev >= 0) ring.release_predicated_at(empty_bar + prev * 8, lane);
    prev = st.stage;
    st.advance();
  }
  wgmma_wait<0>();
  fence_registers(acc);
  if (IN_FLIGHT == 1 && prev >= 0) ring.release_predicated_at(empty_bar + prev * 8, lane);
}

// tm_a / tm_b: A and [N, K] B with boxes {BK, rows a CTA loads of a tile} (its half when shared), 128-byte
// swizzle; [K, M] A and [K, N] B: boxes {64, BK}. tm_a_edge / tm_b_edge: the same tensors with boxes of M (N)
// modulo those rows, for the box across the last row (tma_load_rows; unused for MN-major operands). tm_out:
// EPI_STORE the D map (out dtype), EPI_ACCUMULATE the fp32 D map, EPI_SPLIT the fp32 workspace map; all with box
// {CH, 64} and swizzle CHUNK_ROW_BYTES (0 below 32); TRANS_OUT: the D^T map, box {64, CH}, or with EPI_SPLIT the
// workspace's (laid out as D), box {32, CH}; 128-byte swizzle. d / ld_d: D for the split-K finalisation; w / ld_w:
// the workspace; c / ld_c: C (or null; TRANS_OUT: C^T); counters: one int per 64-row slice of every tile, zero
// between launches; group_m: cluster-tile rows per group of the tile order.
extern "C" __global__ void __launch_bounds__(THREADS, 1) gemm_kernel(
    const __grid_constant__ CUtensorMap_st tm_a, const __grid_constant__ CUtensorMap_st tm_b,
    const __grid_constant__ CUtensorMap_st tm_a_edge, const __grid_constant__ CUtensorMap_st tm_b_edge,
    const __grid_constant__ CUtensorMap_st tm_out, void* d, i64 ld_d, float* w, i64 ld_w, const void* c_ptr,
    i64 ld_c, int* counters, int M, int N, int K, int splits, int group_m) {
  u8* smem = smem_aligned_1024();
  const Ring ring(smem + SMEM_BARS);
  const u32 rank = MCAST ? cluster_rank() : 0;
  // (rows rotated by wave: the last row of tiles, cheaper where consumers are idle, spreads over the CTAs)
  const GemmScheduler<BM, BN, BK, MCAST, LAYOUT_NORMAL, 1, false, true> sched(M, N, K, splits, 1, group_m, nullptr,
                                                                              rank, CLUSTER);
  const int wg = warpgroup_index();
  const int tid = threadIdx.x % 128;
  // L2_WARM (launched with PDL): B's (TRANS_OUT: A's, the weights) first k block of this CTA's first tile into L2
  // before pdl_wait, as in gemm_fp8.cu.
  const auto warm = [&] {
    if constexpr (L2_WARM) {
      if (!sched.more(sched.first)) return;
      const GemmTile t = sched.tile(sched.first);
      if (t.kb0 >= t.kb1) return;
      if constexpr (TRANS_OUT && A_MN) {  // swapped operands: the weights are A (B is the previous kernel's output)
        for (int p = 0; p < panels_in_bounds<BM / 64>(t.m0, M); ++p)
          tma_prefetch_2d(&tm_a, t.m0 + p * 64, t.kb0 * BK);
      } else if constexpr (TRANS_OUT) {
        tma_prefetch_rows<a_sharers(MCAST)>(&tm_a, &tm_a_edge, t.kb0 * BK, t.m0, BM, M, rank);
      } else if constexpr (B_KN) {
        for (int p = 0; p < panels_in_bounds<B_PANELS>(t.n0, N); ++p)
          tma_prefetch_2d(&tm_b, t.n0 + p * 64, t.kb0 * BK);
      } else {
        tma_prefetch_rows<b_sharers(MCAST)>(&tm_b, &tm_b_edge, t.kb0 * BK, t.n0, BN, N, rank);
      }
    }
  };
  kernel_prologue<MCAST != 0>(ring, CLUSTER * CONSUMERS * 4, warm, &tm_a, &tm_b, &tm_a_edge, &tm_b_edge, &tm_out);

  if (wg == 0) {  // ---- producer: one thread issues the loads ----
    regs_decrease<PRODUCER_REGS>();
    if (tid != 0) return;
    Pipe st;
    sched.for_each_tile<false>([&](const GemmTile& t) {
      for (int kb = t.kb0; kb < t.kb1; ++kb) {
        load_k_block(ring, st, smem, &tm_a, &tm_b, &tm_a_edge, &tm_b_edge, kb, t.m0, t.n0, M, N, rank);
        st.advance();
      }
    });
    ring.producer_finish(st);
    return;
  }

  // ---- consumers: consumer c owns the 64-row slice c of every tile ----
  regs_increase<CONSUMER_REGS>();
  const int c = wg - 1;
  const int warp = tid / 32, lane = tid % 32;
  u8* d_smem = smem + SMEM_D + c * D_ROWS_BYTES;
  int* flag = reinterpret_cast<int*>(smem + SMEM_FLAGS) + c;
  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.f;

  Pipe st;
  u32 chunk_seq = 0;  // every output chunk this consumer issues; picks the buffer
  const u32 empty_bar = ring.release_bar(rank, lane);  // (paired: a cluster mapping, done once here)
  sched.for_each_tile<false>([&](const GemmTile& t) {
    const int row0 = t.m0 + c * 64;  // first row of this consumer's slice
    mma_k_blocks(acc, ring, st, smem, t.kb0, t.kb1, c, lane, empty_bar, row0 >= M);
    if (row0 >= M || t.n0 >= N) return;  // a slice past the edge (BM rows beyond M, or a cluster's spare tile)
    if constexpr (EPI == EPI_STORE && C_KIND != KIND_NONE)
      add_to_fragment<C_KIND, ACC, TRANS_OUT>(acc, c_ptr, ld_c, row0, t.n0, M, N, warp, lane);  // D = acc + C

    // registers -> shared (64 x CH chunks, two buffers) -> TMA store, or reduce-add of a split-K partial
    const auto write = [&](int j, u8* buf) { chunk_to_smem<CHUNK_KIND, CH, TRANS_OUT>(acc, j, buf, warp, lane); };
    const auto store = [&] {
      tma_store_chunks<CHUNKS, CH, EPI != EPI_STORE, decltype(write), TRANS_OUT>(&tm_out, d_smem, CHUNK_BYTES,
                                                                                 chunk_seq, t.n0, row0, tid, 1 + c,
                                                                                 write);
    };
    if constexpr (EPI == EPI_STORE) {
      store();
    } else {
      // Three consumers have 152 registers: four loads in flight, not eight.
      constexpr int FIN_LOADS = 64 * BN / 4 >= 128 * 8 && CONSUMERS < 3 ? 8 : 4;
      split_k_epilogue<DETERMINISTIC, EPI == EPI_SPLIT>(
          counters + sched.tile_index(t) * CONSUMERS + c, flag, t.split, splits, sched.one_wave(), tid, 1 + c, store,
          [&](int r_lo, int r_hi) {
            if constexpr (TRANS_OUT) {  // D's rows t.n0.. (the same share of BN), its columns row0..row0 + 63
              const int lo = r_lo * BN / 64, hi = r_hi * BN / 64;
              split_k_finish<OUT_KIND, C_KIND, 64, FIN_LOADS>(d, ld_d, w, ld_w, c_ptr, ld_c, t.n0 + lo, hi - lo, row0,
                                                             N, M, tid);
            } else {
              split_k_finish<OUT_KIND, C_KIND, BN, FIN_LOADS>(d, ld_d, w, ld_w, c_ptr, ld_c, row0 + r_lo,
                                                             r_hi - r_lo, t.n0, M, N, tid);
            }
          });
    }
  });
  epilogue_drain(tid);
}
