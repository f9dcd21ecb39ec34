// The calibration's stream kernel: a grid-stride loop over n int32 elements, one block of 512 threads per program,
// whose grid (the SM count it runs on) the caller chooses. EP_MODE 0 copies src to dst, 1 reads src (each
// thread's sum lands in dst[thread's global index], so the loads are kept), 2 writes dst[i] = i. Both pointers
// 16-byte aligned: the loop moves int4 vectors, then the last n % 4 elements one by one.
#include "ep_jit.cuh"

#if !defined(EP_MODE) || EP_MODE < 0 || EP_MODE > 2
#error "stream_probe.cu needs EP_MODE 0 (copy), 1 (read) or 2 (write)"
#endif

namespace {
using namespace ep_jit;
constexpr int kThreads = 512;
}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads)
ep_stream(const int* __restrict__ src, int* __restrict__ dst, i64 n) {
  const i64 first = static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x;
  const i64 step = static_cast<i64>(gridDim.x) * kThreads;
  const i64 vectors = n / 4;
  int acc = 0;
  for (i64 v = first; v < vectors; v += step) {
#if EP_MODE == 0
    reinterpret_cast<int4*>(dst)[v] = reinterpret_cast<const int4*>(src)[v];
#elif EP_MODE == 1
    const int4 w = reinterpret_cast<const int4*>(src)[v];
    acc += w.x + w.y + w.z + w.w;
#else
    const int i = static_cast<int>(4 * v);
    reinterpret_cast<int4*>(dst)[v] = make_int4(i, i + 1, i + 2, i + 3);
#endif
  }
  for (i64 i = 4 * vectors + first; i < n; i += step) {
#if EP_MODE == 0
    dst[i] = src[i];
#elif EP_MODE == 1
    acc += src[i];
#else
    dst[i] = static_cast<int>(i);
#endif
  }
#if EP_MODE == 1
  dst[first] = acc;
#endif
}
