// Scale layouts for the FP8 GEMM.
#include "common/types.cuh"

// Row-major scales of A [M, G] (any strides) -> the M-major layout the GEMM loads: out[g * ld_out + r], row m at
// r = m / group_rows * group_pad + m % group_rows. The masked layout's groups of group_rows rows each start at a
// multiple of 4 floats (group_pad): TMA starts a box only at a 16-byte boundary of the inner dimension.
extern "C" __global__ void scales_to_mmajor(const float* in, i64 in_row, i64 in_col, float* out, i64 ld_out, int m,
                                            int g, int group_rows, int group_pad) {
  const i64 i = i64(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < i64(m) * g) {
    const int row = int(i % m), col = int(i / m);
    out[col * ld_out + row / group_rows * group_pad + row % group_rows] = in[row * in_row + col * in_col];
  }
}
