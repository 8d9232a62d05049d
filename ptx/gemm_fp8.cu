// FP8 block-scaled GEMM (the DeepGEMM recipe): D[M, N] (bf16) = (A[M, K] * sA) @ (B[N, K] * sB)^T with A and B
// e4m3 (K-major), sA one fp32 scale per 1x128 group of a row of A, stored M-major (sA[kb * ld_sa + m]), and sB one
// fp32 scale per 128x128 block of B (sB[g * sb_group + nb * sb_row + kb * sb_col], any strides).
//
// The structure is gemm.cu's: persistent grid, warpgroup 0 a TMA producer filling a STAGES-deep ring (A, B and
// this k block's sA column), one to three consumer warpgroups each owning 64 (or 128) rows of the BM x BN tile,
// grouped tile order, optional 2-CTA clusters with TMA multicast (MCAST 1: pairs along M share B; 2: pairs along
// N share A), stmatrix + TMA store epilogue. Per 128-deep k block (one scale block) a consumer runs four wgmma
// m64nBNk32 into a scratch accumulator, waits for them, frees the stage and adds the scratch into its fp32 result
// scaled by sA (per row) x sB (per 128 columns): FP8 wgmma keeps about 14 mantissa bits, so each scale block is summed
// by the tensor cores and promoted to fp32 in registers. TMA zero-fills sA past M and A and B past K; the A and B
// boxes that cross the last row of their maps are loaded through edge maps of exactly the rows left, and boxes
// wholly past them not at all (tma_load_rows: those rows are never stored).
//
// LAYOUT (`info` is a device int array):
// - LAYOUT_NORMAL: one GEMM.
// - LAYOUT_CONTIGUOUS (MoE prefill): A's M rows are the experts' rows back to back, info[m] the group of row m
//   (-1: padding); B is [G, N, K] seen as [G * N, K]. Each group's segment starts at a multiple of BM, so a tile
//   holds one group's rows (and padding), or is padding only and skipped. TILE_LIST = 1: segments start at
//   multiples of an alignment that is not a multiple of BM (128 rows at 64, 192 at 128 or 256, 256 at 128), so a
//   tile may hold the rows of two groups; the tiles come from a list of (tile row, group) entries
//   (contiguous_tiles.cu, `tile_list`), a tile row of two groups as two entries, each run against its group's B.
//   Rows of another group or padding are not written.
// - LAYOUT_MASKED (MoE decode): A is [G, M, K] seen as [G * M, K], D [G * M, N]; only the first info[g] rows of
//   group g are computed and written (the scheduler walks only the tiles that hold rows; info lives on the GPU,
//   no host sync).
// - LAYOUT_KGROUPED (weight gradient): group g reduces over k in [info[g], info[g + 1]) (multiples of 128) into
//   its own fp32 D[g] ([G * M, N]), which is added to (TMA reduce-add); both operands have 1x128 scales (sA
//   [K/128][M] and sB [K/128][N], M-major, loaded with TMA: sB is per column of D, "1D-1D" scaling).
// A 64-row slice of a tile with rows that must not be written (past a group's end, another group's, padding) is
// written by its threads directly (bf16 stores, or fp32 atomic adds), every other slice through TMA.
//
// BM = 256 (BN <= 128) gives each of the two consumers 128 rows, run as two m64 row blocks one after the other
// through the one scratch accumulator: a 256-row tile reads a third less from L2 per flop than a 128-row one,
// and the main loop of the 128-row tiles is bound by those reads. The two consumers issue
// freely: with the descriptors in uniform registers, making them take turns (named-barrier ping-pong) no longer
// paid (H100: 1-3% slower).
//
// BM = 192 (BN <= 128; normal layout, contiguous from a tile list, weight gradient) runs three consumers of one m64 row
// block each, with one scratch set (152 registers a consumer). The promotion's FFMAs are what a consumer cannot overlap
// with its own wgmma; two other consumers' groups hide them better than one: the same rhythm ran at 0.955 of the tensor
// rate against 0.884 for 256 x 128 in a microbenchmark behind a stage ring (H200), and the tile reads as much from L2
// per flop as 128 x 192. Weight gradient (its heavier per-column promotion): 0.95-1.0x the time of 128 x 192 from 16 k
// blocks a tile (H200).
//
// One row block of at most 128 columns per consumer (BM 64 or 128, not the weight gradient): two scratch sets, k
// block kb + 1 issued before kb is promoted (TwoScratch). Of 144..192 columns (normal layout, 128 rows: 176..192):
// the two sets hold the two column halves of a k block, each half's group issued as soon as its set is promoted
// (run_two_sets). Each consumer waits for its own wgmma, then promotes; with one set, the 96 FFMAs of a 128 x 192
// tile's promotion plus the next issue outlasted the other consumer's group, and the main loop ran at 1.10x the
// tensor time (clock64 trace, H100). Halves in flight: 4096x2112x7168 0.962x the time, 2048x7168x18432 0.949x, 8
// shapes 0.975x (results bitwise the same: each element sees the same FFMAs in the same order). Narrower halves cost
// more than they hide: each half's wgmma reads the consumer's A rows from shared memory again, so an m64n80 half
// reads 112 bytes a tensor cycle against 88 for one m64n160 group, next to the TMA writes; the normal layout's
// 128 x 160 tiles ran 0.94-0.99x the time in one set (H200, 22 shapes), 128 x 144 level.
//
// BN > 192 (up to 256, BM 64 or 128): a scratch set of BN columns next to the result would not fit the registers,
// so each k block runs as two halves of BN / 2 columns through one scratch set of BN / 2, with A's fragments loaded
// once per k block into registers (ldmatrix) and used by both halves: A is read from shared memory once, as with
// one wgmma of BN columns, not once per half.
//
// KSPLIT > 1 (split-K, normal layout, BM <= 128, no multicast): clusters of KSPLIT CTAs, one per K slice of the
// same tile, each CTA one tile (the grid is tiles x KSPLIT CTAs; a cluster waits only on its own CTAs, which the
// hardware runs together, so clusters beyond those resident just run later). After the main loop the partials
// are summed through distributed shared memory (`cluster_split_sum`: fixed order, bitwise reproducible), each CTA
// writing 1 / KSPLIT of the tile's rows with direct bf16 stores. For M <= 128 a tile streams all of A's rows
// for a few columns of B; splitting K gives each CTA a KSPLIT-th of both.
//
// STREAM_B = 1 loads B with an evict-first L2 policy, as in gemm.cu.
//
// SCALES_AT_ISSUE = 1 (two scratch sets): a k block's scales are loaded when its wgmma group is issued (B's before
// the full-barrier wait, A's after the issue) instead of after the wait for that group, so that their latency is
// off the consumer's chain from wait to promotion. Picked for unsplit 128-row tiles and one row of 64 x 64 / 64 x 96
// tiles, where it is faster; other 64-row tiles ran slower with it (docs/tuning.md).
//
// L2_WARM = 1 (normal layout, launched with PDL): before pdl_wait, a producer warp prefetches B's first k block
// into L2, so that its DRAM latency overlaps the previous kernel's tail.
//
// Compile-time parameters: BM (64, 128, 192, 256), BN (16..256, step 16; 192 and 256 rows: up to 128), STAGES, MCAST,
// LAYOUT, KSPLIT, STREAM_B, TILE_LIST, L2_WARM, SCALES_AT_ISSUE.
#include "common/epilogue.cuh"
#include "common/pipeline.cuh"
#include "common/scheduler.cuh"
#include "common/wgmma_ops.cuh"

#ifndef MCAST
#define MCAST 0
#endif
#ifndef LAYOUT
#define LAYOUT LAYOUT_NORMAL
#endif
#ifndef STREAM_B
#define STREAM_B 0
#endif
#ifndef KSPLIT
#define KSPLIT 1
#endif
#ifndef TILE_LIST
#define TILE_LIST 0
#endif
#ifndef L2_WARM
#define L2_WARM 0
#endif
#ifndef SCALES_AT_ISSUE
#define SCALES_AT_ISSUE 0
#endif

constexpr int BK = 128;  // e4m3 elements = bytes: one 128-byte swizzle span, four k32 wgmma steps, one scale block
constexpr int CONSUMERS = BM == 64 ? 1 : BM == 192 ? 3 : 2;
constexpr int WG_ROWS = BM / CONSUMERS;  // rows of the tile per consumer warpgroup: 64, or 128 when BM = 256
constexpr int SUBS = WG_ROWS / 64;       // m64 wgmma row blocks per consumer
constexpr bool A_IN_REGS = BN > 192;
// A k block's two column halves in flight through the two scratch sets (above; Mainloop::run_two_sets) at 144..192
// columns, but from 176 for the normal layout's 128-row tiles (its 128 x 160 ran faster in one set, the masked and
// contiguous layouts' 1% slower: H200). Not for the weight gradient: its per-column promotion ran 1.09x slower that
// way (H100; docs/tuning.md).
constexpr bool PIPE_HALVES = BM <= 128 && BN > (BM == 128 && LAYOUT == LAYOUT_NORMAL ? 160 : 128) && !A_IN_REGS &&
                             LAYOUT != LAYOUT_KGROUPED;
constexpr int HALVES = A_IN_REGS || PIPE_HALVES ? 2 : 1;  // column halves per k block
constexpr int PART_N = BN / HALVES;        // columns of one wgmma (the scratch accumulator)
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int A_STAGE = BM * BK;
constexpr int B_STAGE = BN * BK;
constexpr int SA_STAGE = BM * 4;
constexpr bool WGRAD = LAYOUT == LAYOUT_KGROUPED;
constexpr int SB_BYTES = WGRAD ? BN * 4 : 0;  // this k block's 1x128 scales of B's BN rows
constexpr int SB_STAGE = (SB_BYTES + 127) / 128 * 128;  // TMA writes shared memory at 128-byte boundaries
constexpr int OUT_BYTES = WGRAD ? 4 : 2;
// Output chunk rows of at most 128 bytes (one swizzle span); 64 with 256-column tiles, whose smaller chunk buffers
// let a fourth stage fit. 256-row tiles take 128-byte chunks and three stages: each chunk costs ~0.15 us of the
// epilogue, and three stages fed the main loop as well as four (H100: 3-4% faster).
constexpr int CH_MAX = (A_IN_REGS ? 64 : 128) / OUT_BYTES;
constexpr int CH = BN % CH_MAX == 0 ? CH_MAX : BN % 32 == 0 ? 32 : 16;
constexpr int CHUNKS = BN / CH;
constexpr int CHUNK_BYTES = 64 * CH * OUT_BYTES;
// Tiles of 128..192 columns: each consumer stages its whole WG_ROWS x BN result (WHOLE_OUT), so the epilogue writes
// every chunk and then stores them all: no per-chunk barriers, and the wait for the buffers' previous stores falls
// a main loop after them (H100: 3-10% on K <= 2048 at M = 4096). 256-column tiles and
// the weight gradient (fp32) keep a ring of two chunk buffers (their whole slice would cost a stage), and so do
// narrower tiles (a single row of tiles, where it measured no better).
constexpr bool WHOLE_OUT = !A_IN_REGS && !WGRAD && BN >= 128;
constexpr int OUT_BUFS = WHOLE_OUT ? SUBS * CHUNKS : 2;
constexpr int CLUSTER = MCAST ? 2 : KSPLIT;
constexpr int ACC = BN / 2;  // fp32 accumulator registers per thread for m64nBN
// Two scratch sets (TwoScratch) when a consumer has one row block and the result plus two scratch sets fit (the
// weight gradient's per-column promotion reads its stage, and keeps the one-set loop).
constexpr bool SCRATCH2 = SUBS == 1 && HALVES == 1 && !WGRAD && BN <= 128 && CONSUMERS < 3;
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = CONSUMERS == 1 ? 256 : CONSUMERS == 2 ? 232 : 152;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= THREADS * launch_regs(THREADS),
              "setmaxnreg beyond the CTA's register allocation");
static_assert(BM == 64 || BM == 128 || BM == 192 || BM == 256, "BM must be 64, 128, 192 or 256");
static_assert(BM != 192 || (BN <= 128 && LAYOUT != LAYOUT_MASKED && (LAYOUT != LAYOUT_CONTIGUOUS || TILE_LIST)),
              "three consumers: m64nBN result and scratch in 152 registers; not masked, contiguous from a list");
static_assert(BM != 256 || BN <= 128, "two result sets of m64nBN and one scratch set must fit 232 registers");
static_assert(BN % 16 == 0 && BN >= 16 && BN <= 256, "BN must be a multiple of 16 in 16..256");
static_assert(MCAST <= 2, "pairs only (MCAST 1 or 2)");
static_assert(MCAST == 0 || (MCAST == 1 && BN % 16 == 0) || (MCAST == 2 && BM % 64 == 0 && BM >= 128),
              "multicast halves must be whole 8-row swizzle atoms");
static_assert(!(LAYOUT == LAYOUT_CONTIGUOUS && MCAST == 1), "tiles paired along M may belong to different groups");
static_assert(!TILE_LIST || (LAYOUT == LAYOUT_CONTIGUOUS && BM >= 128), "a tile list: contiguous, 128+ rows");
static_assert(!SCALES_AT_ISSUE || (SCRATCH2 && !PIPE_HALVES), "scales at issue: the two-set loop of whole k blocks");
static_assert(KSPLIT == 1 || (KSPLIT <= 8 && MCAST == 0 && LAYOUT == LAYOUT_NORMAL && BM <= 128),
              "split-K: normal layout, at most 128 rows, no multicast, a portable cluster");

// A tile starts at a multiple of BN, so it crosses at most SB_BLOCKS 128-column scale blocks of B: with
// g = gcd(BN, 128) (the lowest set bit of BN, at most 128) its first column sits at most 128 - g into a block
// (BN = 176: up to three blocks).
constexpr int BN_GCD_128 = (BN & -BN) < 128 ? (BN & -BN) : 128;
constexpr int SB_BLOCKS = (128 - BN_GCD_128 + BN + 127) / 128;
static_assert(SB_BLOCKS <= 3, "a tile spans at most three scale blocks of B");
// The main loop runs whole laps of the ring with the stage a constant (Mainloop::run_one_set) where the loop has at
// most four copies (one per scale split G: BN a multiple of 32, or within one scale block). H100, 128 x 160: 3.5-5.7%
// faster than one k block at a time (117 -> 349 KB of cubin). BN with finer splits would take up to eight copies of
// an unrolled lap (64 x 176: 142 KB of code), and their 144-wide tiles (memory-bound picks) gained nothing. (Most
// tiles of 144..192 columns and up to 128 rows run the column halves in flight instead: PIPE_HALVES.) Not for
// the weight gradient's three consumers or 256-column tiles: unrolled, their per-column promotion spilled (152 and
// 232 registers; at 160, with the producer at 24, the three consumers ran no faster: H200).
constexpr bool LAP_UNROLL = (SB_BLOCKS == 1 || BN_GCD_128 >= 32) && !(WGRAD && (CONSUMERS == 3 || A_IN_REGS));

// Promotion of one column part (PART columns, PART / 8 groups of 8, the first being tile group `grp0`) with B's
// scale block changing at column group G (and G + 16): s[b][h] = sA x sB of block b for this thread's rows r
// (h = 0) and r + 8 (h = 1).
template <int G, int PART>
__device__ __forceinline__ void promote_part(float* a, const float* part, const float (&s)[3][2], int grp0) {
#pragma unroll
  for (int i = 0; i < PART / 8; ++i) {
    const int grp = grp0 + i;  // a constant once unrolled and inlined
    const int b = SB_BLOCKS > 2 && grp >= G + 16 ? 2 : SB_BLOCKS > 1 && grp >= G ? 1 : 0;
    a[4 * i] += part[4 * i] * s[b][0];
    a[4 * i + 1] += part[4 * i + 1] * s[b][0];
    a[4 * i + 2] += part[4 * i + 2] * s[b][1];
    a[4 * i + 3] += part[4 * i + 3] * s[b][1];
  }
}

// Shared memory (from a 1024-byte aligned base): A stages | B stages | sA stages | sB stages | output chunks |
// barriers.
constexpr int SMEM_B = STAGES * A_STAGE;
constexpr int SMEM_SA = SMEM_B + STAGES * B_STAGE;
constexpr int SMEM_SB = SMEM_SA + STAGES * SA_STAGE;
constexpr int SMEM_D = (SMEM_SB + STAGES * SB_STAGE + 1023) / 1024 * 1024;
constexpr int SMEM_BARS = SMEM_D + CONSUMERS * OUT_BUFS * CHUNK_BYTES;  // then 2 x STAGES mbarriers
static_assert(KSPLIT == 1 || CONSUMERS * 64 * SPLIT_ROW(BN) * 4 <= SMEM_BARS, "split-K partials reuse the stages");

typedef StageRing<STAGES, MCAST> Ring;
typedef PipeState<STAGES> Pipe;
typedef GemmScheduler<BM, BN, BK, MCAST, LAYOUT, KSPLIT, TILE_LIST> Scheduler;

// One k block of 128 (four k32 steps, 32 e4m3 = 32 bytes = 2 descriptor units along K) into `part`, with A from
// shared memory (da) or from registers (REGS).
template <bool REGS, int N>
__device__ __forceinline__ void qgmma_k_block(float (&part)[N], const u32 (&a)[BK / 32][4], u64 da, u64 db) {
#pragma unroll
  for (int k = 0; k < BK / 32; ++k) {
    if constexpr (REGS) {
      WgmmaRegA<WgE4m3, 2 * N>::mma(part, a[k], db + 2 * k, k != 0);
    } else {
      Wgmma<WgE4m3, 2 * N>::template mma<0>(part, da + 2 * k, db + 2 * k, k != 0);
    }
  }
}

// B's scales of one tile, walked along its k blocks (not for the weight gradient, whose 1x128 scales of B come
// through the stages). Column group i (8 columns) of the tile lies in B's scale block n0 / 128 + (8 i >= first_next)
// + (8 i >= first_next + 128) (first_next: 16..128). Blocks past N are clamped (their columns are not stored).
struct ScalesB {
  const float* p;    // the tile's first scale block, at the next k block
  int next1, next2;  // offsets of its second and third blocks (sB is small: int offsets)
  i64 step;          // one k block
  int first_next;
  int lane_block;  // offset of the block whose scale this lane loads in next_lane: lanes 1 and 2 the second and
                   // third, the others the first

  ScalesB() = default;
  __device__ __forceinline__ ScalesB(const GemmTile& t, const float* sb, i64 sb_group, i64 sb_row, i64 sb_col,
                                     int N) {
    const int n_blocks = (N + 127) / 128;
    first_next = 128 - t.n0 % 128;
    const int nb0 = min(t.n0 / 128, n_blocks - 1);
    p = sb + (WGRAD ? 0 : max(t.g, 0) * sb_group) + nb0 * sb_row + t.kb0 * sb_col;
    next1 = int((min(t.n0 / 128 + 1, n_blocks - 1) - nb0) * sb_row);
    next2 = int((min(t.n0 / 128 + 2, n_blocks - 1) - nb0) * sb_row);
    step = sb_col;
    const int lane = threadIdx.x % 32;
    lane_block = lane == 1 ? next1 : lane == 2 ? next2 : 0;
  }

  // This k block's scales of the (up to three) blocks; L1/L2 hits.
  __device__ __forceinline__ void next(float& b0, float& b1, float& b2) {
    b0 = __ldg(p);
    b1 = SB_BLOCKS > 1 ? __ldg(p + next1) : 0.f;
    b2 = SB_BLOCKS > 2 ? __ldg(p + next2) : 0.f;
    p += step;
  }

  // The same, one block's scale a lane (one register), for spread() to hand to every lane where they are used.
  // Loaded by every lane alike, ptxas moves the scales into uniform registers right after the loads, and the warp
  // waits for them there, before the k block's wgmma (at a tile's start an L2 round trip: H200, contiguous at K
  // 2048, the consumers' second most sampled stall). All 32 lanes call both.
  __device__ __forceinline__ float next_lane() {
    const float v = __ldg(p + lane_block);
    p += step;
    return v;
  }
  __device__ __forceinline__ static void spread(float v, float (&b)[3]) {
#pragma unroll
    for (int i = 0; i < 3; ++i) b[i] = i < SB_BLOCKS ? __shfl_sync(0xffffffffu, v, i) : 0.f;
  }
};

// A consumer's main loop: k blocks from the stage ring into `part` (scratch), promoted into the fp32 result with
// sA x sB. c: the consumer (its WG_ROWS rows of the tile).
struct Mainloop {
  const Ring& ring;
  Pipe st;       // stage of the next k block to promote
  u64 da0, db0;  // descriptors of stage 0 (this consumer's rows of A, and B): a stage's are these plus its offset,
                 // which keeps the address arithmetic between a stage's full barrier and its first wgmma short
  const u8* smem;
  ScalesB sb;  // the current tile's
  int c, warp, lane;
  u32 empty_bar;  // stage 0's empty barrier this lane frees (Ring::release_bar)
  u32 sa_row;     // stage 0's sA of this thread's first row (shared address; + 32: its row + 8, + 256: next m64)
  float part[2][PART_N / 2];  // scratch accumulators (two sets, or part[0] alone)
  // Scales loaded at a k block's issue: of each set's k block (SCALES_AT_ISSUE), or (PIPE_HALVES) in [0], of the
  // k block whose first half was issued last; and (PIPE_HALVES) sA x sB of the k block being promoted.
  float issued_sa[2][2], issued_sb[2];  // (issued_sb: ScalesB::next_lane's)
  float half_sc[3][2];

  __device__ __forceinline__ Mainloop(const Ring& ring_, const u8* smem_, int c_, int tid, u32 rank_)
      : ring(ring_),
        da0(wgmma_desc_sw128(smem_ + c_ * WG_ROWS * 128)),
        db0(wgmma_desc_sw128(smem_ + SMEM_B)),
        smem(smem_),
        c(c_),
        warp(tid / 32),
        lane(tid % 32),
        empty_bar(ring_.release_bar(rank_, tid % 32)),
        sa_row(smem_u32(smem_ + SMEM_SA) + (c_ * WG_ROWS + tid / 32 * 16 + tid % 32 / 4) * 4) {}

  // ---- two scratch sets (SCRATCH2) ----
  // k block kb + 1 is issued into one set before kb, in the other, is promoted, so a consumer keeps the tensor pipe
  // fed while it promotes. A lone consumer (BM = 64) has nobody else to fill that gap: 3-12% on the M <= 128
  // shapes, neutral on 128 x 128 tiles (H100). The loop is peeled so that every wgmma group is issued
  // unconditionally: with a conditional issue ptxas could not tell which group a wait retires and serialized all
  // wgmma.

  // The two sets hold consecutive k blocks or (H, PIPE_HALVES) the two column halves of one k block: an item is a
  // k block or a half. Items alternate between the sets; `is` steps to the next stage after a k block's last item.

  // Issue item J into part[J] (waiting for stage `is` at a k block's first item).
  template <bool H, int J>
  __device__ __forceinline__ void issue(Pipe& is) {
    constexpr bool LOAD = H ? J == 0 : SCALES_AT_ISSUE;  // this item's k block's scales now
    constexpr int S = H ? 0 : J;                         // into issued_sa / issued_sb[S]
    if constexpr (LOAD) issued_sb[S] = sb.next_lane();
    if constexpr (!H || J == 0) ring.wait(is);
    wgmma_fence();
    qgmma_k_block<false>(part[J], {}, da0 + u64(is.stage * (A_STAGE >> 4)),
                         db0 + u64(is.stage * (B_STAGE >> 4) + (H ? J * (PART_N * 128 >> 4) : 0)));
    wgmma_commit();
    if constexpr (LOAD) {  // the k block's sA (H: for both halves' promotions)
      const u32 sa = sa_row + is.stage * SA_STAGE;
      issued_sa[S][0] = ld_shared_f32(sa);
      issued_sa[S][1] = ld_shared_f32(sa + 32);
    }
    if constexpr (!H || J == 1) is.advance();
  }

  // Promote part[J] (stage st, whose wgmma group has completed) and hand the stage back after its last item.
  template <int G, bool H, int J>
  __device__ __forceinline__ void promote(float* acc) {
    fence_registers(part[J]);
    if constexpr (H) {
      if constexpr (J == 0) {
        float scale_b[3];
        ScalesB::spread(issued_sb[0], scale_b);
#pragma unroll
        for (int b = 0; b < 3; ++b) {
          half_sc[b][0] = issued_sa[0][0] * scale_b[b];
          half_sc[b][1] = issued_sa[0][1] * scale_b[b];
        }
      } else {
        __syncwarp();
        ring.release_at(empty_bar + st.stage * 8, lane);  // both halves' reads of the stage are done
        st.advance();
      }
      promote_part<G, PART_N>(acc + J * (PART_N / 2), part[J], half_sc, J * (PART_N / 8));
    } else {
      float scale_b0, scale_b1, scale_b2, sa0, sa1;
      if constexpr (SCALES_AT_ISSUE) {
        float scale_b[3];
        ScalesB::spread(issued_sb[J], scale_b);
        scale_b0 = scale_b[0], scale_b1 = scale_b[1], scale_b2 = scale_b[2];
        sa0 = issued_sa[J][0], sa1 = issued_sa[J][1];
      } else {
        sb.next(scale_b0, scale_b1, scale_b2);
        const u32 sa = sa_row + st.stage * SA_STAGE;
        sa0 = ld_shared_f32(sa);
        sa1 = ld_shared_f32(sa + 32);
      }
      const float sc[3][2] = {{sa0 * scale_b0, sa1 * scale_b0}, {sa0 * scale_b1, sa1 * scale_b1},
                              {sa0 * scale_b2, sa1 * scale_b2}};
      __syncwarp();  // every lane's sA is in registers (used above) before the stage goes back
      ring.release_at(empty_bar + st.stage * 8, lane);  // (predicated: measured 3% slower here, 64x32768x512)
      promote_part<G, PART_N>(acc, part[J], sc, 0);
      st.advance();
    }
  }

  // All n items of one tile (n k blocks, or 2 x the k blocks for H). With an unconditional tail (n is even for H)
  // ptxas serialized every wgmma.
  template <int G, bool H>
  __device__ __forceinline__ void run_two_sets(float* acc, int n) {
    if (n <= 0) return;
    Pipe is = st;  // stage of the next item to issue
    issue<H, 0>(is);
    int i = 0;
    for (; i + 2 < n; i += 2) {
      issue<H, 1>(is);
      wgmma_wait<1>();
      promote<G, H, 0>(acc);
      issue<H, 0>(is);
      wgmma_wait<1>();
      promote<G, H, 1>(acc);
    }
    if (i + 2 == n) {
      issue<H, 1>(is);
      wgmma_wait<1>();
      promote<G, H, 0>(acc);
      wgmma_wait<0>();
      promote<G, H, 1>(acc);
    } else {
      wgmma_wait<0>();
      promote<G, H, 0>(acc);
    }
  }

  // The tile's k blocks kb0 .. kb1 - 1, through the loop instantiated for G = first_next / 8 (2..16; 16 for a tile
  // within one scale block of B) as a compile-time constant: no column group needs a compare and a select (those
  // cost 25-35% of the main loop at BN = 176, measured), and the choice is made once a tile (made per k block, it
  // cost 10 instructions of 181 at 128 x 192). Only the G that some tile origin (a multiple of BN) can produce are
  // instantiated.
  template <int G = 2>
  __device__ __forceinline__ void run_tile(float (&acc)[SUBS][ACC], int kb0, int kb1) {
    if constexpr (SB_BLOCKS == 1 || G >= 16 || WGRAD) {  // (the weight gradient's B scales are per column)
      run_tile_at<16>(acc, kb0, kb1);
    } else if constexpr ((128 - 8 * G) % BN_GCD_128 != 0) {
      run_tile<G + 2>(acc, kb0, kb1);
    } else if (sb.first_next == 8 * G) {
      run_tile_at<G>(acc, kb0, kb1);
    } else {
      run_tile<G + 2>(acc, kb0, kb1);
    }
  }

  template <int G>
  __device__ __forceinline__ void run_tile_at(float (&acc)[SUBS][ACC], int kb0, int kb1) {
    if constexpr (PIPE_HALVES) {
      run_two_sets<G, true>(acc[0], 2 * (kb1 - kb0));
    } else if constexpr (SCRATCH2) {
      run_two_sets<G, false>(acc[0], kb1 - kb0);
    } else {
      run_one_set<G>(acc, kb0, kb1);
    }
  }

  // ---- one scratch set: each k block issued, waited for and promoted in turn ----
  // SUBS m64 row blocks (BM = 256) or two column halves (A_IN_REGS) pass through the scratch set one at a time.
  template <int G>
  __device__ __forceinline__ void run_one_set(float (&acc)[SUBS][ACC], int kb0, int kb1) {
    // Whole laps of the ring from stage 0 with the stage a constant (its barrier, descriptor and sA offsets
    // immediates, no stage step or phase select a k block); the k blocks before and after them one at a time.
#pragma unroll 1
    for (int kb = kb0; kb < kb1;) {
      if (LAP_UNROLL && st.stage == 0 && kb + STAGES <= kb1) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) k_block<G>(acc, s, st.phase);
        st.phase ^= 1;
        kb += STAGES;
      } else {
        k_block<G>(acc, st.stage, st.phase);
        st.advance();
        ++kb;
      }
    }
  }

  // One k block from ring stage `stage` (its lap's parity `phase`).
  template <int G>
  __device__ __forceinline__ void k_block(float (&acc)[SUBS][ACC], int stage, u32 phase) {
    float* scratch = part[0];
    // B's scales for this k block, loaded before the wait so that their latency overlaps it.
    float scale_b0 = 0.f, scale_b1 = 0.f, scale_b2 = 0.f;
    if (!WGRAD) sb.next(scale_b0, scale_b1, scale_b2);
    u64 da = da0 + u64(stage * (A_STAGE >> 4)), db = db0 + u64(stage * (B_STAGE >> 4));
    compute_here(da);
    compute_here(db);
    const u32 sa_stage = sa_row + stage * SA_STAGE;
    ring.wait(Pipe{stage, phase});
    const float* sb_stage = reinterpret_cast<const float*>(smem + SMEM_SB + stage * SB_STAGE) + (lane % 4) * 2;
    float scale_a[SUBS][2];
    u32 a_frag[BK / 32][4];  // A_IN_REGS: this warp's 16 rows of A, one x4 matrix set per k32 step
    if constexpr (A_IN_REGS) {
      // Rows 16 warp + {0..7, 8..15} x 16-byte granules {2k, 2k + 1} of the 128-byte swizzled rows (granule
      // g of row r sits at g ^ (r % 8)); lane i addresses row i % 8 of matrix i / 8.
      const int row = c * 64 + warp * 16 + (lane / 8 % 2) * 8 + lane % 8;
      const u8* a_row = smem + stage * A_STAGE + row * 128;
#pragma unroll
      for (int k = 0; k < BK / 32; ++k) ldmatrix_x4(a_frag[k], a_row + (((2 * k + lane / 16) ^ (lane % 8)) << 4));
    }
#pragma unroll
    for (int u = 0; u < SUBS * HALVES; ++u) {
      const int sub = A_IN_REGS ? 0 : u, half = A_IN_REGS ? u : 0;
      wgmma_fence();
      qgmma_k_block<A_IN_REGS>(part[0], a_frag, da + u64(sub * (64 * 128 >> 4)),
                               db + u64(half * (PART_N * 128 >> 4)));
      wgmma_commit();
      if (u == 0) {
#pragma unroll
        for (int v = 0; v < SUBS; ++v) {  // rows r and r + 8 of each row block
          scale_a[v][0] = ld_shared_f32(sa_stage + v * 256);
          scale_a[v][1] = ld_shared_f32(sa_stage + v * 256 + 32);
        }
      }
      wgmma_wait<0>();
      fence_registers(part[0]);
      if constexpr (A_IN_REGS) fence_registers(a_frag);
      const bool last = u == SUBS * HALVES - 1;
      if (!WGRAD && last) ring.release_predicated_at(empty_bar + stage * 8, lane);  // (sA read above)
      float* a = acc[sub] + half * (PART_N / 2);
      if constexpr (WGRAD) {
#pragma unroll
        for (int i = 0; i < PART_N / 8; ++i) {  // per-column scales of B: columns col + 2 (lane % 4) + {0, 1}
          const int col = 8 * (i + half * (PART_N / 8));  // first column of this column group in the tile
          const float2 scale_b = *reinterpret_cast<const float2*>(sb_stage + col);
          a[4 * i] += scratch[4 * i] * (scale_a[sub][0] * scale_b.x);
          a[4 * i + 1] += scratch[4 * i + 1] * (scale_a[sub][0] * scale_b.y);
          a[4 * i + 2] += scratch[4 * i + 2] * (scale_a[sub][1] * scale_b.x);
          a[4 * i + 3] += scratch[4 * i + 3] * (scale_a[sub][1] * scale_b.y);
        }
      } else {
        // sA x sB of this thread's rows r and r + 8 for each scale block of B the tile meets.
        const float sc[3][2] = {{scale_a[sub][0] * scale_b0, scale_a[sub][1] * scale_b0},
                                {scale_a[sub][0] * scale_b1, scale_a[sub][1] * scale_b1},
                                {scale_a[sub][0] * scale_b2, scale_a[sub][1] * scale_b2}};
        promote_part<G, PART_N>(a, scratch, sc, half * (PART_N / 8));
      }
      if (WGRAD && last) {
        __syncwarp();
        ring.release_predicated_at(empty_bar + stage * 8, lane);
      }
    }
  }
};

// The tile's result to D, one 64-row slice at a time: through shared memory and TMA (the whole slice, or a ring of
// two chunk buffers), or, where some of the slice's rows must not be written (past a group's end, another group's,
// padding), by its threads directly. Rows are checked one by one only in tiles that are not whole: the checks'
// loads and barrier cost a contiguous GEMM 2-7% (H100, K 7168 / 2048).
__device__ __forceinline__ void store_tile(float (&acc)[SUBS][ACC], const GemmTile& t, const Scheduler& sched,
                                           const CUtensorMap_st* tm_d, u8* d_smem, u32& chunk_seq, void* d, i64 ld_d,
                                           int N, int c, int tid) {
  const int warp = tid / 32, lane = tid % 32;
  if (WHOLE_OUT && tid == 0) bulk_wait_read<0>();  // the previous tile's stores are done reading the buffers
#pragma unroll
  for (int u = 0; u < SUBS; ++u) {
    const float* a = acc[u];
    const int r0 = c * WG_ROWS + u * 64;  // this 64-row slice's first row within the tile
    if (t.m0 + r0 >= t.rows || t.n0 >= N) continue;  // a slice past the edge (or a cluster's spare tile)
    bool met = false;  // the warpgroup met on the row check's barrier
    if (LAYOUT != LAYOUT_NORMAL && !t.whole) {
      const int r = r0 + warp * 16 + lane / 4;  // this thread's rows r and r + 8
      const bool ok0 = sched.row_writable(t, r), ok1 = sched.row_writable(t, r + 8);
      if (!named_barrier_all(1 + c, 128, ok0 && ok1)) {
        store_fragment_rows<WGRAD, ACC>(a, d, ld_d, t.d_row + r, ok0, ok1, t.n0, N, lane);
        continue;
      }
      met = true;
    }
    const auto write = [&](int j, u8* buf) { chunk_to_smem<WGRAD ? KIND_FP32 : KIND_BF16, CH>(a, j, buf, warp, lane); };
    if constexpr (WHOLE_OUT) {
      tma_store_all<CHUNKS, CH>(tm_d, d_smem + u * CHUNKS * CHUNK_BYTES, CHUNK_BYTES, t.n0, t.d_row + r0, tid, 1 + c,
                                met, write);
    } else {
      tma_store_chunks<CHUNKS, CH, WGRAD>(tm_d, d_smem, CHUNK_BYTES, chunk_seq, t.n0, t.d_row + r0, tid, 1 + c, write);
    }
  }
}

// tm_a / tm_b: boxes {128, rows a CTA loads of the tile} (halves when shared), 128-byte swizzle; tm_a_edge /
// tm_b_edge: the same tensors with boxes of a group's rows of A (N) modulo those rows (tma_load_rows); tm_sa: the
// M-major scales of A as a [K/128][M] fp32 tensor (LAYOUT_MASKED: groups of M rounded up to 4 rows), box {BM, 1};
// tm_sb (LAYOUT_KGROUPED): B's as [K/128][N], box {BN, 1}; tm_d: D in bf16 (fp32 for LAYOUT_KGROUPED), box
// {CH, 64}, swizzle CH * OUT_BYTES. tile_list (TILE_LIST): the tiles' entries, written by contiguous_tiles.cu's
// kernel just before this one. d / ld_d: D for the direct writes. M, N, K: one group's GEMM (LAYOUT_CONTIGUOUS: M
// counts all rows; LAYOUT_KGROUPED: K counts all groups').
extern "C" __global__ void __launch_bounds__(THREADS, 1) gemm_fp8_kernel(
    const __grid_constant__ CUtensorMap_st tm_a, const __grid_constant__ CUtensorMap_st tm_b,
    const __grid_constant__ CUtensorMap_st tm_a_edge, const __grid_constant__ CUtensorMap_st tm_b_edge,
    const __grid_constant__ CUtensorMap_st tm_sa, const __grid_constant__ CUtensorMap_st tm_sb,
    const __grid_constant__ CUtensorMap_st tm_d, const float* sb, i64 sb_group, i64 sb_row, i64 sb_col,
    const int* info, const int* tile_list, void* d, i64 ld_d, int M, int N, int K, int groups, int group_m) {
  u8* smem = smem_aligned_1024();
  const Ring ring(smem + SMEM_BARS);
  const u32 rank = CLUSTER > 1 ? cluster_rank() : 0;
  const int wg = warpgroup_index();
  const int tid = threadIdx.x % 128;
  // L2_WARM: B's first k block of this CTA's first tile (its share) into L2 while the previous kernel ends, so
  // that the first load does not wait on DRAM (the normal layout's tiles follow from the arguments alone). One box:
  // a loop over more k blocks changed ptxas's main loop (H100: 8% slower at M = 4096), and A's first box as well
  // gained nothing.
  const auto warm = [&] {
    if constexpr (L2_WARM && LAYOUT == LAYOUT_NORMAL) {
      const Scheduler s(M, N, K, 1, groups, group_m, info, rank, CLUSTER, tile_list);
      if (!s.more(s.first)) return;
      const GemmTile t = s.tile(s.first);
      if (t.kb0 < t.kb1) tma_prefetch_rows<b_sharers(MCAST)>(&tm_b, &tm_b_edge, t.kb0 * BK, t.b_row, BN, N, rank);
    }
  };
  kernel_prologue<(CLUSTER > 1)>(ring, cluster_ctas(MCAST) * CONSUMERS * 4, warm, &tm_a, &tm_b, &tm_a_edge, &tm_b_edge,
                                 &tm_sa, WGRAD ? &tm_sb : nullptr, &tm_d);
  const Scheduler sched(M, N, K, 1, groups, group_m, info, rank, CLUSTER, tile_list);  // (after pdl_wait)

  if (wg == 0) {  // ---- producer: one thread issues the loads (A, B, this k block's scales) ----
    regs_decrease<PRODUCER_REGS>();
    if (tid == 0) {
      Pipe st;
      sched.for_each_tile<false>([&](const GemmTile& t) {
        // (the masked layout's scales: each group's padded to a multiple of 4 rows, 16 bytes, by the host)
        const int sa_row = LAYOUT == LAYOUT_MASKED ? t.g * ((M + 3) & ~3) + t.m0 : t.a_row;
        for (int kb = t.kb0; kb < t.kb1; ++kb) {
          // A box across its group's last row loads the rows left (the edge map's box: the host sizes it from a
          // group's rows), not the next group's: the bytes announced are those rows.
          const int ab_rows = rows_in_bounds(t.a_row, BM, t.a_end) + rows_in_bounds(t.b_row, BN, t.b_end);
          u64* bar = ring.acquire(st, ab_rows * 128 + SA_STAGE + SB_BYTES);
          tma_load_rows<a_sharers(MCAST)>(smem + st.stage * A_STAGE, &tm_a, &tm_a_edge, bar, kb * BK, t.a_row, BM,
                                          t.a_end, rank, t.shared);
          tma_load_rows<b_sharers(MCAST), STREAM_B>(smem + SMEM_B + st.stage * B_STAGE, &tm_b, &tm_b_edge, bar,
                                                    kb * BK, t.b_row, BN, t.b_end, rank, t.shared);
          tma_load_2d(smem + SMEM_SA + st.stage * SA_STAGE, &tm_sa, bar, sa_row, kb);
          if (WGRAD) tma_load_2d(smem + SMEM_SB + st.stage * SB_STAGE, &tm_sb, bar, t.n0, kb);
          st.advance();
        }
      });
      ring.producer_finish(st);
    }
    if (KSPLIT > 1) split_sync_only();  // the whole warpgroup, together
    return;
  }

  // ---- consumers: consumer c owns rows [c * WG_ROWS, (c + 1) * WG_ROWS) of every tile ----
  regs_increase<CONSUMER_REGS>();
  const int c = wg - 1;
  u8* d_smem = smem + SMEM_D + c * OUT_BUFS * CHUNK_BYTES;
  float acc[SUBS][ACC];
  Mainloop ml(ring, smem, c, tid, rank);
  u32 chunk_seq = 0;
  sched.for_each_tile<true>([&](const GemmTile& t) {
    ml.sb = ScalesB(t, sb, sb_group, sb_row, sb_col, N);
#pragma unroll
    for (int u = 0; u < SUBS; ++u)
#pragma unroll
      for (int i = 0; i < ACC; ++i) acc[u][i] = 0.f;
    ml.run_tile(acc, t.kb0, t.kb1);

#if KSPLIT > 1
    if constexpr (CONSUMERS > 1) named_barrier(3, 256);  // both consumers are done with the stages
    const int row0 = t.m0 + c * 64;
    cluster_split_sum<KSPLIT, BN>(acc[0], reinterpret_cast<float*>(smem) + c * 64 * SPLIT_ROW(BN), rank, tid,
                                  row0 < M && t.n0 < N, [&](int r, int col, f32x4 v) {
                                    if (row0 + r < M && t.n0 + col < N)  // N % 8 == 0: 4 columns wholly in or out
                                      store4<KIND_BF16>(d, i64(row0 + r) * ld_d + t.n0 + col, v);
                                  });
#else
    store_tile(acc, t, sched, &tm_d, d_smem, chunk_seq, d, ld_d, N, c, tid);
#endif
  });
  epilogue_drain(tid);
}
