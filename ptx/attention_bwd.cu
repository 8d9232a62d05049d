// Attention backward: dQ, dK, dV of O = softmax(scale * Q K^T) V from dO, with the forward's log-sum-exp, for
// 16-bit Q, K, V, O, dO (bf16 or fp16) and fp32 accumulation. attention_bwd_prep.cu runs before (dPsum = rowsum(dO
// * O), the LSE in base 2, the dQ accumulator cleared) and after (dQ accumulator * scale -> 16 bits; GQA: the fp32
// dK and dV sums -> 16 bits).
//
// Warp-specialised and persistent. A unit is (key block of BN keys, query head, sequence): the CTA keeps the
// block's K and V in shared memory and walks the head's query tiles (BM rows) that see the block. Warpgroup 0:
// warp 0 streams Q (with its LSE) and dO (with its dPsum) tiles through two STAGES-deep mbarrier rings with TMA
// (lane 0 issues). Warpgroups 1 and 2 own 64 keys each and per tile compute, with wgmma:
// - S^T = K Q^T and dP^T = V dO^T (keys as M: both from shared memory, K-major);
// - P^T = 2^(S^T * scale log2 e - LSE) and dS^T = P^T (dP^T - dPsum) in registers (the LSE and dPsum of a query
//   column come from shared memory);
// - dV += P^T dO and dK += dS^T Q with P^T and dS^T straight from registers (the accumulator layout is wgmma's A
//   register layout) and dO / Q as MN-major B operands; dV and dK stay in registers for the whole unit;
// - dS^T goes to shared memory; dQ = dS K with dS as an MN-major A operand (both warpgroups' keys) and K as an
//   MN-major B operand, the warpgroups splitting the head dim (BM 64) or the query rows (BM 128); each adds its
//   64 x 64 fp32 partial into the dQ accumulator straight from its registers (attention_bwd_layout.cuh: the
//   accumulator is kept in fragment order). A tile's dQ is issued with the next tile's dV and dK, and the consumers
//   take turns issuing GEMMs: they run half a tile apart, one's softmax under the other's GEMMs.
//   DETERMINISTIC (not SPLIT_D): the partial goes through shared memory to warp 1, which waits for its turn and adds
//   it with a bulk reduce-add; a consumer waits on the other CTAs only when its previous block is still queued.
// Head dim 256 (SPLIT_D) splits the head dim between the consumers instead of the keys (see SPLIT_D below).
// GQA: each query head has its units; dK and dV are added into fp32 sums in the epilogue.
// The grid's last wave (not causal, varlen or deterministic): the host may split the last units into parts over
// their query tiles (BwdScheduler), so that the CTAs finish together; the parts of a unit add dK and dV into fp32
// sums, which attention_bwd_split_kv (attention_bwd_prep.cu) stores after the grid.
// Masks: keys past the sequence (their K rows may belong to the next packed sequence) and, causal, keys right of
// the diagonal (bottom-right aligned: query i sees key j <= i + S_k - S_q) get P = 0; query tiles wholly above the
// diagonal are never visited. Query rows past the sequence get P = 0 through their LSE (+inf, from the prep
// kernel), so their dQ rows are exact zeros (added into the tile's own slot of the accumulator).
// DETERMINISTIC: the dQ partials of a query tile are added in key-block order, and a kv head's dK and dV in query
// head order (semaphores: each adder waits for the previous one's sums to complete in global memory).
//
// Compile-time parameters: IN_KIND, HEAD_DIM (64, 128, 256), BM (query rows a tile: 64, or 128 at head dim 64),
// BN (keys a unit: 128, or 64 at head dim 256), STAGES, CAUSAL, VARLEN, DETERMINISTIC; SMEM_LAUNCH (optional: the
// launch's dynamic shared memory, checked against the layout).
#include "attention_bwd_layout.cuh"
#include "common/epilogue.cuh"
#include "common/pipeline.cuh"
#include "common/scheduler.cuh"
#include "common/mma.cuh"

#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef VARLEN
#define VARLEN 0
#endif
#ifndef DETERMINISTIC
#define DETERMINISTIC 0
#endif
constexpr bool CAN_SPLIT = !CAUSAL && !VARLEN && !DETERMINISTIC;  // units split over query tiles (the last wave)

typedef Wg16<IN_KIND>::type WgIn;

constexpr int D = HEAD_DIM;
constexpr int PANEL_COLS = 64;
constexpr int PANELS = D / PANEL_COLS;
constexpr int CONSUMERS = 2;
// Head dim 256 (SPLIT_D): dK and dV of 64 keys take 256 registers a thread, so the consumers split the head dim
// instead of the keys: each computes S^T and dP^T of the block's 64 keys itself (a third more tensor work, nothing
// to exchange), keeps dK and dV for its half of the head dim and computes that half of dQ (64 columns at a time).
constexpr bool SPLIT_D = D == 256;
// DETERMINISTIC, not SPLIT_D: warp 1 adds the consumers' dQ blocks, staged in shared memory, in their turn
constexpr bool DQ_WRITER = DETERMINISTIC && !SPLIT_D;
constexpr int KEYS = SPLIT_D ? BN : BN / CONSUMERS;  // keys a consumer warpgroup's dK and dV rows cover
constexpr int KV_COLS = SPLIT_D ? D / CONSUMERS : D;  // and head-dim columns
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int Q_PANEL = BM * 128;   // one 64-column panel of a Q or dO tile
constexpr int KV_PANEL = BN * 128;  // of a K or V block
constexpr int Q_STAGE = PANELS * Q_PANEL;
constexpr int KV_TILE = PANELS * KV_PANEL;
constexpr int DS_PANEL = BN * 128;    // dS^T: BN key rows of 64 16-bit query columns (128 bytes), BM / 64 panels
constexpr int DS_TILE = BN * BM * 2;
constexpr int DS_BUFS = 2;  // (SPLIT_D: one a consumer)
constexpr u32 Q_TX = BM * D * 2 + BM * 4;  // a tile and its LSE (or dPsum) row
constexpr u32 KV_TX = BN * D * 2;  // K, or V, of a unit
constexpr int ACC_T = BM / 2;        // S^T, dP^T: m64nBM per warpgroup
constexpr int ACC_KV = KV_COLS / 2;  // dK, dV: m64nKV_COLS
// dQ = dS K: BM 64 splits the head dim between the consumers (m64n(D / 2) each), BM 128 the rows (m64nD each)
constexpr bool DQ_SPLIT_ROWS = BM == 128;
constexpr int DQ_N = DQ_SPLIT_ROWS ? D : SPLIT_D ? 64 : D / 2;  // (SPLIT_D: two passes of 64 columns a consumer)
constexpr int ACC_Q = DQ_N / 2;
static_assert(DQ_N == 64, "a consumer's dQ is one 64 x 64 block of the accumulator at a time");
constexpr int Q_STEPS = BM / 16;     // k16 steps over a tile's queries
static_assert(D == 64 || D == 128 || D == 256, "head dim 64, 128 or 256");
static_assert(BM == 64 || (BM == 128 && D == 64), "query tiles of 64 rows, or 128 at head dim 64");
static_assert(SPLIT_D ? BN == 64 && BM == 64 : KEYS == 64, "64 keys a consumer warpgroup (head dim 256: 64 a CTA)");

constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= THREADS * launch_regs(THREADS),
              "setmaxnreg beyond the CTA's register allocation");

// Shared memory (1024-byte aligned base): K | V | Q stages | dO stages | dS^T x 2 (SPLIT_D: within the epilogue's
// staging) | the consumers' dQ blocks (DQ_WRITER) | LSE stages | dPsum stages | barriers.
// K of the next unit loads into the other K buffer while this unit runs, V once this unit's last dP^T has read it
// (head dim 256: no room for a second K buffer)
constexpr int K_BUFS = SPLIT_D ? 1 : 2;
constexpr int SMEM_K = 0;
constexpr int SMEM_V = SMEM_K + K_BUFS * KV_TILE;
constexpr int SMEM_Q = SMEM_V + KV_TILE;
constexpr int SMEM_DO = SMEM_Q + STAGES * Q_STAGE;
constexpr int SMEM_DS = SMEM_DO + STAGES * Q_STAGE;
// SPLIT_D: the epilogue's staging for dK and dV (4 panels) covers the two dS^T tiles
constexpr int SMEM_DQ = SMEM_DS + (SPLIT_D ? CONSUMERS * KV_COLS * 128 : DS_BUFS * DS_TILE);
constexpr int SMEM_LSE = SMEM_DQ + (DQ_WRITER ? CONSUMERS * DQ_BLOCK * 4 : 0);
constexpr int SMEM_DPSUM = SMEM_LSE + STAGES * BM * 4;
constexpr int SMEM_BARS = SMEM_DPSUM + STAGES * BM * 4;
// Q ring (2 x STAGES), dO ring (2 x STAGES), K full [2] and empty [2], V full and empty, unit full [2] and empty
// [2], dS full [2] and empty [2], the unit indices [2]
constexpr int BARS = 4 * STAGES + 14;
constexpr int SMEM_BYTES = SMEM_BARS + BARS * 8 + 8;
static_assert(SMEM_BYTES + 1024 <= 227 * 1024, "shared memory beyond an SM90 CTA's opt-in limit");
#ifdef SMEM_LAUNCH  // the launch's dynamic shared memory (ops/attention_bwd.py smem_bytes, with the alignment slack)
static_assert(SMEM_BYTES + 1024 <= SMEM_LAUNCH, "the launch gives less shared memory than this layout takes");
#endif

// The epilogue stages a consumer's dK (then dV) in 64-row panels of 64 columns: in its rows of the dS^T tiles, or
// (SPLIT_D) in its half of the dS^T and dQ staging region.
__device__ __forceinline__ int stage_panel(int c, int pn) {
  return SPLIT_D ? SMEM_DS + (c * (KV_COLS / 64) + pn) * 64 * 128 : SMEM_DS + pn * DS_TILE + c * KEYS * 128;
}
static_assert(SPLIT_D ? CONSUMERS * DS_TILE <= CONSUMERS * KV_COLS * 128 : PANELS <= DS_BUFS,
              "dK / dV panels are staged in the dS^T tiles");

// Named barriers, each consumer c its own: its turn to issue GEMMs, its warpgroup, (DQ_WRITER) its dQ block written
// (consumer -> writer) and read (writer -> consumer); and both consumers together.
constexpr int BAR_TURN = 1, BAR_WG = 3, BAR_DQ_FULL = 5, BAR_DQ_EMPTY = 7, BAR_CONSUMERS = 9;
constexpr int CONSUMER_THREADS = 128 * CONSUMERS;

typedef StageRing<STAGES, 0> Ring;
typedef PipeState<STAGES> Pipe;

#define POS_INF __int_as_float(0x7f800000u)

// ---- work units --------------------------------------------------------------------------------------------------
struct BwdUnit {
  int n, hq, hkv, b;      // key block, query head, its kv head, sequence
  int q_off, k_off;       // first row of the sequence in the maps' row dimension (varlen; 0 when batched)
  int map_b;              // the maps' batch coordinate
  int sq, sk;             // the sequence's query and key lengths
  int m_begin, m_end;     // query tiles that see a key of the block
  int stat0;              // the sequence's first row in the LSE / dPsum rows (attention_bwd_prep.cu)
  int split;              // a split unit's index among them (its parts share dK and dV sums), else -1
  bool skip;              // the key block lies past the sequence
};

// The first query tile that sees key block n: query i sees key j when j <= i + sk - sq (causal).
__device__ __forceinline__ int first_tile(int n, int sq, int sk) {
  return CAUSAL ? max(0, n * BN - (sk - sq)) / BM : 0;
}

// Units (key block, query head, sequence), key blocks fastest: a head's blocks run side by side and share its Q
// and dO tiles in L2. Causal units (key block n sees the query tiles from first_tile(n) on: block 0 is the longest)
// run in chunks of head_group (sequence, query head) pairs whose Q, dO and dQ sums fit in L2 together, within a
// chunk key block by key block, longest first across the chunk's heads, so that the grid ends on short units (head
// by head, the last head's first block started when little other work was left). GQA: the query heads of a kv head
// each have their units (as many as without GQA, the same L2 footprint), whose dK and dV are summed in fp32 (the
// epilogue). A CTA starts with unit blockIdx.x and takes the next from a global counter when its producer has
// issued the current one's loads (the long-first order balances itself); the producer hands each index to the
// consumers (and the dQ writer, DQ_WRITER) through a two-slot ring in shared memory. The last CTA to finish sets
// the counter back to zero. In DETERMINISTIC mode this order matters too: the units an addition waits for (earlier
// key blocks of the head for dQ, earlier query heads of the group for dK and dV) were handed out before it, to CTAs
// that are running.
// CAN_SPLIT: the units from split_from on come as split_parts parts each (adjacent indices, so the parts of a unit
// run side by side), part p taking the p-th share of the unit's query tiles.
struct BwdScheduler : PersistentUnits {
  int n_blocks, heads_q, batch, group, seqlen_q, seqlen_k, s_pad, head_group, split_from, split_parts;
  const int* cu_q;
  const int* cu_k;

  __device__ __forceinline__ BwdScheduler(int heads_q_, int group_, int batch_, int seqlen_q_, int seqlen_k_,
                                          int head_group_, int split_from_, int split_parts_, const int* cu_q_,
                                          const int* cu_k_)
      : PersistentUnits((seqlen_k_ + BN - 1) / BN * heads_q_ * batch_ +
                            (CAN_SPLIT ? ((seqlen_k_ + BN - 1) / BN * heads_q_ * batch_ - split_from_) *
                                             (split_parts_ - 1)
                                       : 0),
                        1),
        n_blocks((seqlen_k_ + BN - 1) / BN), heads_q(heads_q_), batch(batch_), group(group_), seqlen_q(seqlen_q_),
        seqlen_k(seqlen_k_), s_pad((seqlen_q_ + STAT_PAD - 1) / STAT_PAD * STAT_PAD), head_group(head_group_),
        split_from(split_from_), split_parts(split_parts_), cu_q(cu_q_), cu_k(cu_k_) {}

  __device__ __forceinline__ BwdUnit unit(int u) const {
    BwdUnit t;
    int part = 0;
    t.split = -1;
    if (CAN_SPLIT && u >= split_from) {
      t.split = (u - split_from) / split_parts;
      part = u - split_from - t.split * split_parts;
      u = split_from + t.split;
    }
    if (CAUSAL) {
      const ChunkedUnit cu = chunked_unit(u, n_blocks, head_group, heads_q * batch);
      t.n = cu.block;
      t.hq = cu.pair % heads_q;
      t.b = cu.pair / heads_q;
    } else {
      t.n = u % n_blocks;
      const int rest = u / n_blocks;
      t.hq = rest % heads_q;
      t.b = rest / heads_q;
    }
    t.hkv = t.hq / group;
    if (VARLEN) {
      t.q_off = __ldg(cu_q + t.b);
      t.k_off = __ldg(cu_k + t.b);
      t.sq = __ldg(cu_q + t.b + 1) - t.q_off;
      t.sk = __ldg(cu_k + t.b + 1) - t.k_off;
      t.map_b = 0;
      t.stat0 = (t.q_off & ~3) + 2 * STAT_PAD * t.b;
    } else {
      t.q_off = t.k_off = 0;
      t.sq = seqlen_q;
      t.sk = seqlen_k;
      t.map_b = t.b;
      t.stat0 = t.b * s_pad;
    }
    t.skip = t.n * BN >= t.sk;
    t.m_end = t.skip ? 0 : (t.sq + BM - 1) / BM;
    t.m_begin = min(first_tile(t.n, t.sq, t.sk), t.m_end);
    if (CAN_SPLIT && t.split >= 0) {
      const int span = t.m_end - t.m_begin, begin = t.m_begin;
      t.m_begin = begin + part * span / split_parts;
      t.m_end = begin + (part + 1) * span / split_parts;
    }
    return t;
  }
};

// ---- the dQ accumulator (attention_bwd_layout.cuh) ---------------------------------------------------------------
// Unit t's query head's blocks in its sequence's first slot.
__device__ __forceinline__ float* dq_unit(float* dq_acc, const BwdUnit& t, int seqlen_q, int heads_q) {
  return dq_acc + dq_sequence(VARLEN ? i64(t.q_off) : i64(t.b) * seqlen_q, t.b, heads_q, t.hq, D);
}

// Consumer c's 64-row tile of query tile m (DQ_SPLIT_ROWS: its 64 of the tile's 128 rows). A tile64 wholly past the
// sequence (tile64 * 64 >= sq) would be the next sequence's slot: nothing is added there.
__device__ __forceinline__ int dq_tile64(int m, int c) { return DQ_SPLIT_ROWS ? 2 * m + c : m; }

// A consumer's addition of a tile's dQ: DQ_ADD_BLOCKS adjacent 64 x 64 blocks (SPLIT_D: its two 64-column passes).
constexpr int DQ_ADD_BLOCKS = SPLIT_D ? KV_COLS / DQ_N : 1;

// The first of consumer c's blocks' columns / 64
__device__ __forceinline__ int dq_col0(int c) { return DQ_SPLIT_ROWS ? 0 : c * DQ_ADD_BLOCKS; }

// ---- consumer pieces ---------------------------------------------------------------------------------------------
// acc = A B^T for this consumer's 64 rows of a K or V block (A) and a Q or dO tile (B), both K-major over the head
// dim.
__device__ __forceinline__ void issue_t(float (&acc)[ACC_T], const u8* kv_rows, const u8* tile) {
  mma_kmajor_panels<WgIn, BM, D, KV_PANEL, Q_PANEL>(acc, kv_rows, tile);
}

// acc += A tile: A (P^T or dS^T) from registers, the tile (dO or Q) MN-major over the head dim, 16 query rows of
// 128 bytes a step.
__device__ __forceinline__ void issue_rs(float (&acc)[ACC_KV], const u32 (&a)[Q_STEPS][4], const u8* tile) {
  const u64 db = wgmma_desc_mn_sw128(tile, Q_PANEL);
#pragma unroll
  for (int kk = 0; kk < Q_STEPS; ++kk)
    WgmmaRegA<WgIn, KV_COLS>::template mma<1>(acc, a[kk], db + kk * ((16 * 128) >> 4), 1);
}

// dQ (this consumer's head-dim half) = dS K: dS^T in shared memory is dS as an MN-major A operand (its 64 query
// columns one 128-byte panel), K MN-major over the head dim; 16 keys a step.
__device__ __forceinline__ void issue_dq(float (&acc)[ACC_Q], const u8* ds, const u8* k_cols) {
  const u64 da = wgmma_desc_mn_sw128(ds, 0), db = wgmma_desc_mn_sw128(k_cols, KV_PANEL);
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    Wgmma<WgIn, DQ_N>::template mma<1, 1>(acc, da + kk * ((16 * 128) >> 4), db + kk * ((16 * 128) >> 4), kk != 0);
}

// The consumers take turns issuing GEMMs (named barriers): one's softmax and dS run under the other's GEMMs.
__device__ __forceinline__ void turn_wait(int c) { named_barrier(BAR_TURN + c, CONSUMER_THREADS); }

__device__ __forceinline__ void turn_pass(int c) {
  named_barrier_arrive(BAR_TURN + (c + 1) % CONSUMERS, CONSUMER_THREADS);
}

// P^T = 2^(S^T scale log2 e - LSE) for this thread's elements of a tile (queries q0.., keys key0..), zero where
// masked: keys past the sequence and, causal, right of the diagonal (queries past it have LSE +inf).
__device__ __forceinline__ void probabilities(float (&s)[ACC_T], u32 lse, int key0, int q0, int sq, int sk,
                                              int frag_row, int frag_col, float scale_log2) {
  lse += frag_col * 4;
#pragma unroll
  for (int i = 0; i < ACC_T / 4; ++i) {
    const float2 l = ld_shared_f32x2(lse + 32 * i);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      s[4 * i + 2 * h] = ex2(fmaf(s[4 * i + 2 * h], scale_log2, -l.x));
      s[4 * i + 2 * h + 1] = ex2(fmaf(s[4 * i + 2 * h + 1], scale_log2, -l.y));
    }
  }
  if (key0 + 64 > sk || (CAUSAL && key0 + 63 > q0 + sk - sq)) {
#pragma unroll
    for (int i = 0; i < ACC_T / 4; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kr = key0 + frag_row + 8 * h, qc = q0 + 8 * i + frag_col + e;
          if (!(kr < sk && (!CAUSAL || kr <= qc + sk - sq))) s[4 * i + 2 * h + e] = 0.f;
        }
  }
}

// dS^T = P^T (dP^T - dPsum), into dp.
__device__ __forceinline__ void score_grads(float (&dp)[ACC_T], const float (&p)[ACC_T], u32 dpsum, int frag_col) {
  dpsum += frag_col * 4;
#pragma unroll
  for (int i = 0; i < ACC_T / 4; ++i) {
    const float2 ds = ld_shared_f32x2(dpsum + 32 * i);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dp[4 * i + 2 * h] = p[4 * i + 2 * h] * (dp[4 * i + 2 * h] - ds.x);
      dp[4 * i + 2 * h + 1] = p[4 * i + 2 * h + 1] * (dp[4 * i + 2 * h + 1] - ds.y);
    }
  }
}

// An m64nBM accumulator packed as wgmma A fragments: k16 step kk takes columns 16 kk .. 16 kk + 15.
__device__ __forceinline__ void to_fragments(u32 (&f)[Q_STEPS][4], const float (&x)[ACC_T]) {
#pragma unroll
  for (int kk = 0; kk < Q_STEPS; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) f[kk][r] = pack_f32x2<IN_KIND>(x[8 * kk + 2 * r], x[8 * kk + 2 * r + 1]);
}

// The fragments as this warpgroup's 64 rows of a 128-byte swizzled tile (the same matrices stmatrix_chunk writes).
__device__ __forceinline__ void store_fragments(u8* rows, const u32 (&f)[Q_STEPS][4], int warp, int lane) {
  const int row = warp * 16 + (lane / 8 % 2) * 8 + lane % 8;
#pragma unroll
  for (int kk = 0; kk < Q_STEPS; ++kk)  // (64 columns a panel)
    stmatrix_x4(rows + (kk / 4) * DS_PANEL + swizzled_offset<128>(row, 2 * (kk % 4) + lane / 16), f[kk][0], f[kk][1],
                f[kk][2], f[kk][3]);
}

// The shared-memory base and the barriers at SMEM_BARS: the Q and dO rings, K / V full and empty, the unit slots'
// full [2] and empty [2] barriers, then the two unit indices.
struct BwdShared {
  u8* base;
  Ring q_ring, do_ring;
  u64* k_full;   // [2]: K buffer b loaded
  u64* k_empty;  // [2]: K buffer b read by every wgmma of its unit
  u64* v_full;
  u64* v_empty;  // the unit's last dP^T has read V
  u64* unit_full;
  u64* unit_empty;
  u64* ds_full;   // [2]: a dS^T tile written by both consumers
  u64* ds_empty;  // [2]: a dS^T tile read by both consumers' dQ
  volatile int* unit_slot;

  __device__ __forceinline__ BwdShared()
      : base(opaque(smem_aligned_1024())), q_ring(base + SMEM_BARS), do_ring(base + SMEM_BARS + 2 * STAGES * 8),
        k_full(reinterpret_cast<u64*>(base + SMEM_BARS + 4 * STAGES * 8)), k_empty(k_full + 2), v_full(k_full + 4),
        v_empty(k_full + 5), unit_full(k_full + 6), unit_empty(k_full + 8), ds_full(k_full + 10),
        ds_empty(k_full + 12), unit_slot(reinterpret_cast<volatile int*>(k_full + 14)) {}
};

// Arrival counts of the barriers at SMEM_BARS: the Q and dO rings (full: the producer; empty: every consumer warp),
// K [2] and V full (the producer) and empty (every consumer warp), the unit slots' full (the producer) and empty
// (every consumer warp, and the dQ writer), the dS^T tiles' full and empty (every consumer warp).
__device__ __forceinline__ u32 bar_arrivals(int i) {
  constexpr u32 CONSUMER_WARPS = CONSUMERS * 4;
  if (i < 4 * STAGES) return (i / STAGES) % 2 == 0 ? 1 : CONSUMER_WARPS;
  i -= 4 * STAGES;
  return i < 2 || i == 4 || i == 6 || i == 7 ? 1 : i == 8 || i == 9 ? CONSUMER_WARPS + DQ_WRITER : CONSUMER_WARPS;
}

// tm_q, tm_do: (head dim, rows, heads, batch) maps with boxes {64, BM, 1, 1}; tm_k, tm_v: boxes {64, BN, 1, 1};
// tm_dk, tm_dv: boxes {64, 64, 1, 1}; all 128-byte swizzled. dk_out / dv_out with element strides (row, head): the
// outputs for varlen row-by-row stores.
// tm_stats: the prep kernel's LSE (base 2) rows then dPsum rows, (stat rows, 2 x query heads) fp32 with boxes
// {BM, 1}. cu_q / cu_k: varlen offsets. seqlen_q / seqlen_k: the lengths (varlen: the longest). group: query heads
// per kv head. head_group: (sequence, query head) pairs per causal chunk (BwdScheduler). split_from, split_parts:
// the split units (BwdScheduler; split_from = the unit count: none). scale_log2: softmax scale
// * log2(e); scale: the softmax scale (dK). unit_counter: two ints, zero between launches; semaphores
// (DETERMINISTIC): an int per (sequence, query head, query tile, consumer), zero between launches. dq_acc: the dQ
// accumulator (attention_bwd_layout.cuh), zero before the launch. split_acc: a split unit's fp32 dK and dV sums (BN
// x D each), zero before the launch.
extern "C" __global__ void __launch_bounds__(THREADS, 1) attention_bwd_kernel(
    const __grid_constant__ CUtensorMap_st tm_q, const __grid_constant__ CUtensorMap_st tm_k,
    const __grid_constant__ CUtensorMap_st tm_v, const __grid_constant__ CUtensorMap_st tm_do,
    const __grid_constant__ CUtensorMap_st tm_dk, const __grid_constant__ CUtensorMap_st tm_dv,
    const __grid_constant__ CUtensorMap_st tm_stats, void* dk_out,
    void* dv_out, i64 dk_row, i64 dk_head, i64 dv_row, i64 dv_head, const int* cu_q, const int* cu_k, int seqlen_q,
    int seqlen_k, int heads_q, int batch, int group, int head_group, int split_from, int split_parts,
    float scale_log2, float scale, float* dq_acc, float* dk_acc, float* dv_acc, int* unit_counter, int* semaphores,
    int* kv_semaphores, float* split_acc) {
  const int wg = warpgroup_index();
  if (threadIdx.x == 0) {
    u8* smem = smem_aligned_1024();
    tma_prefetch_map(&tm_q);
    tma_prefetch_map(&tm_k);
    tma_prefetch_map(&tm_v);
    tma_prefetch_map(&tm_do);
    tma_prefetch_map(&tm_stats);
    u64* bars = reinterpret_cast<u64*>(smem + SMEM_BARS);
    for (int i = 0; i < BARS; ++i) mbar_init(&bars[i], bar_arrivals(i));
    fence_barrier_init();
  }
  __syncthreads();
  pdl_wait();
  // Each role derives its pointers, sizes and thread indices after setmaxnreg (values live across it were spilled).
  if (wg == 0) {
    regs_decrease<PRODUCER_REGS>();
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    if (warp == 0) {  // ---- producer: the warp walks the units (its values warp-uniform), lane 0 issues ----
      const BwdScheduler sched(heads_q, group, batch, seqlen_q, seqlen_k, head_group, split_from, split_parts, cu_q,
                                cu_k);
      const bool leader = lane == 0;
      Pipe st;
      for (int k = 0, u = sched.first;; ++k) {
        const BwdShared sh;
        u8* smem = sh.base;
        mbar_wait(&sh.unit_empty[k & 1], ((k >> 1) & 1) ^ 1);
        if (leader) {
          sh.unit_slot[k & 1] = u;
          mbar_arrive(&sh.unit_full[k & 1]);
        }
        if (!sched.more(u)) break;
        const BwdUnit t = sched.unit(u);
        // K into its buffer (free since the unit K_BUFS back), then V once the previous unit's last dP^T has read
        // it; every unit takes a phase of each barrier (one past its sequence loads nothing)
        const auto load_block = [&](u64* full, u8* dst, const CUtensorMap_st* map) {  // the unit's K or V
          if (!leader) return;
          if (t.skip) {
            mbar_arrive(full);
            return;
          }
          mbar_arrive_expect_tx(full, KV_TX);
#pragma unroll
          for (int p = 0; p < PANELS; ++p)
            tma_load_4d(dst + p * KV_PANEL, map, full, p * PANEL_COLS, t.k_off + t.n * BN, t.hkv, t.map_b);
        };
        const int kb = k % K_BUFS;
        mbar_wait(&sh.k_empty[kb], ((k / K_BUFS) & 1) ^ 1);
        load_block(&sh.k_full[kb], smem + SMEM_K + kb * KV_TILE, &tm_k);
        mbar_wait(sh.v_empty, (k & 1) ^ 1);
        load_block(sh.v_full, smem + SMEM_V, &tm_v);
        {
          const int hq = t.hq;
#pragma unroll 1
          for (int m = t.m_begin; m < t.m_end; ++m) {
            const int row = t.q_off + m * BM;
            const int stat = t.stat0 + m * BM;
            const BwdShared shm;
            u8* base = shm.base;
            mbar_wait(&shm.q_ring.empty[st.stage], st.phase ^ 1);
            if (leader) {
              u64* qb = &shm.q_ring.full[st.stage];
              mbar_arrive_expect_tx(qb, Q_TX);
#pragma unroll
              for (int p = 0; p < PANELS; ++p)
                tma_load_4d(base + SMEM_Q + st.stage * Q_STAGE + p * Q_PANEL, &tm_q, qb, p * PANEL_COLS, row, hq,
                            t.map_b);
              tma_load_2d(base + SMEM_LSE + st.stage * BM * 4, &tm_stats, qb, stat, hq);
            }
            mbar_wait(&shm.do_ring.empty[st.stage], st.phase ^ 1);
            if (leader) {
              u64* db = &shm.do_ring.full[st.stage];
              mbar_arrive_expect_tx(db, Q_TX);
#pragma unroll
              for (int p = 0; p < PANELS; ++p)
                tma_load_4d(base + SMEM_DO + st.stage * Q_STAGE + p * Q_PANEL, &tm_do, db, p * PANEL_COLS, row, hq,
                            t.map_b);
              tma_load_2d(base + SMEM_DPSUM + st.stage * BM * 4, &tm_stats, db, stat, heads_q + hq);
            }
            st.advance();
          }
        }
        // the next unit, taken once this one's loads are issued (STAGES tiles before its end: the grid's last units
        // go to the CTAs that finish first)
        int next = 0;
        if (leader) next = sched.step + atomicAdd(unit_counter, 1);
        u = warp_uniform(next);
      }
      if (leader) {  // the last CTA out resets the counters (every CTA has taken its last index before it counts)
        fence_acq_rel_gpu();
        if (atomicAdd(unit_counter + 1, 1) == int(gridDim.x) - 1) {
          unit_counter[0] = 0;
          unit_counter[1] = 0;
        }
        pdl_launch_dependents();
      }
    } else if (DQ_WRITER && warp == 1) {  // ---- dQ writer: each consumer's block in key-block order ----
      const BwdScheduler sched(heads_q, group, batch, seqlen_q, seqlen_k, head_group, split_from, split_parts, cu_q,
                                cu_k);
      for (int k = 0, u = sched.first;; ++k) {
        const BwdShared sh;  // (derived afresh, as in the producer)
        mbar_wait(&sh.unit_full[k & 1], (k >> 1) & 1);
        u = warp_uniform(sh.unit_slot[k & 1]);
        mbar_arrive_by_lane0(smem_u32(&sh.unit_empty[k & 1]), lane);
        if (!sched.more(u)) break;
        const BwdUnit t = sched.unit(u);
        const int m_blocks = (seqlen_q + BM - 1) / BM;
        float* const dq_seq = dq_unit(dq_acc, t, seqlen_q, heads_q);
#pragma unroll 1
        for (int m = t.m_begin; m < t.m_end; ++m) {
          int* sem = semaphores + ((i64(t.b) * heads_q + t.hq) * m_blocks + m) * CONSUMERS;  // (one a tile here)
#pragma unroll
          for (int c = 0; c < CONSUMERS; ++c) {  // each consumer's block as soon as it is there
            named_barrier(BAR_DQ_FULL + c, 128 + 32);
            if (lane == 0) {
              if (c == 0) {  // key block n adds after block n - 1 (blocks 0 .. the last that sees m)
                while (load_acquire_gpu(sem) != t.n) {
                }
                fence_proxy_async_global();  // (the acquire before the async proxy's additions)
              }
              const int tile64 = dq_tile64(m, c);
              if (tile64 * 64 < t.sq) {
                bulk_reduce_add_f32(dq_seq + dq_tile(tile64, heads_q, DQ_SPLIT_ROWS ? 0 : c, D),
                                    sh.base + SMEM_DQ + c * DQ_BLOCK * 4, DQ_BLOCK * 4);
                bulk_commit();
              }
              if (c == CONSUMERS - 1) {
                bulk_wait<0>();  // the sums are in global memory, not just read out of shared memory
                fence_proxy_async_global();
                const bool last = (t.n + 1) * BN >= t.sk || first_tile(t.n + 1, t.sq, t.sk) > m;
                store_release_gpu(sem, last ? 0 : t.n + 1);  // the last one leaves it zero for the next launch
              } else {
                bulk_wait_read<0>();
              }
            }
            __syncwarp();
            named_barrier_arrive(BAR_DQ_EMPTY + c, 128 + 32);
          }
        }
      }
    }
    return;
  }

  // ---- consumers: consumer c owns keys 64 c .. 64 c + 63 of every block ----
  regs_increase<CONSUMER_REGS>();
  const BwdShared sh;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const BwdScheduler sched(heads_q, group, batch, seqlen_q, seqlen_k, head_group, split_from, split_parts, cu_q,
                           cu_k);

  u8* smem = sh.base;
  const int c = wg - 1;
  const int frag_row = warp * 16 + lane / 4;  // the thread's first key row within the consumer's 64
  const int frag_col = 2 * (lane % 4);        // its first query column within a group of 8
  Pipe st;
  u32 tiles = 0;
  bool dq_handed = false;  // (DQ_WRITER) the writer has a block of this consumer's that it may not have read yet
  float dv[ACC_KV], dk[ACC_KV];
  if (c == CONSUMERS - 1) turn_pass(c);  // consumer 0 issues first
  for (int k = 0;; ++k) {
    // (the unit slot is freed only after the epilogue, which reads the unit from it again)
    mbar_wait(&sh.unit_full[k & 1], (k >> 1) & 1);
    const int u = warp_uniform(sh.unit_slot[k & 1]);
    if (!sched.more(u)) break;
    const BwdUnit t = sched.unit(u);
    const int key0 = t.n * BN + (SPLIT_D ? 0 : c * KEYS);  // the consumer's first key in the sequence
#pragma unroll
    for (int i = 0; i < ACC_KV; ++i) {
      dv[i] = 0.f;
      dk[i] = 0.f;
    }
    const int kb = k % K_BUFS;
    const u8* k_rows = smem + SMEM_K + kb * KV_TILE + (SPLIT_D ? 0 : c * KEYS * 128);
    const u8* v_rows = smem + SMEM_V + (SPLIT_D ? 0 : c * KEYS * 128);
    // dQ's operands: this consumer's query rows of dS^T (DQ_SPLIT_ROWS) or all, its head-dim columns of K or all
    const u8* k_cols = smem + SMEM_K + kb * KV_TILE +
                       (DQ_SPLIT_ROWS ? 0 : (c * D / 2 / PANEL_COLS) * KV_PANEL + (c * D / 2 % PANEL_COLS) * 2);
    const int ds_rows = DQ_SPLIT_ROWS ? c * DS_PANEL : 0;
    mbar_wait(&sh.k_full[kb], (k / K_BUFS) & 1);
    mbar_wait(sh.v_full, k & 1);
    // V is free for the next unit once this unit's last dP^T has read it (a unit without tiles: at its end)
    const auto release_v = [&](int m) {
      if (m + 1 == t.m_end) mbar_arrive_by_lane0(smem_u32(sh.v_empty), lane);
    };
    // dQ of a tile is issued with the next tile's dV and dK (or after the unit's last tile): its dS^T then comes
    // from both consumers without either waiting, and the two run half a tile apart (they take turns issuing).
    const auto issue_dq_of = [&](float (&acc)[ACC_Q], u32 tile) {
      mbar_wait(&sh.ds_full[tile & 1], (tile >> 1) & 1);
      issue_dq(acc, smem + SMEM_DS + (tile & 1) * DS_TILE + ds_rows, k_cols);
    };
    // This consumer's 64 x 64 dQ blocks of query tile m into the accumulator, from its registers. DETERMINISTIC
    // (SPLIT_D): after key block n - 1's (a semaphore per tile and consumer: the consumers add disjoint blocks),
    // waited for before the tile's first block and released after its last.
    const int m_blocks = (seqlen_q + BM - 1) / BM;
    int* const sem_base = semaphores + (i64(t.b) * heads_q + t.hq) * m_blocks * CONSUMERS + c;
    const auto dq_order_wait = [&](int m) {
      if (!DETERMINISTIC) return;
      if (tid == 0) {
        while (load_acquire_gpu(sem_base + m * CONSUMERS) != t.n) {
        }
      }
      named_barrier(BAR_WG + c, 128);
    };
    float* const dq_seq = dq_unit(dq_acc, t, seqlen_q, heads_q);
    const auto add_dq = [&](const float (&acc)[ACC_Q], int m, int col_block) {
      const int tile64 = dq_tile64(m, c);
      if (tile64 * 64 >= t.sq) return;
      float* block = dq_seq + dq_tile(tile64, heads_q, col_block, D);
#pragma unroll
      for (int g = 0; g < ACC_Q / 4; ++g)
        red_add_f32x4(block + (g * 128 + tid) * 4, make_float4(acc[4 * g], acc[4 * g + 1], acc[4 * g + 2],
                                                               acc[4 * g + 3]));
    };
    const auto dq_order_release = [&](int m) {  // (every thread's additions before the turn passes)
      if (!DETERMINISTIC) return;
      named_barrier(BAR_WG + c, 128);
      if (tid == 0) {
        fence_acq_rel_gpu();
        const bool last = (t.n + 1) * BN >= t.sk || first_tile(t.n + 1, t.sq, t.sk) > m;
        store_release_gpu(sem_base + m * CONSUMERS, last ? 0 : t.n + 1);  // (the last leaves it zero)
      }
    };
    const auto store_dq = [&](const float (&acc)[ACC_Q], int m) {  // (not SPLIT_D: one block a tile)
      if (!DQ_WRITER) {
        add_dq(acc, m, dq_col0(c));
        return;
      }
      // the block, in its fragment order, to the writer (which keeps the key-block order)
      if (dq_handed) named_barrier(BAR_DQ_EMPTY + c, 128 + 32);
      u8* block = smem + SMEM_DQ + c * DQ_BLOCK * 4;
#pragma unroll
      for (int g = 0; g < ACC_Q / 4; ++g)
        st_shared_f32x4(block + (g * 128 + tid) * 16, acc[4 * g], acc[4 * g + 1], acc[4 * g + 2], acc[4 * g + 3]);
      fence_proxy_async_smem();
      named_barrier_arrive(BAR_DQ_FULL + c, 128 + 32);
      dq_handed = true;
    };
    bool first = true;
    if constexpr (SPLIT_D) {
      // Each consumer computes S^T and dP^T over the whole head dim itself (the two run apart, taking turns on the
      // tensor cores, with nothing to exchange) and dV, dK and dQ for its half of the head dim.
      u8* ds_tile = smem + SMEM_DS + c * DS_TILE;
      for (int m = t.m_begin; m < t.m_end; ++m, ++tiles) {
        const u8* q_tile = smem + SMEM_Q + st.stage * Q_STAGE;
        const u8* do_tile = smem + SMEM_DO + st.stage * Q_STAGE;
        float s[ACC_T], dp[ACC_T];
        sh.q_ring.wait(st);
        sh.do_ring.wait(st);
        turn_wait(c);
        wgmma_fence();
        issue_t(s, k_rows, q_tile);
        wgmma_commit();
        issue_t(dp, v_rows, do_tile);
        wgmma_commit();
        turn_pass(c);
        wgmma_wait<1>();
        fence_registers(s);
        const int q0 = m * BM;
        probabilities(s, smem_u32(smem + SMEM_LSE + st.stage * BM * 4), key0, q0, t.sq, t.sk, frag_row, frag_col,
                      scale_log2);
        wgmma_wait<0>();
        fence_registers(dp);
        release_v(m);
        score_grads(dp, s, smem_u32(smem + SMEM_DPSUM + st.stage * BM * 4), frag_col);
        u32 pf[Q_STEPS][4], dsf[Q_STEPS][4];
        to_fragments(pf, s);
        to_fragments(dsf, dp);
        store_fragments(ds_tile, dsf, warp, lane);  // (its last reader, this consumer's previous dQ, is done)
        fence_proxy_async_smem();
        named_barrier(BAR_WG + c, 128);
        float dq[ACC_Q];
        turn_wait(c);
        wgmma_fence();
        issue_rs(dv, pf, do_tile + c * (KV_COLS / 64) * Q_PANEL);
        issue_rs(dk, dsf, q_tile + c * (KV_COLS / 64) * Q_PANEL);
        issue_dq(dq, ds_tile, k_cols);
        wgmma_commit();
        turn_pass(c);
        wgmma_wait<0>();
        fence_registers(dv);
        fence_registers(dk);
        fence_registers(pf);
        fence_registers(dsf);
        fence_registers(dq);
        __syncwarp();  // every lane's LSE and dPsum reads come before lane 0 frees the stages
        sh.q_ring.release_predicated(st.stage, 0, lane);
        sh.do_ring.release_predicated(st.stage, 0, lane);
        st.advance();
        // dQ (this consumer's columns) into the accumulator, 64 columns at a time
        dq_order_wait(m);
#pragma unroll 1
        for (int pass = 0; pass < DQ_ADD_BLOCKS; ++pass) {
          if (pass > 0) {
            wgmma_fence();
            issue_dq(dq, ds_tile, k_cols + pass * KV_PANEL);
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers(dq);
          }
          add_dq(dq, m, dq_col0(c) + pass);
        }
        dq_order_release(m);
      }
    } else {
      for (int m = t.m_begin; m < t.m_end; ++m, ++tiles) {
        const u8* q_tile = smem + SMEM_Q + st.stage * Q_STAGE;
        const u8* do_tile = smem + SMEM_DO + st.stage * Q_STAGE;
        float s[ACC_T], dp[ACC_T];
        sh.q_ring.wait(st);
        sh.do_ring.wait(st);
        turn_wait(c);
        wgmma_fence();
        issue_t(s, k_rows, q_tile);
        wgmma_commit();
        issue_t(dp, v_rows, do_tile);
        wgmma_commit();
        turn_pass(c);
        wgmma_wait<1>();
        fence_registers(s);
        const int q0 = m * BM;
        probabilities(s, smem_u32(smem + SMEM_LSE + st.stage * BM * 4), key0, q0, t.sq, t.sk, frag_row, frag_col,
                      scale_log2);
        wgmma_wait<0>();
        fence_registers(dp);
        release_v(m);
        score_grads(dp, s, smem_u32(smem + SMEM_DPSUM + st.stage * BM * 4), frag_col);
        u32 pf[Q_STEPS][4], dsf[Q_STEPS][4];
        to_fragments(pf, s);
        to_fragments(dsf, dp);
        // dS^T into its tile, once both consumers' dQ of the tile two back has read it
        const int buf = tiles & 1;
        mbar_wait(&sh.ds_empty[buf], ((tiles >> 1) & 1) ^ 1);
        store_fragments(smem + SMEM_DS + buf * DS_TILE + c * KEYS * 128, dsf, warp, lane);
        // (the other consumer reads it a tile later: handed over after this turn's GEMMs are issued, by when the
        // stores have drained)
        const auto ds_written = [&]() {
          fence_proxy_async_smem();
          __syncwarp();
          mbar_arrive_by_lane0(smem_u32(&sh.ds_full[buf]), lane);
        };
        turn_wait(c);
        wgmma_fence();
        issue_rs(dv, pf, do_tile);
        issue_rs(dk, dsf, q_tile);
        const auto release_stage = [&]() {
          fence_registers(dv);
          fence_registers(dk);
          fence_registers(pf);
          fence_registers(dsf);
          __syncwarp();  // every lane's LSE and dPsum reads come before lane 0 frees the stages
          sh.q_ring.release_predicated(st.stage, 0, lane);
          sh.do_ring.release_predicated(st.stage, 0, lane);
          st.advance();
        };
        if (first) {
          wgmma_commit();
          turn_pass(c);
          ds_written();
          wgmma_wait<0>();
        } else {  // and the previous tile's dQ, whose dS^T both consumers have written by now
          float dq[ACC_Q];
          issue_dq_of(dq, tiles - 1);
          wgmma_commit();
          turn_pass(c);
          ds_written();
          wgmma_wait<0>();
          fence_registers(dq);
          mbar_arrive_by_lane0(smem_u32(&sh.ds_empty[(tiles - 1) & 1]), lane);
          release_stage();
          store_dq(dq, m - 1);
        }
        if (first) release_stage();
        first = false;
      }
    }
    if (!first) {  // the unit's last dQ
      float dq[ACC_Q];
      turn_wait(c);
      wgmma_fence();
      issue_dq_of(dq, tiles - 1);
      wgmma_commit();
      turn_pass(c);
      wgmma_wait<0>();
      fence_registers(dq);
      mbar_arrive_by_lane0(smem_u32(&sh.ds_empty[(tiles - 1) & 1]), lane);
      store_dq(dq, t.m_end - 1);
    }
    mbar_arrive_by_lane0(smem_u32(&sh.k_empty[kb]), lane);  // every wgmma that read K is done
    if (t.m_begin == t.m_end) mbar_arrive_by_lane0(smem_u32(sh.v_empty), lane);

    // ---- epilogue: dK * scale and dV, staged in the dS^T tiles (stage_panel) ----
    // (the unit is decoded again from its slot: kept live across the loop, its fields were spilled)
    const BwdUnit te = sched.unit(warp_uniform(sh.unit_slot[k & 1]));
    mbar_arrive_by_lane0(smem_u32(&sh.unit_empty[k & 1]), lane);
    if (te.skip) continue;
    named_barrier(BAR_CONSUMERS, CONSUMER_THREADS);  // the other consumer's last dQ has read the dS^T tiles
#pragma unroll
    for (int i = 0; i < ACC_KV; ++i) dk[i] *= scale;
    const int row0 = te.n * BN + (SPLIT_D ? 0 : c * KEYS);
    const int col0 = SPLIT_D ? c * KV_COLS : 0;
    const bool whole = !VARLEN || row0 + 64 <= te.sk;
    const auto store = [&](const float (&acc)[ACC_KV], const CUtensorMap_st* map, void* out, i64 out_row,
                           i64 out_head) {
      // (addresses derived here from the base: computed once at the start, they were spilled)
      u8* smem = opaque(sh.base);
#pragma unroll
      for (int pn = 0; pn < KV_COLS / 64; ++pn)
        stmatrix_chunk<PANEL_COLS>(acc, pn, smem + stage_panel(c, pn), warp, lane,
                                   [](float a, float b) { return pack_f32x2<IN_KIND>(a, b); });
      fence_proxy_async_smem();
      named_barrier(BAR_WG + c, 128);
      if (row0 < te.sk) {
        if (whole) {
          if (tid == 0) {
#pragma unroll
            for (int pn = 0; pn < KV_COLS / 64; ++pn)
              tma_store_4d(map, smem + stage_panel(c, pn), col0 + pn * PANEL_COLS, te.k_off + row0, te.hkv,
                           te.map_b);
            bulk_commit();
          }
        } else {  // a varlen tail: only the sequence's rows, 16 bytes at a time
          const int rows = te.sk - row0;
          for (int gi = tid; gi < rows * (KV_COLS / 8); gi += 128) {
            const int r = gi / (KV_COLS / 8), col = gi % (KV_COLS / 8) * 8;
            const u32x4 v = *reinterpret_cast<const u32x4*>(smem + stage_panel(c, col / 64) +
                                                            swizzled_offset<128>(r, col % 64 / 8));
            *reinterpret_cast<u32x4*>(reinterpret_cast<u16*>(out) + (te.k_off + row0 + r) * out_row +
                                      te.hkv * out_head + col0 + col) = v;
          }
        }
      }
      if (tid == 0) bulk_wait_read<0>();
      named_barrier(BAR_WG + c, 128);
    };
    const bool split_part = CAN_SPLIT && group == 1 && te.split >= 0;  // (GQA: the group's sums, as any unit)
    if (group == 1 && !split_part) {
      store(dk, &tm_dk, dk_out, dk_row, dk_head);
      store(dv, &tm_dv, dv_out, dv_row, dv_head);
      continue;
    }
    // Added into fp32 sums: GQA, the group's [rows_k, H_kv, D] accumulators (DETERMINISTIC: the group's query heads
    // in order); a split unit's part, the unit's BN x D pair (attention_bwd_split_kv stores them after the grid).
    int* sem = kv_semaphores + (i64(te.b) * (heads_q / group) + te.hkv) * sched.n_blocks + te.n;
    const int g = te.hq % group;
    if (DETERMINISTIC) {
      if (c == 0 && tid == 0) {
        while (load_acquire_gpu(sem) != g) {
        }
      }
      named_barrier(BAR_CONSUMERS, CONSUMER_THREADS);
    }
    float* k_sum;
    float* v_sum;
    i64 row_step;
    if (split_part) {
      k_sum = split_acc + i64(te.split) * (2 * BN * D) + i64(row0 - te.n * BN + frag_row) * D + col0 + frag_col;
      v_sum = k_sum + BN * D;
      row_step = D;
    } else {
      const i64 at = ((i64(VARLEN ? te.k_off : te.b * seqlen_k) + row0 + frag_row) * (heads_q / group) + te.hkv) * D +
                     col0 + frag_col;
      k_sum = dk_acc + at;
      v_sum = dv_acc + at;
      row_step = i64(heads_q / group) * D;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row0 + frag_row + 8 * h < te.sk) {
#pragma unroll
        for (int i = 0; i < ACC_KV / 4; ++i) {
          red_add_f32x2(k_sum + 8 * h * row_step + 8 * i, dk[4 * i + 2 * h], dk[4 * i + 2 * h + 1]);
          red_add_f32x2(v_sum + 8 * h * row_step + 8 * i, dv[4 * i + 2 * h], dv[4 * i + 2 * h + 1]);
        }
      }
    }
    if (DETERMINISTIC) {  // every thread's additions before the turn passes (the last head leaves it zero)
      named_barrier(BAR_CONSUMERS, CONSUMER_THREADS);
      if (c == 0 && tid == 0) {
        fence_acq_rel_gpu();
        store_release_gpu(sem, g + 1 == group ? 0 : g + 1);
      }
    }
  }
  // the writer's read of the last dQ block; the last turn handed round
  if (dq_handed) named_barrier(BAR_DQ_EMPTY + c, 128 + 32);
  if (c == 0) turn_wait(c);
  epilogue_drain(tid);
}
