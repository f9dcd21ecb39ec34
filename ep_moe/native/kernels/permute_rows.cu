// out[s] = x[pair_of_slot[s] / K] (the row's bytes), zero for a padding slot (pair outside [0, P)); with
// EP_VALUES, slot_values[s] = values[pair] (0 for padding). One warp per slot, 8 per block.
// Specialization: EP_WORD_BYTES (16/4/2/1: the widest word dividing the row bytes and both row pointers),
// EP_ROW_WORDS (row bytes / word bytes), EP_TOPK (K), EP_VALUES (0/1). A compile-time row width lets each lane
// issue its loads in batches ahead of their stores (two words per batch: the fastest of 2-16 on an H200, see
// docs/native.md).
#include "ep_jit.cuh"

#if !defined(EP_WORD_BYTES) || !defined(EP_ROW_WORDS) || !defined(EP_TOPK) || !defined(EP_VALUES)
#error "permute_rows.cu needs EP_WORD_BYTES, EP_ROW_WORDS, EP_TOPK and EP_VALUES"
#endif

namespace {
using namespace ep_jit;
typedef WordOf<EP_WORD_BYTES>::type Word;
constexpr i64 kWords = EP_ROW_WORDS;
constexpr int kTopk = EP_TOPK;
constexpr int kRowsPerBlock = 8;
constexpr int kPerLane = static_cast<int>((kWords + kWarp - 1) / kWarp);
constexpr int kBatch = kPerLane < 2 ? 1 : 2;  // words per lane loaded before they are stored
}  // namespace

extern "C" __global__ void __launch_bounds__(256)
ep_permute_rows(const Word* __restrict__ x, Word* __restrict__ out, const i64* __restrict__ pair_of_slot,
                i64 num_slots, i64 num_pairs, const float* __restrict__ values, float* __restrict__ slot_values) {
  const i64 s = static_cast<i64>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (s >= num_slots) return;
  const int lane = threadIdx.x % kWarp;
  const i64 pair = pair_of_slot[s];
  const bool valid = pair >= 0 && pair < num_pairs;
  Word* dst = out + s * kWords;
  if (valid) {
    const Word* src = x + (pair / kTopk) * kWords;
#pragma unroll 1
    for (int b = 0; b < kPerLane; b += kBatch) {
      Word buf[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const i64 j = lane + static_cast<i64>(b + i) * kWarp;
        if (j < kWords) buf[i] = src[j];
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const i64 j = lane + static_cast<i64>(b + i) * kWarp;
        if (j < kWords) dst[j] = buf[i];
      }
    }
  } else {
    const Word zero{};
    for (i64 j = lane; j < kWords; j += kWarp) dst[j] = zero;
  }
  if (EP_VALUES && lane == 0) slot_values[s] = valid ? values[pair] : 0.0f;
}
