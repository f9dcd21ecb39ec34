// The generic expert-major kernels (ep_moe/native/jit/expert_major_exchange.py launches them): the permute of rows
// into per-expert slots (received rows left in place included), the (weighted) reduce of slots back to rows (an
// expert-major combine's own rows included), and dense routing to top-k form and back. Bit for bit the torch
// definitions of ep_moe/permute.py and ep_moe/integrations/megatron.py (copies, and fp32 sums in a stated order
// without fused multiply-adds).
#pragma once

#ifndef __CUDACC_RTC__  // NVRTC: rtc_prelude.h (through expert_major.h) has the bf16 conversions used here
#include <cuda_bf16.h>
#endif

#include "expert_major.h"

namespace ep_moe {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kRowThreads = 256;  // row kernels: one warp per row or slot, 8 per block
constexpr int kRowsPerBlock = kRowThreads / kWarp;

// ------------------------------------------------------------------------------------------ rows
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  using Elem = T;
  static constexpr int kVec = VEC;
  T v[VEC];
};

// The slot kernels' unit of work: one warp per slot (s past M: nothing to do); its pair, and whether it is one
// (a padding slot's entry lies outside [0, P)).
struct WarpSlot {
  int64_t slot, pair;
  bool valid;
};
__device__ __forceinline__ WarpSlot warp_slot(const int64_t* pair_of_slot, int64_t num_slots, int64_t num_pairs) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (s >= num_slots) return {s, -1, false};
  const int64_t pair = pair_of_slot[s];
  return {s, pair, pair >= 0 && pair < num_pairs};
}

template <typename Word>
__global__ void __launch_bounds__(kRowThreads) permute_rows_kernel(PermuteRowsParams p) {
  const auto [s, pair, valid] = warp_slot(p.pair_of_slot, p.num_slots, p.num_pairs);
  if (s >= p.num_slots) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(Word));
  Word* dst = reinterpret_cast<Word*>(p.out) + s * words;
  if (valid) {
    const int64_t row = pair / p.num_topk;
    const Word* src = reinterpret_cast<const Word*>(p.x) + row * words;
    if (p.own_x != nullptr) {  // two sources: this rank's own rows come from its input
      const int r = p.rank, R = p.num_ranks;
      const int64_t first = r > 0 ? __ldg(p.rank_prefix_matrix + (r - 1) * R + r) : 0;
      const int64_t end = __ldg(p.rank_prefix_matrix + r * R + r);
      // Bounded by T as well: after a dispatch that moved nothing (a capacity or agreement error, raised at the
      // next host wait) the prefix matrix and top-k may be garbage, and a read must still stay in range.
      if (row >= first && row < end && row - first < p.num_own_rows) {
        const int64_t t = __ldg(p.own_tokens + (row - first));
        if (t >= 0 && t < p.num_own_rows) src = reinterpret_cast<const Word*>(p.own_x) + t * words;
      }
    }
    for (int64_t j = lane; j < words; j += kWarp) dst[j] = src[j];
  } else {
    const Word zero{};
    for (int64_t j = lane; j < words; j += kWarp) dst[j] = zero;
  }
  if (p.slot_values != nullptr && lane == 0) p.slot_values[s] = valid ? p.values[pair] : 0.0f;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads) unpermute_sum_kernel(UnpermuteSumParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= p.num_rows) return;
  if (p.rank_prefix_matrix != nullptr) {  // own rows only
    const int r = p.rank, R = p.num_ranks;
    const int64_t first = r > 0 ? __ldg(p.rank_prefix_matrix + (r - 1) * R + r) : 0;
    if (row < first || row >= __ldg(p.rank_prefix_matrix + r * R + r)) return;
  }
  const int K = p.num_topk;
  const int64_t* slots = p.sorted_slots + row * K;
  const int64_t packs = p.hidden / VEC;
  const Pack<T, VEC>* y = reinterpret_cast<const Pack<T, VEC>*>(p.y);
  Pack<T, VEC>* out = reinterpret_cast<Pack<T, VEC>*>(p.out) + row * packs;
  for (int64_t c = lane; c < packs; c += kWarp) {
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
    for (int j = 0; j < K; ++j) {
      const int64_t s = __ldg(slots + j);
      if (s < 0 || s >= p.num_slots) continue;
      const Pack<T, VEC> term = y[s * packs + c];
      if (p.weights != nullptr) {
        const float w = __ldg(p.weights + s);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], __fmul_rn(w, to_f32(term.v[v])));
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], to_f32(term.v[v]));
      }
    }
    Pack<T, VEC> result;
#pragma unroll
    for (int v = 0; v < VEC; ++v) result.v[v] = from_f32<T>(acc[v]);
    out[c] = result;
  }
  if (p.slot_values != nullptr)
    for (int k = lane; k < K; k += kWarp) {
      const int64_t s = p.slot_of_pair[row * K + k];
      p.pair_values[row * K + k] = (s >= 0 && s < p.num_slots) ? p.slot_values[s] : 0.0f;
    }
}

template <typename T>
__global__ void routing_map_to_topk_kernel(RoutingMapParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.num_tokens) return;
  const bool* selected = p.routing_map + t * p.num_experts;
  const T* probs = static_cast<const T*>(p.probs) + t * p.num_experts;
  int64_t* idx = p.topk_idx + t * p.num_topk;
  float* weights = p.topk_weights + t * p.num_topk;
  int k = 0;
  for (int e = 0; e < p.num_experts && k < p.num_topk; ++e)
    if (selected[e]) {
      idx[k] = e;
      weights[k] = to_f32(probs[e]);
      ++k;
    }
  for (; k < p.num_topk; ++k) {
    idx[k] = -1;
    weights[k] = 0.0f;
  }
}

template <typename T>
__global__ void routing_map_to_topk_backward_kernel(RoutingMapParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.num_tokens) return;
  T* grad = static_cast<T*>(p.grad_probs) + t * p.num_experts;
  for (int e = 0; e < p.num_experts; ++e) grad[e] = from_f32<T>(0.0f);
  for (int k = 0; k < p.num_topk; ++k) {
    const int64_t e = p.topk_idx[t * p.num_topk + k];
    // 0 + g: what a scatter-add into zeros gives (a -0 gradient becomes +0)
    if (e >= 0 && e < p.num_experts) grad[e] = from_f32<T>(__fadd_rn(0.0f, p.topk_weights[t * p.num_topk + k]));
  }
}

}  // namespace

}  // namespace ep_moe
