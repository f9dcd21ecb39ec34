// The generic expert-major kernels that the shape-specialized JIT sources beside this file do not cover (the
// permute of received rows left in place, the own rows of an expert-major combine, and the dense routing map to
// top-k and back) as one JIT module: expert_major_kernels.cuh (ep_moe/native/jit/expert_major_exchange.py fills the
// parameter structs and picks the instantiation). One generic build per architecture.
//
// The kernels keep their C++ names (in an unnamed namespace); the launchers find them in the CUBIN's symbol table.
// Every instantiation the launchers pick is made here.
#include "expert_major_kernels.cuh"

namespace ep_moe {
namespace {
template __global__ void permute_rows_kernel<uint4>(PermuteRowsParams);
template __global__ void permute_rows_kernel<uint32_t>(PermuteRowsParams);
template __global__ void permute_rows_kernel<uint16_t>(PermuteRowsParams);
template __global__ void permute_rows_kernel<uint8_t>(PermuteRowsParams);
template __global__ void unpermute_sum_kernel<__nv_bfloat16, 8>(UnpermuteSumParams);
template __global__ void unpermute_sum_kernel<__nv_bfloat16, 1>(UnpermuteSumParams);
template __global__ void unpermute_sum_kernel<float, 4>(UnpermuteSumParams);
template __global__ void unpermute_sum_kernel<float, 1>(UnpermuteSumParams);
template __global__ void routing_map_to_topk_kernel<__nv_bfloat16>(RoutingMapParams);
template __global__ void routing_map_to_topk_kernel<float>(RoutingMapParams);
template __global__ void routing_map_to_topk_backward_kernel<__nv_bfloat16>(RoutingMapParams);
template __global__ void routing_map_to_topk_backward_kernel<float>(RoutingMapParams);
}  // namespace
}  // namespace ep_moe

// The constants the Python launchers use (ep_moe/native/jit/params.py: EXPERT_MAJOR_CONSTANTS, in this order),
// compared with the mirror before the first launch.
extern "C" __global__ void ep_expert_major_constants(long long* out) {
  using namespace ep_moe;
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const long long values[] = {kRowThreads, kRowsPerBlock, kRowBF16, kRowFP32};
  for (int i = 0; i < static_cast<int>(sizeof(values) / sizeof(values[0])); ++i) out[i] = values[i];
}
