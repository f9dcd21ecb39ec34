// The parameter structs of the generic expert-major kernels (expert_major_kernels.cuh; ep_moe.permute's contract, raw
// pointers and sizes). ep_moe/native/jit/params.py mirrors them in this order, and
// ep_moe/native/jit/expert_major_exchange.py fills them and launches the kernels.
//
// Notation: N rows, K top-k columns, P = N * K pairs (flat index i * K + k), L experts of this rank, A the
// alignment, M slots (expert-major rows), H the row width.
#pragma once

#ifdef __CUDACC_RTC__
#include "rtc_prelude.h"  // NVRTC (the JIT build, expert_major_exchange.cu) has no toolkit headers
#else
#include <cstdint>
#include <cuda_runtime.h>
#endif

namespace ep_moe {

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

}  // namespace ep_moe
