// The intranode kernels (layout, notify, dispatch, combine, barrier) as one JIT module: dispatch_layout.cuh and
// intranode_kernels.cuh, device code only (ep_moe/native/jit/intranode.py fills the parameter structs and launches
// from Python).
// One generic build per architecture: nothing is specialized (the kernels take ranks, rows and types at run time).
//
// The kernels keep their C++ names (in an unnamed namespace); intranode.py finds them in the CUBIN's symbol table.
// The combine's two instantiations (bf16 and fp32 rows) are made here.
#include "dispatch_layout.cuh"
#include "intranode_kernels.cuh"

namespace ep_moe {
namespace {
template __global__ void combine_kernel<kBF16>(CombineParams);
template __global__ void combine_kernel<kFP32>(CombineParams);
}  // namespace
}  // namespace ep_moe

// A member's offset (NVRTC has no <cstddef>): the address of the member of a struct at address 0.
#define EP_OFFSET_OF(T, member) (reinterpret_cast<long long>(&(reinterpret_cast<T*>(0)->member)))

// The constants the Python launchers use (ep_moe/native/jit/params.py: CONSTANTS, in this order), written once at
// first use: compared with the mirror there (a header change that the mirror missed raises instead of launching),
// and, for the control block's copy-engine flags (whose offset may move as fields are added), used from here.
extern "C" __global__ void ep_intranode_constants(long long* out) {
  using namespace ep_moe;
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const long long values[] = {kMaxRanks, kMaxChunks, kMaxNotifyExperts, kControlBytes, kThreads, kMaxCopyEngineChunks,
                              kMaxCopyStreams, kErrWords, kTraceSlots, kCopyEngineTraceSlots, kNotifyThreads,
                              kLayoutThreads, kBulkStages, kReduceWarps, kBulkHeaderBytes, kBulkSmemBudget,
                              kHeaderLen, kHeaderWords, kHeaderCopySeq, kMismatchWords, sizeof(Control), sizeof(LocalState), EP_OFFSET_OF(Control, copy_engine_flag)};
  for (int i = 0; i < static_cast<int>(sizeof(values) / sizeof(values[0])); ++i) out[i] = values[i];
}
