// The copy-engine half of a combine: this rank's rows go back to their sources as plain device-to-device
// copies into the peers' symmetric buffers, queued on a side stream, so that no SM pushes and every
// block of the combine kernel reduces. A combine's rows for one source are contiguous on both sides
// (y rows [rows_from_lower(src, me), +count) -> the source's buffer at rows_back_from_lower(src, me)),
// so each chunk is one copy. Measured on 2 x H200 (NOTES.md): the copy engine moves 58.7 MB into the
// peer in 160 us as one copy and ~5 us more per extra chunk with its flag write; SM pushers took ~220 us.
//
// Stream memory operations (cuStreamWaitValue64 / cuStreamWriteValue64) come from the driver through the
// runtime's entry-point query, so the extension does not link libcuda.
#include <cuda.h>

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

cudaError_t from_driver(CUresult res) {
  // The driver's and the runtime's error codes coincide for the errors these calls return.
  return res == CUDA_SUCCESS ? cudaSuccess : static_cast<cudaError_t>(res);
}

CUdeviceptr device_word(const void* p) { return reinterpret_cast<CUdeviceptr>(p); }

}  // namespace

int64_t most_rows_back(const int32_t* prefix, int num_ranks) {
  int64_t most = 0;
  for (int s = 0; s < num_ranks; ++s) {
    const int64_t rows = rows_back_from_lower(prefix, num_ranks, s, num_ranks);
    most = rows > most ? rows : most;
  }
  return most;
}

cudaError_t enqueue_copy_engine_combine(const CombineParams& p, const int32_t* prefix, cudaStream_t stream) {
  const StreamMemOps& ops = stream_mem_ops();
  if (ops.status != cudaSuccess) return ops.status;
  const KernelEnv& env = p.env;
  const int num_ranks = env.num_ranks, me = env.rank;
  const auto cu_stream = reinterpret_cast<CUstream>(stream);
  CUresult res = ops.wait(cu_stream, device_word(p.copy_engine_go), p.copy_engine_seq, CU_STREAM_WAIT_VALUE_GEQ);
  if (res != CUDA_SUCCESS) return from_driver(res);
  const int64_t y_bytes = static_cast<int64_t>(p.hidden) * (p.y_type == kBF16 ? 2 : 4);
  const int64_t w_bytes = p.has_weights ? static_cast<int64_t>(p.num_topk) * 4 : 0;
  // Chunk k of every peer in turn, so that each peer's first rows land early.
  for (int k = 0; k < p.copy_engine_chunks; ++k) {
    for (int j = 1; j < num_ranks; ++j) {
      const int src = (me + j) % num_ranks;
      const int count = pair_count(prefix, num_ranks, src, me);
      const int64_t j0 = copy_engine_chunk_end(p.copy_engine_bounds, p.copy_engine_chunks, count, k - 1);
      const int64_t j1 = copy_engine_chunk_end(p.copy_engine_bounds, p.copy_engine_chunks, count, k);
      if (j1 == j0) continue;  // an empty chunk: the reducers never wait for it
      const int64_t my_rows = rows_from_lower(prefix, num_ranks, src, me);
      const int64_t base = rows_back_from_lower(prefix, num_ranks, src, me);
      uint8_t* data = p.data[src];
      cudaError_t err;
      if (j0 == 0 && w_bytes > 0) {  // the top-k weights go with the pair's first rows
        err = cudaMemcpyAsync(data + p.off_weights + base * w_bytes,
                              reinterpret_cast<const uint8_t*>(p.weights) + my_rows * w_bytes, count * w_bytes,
                              cudaMemcpyDeviceToDevice, stream);
        if (err != cudaSuccess) return err;
      }
      err = cudaMemcpyAsync(data + p.off_y + (base + j0) * y_bytes, p.y + (my_rows + j0) * y_bytes,
                            (j1 - j0) * y_bytes, cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) return err;
      const uint64_t* flag = &reinterpret_cast<const Control*>(env.ctrl[src])->copy_engine_flag[me][k];
      // Default flags: the write waits for the stream's earlier writes (a system-wide fence first).
      res = ops.write(cu_stream, device_word(flag), p.copy_engine_seq, CU_STREAM_WRITE_VALUE_DEFAULT);
      if (res != CUDA_SUCCESS) return from_driver(res);
    }
  }
  return cudaSuccess;
}

}  // namespace ep_moe
