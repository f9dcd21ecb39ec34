// pybind11 binding of the intranode kernels: the only place that sees tensors. It checks shapes,
// dtypes and devices, converts tensors into the plain parameter structs of kernels.h and launches on
// the current CUDA stream. Outputs are allocated by the caller (ep_moe/backends/native_backend.py).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

using ep_moe::kMaxRanks;
using OptTensor = std::optional<at::Tensor>;

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "ep_moe.native: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "ep_moe.native: ", name, " must be contiguous");
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "ep_moe.native: launching ", what, " failed: ", cudaGetErrorString(err));
}

bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

// The data pointer of an optional tensor (null when absent, or when empty: never dereferenced then).
template <typename T>
T* ptr_or_null(const OptTensor& t, const char* name) {
  if (!present(t)) return nullptr;
  check_cuda(*t, name);
  return reinterpret_cast<T*>(t->data_ptr());
}

int elem_type(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return ep_moe::kBF16;
  if (t.scalar_type() == at::kFloat) return ep_moe::kFP32;
  TORCH_CHECK(false, "ep_moe.native: ", name, " must be bfloat16 or float32, got ", t.scalar_type());
}

// The copy-engine timeline after the blocks' slots of a trace buffer (null: no tracing or no copy engine).
int64_t* copy_engine_trace_ptr(const OptTensor& trace, int64_t num_blocks, int64_t copy_engine_seq) {
  if (!present(trace) || copy_engine_seq == 0) return nullptr;
  TORCH_CHECK(trace->numel() >= num_blocks * ep_moe::kTraceSlots + ep_moe::kCopyEngineTraceSlots,
              "ep_moe.native: a copy-engine call's trace needs ", ep_moe::kCopyEngineTraceSlots, " slots after the blocks'");
  return trace->data_ptr<int64_t>() + num_blocks * ep_moe::kTraceSlots;
}

// The per-block timeline buffer of a dispatch or combine (null: no tracing).
int64_t* trace_ptr(const OptTensor& trace, int64_t num_blocks) {
  if (!present(trace)) return nullptr;
  check_cuda(*trace, "trace");
  TORCH_CHECK(trace->scalar_type() == at::kLong && trace->numel() >= num_blocks * ep_moe::kTraceSlots,
              "ep_moe.native: trace must be int64 with ", ep_moe::kTraceSlots, " slots per block");
  return trace->data_ptr<int64_t>();
}

// What every collective kernel of one rank needs: peers' control blocks, private state, error record.
struct Env {
  ep_moe::KernelEnv env{};
  at::Tensor state, error;  // kept alive with the Env
  int combine_chunks_per_pair = 0;  // env.chunks_per_pair is the dispatch's

  Env(int rank, const std::vector<int64_t>& ctrl_ptrs, at::Tensor state_, at::Tensor error_, int64_t timeout_ns,
      int64_t dispatch_chunks, int64_t combine_chunks,
      int64_t min_chunk_rows)
      : state(std::move(state_)), error(std::move(error_)) {
    const int num_ranks = static_cast<int>(ctrl_ptrs.size());
    TORCH_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "ep_moe.native: group size must be in [1, ", kMaxRanks,
                "], got ", num_ranks);
    TORCH_CHECK(rank >= 0 && rank < num_ranks, "ep_moe.native: rank out of range");
    check_cuda(state, "state");
    TORCH_CHECK(state.nbytes() >= 64, "ep_moe.native: state too small");
    TORCH_CHECK(!error.is_cuda() && error.is_pinned() && error.scalar_type() == at::kInt &&
                    error.numel() >= ep_moe::kErrWords + ep_moe::kMismatchWords,
                "ep_moe.native: error must be a pinned int32 CPU tensor of ", ep_moe::kErrWords, " + ",
                ep_moe::kMismatchWords, " words (error record, mismatch record)");
    env.rank = rank;
    env.num_ranks = num_ranks;
    for (int r = 0; r < num_ranks; ++r) env.ctrl[r] = reinterpret_cast<uint8_t*>(ctrl_ptrs[r]);
    env.state = reinterpret_cast<ep_moe::LocalState*>(state.data_ptr());
    int32_t* device_error = nullptr;
    TORCH_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_error), error.data_ptr(), 0) == cudaSuccess,
                "ep_moe.native: the error record is not device-mapped pinned memory");
    env.error = device_error;
    env.timeout_ns = static_cast<uint64_t>(timeout_ns);
    for (const int64_t chunks : {dispatch_chunks, combine_chunks})
      TORCH_CHECK(chunks >= 1 && chunks <= ep_moe::kMaxChunks, "ep_moe.native: chunks per pair must be in [1, ",
                  ep_moe::kMaxChunks, "], got ", chunks);
    TORCH_CHECK(min_chunk_rows >= 1, "ep_moe.native: min_chunk_rows must be >= 1, got ", min_chunk_rows);
    env.chunks_per_pair = static_cast<int>(dispatch_chunks);
    env.min_chunk_rows = static_cast<int>(min_chunk_rows);
    combine_chunks_per_pair = static_cast<int>(combine_chunks);
  }
};

// This rank's header of a call (ep_moe/backends/agreement.py's slots, then the native words; kernels.h,
// HeaderSlot) and the test-only perturbation (absent: off).
ep_moe::HeaderCheck header_check(const std::vector<int64_t>& header, bool digest_from_prefix,
                                 const OptTensor& test_perturb) {
  TORCH_CHECK(static_cast<int>(header.size()) == ep_moe::kHeaderWords, "ep_moe.native: header must hold ",
              ep_moe::kHeaderWords, " values, got ", header.size());
  ep_moe::HeaderCheck check{};
  for (int s = 0; s < ep_moe::kHeaderWords; ++s) {
    TORCH_CHECK(header[s] >= INT32_MIN && header[s] <= INT32_MAX, "ep_moe.native: header value ", header[s],
                " (slot ", s, ") does not fit int32");
    check.header[s] = static_cast<int32_t>(header[s]);
  }
  check.digest_from_prefix = digest_from_prefix;
  if (present(test_perturb)) {
    check_cuda(*test_perturb, "test_header_perturbation");
    TORCH_CHECK(test_perturb->scalar_type() == at::kInt && test_perturb->numel() == 3,
                "ep_moe.native: test_header_perturbation must be an int32 CUDA tensor of 3 (source, slot, value added)");
    check.test_perturb = test_perturb->data_ptr<int32_t>();
  }
  return check;
}

std::vector<at::Tensor> layout(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks) {
  check_cuda(topk_idx, "topk_idx");
  TORCH_CHECK(topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong, "ep_moe.native: topk_idx must be [T, K] int64");
  TORCH_CHECK(num_ranks >= 1 && num_ranks <= 32 && num_experts % num_ranks == 0, "ep_moe.native: bad num_ranks/num_experts");
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  const auto opts = topk_idx.options();
  auto per_rank = at::empty({num_ranks}, opts.dtype(at::kInt));
  auto per_expert = at::empty({num_experts}, opts.dtype(at::kInt));
  auto in_rank = at::empty({topk_idx.size(0), num_ranks}, opts.dtype(at::kBool));
  ep_moe::LayoutParams p{};
  p.topk_idx = topk_idx.data_ptr<int64_t>();
  p.num_tokens = static_cast<int>(topk_idx.size(0));
  p.num_topk = static_cast<int>(topk_idx.size(1));
  p.num_experts = static_cast<int>(num_experts);
  p.num_ranks = static_cast<int>(num_ranks);
  p.num_tokens_per_rank = per_rank.data_ptr<int32_t>();
  p.num_tokens_per_expert = per_expert.data_ptr<int32_t>();
  p.is_token_in_rank = in_rank.data_ptr<bool>();
  check_launch(ep_moe::launch_layout(p, c10::cuda::getCurrentCUDAStream().stream()), "layout");
  return {per_rank, per_expert, in_rank};
}

void notify(const Env& env, const at::Tensor& is_token_in_rank, const at::Tensor& num_tokens_per_rank,
            const at::Tensor& rank_prefix_matrix, const at::Tensor& pos, const at::Tensor& send_list,
            const at::Tensor& host_counts,
            int64_t num_worst_tokens, int64_t rows_capacity, const OptTensor& topk_idx, int64_t experts_per_rank,
            int64_t expert_alignment, const OptTensor& host_expert_counts, const std::vector<int64_t>& header,
            const OptTensor& test_perturb) {
  const int num_ranks = env.env.num_ranks;
  check_cuda(is_token_in_rank, "is_token_in_rank");
  check_cuda(num_tokens_per_rank, "num_tokens_per_rank");
  check_cuda(rank_prefix_matrix, "rank_prefix_matrix");
  check_cuda(pos, "pos");
  check_cuda(send_list, "send_list");
  const int64_t num_tokens = is_token_in_rank.size(0);
  TORCH_CHECK(is_token_in_rank.scalar_type() == at::kBool && is_token_in_rank.size(1) == num_ranks,
              "ep_moe.native: is_token_in_rank must be [T, R] bool");
  TORCH_CHECK(num_tokens_per_rank.numel() == num_ranks &&
                  (num_tokens_per_rank.scalar_type() == at::kInt || num_tokens_per_rank.scalar_type() == at::kLong),
              "ep_moe.native: num_tokens_per_rank must be [R] int32/int64");
  TORCH_CHECK(rank_prefix_matrix.numel() == num_ranks * num_ranks && rank_prefix_matrix.scalar_type() == at::kInt,
              "ep_moe.native: rank_prefix_matrix must be [R, R] int32");
  TORCH_CHECK(pos.numel() == num_tokens * num_ranks && send_list.numel() == num_tokens * num_ranks &&
                  pos.scalar_type() == at::kInt && send_list.scalar_type() == at::kInt,
              "ep_moe.native: pos and send_list must hold T * R int32");
  const int64_t host_words = num_ranks * (num_ranks + 1) + num_ranks * ep_moe::kHeaderWords + ep_moe::kHeaderLen + 1;
  TORCH_CHECK(!host_counts.is_cuda() && host_counts.is_pinned() && host_counts.numel() >= host_words,
              "ep_moe.native: host_counts must be pinned, R * R + R int32 then the header check's ",
              num_ranks * ep_moe::kHeaderWords + ep_moe::kHeaderLen + 1);
  int32_t* host_dev = nullptr;
  TORCH_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host_counts.data_ptr(), 0) == cudaSuccess,
              "ep_moe.native: host_counts is not device-mapped");
  ep_moe::NotifyParams p{};
  p.env = env.env;
  p.is_token_in_rank = is_token_in_rank.data_ptr<bool>();
  p.num_tokens_per_rank = num_tokens_per_rank.data_ptr();
  p.counts_int64 = num_tokens_per_rank.scalar_type() == at::kLong;
  p.num_tokens = static_cast<int>(num_tokens);
  p.rank_prefix_matrix = rank_prefix_matrix.data_ptr<int32_t>();
  p.pos = pos.data_ptr<int32_t>();
  p.send_list = send_list.data_ptr<int32_t>();
  p.host_counts = host_dev;
  p.num_worst_tokens = static_cast<int>(num_worst_tokens);
  p.rows_capacity = rows_capacity;
  p.check = header_check(header, false, test_perturb);
  if (present(host_expert_counts)) {  // the per-expert counts travel with the row counts
    TORCH_CHECK(present(topk_idx) && topk_idx->scalar_type() == at::kLong && topk_idx->dim() == 2 &&
                    topk_idx->size(0) == num_tokens,
                "ep_moe.native: topk_idx must be [T, K] int64 when per-expert counts are exchanged");
    TORCH_CHECK(experts_per_rank >= 1 && experts_per_rank <= ep_moe::kMaxNotifyExperts,
                "ep_moe.native: experts per rank must be in [1, ", ep_moe::kMaxNotifyExperts, "] to travel in notify, got ",
                experts_per_rank);
    TORCH_CHECK(expert_alignment >= 1, "ep_moe.native: expert_alignment must be >= 1");
    TORCH_CHECK(!host_expert_counts->is_cuda() && host_expert_counts->is_pinned() &&
                    host_expert_counts->scalar_type() == at::kLong && host_expert_counts->numel() >= experts_per_rank,
                "ep_moe.native: host_expert_counts must be pinned int64 with room for every local expert");
    p.topk_idx = ptr_or_null<const int64_t>(topk_idx, "topk_idx");
    p.num_topk = static_cast<int>(topk_idx->size(1));
    p.experts_per_rank = static_cast<int>(experts_per_rank);
    p.expert_alignment = static_cast<int>(expert_alignment);
    int64_t* host_experts_dev = nullptr;
    TORCH_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_experts_dev), host_expert_counts->data_ptr(),
                                         0) == cudaSuccess,
                "ep_moe.native: host_expert_counts is not device-mapped");
    p.host_expert_counts = host_experts_dev;
  }
  check_launch(ep_moe::launch_notify(p, c10::cuda::getCurrentCUDAStream().stream()), "notify");
}

std::vector<cudaStream_t> as_streams(const std::vector<int64_t>& handles) {
  std::vector<cudaStream_t> streams;
  for (const int64_t h : handles) streams.push_back(reinterpret_cast<cudaStream_t>(h));
  return streams;
}

// Copy streams and the flag stream (0: flag writes on the copy streams); `copy` must outlive the set.
ep_moe::CopyStreamSet stream_set(const std::vector<cudaStream_t>& copy, int64_t flag_stream) {
  return {copy.data(), static_cast<int>(copy.size()), reinterpret_cast<cudaStream_t>(flag_stream)};
}

// The copy-engine half's parameters (seq 0: none); checked before any kernel starts, since the kernel
// releases the copy stream and the copies write into the peers' buffers unchecked.
ep_moe::CopyEngineParams copy_engine_params(const std::vector<int64_t>& streams, int64_t flag_stream, int64_t seq,
                                            const OptTensor& go, const std::vector<int64_t>& shares,
                                            int64_t num_push_blocks) {
  ep_moe::CopyEngineParams ce{};
  if (seq == 0) return ce;
  TORCH_CHECK(seq > 0 && num_push_blocks == 0 && present(go),
              "ep_moe.native: a copy-engine call needs no pusher blocks and the go word");
  TORCH_CHECK(!streams.empty() && static_cast<int>(streams.size()) <= ep_moe::kMaxCopyStreams &&
                  std::find(streams.begin(), streams.end(), 0) == streams.end(),
              "ep_moe.native: copy_engine_streams must hold 1 to ", ep_moe::kMaxCopyStreams,
              " side streams (not the legacy default stream), got ", streams.size());
  TORCH_CHECK(std::find(streams.begin(), streams.end(), flag_stream) == streams.end(),
              "ep_moe.native: copy_engine_flag_stream must not be one of the copy streams");
  check_cuda(*go, "copy_engine_go");
  TORCH_CHECK(go->scalar_type() == at::kLong && go->numel() >= 1, "ep_moe.native: copy_engine_go must be an int64 "
              "CUDA tensor");
  const int num_chunks = static_cast<int>(shares.size());
  TORCH_CHECK(num_chunks >= 1 && num_chunks <= ep_moe::kMaxCopyEngineChunks, "ep_moe.native: copy_engine_shares must "
              "hold 1 to ", ep_moe::kMaxCopyEngineChunks, " shares, got ", num_chunks);
  int64_t total = 0;
  for (int k = 0; k < num_chunks; ++k) {
    TORCH_CHECK(shares[k] >= 1 && shares[k] <= 1024, "ep_moe.native: copy_engine_shares must be in [1, 1024], got ",
                shares[k]);
    total += shares[k];
    ce.bounds[k + 1] = static_cast<int32_t>(total);
  }
  ce.chunks = num_chunks;
  ce.seq = static_cast<uint64_t>(seq);
  ce.go = reinterpret_cast<uint64_t*>(go->data_ptr());
  return ce;
}

// What dispatch and combine params share: blocks, pusher blocks, the trace buffer and the copy-engine half.
template <typename Params>
void set_launch(Params& p, int64_t num_blocks, int64_t num_push_blocks, const OptTensor& trace,
                const std::vector<int64_t>& copy_engine_streams, int64_t copy_engine_flag_stream,
                int64_t copy_engine_seq, const OptTensor& copy_engine_go,
                const std::vector<int64_t>& copy_engine_shares) {
  p.num_blocks = static_cast<int>(num_blocks);
  p.num_push_blocks = static_cast<int>(num_push_blocks);
  p.trace = trace_ptr(trace, num_blocks);
  p.copy_engine = copy_engine_params(copy_engine_streams, copy_engine_flag_stream, copy_engine_seq, copy_engine_go,
                                     copy_engine_shares, num_push_blocks);
  p.copy_engine.trace = copy_engine_trace_ptr(trace, num_blocks, copy_engine_seq);
}

void dispatch(const Env& env, const std::vector<int64_t>& data_ptrs, const std::vector<int64_t>& offsets,
              const at::Tensor& rank_prefix_matrix, const at::Tensor& send_list, const at::Tensor& x,
              const OptTensor& scales, const OptTensor& topk_idx, const OptTensor& topk_weights,
              int64_t experts_per_rank, const at::Tensor& recv_x, const OptTensor& recv_scales,
              const OptTensor& recv_topk_idx, const OptTensor& recv_topk_weights, const OptTensor& recv_src_idx,
              const OptTensor& recv_src_rank, const OptTensor& expert_scratch, const OptTensor& num_recv_per_expert,
              int64_t expert_alignment, int64_t rows_capacity, bool write_arrival, int64_t num_blocks,
              int64_t num_push_blocks, const OptTensor& trace, const std::vector<int64_t>& copy_engine_streams,
              int64_t copy_engine_flag_stream, int64_t copy_engine_seq,
              const OptTensor& copy_engine_go, const std::vector<int64_t>& copy_engine_shares,
              const std::vector<int64_t>& copy_engine_tokens, const std::vector<int64_t>& host_prefix,
              const OptTensor& cached_src_idx, const std::vector<int64_t>& header, const OptTensor& test_perturb,
              bool rows_in_place) {
  // rows_in_place (DispatchParams): recv_x is [0, H] (its dtype and width only) and recv_scales absent; the
  // received rows count is recv_topk_idx's (fresh) or cached_src_idx's (cached: the handle's recv_src_idx, of
  // which only the size is used; no copy engine).
  const int num_ranks = env.env.num_ranks;
  TORCH_CHECK(static_cast<int>(data_ptrs.size()) == num_ranks && offsets.size() == 5,
              "ep_moe.native: data_ptrs must hold R pointers and offsets 5");
  check_cuda(rank_prefix_matrix, "rank_prefix_matrix");
  check_cuda(send_list, "send_list");
  check_cuda(x, "x");
  check_cuda(recv_x, "recv_x");
  TORCH_CHECK(x.dim() == 2 && recv_x.dim() == 2 && x.size(1) == recv_x.size(1) && x.scalar_type() == recv_x.scalar_type(),
              "ep_moe.native: x and recv_x must be [*, H] of one dtype");
  const int64_t x_bytes = x.size(1) * x.element_size();
  TORCH_CHECK(x_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(recv_x.data_ptr()) % 16 == 0,
              "ep_moe.native: rows must be 16-byte multiples at 16-byte-aligned addresses");
  TORCH_CHECK(send_list.numel() == x.size(0) * num_ranks, "ep_moe.native: send_list does not match x");
  TORCH_CHECK(num_blocks >= 1 && num_push_blocks >= 0 && num_push_blocks < num_blocks + (num_ranks == 1 ? 1 : 0),
              "ep_moe.native: bad block split");
  ep_moe::DispatchParams p{};
  p.env = env.env;
  for (int r = 0; r < num_ranks; ++r) p.data[r] = reinterpret_cast<uint8_t*>(data_ptrs[r]);
  p.off_x = offsets[0];
  p.off_scales = offsets[1];
  p.off_idx = offsets[2];
  p.off_weights = offsets[3];
  p.off_src = offsets[4];
  p.rank_prefix_matrix = rank_prefix_matrix.data_ptr<int32_t>();
  p.send_list = send_list.data_ptr<int32_t>();
  p.num_tokens = static_cast<int>(x.size(0));
  p.x = reinterpret_cast<const uint8_t*>(x.data_ptr());
  p.x_bytes = static_cast<int>(x_bytes);
  p.has_scales = present(scales);
  p.scales = ptr_or_null<const float>(scales, "scales");
  p.num_scales = p.has_scales ? static_cast<int>(scales->size(1)) : 0;
  p.has_topk = present(topk_idx);
  p.topk_idx = ptr_or_null<const int64_t>(topk_idx, "topk_idx");
  p.topk_weights = ptr_or_null<const float>(topk_weights, "topk_weights");
  p.num_topk = p.has_topk ? static_cast<int>(topk_idx->size(1)) : 0;
  TORCH_CHECK(p.has_topk == present(topk_weights), "ep_moe.native: topk_idx and topk_weights go together");
  p.experts_per_rank = static_cast<int>(experts_per_rank);
  p.recv_x = rows_in_place ? nullptr : reinterpret_cast<uint8_t*>(recv_x.data_ptr());
  p.recv_scales = ptr_or_null<float>(recv_scales, "recv_scales");
  TORCH_CHECK(p.has_scales == present(recv_scales) || (rows_in_place && !present(recv_scales)),
              "ep_moe.native: scales and recv_scales go together");
  p.recv_topk_idx = ptr_or_null<int64_t>(recv_topk_idx, "recv_topk_idx");
  p.recv_topk_weights = ptr_or_null<float>(recv_topk_weights, "recv_topk_weights");
  p.recv_src_idx = ptr_or_null<int32_t>(recv_src_idx, "recv_src_idx");
  p.recv_src_rank = ptr_or_null<int32_t>(recv_src_rank, "recv_src_rank");
  p.expert_scratch = ptr_or_null<int32_t>(expert_scratch, "expert_scratch");
  p.num_recv_per_expert = ptr_or_null<int64_t>(num_recv_per_expert, "num_recv_per_expert");
  if (p.has_topk)
    TORCH_CHECK(present(recv_topk_idx) && present(recv_topk_weights) && present(recv_src_idx) &&
                    present(recv_src_rank) && present(expert_scratch) && present(num_recv_per_expert) &&
                    expert_scratch->numel() >= experts_per_rank && num_recv_per_expert->numel() == experts_per_rank,
                "ep_moe.native: a dispatch with top-k needs every top-k output");
  TORCH_CHECK(!rows_in_place || ((p.has_topk || (present(cached_src_idx) && cached_src_idx->dim() == 1)) &&
                                  recv_x.size(0) == 0 && copy_engine_seq == 0),
              "ep_moe.native: a dispatch with rows in place has top-k (fresh) or cached_src_idx (cached), an empty "
              "recv_x and no copy engine");
  p.num_recv_rows = static_cast<int>(!rows_in_place ? recv_x.size(0)
                                     : p.has_topk   ? recv_topk_idx->size(0)
                                                    : cached_src_idx->size(0));
  p.rows_in_place = rows_in_place;
  p.expert_alignment = static_cast<int>(expert_alignment);
  p.rows_capacity = rows_capacity;
  p.write_arrival = write_arrival;
  set_launch(p, num_blocks, num_push_blocks, trace, copy_engine_streams, copy_engine_flag_stream, copy_engine_seq,
             copy_engine_go, copy_engine_shares);
  // A cached dispatch checks the header in the kernel (with the handle's layout digest and the number its copy
  // stream writes); a fresh one's notify did.
  p.check = header_check(header, write_arrival, test_perturb);
  p.check.header[ep_moe::kHeaderCopySeq] = static_cast<int32_t>(copy_engine_seq);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  if (copy_engine_seq == 0) {
    check_launch(ep_moe::launch_dispatch(p, stream), "dispatch");
    return;
  }
  // Copy-engine dispatch: every source's tokens must fit its slot (the copies are not bounds-checked). A
  // cached one reads the handle's recv_src_idx; a fresh one the send lists its peers' copy streams stage.
  TORCH_CHECK(static_cast<int>(copy_engine_tokens.size()) == num_ranks &&
                  static_cast<int>(host_prefix.size()) == num_ranks * num_ranks && p.has_topk != present(cached_src_idx),
              "ep_moe.native: a copy-engine dispatch needs every rank's tokens, the R x R prefix matrix, and "
              "recv_src_idx exactly when cached");
  p.copy_engine_slot_rows = rows_capacity / num_ranks;
  for (int r = 0; r < num_ranks; ++r) {
    TORCH_CHECK(copy_engine_tokens[r] >= 0 && copy_engine_tokens[r] <= p.copy_engine_slot_rows,
                "ep_moe.native: rank ", r, "'s ", copy_engine_tokens[r], " tokens do not fit its slot of ",
                p.copy_engine_slot_rows, " rows");
    p.copy_engine_tokens[r] = static_cast<int32_t>(copy_engine_tokens[r]);
  }
  TORCH_CHECK(p.copy_engine_tokens[env.env.rank] == p.num_tokens, "ep_moe.native: x has ", p.num_tokens,
              " tokens but the layout ", p.copy_engine_tokens[env.env.rank]);
  const std::vector<int32_t> prefix32(host_prefix.begin(), host_prefix.end());
  TORCH_CHECK(p.num_recv_rows == prefix32[(num_ranks - 1) * num_ranks + env.env.rank],
              "ep_moe.native: a copy-engine dispatch receives exactly its rows (no padding)");
  if (present(cached_src_idx)) {
    check_cuda(*cached_src_idx, "cached_src_idx");
    TORCH_CHECK(cached_src_idx->scalar_type() == at::kInt && cached_src_idx->numel() >= recv_x.size(0),
                "ep_moe.native: cached_src_idx must be int32 with a row per received row");
    p.cached_src_idx = cached_src_idx->data_ptr<int32_t>();
  }
  // The kernel goes first: the copy stream's first operation waits for its go word (see combine).
  check_launch(ep_moe::launch_dispatch(p, stream), "dispatch");
  const std::vector<cudaStream_t> copy_streams = as_streams(copy_engine_streams);
  check_launch(
      ep_moe::enqueue_copy_engine_dispatch(p, prefix32.data(), stream_set(copy_streams, copy_engine_flag_stream)),
      "the dispatch's copy-engine pushes");
}

void combine(const Env& env, const std::vector<int64_t>& data_ptrs, int64_t off_y, int64_t off_weights,
             int64_t rows_capacity, const at::Tensor& rank_prefix_matrix, const at::Tensor& is_token_in_rank,
             const at::Tensor& pos, const at::Tensor& y, const OptTensor& weights, const OptTensor& bias0,
             const OptTensor& bias1, const at::Tensor& out, const OptTensor& out_weights, int64_t num_blocks,
             int64_t num_push_blocks, const OptTensor& trace, const std::vector<int64_t>& copy_engine_streams,
             int64_t copy_engine_flag_stream, int64_t copy_engine_seq, const OptTensor& copy_engine_go,
             const std::vector<int64_t>& copy_engine_shares,
             const std::vector<int64_t>& host_prefix, bool bulk_reduce, const std::vector<int64_t>& header,
             const OptTensor& test_perturb, const OptTensor& expert_y, const OptTensor& expert_weights,
             const OptTensor& sorted_slots) {
  // expert_y (CombineParams): an expert-major combine; y then holds the own rows only ([N, H], N = the rows of
  // sorted_slots [N, K]).
  const int num_ranks = env.env.num_ranks;
  TORCH_CHECK(static_cast<int>(data_ptrs.size()) == num_ranks, "ep_moe.native: data_ptrs must hold R pointers");
  check_cuda(rank_prefix_matrix, "rank_prefix_matrix");
  check_cuda(is_token_in_rank, "is_token_in_rank");
  check_cuda(pos, "pos");
  check_cuda(y, "y");
  check_cuda(out, "out");
  const int64_t num_tokens = is_token_in_rank.size(0);
  TORCH_CHECK(pos.numel() >= num_tokens * num_ranks, "ep_moe.native: pos does not match is_token_in_rank");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == num_tokens && out.size(1) == y.size(1) && out.scalar_type() == y.scalar_type(),
              "ep_moe.native: out must be [T, H] of y's dtype");
  const int64_t y_bytes = y.size(1) * y.element_size();
  TORCH_CHECK(y_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "ep_moe.native: rows must be 16-byte multiples at 16-byte-aligned addresses");
  ep_moe::CombineParams p{};
  p.env = env.env;
  p.env.chunks_per_pair = env.combine_chunks_per_pair;
  for (int r = 0; r < num_ranks; ++r) p.data[r] = reinterpret_cast<uint8_t*>(data_ptrs[r]);
  p.off_y = off_y;
  p.off_weights = off_weights;
  p.rows_capacity = rows_capacity;
  p.rank_prefix_matrix = rank_prefix_matrix.data_ptr<int32_t>();
  p.is_token_in_rank = is_token_in_rank.data_ptr<bool>();
  p.pos = pos.data_ptr<int32_t>();
  p.num_tokens = static_cast<int>(num_tokens);
  p.y = reinterpret_cast<const uint8_t*>(y.data_ptr());
  p.y_type = elem_type(y, "y");
  p.hidden = static_cast<int>(y.size(1));
  p.has_weights = present(weights);
  p.weights = ptr_or_null<const float>(weights, "topk_weights");
  p.num_topk = p.has_weights ? static_cast<int>(weights->size(1)) : 0;
  p.out_weights = ptr_or_null<float>(out_weights, "out_weights");
  TORCH_CHECK(p.has_weights == present(out_weights), "ep_moe.native: weights and out_weights go together");
  if (p.has_weights)
    TORCH_CHECK(out_weights->dim() == 2 && out_weights->size(0) == num_tokens && out_weights->size(1) == p.num_topk,
                "ep_moe.native: out_weights must be [T, K]");
  p.bias0 = ptr_or_null<const void>(bias0, "bias0");
  p.bias1 = ptr_or_null<const void>(bias1, "bias1");
  p.bias0_type = present(bias0) ? elem_type(*bias0, "bias0") : ep_moe::kNone;
  p.bias1_type = present(bias1) ? elem_type(*bias1, "bias1") : ep_moe::kNone;
  p.out = reinterpret_cast<uint8_t*>(out.data_ptr());
  set_launch(p, num_blocks, num_push_blocks, trace, copy_engine_streams, copy_engine_flag_stream, copy_engine_seq,
             copy_engine_go, copy_engine_shares);
  p.bulk_reduce = bulk_reduce;
  p.check = header_check(header, true, test_perturb);  // with the handle's layout digest
  p.check.header[ep_moe::kHeaderCopySeq] = static_cast<int32_t>(copy_engine_seq);
  if (present(expert_y)) {
    TORCH_CHECK(present(sorted_slots), "ep_moe.native: expert_y needs sorted_slots");
    check_cuda(*expert_y, "expert_y");
    check_cuda(*sorted_slots, "sorted_slots");
    TORCH_CHECK(expert_y->dim() == 2 && expert_y->size(1) == y.size(1) && expert_y->scalar_type() == y.scalar_type() &&
                    reinterpret_cast<uintptr_t>(expert_y->data_ptr()) % 16 == 0,
                "ep_moe.native: expert_y must be [M, H] of y's dtype at a 16-byte-aligned address");
    TORCH_CHECK(sorted_slots->dim() == 2 && sorted_slots->size(0) == y.size(0) &&
                    sorted_slots->scalar_type() == at::kLong && copy_engine_seq == 0,
                "ep_moe.native: an expert-major combine needs sorted_slots [N, K] int64 (N = y's rows) and no copy "
                "engine");
    p.expert_y = reinterpret_cast<const uint8_t*>(expert_y->data_ptr());
    p.expert_weights = ptr_or_null<const float>(expert_weights, "expert_weights");
    if (p.expert_weights != nullptr)
      TORCH_CHECK(expert_weights->numel() == expert_y->size(0), "ep_moe.native: expert_weights must be [M]");
    p.sorted_slots = sorted_slots->data_ptr<int64_t>();
    p.expert_topk = static_cast<int>(sorted_slots->size(1));
    p.expert_slots = expert_y->size(0);
  }
  std::vector<int32_t> prefix32;
  if (copy_engine_seq > 0) {  // the copies are not bounds-checked: every rank's rows back must fit
    TORCH_CHECK(static_cast<int>(host_prefix.size()) == num_ranks * num_ranks,
                "ep_moe.native: host_prefix must hold the R x R rank prefix matrix");
    prefix32.assign(host_prefix.begin(), host_prefix.end());
    const int64_t most = ep_moe::most_rows_back(prefix32.data(), num_ranks);
    TORCH_CHECK(most <= rows_capacity, "ep_moe.native: a rank gets ", most,
                " rows back but the symmetric buffer holds ", rows_capacity);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  if (copy_engine_seq == 0) {
    check_launch(ep_moe::launch_combine(p, stream), "combine");
    return;
  }
  // The kernel goes first: the copy stream's first operation waits for the kernel's go word, and streams
  // can share a hardware queue, where that wait would hold back a kernel queued after it (a deadlock,
  // seen on 2 x H200 when the copies were queued first).
  check_launch(ep_moe::launch_combine(p, stream), "combine");
  const std::vector<cudaStream_t> copy_streams = as_streams(copy_engine_streams);
  check_launch(
      ep_moe::enqueue_copy_engine_combine(p, prefix32.data(), stream_set(copy_streams, copy_engine_flag_stream)),
      "the combine's copy-engine pushes");
}

void barrier(const Env& env) {
  check_launch(ep_moe::launch_barrier(env.env, c10::cuda::getCurrentCUDAStream().stream()), "barrier");
}

// A header exchange before a host-side decision (kernels.h, launch_exchange); the result goes where the
// notify's header check writes it in host_counts. `prefix`: the handle's [R, R] int32 rank_prefix_matrix,
// whose layout digest fills the layout slot (absent: the header's own value).
void exchange(const Env& env, const std::vector<int64_t>& header, const OptTensor& prefix, const at::Tensor& host_counts,
              const OptTensor& test_perturb) {
  const int num_ranks = env.env.num_ranks;
  const int64_t host_words = num_ranks * (num_ranks + 1) + num_ranks * ep_moe::kHeaderWords + ep_moe::kHeaderLen + 1;
  TORCH_CHECK(!host_counts.is_cuda() && host_counts.is_pinned() && host_counts.scalar_type() == at::kInt &&
                  host_counts.numel() >= host_words,
              "ep_moe.native: host_counts must be pinned int32 of at least ", host_words, " words");
  int32_t* host_dev = nullptr;
  TORCH_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host_counts.data_ptr(), 0) == cudaSuccess,
              "ep_moe.native: host_counts is not device-mapped");
  const bool with_prefix = present(prefix);
  if (with_prefix)
    TORCH_CHECK(prefix->is_cuda() && prefix->is_contiguous() && prefix->scalar_type() == at::kInt &&
                    prefix->numel() == num_ranks * num_ranks,
                "ep_moe.native: prefix must be a contiguous [R, R] int32 CUDA tensor");
  const ep_moe::HeaderCheck check = header_check(header, with_prefix, test_perturb);
  check_launch(ep_moe::launch_exchange(env.env, check, with_prefix ? prefix->data_ptr<int32_t>() : nullptr,
                                       host_dev + num_ranks * (num_ranks + 1), c10::cuda::getCurrentCUDAStream().stream()),
               "exchange");
}

void close_epoch(const Env& env) {
  check_launch(ep_moe::launch_close_epoch(env.env, c10::cuda::getCurrentCUDAStream().stream()), "close_epoch");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ep_moe native intranode kernels (layout, notify, dispatch, combine, barrier)";
  m.attr("MAX_RANKS") = ep_moe::kMaxRanks;
  m.attr("MAX_CHUNKS") = ep_moe::kMaxChunks;
  m.attr("CONTROL_BYTES") = ep_moe::kControlBytes;
  m.attr("MAX_NOTIFY_EXPERTS") = ep_moe::kMaxNotifyExperts;
  m.attr("ERROR_WORDS") = static_cast<int>(ep_moe::kErrWords);
  m.attr("TRACE_SLOTS") = static_cast<int>(ep_moe::kTraceSlots);
  m.attr("COPY_ENGINE_TRACE_SLOTS") = ep_moe::kCopyEngineTraceSlots;
  m.attr("MAX_COPY_ENGINE_CHUNKS") = ep_moe::kMaxCopyEngineChunks;
  m.attr("MISMATCH_WORDS") = static_cast<int>(ep_moe::kMismatchWords);
  m.attr("HEADER_LEN") = ep_moe::kHeaderLen;
  m.attr("HEADER_WORDS") = ep_moe::kHeaderWords;
  pybind11::class_<Env>(m, "Env")
      .def(pybind11::init<int, const std::vector<int64_t>&, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, int64_t>(),
           pybind11::arg("rank"), pybind11::arg("ctrl_ptrs"), pybind11::arg("state"), pybind11::arg("error"),
           pybind11::arg("timeout_ns"), pybind11::arg("dispatch_chunks"),
           pybind11::arg("combine_chunks"), pybind11::arg("min_chunk_rows"));
  m.def("layout", &layout, "dispatch layout of topk_idx");
  m.def("notify", &notify, "count exchange and per-destination token lists");
  m.def("dispatch", &dispatch, "dispatch rows to their destinations");
  m.def("combine", &combine, "return rows to their sources and sum per token");
  m.def("barrier", &barrier, "device barrier over the group");
  m.def("close_epoch", &close_epoch, "close the epoch of a notify that no dispatch kernel follows");
  m.def("exchange", &exchange, "header exchange before a host-side decision (every rank's header to host_counts)");
}
