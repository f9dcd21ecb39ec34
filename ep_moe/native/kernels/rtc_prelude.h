// What the intranode sources take from the CUDA toolkit's headers, for NVRTC (the JIT build,
// intranode.cu and expert_major_exchange.cu), which has none: the fixed-width integers (as glibc's LP64 types, so
// that both builds lay the parameter structs out alike) and the bf16 conversions the combine uses (round to
// nearest even, as cuda_bf16.h's on sm_80 and later).
#pragma once

#ifndef __CUDACC_RTC__
#error "rtc_prelude.h is for NVRTC builds only; nvcc builds include <cstdint> and <cuda_runtime.h>"
#endif

typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef unsigned long uintptr_t;
static_assert(sizeof(int64_t) == 8 && sizeof(void*) == 8, "the kernels assume an LP64 target");

struct __nv_bfloat16 {
  unsigned short x;
};
__device__ __forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f) {
  __nv_bfloat16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
  return r;
}
__device__ __forceinline__ unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
__device__ __forceinline__ float __bfloat162float(__nv_bfloat16 h) {
  return __uint_as_float(static_cast<unsigned int>(h.x) << 16);
}
