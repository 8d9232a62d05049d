// The row-wise kernels around the attention backward (attention_bwd.cu), one CTA per (64-row query tile, query head,
// sequence), four threads a row:
// - attention_bwd_prep: dPsum = rowsum(dO * O) in fp32 and the LSE in base 2 (LSE log2 e) into the stats rows the
//   main kernel loads a tile at a time, and the tile's slot of the fp32 dQ accumulator cleared. Every row of a
//   visited tile is written: rows past the sequence, and rows that saw no key in the forward (LSE -inf), get LSE
//   +inf (so P = 0) and dPsum 0.
// - attention_bwd_dq: dQ = accumulator * softmax scale, to 16 bits (the accumulator's fragment order undone).
// - attention_bwd_rows: fp32 rows [rows, heads, D] to 16 bits (GQA: the dK and dV sums).
// - attention_bwd_split_kv (one CTA per split unit, dK or dV, and 64 keys): the split units' dK and dV, below.
// Stats rows: a head's rows are `stat_head` floats; sequence b starts at b * S_pad (batched, S_pad = S_q rounded up
// to STAT_PAD) or at (q_off & ~3) + 2 STAT_PAD b (varlen: 16-byte aligned for TMA, and never reaching the next
// sequence's rows however a tile of up to STAT_PAD rows rounds). Rows up to the sequence's length rounded up to
// STAT_PAD are written. The dQ accumulator: attention_bwd_layout.cuh.
// Compile-time parameters: IN_KIND, HEAD_DIM, VARLEN.
#include "attention_bwd_layout.cuh"
#include "common/epilogue.cuh"
#include "common/memory.cuh"

#ifndef VARLEN
#define VARLEN 0
#endif

constexpr int D = HEAD_DIM;
constexpr int ROWS = 64;  // (the dQ accumulator's blocks are as tall)
constexpr int VECS = D / 8 / 4;  // 16-byte vectors (8 elements) a thread: every fourth of the row's

struct RowTile {
  int row;      // the thread's row in the sequence
  int sq;       // the sequence's length
  i64 row0;     // the sequence's first row in the packed rows (b S_q batched)
  i64 acc_row;  // the thread's row in the packed rows
  int stat;     // its index within a head's stats rows
  int b;
};

__device__ __forceinline__ RowTile row_tile(const int* cu_q, int seqlen_q) {
  RowTile t;
  t.b = blockIdx.z;
  t.row = blockIdx.x * ROWS + threadIdx.x / 4;
  if (VARLEN) {
    const int q_off = __ldg(cu_q + t.b);
    t.sq = __ldg(cu_q + t.b + 1) - q_off;
    t.row0 = q_off;
    t.acc_row = q_off + t.row;
    t.stat = (q_off & ~3) + 2 * STAT_PAD * t.b + t.row;
  } else {
    t.sq = seqlen_q;
    t.row0 = i64(t.b) * seqlen_q;
    t.acc_row = t.row0 + t.row;
    t.stat = t.b * ((seqlen_q + STAT_PAD - 1) / STAT_PAD * STAT_PAD) + t.row;
  }
  return t;
}

__device__ __forceinline__ float dot8(u32x4 a, u32x4 b) {
  const u32 x[4] = {a.x, a.y, a.z, a.w}, y[4] = {b.x, b.y, b.z, b.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float a0, a1, b0, b1;
    if (IN_KIND == KIND_BF16) {
      bf16x2_to_f32(x[i], a0, a1);
      bf16x2_to_f32(y[i], b0, b1);
    } else {
      fp16x2_to_f32(x[i], a0, a1);
      fp16x2_to_f32(y[i], b0, b1);
    }
    s = fmaf(a0, b0, fmaf(a1, b1, s));
  }
  return s;
}

// o / dout: element strides row, head, batch (batch unused when VARLEN). lse: the forward's, element (b, h, i) at
// b * lse_b + h * lse_h + q_off + i. stats: LSE rows, then (heads * stat_head floats on) dPsum rows.
extern "C" __global__ void __launch_bounds__(256) attention_bwd_prep(
    const void* o, i64 o_row, i64 o_head, i64 o_batch, const void* dout, i64 do_row, i64 do_head, i64 do_batch,
    const float* lse, i64 lse_b, i64 lse_h, float* stats, i64 stat_head, float* dq_acc, const int* cu_q,
    int seqlen_q) {
  pdl_wait();
  const int h = blockIdx.y, heads = gridDim.y, part = threadIdx.x % 4;
  const RowTile t = row_tile(cu_q, seqlen_q);
  if (blockIdx.x * ROWS >= (t.sq + STAT_PAD - 1) / STAT_PAD * STAT_PAD) return;  // the main kernel never reads these
  const bool live = t.row < t.sq;
  float dot = 0.f;
  if (live) {
    const i64 b_o = VARLEN ? 0 : t.b * o_batch, b_do = VARLEN ? 0 : t.b * do_batch;
    const i64 r = VARLEN ? t.acc_row : t.row;
    const u16* orow = reinterpret_cast<const u16*>(o) + b_o + r * o_row + h * o_head;
    const u16* drow = reinterpret_cast<const u16*>(dout) + b_do + r * do_row + h * do_head;
#pragma unroll
    for (int v = 0; v < VECS; ++v) {
      const int col = (v * 4 + part) * 8;
      dot += dot8(ld_stream_16(orow + col), ld_stream_16(drow + col));
    }
  }
  if (int(blockIdx.x) * ROWS < t.sq) {  // the tile's slot (a tile past the sequence: not its slot)
    float* block = dq_acc + dq_sequence(t.row0, t.b, heads, h, D) + dq_tile(blockIdx.x, heads, 0, D);
#pragma unroll
    for (int i = 0; i < ROWS * D / 4 / 256; ++i)
      *reinterpret_cast<u32x4*>(block + (i * 256 + threadIdx.x) * 4) = u32x4{0, 0, 0, 0};
  }
  dot += __shfl_xor_sync(0xffffffffu, dot, 1);
  dot += __shfl_xor_sync(0xffffffffu, dot, 2);
  if (part == 0) {
    float l = __int_as_float(0x7f800000u);  // +inf: P = 0
    if (live) {
      const float x = lse[t.b * lse_b + h * lse_h + (VARLEN ? t.acc_row : t.row)];
      if (x != __int_as_float(0xff800000u)) l = x * 1.4426950408889634f;
    }
    stats[h * stat_head + t.stat] = l;
    stats[(heads + h) * stat_head + t.stat] = live ? dot : 0.f;
  }
  pdl_launch_dependents();
}

// dq: element strides row, head, batch (batch unused when VARLEN). A CTA converts one 64-row tile of a head: it
// reads the tile's D / 64 blocks 16 bytes a thread (a warp 512 contiguous bytes), puts the 16-bit values back in row
// order in shared memory and stores whole rows, 16 bytes a thread. (Stored straight from the fragments, a warp's
// store was 8 rows of 16 bytes: twice cuDNN's conversion time.)
constexpr int DQ_ROW_BYTES = D * 2 + 16;  // (the pad puts a warp's 4-byte writes, 8 rows of 16 bytes, on 32 banks)
constexpr int DQ_LOADS = D / 64 * DQ_BLOCK / 4 / 256;  // 16-byte loads a thread

extern "C" __global__ void __launch_bounds__(256) attention_bwd_dq(const float* dq_acc, void* dq, i64 dq_row,
                                                                   i64 dq_head, i64 dq_batch, const int* cu_q,
                                                                   int seqlen_q, float scale) {
  __shared__ __align__(16) u8 rows_16[ROWS * DQ_ROW_BYTES];
  pdl_wait();
  const int h = blockIdx.y, heads = gridDim.y;
  const RowTile t = row_tile(cu_q, seqlen_q);
  const int rows = t.sq - int(blockIdx.x) * ROWS;  // the tile's rows in the sequence (uniform over the CTA)
  if (rows > 0) {
    const float* block = dq_acc + dq_sequence(t.row0, t.b, heads, h, D) + dq_tile(blockIdx.x, heads, 0, D);
    f32x4 a[DQ_LOADS];
#pragma unroll
    for (int j = 0; j < DQ_LOADS; ++j) a[j] = ld_stream_f32x4(block + (j * 256 + threadIdx.x) * 4);
#pragma unroll
    for (int j = 0; j < DQ_LOADS; ++j) {  // float4 i = j 256 + thread: block i / 1024, fragment g, thread tt
      const int i = j * 256 + threadIdx.x, g = i / 128 % 8, tt = i % 128;
      const int r = 16 * (tt / 32) + tt % 32 / 4, col = i / (DQ_BLOCK / 4) * 64 + 8 * g + 2 * (tt % 4);
      u8* p = rows_16 + r * DQ_ROW_BYTES + col * 2;
      *reinterpret_cast<u32*>(p) = pack_f32x2<IN_KIND>(a[j].x * scale, a[j].y * scale);
      *reinterpret_cast<u32*>(p + 8 * DQ_ROW_BYTES) = pack_f32x2<IN_KIND>(a[j].z * scale, a[j].w * scale);
    }
    __syncthreads();
    u16* out = reinterpret_cast<u16*>(dq) + (VARLEN ? t.row0 * dq_row : t.b * dq_batch) +
               i64(blockIdx.x) * ROWS * dq_row + h * dq_head;
#pragma unroll
    for (int j = 0; j < DQ_LOADS / 2; ++j) {  // 16 bytes (8 columns) a thread, D / 8 a row
      const int i = j * 256 + threadIdx.x, r = i / (D / 8), c8 = i % (D / 8);
      if (r < rows)
        *reinterpret_cast<u32x4*>(out + r * dq_row + c8 * 8) =
            *reinterpret_cast<const u32x4*>(rows_16 + r * DQ_ROW_BYTES + c8 * 16);
    }
  }
  pdl_launch_dependents();
}

// attention_bwd_rows: out = acc * scale for fp32 rows acc [rows, heads, D] (rows b * S + i batched, or the packed
// rows; cu_q / seqlen_q are the key side's for GQA's dK and dV sums); out: element strides row, head, batch (batch
// unused when VARLEN).
extern "C" __global__ void __launch_bounds__(256) attention_bwd_rows(const float* acc, void* out, i64 out_row,
                                                                     i64 out_head, i64 out_batch, const int* cu_q,
                                                                     int seqlen_q, float scale) {
  pdl_wait();
  const int h = blockIdx.y, heads = gridDim.y, part = threadIdx.x % 4;
  const RowTile t = row_tile(cu_q, seqlen_q);
  if (t.row >= t.sq) return;
  const float* row = acc + (t.acc_row * heads + h) * D;
  u16* dst = reinterpret_cast<u16*>(out) + (VARLEN ? 0 : t.b * out_batch) + (VARLEN ? t.acc_row : t.row) * out_row +
             h * out_head;
#pragma unroll
  for (int v = 0; v < VECS; ++v) {
    const int col = (v * 4 + part) * 8;
    const f32x4 a = ld_stream_f32x4(row + col), b = ld_stream_f32x4(row + col + 4);
    *reinterpret_cast<u32x4*>(dst + col) =
        u32x4{pack_f32x2<IN_KIND>(a.x * scale, a.y * scale), pack_f32x2<IN_KIND>(a.z * scale, a.w * scale),
              pack_f32x2<IN_KIND>(b.x * scale, b.y * scale), pack_f32x2<IN_KIND>(b.z * scale, b.w * scale)};
  }
  pdl_launch_dependents();
}

// attention_bwd_split_kv: dK and dV of the main kernel's split units (batched, not causal: unit u = split_from +
// blockIdx.x is key block u % n_blocks of head (u / n_blocks) % heads of sequence u / (n_blocks heads)), from their
// fp32 sums [unit][dK, dV][BN][D] to 16 bits (blockIdx.y: dK or dV); the sums cleared for the next launch.
// dk, dv: element strides row, head, batch.
extern "C" __global__ void __launch_bounds__(256) attention_bwd_split_kv(
    float* sums, void* dk, i64 dk_row, i64 dk_head, i64 dk_batch, void* dv, i64 dv_row, i64 dv_head, i64 dv_batch,
    int split_from, int n_blocks, int heads, int seqlen_k, int bn) {
  pdl_wait();
  const int u = split_from + blockIdx.x, n = u % n_blocks, h = u / n_blocks % heads, b = u / n_blocks / heads;
  const int row = blockIdx.z * ROWS + threadIdx.x / 4, part = threadIdx.x % 4, key = n * bn + row;
  if (row < bn) {
    float* acc = sums + (i64(blockIdx.x) * 2 + blockIdx.y) * bn * D + i64(row) * D;
    u16* out = blockIdx.y ? reinterpret_cast<u16*>(dv) + b * dv_batch + key * dv_row + h * dv_head
                          : reinterpret_cast<u16*>(dk) + b * dk_batch + key * dk_row + h * dk_head;
#pragma unroll
    for (int v = 0; v < VECS; ++v) {
      const int col = (v * 4 + part) * 8;
      const f32x4 a = ld_cg_f32x4(acc + col), c = ld_cg_f32x4(acc + col + 4);  // (not .nc: zeroed below)
      if (key < seqlen_k)
        *reinterpret_cast<u32x4*>(out + col) = u32x4{pack_f32x2<IN_KIND>(a.x, a.y), pack_f32x2<IN_KIND>(a.z, a.w),
                                                     pack_f32x2<IN_KIND>(c.x, c.y), pack_f32x2<IN_KIND>(c.z, c.w)};
      *reinterpret_cast<u32x4*>(acc + col) = u32x4{0, 0, 0, 0};
      *reinterpret_cast<u32x4*>(acc + col + 4) = u32x4{0, 0, 0, 0};
    }
  }
  pdl_launch_dependents();
}
