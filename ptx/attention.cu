// Attention forward: O = softmax(scale * Q K^T) V per (batch, query head), with the log-sum-exp of every row, for
// 16-bit Q, K, V (bf16 or fp16) and fp32 accumulation.
//
// Warp-specialised and persistent. Warpgroup 0 is the producer: one thread loads a BM-row Q tile once per work unit
// and streams the unit's K and V tiles (BN keys each) through two STAGES-deep mbarrier rings with TMA. Warpgroups
// 1..BM/64 are consumers, each owning 64 query rows:
// - S = Q K^T with wgmma from shared memory (Q and K K-major: the head dim is contiguous);
// - the online softmax in registers, in base 2 with the scale folded into one FMA (p = 2^(s * scale * log2 e - m));
// - O += P V with P straight from the S accumulators converted to 16 bits (their fragment layout is wgmma's A
//   register layout) and V as an MN-major B operand (the head dim is V's contiguous dimension and the N of P V).
// Intra-warpgroup overlap: the next tile's S = Q K^T and this tile's O += P V are issued together, and the softmax of
// the new S runs while P V is still on the tensor cores. Pingpong (PINGPONG): the consumers take turns issuing their
// GEMMs (named barriers), so that one warpgroup's softmax runs while another's GEMMs keep the tensor cores busy.
//
// Keys are walked from the last block to the first, so a causal tile's masked blocks (the diagonal, and a key tail
// past S_k) come first and the rest run without masks; blocks wholly above the diagonal are never loaded. Causal
// attention is aligned bottom-right (query i sees keys j <= i + S_k - S_q). A row that sees no key gets O = 0 and
// LSE = -inf.
//
// Layouts: Q, K, V and O are 4-d tensor maps (head dim, rows, heads, batch) with 128-byte swizzled boxes of 64
// head-dim columns: batched inputs use the batch dimension, and TMA's bounds on rows zero-fill loads past S and
// clip stores; packed varlen inputs (VARLEN) have one batch and rows offset by cu_seqlens, keys past a sequence are
// masked, and output rows past a sequence are stored from shared memory row by row (a TMA box would write into the
// next sequence). O goes through shared memory (the consumer's rows of the Q tile, free once its loop is done).
// Units are (query block, head, batch): for causal attention longest blocks first (the last query blocks see the
// most keys), otherwise query blocks fastest, so that the CTAs of a wave share a head's K and V in L2.
//
// Compile-time parameters: IN_KIND (KIND_BF16 / KIND_FP16), HEAD_DIM (64, 128, 192, 256), BM (64 x consumers),
// BN (keys per tile, a multiple of 16), STAGES, CAUSAL, VARLEN, PINGPONG, O_BUFFER, DYNAMIC.
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
#ifndef PINGPONG
#define PINGPONG 1
#endif
#ifndef DYNAMIC
#define DYNAMIC (CAUSAL || VARLEN)
#endif

typedef Wg16<IN_KIND>::type WgIn;

constexpr int D = HEAD_DIM;
constexpr int PANEL_COLS = 64;      // head-dim columns of one 128-byte swizzled box
constexpr int PANELS = D / PANEL_COLS;
#define NEG_INF __int_as_float(0xff800000u)
constexpr int CONSUMERS = BM / 64;
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int Q_PANEL = BM * 128;   // bytes of one panel of the Q tile (BM rows of 128 bytes)
constexpr int KV_PANEL = BN * 128;  // one panel of a K or V tile
constexpr int Q_BYTES = PANELS * Q_PANEL;
constexpr int KV_STAGE = PANELS * KV_PANEL;
constexpr u32 Q_TX = BM * D * 2;    // bytes TMA delivers (boxes of the panel's real columns)
constexpr u32 KV_TX = BN * D * 2;
constexpr int S_ACC = BN / 2;       // fp32 S accumulators per thread (m64nBN)
constexpr int O_ACC = D / 2;        // fp32 O accumulators per thread (m64nD)
constexpr int P_STEPS = BN / 16;    // k16 steps of P V
static_assert(D % 64 == 0 && D <= 256, "head dim: 64, 128, 192 or 256");
static_assert(BN % 16 == 0 && BN <= 256 && BN >= 16, "BN must be a multiple of 16 in 16..256");
static_assert(CONSUMERS >= 1 && CONSUMERS <= 3, "one to three consumer warpgroups");
constexpr int PRODUCER_REGS = CONSUMERS == 2 ? 40 : 32;
constexpr int CONSUMER_REGS = CONSUMERS == 3 ? 160 : CONSUMERS == 2 ? 232 : 256;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= THREADS * launch_regs(THREADS),
              "setmaxnreg beyond the CTA's register allocation");

// O_BUFFER: O is staged in a tile of its own, so that the Q tile is free as soon as a unit's last Q K^T is done
// and the next unit's Q loads under this one's last P V and epilogue (and the O store under the next unit's
// work); without it (head dim 256: no room) O is staged in the Q tile, which the next unit's Q waits for.
// Shared memory (from a 1024-byte aligned base): Q | O | K stages | V stages | K ring bars | V ring bars | Q bars.
#ifndef O_BUFFER
#define O_BUFFER 0
#endif
constexpr int SMEM_O = O_BUFFER ? Q_BYTES : 0;
constexpr int SMEM_K = Q_BYTES + (O_BUFFER ? Q_BYTES : 0);
constexpr int SMEM_V = SMEM_K + STAGES * KV_STAGE;
constexpr int SMEM_BARS = SMEM_V + STAGES * KV_STAGE;
constexpr int SMEM_UNITS = SMEM_BARS + 4 * STAGES * 8 + 16;  // DYNAMIC: 2 full + 2 empty barriers, 2 unit indices
constexpr int SMEM_BYTES = SMEM_UNITS + 4 * 8 + 2 * 4;

// Named barriers: 1 + c the consumer c's own (epilogue), 1 + CONSUMERS + c its turn to issue GEMMs (pingpong).
constexpr int BAR_TURN = 1 + CONSUMERS;

typedef StageRing<STAGES, 0> Ring;
typedef PipeState<STAGES> Pipe;

// ---- work units --------------------------------------------------------------------------------------------------
struct AttnUnit {
  int mb, h, b;           // query block, query head, sequence
  int q_off, k_off;       // first row of the sequence in the maps' row dimension (varlen; 0 when batched)
  int map_b;              // the maps' batch coordinate
  int sq, sk;             // the sequence's query and key lengths
  int blocks;             // key blocks the unit reads (0: no row sees a key)
  bool skip;              // the query block lies past the sequence
};

// Causal units run in chunks of `head_group` (batch, head) pairs whose K and V fit in L2 together: within a chunk
// longest query blocks first, the chunk's heads side by side (so a wave's CTAs share K and V in L2 instead of each
// streaming its own head's from DRAM), then the next chunk.
// DYNAMIC (units of unequal length: causal, varlen): a CTA starts with unit blockIdx.x and then takes the next
// unit from a global counter when its producer is ready for one, so that the long units first / short units last
// order balances itself; the producer hands each unit index to the consumers through a two-slot ring in shared
// memory. The last CTA to finish sets the counter back to zero for the next launch. Otherwise CTA i runs units
// i, i + grid, i + 2 grid, ...
struct AttnScheduler : PersistentUnits {
  int m_blocks, heads, batch, seqlen_q, seqlen_k, head_group;
  const int* cu_q;
  const int* cu_k;

  __device__ __forceinline__ AttnScheduler(int m_blocks_, int heads_, int batch_, int seqlen_q_, int seqlen_k_,
                                           int head_group_, const int* cu_q_, const int* cu_k_)
      : PersistentUnits(m_blocks_ * heads_ * batch_, 1),
        m_blocks(m_blocks_), heads(heads_), batch(batch_), seqlen_q(seqlen_q_), seqlen_k(seqlen_k_),
        head_group(head_group_), cu_q(cu_q_), cu_k(cu_k_) {}

  __device__ __forceinline__ AttnUnit unit(int u) const {
    AttnUnit t;
    if (CAUSAL) {
      const ChunkedUnit cu = chunked_unit(u, m_blocks, head_group, heads * batch);
      t.mb = m_blocks - 1 - cu.block;
      t.b = cu.pair / heads;
      t.h = cu.pair % heads;
    } else {       // a head's query blocks together: they read the same K and V
      t.mb = u % m_blocks;
      const int rest = u / m_blocks;
      t.h = rest % heads;
      t.b = rest / heads;
    }
    if (VARLEN) {
      t.q_off = __ldg(cu_q + t.b);
      t.k_off = __ldg(cu_k + t.b);
      t.sq = __ldg(cu_q + t.b + 1) - t.q_off;
      t.sk = __ldg(cu_k + t.b + 1) - t.k_off;
      t.map_b = 0;
    } else {
      t.q_off = t.k_off = 0;
      t.sq = seqlen_q;
      t.sk = seqlen_k;
      t.map_b = t.b;
    }
    t.skip = t.mb * BM >= t.sq;
    int blocks = (t.sk + BN - 1) / BN;
    if (CAUSAL) {  // the tile's last row sees keys up to mb * BM + BM - 1 + sk - sq
      const int last_key = t.mb * BM + BM - 1 + t.sk - t.sq;
      blocks = last_key < 0 ? 0 : min(blocks, last_key / BN + 1);
    }
    t.blocks = blocks;
    return t;
  }
};

// ---- consumer pieces ---------------------------------------------------------------------------------------------
// S = Q K^T for this consumer's 64 rows and the BN keys of a K stage.
__device__ __forceinline__ void issue_qk(float (&s)[S_ACC], const u8* q_rows, const u8* k_stage) {
  mma_kmajor_panels<WgIn, BN, D, Q_PANEL, KV_PANEL>(s, q_rows, k_stage);
}

// O += P V: P from registers (16 keys a step), V MN-major in panels of 64 head-dim columns (leading byte offset one
// panel), a step 16 key rows of 128 bytes further.
__device__ __forceinline__ void issue_pv(float (&o)[O_ACC], const u32 (&p)[P_STEPS][4], const u8* v_stage) {
  const u64 dv = wgmma_desc_mn_sw128(v_stage, KV_PANEL);
#pragma unroll
  for (int kk = 0; kk < P_STEPS; ++kk) WgmmaRegA<WgIn, D>::template mma<1>(o, p[kk], dv + kk * ((16 * 128) >> 4), 1);
}

// Keys of block j this thread may not see become -inf: past the sequence, or (causal) right of the diagonal.
// `row` is the thread's first row (local to the sequence), the second is 8 further.
__device__ __forceinline__ void mask_block(float (&s)[S_ACC], int j, int row, int sq, int sk, int lane) {
  const int col0 = j * BN + 2 * (lane % 4);
#pragma unroll
  for (int i = 0; i < S_ACC / 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = col0 + 8 * i + e;
        const bool ok = col < sk && (!CAUSAL || col <= row + 8 * h + sk - sq);
        if (!ok) s[4 * i + 2 * h + e] = NEG_INF;
      }
}

constexpr float RESCALE_SLACK = 8.f;

// Online softmax of a new S block for the thread's two rows: the running max m (in units of scale * log2 e), the
// factor the old O and row sums must be scaled by, S replaced by p = 2^(s * scale_log2 - m), partial row sums l
// (this thread's columns; summed over the row's four threads at the end).
template <bool FIRST>
__device__ __forceinline__ void softmax_block(float (&s)[S_ACC], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                              float scale_log2) {
  // Max and sum over four interleaved partials each: four short dependency chains instead of one long one (the
  // softmax has to fit under the other consumer's GEMMs).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx[4] = {NEG_INF, NEG_INF, NEG_INF, NEG_INF};
#pragma unroll
    for (int i = 0; i < S_ACC / 4; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) mx[i % 2 * 2 + e] = fmaxf(mx[i % 2 * 2 + e], s[4 * i + 2 * h + e]);
    float row_max = fmaxf(fmaxf(mx[0], mx[1]), fmaxf(mx[2], mx[3]));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
    // The running max moves only when the block's exceeds it by more than RESCALE_SLACK: below that p stays
    // <= 2^RESCALE_SLACK (in range for fp32 sums and 16-bit P alike; O / l and the LSE take m as it is), alpha
    // is 1 and the O rescale is skipped, for almost every block after the first few.
    const float blk = row_max * scale_log2;
    const float m_new = FIRST || blk > m[h] + RESCALE_SLACK ? blk : m[h];
    const float m_use = m_new == NEG_INF ? 0.f : m_new;  // a row with no key yet: keep every p at 0
    alpha[h] = FIRST ? 0.f : ex2(m[h] - m_use);
    m[h] = m_new;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < S_ACC / 4; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * i + 2 * h + e];
        x = ex2(fmaf(x, scale_log2, -m_use));
        sum[i % 2 * 2 + e] += x;
      }
    const float total = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    l[h] = FIRST ? total : l[h] * alpha[h] + total;
  }
}

// P as wgmma A fragments: k16 step kk takes S columns 16 kk .. 16 kk + 15, i.e. accumulator groups 2 kk and 2 kk + 1.
__device__ __forceinline__ void to_fragments(u32 (&p)[P_STEPS][4], const float (&s)[S_ACC]) {
#pragma unroll
  for (int kk = 0; kk < P_STEPS; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) p[kk][r] = pack_f32x2<IN_KIND>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

__device__ __forceinline__ void scale_rows(float (&o)[O_ACC], const float (&f)[2]) {
#pragma unroll
  for (int i = 0; i < O_ACC / 4; ++i) {
    o[4 * i] *= f[0];
    o[4 * i + 1] *= f[0];
    o[4 * i + 2] *= f[1];
    o[4 * i + 3] *= f[1];
  }
}

// Pingpong: wait for this consumer's turn to issue GEMMs; after issuing, hand the turn to the next consumer.
__device__ __forceinline__ void turn_wait(int c) {
  if (PINGPONG && CONSUMERS > 1) named_barrier(BAR_TURN + c, 256);
}

__device__ __forceinline__ void turn_pass(int c) {
  if (PINGPONG && CONSUMERS > 1)
    named_barrier_arrive(BAR_TURN + (c + 1) % CONSUMERS, 256);
}

// tm_q / tm_k / tm_v: (head dim, rows, heads, batch) maps with boxes {64, BM / BN, 1, 1}, 128-byte swizzle; tm_o:
// O's map with box {64, 64, 1, 1}. o / o_row / o_head: O for the varlen row-by-row stores (element strides).
// lse (or null): fp32, element (b, h, row) at b * lse_b + h * lse_h + q_off + row. cu_q / cu_k: varlen offsets
// [batch + 1] (VARLEN). seqlen_q / seqlen_k: the lengths (varlen: the longest, for m_blocks); group: query heads
// per kv head; head_group: (batch, head) pairs per causal chunk (AttnScheduler). scale_log2: softmax scale * log2(e).
// unit_counter (DYNAMIC): two ints, zero between launches.
extern "C" __global__ void __launch_bounds__(THREADS, 1) attention_fwd_kernel(
    const __grid_constant__ CUtensorMap_st tm_q, const __grid_constant__ CUtensorMap_st tm_k,
    const __grid_constant__ CUtensorMap_st tm_v, const __grid_constant__ CUtensorMap_st tm_o, void* o, i64 o_row,
    i64 o_head, float* lse, i64 lse_b, i64 lse_h, const int* cu_q, const int* cu_k, int seqlen_q, int seqlen_k,
    int heads, int batch, int group, int head_group, float scale_log2, int* unit_counter) {
  u8* smem = smem_aligned_1024();
  const Ring k_ring(smem + SMEM_BARS), v_ring(smem + SMEM_BARS + 2 * STAGES * 8);
  u64* q_full = reinterpret_cast<u64*>(smem + SMEM_BARS + 4 * STAGES * 8);
  u64* q_empty = q_full + 1;
  u64* unit_full = reinterpret_cast<u64*>(smem + SMEM_UNITS);  // [2], then unit_empty [2], then the indices [2]
  u64* unit_empty = unit_full + 2;
  volatile int* unit_slot = reinterpret_cast<volatile int*>(unit_full + 4);
  const int wg = warpgroup_index();
  const int tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    tma_prefetch_map(&tm_q);
    tma_prefetch_map(&tm_k);
    tma_prefetch_map(&tm_v);
    tma_prefetch_map(&tm_o);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&k_ring.full[s], 1);
      mbar_init(&k_ring.empty[s], CONSUMERS * 4);
      mbar_init(&v_ring.full[s], 1);
      mbar_init(&v_ring.empty[s], CONSUMERS * 4);
    }
    mbar_init(q_full, 1);
    mbar_init(q_empty, O_BUFFER ? CONSUMERS * 4 : CONSUMERS);  // (O_BUFFER: each consumer warp)
    for (int i = 0; i < 2; ++i) {
      mbar_init(&unit_full[i], 1);
      mbar_init(&unit_empty[i], CONSUMERS * 4);
    }
    fence_barrier_init();
  }
  __syncthreads();
  pdl_wait();

  if (wg == 0) {  // ---- producer: one thread issues the loads ----
    regs_decrease<PRODUCER_REGS>();
    if (tid != 0) return;
    // (each role builds its own scheduler: values live across setmaxnreg were spilled)
    const AttnScheduler sched((seqlen_q + BM - 1) / BM, heads, batch, seqlen_q, seqlen_k, head_group, cu_q, cu_k);
    Pipe st;
    u32 q_phase = 0;
    const auto load_q = [&](const AttnUnit& t, u32& phase) {
      mbar_wait(q_empty, phase ^ 1);
      mbar_arrive_expect_tx(q_full, Q_TX);
#pragma unroll
      for (int p = 0; p < PANELS; ++p)
        tma_load_4d(smem + p * Q_PANEL, &tm_q, q_full, p * PANEL_COLS, t.q_off + t.mb * BM, t.h, t.map_b);
      phase ^= 1;
    };
    for (int k = 0, u = sched.first;; ++k) {
      int next = u + sched.step;
      if (DYNAMIC) {  // publish this unit to the consumers; ask for the next one now, its reply comes under the loads
        mbar_wait(&unit_empty[k & 1], ((k >> 1) & 1) ^ 1);
        unit_slot[k & 1] = u;
        mbar_arrive(&unit_full[k & 1]);
        if (sched.more(u)) next = sched.step + atomicAdd(unit_counter, 1);
      }
      if (!sched.more(u)) break;
      const AttnUnit t = sched.unit(u);
      u = next;
      if (t.skip) continue;
      const int hkv = t.h / group;
      // The unit's first K tile goes out before the wait for the Q tile (free once the previous unit's O stores
      // have read it), so that it overlaps the consumers' epilogue.
      for (int j = t.blocks - 1, first = 1; j >= 0; --j, first = 0) {
        u64* kb = k_ring.acquire(st, KV_TX);
#pragma unroll
        for (int p = 0; p < PANELS; ++p)
          tma_load_4d(smem + SMEM_K + st.stage * KV_STAGE + p * KV_PANEL, &tm_k, kb, p * PANEL_COLS,
                      t.k_off + j * BN, hkv, t.map_b);
        if (first) load_q(t, q_phase);
        u64* vb = v_ring.acquire(st, KV_TX);
#pragma unroll
        for (int p = 0; p < PANELS; ++p)
          tma_load_4d(smem + SMEM_V + st.stage * KV_STAGE + p * KV_PANEL, &tm_v, vb, p * PANEL_COLS,
                      t.k_off + j * BN, hkv, t.map_b);
        st.advance();
      }
      if (t.blocks == 0) load_q(t, q_phase);  // (the consumers still meet on the Q barriers)
    }
    if (DYNAMIC) {  // the last CTA out resets the counters (every CTA has taken its last index before it counts)
      fence_acq_rel_gpu();
      if (atomicAdd(unit_counter + 1, 1) == int(gridDim.x) - 1) {
        unit_counter[0] = 0;
        unit_counter[1] = 0;
      }
    }
    pdl_launch_dependents();
    return;
  }

  // ---- consumers: consumer c owns query rows 64 c .. 64 c + 63 of every tile ----
  regs_increase<CONSUMER_REGS>();
  const AttnScheduler sched((seqlen_q + BM - 1) / BM, heads, batch, seqlen_q, seqlen_k, head_group, cu_q, cu_k);
  const int c = wg - 1;
  const int warp = tid / 32, lane = tid % 32;
  const int frag_row = warp * 16 + lane / 4;  // the thread's first row within the consumer's 64
  smem = opaque(smem);                        // (computed before setmaxnreg, it was spilled)
  u8* q_rows = smem + c * 64 * 128;           // this consumer's rows of every Q panel (and of the O tile)
  if (PINGPONG && CONSUMERS > 1 && c == CONSUMERS - 1) turn_pass(c);  // consumer 0 issues first
  Pipe st;
  u32 q_phase = 0;
  float o_acc[O_ACC];
  float s[S_ACC];
  u32 p[P_STEPS][4];
  for (int k = 0, u = sched.first;; ++k, u += sched.step) {
    if (DYNAMIC) {
      mbar_wait(&unit_full[k & 1], (k >> 1) & 1);
      u = warp_uniform(unit_slot[k & 1]);
      mbar_arrive_by_lane0(smem_u32(&unit_empty[k & 1]), lane);
    }
    if (!sched.more(u)) break;
    const AttnUnit t = sched.unit(u);
    if (t.skip) continue;
    const int row0 = t.mb * BM + c * 64;  // the consumer's first row in the sequence
    const int row = row0 + frag_row;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, alpha[2];
#pragma unroll
    for (int i = 0; i < O_ACC; ++i) o_acc[i] = 0.f;
    // blocks from `unmasked` down need no mask: all their keys exist and lie left of the consumer's diagonal
    int unmasked = t.sk / BN;
    if (CAUSAL) unmasked = min(unmasked, max(0, (row0 + t.sk - t.sq + 1) / BN));
    mbar_wait(q_full, q_phase);
    q_phase ^= 1;
    if (O_BUFFER && t.blocks == 0) mbar_arrive_by_lane0(smem_u32(q_empty), lane);
    if (t.blocks > 0) {
      int j = t.blocks - 1;
      k_ring.wait(st);
      turn_wait(c);
      wgmma_fence();
      issue_qk(s, q_rows, smem + SMEM_K + st.stage * KV_STAGE);
      wgmma_commit();
      turn_pass(c);
      wgmma_wait<0>();
      fence_registers(s);
      k_ring.release_predicated(st.stage, 0, lane);
      if (O_BUFFER && j == 0) mbar_arrive_by_lane0(smem_u32(q_empty), lane);
      if (j >= unmasked) mask_block(s, j, row, t.sq, t.sk, lane);
      softmax_block<true>(s, m, l, alpha, scale_log2);
      to_fragments(p, s);
      Pipe pv = st;  // the V stage P goes with
      st.advance();
      for (--j; j >= 0; --j) {
        k_ring.wait(st);
        v_ring.wait(pv);
        turn_wait(c);
        wgmma_fence();
        issue_qk(s, q_rows, smem + SMEM_K + st.stage * KV_STAGE);
        wgmma_commit();
        issue_pv(o_acc, p, smem + SMEM_V + pv.stage * KV_STAGE);
        wgmma_commit();
        turn_pass(c);
        wgmma_wait<1>();  // S is ready; P V still runs under the softmax
        fence_registers(s);
        k_ring.release_predicated(st.stage, 0, lane);
        if (O_BUFFER && j == 0) mbar_arrive_by_lane0(smem_u32(q_empty), lane);
        if (j >= unmasked) mask_block(s, j, row, t.sq, t.sk, lane);
        softmax_block<false>(s, m, l, alpha, scale_log2);
        // The wait for P V sits in both arms of a branch that every warp of the warpgroup takes alike (the scale
        // is positive; the compiler cannot know): ptxas does not hoist it above the softmax there (in one straight
        // block it did, and the softmax no longer ran under P V).
        if (scale_log2 > 0.f) {
          wgmma_wait<0>();
        } else {
          wgmma_wait<0>();
        }
        fence_registers(o_acc);
        // (alpha is exactly 1 unless a row's max moved: most blocks skip the rescale)
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) scale_rows(o_acc, alpha);
        fence_registers(p);
        v_ring.release_predicated(pv.stage, 0, lane);
        to_fragments(p, s);
        pv = st;
        st.advance();
      }
      v_ring.wait(pv);
      turn_wait(c);
      wgmma_fence();
      issue_pv(o_acc, p, smem + SMEM_V + pv.stage * KV_STAGE);
      wgmma_commit();
      turn_pass(c);
      wgmma_wait<0>();
      fence_registers(o_acc);
      fence_registers(p);
      v_ring.release_predicated(pv.stage, 0, lane);
    }

    // ---- epilogue: O / l, LSE; O through this consumer's rows of the Q tile ----
    // The unit is decoded again: kept live across the loop, its fields spilled (head dim 256, 240 registers).
    int again = u;
    asm volatile("" : "+r"(again));
    const AttnUnit te = sched.unit(again);
    const int row_e = te.mb * BM + c * 64 + frag_row;
    u8* o_rows = opaque(q_rows + SMEM_O);
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = l[h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv[h] = sum > 0.f ? 1.f / sum : 0.f;
      if (lse != nullptr && lane % 4 == 0 && row_e + 8 * h < te.sq)
        lse[te.b * lse_b + te.h * lse_h + te.q_off + row_e + 8 * h] =
            sum > 0.f ? (m[h] + __log2f(sum)) * 0.6931471805599453f : NEG_INF;
    }
    scale_rows(o_acc, inv);
    // O_BUFFER: the previous unit's O store has read the buffer; otherwise: every warp's wgmma reads of the Q
    // rows are done (the next unit's Q waits for q_empty below)
    if (O_BUFFER && tid == 0) bulk_wait_read<0>();
    named_barrier(1 + c, 128);
#pragma unroll
    for (int pn = 0; pn < PANELS; ++pn) {
      stmatrix_chunk<PANEL_COLS>(o_acc, pn, o_rows + pn * Q_PANEL, warp, lane,
                                 [](float a, float b) { return pack_f32x2<IN_KIND>(a, b); });
    }
    fence_proxy_async_smem();
    named_barrier(1 + c, 128);
    const int row0_e = row_e - frag_row;
    const bool whole = !VARLEN || row0_e + 64 <= te.sq;
    if (row0_e < te.sq) {
      if (whole) {
        if (tid == 0) {
#pragma unroll
          for (int pn = 0; pn < PANELS; ++pn)
            tma_store_4d(&tm_o, o_rows + pn * Q_PANEL, pn * PANEL_COLS, te.q_off + row0_e, te.h, te.map_b);
          bulk_commit();
        }
      } else {  // a varlen tail: only the sequence's rows, 16 bytes at a time
        const int rows = te.sq - row0_e;
        for (int g = tid; g < rows * (D / 8); g += 128) {
          const int r = g / (D / 8), col = g % (D / 8) * 8;
          const u32x4 v = *reinterpret_cast<const u32x4*>(o_rows + (col / 64) * Q_PANEL +
                                                          swizzled_offset<128>(r, col % 64 / 8));
          *reinterpret_cast<u32x4*>(reinterpret_cast<u16*>(o) + (te.q_off + row0_e + r) * o_row + te.h * o_head + col) = v;
        }
      }
    }
    if (!O_BUFFER) {  // the Q tile goes back to the producer once the O stores (and row copies) have read it
      if (tid == 0) bulk_wait_read<0>();
      named_barrier(1 + c, 128);
      if (tid == 0) mbar_arrive(q_empty);
    }
  }
  if (PINGPONG && CONSUMERS > 1 && c == 0) turn_wait(c);  // the last turn handed round
  epilogue_drain(tid);
}
