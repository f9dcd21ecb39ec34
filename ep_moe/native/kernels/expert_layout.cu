// The expert-major layout of P = N * K (row, k) pairs over L experts (ep_moe.permute's contract): count pairs per
// expert (per block, then exclusive offsets across blocks), each expert's aligned size and first slot, place every
// pair in its slot (stable: by expert, then flat pair index), and sort each row's slots.
//
// Two ways to run it, the same device code (the phase functions below) and the same outputs bit for bit:
// * ep_expert_layout, one COOPERATIVE launch of num_blocks x 256 (cuLaunchCooperativeKernel: every block is
//   resident at once, so its grid barriers cannot deadlock) doing count -> barrier -> scan -> barrier -> assign
//   (with the padding fill) -> barrier -> sort; `phase` picks kPhaseCount (count and scan), kPhasePlace (assign
//   and sort) or both (kPhaseAll). The exact size launches it twice (the host reads the aligned counts between).
// * four plain launches, in this order (the GPU tests check the cooperative kernel against them): ep_expert_count
//   (num_blocks x 256), ep_expert_scan (1 x 1024), ep_expert_assign (num_blocks x 256) and ep_expert_sort_rows
//   (one thread per row).
// Block b of the count and assign phases takes pairs [b * pairs_per_block, ...), a multiple of 256; the assign
// phase also writes every padding slot (P), so pair_of_slot needs no fill; with P = 0 the phases still write
// every output (the counts, the aligned sizes, the padding).
// Specialization: EP_EXPERTS (L <= 1024: the shared-memory counters are sized to it) and EP_TOPK (K). The
// capacity is a run-time argument (C > 0: every expert owns exactly C slots, from e * C, and its pairs past C have
// none; alignment 1; 0: none).
#include "ep_jit.cuh"

#if !defined(EP_EXPERTS) || !defined(EP_TOPK)
#error "expert_layout.cu needs EP_EXPERTS and EP_TOPK"
#endif

namespace {
using namespace ep_jit;
constexpr int kExperts = EP_EXPERTS;
constexpr int kTopk = EP_TOPK;
constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / kWarp;
constexpr int kExpertsPerThread = (kExperts + kTileThreads - 1) / kTileThreads;
static_assert(kExperts >= 1 && kExperts <= 1024, "EP_EXPERTS must be in [1, 1024]");
static_assert(kTopk >= 1, "EP_TOPK must be >= 1");

// ep_expert_layout's `phase` (bits): count and scan, assign and sort.
constexpr int kPhaseCount = 1;
constexpr int kPhasePlace = 2;
// A grid barrier that waits longer than this traps (a launch failure at the next synchronization) instead of
// hanging: with every block resident, only a bug can make it wait at all this long.
constexpr u64 kBarrierTimeoutNs = 20ull * 1000 * 1000 * 1000;

// The kernels' arguments (every kernel takes the same list; the four plain ones ignore `barrier` and `phase`).
struct LayoutArgs {
  const i64* __restrict__ topk_idx;
  i64 num_pairs, alignment, num_slots, capacity;
  int num_blocks;
  i64 pairs_per_block;
  int* __restrict__ block_counts;  // [num_blocks, L]: a block's pairs per expert, then their exclusive offsets
  i64* __restrict__ tokens_per_expert;
  i64* __restrict__ pairs_per_expert;
  i64* __restrict__ pair_of_slot;
  i64* __restrict__ slot_of_pair;
  i64* __restrict__ sorted_slots;
};

// A 256-thread block's shared memory in the assign phase (the count phase uses `running`).
struct AssignShared {
  i64 first_slot[kExperts];
  i64 warp_sum[kTileWarps];
  int running[kExperts];
  int warp_count[kTileWarps][kExperts];
};

// The expert of pair i of a block's run (-1: past the run, or not a pair).
__device__ __forceinline__ int expert_of(const i64* topk_idx, i64 i, i64 end) {
  if (i >= end) return -1;
  const i64 e = topk_idx[i];
  return (e >= 0 && e < kExperts) ? static_cast<int>(e) : -1;
}

__device__ __forceinline__ i64 run_end(const LayoutArgs& a, i64 begin) {
  return begin + a.pairs_per_block < a.num_pairs ? begin + a.pairs_per_block : a.num_pairs;
}

__device__ __forceinline__ u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Every block of a cooperative launch meets here; what any block wrote before it, every block reads after it.
// barrier[0] counts arrivals, barrier[1] is the generation (two words of the call's own workspace, zeroed before
// the launch): the last block to arrive resets the count and advances the generation, which the others poll.
__device__ __forceinline__ void grid_barrier(unsigned* barrier) {
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned* generation = barrier + 1;
    const unsigned seen = *generation;
    __threadfence();  // this block's writes (and the read of `seen`) before its arrival
    if (atomicAdd(barrier, 1u) == gridDim.x - 1) {
      atomicExch(barrier, 0u);
      __threadfence();
      atomicAdd(barrier + 1, 1u);
    } else {
      const u64 start = global_timer_ns();
      while (*generation == seen) {
        asm volatile("nanosleep.u32 64;");  // PTX, as the timer read: no toolkit header under NVRTC
        if (global_timer_ns() - start > kBarrierTimeoutNs) asm volatile("trap;");
      }
    }
    __threadfence();  // the other blocks' writes before this block's reads
  }
  __syncthreads();
}

// ------------------------------------------------------------------------------------------ phases
// Count: pairs per expert over block `block`'s run (warp-aggregated shared-memory counters) -> block_counts[block].
__device__ __forceinline__ void count_run(const LayoutArgs& a, int block, int* count) {
  for (int e = threadIdx.x; e < kExperts; e += kTileThreads) count[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x % kWarp;
  const i64 begin = static_cast<i64>(block) * a.pairs_per_block;
  const i64 end = run_end(a, begin);
  for (i64 base = begin; base < end; base += kTileThreads) {  // uniform over the block
    const int e = expert_of(a.topk_idx, base + threadIdx.x, end);
    const unsigned peers = __match_any_sync(kFull, e);
    if (e >= 0 && lane == __ffs(peers) - 1) atomicAdd(&count[e], __popc(peers));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kExperts; e += kTileThreads)
    a.block_counts[static_cast<i64>(block) * kExperts + e] = count[e];
}

// Scan, thread `thread` of `threads` (a multiple of 32, over every block taking part): each expert's block counts
// become exclusive offsets (in place), and its pairs (the capacity applied) and aligned size are written. Lanes
// work in groups of G, the smallest power of two >= num_blocks (at most 32), one expert per group at a time (a
// segmented warp scan): every thread makes about L * G / threads * ceil(num_blocks / G) steps, at most about 8
// when the threads are 256 per block, whatever the block count.
__device__ __forceinline__ void scan_experts(const LayoutArgs& a, int thread, int threads) {
  int group = 1;
  while (group < a.num_blocks && group < kWarp) group *= 2;
  const int lane = threadIdx.x % kWarp, sub = lane % group;
  const int groups_per_warp = kWarp / group;
  const int step = threads / kWarp * groups_per_warp;
  for (int e0 = thread / kWarp * groups_per_warp; e0 < kExperts; e0 += step) {  // uniform over the warp
    const int e = e0 + lane / group;
    int carry = 0;
    for (int b0 = 0; b0 < a.num_blocks; b0 += group) {  // uniform over the warp
      const int b = b0 + sub;
      const bool mine = e < kExperts && b < a.num_blocks;
      int* at = a.block_counts + static_cast<i64>(b) * kExperts + e;
      const int c = mine ? __ldcg(at) : 0;  // L2: written by other blocks of this launch
      int inclusive = c;
      for (int d = 1; d < group; d *= 2) {
        const int u = __shfl_up_sync(kFull, inclusive, d, group);
        if (sub >= d) inclusive += u;
      }
      if (mine) *at = carry + inclusive - c;
      carry += __shfl_sync(kFull, inclusive, group - 1, group);
    }
    if (e < kExperts && sub == 0) {
      const i64 capacity = a.capacity;
      const i64 aligned = capacity > 0 ? capacity : (carry + a.alignment - 1) / a.alignment * a.alignment;
      a.pairs_per_expert[e] = capacity > 0 && carry > capacity ? capacity : carry;
      a.tokens_per_expert[e] = aligned;
    }
  }
}

// Each expert's first slot, the exclusive sum of the aligned sizes before it, into shared memory (256 threads,
// each a run of consecutive experts). Every block of the assign phase computes it for itself.
__device__ __forceinline__ void first_slots(const LayoutArgs& a, AssignShared& s) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int begin = threadIdx.x * kExpertsPerThread;
  i64 size[kExpertsPerThread];
  i64 total = 0;
#pragma unroll
  for (int j = 0; j < kExpertsPerThread; ++j) {
    size[j] = begin + j < kExperts ? __ldcg(a.tokens_per_expert + begin + j) : 0;
    total += size[j];
  }
  const i64 inclusive = warp_inclusive_scan(total);
  if (lane == kWarp - 1) s.warp_sum[warp] = inclusive;
  __syncthreads();
  i64 before = inclusive - total;
  for (int w = 0; w < warp; ++w) before += s.warp_sum[w];
#pragma unroll
  for (int j = 0; j < kExpertsPerThread; ++j) {
    if (begin + j < kExperts) s.first_slot[begin + j] = before;
    before += size[j];
  }
  __syncthreads();
}

// Whether slot s holds no pair: it lies at or past its expert's pairs (pairs_per_expert, the capacity applied)
// in the expert's group, or past the last group. Its expert is the last e with first_slot[e] <= s (first_slot
// is nondecreasing from 0; an empty expert's group is empty, so a later one holds s).
__device__ __forceinline__ bool is_padding_slot(const LayoutArgs& a, const i64* first_slot, i64 s) {
  int lo = 0, hi = kExperts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_slot[mid] <= s) lo = mid;
    else hi = mid - 1;
  }
  return s - first_slot[lo] >= __ldcg(a.pairs_per_expert + lo);
}

// Assign (after first_slots): first, all blocks together (grid-stride), every padding slot gets P: the pairs fill
// exactly the other slots below num_slots (each expert's first pairs_per_expert of its group), so pair_of_slot
// needs no fill. Then block `block`'s run in order, 256 pairs at a time: a pair's slot is its expert's first slot
// + the expert's pairs in earlier blocks + in earlier sub-tiles of this run + in earlier warps of this sub-tile + in
// earlier lanes of this warp, so the pairs of one expert keep their flat order. A slot at or past num_slots, or a
// pair past its expert's capacity, is no slot (-1).
__device__ __forceinline__ void assign_run(const LayoutArgs& a, int block, AssignShared& s) {
  const i64 stride = static_cast<i64>(gridDim.x) * kTileThreads;
  for (i64 slot = static_cast<i64>(blockIdx.x) * kTileThreads + threadIdx.x; slot < a.num_slots; slot += stride)
    if (is_padding_slot(a, s.first_slot, slot)) a.pair_of_slot[slot] = a.num_pairs;
  for (int e = threadIdx.x; e < kExperts; e += kTileThreads) {
    s.running[e] = __ldcg(a.block_counts + static_cast<i64>(block) * kExperts + e);
#pragma unroll
    for (int w = 0; w < kTileWarps; ++w) s.warp_count[w][e] = 0;
  }
  __syncthreads();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const unsigned lanes_below = (1u << lane) - 1u;
  const i64 begin = static_cast<i64>(block) * a.pairs_per_block;
  const i64 end = run_end(a, begin);
  for (i64 base = begin; base < end; base += kTileThreads) {  // uniform over the block
    const i64 i = base + threadIdx.x;
    const int e = expert_of(a.topk_idx, i, end);
    const unsigned peers = __match_any_sync(kFull, e);
    const bool leader = e >= 0 && lane == __ffs(peers) - 1;
    if (leader) s.warp_count[warp][e] = __popc(peers);
    __syncthreads();
    if (i < end) {
      i64 slot = -1;
      if (e >= 0) {
        i64 before = s.running[e] + __popc(peers & lanes_below);
        for (int w = 0; w < warp; ++w) before += s.warp_count[w][e];
        slot = s.first_slot[e] + before;
        if (slot < a.num_slots && (a.capacity == 0 || before < a.capacity)) a.pair_of_slot[slot] = i;
        else slot = -1;
      }
      a.slot_of_pair[i] = slot;
    }
    __syncthreads();
    if (leader) {
      atomicAdd(&s.running[e], __popc(peers));
      s.warp_count[warp][e] = 0;
    }
    __syncthreads();
  }
}

// Sort, thread `thread` of `threads` (grid-stride over rows): a row's slots in increasing order, then -1 (the
// valid slots are distinct, so each one's place is the number of valid ones below it).
__device__ __forceinline__ void sort_rows(const LayoutArgs& a, i64 thread, i64 threads) {
  const i64 num_rows = a.num_pairs / kTopk;
  for (i64 row = thread; row < num_rows; row += threads) {
    i64 slots[kTopk];
#pragma unroll
    for (int j = 0; j < kTopk; ++j) slots[j] = __ldcg(a.slot_of_pair + row * kTopk + j);
    i64* sorted = a.sorted_slots + row * kTopk;
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
}
}  // namespace

#define EP_LAYOUT_PARAMS                                                                                         \
  const i64 *__restrict__ topk_idx, i64 num_pairs, i64 alignment, i64 num_slots, i64 capacity, int num_blocks, \
      i64 pairs_per_block, int *__restrict__ block_counts, i64 *__restrict__ tokens_per_expert,                 \
      i64 *__restrict__ pairs_per_expert, i64 *__restrict__ pair_of_slot, i64 *__restrict__ slot_of_pair,       \
      i64 *__restrict__ sorted_slots, unsigned *barrier, int phase
#define EP_LAYOUT_ARGS                                                                                         \
  LayoutArgs {                                                                                                 \
    topk_idx, num_pairs, alignment, num_slots, capacity, num_blocks, pairs_per_block, block_counts,            \
        tokens_per_expert, pairs_per_expert, pair_of_slot, slot_of_pair, sorted_slots                          \
  }

// The whole layout in one cooperative launch of num_blocks x 256 (gridDim.x == num_blocks), or half of it (phase).
extern "C" __global__ void __launch_bounds__(kTileThreads, 2) ep_expert_layout(EP_LAYOUT_PARAMS) {
  __shared__ AssignShared s;
  const LayoutArgs a = EP_LAYOUT_ARGS;
  const int thread = blockIdx.x * kTileThreads + threadIdx.x, threads = gridDim.x * kTileThreads;
  if (phase & kPhaseCount) {
    count_run(a, blockIdx.x, s.running);
    grid_barrier(barrier);
    scan_experts(a, thread, threads);
    if (!(phase & kPhasePlace)) return;  // the same for every block
    grid_barrier(barrier);
  }
  first_slots(a, s);
  assign_run(a, blockIdx.x, s);
  grid_barrier(barrier);
  sort_rows(a, thread, threads);
}

// The four plain kernels (the same phases, one launch each).
extern "C" __global__ void __launch_bounds__(kTileThreads) ep_expert_count(EP_LAYOUT_PARAMS) {
  __shared__ int count[kExperts];
  count_run(EP_LAYOUT_ARGS, blockIdx.x, count);
}

extern "C" __global__ void __launch_bounds__(1024) ep_expert_scan(EP_LAYOUT_PARAMS) {
  scan_experts(EP_LAYOUT_ARGS, threadIdx.x, blockDim.x);
}

extern "C" __global__ void __launch_bounds__(kTileThreads) ep_expert_assign(EP_LAYOUT_PARAMS) {
  __shared__ AssignShared s;
  const LayoutArgs a = EP_LAYOUT_ARGS;
  first_slots(a, s);
  assign_run(a, blockIdx.x, s);
}

extern "C" __global__ void __launch_bounds__(256) ep_expert_sort_rows(EP_LAYOUT_PARAMS) {
  sort_rows(EP_LAYOUT_ARGS, static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x,
            static_cast<i64>(gridDim.x) * blockDim.x);
}
