// The shared-memory stage ring of a warp-specialised kernel: a producer (one thread issuing TMA loads) fills
// RING stages, consumer warps read them and hand them back. Each stage has a `full` mbarrier (the producer's
// arrival plus the TMA bytes) and an `empty` one (one arrival per consumer warp of every CTA whose producer
// writes into the stage). Producer and consumers each walk the ring with their own PipeState.
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

// PAIRING (a kernel's MCAST, 2-CTA clusters): 0 none; 1 or 2, the two CTAs of a cluster each load half of a tile
// they share and multicast it to both, so a stage is free only when the consumers of both CTAs released it.
template <int RING, int PAIRING>
struct StageRing {
  typedef PipeState<RING> State;
  u64* full;
  u64* empty;

  // `bars`: 2 x RING mbarriers in shared memory.
  __device__ __forceinline__ explicit StageRing(u8* bars)
      : full(reinterpret_cast<u64*>(bars)), empty(reinterpret_cast<u64*>(bars) + RING) {}

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
      cluster_sync();
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
  __device__ __forceinline__ void wait(State st) const { mbar_wait(&full[st.stage], st.phase); }

  // A consumer warp (one lane) is done with `stage`: free it here and, when paired, in the partner CTA (whose
  // producer writes half of this CTA's stage).
  __device__ __forceinline__ void release(int stage, u32 rank) const {
    mbar_arrive(&empty[stage]);
    if constexpr (PAIRING != 0) mbar_arrive_cluster(&empty[stage], rank ^ 1);
  }

  // release(stage) by lane 0 of the calling warp as predicated instructions. With a branch around the arrivals
  // ptxas computed their addresses only after the wgmma wait they follow; predicated, it does so while the group
  // runs (H100: FP8 256 x 128 tiles 11% faster, BF16 one-consumer tiles on long K 1.2x).
  __device__ __forceinline__ void release_by_lane0(int stage, u32 rank, int lane) const {
    const u32 bar = smem_u32(&empty[stage]);
    if constexpr (PAIRING != 0) {
      asm volatile("{\n\t.reg .pred p;\n\tsetp.eq.s32 p, %2, 0;\n\t@p mbarrier.arrive.shared::cta.b64 _, [%0];\n\t"
                   "@p mbarrier.arrive.shared::cluster.b64 _, [%1];\n\t}"
                   :: "r"(bar), "r"(dsmem_addr(bar, rank ^ 1)), "r"(lane) : "memory");
    } else {
      mbar_arrive_by_lane0(bar, lane);
    }
  }
};

// The set-up of a warp-specialised kernel: thread 0 prefetches the tensor maps (null ones are skipped), the ring's
// barriers are initialised, then the kernel waits for the previous one in the stream (programmatic dependent
// launch: this overlapped its tail; from here on global memory it wrote, or still read, may be touched).
template <bool CLUSTERED, class Ring, typename... Maps>
__device__ __forceinline__ void kernel_prologue(const Ring& ring, u32 empty_arrivals, const Maps*... maps) {
  if (threadIdx.x == 0) {
    ((maps ? tma_prefetch_map(maps) : void()), ...);
  }
  ring.template init<CLUSTERED>(empty_arrivals);
  pdl_wait();
}

// One k block of an operand tile of `rows` 128-byte rows from row `row0` of a map with `row_end` rows, as one box
// per CTA: the whole tile, or (SHARED, a tile both CTAs of a pair use) this CTA's half, multicast to both. A box
// that crosses row_end is loaded through `edge`, a map of the same tensor whose box is exactly the rows left there
// (the host sizes it: every such box starts at a multiple of the box from the start of a group of row_end's
// period), and a box wholly past row_end is not issued. So TMA never fills rows past the tensor, which it does
// slowly (FP8, H100: 160x4096x7168 28.8 us with half the second tile's box filled, 20.7 without). Rows not loaded
// keep stale bytes: they reach only accumulator rows (A) or columns (B) past the tensor, which are never stored.
// `rows_in_bounds(...) * 128` bytes land in each CTA.
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
