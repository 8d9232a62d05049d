// Plain global-memory vector accesses and warp reductions shared by the memory-bound kernels.
#pragma once
#include "common/types.cuh"

// Streaming 16-byte load: read once, keep out of L1.
__device__ __forceinline__ u32x4 ld_stream_16(const void* p) {
  u32x4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The same, asking L2 to fetch the whole 256-byte block around it from DRAM (neighbours read it soon).
__device__ __forceinline__ u32x4 ld_stream_256(const void* p) {
  u32x4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// ld_stream_16 of 4 floats (a cast to f32x4, a 4-byte aligned struct, loads them 4 bytes at a time).
__device__ __forceinline__ f32x4 ld_stream_f32x4(const float* p) {
  const u32x4 v = ld_stream_16(p);
  return f32x4{__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w)};
}

// One element of a KIND_BF16, KIND_FP16 or KIND_FP32 array, widened to fp32.
template <int KIND>
__device__ __forceinline__ float load_elem(const void* base, i64 idx) {
  if constexpr (KIND == KIND_FP32) {
    return reinterpret_cast<const float*>(base)[idx];
  } else if constexpr (KIND == KIND_BF16) {
    return __uint_as_float(u32(reinterpret_cast<const u16*>(base)[idx]) << 16);
  } else {
    float f;
    asm("{\n\t.reg .f16 h;\n\tmov.b16 h, %1;\n\tcvt.f32.f16 %0, h;\n\t}"
        : "=f"(f) : "h"(reinterpret_cast<const u16*>(base)[idx]));
    return f;
  }
}

__device__ __forceinline__ void st_8(void* p, u32 a, u32 b) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ void st_4(void* p, u32 a) {
  asm volatile("st.global.u32 [%0], %1;" :: "l"(p), "r"(a) : "memory");
}

// Max over aligned groups of `width` lanes (width a power of two <= 32); every lane gets its group's result.
template <int width>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int off = width / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
