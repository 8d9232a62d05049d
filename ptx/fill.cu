// A small int32 table given by value (kernel parameters) written into device memory: unlike a copy from host
// memory it needs no host synchronisation and is captured into a CUDA graph with its values.
#include "common/types.cuh"

#define FILL_MAX 512  // cudart_kernels/ops/gemm_fp8.py _FILL_MAX

struct I32Table { int v[FILL_MAX]; };

extern "C" __global__ void fill_i32(int* dst, int n, const __grid_constant__ I32Table table) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = table.v[i];
}
