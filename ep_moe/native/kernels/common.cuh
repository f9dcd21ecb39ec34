// Shared device helpers of the intranode kernels: the control-block layout, memory-ordering
// primitives over NVLink (system scope), bounded waits that record an error instead of hanging,
// and 16-byte copy loops. Pure CUDA; no torch.
#pragma once

#include "kernels.h"

namespace ep_moe {

// ------------------------------------------------------------------------------------------ layout
// One `Control` lives at the start of every rank's symmetric control buffer. A peer writes only the
// slots indexed by its own rank; the owner only reads them. Every flag holds an epoch (the 1-based
// index of a collective operation, identical on all ranks), compared with >=, so slots never need
// resetting: a later epoch also satisfies an earlier wait, and the handshake at the start of every
// operation guarantees that a peer never writes data of epoch e+1 before the owner left epoch e.
struct Control {
  uint64_t arrive[kMaxRanks];                          // arrive[p]: last epoch rank p entered
  uint64_t count_flag[2][kMaxRanks];                   // [epoch parity][source]
  int32_t counts[2][kMaxRanks][kMaxRanks];             // [epoch parity][source][destination]
  int32_t tokens[2][kMaxRanks];                        // [epoch parity][source]: the source's tokens
  int32_t expert_counts[2][kMaxRanks][kMaxNotifyExperts];  // [epoch parity][source][local expert of the owner]
  uint64_t dispatch_flag[kMaxRanks][kMaxChunks];       // [source][chunk] rows of dispatch landed
  uint64_t combine_flag[kMaxRanks][kMaxChunks];        // [source][chunk] rows of combine landed
  // [source][chunk] rows of a copy-engine dispatch or combine landed; holds the host's copy-engine sequence
  // number (written by the source's copy stream, which knows no epoch), compared with >= like the epochs.
  uint64_t copy_engine_flag[kMaxRanks][kMaxChunks];
  // [epoch parity][source]: the source's header of the operation (HeaderSlot), written before the source releases
  // its arrive (so an acquired arrive covers it); the parity keeps epoch e's readable while e + 1's arrive.
  int32_t header[2][kMaxRanks][kHeaderWords];
  // [source]: the last epoch the source closed after a disagreement, once its own copy-engine copies landed
  // (see close_after_disagreement in intranode_kernels.cuh).
  uint64_t closed[kMaxRanks];
};
static_assert(sizeof(Control) <= kControlBytes, "control block too large");

// Per-rank device state that only the rank itself touches (ordinary device memory).
struct LocalState {
  uint64_t seq;     // epochs completed on this rank
  int32_t done;     // blocks of the running kernel that have finished (last one resets it)
  int32_t skip;     // 1: the current dispatch must move nothing (capacity error, same on all ranks)
  int32_t abort;    // 1: a wait timed out; every other wait gives up at once
  int32_t pad[3];
};

// ------------------------------------------------------------------------------------------ memory ops
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ int32_t ld_acquire_sys_s32(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Bulk row loads, input and peer-written data alike: L2 only (never a stale L1 line). The non-coherent
// path (ld.global.nc) copies slower (benchmarks/copy_rates.py; docs/native.md).
__device__ __forceinline__ int4 ld_cg(const int4* p) { return __ldcg(p); }

// ------------------------------------------------------------------------------------------ bulk copies
// cp.async.bulk moves a whole row segment from global into shared memory with one instruction, completing
// on an mbarrier (transaction bytes); a warp keeps many such segments in flight without registers.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes initialized mbarriers visible to the async proxy, which completes the bulk copies on them.
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// This thread's arrival, announcing `bytes` of bulk copies that complete on the barrier's current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Until the barrier's phase of this parity completed (its bulk copies landed in shared memory).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}
// `bytes` (a multiple of 16, 16-byte aligned both sides) from global into this block's shared memory.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// Orders this thread's earlier generic-proxy accesses (and what it acquired) before its later bulk copies:
// of global memory (rows whose landing flag was acquired), of shared memory (a stage the warp read).
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ------------------------------------------------------------------------------------------ errors
// What a failing wait needs to report (scalars, so that no kernel parameter is copied to local memory).
struct WaitCtx {
  LocalState* state;
  int32_t* error;
  uint64_t timeout_ns;
  int rank;
};

__device__ __forceinline__ WaitCtx wait_ctx(const KernelEnv& env) {
  return WaitCtx{env.state, env.error, env.timeout_ns, env.rank};
}

static __device__ __noinline__ void record_error(WaitCtx ctx, int code, int stage, int peer, int detail, int64_t value) {
  // The first failing thread on this rank claims the record; the rest only see `abort`.
  if (atomicCAS(&ctx.state->abort, 0, 1) != 0) return;
  volatile int32_t* rec = ctx.error;
  rec[kErrRank] = ctx.rank;
  rec[kErrStage] = stage;
  rec[kErrChannel] = static_cast<int32_t>(blockIdx.x);
  rec[kErrPeer] = peer;
  rec[kErrDetail] = detail;
  rec[kErrValueLo] = static_cast<int32_t>(value & 0xffffffff);
  rec[kErrValueHi] = static_cast<int32_t>(value >> 32);
  __threadfence_system();
  rec[kErrCode] = code;
  __threadfence_system();
}

// Wait until *flag >= target. Returns false (after recording the error) on timeout, or at once when
// another wait on this rank already failed.
static __device__ __noinline__ bool wait_flag(WaitCtx ctx, const uint64_t* flag, uint64_t target, int stage, int peer,
                                       int detail) {
  if (ld_acquire_sys(flag) >= target) return true;
  const uint64_t start = global_timer_ns();
  while (true) {
    if (ld_acquire_sys(flag) >= target) return true;
    if (*reinterpret_cast<volatile int32_t*>(&ctx.state->abort) != 0) return false;
    const uint64_t waited = global_timer_ns() - start;
    if (waited > ctx.timeout_ns) {
      record_error(ctx, kErrorTimeout, stage, peer, detail, static_cast<int64_t>(waited));
      return false;
    }
  }
}

// ------------------------------------------------------------------------------------------ rank agreement
// The layout digest of a [R, R] rank_prefix_matrix, as ep_moe.backends.agreement.layout_digest computes it:
// 1 + (sum_i (prefix[i] mod P) * 48271^(i + 1) mod P) mod P with P = 2^31 - 1 (equal on every rank, whatever
// the handle's way there). Host and device alike, so that the host code and tests can check it.
constexpr uint64_t kDigestPrime = 2147483647ull;
// a * b mod P for a, b < P (P is a Mersenne prime: two folds instead of a 64-bit division)
__host__ __device__ __forceinline__ uint64_t digest_mulmod(uint64_t a, uint64_t b) {
  uint64_t x = a * b;
  x = (x & kDigestPrime) + (x >> 31);
  x = (x & kDigestPrime) + (x >> 31);
  return x >= kDigestPrime ? x - kDigestPrime : x;
}
__host__ __device__ __forceinline__ uint64_t digest_multiplier(int i) {  // 48271^(i + 1) mod P
  uint64_t result = 1, base = 48271, e = static_cast<uint64_t>(i) + 1;
  while (e) {
    if (e & 1) result = digest_mulmod(result, base);
    base = digest_mulmod(base, base);
    e >>= 1;
  }
  return result;
}
__host__ __device__ __forceinline__ uint64_t digest_term(const int32_t* prefix, int i) {
  return digest_mulmod(static_cast<uint64_t>(prefix[i]) % kDigestPrime, digest_multiplier(i));
}
__host__ __device__ __forceinline__ int32_t layout_digest_of(uint64_t sum_of_terms) {
  return static_cast<int32_t>(sum_of_terms % kDigestPrime + 1);
}
// Warp: the digest of `prefix` ([num_ranks^2] int32, global or shared memory), on every lane.
__device__ __forceinline__ int32_t warp_layout_digest(const int32_t* prefix, int num_ranks) {
  uint64_t sum = 0;
  for (int i = threadIdx.x & 31; i < num_ranks * num_ranks; i += 32) sum += digest_term(prefix, i);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  return layout_digest_of(sum);
}

// Thread: the mismatch record (kernels.h, MismatchWord) from this rank's header and every rank's as seen
// (`seen(r, s)`), unless an earlier one is still unread by the host.
template <typename Seen>
__device__ __forceinline__ void record_mismatch(const WaitCtx& ctx, int num_ranks, const int32_t* own, Seen seen) {
  volatile int32_t* rec = ctx.error + kErrWords;
  if (rec[kMismatchFound] != 0) return;
  rec[kMismatchRank] = ctx.rank;
  rec[kMismatchRanks] = num_ranks;
  for (int s = 0; s < kHeaderLen; ++s) rec[kMismatchOwn + s] = own[s];
  for (int r = 0; r < num_ranks; ++r)
    for (int s = 0; s < kHeaderLen; ++s) rec[kMismatchSeen + r * kHeaderLen + s] = seen(r, s);
  __threadfence_system();
  rec[kMismatchFound] = own[kHeaderOp];
  __threadfence_system();
}

// ------------------------------------------------------------------------------------------ copies
constexpr int kUnroll = 8;  // 16-byte loads in flight per thread

// A lane's U words of a row at base, base + 32, ... (those below n16): one round of loads in flight.
template <int U>
__device__ __forceinline__ void load_lane_words(int4 (&v)[U], const int4* src, int base, int n16) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (base + u * 32 < n16) v[u] = ld_cg(src + base + u * 32);
}

// One warp copies n16 16-byte words (a row), kUnroll loads in flight per lane.
__device__ __forceinline__ void warp_copy16(int4* dst, const int4* src, int n16, int lane) {
  for (int base = lane; base < n16; base += 32 * kUnroll) {
    int4 v[kUnroll];
    load_lane_words(v, src, base, n16);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * 32 < n16) dst[base + u * 32] = v[u];
  }
}

// ------------------------------------------------------------------------------------------ rows
// Rows destination r receives from sources below s (where s's rows start among r's), from the
// cumulative matrix (in shared memory on the device; the host copy for the copy engine).
__host__ __device__ __forceinline__ int rows_from_lower(const int32_t* prefix, int num_ranks, int s, int r) {
  return s > 0 ? prefix[(s - 1) * num_ranks + r] : 0;
}
// Rows source s sends destination r.
__host__ __device__ __forceinline__ int pair_count(const int32_t* prefix, int num_ranks, int s, int r) {
  return prefix[s * num_ranks + r] - rows_from_lower(prefix, num_ranks, s, r);
}
// Rows rank s gets back in a combine from its peers below r (its own rows are read in place, never
// sent): where peer r's rows start in s's combine buffer; r = num_ranks gives all of them.
__host__ __device__ __forceinline__ int64_t rows_back_from_lower(const int32_t* prefix, int num_ranks, int s, int r) {
  int64_t rows = 0;
  for (int q = 0; q < r; ++q)
    if (q != s) rows += pair_count(prefix, num_ranks, s, q);
  return rows;
}

// Chunking of the rows one source sends one destination: both sides derive it from the count alone.
__device__ __forceinline__ int chunk_rows(int count, const KernelEnv& env) {
  const int by_max = (count + env.chunks_per_pair - 1) / env.chunks_per_pair;
  return by_max > env.min_chunk_rows ? by_max : env.min_chunk_rows;
}
__device__ __forceinline__ int num_chunks(int count, const KernelEnv& env) {
  if (count <= 0) return 0;
  const int rows = chunk_rows(count, env);
  return (count + rows - 1) / rows;
}

// End (exclusive) of chunk k of `count` rows cut into n copy-engine chunks (a combine's rows of one pair, a
// dispatch's tokens of one source): `bounds` are the n + 1 cumulative shares of CopyEngineParams::bounds.
__host__ __device__ __forceinline__ int copy_engine_chunk_end(const int32_t* bounds, int n, int count, int k) {
  return static_cast<int>(static_cast<int64_t>(count) * bounds[k + 1] / bounds[n]);
}

}  // namespace ep_moe
