// The work list of a contiguous-layout FP8 GEMM whose tiles are not a divisor of the segments' alignment
// (gemm_fp8.cu, TILE_LIST): an entry (tile row, group) for each group with rows in a tile row. A tile row holding
// the end of one expert's segment and the start of the next gets two entries, one per expert; a tile row of
// padding only gets none. Each of the GEMM's units is then one tile of work. (Run inside one unit, the second
// pass made some CTAs fall behind the others, their working set outgrew L2 and every CTA went to DRAM: H100,
// 32 experts on 35k rows, N 4096, K 7168, 128 x 192 tiles: 2.56x the DRAM reads, 1.51x the time.)
//
// ids: the group of each of the M rows (-1, or any id past the groups: padding); segments start at multiples of
// `align`, and tile_m <= align + gcd(align, tile_m), so a segment can start at most once inside a tile row (its
// `cut`, the first multiple of align past the row's first row): 128 rows at alignment 64, 192 at 128 or 256, 256
// at 128. list: [0] the entry count; entry e at int2 index 1 + e (2 x tile row + whole, group), in tile-row order,
// where `whole` says every row of the tile row is the group's (no row checks in the GEMM's epilogue): a segment
// being its group's rows, then padding, each piece of the tile row (before and after the cut) is when its first
// and last rows are.
#include "common/sm90.cuh"

constexpr int THREADS = 1024;  // one CTA walks the tile rows, THREADS at a time
static_assert(THREADS == 32 * 32, "the warp totals are scanned by one warp");

// x summed over lanes 0..lane of the warp.
__device__ __forceinline__ int warp_inclusive_sum(int x, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

extern "C" __global__ void __launch_bounds__(THREADS) contiguous_tile_list(const int* ids, int M, int groups,
                                                                           int tile_m, int align, int* list) {
  __shared__ int warp_sums[THREADS / 32];
  // Launched with PDL like the GEMMs: this grid starts under the previous kernel's tail, and the GEMM's prologue
  // under this one (the GEMM reads the list only once this grid is done).
  pdl_launch_dependents();
  pdl_wait();  // (the ids may come from the previous kernel, and the list's last reader is the previous GEMM)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int rows = (M + tile_m - 1) / tile_m;
  int2* entries = reinterpret_cast<int2*>(list) + 1;
  int base = 0;  // entries of the tile rows before this round's
  for (int r0 = 0; r0 < rows; r0 += THREADS) {
    const int r = r0 + int(threadIdx.x);
    int first = -1, second = -1;  // the groups before and after the cut, -1 where none or the same
    bool whole = false;           // (first's entry)
    if (r < rows) {
      const int m0 = r * tile_m, end = min(m0 + tile_m, M), cut = (m0 / align + 1) * align;
      const auto group = [&](int row) { const int g = __ldg(ids + row); return g >= 0 && g < groups ? g : -1; };
      first = group(m0);
      second = cut < end ? group(cut) : -1;
      whole = m0 + tile_m <= M && first >= 0 && group(end - 1) == first &&
              (cut >= end || (second == first && group(cut - 1) == first));
      if (second == first) second = -1;
    }
    const int n = (first >= 0) + (second >= 0);
    const int x = warp_inclusive_sum(n, lane);  // over the warp, then the warp totals over the warps
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) warp_sums[lane] = warp_inclusive_sum(warp_sums[lane], lane);
    __syncthreads();
    int e = base + x - n + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (first >= 0) entries[e++] = make_int2(2 * r + whole, first);
    if (second >= 0) entries[e] = make_int2(2 * r, second);
    base += warp_sums[THREADS / 32 - 1];
    __syncthreads();  // (warp_sums is written again next round)
  }
  if (threadIdx.x == 0) list[0] = base;
}
