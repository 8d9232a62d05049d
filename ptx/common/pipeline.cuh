// The shared-memory stage ring of a warp-specialised kernel: a producer (one thread issuing TMA loads) fills
// RING stages, consumer warps read them and hand them back. Each stage has a `full` mbarrier (the producer's
// arrival plus the TMA bytes) and an `empty` one (one arrival per consumer warp of every CTA whose producer
// writes into the stage; in a cluster always every CTA's, also for a tile its CTAs load alone, tma_load_rows'
// `shared`, so that the counts stay in step). Producer and consumers each walk the ring with their own PipeState.
#pragma once
#include "common/sm90.cuh"

// Position in the ring: the stage, and the parity of the ring's lap (an mbarrier phase completes once a lap).
template <int RING>
struct PipeState {
  int stage = 0;
  u32 phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == RING) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// PAIRING (a kernel's MCAST; cluster_ctas, a_sharers, b_sharers in sm90.cuh): a stage of a cluster's CTAs is free
// only when the consumers of every CTA of the cluster released it.
template <int RING, int PAIRING>
struct StageRing {
  typedef PipeState<RING> State;
  static constexpr int CTAS = cluster_ctas(PAIRING);
  u64* full;
  u64* empty;
  u32 bars;  // full[0]'s shared address (empty[0] at + RING * 8): the consumers' waits and releases stay 32-bit

  // `bars`: 2 x RING mbarriers in shared memory.
  __device__ __forceinline__ explicit StageRing(u8* bars_)
      : full(reinterpret_cast<u64*>(bars_)), empty(reinterpret_cast<u64*>(bars_) + RING), bars(smem_u32(bars_)) {}

  // Thread 0 initialises the barriers, then the whole CTA, or in a cluster the whole cluster, synchronises: the
  // other CTAs' barriers exist before any multicast or remote arrival.
  template <bool CLUSTERED>
  __device__ __forceinline__ void init(u32 empty_arrivals) const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < RING; ++s) {
        mbar_init(&full[s], 1);
        mbar_init(&empty[s], empty_arrivals);
      }
      fence_barrier_init();
    }
    if constexpr (CLUSTERED) {
      cluster_sync_after_init();
    } else {
      __syncthreads();
    }
  }

  // ---- producer half ----
  // Wait until the consumers freed stage st, then announce `tx_bytes` of loads on its full barrier (returned,
  // for the loads to complete on).
  __device__ __forceinline__ u64* acquire(State st, u32 tx_bytes) const {
    mbar_wait(&empty[st.stage], st.phase ^ 1);
    mbar_arrive_expect_tx(&full[st.stage], tx_bytes);
    return &full[st.stage];
  }

  // After the last load: release the next kernel in the stream (programmatic dependent launch: it may start its
  // set-up where SMs free up), then, when paired, wait until both CTAs released every stage, so that no remote
  // arrival still targets this CTA when it exits.
  __device__ __forceinline__ void producer_finish(State st) const {
    pdl_launch_dependents();
    if constexpr (PAIRING != 0) {
      for (int i = 0; i < RING; ++i) {
        mbar_wait(&empty[st.stage], st.phase ^ 1);
        st.advance();
      }
    }
  }

  // ---- consumer half ----
  __device__ __forceinline__ void wait(State st) const { mbar_wait(bars + st.stage * 8, st.phase); }

  // The empty barrier of stage 0 that lane `lane` of a consumer warp frees: this CTA's (lane 0) or, in a cluster,
  // that of CTA rank ^ lane (lanes below CTAS: each of their producers writes part of this CTA's stage), as a
  // cluster address then. Stage s's is this + 8 s (a CTA's window is contiguous): a hot loop computes this once (the
  // mapping reads the CTA's cluster id).
  __device__ __forceinline__ u32 release_bar(u32 rank, int lane) const {
    return PAIRING != 0 ? dsmem_addr(bars + RING * 8, rank ^ u32(lane & (CTAS - 1))) : bars + RING * 8;
  }

  // A consumer warp is done with the stage whose empty barrier (for this lane) is `bar`: one arrival instruction,
  // lane 0 here and, in a cluster, lanes 1 .. CTAS - 1 in the others. CTA-scope release (the default): a
  // cluster-scope release costs a MEMBAR per arrival (measured: half the stall cycles of a multicast GEMM), and none
  // is needed to free a stage whose reads (wgmma) have completed.
  __device__ __forceinline__ void release_at(u32 bar, int lane) const {
    if constexpr (PAIRING != 0) {
      if (lane < CTAS) asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(bar) : "memory");
    } else {
      if (lane == 0) mbar_arrive(bar);
    }
  }

  // release_at as a predicated instruction. With a branch around the arrivals ptxas computed their addresses only
  // after the wgmma wait they follow; predicated, it does so while the group runs (H100: FP8 256 x 128 tiles 11%
  // faster, BF16 one-consumer tiles on long K 1.2x).
  __device__ __forceinline__ void release_predicated_at(u32 bar, int lane) const {
    if constexpr (PAIRING != 0) {
      asm volatile(
          "{\n\t.reg .pred p;\n\tsetp.lt.s32 p, %1, %2;\n\t@p mbarrier.arrive.shared::cluster.b64 _, [%0];\n\t}"
          :: "r"(bar), "r"(lane), "n"(CTAS) : "memory");
    } else {
      mbar_arrive_by_lane0(bar, lane);
    }
  }

  // The same for loops that do not keep release_bar (its mapping is then redone a call when paired).
  __device__ __forceinline__ void release_predicated(int stage, u32 rank, int lane) const {
    release_predicated_at(release_bar(rank, lane) + stage * 8, lane);
  }
};

// The set-up of a warp-specialised kernel: thread 0 prefetches the tensor maps (null ones are skipped), the ring's
// barriers are initialised, lane 0 of warp 1 (a producer warp that issues no loads, so the loads never wait on it)
// runs `warm` (the kernel's L2 prefetches of its first loads, or nothing), then the kernel waits for the previous
// one in the stream (programmatic dependent launch: this overlapped its tail; from here on global memory it wrote,
// or still read, may be touched).
template <bool CLUSTERED, class Ring, class Warm, typename... Maps>
__device__ __forceinline__ void kernel_prologue(const Ring& ring, u32 empty_arrivals, Warm warm, const Maps*... maps) {
  if (threadIdx.x == 0) {
    ((maps ? tma_prefetch_map(maps) : void()), ...);
  }
  ring.template init<CLUSTERED>(empty_arrivals);
  if (threadIdx.x == 32) warm();
  pdl_wait();
}

// One k block of an operand tile of `rows` 128-byte rows from row `row0` of a map with `row_end` rows, as one box
// per CTA: the whole tile, or (SHARERS CTAs of a cluster use it: a_sharers / b_sharers) this CTA's part, rank r's
// rows [r rows / SHARERS, (r + 1) rows / SHARERS), multicast to all of them. A box
// that crosses row_end is loaded through `edge`, a map of the same tensor whose box is exactly the rows left there
// (the host sizes it: every such box starts at a multiple of the box from the start of a group of row_end's
// period), and a box wholly past row_end is not issued. So TMA never fills rows past the tensor, which it does
// slowly (FP8, H100: 160x4096x7168 28.8 us with half the second tile's box filled, 20.7 without). Rows not loaded
// keep stale bytes: they reach only accumulator rows (A) or columns (B) past the tensor, which are never stored.
// `rows_in_bounds(...) * 128` bytes land in each CTA.
__device__ __forceinline__ int rows_in_bounds(int row0, int rows, int row_end) {
  return min(rows, max(0, row_end - row0));
}

// The box of tma_load_rows: its map (`map`, or `edge` where it crosses row_end) and first row; null where it lies
// wholly past row_end.
template <int SHARERS>
__device__ __forceinline__ const CUtensorMap_st* row_box(const CUtensorMap_st* map, const CUtensorMap_st* edge,
                                                         int row0, int rows, int row_end, u32 rank, int& first) {
  static_assert(SHARERS == 1 || SHARERS == 2 || SHARERS == 4, "a tile is shared by 1, 2 or 4 CTAs");
  const int box = rows / SHARERS;
  first = row0 + (SHARERS > 1 ? int(rank) * box : 0);
  if (first >= row_end) return nullptr;
  return first + box <= row_end ? map : edge;
}

// Not `shared` (a cluster whose CTAs have tiles of their own for once): this CTA loads every box of its tile.
template <int SHARERS, bool EVICT_FIRST = false>
__device__ __forceinline__ void tma_load_rows(u8* dst, const CUtensorMap_st* map, const CUtensorMap_st* edge,
                                              u64* bar, int k0, int row0, int rows, int row_end, u32 rank,
                                              bool shared = true) {
  int first;
  if (SHARERS > 1 && !shared) {
    for (u32 part = 0; part < SHARERS; ++part) {
      const CUtensorMap_st* m = row_box<SHARERS>(map, edge, row0, rows, row_end, part, first);
      if (m) tma_load_2d<EVICT_FIRST>(dst + (first - row0) * 128, m, bar, k0, first);
    }
    return;
  }
  const CUtensorMap_st* m = row_box<SHARERS>(map, edge, row0, rows, row_end, rank, first);
  if (!m) return;
  if constexpr (SHARERS > 1) {
    tma_load_2d_multicast<EVICT_FIRST>(dst + (first - row0) * 128, m, bar, k0, first, (1 << SHARERS) - 1);
  } else {
    tma_load_2d<EVICT_FIRST>(dst, m, bar, k0, first);
  }
}

// The same box into L2 only (tma_prefetch_2d).
template <int SHARERS>
__device__ __forceinline__ void tma_prefetch_rows(const CUtensorMap_st* map, const CUtensorMap_st* edge, int k0,
                                                  int row0, int rows, int row_end, u32 rank) {
  int first;
  const CUtensorMap_st* m = row_box<SHARERS>(map, edge, row0, rows, row_end, rank, first);
  if (m) tma_prefetch_2d(m, k0, first);
}
