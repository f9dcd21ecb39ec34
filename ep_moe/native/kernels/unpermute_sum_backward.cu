// The gradients of unpermute_sum, slot by slot (r = pair_of_slot[s] / K; zero for a padding slot):
// grad_y[s] = (weights[s] * grad_out[r]).to(dtype) (a copy without weights); grad_weights[s] = <grad_out[r], y[s]>
// in fp32, in a fixed order (per lane over its packs, fused multiply-adds, then a butterfly over the warp).
// One warp per slot, 8 per block. Specialization: EP_DTYPE, EP_VEC, EP_PACKS, EP_TOPK (as unpermute_sum.cu),
// EP_WEIGHTED, EP_GRAD_Y and EP_GRAD_W (0/1).
#include "ep_jit.cuh"

#if !defined(EP_DTYPE) || !defined(EP_VEC) || !defined(EP_PACKS) || !defined(EP_TOPK) || !defined(EP_WEIGHTED) || \
    !defined(EP_GRAD_Y) || !defined(EP_GRAD_W)
#error "unpermute_sum_backward.cu needs EP_DTYPE, EP_VEC, EP_PACKS, EP_TOPK, EP_WEIGHTED, EP_GRAD_Y and EP_GRAD_W"
#endif

namespace {
using namespace ep_jit;
typedef RowType<EP_DTYPE>::type T;
typedef Pack<T, EP_VEC> P;
constexpr int kVec = EP_VEC;
constexpr i64 kPacks = EP_PACKS;
constexpr int kTopk = EP_TOPK;
constexpr int kRowsPerBlock = 8;
}  // namespace

extern "C" __global__ void __launch_bounds__(256)
ep_unpermute_sum_backward(const P* __restrict__ grad_out, const P* __restrict__ y, const float* __restrict__ weights,
                          const i64* __restrict__ pair_of_slot, i64 num_slots, i64 num_pairs, P* __restrict__ grad_y,
                          float* __restrict__ grad_weights) {
  const i64 s = static_cast<i64>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (s >= num_slots) return;
  const int lane = threadIdx.x % kWarp;
  const i64 pair = pair_of_slot[s];
  const bool valid = pair >= 0 && pair < num_pairs;
  const P* grad = grad_out + (valid ? pair / kTopk : 0) * kPacks;
  const float w = (EP_WEIGHTED && valid) ? weights[s] : 1.0f;
  float dot = 0.0f;
  for (i64 c = lane; c < kPacks; c += kWarp) {
    P g;
    if (valid) {
      g = grad[c];
    } else {
#pragma unroll
      for (int v = 0; v < kVec; ++v) g.v[v] = from_f32<T>(0.0f);
    }
    if (EP_GRAD_Y) {
      if (EP_WEIGHTED && valid) {
        P scaled;
#pragma unroll
        for (int v = 0; v < kVec; ++v) scaled.v[v] = from_f32<T>(__fmul_rn(w, to_f32(g.v[v])));
        grad_y[s * kPacks + c] = scaled;
      } else {
        grad_y[s * kPacks + c] = g;
      }
    }
    if (EP_GRAD_W && valid) {
      const P yv = y[s * kPacks + c];
#pragma unroll
      for (int v = 0; v < kVec; ++v) dot = fmaf(to_f32(g.v[v]), to_f32(yv.v[v]), dot);
    }
  }
  if (!EP_GRAD_W) return;
#pragma unroll
  for (int d = kWarp / 2; d > 0; d /= 2) dot += __shfl_xor_sync(kFull, dot, d);
  if (lane == 0) grad_weights[s] = valid ? dot : 0.0f;
}
