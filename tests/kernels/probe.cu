// Test kernel: writes back its scalar arguments and the bytes of a by-value tensor map, so the host side can
// check the launcher's packing (offsets, alignment, 64-byte tensor-map slots).
#include "common/types.cuh"

extern "C" __global__ void probe(int a, long long b, float c, u64* out, const __grid_constant__ CUtensorMap_st tm,
                                 unsigned d) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  out[0] = u64(a);
  out[1] = u64(b);
  out[2] = u64(__float_as_uint(c));
  out[3] = u64(d);
  for (int i = 0; i < 16; ++i) out[4 + i] = tm.opaque[i];
  out[20] = gridDim.x * 1000000ull + gridDim.y * 1000ull + gridDim.z;
}
