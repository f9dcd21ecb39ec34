// Local expert-major kernels: the layout of (row, k) pairs in per-expert slots, the permute of rows into
// slots, and the (weighted) reduce of slots back to rows with its gradients. Bit for bit the torch
// definitions of ep_moe/permute.py (integers, copies, and fp32 sums in a stated order without fused
// multiply-adds); the weights' gradient is a dot product in a fixed order of its own.
#ifndef __CUDACC_RTC__  // NVRTC: rtc_prelude.h (through expert_major.h) has the bf16 conversions used here
#include <cuda_bf16.h>

#include <initializer_list>
#include <type_traits>
#endif

#include "expert_major.h"

namespace ep_moe {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kTileWarps = kLayoutTileThreads / kWarp;
constexpr int kRowThreads = 256;  // row kernels: one warp per row or slot, 8 per block
constexpr int kRowsPerBlock = kRowThreads / kWarp;

// ------------------------------------------------------------------------------------------ layout
// The expert of pair i of this block's run (-1: past the run, or not a pair).
__device__ __forceinline__ int expert_of(const ExpertLayoutParams& p, int64_t i, int64_t end) {
  if (i >= end) return -1;
  const int64_t e = p.topk_idx[i];
  return (e >= 0 && e < p.num_experts) ? static_cast<int>(e) : -1;
}

__device__ __forceinline__ int64_t run_begin(const ExpertLayoutParams& p) {
  return static_cast<int64_t>(blockIdx.x) * p.pairs_per_block;
}
__device__ __forceinline__ int64_t run_end(const ExpertLayoutParams& p) {
  const int64_t end = run_begin(p) + p.pairs_per_block;
  return end < p.num_pairs ? end : p.num_pairs;
}

// Per block: pairs per expert over its run (warp-aggregated shared-memory counters).
__global__ void __launch_bounds__(kLayoutTileThreads) expert_count_kernel(ExpertLayoutParams p) {
  __shared__ int32_t count[kMaxLayoutExperts];
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x % kWarp;
  const int64_t end = run_end(p);
  for (int64_t base = run_begin(p); base < end; base += kLayoutTileThreads) {  // uniform over the block
    const int e = expert_of(p, base + threadIdx.x, end);
    const unsigned peers = __match_any_sync(kFull, e);
    if (e >= 0 && lane == __ffs(peers) - 1) atomicAdd(&count[e], __popc(peers));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x)
    p.block_counts[static_cast<int64_t>(blockIdx.x) * p.num_experts + e] = count[e];
}

template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x % kWarp;
  for (int d = 1; d < kWarp; d *= 2) {
    const T u = __shfl_up_sync(kFull, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// One block: block counts -> exclusive offsets per expert (one warp per expert), the experts' totals and
// aligned sizes, and each expert's first slot (an exclusive scan over experts, in warp 0).
__global__ void __launch_bounds__(1024) expert_scan_kernel(ExpertLayoutParams p) {
  __shared__ int64_t padded[kMaxLayoutExperts];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, num_warps = blockDim.x / kWarp;
  const int L = p.num_experts;
  for (int e = warp; e < L; e += num_warps) {
    int32_t carry = 0;
    for (int b0 = 0; b0 < p.num_blocks; b0 += kWarp) {
      const int b = b0 + lane;
      int32_t* at = p.block_counts + static_cast<int64_t>(b) * L + e;
      const int32_t c = b < p.num_blocks ? *at : 0;
      const int32_t inclusive = warp_inclusive_scan(c);
      if (b < p.num_blocks) *at = carry + inclusive - c;
      carry += __shfl_sync(kFull, inclusive, kWarp - 1);
    }
    if (lane == 0) {
      const int64_t aligned = p.capacity > 0 ? p.capacity : (carry + p.alignment - 1) / p.alignment * p.alignment;
      p.pairs_per_expert[e] = p.capacity > 0 && carry > p.capacity ? p.capacity : carry;
      p.tokens_per_expert[e] = aligned;
      padded[e] = aligned;
    }
  }
  __syncthreads();
  if (warp != 0) return;
  int64_t carry = 0;
  for (int e0 = 0; e0 < L; e0 += kWarp) {
    const int e = e0 + lane;
    const int64_t v = e < L ? padded[e] : 0;
    const int64_t inclusive = warp_inclusive_scan(v);
    if (e < L) p.first_slot[e] = carry + inclusive - v;
    carry += __shfl_sync(kFull, inclusive, kWarp - 1);
  }
}

// Whether slot s holds no pair: it lies at or past its expert's pairs (pairs_per_expert, the capacity applied)
// in the expert's group, or past the last group. Its expert is the last e with first_slot[e] <= s (first_slot
// is nondecreasing from 0; an empty expert's group is empty, so a later one holds s).
__device__ __forceinline__ bool is_padding_slot(const ExpertLayoutParams& p, int64_t s) {
  int lo = 0, hi = p.num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(p.first_slot + mid) <= s) lo = mid;
    else hi = mid - 1;
  }
  return s - __ldg(p.first_slot + lo) >= __ldg(p.pairs_per_expert + lo);
}

// Per block, its run in order, a sub-tile of kLayoutTileThreads pairs at a time: a pair's slot is its
// expert's first slot + the expert's pairs in earlier blocks + in earlier sub-tiles of this run + in earlier
// warps of this sub-tile + in earlier lanes of this warp, so pairs of one expert keep their flat order.
// First, all blocks together (grid-stride), every padding slot gets P: the pairs fill exactly the other slots
// below num_slots (each expert's first pairs_per_expert of its group), so pair_of_slot needs no fill launch.
__global__ void __launch_bounds__(kLayoutTileThreads) expert_assign_kernel(ExpertLayoutParams p) {
  __shared__ int32_t running[kMaxLayoutExperts];
  __shared__ int32_t warp_count[kTileWarps][kMaxLayoutExperts];
  const int L = p.num_experts;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < p.num_slots; s += stride)
    if (is_padding_slot(p, s)) p.pair_of_slot[s] = p.num_pairs;
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    running[e] = p.block_counts[static_cast<int64_t>(blockIdx.x) * L + e];
    for (int w = 0; w < kTileWarps; ++w) warp_count[w][e] = 0;
  }
  __syncthreads();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const unsigned lanes_below = (1u << lane) - 1u;
  const int64_t end = run_end(p);
  for (int64_t base = run_begin(p); base < end; base += kLayoutTileThreads) {  // uniform over the block
    const int64_t i = base + threadIdx.x;
    const int e = expert_of(p, i, end);
    const unsigned peers = __match_any_sync(kFull, e);
    const bool leader = e >= 0 && lane == __ffs(peers) - 1;
    if (leader) warp_count[warp][e] = __popc(peers);
    __syncthreads();
    if (i < end) {
      int64_t slot = -1;
      if (e >= 0) {
        int64_t before = running[e] + __popc(peers & lanes_below);
        for (int w = 0; w < warp; ++w) before += warp_count[w][e];
        slot = p.first_slot[e] + before;
        // a bound below the total, or a pair past its expert's capacity: no slot
        if (slot < p.num_slots && (p.capacity == 0 || before < p.capacity)) p.pair_of_slot[slot] = i;
        else slot = -1;
      }
      p.slot_of_pair[i] = slot;
    }
    __syncthreads();
    if (leader) {
      atomicAdd(&running[e], __popc(peers));
      warp_count[warp][e] = 0;
    }
    __syncthreads();
  }
}

// One thread per row: its slots in increasing order, then -1 (slots are distinct: each valid one's place is
// the number of valid ones below it).
__global__ void expert_sort_rows_kernel(ExpertLayoutParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row * p.num_topk >= p.num_pairs) return;
  const int K = p.num_topk;
  const int64_t* slots = p.slot_of_pair + row * K;
  int64_t* sorted = p.sorted_slots + row * K;
  int valid = 0;
  for (int j = 0; j < K; ++j) {
    const int64_t v = slots[j];
    if (v < 0) continue;
    int place = 0;
    for (int j2 = 0; j2 < K; ++j2) place += (slots[j2] >= 0 && slots[j2] < v) ? 1 : 0;
    sorted[place] = v;
    ++valid;
  }
  for (int j = valid; j < K; ++j) sorted[j] = -1;
}

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

template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads) unpermute_sum_backward_kernel(UnpermuteSumBackwardParams p) {
  const auto [s, pair, valid] = warp_slot(p.pair_of_slot, p.num_slots, p.num_pairs);
  if (s >= p.num_slots) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t packs = p.hidden / VEC;
  const Pack<T, VEC>* grad = reinterpret_cast<const Pack<T, VEC>*>(p.grad_out) + (valid ? pair / p.num_topk : 0) * packs;
  const Pack<T, VEC>* y = reinterpret_cast<const Pack<T, VEC>*>(p.y) + s * packs;
  Pack<T, VEC>* grad_y = p.grad_y == nullptr ? nullptr : reinterpret_cast<Pack<T, VEC>*>(p.grad_y) + s * packs;
  const float w = (p.weights != nullptr && valid) ? p.weights[s] : 1.0f;
  float dot = 0.0f;
  for (int64_t c = lane; c < packs; c += kWarp) {
    Pack<T, VEC> g;
    if (valid) {
      g = grad[c];
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) g.v[v] = from_f32<T>(0.0f);
    }
    if (grad_y != nullptr) {
      if (p.weights != nullptr && valid) {
        Pack<T, VEC> scaled;
#pragma unroll
        for (int v = 0; v < VEC; ++v) scaled.v[v] = from_f32<T>(__fmul_rn(w, to_f32(g.v[v])));
        grad_y[c] = scaled;
      } else {
        grad_y[c] = g;
      }
    }
    if (p.grad_weights != nullptr && valid) {
      const Pack<T, VEC> yv = y[c];
#pragma unroll
      for (int v = 0; v < VEC; ++v) dot = fmaf(to_f32(g.v[v]), to_f32(yv.v[v]), dot);
    }
  }
  if (p.grad_weights == nullptr) return;
  for (int d = kWarp / 2; d > 0; d /= 2) dot += __shfl_xor_sync(kFull, dot, d);
  if (lane == 0) p.grad_weights[s] = valid ? dot : 0.0f;
}

#ifndef __CUDACC_RTC__  // host code: the JIT build (ep_moe/native/jit/expert_major_csrc.py) launches from Python
// The widest of 16/4/2/1-byte words that divides the row bytes and every pointer.
template <typename Launch>
cudaError_t by_word(int64_t row_bytes, const void* a, const void* b, Launch launch, const void* c = nullptr) {
  const auto fits = [&](int64_t w) {
    return row_bytes % w == 0 && reinterpret_cast<uintptr_t>(a) % w == 0 && reinterpret_cast<uintptr_t>(b) % w == 0 &&
           reinterpret_cast<uintptr_t>(c) % w == 0;
  };
  if (fits(16)) return launch(uint4{});
  if (fits(4)) return launch(uint32_t{});
  if (fits(2)) return launch(uint16_t{});
  return launch(uint8_t{});
}

// A 16-byte pack of T when the hidden size and every pointer allow it, else one element.
template <typename T, typename Launch>
cudaError_t by_pack(int64_t hidden, std::initializer_list<const void*> ptrs, Launch launch) {
  constexpr int kVec = 16 / sizeof(T);
  bool wide = hidden % kVec == 0;
  for (const void* ptr : ptrs) wide = wide && (ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0);
  if (wide) return launch(Pack<T, kVec>{});
  return launch(Pack<T, 1>{});
}

#endif  // __CUDACC_RTC__

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

#ifndef __CUDACC_RTC__
// One thread per token, with the kernel of the probs' dtype.
cudaError_t launch_per_token(const RoutingMapParams& p, cudaStream_t stream, void (*bf16_kernel)(RoutingMapParams),
                             void (*fp32_kernel)(RoutingMapParams)) {
  if (p.num_tokens == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((p.num_tokens + 127) / 128);
  (p.probs_dtype == kRowBF16 ? bf16_kernel : fp32_kernel)<<<blocks, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

// by_pack for rows of the given RowDtype.
template <typename Launch>
cudaError_t by_row_type(int dtype, int64_t hidden, std::initializer_list<const void*> ptrs, Launch launch) {
  if (dtype == kRowBF16) return by_pack<__nv_bfloat16>(hidden, ptrs, launch);
  return by_pack<float>(hidden, ptrs, launch);
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__  // the extension's launch functions (expert_major.h)
cudaError_t launch_routing_map_to_topk(const RoutingMapParams& p, cudaStream_t stream) {
  return launch_per_token(p, stream, routing_map_to_topk_kernel<__nv_bfloat16>, routing_map_to_topk_kernel<float>);
}

cudaError_t launch_routing_map_to_topk_backward(const RoutingMapParams& p, cudaStream_t stream) {
  return launch_per_token(p, stream, routing_map_to_topk_backward_kernel<__nv_bfloat16>,
                          routing_map_to_topk_backward_kernel<float>);
}

cudaError_t launch_expert_counts(const ExpertLayoutParams& p, cudaStream_t stream) {
  expert_count_kernel<<<p.num_blocks, kLayoutTileThreads, 0, stream>>>(p);
  expert_scan_kernel<<<1, 1024, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_expert_slots(const ExpertLayoutParams& p, cudaStream_t stream) {
  expert_assign_kernel<<<p.num_blocks, kLayoutTileThreads, 0, stream>>>(p);
  const int64_t rows = p.num_pairs / p.num_topk;
  expert_sort_rows_kernel<<<static_cast<unsigned>((rows + 255) / 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_permute_rows(const PermuteRowsParams& p, cudaStream_t stream) {
  if (p.num_slots == 0) return cudaSuccess;
  return by_word(p.row_bytes, p.x, p.out, [&](auto word) {
    permute_rows_kernel<decltype(word)><<<row_blocks(p.num_slots), kRowThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }, p.own_x);
}

cudaError_t launch_unpermute_sum(const UnpermuteSumParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  return by_row_type(p.dtype, p.hidden, {p.y, p.out}, [&](auto pack) {
    using P = decltype(pack);
    unpermute_sum_kernel<typename P::Elem, P::kVec><<<row_blocks(p.num_rows), kRowThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t launch_unpermute_sum_backward(const UnpermuteSumBackwardParams& p, cudaStream_t stream) {
  if (p.num_slots == 0) return cudaSuccess;
  return by_row_type(p.dtype, p.hidden, {p.grad_out, p.y, p.grad_y}, [&](auto pack) {
    using P = decltype(pack);
    unpermute_sum_backward_kernel<typename P::Elem, P::kVec><<<row_blocks(p.num_slots), kRowThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

#endif  // __CUDACC_RTC__

}  // namespace ep_moe
