// Plain launch functions of the local expert-major kernels (ep_moe.permute's contract; raw pointers and
// sizes, no torch). The torch ops of expert_major_ops.cpp convert tensors into these structs. Every function
// enqueues on `stream` and returns the CUDA error of the launch.
//
// Notation: N rows, K top-k columns, P = N * K pairs (flat index i * K + k), L experts of this rank, A the
// alignment, M slots (expert-major rows), H the row width.
#pragma once

#ifdef __CUDACC_RTC__
#include "rtc_prelude.h"  // NVRTC (the JIT build, jit/kernels/expert_major_csrc.cu) has no toolkit headers
#else
#include <cstdint>
#include <cuda_runtime.h>
#endif

namespace ep_moe {

constexpr int kLayoutTileThreads = 256;   // pairs per sub-tile = threads of a count / assign block
constexpr int kMaxLayoutExperts = 1024;   // experts whose counters fit in those blocks' shared memory
constexpr int kMaxLayoutBlocks = 256;     // count / assign blocks (each takes a run of consecutive pairs)

struct ExpertLayoutParams {
  const int64_t* topk_idx;     // [P]: expert ids in [0, L); anything else is not a pair
  int64_t num_pairs;           // P
  int num_topk;                // K
  int num_experts;             // L <= kMaxLayoutExperts
  int64_t alignment;           // A >= 1
  int64_t capacity;            // C > 0: every expert owns exactly C slots (from e * C), its pairs past C have
                               // none (A is 1 then); 0: each expert's pairs rounded up to A
  int64_t num_slots;           // M (needed by the slots kernels only)
  int num_blocks;              // blocks of the count and assign kernels, <= kMaxLayoutBlocks
  int64_t pairs_per_block;     // a multiple of kLayoutTileThreads; block b takes pairs [b * this, ...)
  int32_t* block_counts;       // [num_blocks, L] scratch: per block pairs per expert, then exclusive offsets
  int64_t* first_slot;         // [L] scratch: each expert's first slot
  int64_t* tokens_per_expert;  // [L] out: pairs rounded up to A
  int64_t* pairs_per_expert;   // [L] out
  int64_t* pair_of_slot;       // [M] out: each slot's pair, P for padding (launch_expert_slots writes every slot)
  int64_t* slot_of_pair;       // [P] out: the slot of each pair, -1 for a non-pair or a pair past M
  int64_t* sorted_slots;       // [P] out: per row its slots in increasing order, then -1
};

// Counts pairs per expert (per block, then exclusive offsets across blocks) and each expert's first slot;
// writes tokens_per_expert and pairs_per_expert. P > 0.
cudaError_t launch_expert_counts(const ExpertLayoutParams& p, cudaStream_t stream);
// Places every pair in its slot (stable: by expert, then flat pair index), writes P into every padding slot
// (reading first_slot and pairs_per_expert from launch_expert_counts), and sorts each row's slots.
cudaError_t launch_expert_slots(const ExpertLayoutParams& p, cudaStream_t stream);

// out[s] = x[pair_of_slot[s] / K] (bytes), zero for a padding slot (pair outside [0, P));
// slot_values[s] = values[pair_of_slot[s]] or 0 when both are given.
struct PermuteRowsParams {
  const void* x;               // [N, row_bytes]
  void* out;                   // [M, row_bytes]
  int64_t row_bytes;
  const int64_t* pair_of_slot; // [M]
  int64_t num_slots, num_pairs;
  int num_topk;
  const float* values;         // [P] or null
  float* slot_values;          // [M] or null
  // Received rows left where a dispatch put them (rows_in_place): row i < N is own_x[own_tokens[i - first]]
  // for first <= i < end, else x[i] (x: the peers' rows in this rank's receive buffer, [>= N, row_bytes]);
  // first and end are read on the device from rank_prefix_matrix [R, R] (rows that ranks below `rank`, and up
  // to `rank`, send `rank`). own_x null: one source, x.
  const void* own_x;           // [T, row_bytes] or null
  const int32_t* own_tokens;   // [T]: the token of each own row, in order
  const int32_t* rank_prefix_matrix;
  int num_ranks, rank;
  int64_t num_own_rows;        // T: reads stay inside own_x and own_tokens whatever the prefix matrix holds
};
cudaError_t launch_permute_rows(const PermuteRowsParams& p, cudaStream_t stream);

enum RowDtype { kRowBF16 = 0, kRowFP32 = 1 };

// out[i] = (fp32 sum over the slots s of sorted_slots[i] in [0, M), in order, from 0, of weights[s] * y[s]
// (the product rounded first: no fused multiply-add) or of y[s]).to(dtype); and, when slot_values is given,
// pair_values[i * K + k] = slot_values[slot_of_pair[i * K + k]] or 0.
struct UnpermuteSumParams {
  const void* y;               // [M, H]
  void* out;                   // [N, H]
  int dtype;                   // RowDtype of y and out
  int64_t hidden, num_rows, num_slots;
  int num_topk;
  const float* weights;        // [M] or null
  const int64_t* sorted_slots; // [P]
  const float* slot_values;    // [M] or null
  const int64_t* slot_of_pair; // [P] (with slot_values)
  float* pair_values;          // [P] (with slot_values)
  // Only this rank's own rows of a rank-major layout (an expert-major combine, whose kernel sums the other rows
  // as they go out): rows i outside [rank_prefix_matrix[rank - 1, rank] (0 for rank 0), [rank, rank]) are not
  // written. Null: every row.
  const int32_t* rank_prefix_matrix;  // [R, R] on the device, or null
  int num_ranks, rank;
};
cudaError_t launch_unpermute_sum(const UnpermuteSumParams& p, cudaStream_t stream);

// The gradients of unpermute_sum, slot by slot (r = pair_of_slot[s] / K, zero for padding):
// grad_y[s] = (weights[s] * grad_out[r]).to(dtype) (a copy without weights);
// grad_weights[s] = <grad_out[r], y[s]> in fp32, in a fixed order (per lane, then a butterfly over the warp).
struct UnpermuteSumBackwardParams {
  const void* grad_out;        // [N, H]
  const void* y;               // [M, H] (for grad_weights)
  int dtype;                   // RowDtype of grad_out, y and grad_y
  int64_t hidden, num_slots, num_pairs;
  int num_topk;
  const float* weights;        // [M] or null
  const int64_t* pair_of_slot; // [M]
  void* grad_y;                // [M, H] or null
  float* grad_weights;         // [M] or null
};
cudaError_t launch_unpermute_sum_backward(const UnpermuteSumBackwardParams& p, cudaStream_t stream);

// Dense routing (Megatron's routing_map [T, E] bool and probs [T, E]) to top-k form: per token its first K selected
// experts in increasing id, then -1; their probs as fp32 (0 for -1). And back (the gradient): grad_probs[t, e] =
// grad_weights[t, k] (rounded to the probs' dtype) where topk_idx[t, k] = e, 0 elsewhere.
struct RoutingMapParams {
  const bool* routing_map;     // [T, E]
  const void* probs;           // [T, E], RowDtype
  int probs_dtype;
  int64_t num_tokens;
  int num_experts, num_topk;
  int64_t* topk_idx;           // [T, K]
  float* topk_weights;         // [T, K] (forward) / grad_weights (backward, read)
  void* grad_probs;            // [T, E] (backward, written), RowDtype of probs
};
cudaError_t launch_routing_map_to_topk(const RoutingMapParams& p, cudaStream_t stream);
cudaError_t launch_routing_map_to_topk_backward(const RoutingMapParams& p, cudaStream_t stream);

}  // namespace ep_moe
