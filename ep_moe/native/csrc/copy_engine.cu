// The copy-engine halves of a combine and of a cached dispatch: rows travel as plain device-to-device copies
// into the peers' symmetric buffers, queued on a side stream, so that no SM pushes (every block of the
// kernel reduces or copies locally). Dispatch: this rank's whole x goes, token-indexed, into its slot of
// every peer's buffer (the peer picks the rows it receives; worth it where nearly every token goes to every
// peer, as with top-8 of 256 experts on 2 ranks). Combine: the rows for one source are contiguous on both
// sides (y rows [rows_from_lower(src, me), +count) -> the source's buffer at rows_back_from_lower(src, me)),
// so each chunk is one copy. Every chunk adds a fixed cost (its copy call and flag write), so a call cuts its
// rows into a few chunks only; measurements against SM pushers are in CHANGELOG.md.
//
// Stream memory operations (cuStreamWaitValue64 / cuStreamWriteValue64) come from the driver through the
// runtime's entry-point query, so the extension does not link libcuda.
#include <cuda.h>

#include <array>
#include <map>
#include <mutex>

#include "common.cuh"

namespace ep_moe {
namespace {

using StreamValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

struct StreamMemOps {
  StreamValue64 wait = nullptr, write = nullptr;
  cudaError_t status = cudaSuccess;
};

cudaError_t driver_entry(const char* name, StreamValue64* fn) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult found;
  // Version 12000 asks for the CUDA 12 ABI (the "_v2" stream memory operations, always supported).
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &ptr, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess) return err;
  if (found != cudaDriverEntryPointSuccess || ptr == nullptr) return cudaErrorNotSupported;
  *fn = reinterpret_cast<StreamValue64>(ptr);
  return cudaSuccess;
}

const StreamMemOps& stream_mem_ops() {
  static const StreamMemOps ops = [] {
    StreamMemOps o;
    o.status = driver_entry("cuStreamWaitValue64", &o.wait);
    if (o.status == cudaSuccess) o.status = driver_entry("cuStreamWriteValue64", &o.write);
    return o;
  }();
  return ops;
}

#define EP_MOE_TRY(expr)                        \
  do {                                          \
    const cudaError_t err_ = (expr);            \
    if (err_ != cudaSuccess) return err_;       \
  } while (0)

cudaError_t from_driver(CUresult res) {
  // The driver's and the runtime's error codes coincide for the errors these calls return.
  return res == CUDA_SUCCESS ? cudaSuccess : static_cast<cudaError_t>(res);
}

// `after` waits for the work queued so far on `before`, through an event per chunk k created once per
// device. The lock covers the record and the wait together: a stream wait takes the event's state when it is
// queued, so the event can be reused by the next call, but not re-recorded in between by another thread.
cudaError_t wait_for_chunk(int k, cudaStream_t before, cudaStream_t after) {
  static std::mutex mutex;
  static std::map<int, std::array<cudaEvent_t, kMaxCopyEngineChunks>> pools;
  int device = 0;
  EP_MOE_TRY(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  auto it = pools.find(device);
  if (it == pools.end()) {
    std::array<cudaEvent_t, kMaxCopyEngineChunks> pool{};
    for (cudaEvent_t& e : pool) EP_MOE_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    it = pools.emplace(device, pool).first;
  }
  EP_MOE_TRY(cudaEventRecord(it->second[k], before));
  return cudaStreamWaitEvent(after, it->second[k], 0);
}

// What one copy-engine call queues on its streams (CopyStreamSet): on each copy stream, the wait for the
// kernel's go word; then chunk k's device-to-device copies on copy stream k % num_copy and, per peer, its
// flag write into the peer's copy_engine_flag[this rank][k]: on the same stream after the peer's copies, or,
// with a flag stream, on it after an event behind all peers' copies of the chunk. Two copy streams let one
// chunk's copies run while another's flag write drains; a flag stream keeps the copies back to back.
class CopyStreams {
 public:
  CopyStreams(const KernelEnv& env, const CopyEngineParams& ce, const CopyStreamSet& set)
      : env_(env), ce_(ce), set_(set) {}

  cudaError_t wait_for_go() const {
    const StreamMemOps& ops = stream_mem_ops();
    if (ops.status != cudaSuccess) return ops.status;
    for (int i = 0; i < set_.num_copy; ++i)
      EP_MOE_TRY(from_driver(ops.wait(cu_stream(set_.copy[i]), reinterpret_cast<CUdeviceptr>(ce_.go), ce_.seq,
                                      CU_STREAM_WAIT_VALUE_GEQ)));
    return cudaSuccess;
  }
  // A copy that belongs to chunk k.
  cudaError_t copy(int k, uint8_t* dst, const uint8_t* src, int64_t bytes) const {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, copy_stream(k));
  }
  // Chunk k's copies into `peer` are queued: its flag write now (inline), or with the chunk's other peers
  // at chunk_queued (flag stream).
  cudaError_t peer_queued(int peer, int k) {
    if (set_.flags == nullptr) return publish(copy_stream(k), peer, k);
    pending_ |= 1u << peer;
    return cudaSuccess;
  }
  // Every peer's copies of chunk k are queued (flag stream: event, wait, the pending peers' flag writes).
  cudaError_t chunk_queued(int k) {
    if (set_.flags == nullptr || pending_ == 0) return cudaSuccess;
    EP_MOE_TRY(wait_for_chunk(k, copy_stream(k), set_.flags));
    for (int peer = 0; peer < env_.num_ranks; ++peer)
      if ((pending_ >> peer) & 1u) EP_MOE_TRY(publish(set_.flags, peer, k));
    pending_ = 0;
    return cudaSuccess;
  }
  // First row of chunk k of n rows (k = chunks: n).
  int64_t chunk_start(int n, int k) const { return copy_engine_chunk_end(ce_.bounds, ce_.chunks, n, k - 1); }

 private:
  cudaStream_t copy_stream(int k) const { return set_.copy[k % set_.num_copy]; }
  static CUstream cu_stream(cudaStream_t s) { return reinterpret_cast<CUstream>(s); }
  // Default flags: the write waits for the stream's earlier work and writes (a system-wide fence first).
  cudaError_t publish(cudaStream_t stream, int peer, int k) const {
    const uint64_t* flag = &reinterpret_cast<const Control*>(env_.ctrl[peer])->copy_engine_flag[env_.rank][k];
    return from_driver(stream_mem_ops().write(cu_stream(stream), reinterpret_cast<CUdeviceptr>(flag), ce_.seq,
                                              CU_STREAM_WRITE_VALUE_DEFAULT));
  }
  const KernelEnv& env_;
  const CopyEngineParams& ce_;
  const CopyStreamSet& set_;
  uint32_t pending_ = 0;  // peers whose flag for the current chunk waits for chunk_queued
};

}  // namespace

int64_t most_rows_back(const int32_t* prefix, int num_ranks) {
  int64_t most = 0;
  for (int s = 0; s < num_ranks; ++s) {
    const int64_t rows = rows_back_from_lower(prefix, num_ranks, s, num_ranks);
    most = rows > most ? rows : most;
  }
  return most;
}

cudaError_t enqueue_copy_engine_combine(const CombineParams& p, const int32_t* prefix, const CopyStreamSet& streams) {
  CopyStreams cs(p.env, p.copy_engine, streams);
  EP_MOE_TRY(cs.wait_for_go());
  const int num_ranks = p.env.num_ranks, me = p.env.rank;
  const int64_t y_bytes = static_cast<int64_t>(p.hidden) * (p.y_type == kBF16 ? 2 : 4);
  const int64_t w_bytes = p.has_weights ? static_cast<int64_t>(p.num_topk) * 4 : 0;
  // Chunk k of every peer in turn, so that each peer's first rows land early.
  for (int k = 0; k < p.copy_engine.chunks; ++k) {
    for (int j = 1; j < num_ranks; ++j) {
      const int src = (me + j) % num_ranks;
      const int count = pair_count(prefix, num_ranks, src, me);
      const int64_t j0 = cs.chunk_start(count, k), j1 = cs.chunk_start(count, k + 1);
      if (j1 == j0) continue;  // an empty chunk: the reducers never wait for it
      const int64_t my_rows = rows_from_lower(prefix, num_ranks, src, me);
      const int64_t base = rows_back_from_lower(prefix, num_ranks, src, me);
      uint8_t* data = p.data[src];
      if (j0 == 0 && w_bytes > 0)  // the top-k weights go with the pair's first rows
        EP_MOE_TRY(cs.copy(k, data + p.off_weights + base * w_bytes,
                           reinterpret_cast<const uint8_t*>(p.weights) + my_rows * w_bytes, count * w_bytes));
      EP_MOE_TRY(cs.copy(k, data + p.off_y + (base + j0) * y_bytes, p.y + (my_rows + j0) * y_bytes, (j1 - j0) * y_bytes));
      EP_MOE_TRY(cs.peer_queued(src, k));
    }
    EP_MOE_TRY(cs.chunk_queued(k));
  }
  return cudaSuccess;
}

cudaError_t enqueue_copy_engine_dispatch(const DispatchParams& p, const int32_t* prefix, const CopyStreamSet& streams) {
  CopyStreams cs(p.env, p.copy_engine, streams);
  EP_MOE_TRY(cs.wait_for_go());
  const int num_ranks = p.env.num_ranks, me = p.env.rank;
  const int64_t scale_bytes = p.has_scales ? static_cast<int64_t>(p.num_scales) * 4 : 0;
  const int64_t slot = static_cast<int64_t>(me) * p.copy_engine_slot_rows;  // this rank's rows in a peer's buffer
  const auto* scales = reinterpret_cast<const uint8_t*>(p.scales);
  // A fresh dispatch: the send list to each peer and the whole top-k go ahead of chunk 0, on its stream.
  if (p.has_topk) {
    const int64_t idx_bytes = static_cast<int64_t>(p.num_topk) * 8, w_bytes = static_cast<int64_t>(p.num_topk) * 4;
    for (int j = 1; j < num_ranks; ++j) {
      const int dst = (me + j) % num_ranks;
      uint8_t* data = p.data[dst];
      const int count = pair_count(prefix, num_ranks, me, dst);
      if (count > 0)
        EP_MOE_TRY(cs.copy(0, data + p.off_src + slot * 4,
                           reinterpret_cast<const uint8_t*>(p.send_list + static_cast<int64_t>(dst) * p.num_tokens),
                           static_cast<int64_t>(count) * 4));
      EP_MOE_TRY(cs.copy(0, data + p.off_idx + slot * idx_bytes, reinterpret_cast<const uint8_t*>(p.topk_idx),
                         p.num_tokens * idx_bytes));
      EP_MOE_TRY(cs.copy(0, data + p.off_weights + slot * w_bytes, reinterpret_cast<const uint8_t*>(p.topk_weights),
                         p.num_tokens * w_bytes));
    }
  }
  for (int k = 0; k < p.copy_engine.chunks; ++k) {
    const int64_t t0 = cs.chunk_start(p.num_tokens, k), t1 = cs.chunk_start(p.num_tokens, k + 1);
    // An empty chunk has no waiter, except chunk 0 of a fresh dispatch (the send list comes with it).
    if (t1 == t0 && !(k == 0 && p.has_topk)) continue;
    for (int j = 1; j < num_ranks; ++j) {
      const int dst = (me + j) % num_ranks;
      uint8_t* data = p.data[dst];
      if (t1 > t0) {
        EP_MOE_TRY(cs.copy(k, data + p.off_x + (slot + t0) * p.x_bytes, p.x + t0 * p.x_bytes, (t1 - t0) * p.x_bytes));
        if (scale_bytes > 0)
          EP_MOE_TRY(cs.copy(k, data + p.off_scales + (slot + t0) * scale_bytes, scales + t0 * scale_bytes,
                             (t1 - t0) * scale_bytes));
      }
      EP_MOE_TRY(cs.peer_queued(dst, k));
    }
    EP_MOE_TRY(cs.chunk_queued(k));
  }
  return cudaSuccess;
}

}  // namespace ep_moe
