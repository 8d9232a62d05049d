// Pieces shared by the persistent, warp-specialised GEMM kernels (gemm.cu, gemm_fp8.cu): the work-unit order of
// the persistent grid, freeing a pipeline stage under 2-CTA multicast, and writing accumulators to shared memory
// for a TMA store.
#pragma once
#include "common/sm90.cuh"

// PAIRING (a kernel's MCAST, 2-CTA clusters): 0 none, 1 pairs two tiles along M that share a B tile, 2 pairs two
// tiles along N that share an A tile.
struct Work {
  int tm, tn, split;
};

// Work unit -> (tile row, tile column, split) of this CTA. Units are (cluster tile, split) pairs, split fastest;
// cluster tiles (two tiles along M or N when paired, else one) run GROUP_M rows at a time, M fastest within a
// group. A CTA of a pair may get a tile past the edge (odd tile count): it still loads its half for its partner.
template <int PAIRING>
__device__ __forceinline__ Work unit_work(int unit, int splits, int cl_tiles_m, int cl_tiles_n, int group_m,
                                          u32 rank) {
  Work w;
  w.split = unit % splits;
  const int t = unit / splits;
  const int per_group = group_m * cl_tiles_n;
  const int first = t / per_group * group_m;
  const int rows = min(group_m, cl_tiles_m - first);
  const int r = t % per_group;
  w.tm = first + r % rows;
  w.tn = r / rows;
  if (PAIRING == 1) w.tm = 2 * w.tm + rank;
  if (PAIRING == 2) w.tn = 2 * w.tn + rank;
  return w;
}

// A consumer warp is done with a stage: free it in this CTA and, under multicast, in the partner (whose producer
// writes half of this CTA's stage).
template <int PAIRING>
__device__ __forceinline__ void release_stage(u64* bar, u32 rank) {
  mbar_arrive(bar);
  if constexpr (PAIRING != 0) mbar_arrive_cluster(bar, rank ^ 1);
}

// Columns j*CH .. j*CH+CH-1 of a consumer's 64-row wgmma accumulator as 16-bit values (`pack` turns two floats
// into one u32) into `buf`, in the layout a TMA map with swizzle span CH * 2 bytes reads (stmatrix: lane i gives
// the address of row i % 8 of matrix i / 8; no two lanes of a warp hit one bank).
template <int CH, typename Pack>
__device__ __forceinline__ void stmatrix_chunk(const float* acc, int j, u8* buf, int warp, int lane, Pack pack) {
  constexpr int ROW = CH * 2;
  const int row = warp * 16 + (lane / 8 % 2) * 8 + lane % 8;  // the row whose address this lane gives
#pragma unroll
  for (int g = 0; g + 1 < CH / 8; g += 2) {  // two 8-column groups per stmatrix.x4
    const int i = j * (CH / 8) + g;
    stmatrix_x4(buf + swizzled_offset<ROW>(row, g + lane / 16), pack(acc[4 * i], acc[4 * i + 1]),
                pack(acc[4 * i + 2], acc[4 * i + 3]), pack(acc[4 * i + 4], acc[4 * i + 5]),
                pack(acc[4 * i + 6], acc[4 * i + 7]));
  }
  if constexpr (CH == 8)
    stmatrix_x2(buf + swizzled_offset<ROW>(row, 0), pack(acc[4 * j], acc[4 * j + 1]),
                pack(acc[4 * j + 2], acc[4 * j + 3]));
}

// As stmatrix_chunk for fp32 outputs: columns j*CH .. j*CH+CH-1 (CH * 4 bytes a row, the map's swizzle span) as
// 8-byte pairs.
template <int CH>
__device__ __forceinline__ void f32_chunk(const float* acc, int j, u8* buf, int warp, int lane) {
#pragma unroll
  for (int g = 0; g < CH / 8; ++g) {
    const int i = j * (CH / 8) + g;
    const int col = g * 8 + (lane % 4) * 2;  // column within the chunk: granule col / 4, byte (col % 4) * 4
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp * 16 + lane / 4 + 8 * h;
      // A plain u32x2 store of the two floats made ptxas serialize every wgmma of the kernel (C7520: a
      // compiler-inserted warpgroup arrive on a divergent path); this one does not.
      st_shared_f32x2(buf + swizzled_offset<CH * 4>(row, col / 4) + (col % 4) * 4, acc[4 * i + 2 * h],
                      acc[4 * i + 2 * h + 1]);
    }
  }
}

// A consumer warpgroup's epilogue: its 64-row result goes to global memory in CHUNKS chunks of 64 x CH through two
// alternating shared buffers of `chunk_bytes` at `bufs` (`seq` counts the chunks it ever issued and picks the
// buffer). `write(j, buf)` fills chunk j; thread 0 then stores it with TMA at (col0 + j * CH, row0), or adds it
// (REDUCE). Before a buffer is rewritten the TMA operation that last read it (two chunks back) must be done
// reading. `bar` is the warpgroup's named barrier.
template <int CHUNKS, int CH, bool REDUCE, typename Write>
__device__ __forceinline__ void tma_store_chunks(const CUtensorMap_st* map, u8* bufs, int chunk_bytes, u32& seq,
                                                 int col0, int row0, int tid, int bar, Write write) {
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    u8* buf = bufs + (seq++ & 1) * chunk_bytes;
    if (tid == 0) bulk_wait_read<1>();
    named_barrier(bar, 128);
    write(j, buf);
    fence_proxy_async_smem();
    named_barrier(bar, 128);
    if (tid == 0) {
      if constexpr (REDUCE) {
        tma_reduce_add_2d(map, buf, col0 + j * CH, row0);
      } else {
        tma_store_2d(map, buf, col0 + j * CH, row0);
      }
      bulk_commit();
    }
  }
}

// As tma_store_chunks with a buffer for every chunk (`bufs`: CHUNKS x chunk_bytes): the warpgroup writes all
// chunks, then thread 0 issues all stores. Two named barriers and one proxy fence per call instead of per chunk.
// The caller's thread 0 must have waited (bulk_wait_read<0>) for the stores that last read `bufs` before the call,
// and SYNCED callers have had the warpgroup meet on a barrier since then.
template <int CHUNKS, int CH, bool SYNCED = false, typename Write>
__device__ __forceinline__ void tma_store_all(const CUtensorMap_st* map, u8* bufs, int chunk_bytes, int col0,
                                              int row0, int tid, int bar, Write write) {
  if constexpr (!SYNCED) named_barrier(bar, 128);
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) write(j, bufs + j * chunk_bytes);
  fence_proxy_async_smem();
  named_barrier(bar, 128);
  if (tid == 0) {
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) tma_store_2d(map, bufs + j * chunk_bytes, col0 + j * CH, row0);
    bulk_commit();
  }
}

// Thread 0 initialises the stage barriers (full: the producer's one arrival plus the TMA bytes; empty: one
// arrival per consumer warp of every CTA that writes into this CTA's stages), then the whole CTA, or in a cluster
// the whole cluster, synchronises: the other CTAs' barriers exist before any multicast or remote arrival.
template <bool CLUSTERED>
__device__ __forceinline__ void pipeline_init(u64* full, u64* empty, int stages, u32 empty_arrivals) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], empty_arrivals);
    }
    fence_barrier_init();
  }
  if constexpr (CLUSTERED) {
    cluster_sync();
  } else {
    __syncthreads();
  }
}

// Producer, after its last load: release the next kernel in the stream (programmatic dependent launch: it may
// start its set-up where SMs free up), then, under multicast, wait until both CTAs released every stage, so that
// no remote arrival still targets this CTA when it exits.
template <int PAIRING>
__device__ __forceinline__ void producer_finish(u64* empty, int s, u32 phase, int stages) {
  pdl_launch_dependents();
  if constexpr (PAIRING != 0) {
    for (int i = 0; i < stages; ++i) {
      mbar_wait(&empty[s], phase ^ 1);
      if (++s == stages) { s = 0; phase ^= 1; }
    }
  }
}

// One k block of an operand tile of `rows` 128-byte rows from row `row0` of a map with `row_end` rows, as one box
// per CTA: the whole tile, or (SHARED, a tile both CTAs of a pair use) this CTA's half, multicast to both. A box
// that crosses row_end is loaded through `edge`, a map of the same tensor whose box is exactly the rows left there
// (the host sizes it: every such box starts at a multiple of the box from the start of a group of row_end's
// period), and a box wholly past row_end is not issued. So TMA never fills rows past the tensor, which it does
// slowly (FP8, H100: 160x4096x7168 28.8 us with half the second tile's box filled, 20.7 without; docs/perf-notes.md
// sessions 18-20). Rows not loaded keep stale bytes: they reach only accumulator rows (A) or columns (B) past the
// tensor, which are never stored. `rows_in_bounds(...) * 128` bytes land in each CTA.
__device__ __forceinline__ int rows_in_bounds(int row0, int rows, int row_end) {
  return min(rows, max(0, row_end - row0));
}

template <bool SHARED, bool EVICT_FIRST = false>
__device__ __forceinline__ void tma_load_rows(u8* dst, const CUtensorMap_st* map, const CUtensorMap_st* edge,
                                              u64* bar, int k0, int row0, int rows, int row_end, u32 rank) {
  const int box = SHARED ? rows / 2 : rows;
  const int first = row0 + (SHARED ? int(rank) * box : 0);
  if (first >= row_end) return;
  const CUtensorMap_st* m = first + box <= row_end ? map : edge;
  if constexpr (SHARED) {
    tma_load_2d_multicast<EVICT_FIRST>(dst + (first - row0) * 128, m, bar, k0, first, 3);
  } else {
    tma_load_2d<EVICT_FIRST>(dst, m, bar, k0, first);
  }
}

// ---- split-K inside a cluster ---------------------------------------------------------------------------------
// The SPLITS CTAs of a cluster compute one tile over SPLITS slices of K (cluster rank = slice) and sum their fp32
// partials through distributed shared memory: no workspace, no counters, and a fixed order of summation (rank 0
// first), so the result is bitwise reproducible. A consumer warpgroup writes its 64 x COLS partial into its CTA's
// shared memory at `part` (rows of SPLIT_ROW(COLS) floats; the pipeline stages, free once the tile's main loop is
// done), then sums rows [rank * 64 / SPLITS, (rank + 1) * 64 / SPLITS) of it over the cluster and hands each
// 4-column group to `out(row, col, sum)`. Two cluster barriers order it: every partial is written before any is
// read, and every read is done before a CTA exits. Every thread of the cluster must pass both (an inactive
// warpgroup, one whose rows lie past M, and the producer included: see split_sync_only).
#define SPLIT_ROW(COLS) ((COLS) + 8)  // 8 floats of padding: the fragment stores below hit 32 banks per 16 lanes

template <int SPLITS, int COLS, typename Out>
__device__ __forceinline__ void cluster_split_sum(const float* acc, float* part, u32 rank, int tid, bool active,
                                                  Out out) {
  constexpr int ROW = SPLIT_ROW(COLS), GROUPS_ROW = COLS / 4, ITEMS = 4;
  const int warp = tid / 32, lane = tid % 32;
  if (active) {
#pragma unroll
    for (int i = 0; i < COLS / 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        st_shared_f32x2(part + (warp * 16 + lane / 4 + 8 * h) * ROW + 8 * i + 2 * (lane % 4), acc[4 * i + 2 * h],
                        acc[4 * i + 2 * h + 1]);
  }
  cluster_sync();  // (release / acquire at cluster scope) every partial is in place
  if (active) {
    const int r0 = int(rank) * 64 / SPLITS, groups = ((int(rank) + 1) * 64 / SPLITS - r0) * GROUPS_ROW;
    u32 base[SPLITS];
#pragma unroll
    for (int p = 0; p < SPLITS; ++p) base[p] = dsmem_addr(part, p);
    for (int g0 = tid; g0 < groups; g0 += 128 * ITEMS) {
      f32x4 v[ITEMS][SPLITS];  // every load of the round in flight before the first sum
#pragma unroll
      for (int j = 0; j < ITEMS; ++j) {
        const int g = min(g0 + 128 * j, groups - 1);
        const u32 off = ((r0 + g / GROUPS_ROW) * ROW + g % GROUPS_ROW * 4) * 4;
#pragma unroll
        for (int p = 0; p < SPLITS; ++p) v[j][p] = ld_dsmem_f32x4(base[p] + off);
      }
#pragma unroll
      for (int j = 0; j < ITEMS; ++j) {
        const int g = g0 + 128 * j;
        if (g >= groups) break;
        f32x4 s = v[j][0];
#pragma unroll
        for (int p = 1; p < SPLITS; ++p) {
          s.x += v[j][p].x; s.y += v[j][p].y; s.z += v[j][p].z; s.w += v[j][p].w;
        }
        out(r0 + g / GROUPS_ROW, g % GROUPS_ROW * 4, s);
      }
    }
  }
  cluster_sync();  // no CTA exits while another still reads its partial
}

// The producer warpgroup's side of cluster_split_sum: the same two cluster barriers.
__device__ __forceinline__ void split_sync_only() {
  __syncwarp();
  cluster_sync();
  cluster_sync();
}
