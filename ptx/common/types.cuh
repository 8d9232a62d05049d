// Self-contained scalar types and conversions: no CUDA toolkit headers, so the pip NVRTC alone compiles us.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// 16 bytes moved as one vector access.
struct alignas(16) u32x4 { u32 x, y, z, w; };
struct f32x4 { float x, y, z, w; };
struct alignas(8) u32x2 { u32 x, y; };

// Opaque TMA descriptor (passed by value as a __grid_constant__ kernel parameter).
struct alignas(64) CUtensorMap_st { u64 opaque[16]; };

// Element kinds selected at compile time with -DIN_KIND=...
#define KIND_BF16 0
#define KIND_FP16 1
#define KIND_FP32 2
#define KIND_NONE -1  // an optional operand that is absent

// Widen a packed pair of 16-bit floats to fp32 (exact).
__device__ __forceinline__ void bf16x2_to_f32(u32 v, float& lo, float& hi) {
  lo = __uint_as_float(v << 16);
  hi = __uint_as_float(v & 0xffff0000u);
}

__device__ __forceinline__ void fp16x2_to_f32(u32 v, float& lo, float& hi) {
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi) : "r"(v));
}

// Round to nearest even, saturating to +-448. The first element lands in the low byte (memory order).
__device__ __forceinline__ u16 f32x2_to_e4m3x2(float first, float second) {
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(second), "f"(first));
  return r;
}

__device__ __forceinline__ u32 pack_e4m3x4(float a, float b, float c, float d) {
  return u32(f32x2_to_e4m3x2(a, b)) | (u32(f32x2_to_e4m3x2(c, d)) << 16);
}

__device__ __forceinline__ u32 f32x2_to_bf16x2(float first, float second) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(second), "f"(first));
  return r;
}
