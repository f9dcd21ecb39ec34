// The expert-major layout of P = N * K (row, k) pairs over L experts (ep_moe.permute's contract): count pairs per
// expert (per block, then exclusive offsets across blocks), each expert's aligned size and first slot, place every
// pair in its slot (stable: by expert, then flat pair index), and sort each row's slots. Four kernels, launched in
// this order by ep_moe/native/jit/expert_major.py: ep_expert_count (num_blocks x 256), ep_expert_scan (1 x 1024),
// then (after the caller knows M) ep_expert_assign (num_blocks x 256; it also writes the padding slots, so
// pair_of_slot needs no fill) and ep_expert_sort_rows (one thread per row).
// Block b of the count and assign kernels takes pairs [b * pairs_per_block, ...), a multiple of 256.
// Specialization: EP_EXPERTS (L <= 1024: the shared-memory counters are sized to it), EP_TOPK (K), and optionally
// EP_CAPACITY (C > 0: every expert owns exactly C slots, from e * C, and its pairs past C have none; alignment 1).
#include "ep_jit.cuh"

#if !defined(EP_EXPERTS) || !defined(EP_TOPK)
#error "expert_layout.cu needs EP_EXPERTS and EP_TOPK"
#endif
#ifndef EP_CAPACITY
#define EP_CAPACITY 0
#endif

namespace {
using namespace ep_jit;
constexpr int kExperts = EP_EXPERTS;
constexpr int kTopk = EP_TOPK;
constexpr i64 kCapacity = EP_CAPACITY;
constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / kWarp;
static_assert(kExperts >= 1 && kExperts <= 1024, "EP_EXPERTS must be in [1, 1024]");

// The expert of pair i of this block's run (-1: past the run, or not a pair).
__device__ __forceinline__ int expert_of(const i64* topk_idx, i64 i, i64 end) {
  if (i >= end) return -1;
  const i64 e = topk_idx[i];
  return (e >= 0 && e < kExperts) ? static_cast<int>(e) : -1;
}
}  // namespace

#define EP_LAYOUT_PARAMS                                                                                       \
  const i64 *__restrict__ topk_idx, i64 num_pairs, i64 alignment, i64 num_slots, int num_blocks,             \
      i64 pairs_per_block, int *__restrict__ block_counts, i64 *__restrict__ first_slot,                      \
      i64 *__restrict__ tokens_per_expert, i64 *__restrict__ pairs_per_expert, i64 *__restrict__ pair_of_slot, \
      i64 *__restrict__ slot_of_pair, i64 *__restrict__ sorted_slots

// Per block: pairs per expert over its run (warp-aggregated shared-memory counters).
extern "C" __global__ void __launch_bounds__(kTileThreads) ep_expert_count(EP_LAYOUT_PARAMS) {
  __shared__ int count[kExperts];
  for (int e = threadIdx.x; e < kExperts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x % kWarp;
  const i64 begin = static_cast<i64>(blockIdx.x) * pairs_per_block;
  const i64 end = begin + pairs_per_block < num_pairs ? begin + pairs_per_block : num_pairs;
  for (i64 base = begin; base < end; base += kTileThreads) {  // uniform over the block
    const int e = expert_of(topk_idx, base + threadIdx.x, end);
    const unsigned peers = __match_any_sync(kFull, e);
    if (e >= 0 && lane == __ffs(peers) - 1) atomicAdd(&count[e], __popc(peers));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kExperts; e += blockDim.x)
    block_counts[static_cast<i64>(blockIdx.x) * kExperts + e] = count[e];
}

// One block of 1024: block counts -> exclusive offsets per expert (one warp per expert), the experts' totals and
// aligned sizes, and each expert's first slot (an exclusive scan over experts, in warp 0).
extern "C" __global__ void __launch_bounds__(1024) ep_expert_scan(EP_LAYOUT_PARAMS) {
  __shared__ i64 padded[kExperts];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, num_warps = blockDim.x / kWarp;
  for (int e = warp; e < kExperts; e += num_warps) {
    int carry = 0;
    for (int b0 = 0; b0 < num_blocks; b0 += kWarp) {
      const int b = b0 + lane;
      int* at = block_counts + static_cast<i64>(b) * kExperts + e;
      const int c = b < num_blocks ? *at : 0;
      const int inclusive = warp_inclusive_scan(c);
      if (b < num_blocks) *at = carry + inclusive - c;
      carry += __shfl_sync(kFull, inclusive, kWarp - 1);
    }
    if (lane == 0) {
      const i64 aligned = kCapacity > 0 ? kCapacity : (carry + alignment - 1) / alignment * alignment;
      pairs_per_expert[e] = kCapacity > 0 && carry > kCapacity ? kCapacity : carry;
      tokens_per_expert[e] = aligned;
      padded[e] = aligned;
    }
  }
  __syncthreads();
  if (warp != 0) return;
  i64 carry = 0;
  for (int e0 = 0; e0 < kExperts; e0 += kWarp) {
    const int e = e0 + lane;
    const i64 v = e < kExperts ? padded[e] : 0;
    const i64 inclusive = warp_inclusive_scan(v);
    if (e < kExperts) first_slot[e] = carry + inclusive - v;
    carry += __shfl_sync(kFull, inclusive, kWarp - 1);
  }
}

// Whether slot s holds no pair: it lies at or past its expert's pairs (pairs_per_expert, the capacity applied)
// in the expert's group, or past the last group. Its expert is the last e with first_slot[e] <= s (first_slot
// is nondecreasing from 0; an empty expert's group is empty, so a later one holds s).
__device__ __forceinline__ bool is_padding_slot(const i64* first_slot, const i64* pairs_per_expert, i64 s) {
  int lo = 0, hi = kExperts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(first_slot + mid) <= s) lo = mid;
    else hi = mid - 1;
  }
  return s - __ldg(first_slot + lo) >= __ldg(pairs_per_expert + lo);
}

// Per block, its run in order, 256 pairs at a time: a pair's slot is its expert's first slot + the expert's pairs
// in earlier blocks + in earlier sub-tiles of this run + in earlier warps of this sub-tile + in earlier lanes of
// this warp, so the pairs of one expert keep their flat order. A slot at or past num_slots is no slot (-1).
// First, all blocks together (grid-stride), every padding slot gets P: the pairs fill exactly the other slots
// below num_slots (each expert's first pairs_per_expert of its group), so pair_of_slot needs no fill launch.
extern "C" __global__ void __launch_bounds__(kTileThreads) ep_expert_assign(EP_LAYOUT_PARAMS) {
  __shared__ int running[kExperts];
  __shared__ int warp_count[kTileWarps][kExperts];
  const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
  for (i64 s = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; s < num_slots; s += stride)
    if (is_padding_slot(first_slot, pairs_per_expert, s)) pair_of_slot[s] = num_pairs;
  for (int e = threadIdx.x; e < kExperts; e += blockDim.x) {
    running[e] = block_counts[static_cast<i64>(blockIdx.x) * kExperts + e];
#pragma unroll
    for (int w = 0; w < kTileWarps; ++w) warp_count[w][e] = 0;
  }
  __syncthreads();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const unsigned lanes_below = (1u << lane) - 1u;
  const i64 begin = static_cast<i64>(blockIdx.x) * pairs_per_block;
  const i64 end = begin + pairs_per_block < num_pairs ? begin + pairs_per_block : num_pairs;
  for (i64 base = begin; base < end; base += kTileThreads) {  // uniform over the block
    const i64 i = base + threadIdx.x;
    const int e = expert_of(topk_idx, i, end);
    const unsigned peers = __match_any_sync(kFull, e);
    const bool leader = e >= 0 && lane == __ffs(peers) - 1;
    if (leader) warp_count[warp][e] = __popc(peers);
    __syncthreads();
    if (i < end) {
      i64 slot = -1;
      if (e >= 0) {
        i64 before = running[e] + __popc(peers & lanes_below);
        for (int w = 0; w < warp; ++w) before += warp_count[w][e];
        slot = first_slot[e] + before;
        // a bound below the total, or a pair past its expert's capacity: no slot
        if (slot < num_slots && (kCapacity == 0 || before < kCapacity)) pair_of_slot[slot] = i;
        else slot = -1;
      }
      slot_of_pair[i] = slot;
    }
    __syncthreads();
    if (leader) {
      atomicAdd(&running[e], __popc(peers));
      warp_count[warp][e] = 0;
    }
    __syncthreads();
  }
}

// One thread per row: its slots in increasing order, then -1 (the valid slots are distinct, so each one's place
// is the number of valid ones below it).
extern "C" __global__ void __launch_bounds__(256) ep_expert_sort_rows(EP_LAYOUT_PARAMS) {
  const i64 row = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row * kTopk >= num_pairs) return;
  i64 slots[kTopk];
#pragma unroll
  for (int j = 0; j < kTopk; ++j) slots[j] = slot_of_pair[row * kTopk + j];
  i64* sorted = sorted_slots + row * kTopk;
  int valid = 0;
#pragma unroll
  for (int j = 0; j < kTopk; ++j) {
    if (slots[j] < 0) continue;
    int place = 0;
#pragma unroll
    for (int j2 = 0; j2 < kTopk; ++j2) place += (slots[j2] >= 0 && slots[j2] < slots[j]) ? 1 : 0;
    sorted[place] = slots[j];
    ++valid;
  }
  for (int j = valid; j < kTopk; ++j) sorted[j] = -1;
}
