// Persistent tile schedulers. A scheduler is the walk of a persistent grid over work units (PersistentUnits) plus
// `tile(unit)`, which decodes a unit index into what the kernel's roles need: for a GEMM the tile's origin, its
// operands' rows, its k range and whether it has work at all. The producer and the consumers of a CTA walk the
// same units and decode them alike, so they agree on every unit without talking. Another kernel family brings its
// own decode (attention: (batch, head, block), longest blocks first) on the same walk.
#pragma once
#include "common/sm90.cuh"

// Cluster i of the grid runs units i, i + clusters, i + 2 clusters, ... below `count`; a unit is one cluster's
// work (both CTAs of a pair, or all CTAs of a split cluster, run it together).
struct PersistentUnits {
  int first, step, count;

  __device__ __forceinline__ PersistentUnits(int units, int cluster)
      : first(blockIdx.x / cluster), step(gridDim.x / cluster), count(units) {}
  __device__ __forceinline__ bool more(int unit) const { return unit < count; }
  __device__ __forceinline__ int next(int unit) const { return unit + step; }
  // Every unit is resident at once (one wave): a unit may then wait for any other.
  __device__ __forceinline__ bool one_wave() const { return count <= step; }
};

// Units in chunks of `group` (batch, head) pairs out of `pairs`: within a chunk block by block, the chunk's pairs
// side by side (attention's causal order: the chunk's heads share L2, its longest blocks go first).
struct ChunkedUnit {
  int block;  // the unit's block rank within its chunk's walk (0 first)
  int pair;   // its (batch, head) pair
};

__device__ __forceinline__ ChunkedUnit chunked_unit(int u, int blocks, int group, int pairs) {
  const int per_chunk = group * blocks;
  const int chunk = u / per_chunk, r = u - chunk * per_chunk;
  const int first = chunk * group, size = min(group, pairs - first);
  return {r / size, first + r % size};
}

// Layouts of a GEMM's operands (a kernel's LAYOUT define; `info` is a device int array).
#define LAYOUT_NORMAL 0      // one GEMM
#define LAYOUT_CONTIGUOUS 1  // MoE prefill: A's rows are the groups' rows back to back, info[m] the group of row m
                             // (tiles that do not divide the segments' alignment: from a list, contiguous_tiles.cu)
#define LAYOUT_MASKED 2      // MoE decode: G GEMMs of M rows, only the first info[g] rows of group g count
#define LAYOUT_KGROUPED 3    // weight gradient: group g sums k in [info[g], info[g + 1]) into its own D[g]

// One GEMM tile of work: where its operands and output live and which k blocks it sums.
struct GemmTile {
  int tm, tn;        // tile row and column in the tile grid (of its group)
  int m0, n0;        // tile origin in D's rows (of its group) and columns
  int g;             // group
  int a_row, b_row;  // first row of the A and B tiles in their (flattened) maps
  int a_end, b_end;  // where their rows end: the group's last row + 1 where the groups' rows follow each other
  int d_row;         // first row of the tile in D's (flattened) map
  int kb0, kb1;      // k blocks [kb0, kb1)
  int split;         // split-K slice (units of `splits` slices)
  int rows;          // rows of the group that may be written: the tile's rows from m0 below `rows`
  bool skip;         // nothing to compute (padding, empty k range; masked: the walk holds live tiles only)
  bool whole;        // every row of the tile may be written (else each row is checked: row_writable)
  bool shared;       // the cluster shares the tile's operand (else this CTA loads its own tile alone)
};

// GEMM tiles of TILE_M x TILE_N (k blocks of TILE_K) in grouped order: cluster tiles (two tiles along M or N when
// PAIRING is 1 or 2, four along M when it is 3, else one) run group_m rows at a time, M fastest within a group, so
// that the CTAs of a wave share A and B panels in L2. Units are:
// - (cluster tile, split) pairs, split fastest, with `splits` slices of K (split-K through global memory: a unit
//   then only ever waits on a unit with a smaller index, which a resident CTA has already started);
// - per group (ORDER LAYOUT_MASKED, LAYOUT_KGROUPED: M counts one group's rows), group slowest. Masked: only the
//   tiles with rows to compute (group g's first ceil(min(info[g], M) / TILE_M) tile rows), so that the CTAs share
//   the live tiles evenly however unevenly the groups are filled (skipping dead tiles of a static walk left some
//   CTAs with several times the live tiles of others). Clusters along M take a group's tile rows a cluster at a
//   time, then deal the tiles of the rows left over (fewer than a cluster's) to their CTAs one each, every CTA
//   loading its own (shared false): a cluster of a live and a dead tile took a live cluster's time;
// - with CLUSTER_SPLITS > 1, one cluster tile whose CLUSTER_SPLITS CTAs (cluster rank = slice) each take a slice of K;
// - LISTED (LAYOUT_CONTIGUOUS): rows of tiles are the entries (tile row, group) of `list` (contiguous_tiles.cu), so
//   a tile row that holds two groups' rows is two rows of units, one per group.
// ROTATE_ROWS: a column's rows rotated by its wave, so that a CTA (every step-th unit) cycles through the rows
// instead of always getting the same one: the last row of tiles, cheaper where a consumer's rows are all past M
// (gemm.cu), spreads over the CTAs. A wave's tiles, and so what they share in L2, stay the same.
// A CTA of a cluster may get a tile past the edge (a tile count not a multiple of the cluster's): it still loads
// its part of the shared tile for the others (masked, a left-over row's spare: a column past N, nothing shared).
template <int TILE_M, int TILE_N, int TILE_K, int PAIRING, int ORDER = LAYOUT_NORMAL, int CLUSTER_SPLITS = 1,
          bool LISTED = false, bool ROTATE_ROWS = false>
struct GemmScheduler : PersistentUnits {
  static constexpr bool PER_GROUP = ORDER == LAYOUT_MASKED || ORDER == LAYOUT_KGROUPED;
  static constexpr int CTAS_M = b_sharers(PAIRING), CTAS_N = a_sharers(PAIRING);  // a cluster's tiles along M, N
  static_assert(!LISTED || (ORDER == LAYOUT_CONTIGUOUS && CTAS_M == 1), "a list of contiguous tile rows");
  int tiles_m, cl_tiles_m, cl_tiles_n, per_group, group_m, splits, k_blocks, M, N, groups;
  u32 rank;
  const int* info;
  const int2* list;  // LISTED: the entries (after the count)
  // Masked: the group of the last unit decoded (-1: none yet), its first unit, its units and its live tile rows. A
  // CTA's units only grow, so tile() walks the groups forward from there, WALK groups' counts loaded at a time (one
  // load latency for up to WALK groups passed; H200, K-768 cases of 16 to 64 groups against the static walk: a
  // group at a time 1.10-1.13x the time, eight at a time 1.06-1.09x).
  static constexpr int WALK = 8;
  mutable int cur_g = -1, cur_base = 0, cur_units = 0, cur_tiles = 0;

  __device__ __forceinline__ static int cl_tiles(int tiles, int ctas) { return (tiles + ctas - 1) / ctas; }
  // Masked: the tile rows with rows to compute of a group of `rows` rows (masked_m), and their units: whole
  // clusters of tiles, then the left-over rows' tiles, one a CTA.
  __device__ __forceinline__ static int live_tiles(int rows, int M_) {
    return (min(max(rows, 0), M_) + TILE_M - 1) / TILE_M;
  }
  __device__ __forceinline__ static int group_units(int tiles, int cl_n) {
    return tiles / CTAS_M * cl_n + cl_tiles(tiles % CTAS_M * cl_n, CTAS_M);
  }
  // Units of the walk: masked, the units of all groups' live tiles, summed across the warp (the scheduler is
  // built by whole warps right after pdl_wait; the kernel before may write info: ld_produced).
  __device__ __forceinline__ static int unit_count(int M_, int N_, int splits_, int groups_, const int* info_,
                                                   const int* list_) {
    const int cl_n = cl_tiles((N_ + TILE_N - 1) / TILE_N, CTAS_N);
    if constexpr (ORDER == LAYOUT_MASKED) {
      int units = 0;
      for (int g = threadIdx.x % 32; g < groups_; g += 32) {
        units += group_units(live_tiles(ld_produced(info_ + g), M_), cl_n);
      }
      return __reduce_add_sync(0xffffffffu, units);
    }
    return cl_tiles(unit_rows(M_, list_), CTAS_M) * cl_n * (PER_GROUP ? groups_ : splits_);
  }
  // Rows of units: of tiles, or the list's entries (read after pdl_wait: the list kernel writes them).
  __device__ __forceinline__ static int unit_rows(int M_, const int* list_) {
    return LISTED ? ld_produced(list_) : (M_ + TILE_M - 1) / TILE_M;
  }

  // M, N, K: one group's GEMM (LAYOUT_CONTIGUOUS: M counts all rows; LAYOUT_KGROUPED: K counts all groups').
  __device__ __forceinline__ GemmScheduler(int M_, int N_, int K, int splits_, int groups_, int group_m_,
                                           const int* info_, u32 rank_, int cluster, const int* list_ = nullptr)
      : PersistentUnits(unit_count(M_, N_, splits_, groups_, info_, list_), cluster),
        tiles_m((M_ + TILE_M - 1) / TILE_M),
        cl_tiles_m(cl_tiles(unit_rows(M_, list_), CTAS_M)),
        cl_tiles_n(cl_tiles((N_ + TILE_N - 1) / TILE_N, CTAS_N)),
        per_group(cl_tiles_m * cl_tiles_n),
        group_m(group_m_),
        splits(splits_),
        k_blocks((K + TILE_K - 1) / TILE_K),
        M(M_),
        N(N_),
        groups(groups_),
        rank(rank_),
        info(info_),
        list(LISTED ? reinterpret_cast<const int2*>(list_) + 1 : nullptr) {}

  // What tile() reads from global memory for a unit, two ints at addresses x and y (null: none, read as -1):
  // contiguous, the group ids of the tile's first and last rows (or its list entry); K-grouped, its group's k
  // range. Masked tiles come from the walk, which tile() loads as it goes.
  static constexpr bool PEEKS = ORDER == LAYOUT_CONTIGUOUS || ORDER == LAYOUT_KGROUPED;
  struct Peeked {
    int x, y;
  };
  __device__ __forceinline__ void peek_at(int unit, const int*& x, const int*& y) const {
    x = y = nullptr;
    if constexpr (ORDER == LAYOUT_CONTIGUOUS && LISTED) {
      x = reinterpret_cast<const int*>(list + place(unit).tm);
      y = x + 1;
    } else if constexpr (ORDER == LAYOUT_CONTIGUOUS) {
      const int m0 = place(unit).m0;
      x = info + min(m0, M - 1);
      if (m0 + TILE_M <= M) y = info + m0 + TILE_M - 1;
    } else if constexpr (ORDER == LAYOUT_KGROUPED) {
      x = info + place(unit).g;
      y = x + 1;
    }
  }
  __device__ __forceinline__ static int load_or_none(const int* p) { return p ? __ldg(p) : -1; }

  __device__ __forceinline__ GemmTile tile(int unit) const {
    const int *x, *y;
    peek_at(unit, x, y);
    return tile(unit, {load_or_none(x), load_or_none(y)});
  }

  // `peeked`: the ints at peek_at(unit), loaded earlier.
  __device__ __forceinline__ GemmTile tile(int unit, Peeked peeked) const {
    GemmTile t = place(unit);
    if constexpr (ORDER == LAYOUT_CONTIGUOUS && LISTED) {  // t.tm was an entry of the list
      t.tm = peeked.x >> 1;
      t.whole = peeked.x & 1;
      t.g = peeked.y;
      t.m0 = t.a_row = t.d_row = t.tm * TILE_M;
      t.b_row = t.g * N + t.n0;
      t.b_end = (t.g + 1) * N;
    } else if constexpr (ORDER == LAYOUT_CONTIGUOUS) {  // each group's rows start at a multiple of TILE_M
      t.g = peeked.x;
      t.skip = t.g < 0 || t.g >= groups;  // (-1: padding; an id past the groups alike)
      t.b_row = max(t.g, 0) * N + t.n0;
      t.b_end = (max(t.g, 0) + 1) * N;
      // The tile lies in one segment (its group's rows, then padding): the group's alone when its last row is.
      t.whole = peeked.y == t.g;
    } else if constexpr (ORDER == LAYOUT_MASKED) {
      t.rows = min(max(__ldg(info + t.g), 0), M);  // (the walk has live tiles only)
      t.whole = t.m0 + TILE_M <= t.rows;
      t.a_row = t.d_row = t.g * M + t.m0;
      t.b_row = t.g * N + t.n0;
      t.a_end = (t.g + 1) * M;
      t.b_end = (t.g + 1) * N;
    } else if constexpr (ORDER == LAYOUT_KGROUPED) {
      t.kb0 = peeked.x / TILE_K;
      t.kb1 = peeked.y / TILE_K;
      t.skip = t.kb1 <= t.kb0;
      t.whole = t.m0 + TILE_M <= M;  // (D's next rows are the next group's)
      t.d_row = t.g * M + t.m0;
    }
    if constexpr (CLUSTER_SPLITS > 1) {  // this CTA's slice of K
      const int blocks = t.kb1;
      t.kb0 = int(rank) * blocks / CLUSTER_SPLITS;
      t.kb1 = (int(rank) + 1) * blocks / CLUSTER_SPLITS;
    }
    return t;
  }

  // f(tile) for each of this CTA's units with work, in order. WARP (called by whole warps): the two ints of each
  // tile are loaded while the tile before runs, one per lane (lanes 0 and 1: a single register through the main
  // loop), and shuffled to every lane when the tile starts. Loaded by every lane alike (a warp-uniform address),
  // ptxas moves them into uniform registers right after the load, so that the warp waits for the load there (H200,
  // contiguous at K 2048: the consumers' most sampled stall); both loaded by every lane into ordinary registers (an
  // offset the compiler cannot fold), the 128 x 192 and 192 x 128 consumers spilled.
  template <bool WARP, class F>
  __device__ __forceinline__ void for_each_tile(F&& f) const {
    if constexpr (!WARP || !PEEKS) {
      for (int unit = first; more(unit); unit = next(unit)) {
        const GemmTile t = tile(unit);
        if (!t.skip) f(t);
      }
    } else {
      const bool second = threadIdx.x % 2;
      const auto peek = [&](int unit) {
        const int *x, *y;
        peek_at(unit, x, y);
        return load_or_none(second ? y : x);
      };
      int peeked = more(first) ? peek(first) : 0;
      for (int unit = first; more(unit);) {
        const GemmTile t = tile(unit, {__shfl_sync(~0u, peeked, 0), __shfl_sync(~0u, peeked, 1)});
        unit = next(unit);
        if (more(unit)) peeked = peek(unit);
        if (!t.skip) f(t);
      }
    }
  }

  // The unit's tile in the grid and its operands' rows, before what tile() reads from global memory (masked: the
  // walk to its group).
  __device__ __forceinline__ GemmTile place(int unit) const {
    GemmTile t;
    int group_cl_rows = cl_tiles_m;  // cluster-tile rows of the unit's group (of the GEMM; masked: whole ones)
    if constexpr (ORDER == LAYOUT_MASKED) {
      while (unit >= cur_base + cur_units && cur_g < groups) {  // (unit < count: one is ahead)
        int rows[WALK];
#pragma unroll
        for (int i = 0; i < WALK; ++i) rows[i] = cur_g + 1 + i < groups ? __ldg(info + cur_g + 1 + i) : 0;
#pragma unroll
        for (int i = 0; i < WALK; ++i) {
          if (unit >= cur_base + cur_units) {
            cur_base += cur_units;
            cur_tiles = live_tiles(rows[i], M);
            cur_units = group_units(cur_tiles, cl_tiles_n);
            ++cur_g;
          }
        }
      }
      t.g = cur_g;
      unit -= cur_base;
      group_cl_rows = cur_tiles / CTAS_M;
    } else {
      t.g = PER_GROUP ? unit / per_group : 0;
      if (PER_GROUP) unit %= per_group;
    }
    t.split = unit % splits;
    const int ct = unit / splits;  // cluster tile, in grouped order
    t.shared = true;
    if constexpr (ORDER == LAYOUT_MASKED && CTAS_M > 1) t.shared = ct < group_cl_rows * cl_tiles_n;
    if (!t.shared) {  // masked: one of the left-over rows' tiles (CTAS_N is 1: cl_tiles_n counts tiles)
      const int i = (ct - group_cl_rows * cl_tiles_n) * CTAS_M + int(rank);
      const int tiles = cur_tiles % CTAS_M * cl_tiles_n;
      t.tm = group_cl_rows * CTAS_M + min(i, tiles - 1) / cl_tiles_n;
      t.tn = i < tiles ? i % cl_tiles_n : cl_tiles_n;  // (past the last: a column past N, stored nowhere)
    } else {
      const int gsize = group_m * cl_tiles_n;
      const int first = ct / gsize * group_m;
      const int rows = min(group_m, group_cl_rows - first);
      const int r = ct % gsize;
      t.tm = first + r % rows;
      if constexpr (ROTATE_ROWS) {  // (the column's first unit's wave)
        t.tm = first + (r % rows + (ct - r % rows) * splits / step) % rows;
      }
      t.tn = r / rows;
      if (CTAS_M > 1) t.tm = CTAS_M * t.tm + rank;
      if (CTAS_N > 1) t.tn = CTAS_N * t.tn + rank;
    }
    t.m0 = t.tm * TILE_M;
    t.n0 = t.tn * TILE_N;
    t.a_row = t.d_row = t.m0;
    t.b_row = t.n0;
    t.a_end = M;
    t.b_end = N;
    t.kb0 = t.split * k_blocks / splits;
    t.kb1 = (t.split + 1) * k_blocks / splits;
    t.rows = M;
    t.skip = false;
    t.whole = true;  // (the normal layout's D ends at M, where TMA clips)
    return t;
  }

  // LAYOUT_CONTIGUOUS: the group of row r (from the tile's origin), -1 past the rows.
  __device__ __forceinline__ int row_group(const GemmTile& t, int r) const {
    const int row = t.m0 + r;
    return row < t.rows ? __ldg(info + row) : -1;
  }

  // Row r of the tile may be written.
  __device__ __forceinline__ bool row_writable(const GemmTile& t, int r) const {
    if constexpr (ORDER == LAYOUT_CONTIGUOUS) return row_group(t, r) == t.g;  // a tile not skipped has t.g >= 0
    return t.m0 + r < t.rows;
  }

  // Index of a tile in the whole grid, M fastest (for per-tile state in global memory, e.g. split-K counters).
  __device__ __forceinline__ int tile_index(const GemmTile& t) const { return t.tn * tiles_m + t.tm; }
};
