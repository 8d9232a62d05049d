// Hopper primitives shared by every TMA/wgmma kernel: shared addresses, mbarriers, TMA load/store/reduce,
// proxy fences, wgmma descriptors and synchronisation, register reallocation, named barriers.
#pragma once
#include "common/types.cuh"

// 32-bit shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u64 a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return u32(a);
}

// The dynamic shared memory from its first 1024-byte boundary (128-byte swizzled TMA tiles and their wgmma
// descriptors need that alignment; the launch's size leaves room for the slack).
__device__ __forceinline__ u8* smem_aligned_1024() {
  extern __shared__ u8 smem_raw[];
  return smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
}

// ---- clusters of CTAs sharing operand tiles (a kernel's MCAST, "pairing") -----------------------------------------
// 0 none; 1 or 2, the two CTAs of a cluster each load half of a tile they share (1: tiles along M share B, 2: along N
// share A) and multicast it to both; 3, four CTAs along M each load a quarter of the B tile they share.
__host__ __device__ constexpr int cluster_ctas(int pairing) { return pairing == 3 ? 4 : pairing != 0 ? 2 : 1; }
// The CTAs that share (each loading a part of) the A and the B tile.
__host__ __device__ constexpr int a_sharers(int pairing) { return pairing == 2 ? 2 : 1; }
__host__ __device__ constexpr int b_sharers(int pairing) { return pairing == 1 ? 2 : pairing == 3 ? 4 : 1; }

// ---- mbarrier ----------------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u64* bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(arrivals) : "memory");
}

// Make initialised barriers visible to the async proxy (TMA) and the rest of the cluster.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u64* bar) { mbar_arrive(smem_u32(bar)); }

// Lane 0 of the calling warp arrives, as a predicated instruction (no branch: ptxas then computes the address while
// earlier work, a wgmma group, still runs; see StageRing::release_predicated).
__device__ __forceinline__ void mbar_arrive_by_lane0(u32 bar, int lane) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.eq.s32 p, %1, 0;\n\t@p mbarrier.arrive.shared::cta.b64 _, [%0];\n\t}"
               :: "r"(bar), "r"(lane) : "memory");
}

// Arrive and announce `bytes` of TMA traffic that will complete on this barrier.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
               "selp.u32 %0, 1, 0, p;\n\t}"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done;
}

// Wait until the barrier's phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) { mbar_wait(smem_u32(bar), parity); }

// ---- TMA (bulk tensor copies) -------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap_st* map) {
  asm volatile("prefetch.tensormap [%0];" :: "l"(map) : "memory");
}

// A box of `map` into L2 only (no shared memory, no barrier): warms L2 for a load of the same box. L2 is the GPU's
// point of coherence, so this may run before pdl_wait: a line the previous kernel writes later is updated there.
__device__ __forceinline__ void tma_prefetch_2d(const CUtensorMap_st* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" :: "l"(map), "r"(c0), "r"(c1)
               : "memory");
}

// An L2 policy under which the lines a copy brings in are the first to be evicted: for an operand whose lines
// are each read once, or only by CTAs running at the same time, so that its stream does not push out lines that
// are read again (the other operand, split-K partials).
__device__ __forceinline__ u64 l2_evict_first() {
  u64 policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Global -> shared, completing `box bytes` on `bar`. Coordinates are innermost first; out-of-bounds parts of the
// box are filled with zeros (and still count towards the transaction bytes). EVICT_FIRST: see l2_evict_first.
template <bool EVICT_FIRST = false>
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap_st* map, u64* bar, int c0, int c1) {
  if constexpr (EVICT_FIRST) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4}], [%2], %5;"
        :: "r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "l"(l2_evict_first()) : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
        :: "r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1) : "memory");
  }
}

// As tma_load_2d, but the box lands at the same shared offset in every CTA of `cta_mask` (this cluster's ranks)
// and completes its bytes on the barrier at the same offset in each of them.
template <bool EVICT_FIRST = false>
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap_st* map, u64* bar, int c0, int c1,
                                                      u16 cta_mask) {
  if constexpr (EVICT_FIRST) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        ".L2::cache_hint [%0], [%1, {%3, %4}], [%2], %5, %6;"
        :: "r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(cta_mask), "l"(l2_evict_first())
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%3, %4}], [%2], %5;"
        :: "r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(cta_mask) : "memory");
  }
}

// Shared -> global; the out-of-bounds part of the box is not written.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap_st* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
               :: "l"(map), "r"(smem_u32(src)), "r"(c0), "r"(c1) : "memory");
}

// The 4-d forms (attention's (head dim, rows, heads, batch) maps): bounds apply per dimension, so a box of rows
// past a sequence's end is zero-filled on load and clipped on store even when more heads or batches follow.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap_st* map, u64* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
      :: "r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

__device__ __forceinline__ void tma_store_4d(const CUtensorMap_st* map, const void* src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
               :: "l"(map), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

// global += shared, element-wise (fp32 add for fp32 maps), clipped like a store.
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap_st* map, const void* src, int c0, int c1) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];"
               :: "l"(map), "r"(smem_u32(src)), "r"(c0), "r"(c1) : "memory");
}

// global += shared for the 4-d maps (fp32 add for fp32 maps), clipped like a store.
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap_st* map, const void* src, int c0, int c1, int c2,
                                                  int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
      :: "l"(map), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

// global[0 .. bytes) += shared[0 .. bytes) as fp32 (bytes a multiple of 16, both 16-byte aligned).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(dst), "r"(smem_u32(src)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// The shared-memory sources of all but the newest N committed stores/reduces may be reused.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}

// All but the newest N committed stores/reduces are complete in global memory.
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}

// Ordinary shared-memory writes -> visible to the async proxy (TMA, wgmma). Each writing thread, before a barrier.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Order this thread's completed async-proxy (TMA) global writes with its generic-proxy accesses, and back.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// ---- clusters -----------------------------------------------------------------------------------------------------
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA in the cluster arrives, then waits (release/acquire at cluster scope).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// cluster_sync after mbarrier initialisation: fence_barrier_init has already released the inits to the cluster, so
// the arrival is relaxed (a release arrival costs a MEMBAR.GPU in every warp; FP8 GEMM on the H100, 2026-11-27:
// 2-CTA split-K shapes 3.4% faster, geomean of 26 shapes 0.6%).
__device__ __forceinline__ void cluster_sync_after_init() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Address of `p`'s counterpart in the shared memory of the cluster's CTA `rank` (possibly this one).
__device__ __forceinline__ u32 dsmem_addr(u32 smem_addr, u32 rank) {
  u32 r;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr), "r"(rank));
  return r;
}

__device__ __forceinline__ u32 dsmem_addr(const void* p, u32 rank) { return dsmem_addr(smem_u32(p), rank); }

// ---- inter-CTA signalling (split-K counters) --------------------------------------------------------------------
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ int atomic_add_relaxed_gpu(int* p, int v) {
  int old;
  asm volatile("atom.add.relaxed.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ void red_add_relaxed_gpu(int* p, int v) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// Two fp32 additions into global memory (8-byte aligned), each atomic; no result.
__device__ __forceinline__ void red_add_f32x2(float* p, float x, float y) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(x), "f"(y) : "memory");
}

__device__ __forceinline__ void red_add_f32x4(float* p, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

__device__ __forceinline__ int load_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// L2-only load (data other CTAs just produced; never a stale L1 line).
__device__ __forceinline__ f32x4 ld_cg_f32x4(const float* p) {
  f32x4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p) : "memory");
  return v;
}

// 16 bytes from distributed shared memory (an address from dsmem_addr).
__device__ __forceinline__ f32x4 ld_dsmem_f32x4(u32 addr) {
  f32x4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr) : "memory");
  return v;
}

// Pins the computation of x at this point of the program: ptxas otherwise sinks address arithmetic below the next
// mbarrier wait, onto the path from a stage's arrival to the wgmma that consumes it.
__device__ __forceinline__ void compute_here(u64& x) { asm volatile("" : "+l"(x)); }

// The pointer as a value the compiler cannot trace back: address arithmetic on it stays where it is written instead
// of being hoisted out of a loop and kept live (spilled) across it.
__device__ __forceinline__ u8* opaque(u8* p) {
  asm volatile("" : "+l"(p));
  return p;
}

// 2^x on the MUFU unit (flushes denormals; 2^-inf = 0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- wgmma -------------------------------------------------------------------------------------------------------
// Descriptor of a K-major tile written by TMA with 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes
// apart (stride byte offset), leading byte offset unused, the tile 1024-byte aligned (base offset 0).
__device__ __forceinline__ u64 wgmma_desc_sw128(const void* tile) {
  return u64((smem_u32(tile) & 0x3FFFF) >> 4) | (u64(1) << 16) | (u64(1024 >> 4) << 32) | (u64(1) << 62);
}

// Descriptor of an MN-major tile (MN contiguous) loaded by TMA with 128-byte swizzle as panels of 64 16-bit
// elements along MN: each panel is `lines` rows of 128 bytes along K. Leading byte offset = one panel to the
// next along MN; stride byte offset = one group of 8 K rows to the next (1024 bytes). A k16 step advances the
// start by 16 rows (2048 bytes).
__device__ __forceinline__ u64 wgmma_desc_mn_sw128(const void* tile, u32 panel_bytes) {
  return u64((smem_u32(tile) & 0x3FFFF) >> 4) | (u64(panel_bytes >> 4) << 16) | (u64(1024 >> 4) << 32) |
         (u64(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Pin accumulator registers in program order around wgmma (the compiler must not move their reads or writes).
template <int R>
__device__ __forceinline__ void fence_registers(float (&r)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}

// The same for wgmma's A fragments in registers: they must stay untouched until the wgmma that reads them is done.
template <int R, int C>
__device__ __forceinline__ void fence_registers(u32 (&r)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) asm volatile("" : "+r"(r[i][j]) :: "memory");
}

// ---- epilogue: registers -> shared --------------------------------------------------------------------------------
// Four 8x8 matrices of 16-bit pairs: lane i gives the row address for row i % 8 of matrix i / 8, and register j
// holds this lane's pair (row lane / 4, columns 2 * (lane % 4) + {0, 1}) of matrix j: the wgmma accumulator layout.
// TRANS: each matrix is stored transposed (lane i's address gets column i % 8 of matrix i / 8).
template <bool TRANS = false>
__device__ __forceinline__ void stmatrix_x4(void* row_addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  if constexpr (TRANS) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(smem_u32(row_addr)), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
  } else {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(smem_u32(row_addr)), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
  }
}

// The inverse: lane i gives the address of row i % 8 of matrix i / 8; r[j] receives this lane's 4 bytes (row
// lane / 4, bytes 4 * (lane % 4) .. + 3) of matrix j (wgmma's register layout of an 8-bit A operand, m64k32).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(row_addr)) : "memory");
}

// ---- warp-level tensor-core MMA (mma.sync) -------------------------------------------------------------------------
// D[16 x 8] += A[16 x 16] B[16 x 8] in fp32 with 16-bit inputs (KIND_BF16 or KIND_FP16). Lane l holds A at rows
// l / 4 and l / 4 + 8, B at column l / 4, D at rows l / 4 and l / 4 + 8, columns 2 * (l % 4) + {0, 1} (PTX ISA,
// "m16n8k16" fragments).
template <int KIND>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if constexpr (KIND == KIND_BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Two matrices; lanes 0..15 give the row addresses.
template <bool TRANS = false>
__device__ __forceinline__ void stmatrix_x2(void* row_addr, u32 r0, u32 r1) {
  if constexpr (TRANS) {
    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};"
                 :: "r"(smem_u32(row_addr)), "r"(r0), "r"(r1) : "memory");
  } else {
    asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};"
                 :: "r"(smem_u32(row_addr)), "r"(r0), "r"(r1) : "memory");
  }
}

// Byte offset of 16-byte granule `g` of row `row` in a tile of `ROW_BYTES`-byte rows that a TMA map with
// swizzle span ROW_BYTES (32, 64 or 128; 16 means no swizzle) reads or writes: the granule index is XORed with
// address bits 7 and up (the tile must be aligned to 8 x 128 bytes).
template <int ROW_BYTES>
__device__ __forceinline__ u32 swizzled_offset(int row, int g) {
  if constexpr (ROW_BYTES < 32) {
    return row * ROW_BYTES + g * 16;
  } else {
    return row * ROW_BYTES + ((g ^ ((row * ROW_BYTES >> 7) & (ROW_BYTES / 16 - 1))) << 4);
  }
}

__device__ __forceinline__ float ld_shared_f32(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ float2 ld_shared_f32x2(u32 addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ float4 ld_shared_f32x4(u32 addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ void st_shared_f32(void* p, float x) {
  asm volatile("st.shared.f32 [%0], %1;" :: "r"(smem_u32(p)), "f"(x) : "memory");
}

__device__ __forceinline__ void st_shared_f32x2(void* p, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(smem_u32(p)), "f"(x), "f"(y) : "memory");
}

__device__ __forceinline__ void st_shared_f32x4(void* p, float x, float y, float z, float w) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(smem_u32(p)), "f"(x), "f"(y), "f"(z), "f"(w)
               : "memory");
}

// ---- programmatic dependent launch (kernels launched with the PDL attribute) -----------------------------------
// The next kernel in the stream may start (its prologue overlaps this grid's tail); it still waits in pdl_wait.
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Wait until the previous kernel in the stream has completed and its writes are visible (returns at once when
// there is none, or the launch had no PDL attribute). Before any global read or write.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// A read, in the straight-line code right after pdl_wait, of data that the previous kernel may have written (the
// tile list's count): a plain load, not __ldg. ptxas takes ld.global.nc for invariant and hoisted it above
// griddepcontrol.wait to the kernel's first instructions, so under PDL the count could be read before the list
// kernel wrote it (H200, 2026-11-28: an output left unwritten in 1 of 544 calls, 8 processes on the GPU).
// The reads inside the tile loops stay __ldg: ptxas keeps them after the wait, which tests/test_compile.py checks
// in every variant's SASS.
template <class T>
__device__ __forceinline__ T ld_produced(const T* p) {
  return *p;
}

// ---- warp specialisation -----------------------------------------------------------------------------------------
// This thread's warpgroup, as a value ptxas knows to be warp-uniform (a shuffle from lane 0): whatever derives
// from it (a consumer's wgmma descriptors) then lives in uniform registers, and a wgmma group issues back to back.
// From threadIdx.x / 128 directly, ptxas built each descriptor in ordinary registers and moved it over with R2UR:
// ~50 instructions between the four wgmma of a group (FP8 256 x 128: 10-13% of the main loop, H100).
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0); }

// A value that every lane of the warp holds alike (loaded from memory, say), marked warp-uniform in the same way:
// loop bounds and branches that depend on it then keep the loop's own state in uniform registers. All 32 lanes
// must call it.
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }

// setmaxnreg only moves registers between the warpgroups of the CTA's allocation at launch (THREADS x
// launch_regs(THREADS), the per-thread count __launch_bounds__(THREADS, 1) allows): the consumers can grow only by
// what the producer gives back, or setmaxnreg.inc waits forever. Kernels check it with static_assert.
__host__ __device__ constexpr int launch_regs(int threads) {
  return (65536 / threads) / 8 * 8 > 255 ? 255 : (65536 / threads) / 8 * 8;
}

template <int REGS>
__device__ __forceinline__ void regs_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGS));
}

template <int REGS>
__device__ __forceinline__ void regs_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGS));
}

// Barrier among `threads` threads (a multiple of 32) on hardware barrier `id` (1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// Arrive on named barrier `id` without waiting: the others of its `threads` wait on it (named_barrier).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// named_barrier that also returns whether `pred` holds in every participating thread (warp-uniform: a branch on
// it leaves the enclosing loop's state in uniform registers).
__device__ __forceinline__ bool named_barrier_all(int id, int threads, bool pred) {
  u32 all;
  asm volatile(
      "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 p, %1, 0;\n\tbar.red.and.pred q, %2, %3, p;\n\t"
      "selp.u32 %0, 1, 0, q;\n\t}"
      : "=r"(all) : "r"(u32(pred)), "r"(id), "r"(threads) : "memory");
  return warp_uniform(int(all)) != 0;
}
