// Epilogues of a consumer warpgroup's 64-row wgmma accumulator (fragment layout: thread t of the warpgroup holds
// rows 16 (t / 32) + (t % 32) / 4 + {0, 8} and, in each 8-column group i, columns 8 i + 2 (t % 4) + {0, 1} at
// acc[4 i + {0, 1}] (row r) and acc[4 i + {2, 3}] (row r + 8)):
// - through shared memory and TMA: chunks written in the output map's swizzle (stmatrix for 16-bit outputs,
//   8-byte pairs for fp32), then stored or reduce-added, through a ring of two chunk buffers or a buffer per chunk;
// - C added into the fragment; direct row-masked stores (rows a TMA box must not cover);
// - split-K through global memory (partials reduce-added and counted per slice, then finished), and inside a
//   cluster (partials summed through distributed shared memory).
#pragma once
#include "common/memory.cuh"
#include "common/sm90.cuh"

// Two floats as one u32 of a 16-bit kind (the first in the low half, memory order).
template <int KIND>
__device__ __forceinline__ u32 pack_f32x2(float a, float b) {
  if constexpr (KIND == KIND_BF16) {
    return f32x2_to_bf16x2(a, b);
  } else {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
  }
}

// Four consecutive elements of a row of a KIND array (16-byte aligned for fp32, 8-byte for 16-bit kinds).
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

template <int KIND>
__device__ __forceinline__ void store4(void* base, i64 idx, f32x4 v) {
  if constexpr (KIND == KIND_FP32) {
    *reinterpret_cast<f32x4*>(reinterpret_cast<float*>(base) + idx) = v;
  } else {
    *reinterpret_cast<u32x2*>(reinterpret_cast<u16*>(base) + idx) =
        u32x2{pack_f32x2<KIND>(v.x, v.y), pack_f32x2<KIND>(v.z, v.w)};
  }
}

// ---- registers -> shared ------------------------------------------------------------------------------------------
// Columns j*CH .. j*CH+CH-1 of the accumulator as 16-bit values (`pack` turns two floats into one u32) into `buf`,
// in the layout a TMA map with swizzle span CH * 2 bytes reads (stmatrix: lane i gives the address of row i % 8 of
// matrix i / 8; no two lanes of a warp hit one bank).
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

// Columns j*CH .. j*CH+CH-1 of the accumulator transposed, for a TMA map over D^T: CH lines of 128 bytes (128-byte
// swizzle), line c holding column j*CH + c of the warpgroup's 64 rows (stmatrix .trans: lane i gives the address of
// the line of column i % 8 of matrix i / 8, at the granule of that matrix's 8 rows).
template <int CH, typename Pack>
__device__ __forceinline__ void stmatrix_chunk_trans(const float* acc, int j, u8* buf, int warp, int lane, Pack pack) {
  const int granule = 2 * warp + lane / 8 % 2;
#pragma unroll
  for (int g = 0; g + 1 < CH / 8; g += 2) {  // two 8-column groups per stmatrix.x4
    const int i = j * (CH / 8) + g;
    stmatrix_x4<true>(buf + swizzled_offset<128>((g + lane / 16) * 8 + lane % 8, granule),
                      pack(acc[4 * i], acc[4 * i + 1]), pack(acc[4 * i + 2], acc[4 * i + 3]),
                      pack(acc[4 * i + 4], acc[4 * i + 5]), pack(acc[4 * i + 6], acc[4 * i + 7]));
  }
  if constexpr (CH == 8)
    stmatrix_x2<true>(buf + swizzled_offset<128>(lane % 8, granule), pack(acc[4 * j], acc[4 * j + 1]),
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

// As f32_chunk transposed, for a fp32 map over D^T with box {32, CH} and 128-byte swizzle: two halves of CH
// lines (rows 0..31 of the warpgroup, then 32..63), line c holding column j*CH + c. One float per store: a
// thread's floats lie on different lines or granules (no two lanes of a warp hit one bank).
template <int CH>
__device__ __forceinline__ void f32_chunk_trans(const float* acc, int j, u8* buf, int warp, int lane) {
  u8* half = buf + (warp / 2) * CH * 128;
#pragma unroll
  for (int g = 0; g < CH / 8; ++g) {
    const int i = j * (CH / 8) + g;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int line = g * 8 + (lane % 4) * 2 + e;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pos = (warp % 2) * 16 + lane / 4 + 8 * h;  // the row within the half
        st_shared_f32(half + swizzled_offset<128>(line, pos / 4) + (pos % 4) * 4, acc[4 * i + 2 * h + e]);
      }
    }
  }
}

// Chunk j as KIND: 16-bit kinds through stmatrix, fp32 as pairs (TRANS: transposed, fp32 one by one).
template <int KIND, int CH, bool TRANS = false>
__device__ __forceinline__ void chunk_to_smem(const float* acc, int j, u8* buf, int warp, int lane) {
  const auto pack = [](float a, float b) { return pack_f32x2<KIND>(a, b); };
  if constexpr (KIND == KIND_FP32 && TRANS) {
    f32_chunk_trans<CH>(acc, j, buf, warp, lane);
  } else if constexpr (KIND == KIND_FP32) {
    f32_chunk<CH>(acc, j, buf, warp, lane);
  } else if constexpr (TRANS) {
    stmatrix_chunk_trans<CH>(acc, j, buf, warp, lane, pack);
  } else {
    stmatrix_chunk<CH>(acc, j, buf, warp, lane, pack);
  }
}

// ---- shared -> global (TMA) -----------------------------------------------------------------------------------------
// The 64-row result goes to global memory in CHUNKS chunks of 64 x CH through two alternating shared buffers of
// `chunk_bytes` at `bufs` (`seq` counts the chunks the warpgroup ever issued and picks the buffer). `write(j, buf)`
// fills chunk j; thread 0 then stores it with TMA at (col0 + j * CH, row0), or adds it (REDUCE). Before a buffer is
// rewritten the TMA operation that last read it (two chunks back) must be done reading. `bar` is the warpgroup's
// named barrier. TRANS: the map is over D^T (chunks from chunk_to_smem's TRANS), stored at (row0, col0 + j * CH);
// fp32 ones (REDUCE) in two halves of 32 rows.
template <int CHUNKS, int CH, bool REDUCE, typename Write, bool TRANS = false>
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
      if constexpr (REDUCE && TRANS) {
        tma_reduce_add_2d(map, buf, row0, col0 + j * CH);
        tma_reduce_add_2d(map, buf + chunk_bytes / 2, row0 + 32, col0 + j * CH);
      } else if constexpr (REDUCE) {
        tma_reduce_add_2d(map, buf, col0 + j * CH, row0);
      } else if constexpr (TRANS) {
        tma_store_2d(map, buf, row0, col0 + j * CH);
      } else {
        tma_store_2d(map, buf, col0 + j * CH, row0);
      }
      bulk_commit();
    }
  }
}

// As tma_store_chunks with a buffer for every chunk (`bufs`: CHUNKS x chunk_bytes): the warpgroup writes all
// chunks, then thread 0 issues all stores. Two named barriers and one proxy fence per call instead of per chunk.
// The caller's thread 0 must have waited (bulk_wait_read<0>) for the stores that last read `bufs` before the call;
// `synced`: the warpgroup has met on a barrier since then (else the call meets first).
template <int CHUNKS, int CH, typename Write>
__device__ __forceinline__ void tma_store_all(const CUtensorMap_st* map, u8* bufs, int chunk_bytes, int col0,
                                              int row0, int tid, int bar, bool synced, Write write) {
  if (!synced) named_barrier(bar, 128);
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

// After a warpgroup's last TMA store: its thread 0 waits until the stores have read their shared-memory sources
// (before the CTA exits). Their writes need no wait: the grid's completion makes them visible to what follows.
__device__ __forceinline__ void epilogue_drain(int tid) {
  if (tid == 0) bulk_wait_read<0>();
}

// ---- straight from registers ----------------------------------------------------------------------------------------
// acc += C (a KIND array, row stride ld_c) for the fragment at (row0, col0), clipped to M x N (N even). TRANS: C
// holds the transpose (the fragment's element (r, c) at C[c][r]; N may be odd).
template <int KIND, int ACC, bool TRANS = false>
__device__ __forceinline__ void add_to_fragment(float (&acc)[ACC], const void* c, i64 ld_c, int row0, int col0,
                                                int M, int N, int warp, int lane) {
  const int r = row0 + warp * 16 + lane / 4;
#pragma unroll
  for (int i = 0; i < ACC / 4; ++i) {
    const int gc = col0 + i * 8 + (lane % 4) * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (TRANS) {
        if (r + 8 * h < M && gc < N) acc[4 * i + 2 * h] += load_elem<KIND>(c, gc * ld_c + r + 8 * h);
        if (r + 8 * h < M && gc + 1 < N) acc[4 * i + 2 * h + 1] += load_elem<KIND>(c, (gc + 1) * ld_c + r + 8 * h);
      } else if (r + 8 * h < M && gc < N) {  // N is even, so gc + 1 < N too
        acc[4 * i + 2 * h] += load_elem<KIND>(c, (r + 8 * h) * ld_c + gc);
        acc[4 * i + 2 * h + 1] += load_elem<KIND>(c, (r + 8 * h) * ld_c + gc + 1);
      }
    }
  }
}

// The fragment written by its threads straight to D (bf16 pairs, or ADD: fp32 atomic adds): this thread's rows
// `r` and r + 8 (D's flattened rows) where ok0 / ok1, its columns from col0 below N.
template <bool ADD, int ACC>
__device__ __forceinline__ void store_fragment_rows(const float* a, void* d, i64 ld_d, int r, bool ok0, bool ok1,
                                                    int col0, int N, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!(h ? ok1 : ok0)) continue;
    const i64 row = r + 8 * h;
#pragma unroll
    for (int i = 0; i < ACC / 4; ++i) {
      const int col = col0 + 8 * i + (lane % 4) * 2;
      if (col >= N) continue;
      const float x = a[4 * i + 2 * h], y = a[4 * i + 2 * h + 1];
      if constexpr (ADD) {
        float* p = reinterpret_cast<float*>(d) + row * ld_d + col;
        atomicAdd(p, x);
        atomicAdd(p + 1, y);
      } else {
        *reinterpret_cast<u32*>(reinterpret_cast<u16*>(d) + row * ld_d + col) = f32x2_to_bf16x2(x, y);
      }
    }
  }
}

// ---- split-K through global memory ----------------------------------------------------------------------------------
// The `splits` partials of a 64-row slice meet on `counter` (an int in global memory, zero between launches).
// `add()` issues this split's partial as TMA reduce-adds (thread 0): into D itself (FINISH false: D += acc), or
// into a zeroed fp32 workspace W (FINISH), after which `finish(r_lo, r_hi)` writes D = W (+ C) for the slice's rows
// [r_lo, r_hi) and zeroes them in W, so W stays clean for the next call. When every unit is resident at once
// (`one_wave`), all splits wait until the last partial is in and each finishes 1/S of the rows (their second count
// tells when the counter may be reset); otherwise the last split finishes the whole slice. Partials are published
// with a full bulk wait, a proxy fence and a gpu-scope release before the counter. ORDERED: splits add in K
// order (a turnstile on the counter), so results are bitwise stable. `flag`: a shared int of the warpgroup.
// The waits spin in the whole of warp 0 on a warp-uniform value, not in thread 0 alone: a spin loop in one thread
// makes the consumer's control flow divergent to ptxas, which then keeps the main loop's stage and wgmma
// descriptors in ordinary registers (R2UR before every wgmma).
template <bool ORDERED, bool FINISH, typename Add, typename Finish>
__device__ __forceinline__ void split_k_epilogue(int* counter, int* flag, int split, int splits, bool one_wave,
                                                 int tid, int bar, Add add, Finish finish) {
  const int warp = tid / 32, lane = tid % 32;
  const bool lead_warp = warp_uniform(warp) == 0;
  if (ORDERED && splits > 1 && lead_warp) {
    while (warp_uniform(load_acquire_gpu(counter)) != split) {  // K order: the previous split's add
    }
  }
  add();
  const bool spread = FINISH && one_wave;
  int passed = 0;  // spread: splits past the wait before this one (second round of counts, read after the finish)
  if (lead_warp && (FINISH || ORDERED) && splits > 1) {
    bulk_wait<0>();  // the partial is in global memory, not just read out of shared memory (thread 0's stores)
    fence_proxy_async_global();
    fence_acq_rel_gpu();
    bool last = false;
    if (ORDERED) {
      last = split == splits - 1;
      if ((!last || spread) && lane == 0) store_release_gpu(counter, split + 1);
    } else if (spread) {
      if (lane == 0) red_add_relaxed_gpu(counter, 1);  // no reply to wait for: every split polls below
    } else {
      last = warp_uniform(lane == 0 ? atomic_add_relaxed_gpu(counter, 1) : 0) == splits - 1;
    }
    if (spread) {  // the acquire orders the finish's reads of W (generic loads) after the other partials
      while (warp_uniform(load_acquire_gpu(counter)) < splits) {
        __nanosleep(32);  // fewer polls of a hot line while the partials still stream into L2
      }
      if (lane == 0) passed = atomic_add_relaxed_gpu(counter, 1);  // its reply overlaps the finish
    } else if (last) {
      fence_acq_rel_gpu();
      fence_proxy_async_global();
    }
    if (lane == 0) *flag = last || spread;
  }
  if constexpr (FINISH) {
    if (splits > 1) {
      named_barrier(bar, 128);  // every thread sees the flag, after the lead warp's acquire
      if (*flag) {
        finish(spread ? split * 64 / splits : 0, spread ? (split + 1) * 64 / splits : 64);
        if (tid == 0) {
          if (!spread || passed == 2 * splits - 1) *counter = 0;  // (spread: every split is past its wait)
        }
      }
    }
  } else {
    if (ORDERED && splits > 1 && tid == 0 && *flag) *counter = 0;
  }
}

// The finish of split_k_epilogue: D = W (+ C of ADD_KIND, unless KIND_NONE) for rows [row0, row0 + rows) and the
// COLS columns from col0 (clipped to M x N; N a multiple of 4, so a 4-column group is wholly in or out), then those
// rows zeroed in W. LOADS independent 16-byte loads per thread are in flight before any store (the latency, not the
// bytes, is what this step costs).
template <int D_KIND, int ADD_KIND, int COLS, int LOADS>
__device__ __forceinline__ void split_k_finish(void* d, i64 ld_d, float* w, i64 ld_w, const void* c, i64 ld_c,
                                               int row0, int rows, int col0, int M, int N, int tid) {
  const int groups = rows * (COLS / 4);
  for (int base = tid; base < groups; base += 128 * LOADS) {
    f32x4 v[LOADS];
    i64 wi[LOADS], di[LOADS], ci[LOADS];
    bool ok[LOADS];
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int g = base + j * 128;
      const int gr = row0 + g / (COLS / 4), gc = col0 + (g % (COLS / 4)) * 4;
      ok[j] = g < groups && gr < M && gc < N;
      wi[j] = gr * ld_w + gc;
      di[j] = gr * ld_d + gc;
      ci[j] = gr * ld_c + gc;
      if (ok[j]) v[j] = ld_cg_f32x4(w + wi[j]);
    }
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      if (!ok[j]) continue;
      if constexpr (ADD_KIND != KIND_NONE) {
        const f32x4 cv = load4<ADD_KIND>(c, ci[j]);
        v[j].x += cv.x; v[j].y += cv.y; v[j].z += cv.z; v[j].w += cv.w;
      }
      store4<D_KIND>(d, di[j], v[j]);
      *reinterpret_cast<f32x4*>(w + wi[j]) = f32x4{0.f, 0.f, 0.f, 0.f};
    }
  }
}

// ---- split-K inside a cluster ---------------------------------------------------------------------------------------
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
