// Shared device helpers of the JIT kernels. Device code only, no host or toolkit header: NVRTC compiles these
// files with nothing but their own folder on the include path (nvcc compiles them too:
// nvcc -std=c++17 -arch=sm_90 -cubin -DNAME=VALUE ... FILE.cu).
#pragma once

namespace ep_jit {

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;

// bf16 as its bits: conversions are exact (to fp32) or round to nearest even (from fp32), as torch's .to(); a NaN
// becomes 0x7FFF like the GPU's own conversion.
struct bf16 {
  u16 bits;
};
__device__ __forceinline__ float to_f32(bf16 v) { return __uint_as_float(static_cast<u32>(v.bits) << 16); }
__device__ __forceinline__ float to_f32(float v) { return v; }
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float v) {
  bf16 r;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
#else
  const u32 u = __float_as_uint(v);
  r.bits = (u & 0x7fffffffu) > 0x7f800000u ? u16(0x7fffu) : u16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
  return r;
}
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }

// The row element type of a RowDtype define: 0 bf16, 1 fp32.
template <int DTYPE>
struct RowType;
template <>
struct RowType<0> { typedef bf16 type; };
template <>
struct RowType<1> { typedef float type; };

// VEC elements of T moved as one (16 bytes when sizeof(T) * VEC == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// A word of BYTES bytes (16, 4, 2 or 1): the unit of a row copy (uint4: CUDA's built-in 16-byte vector).
template <int BYTES>
struct WordOf;
template <>
struct WordOf<16> { typedef uint4 type; };
template <>
struct WordOf<4> { typedef u32 type; };
template <>
struct WordOf<2> { typedef u16 type; };
template <>
struct WordOf<1> { typedef u8 type; };

template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int d = 1; d < kWarp; d *= 2) {
    const T u = __shfl_up_sync(kFull, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

}  // namespace ep_jit
