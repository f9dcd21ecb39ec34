// Dispatch layout: which ranks and experts each token goes to. Must equal
// `ep_moe.buffer.routing_layout.dispatch_layout` exactly (integer counts, so any summation order does).
#pragma once

#include "common.cuh"

namespace ep_moe {
namespace {

constexpr int kLayoutThreads = 256;
constexpr int kSmemExperts = 8192;  // experts counted in shared memory; beyond, global atomics

__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(LayoutParams p) {
  __shared__ int32_t per_expert[kSmemExperts];
  __shared__ int32_t per_rank[kMaxRanks];
  const bool smem_experts = p.num_experts <= kSmemExperts;
  if (smem_experts)
    for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) per_expert[e] = 0;
  if (threadIdx.x < kMaxRanks) per_rank[threadIdx.x] = 0;
  __syncthreads();

  const int experts_per_rank = p.num_experts / p.num_ranks;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t mask = 0;
  if (t < p.num_tokens) {
    const int64_t* row = p.topk_idx + static_cast<int64_t>(t) * p.num_topk;
    for (int k = 0; k < p.num_topk; ++k) {
      const int64_t e = row[k];
      if (e < 0 || e >= p.num_experts) continue;  // -1 = no expert (ids are validated upstream)
      mask |= 1u << (static_cast<int>(e) / experts_per_rank);
      if (smem_experts) atomicAdd(&per_expert[e], 1);
      else atomicAdd(&p.num_tokens_per_expert[e], 1);
    }
    bool* in_rank = p.is_token_in_rank + static_cast<int64_t>(t) * p.num_ranks;
    for (int r = 0; r < p.num_ranks; ++r) in_rank[r] = (mask >> r) & 1u;
  }
  // Warp-aggregated per-rank counts.
  const int lane = threadIdx.x & 31;
  for (int r = 0; r < p.num_ranks; ++r) {
    const int n = __popc(__ballot_sync(0xffffffffu, (mask >> r) & 1u));
    if (lane == 0 && n) atomicAdd(&per_rank[r], n);
  }
  __syncthreads();
  if (smem_experts)
    for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x)
      if (per_expert[e]) atomicAdd(&p.num_tokens_per_expert[e], per_expert[e]);
  if (threadIdx.x < p.num_ranks && per_rank[threadIdx.x])
    atomicAdd(&p.num_tokens_per_rank[threadIdx.x], per_rank[threadIdx.x]);
}

}  // namespace

}  // namespace ep_moe
