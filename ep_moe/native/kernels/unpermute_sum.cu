// out[i] = (fp32 sum over the slots s of sorted_slots[i] in [0, M), in order, from 0, of weights[s] * y[s] (the
// product rounded first: no fused multiply-add) or of y[s]).to(dtype); with EP_PAIR_VALUES,
// pair_values[i * K + k] = slot_values[slot_of_pair[i * K + k]] or 0. EP_ROW_THREADS threads per row (32 when not
// given), 256 threads per block.
// Specialization: EP_DTYPE (0 bf16, 1 fp32), EP_VEC (elements per 16-byte pack, 1 when the hidden size or a
// pointer does not allow packs), EP_PACKS (H / EP_VEC), EP_TOPK (K), EP_WEIGHTED and EP_PAIR_VALUES (0/1),
// EP_ROW_THREADS (32, 64, 128 or 256). A compile-time K keeps a row's weights in registers and issues its K loads
// together; more threads per row put more of a row's loads in flight at once (each thread sums its own
// packs, so the result does not depend on the thread count).
#include "ep_jit.cuh"

#if !defined(EP_DTYPE) || !defined(EP_VEC) || !defined(EP_PACKS) || !defined(EP_TOPK) || !defined(EP_WEIGHTED) || \
    !defined(EP_PAIR_VALUES)
#error "unpermute_sum.cu needs EP_DTYPE, EP_VEC, EP_PACKS, EP_TOPK, EP_WEIGHTED and EP_PAIR_VALUES"
#endif
#ifndef EP_ROW_THREADS
#define EP_ROW_THREADS 32
#endif

namespace {
using namespace ep_jit;
typedef RowType<EP_DTYPE>::type T;
typedef Pack<T, EP_VEC> P;
constexpr int kVec = EP_VEC;
constexpr i64 kPacks = EP_PACKS;
constexpr int kTopk = EP_TOPK;
constexpr int kRowThreads = EP_ROW_THREADS;
static_assert(kRowThreads >= kWarp && 256 % kRowThreads == 0, "EP_ROW_THREADS must be 32, 64, 128 or 256");
constexpr int kRowsPerBlock = 256 / kRowThreads;
}  // namespace

extern "C" __global__ void __launch_bounds__(256)
ep_unpermute_sum(const P* __restrict__ y, P* __restrict__ out, i64 num_rows, i64 num_slots,
                 const float* __restrict__ weights, const i64* __restrict__ sorted_slots,
                 const float* __restrict__ slot_values, const i64* __restrict__ slot_of_pair,
                 float* __restrict__ pair_values) {
  const i64 row = static_cast<i64>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowThreads;
  if (row >= num_rows) return;
  const int lane = threadIdx.x % kRowThreads;
  const i64* row_slots = sorted_slots + row * kTopk;
  float w[kTopk];
#pragma unroll
  for (int j = 0; j < kTopk; ++j) {
    const i64 s = __ldg(row_slots + j);
    w[j] = (EP_WEIGHTED && s >= 0 && s < num_slots) ? __ldg(weights + s) : 1.0f;
  }
  P* dst = out + row * kPacks;
  for (i64 c = lane; c < kPacks; c += kRowThreads) {
    float acc[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) acc[v] = 0.0f;
#pragma unroll
    for (int j = 0; j < kTopk; ++j) {
      // the slot read again per pack (an L1 hit) rather than held in registers: fewer registers, more warps
      // resident, faster on large inputs
      const i64 s = __ldg(row_slots + j);
      if (s < 0 || s >= num_slots) continue;
      const P term = y[s * kPacks + c];
#pragma unroll
      for (int v = 0; v < kVec; ++v)
        acc[v] = EP_WEIGHTED ? __fadd_rn(acc[v], __fmul_rn(w[j], to_f32(term.v[v]))) : __fadd_rn(acc[v], to_f32(term.v[v]));
    }
    P result;
#pragma unroll
    for (int v = 0; v < kVec; ++v) result.v[v] = from_f32<T>(acc[v]);
    dst[c] = result;
  }
  if (EP_PAIR_VALUES)
    for (int k = lane; k < kTopk; k += kRowThreads) {
      const i64 s = slot_of_pair[row * kTopk + k];
      pair_values[row * kTopk + k] = (s >= 0 && s < num_slots) ? slot_values[s] : 0.0f;
    }
}
