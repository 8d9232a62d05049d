// GEMM steps the kernels compose from the generated wgmma wrappers (common/wgmma_ops.cuh) and the shared-memory
// descriptors (common/sm90.cuh).
#pragma once
#include "common/sm90.cuh"
#include "common/wgmma_ops.cuh"

// acc = A B^T over K columns, A (64 rows) and B (N rows) both K-major 16-bit tiles loaded by TMA with 128-byte
// swizzle as panels of 64 columns (A_PANEL / B_PANEL bytes apart); a k16 step is 32 bytes within a panel row.
template <typename In, int N, int K, int A_PANEL, int B_PANEL, int ACC>
__device__ __forceinline__ void mma_kmajor_panels(float (&acc)[ACC], const void* a, const void* b) {
  const u64 da = wgmma_desc_sw128(a), db = wgmma_desc_sw128(b);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const u64 step = 2 * (kk % 4);
    Wgmma<In, N>::template mma<0>(acc, da + (kk / 4) * (A_PANEL >> 4) + step, db + (kk / 4) * (B_PANEL >> 4) + step,
                                  kk != 0);
  }
}
