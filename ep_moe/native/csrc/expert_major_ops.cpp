// torch ops (namespace ep_moe_native, CUDA) of the local expert-major kernels (expert_major.h): they check
// tensors, allocate the outputs and launch on the tensors' device and its current stream. ep_moe/permute.py
// wraps them in autograd and registers their fake implementations. Being dispatcher ops (not pybind
// functions), they cost little host time per call and torch.compile traces them.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "expert_major.h"

namespace {

using OptTensor = std::optional<at::Tensor>;

void check_cuda(const at::Tensor& t, const char* op, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "ep_moe_native.", op, ": argument '", name,
              "' must be on ", like.device(), ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "ep_moe_native.", op, ": argument '", name, "' must be contiguous");
}

void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, "ep_moe_native.", op, ": argument '", name, "' must be ", dtype, ", got ",
              t.scalar_type());
}

bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

int row_dtype(const at::Tensor& t, const char* op, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return ep_moe::kRowBF16;
  if (t.scalar_type() == at::kFloat) return ep_moe::kRowFP32;
  TORCH_CHECK(false, "ep_moe_native.", op, ": argument '", name, "' must be bfloat16 or float32, got ", t.scalar_type());
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "ep_moe_native.", op, ": kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor none_like(const at::Tensor& t, at::ScalarType dtype) { return at::empty({0}, t.options().dtype(dtype)); }

// (pair_of_slot [M], slot_of_pair [N, K], sorted_slots [N, K], tokens_per_expert [L], pairs_per_expert [L],
//  tokens_per_expert on the host [L] (exact size or a capacity; empty for a given bound)).
// capacity > 0: M = L * capacity, every expert's slot count is the capacity (no host read).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> expert_layout(
    const at::Tensor& topk_idx, int64_t num_experts, int64_t alignment, int64_t num_slots, int64_t capacity) {
  const char* op = "expert_layout";
  TORCH_CHECK(topk_idx.dim() == 2, "ep_moe_native.expert_layout: argument 'topk_idx' must be [N, K]");
  check_cuda(topk_idx, op, "topk_idx", topk_idx);
  check_dtype(topk_idx, at::kLong, op, "topk_idx");
  TORCH_CHECK(num_experts >= 1 && num_experts <= ep_moe::kMaxLayoutExperts, "ep_moe_native.expert_layout: argument "
              "'num_experts' must be in [1, ", ep_moe::kMaxLayoutExperts, "], got ", num_experts);
  TORCH_CHECK(alignment >= 1, "ep_moe_native.expert_layout: argument 'alignment' must be >= 1, got ", alignment);
  TORCH_CHECK(capacity >= 0, "ep_moe_native.expert_layout: argument 'capacity' must be >= 0, got ", capacity);
  TORCH_CHECK(capacity == 0 || (alignment == 1 && (num_slots < 0 || num_slots == num_experts * capacity)),
              "ep_moe_native.expert_layout: with a capacity, argument 'alignment' must be 1 and 'num_slots' -1 or "
              "num_experts * capacity");
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto longs = topk_idx.options();
  const int64_t rows = topk_idx.size(0), topk = topk_idx.size(1), pairs = rows * topk;
  // With pairs, the scan kernel writes every count and the assign kernel every slot: no fill launches.
  at::Tensor tokens = pairs > 0 ? at::empty({num_experts}, longs) : at::full({num_experts}, capacity, longs);
  at::Tensor counts = pairs > 0 ? at::empty({num_experts}, longs) : at::zeros({num_experts}, longs);
  ep_moe::ExpertLayoutParams p{};
  at::Tensor block_counts, first_slot;
  if (pairs > 0) {
    const int64_t tiles = (pairs + ep_moe::kLayoutTileThreads - 1) / ep_moe::kLayoutTileThreads;
    const int64_t blocks = std::min<int64_t>(tiles, ep_moe::kMaxLayoutBlocks);
    p.pairs_per_block = (tiles + blocks - 1) / blocks * ep_moe::kLayoutTileThreads;
    p.num_blocks = static_cast<int>((pairs + p.pairs_per_block - 1) / p.pairs_per_block);
    block_counts = at::empty({p.num_blocks, num_experts}, longs.dtype(at::kInt));
    first_slot = at::empty({num_experts}, longs);
    p.topk_idx = topk_idx.data_ptr<int64_t>();
    p.num_pairs = pairs;
    p.num_topk = static_cast<int>(topk);
    p.num_experts = static_cast<int>(num_experts);
    p.alignment = alignment;
    p.capacity = capacity;
    p.block_counts = block_counts.data_ptr<int32_t>();
    p.first_slot = first_slot.data_ptr<int64_t>();
    p.tokens_per_expert = tokens.data_ptr<int64_t>();
    p.pairs_per_expert = counts.data_ptr<int64_t>();
    check_launch(ep_moe::launch_expert_counts(p, stream), op);
  }
  at::Tensor host = at::empty({0}, longs.device(at::kCPU));
  if (capacity > 0) {  // every count is known on the host
    host = at::full({num_experts}, capacity, longs.device(at::kCPU));
    num_slots = num_experts * capacity;
  } else if (num_slots < 0) {  // exact size: the aligned total, read once on the host (with the counts)
    host = at::empty({num_experts}, longs.device(at::kCPU).pinned_memory(true));
    check_launch(cudaMemcpyAsync(host.data_ptr<int64_t>(), tokens.data_ptr<int64_t>(), sizeof(int64_t) * num_experts,
                                 cudaMemcpyDeviceToHost, stream), op);
    check_launch(cudaStreamSynchronize(stream), op);
    num_slots = host.sum().item<int64_t>();
  }
  at::Tensor pair_of_slot = pairs > 0 ? at::empty({num_slots}, longs) : at::full({num_slots}, pairs, longs);
  at::Tensor slot_of_pair = at::empty({rows, topk}, longs), sorted_slots = at::empty({rows, topk}, longs);
  if (pairs > 0) {
    p.num_slots = num_slots;
    p.pair_of_slot = pair_of_slot.data_ptr<int64_t>();
    p.slot_of_pair = slot_of_pair.data_ptr<int64_t>();
    p.sorted_slots = sorted_slots.data_ptr<int64_t>();
    check_launch(ep_moe::launch_expert_slots(p, stream), op);
  }
  return {pair_of_slot, slot_of_pair, sorted_slots, tokens, counts, host};
}

// (rows [M, H] of x's dtype, slot_values [M] fp32 (empty without values)).
std::tuple<at::Tensor, at::Tensor> permute_rows(const at::Tensor& x, const at::Tensor& pair_of_slot, int64_t num_topk,
                                                const OptTensor& values) {
  const char* op = "permute_rows";
  TORCH_CHECK(x.dim() == 2, "ep_moe_native.permute_rows: argument 'x' must be [N, H]");
  TORCH_CHECK(num_topk >= 1, "ep_moe_native.permute_rows: argument 'num_topk' must be >= 1, got ", num_topk);
  check_cuda(x, op, "x", x);
  check_cuda(pair_of_slot, op, "pair_of_slot", x);
  check_dtype(pair_of_slot, at::kLong, op, "pair_of_slot");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t slots = pair_of_slot.numel();
  at::Tensor out = at::empty({slots, x.size(1)}, x.options());
  at::Tensor slot_values = none_like(x, at::kFloat);
  ep_moe::PermuteRowsParams p{};
  if (present(values)) {
    check_cuda(*values, op, "values", x);
    check_dtype(*values, at::kFloat, op, "values");
    TORCH_CHECK(values->numel() == x.size(0) * num_topk, "ep_moe_native.permute_rows: argument 'values' must have N * K = ",
                x.size(0) * num_topk, " elements, got ", values->numel());
    slot_values = at::empty({slots}, x.options().dtype(at::kFloat));
    p.values = values->data_ptr<float>();
    p.slot_values = slot_values.data_ptr<float>();
  }
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.row_bytes = x.size(1) * x.element_size();
  p.pair_of_slot = pair_of_slot.data_ptr<int64_t>();
  p.num_slots = slots;
  p.num_pairs = x.size(0) * num_topk;
  p.num_topk = static_cast<int>(num_topk);
  if (p.row_bytes > 0 || p.slot_values != nullptr)
    check_launch(ep_moe::launch_permute_rows(p, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {out, slot_values};
}

// permute_rows of the N received rows of a dispatch that left them in place: row i is own_x[own_tokens[i -
// first]] inside this rank's own range of rank_prefix_matrix [R, R] (int32, device), else rows[i] (the peers'
// rows in the receive buffer, at least N of them). Every row read once, written into each of its slots.
std::tuple<at::Tensor, at::Tensor> permute_received_rows(const at::Tensor& rows, int64_t num_rows,
                                                         const at::Tensor& own_x, const at::Tensor& own_tokens,
                                                         const at::Tensor& rank_prefix_matrix, int64_t rank,
                                                         const at::Tensor& pair_of_slot, int64_t num_topk,
                                                         const OptTensor& values) {
  const char* op = "permute_received_rows";
  TORCH_CHECK(rows.dim() == 2 && own_x.dim() == 2 && rows.size(1) == own_x.size(1) &&
                  rows.scalar_type() == own_x.scalar_type(),
              "ep_moe_native.permute_received_rows: arguments 'rows' and 'own_x' must be [*, H] of one dtype, got ",
              rows.sizes(), " ", rows.scalar_type(), " and ", own_x.sizes(), " ", own_x.scalar_type());
  TORCH_CHECK(num_rows >= 0 && num_rows <= rows.size(0), "ep_moe_native.permute_received_rows: argument 'num_rows' "
              "must be in [0, ", rows.size(0), "] (the buffer's rows), got ", num_rows);
  TORCH_CHECK(num_topk >= 1, "ep_moe_native.permute_received_rows: argument 'num_topk' must be >= 1, got ", num_topk);
  check_cuda(rows, op, "rows", rows);
  check_cuda(own_x, op, "own_x", rows);
  check_cuda(own_tokens, op, "own_tokens", rows);
  check_cuda(rank_prefix_matrix, op, "rank_prefix_matrix", rows);
  check_cuda(pair_of_slot, op, "pair_of_slot", rows);
  check_dtype(own_tokens, at::kInt, op, "own_tokens");
  check_dtype(rank_prefix_matrix, at::kInt, op, "rank_prefix_matrix");
  check_dtype(pair_of_slot, at::kLong, op, "pair_of_slot");
  const int64_t num_ranks = rank_prefix_matrix.size(0);
  TORCH_CHECK(rank_prefix_matrix.dim() == 2 && rank_prefix_matrix.size(1) == num_ranks && rank >= 0 && rank < num_ranks,
              "ep_moe_native.permute_received_rows: argument 'rank_prefix_matrix' must be [R, R] with 0 <= rank < R");
  TORCH_CHECK(own_tokens.numel() == own_x.size(0), "ep_moe_native.permute_received_rows: argument 'own_tokens' must "
              "have a token per row of own_x (", own_x.size(0), "), got ", own_tokens.numel());
  const c10::cuda::CUDAGuard guard(rows.device());
  const int64_t slots = pair_of_slot.numel();
  at::Tensor out = at::empty({slots, rows.size(1)}, rows.options());
  at::Tensor slot_values = none_like(rows, at::kFloat);
  ep_moe::PermuteRowsParams p{};
  if (present(values)) {
    check_cuda(*values, op, "values", rows);
    check_dtype(*values, at::kFloat, op, "values");
    TORCH_CHECK(values->numel() == num_rows * num_topk, "ep_moe_native.permute_received_rows: argument 'values' "
                "must have N * K = ", num_rows * num_topk, " elements, got ", values->numel());
    slot_values = at::empty({slots}, rows.options().dtype(at::kFloat));
    p.values = values->data_ptr<float>();
    p.slot_values = slot_values.data_ptr<float>();
  }
  p.x = rows.data_ptr();
  p.out = out.data_ptr();
  p.row_bytes = rows.size(1) * rows.element_size();
  p.pair_of_slot = pair_of_slot.data_ptr<int64_t>();
  p.num_slots = slots;
  p.num_pairs = num_rows * num_topk;
  p.num_topk = static_cast<int>(num_topk);
  p.own_x = own_x.data_ptr();
  p.own_tokens = own_tokens.data_ptr<int32_t>();
  p.rank_prefix_matrix = rank_prefix_matrix.data_ptr<int32_t>();
  p.num_ranks = static_cast<int>(num_ranks);
  p.rank = static_cast<int>(rank);
  p.num_own_rows = own_x.size(0);
  if (p.row_bytes > 0 || p.slot_values != nullptr)
    check_launch(ep_moe::launch_permute_rows(p, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {out, slot_values};
}

// (out [N, H] of y's dtype, pair_values [N, K] fp32 (empty without slot_values)).
std::tuple<at::Tensor, at::Tensor> unpermute_sum(const at::Tensor& y, const OptTensor& weights,
                                                 const at::Tensor& sorted_slots, const OptTensor& slot_values,
                                                 const OptTensor& slot_of_pair) {
  const char* op = "unpermute_sum";
  TORCH_CHECK(y.dim() == 2 && sorted_slots.dim() == 2,
              "ep_moe_native.unpermute_sum: arguments 'y' and 'sorted_slots' must be [M, H] and [N, K]");
  check_cuda(y, op, "y", y);
  check_cuda(sorted_slots, op, "sorted_slots", y);
  check_dtype(sorted_slots, at::kLong, op, "sorted_slots");
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t rows = sorted_slots.size(0), topk = sorted_slots.size(1), slots = y.size(0);
  ep_moe::UnpermuteSumParams p{};
  p.dtype = row_dtype(y, op, "y");
  if (present(weights)) {
    check_cuda(*weights, op, "weights", y);
    check_dtype(*weights, at::kFloat, op, "weights");
    TORCH_CHECK(weights->numel() == slots, "ep_moe_native.unpermute_sum: argument 'weights' must be [M=", slots, "]");
    p.weights = weights->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, y.size(1)}, y.options());
  at::Tensor pair_values = none_like(y, at::kFloat);
  if (present(slot_values)) {
    TORCH_CHECK(present(slot_of_pair), "ep_moe_native.unpermute_sum: argument 'slot_of_pair' must come with 'slot_values'");
    check_cuda(*slot_values, op, "slot_values", y);
    check_dtype(*slot_values, at::kFloat, op, "slot_values");
    check_cuda(*slot_of_pair, op, "slot_of_pair", y);
    check_dtype(*slot_of_pair, at::kLong, op, "slot_of_pair");
    TORCH_CHECK(slot_values->numel() == slots && slot_of_pair->numel() == rows * topk,
                "ep_moe_native.unpermute_sum: 'slot_values' must be [M] and 'slot_of_pair' [N, K]");
    pair_values = at::empty({rows, topk}, y.options().dtype(at::kFloat));
    p.slot_values = slot_values->data_ptr<float>();
    p.slot_of_pair = slot_of_pair->data_ptr<int64_t>();
    p.pair_values = pair_values.data_ptr<float>();
  }
  p.y = y.data_ptr();
  p.out = out.data_ptr();
  p.hidden = y.size(1);
  p.num_rows = rows;
  p.num_slots = slots;
  p.num_topk = static_cast<int>(topk);
  p.sorted_slots = sorted_slots.data_ptr<int64_t>();
  check_launch(ep_moe::launch_unpermute_sum(p, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {out, pair_values};
}

// out [N, H] of y's dtype: unpermute_sum's rows for this rank's own rows of a rank-major layout only (rows i in
// [rank_prefix_matrix[rank - 1, rank], [rank, rank]), read on the device); the other rows are left unwritten
// (an expert-major combine computes them as they go out, and reads only the own ones from here).
at::Tensor unpermute_own_rows(const at::Tensor& y, const OptTensor& weights, const at::Tensor& sorted_slots,
                              const at::Tensor& rank_prefix_matrix, int64_t rank) {
  const char* op = "unpermute_own_rows";
  TORCH_CHECK(y.dim() == 2 && sorted_slots.dim() == 2,
              "ep_moe_native.unpermute_own_rows: arguments 'y' and 'sorted_slots' must be [M, H] and [N, K]");
  check_cuda(y, op, "y", y);
  check_cuda(sorted_slots, op, "sorted_slots", y);
  check_dtype(sorted_slots, at::kLong, op, "sorted_slots");
  check_cuda(rank_prefix_matrix, op, "rank_prefix_matrix", y);
  check_dtype(rank_prefix_matrix, at::kInt, op, "rank_prefix_matrix");
  const int64_t num_ranks = rank_prefix_matrix.size(0);
  TORCH_CHECK(rank_prefix_matrix.dim() == 2 && rank_prefix_matrix.size(1) == num_ranks && rank >= 0 && rank < num_ranks,
              "ep_moe_native.unpermute_own_rows: argument 'rank_prefix_matrix' must be [R, R] with 0 <= rank < R");
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t rows = sorted_slots.size(0), slots = y.size(0);
  ep_moe::UnpermuteSumParams p{};
  p.dtype = row_dtype(y, op, "y");
  if (present(weights)) {
    check_cuda(*weights, op, "weights", y);
    check_dtype(*weights, at::kFloat, op, "weights");
    TORCH_CHECK(weights->numel() == slots, "ep_moe_native.unpermute_own_rows: argument 'weights' must be [M=", slots,
                "]");
    p.weights = weights->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, y.size(1)}, y.options());
  p.y = y.data_ptr();
  p.out = out.data_ptr();
  p.hidden = y.size(1);
  p.num_rows = rows;
  p.num_slots = slots;
  p.num_topk = static_cast<int>(sorted_slots.size(1));
  p.sorted_slots = sorted_slots.data_ptr<int64_t>();
  p.rank_prefix_matrix = rank_prefix_matrix.data_ptr<int32_t>();
  p.num_ranks = static_cast<int>(num_ranks);
  p.rank = static_cast<int>(rank);
  check_launch(ep_moe::launch_unpermute_sum(p, c10::cuda::getCurrentCUDAStream().stream()), op);
  return out;
}

// (grad_y [M, H] (empty unless asked), grad_weights [M] fp32 (empty unless asked)).
std::tuple<at::Tensor, at::Tensor> unpermute_sum_backward(const at::Tensor& grad_out, const at::Tensor& y,
                                                          const OptTensor& weights, const at::Tensor& pair_of_slot,
                                                          int64_t num_topk, bool need_grad_y, bool need_grad_weights) {
  const char* op = "unpermute_sum_backward";
  TORCH_CHECK(grad_out.dim() == 2 && y.dim() == 2 && grad_out.size(1) == y.size(1) &&
                  grad_out.scalar_type() == y.scalar_type(),
              "ep_moe_native.unpermute_sum_backward: 'grad_out' [N, H] and 'y' [M, H] of one dtype");
  TORCH_CHECK(num_topk >= 1, "ep_moe_native.unpermute_sum_backward: argument 'num_topk' must be >= 1");
  check_cuda(grad_out, op, "grad_out", y);
  check_cuda(y, op, "y", y);
  check_cuda(pair_of_slot, op, "pair_of_slot", y);
  check_dtype(pair_of_slot, at::kLong, op, "pair_of_slot");
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t slots = pair_of_slot.numel();
  TORCH_CHECK(y.size(0) == slots, "ep_moe_native.unpermute_sum_backward: 'y' must have M = ", slots, " rows");
  ep_moe::UnpermuteSumBackwardParams p{};
  p.dtype = row_dtype(y, op, "y");
  if (present(weights)) {
    check_cuda(*weights, op, "weights", y);
    check_dtype(*weights, at::kFloat, op, "weights");
    TORCH_CHECK(weights->numel() == slots, "ep_moe_native.unpermute_sum_backward: argument 'weights' must be [M]");
    p.weights = weights->data_ptr<float>();
  }
  at::Tensor grad_y = need_grad_y ? at::empty({slots, y.size(1)}, y.options()) : none_like(y, y.scalar_type());
  at::Tensor grad_weights = need_grad_weights ? at::empty({slots}, y.options().dtype(at::kFloat))
                                              : none_like(y, at::kFloat);
  p.grad_out = grad_out.data_ptr();
  p.y = y.data_ptr();
  p.hidden = y.size(1);
  p.num_slots = slots;
  p.num_pairs = grad_out.size(0) * num_topk;
  p.num_topk = static_cast<int>(num_topk);
  p.pair_of_slot = pair_of_slot.data_ptr<int64_t>();
  p.grad_y = need_grad_y ? grad_y.data_ptr() : nullptr;
  p.grad_weights = need_grad_weights ? grad_weights.data_ptr<float>() : nullptr;
  if (need_grad_y || need_grad_weights)
    check_launch(ep_moe::launch_unpermute_sum_backward(p, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {grad_y, grad_weights};
}

// (topk_idx [T, K] int64, topk_weights [T, K] fp32).
std::tuple<at::Tensor, at::Tensor> routing_map_to_topk(const at::Tensor& routing_map, const at::Tensor& probs,
                                                       int64_t num_topk) {
  const char* op = "routing_map_to_topk";
  TORCH_CHECK(routing_map.dim() == 2 && probs.sizes() == routing_map.sizes(),
              "ep_moe_native.routing_map_to_topk: 'routing_map' and 'probs' must be [T, E] of one shape");
  TORCH_CHECK(num_topk >= 1, "ep_moe_native.routing_map_to_topk: argument 'num_topk' must be >= 1");
  check_cuda(routing_map, op, "routing_map", routing_map);
  check_cuda(probs, op, "probs", routing_map);
  check_dtype(routing_map, at::kBool, op, "routing_map");
  const c10::cuda::CUDAGuard guard(routing_map.device());
  const int64_t tokens = routing_map.size(0);
  at::Tensor idx = at::empty({tokens, num_topk}, routing_map.options().dtype(at::kLong));
  at::Tensor weights = at::empty({tokens, num_topk}, routing_map.options().dtype(at::kFloat));
  ep_moe::RoutingMapParams p{};
  p.routing_map = routing_map.data_ptr<bool>();
  p.probs = probs.data_ptr();
  p.probs_dtype = row_dtype(probs, op, "probs");
  p.num_tokens = tokens;
  p.num_experts = static_cast<int>(routing_map.size(1));
  p.num_topk = static_cast<int>(num_topk);
  p.topk_idx = idx.data_ptr<int64_t>();
  p.topk_weights = weights.data_ptr<float>();
  check_launch(ep_moe::launch_routing_map_to_topk(p, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {idx, weights};
}

// grad_probs [T, E] of the probs' dtype.
at::Tensor routing_map_to_topk_backward(const at::Tensor& grad_weights, const at::Tensor& topk_idx,
                                        int64_t num_experts, at::ScalarType dtype) {
  const char* op = "routing_map_to_topk_backward";
  TORCH_CHECK(grad_weights.dim() == 2 && topk_idx.sizes() == grad_weights.sizes() && num_experts >= 1,
              "ep_moe_native.routing_map_to_topk_backward: 'grad_weights' and 'topk_idx' [T, K], num_experts >= 1");
  check_cuda(grad_weights, op, "grad_weights", topk_idx);
  check_cuda(topk_idx, op, "topk_idx", topk_idx);
  check_dtype(grad_weights, at::kFloat, op, "grad_weights");
  check_dtype(topk_idx, at::kLong, op, "topk_idx");
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  at::Tensor grad = at::empty({topk_idx.size(0), num_experts}, topk_idx.options().dtype(dtype));
  ep_moe::RoutingMapParams p{};
  p.probs_dtype = row_dtype(grad, op, "dtype");
  p.num_tokens = grad.size(0);
  p.num_experts = static_cast<int>(grad.size(1));
  p.num_topk = static_cast<int>(topk_idx.size(1));
  p.topk_idx = topk_idx.data_ptr<int64_t>();
  p.topk_weights = grad_weights.data_ptr<float>();
  p.grad_probs = grad.data_ptr();
  check_launch(ep_moe::launch_routing_map_to_topk_backward(p, c10::cuda::getCurrentCUDAStream().stream()), op);
  return grad;
}

}  // namespace

TORCH_LIBRARY(ep_moe_native, m) {
  m.def("expert_layout(Tensor topk_idx, int num_experts, int alignment, int num_slots, int capacity=0) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("permute_rows(Tensor x, Tensor pair_of_slot, int num_topk, Tensor? values) -> (Tensor, Tensor)");
  m.def("permute_received_rows(Tensor rows, int num_rows, Tensor own_x, Tensor own_tokens, Tensor rank_prefix_matrix, "
        "int rank, Tensor pair_of_slot, int num_topk, Tensor? values) -> (Tensor, Tensor)");
  m.def("unpermute_sum(Tensor y, Tensor? weights, Tensor sorted_slots, Tensor? slot_values, Tensor? slot_of_pair) "
        "-> (Tensor, Tensor)");
  m.def("unpermute_own_rows(Tensor y, Tensor? weights, Tensor sorted_slots, Tensor rank_prefix_matrix, int rank) "
        "-> Tensor");
  m.def("unpermute_sum_backward(Tensor grad_out, Tensor y, Tensor? weights, Tensor pair_of_slot, int num_topk, "
        "bool need_grad_y, bool need_grad_weights) -> (Tensor, Tensor)");
  m.def("routing_map_to_topk(Tensor routing_map, Tensor probs, int num_topk) -> (Tensor, Tensor)");
  m.def("routing_map_to_topk_backward(Tensor grad_weights, Tensor topk_idx, int num_experts, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(ep_moe_native, CUDA, m) {
  m.impl("expert_layout", &expert_layout);
  m.impl("permute_rows", &permute_rows);
  m.impl("permute_received_rows", &permute_received_rows);
  m.impl("unpermute_sum", &unpermute_sum);
  m.impl("unpermute_own_rows", &unpermute_own_rows);
  m.impl("unpermute_sum_backward", &unpermute_sum_backward);
  m.impl("routing_map_to_topk", &routing_map_to_topk);
  m.impl("routing_map_to_topk_backward", &routing_map_to_topk_backward);
}
