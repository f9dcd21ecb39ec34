// Intranode dispatch, combine and barrier over symmetric memory (NVLink peers).
//
// Dispatch: a notify kernel exchanges per-destination row counts (every rank writes its row of the
// count matrix into every peer's control block; with an exact-size dispatch, also its tokens per
// expert of each peer) and turns `is_token_in_rank` into, per destination, the list of tokens sent
// there. The dispatch kernel then splits its blocks into
//   * pushers: copy each row straight to its final position in the receiver's symmetric buffer
//     (position = rows of lower source ranks + the row's index among those sent to that receiver),
//     16-byte stores over NVLink, chunk by chunk; the last warp of the block to finish a chunk
//     publishes it with a release store to a flag in the receiver's control block;
//   * local blocks: first copy this rank's rows to itself straight into the output, then copy every
//     peer's chunk out of the symmetric buffer into the output once its flag is set (the buffer holds
//     the rows in output order); the local warps of all blocks stride over those rows together.
// Every warp walks its rows on its own, one row per warp at a time: no block-wide barrier inside the
// loops, so a warp that waits (for a flag, or for a release to reach the peer) holds up only itself.
// Combine reverses it: pushers send each received row back to its source's buffer (contiguous per
// source), and reducer warps (striding over all tokens) sum, per token, the rows of the ranks it went
// to in increasing rank order in fp32 (the own rank's rows read in place), add the biases and round once.
// In a copy-engine combine (ep_moe/native/jit/copy_engine.py) there are no pushers: every block reduces, and block 0 tells
// the copy stream when every peer entered the combine. Reducers launched with p.bulk_reduce (by default
// those of a copy-engine combine) read the rows through shared memory by bulk copies (bulk_reduce), which
// keeps far more bytes in flight per SM than loads into registers.
#pragma once

#ifndef __CUDACC_RTC__  // NVRTC: rtc_prelude.h has the bf16 conversions used here
#include <cuda_bf16.h>
#endif

#include "common.cuh"

namespace ep_moe {
namespace {

__device__ __forceinline__ Control* control_of(const KernelEnv& env, int rank) {
  return reinterpret_cast<Control*>(env.ctrl[rank]);
}

__device__ __forceinline__ uint64_t current_epoch(const KernelEnv& env) {
  return *reinterpret_cast<volatile uint64_t*>(&env.state->seq) + 1;
}

// The last block of a kernel to finish closes the epoch (`last` tells the caller it is that block).
__device__ __forceinline__ bool finish_block(const KernelEnv& env, int num_blocks, int* s_flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *s_flag = atomicAdd(&env.state->done, 1) == num_blocks - 1;
  __syncthreads();
  const bool last = *s_flag;
  if (last) __threadfence();
  return last;
}

// Stamps of this block's timeline into `trace` (see TraceSlot), when tracing is on: thread 0 stamps
// entry, work done and exit; thread 0 or 32 the first wait (pushers wait in every warp); any thread adds
// to the wait and handshake sums.
struct BlockTrace {
  int64_t* slots;
  int64_t* sums;
  bool waited = false;
  __device__ explicit BlockTrace(int64_t* trace)
      : slots(trace != nullptr && (threadIdx.x == 0 || threadIdx.x == 32)
                  ? trace + static_cast<int64_t>(blockIdx.x) * kTraceSlots
                  : nullptr),
        sums(trace != nullptr ? trace + static_cast<int64_t>(blockIdx.x) * kTraceSlots : nullptr) {
    stamp(kTraceStart);
  }
  __device__ __forceinline__ void stamp(int slot) {
    if (slots != nullptr && threadIdx.x == 0) slots[slot] = static_cast<int64_t>(global_timer_ns());
  }
  __device__ __forceinline__ void first_wait() {
    if (slots != nullptr && !waited) slots[kTraceFirstWait] = static_cast<int64_t>(global_timer_ns());
    waited = true;
  }
  // Timer for a sum slot: 0 when tracing is off (then `add` does nothing).
  __device__ __forceinline__ uint64_t now() const { return sums != nullptr ? global_timer_ns() : 0; }
  __device__ __forceinline__ void add(int slot, uint64_t since) const {
    if (sums != nullptr)
      atomicAdd(reinterpret_cast<unsigned long long*>(sums + slot), static_cast<unsigned long long>(global_timer_ns() - since));
  }
};

// ========================================================================================== rank agreement
// Every collective operation starts with every rank announcing its header (kernels.h, HeaderSlot) in every
// rank's control block before its arrival; every rank compares all R headers with its own before any row
// moves. Every rank sees the same R headers, so every rank reaches the same verdict; on a disagreement no row
// moves, the epoch still closes, and a mismatch record (not an error: the buffer stays usable) tells the host,
// which raises the ValueError of ep_moe.backends.agreement.

// This thread (r < R, of block 0): this rank's header (`digest` in the layout slot) into rank r's control block,
// then this rank's arrival there; the release store orders the header before it.
__device__ __forceinline__ void announce_header(const KernelEnv& env, const HeaderCheck& hc, int32_t digest,
                                                uint64_t epoch) {
  Control* peer = control_of(env, static_cast<int>(threadIdx.x));
  int32_t* dst = peer->header[epoch & 1][env.rank];
#pragma unroll
  for (int s = 0; s < kHeaderWords; ++s) dst[s] = s == kHeaderLayout ? digest : hc.header[s];
  st_release_sys(&peer->arrive[env.rank], epoch);
}

// Rank `src`'s header of this epoch from this rank's control block (after its arrival was acquired; L2 loads,
// never a stale L1 line), as the test perturbation (HeaderCheck::test_perturb) makes the kernel see it.
__device__ __forceinline__ void load_header(const KernelEnv& env, const HeaderCheck& hc, uint64_t epoch, int src,
                                            int32_t (&seen)[kHeaderWords]) {
  const int32_t* from = control_of(env, env.rank)->header[epoch & 1][src];
#pragma unroll
  for (int s = 0; s < kHeaderWords; ++s) seen[s] = __ldcg(from + s);
  if (hc.test_perturb != nullptr && __ldcg(hc.test_perturb) == src) {
    const int slot = __ldcg(hc.test_perturb + 1);
    const int32_t add = __ldcg(hc.test_perturb + 2);
#pragma unroll
    for (int s = 0; s < kHeaderLen; ++s)
      if (s == slot) seen[s] += add;
  }
}

enum HeaderVerdict { kHeadersAgree = 0, kHeadersDisagree = 1, kHeadersWaitFailed = 2 };

// Warp: lanes < R wait for rank `lane`'s arrival in this epoch and load its header; then every lane compares
// the R headers with this rank's own (`hc`, `digest` in the layout slot). With `record`, a disagreement writes
// the mismatch record. Lane r's `copy_seq`: rank r's kHeaderCopySeq. Ranks of which some take the copy engine
// (`copy_engine_here`) and some do not also disagree, whatever their headers (a receiver would otherwise wait
// for copies that never come, or for no number at all): that happens where only some ranks know the handle's
// layout on the host. Every warp that calls it gets the same verdict (the headers of an epoch stay put until
// every rank arrived in the next one).
__device__ HeaderVerdict check_headers_warp(const KernelEnv& env, const HeaderCheck& hc, int32_t digest, uint64_t epoch,
                                            int stage, bool record, uint64_t* copy_seq, bool copy_engine_here) {
  const int lane = threadIdx.x & 31, num_ranks = env.num_ranks;
  int32_t own[kHeaderLen], seen[kHeaderWords];
#pragma unroll
  for (int s = 0; s < kHeaderLen; ++s) own[s] = s == kHeaderLayout ? digest : hc.header[s];
#pragma unroll
  for (int s = 0; s < kHeaderWords; ++s) seen[s] = s < kHeaderLen ? own[s] : 0;
  bool ok = true;
  if (lane < num_ranks) {
    ok = wait_flag(wait_ctx(env), &control_of(env, env.rank)->arrive[lane], epoch, stage, lane, 0);
    if (ok) load_header(env, hc, epoch, lane, seen);
  }
  if (!__all_sync(0xffffffffu, ok)) return kHeadersWaitFailed;
  *copy_seq = static_cast<uint32_t>(seen[kHeaderCopySeq]);
  bool differs = lane < num_ranks && (seen[kHeaderCopySeq] != 0) != copy_engine_here;
#pragma unroll
  for (int s = 0; s < kHeaderLen; ++s) differs |= seen[s] != own[s];
  if (!__any_sync(0xffffffffu, differs)) return kHeadersAgree;
  if (record) {  // the headers are in the lanes' registers: gather them in lane 0 (a rare path)
    int32_t all[kMaxRanks * kHeaderLen];
    for (int r = 0; r < num_ranks; ++r)
#pragma unroll
      for (int s = 0; s < kHeaderLen; ++s) all[r * kHeaderLen + s] = __shfl_sync(0xffffffffu, seen[s], r);
    if (lane == 0) record_mismatch(wait_ctx(env), num_ranks, own, [&](int r, int s) { return all[r * kHeaderLen + s]; });
  }
  return kHeadersDisagree;
}

// Warp 0 of block 0 after a disagreement, on every rank (all reach the same verdict). A copy-engine call's copy
// stream was released by the go word before the verdict was known (a queued copy cannot be withdrawn, and the
// stream must never wait forever), so its rows still land in the peers' buffers, where no kernel of this epoch
// reads them. So that none lands in a later operation's rows, lane p waits until this rank's own copies into
// rank p landed (`own_copies_landed(p)`, only when this rank's call used the copy engine: `any_copy_engine`
// says whether any rank's did), then every rank releases closed[me] in every rank and waits for every rank's.
template <typename OwnCopiesLanded>
__device__ __forceinline__ void close_after_disagreement(const KernelEnv& env, uint64_t epoch, int stage,
                                                         bool any_copy_engine, OwnCopiesLanded own_copies_landed) {
  if (!any_copy_engine) return;  // nothing can land late: no rank wrote into a peer's buffer
  const int lane = threadIdx.x & 31, num_ranks = env.num_ranks, me = env.rank;
  bool ok = true;
  if (lane < num_ranks && lane != me) ok = own_copies_landed(lane);
  if (!__all_sync(0xffffffffu, ok)) return;  // a wait failed: the error record is written, the buffer is unusable
  if (lane < num_ranks) {
    st_release_sys(&control_of(env, lane)->closed[me], epoch);
    wait_flag(wait_ctx(env), &control_of(env, me)->closed[lane], epoch, stage, lane, 0);
  }
  __syncwarp();
}

// ========================================================================================== notify
constexpr int kNotifyThreads = 1024;

__device__ __forceinline__ void notify_exchange(const NotifyParams& p) {
  const KernelEnv& env = p.env;
  const int num_ranks = env.num_ranks, me = env.rank;
  const uint64_t epoch = current_epoch(env);
  const int parity = static_cast<int>(epoch & 1);
  __shared__ int32_t counts[kMaxRanks][kMaxRanks];
  __shared__ int32_t expert_hist[kMaxRanks * kMaxNotifyExperts];  // this rank's tokens per global expert
  __shared__ int ok;
  __shared__ int32_t heads[kMaxRanks][kHeaderWords];  // every rank's header as seen (the check)
  __shared__ int disagree;
  const bool with_experts = p.host_expert_counts != nullptr;
  const int num_experts = num_ranks * p.experts_per_rank;
  if (threadIdx.x == 0) ok = 1;
  if (with_experts) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) expert_hist[e] = 0;
    __syncthreads();
    const int64_t entries = static_cast<int64_t>(p.num_tokens) * p.num_topk;
    for (int64_t i = threadIdx.x; i < entries; i += blockDim.x) {
      const int64_t e = p.topk_idx[i];
      if (e >= 0 && e < num_experts) atomicAdd(&expert_hist[e], 1);
    }
    __syncthreads();
    // Peer r gets the counts of its own experts; every writer fences so that the count flag released
    // below (by threads < R, after the barrier) covers these stores too.
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x) {
      const int r = i / p.experts_per_rank;
      control_of(env, r)->expert_counts[parity][me][i - r * p.experts_per_rank] = expert_hist[i];
    }
    fence_sys();
  }
  __syncthreads();
  if (threadIdx.x < num_ranks) {
    Control* peer = control_of(env, threadIdx.x);
    for (int r = 0; r < num_ranks; ++r) {
      const int32_t c = p.counts_int64 ? static_cast<int32_t>(static_cast<const int64_t*>(p.num_tokens_per_rank)[r])
                                       : static_cast<const int32_t*>(p.num_tokens_per_rank)[r];
      peer->counts[parity][me][r] = c;
    }
    peer->tokens[parity][me] = p.num_tokens;
#pragma unroll
    for (int w = 0; w < kHeaderWords; ++w) peer->header[parity][me][w] = p.check.header[w];
    fence_sys();
    st_release_sys(&peer->count_flag[parity][me], epoch);
    st_release_sys(&peer->arrive[me], epoch);
  }
  if (threadIdx.x < num_ranks) {
    const int src = threadIdx.x;
    Control* mine = control_of(env, me);
    // The arrival (released after the count flag) rather than the count flag: a rank in another operation
    // (a cached dispatch, a combine, a barrier) announces its header and arrival but no counts, and the check
    // below turns that into a disagreement instead of a timeout.
    if (wait_flag(wait_ctx(env), &mine->arrive[src], epoch, kStageNotify, src, 0)) {
      int32_t seen[kHeaderWords];
      load_header(env, p.check, epoch, src, seen);
#pragma unroll
      for (int w = 0; w < kHeaderWords; ++w) heads[src][w] = seen[w];
      for (int r = 0; r < num_ranks; ++r) counts[src][r] = ld_acquire_sys_s32(&mine->counts[parity][src][r]);
      reinterpret_cast<volatile int32_t*>(p.host_counts)[num_ranks * num_ranks + src] =
          ld_acquire_sys_s32(&mine->tokens[parity][src]);
    } else {
      ok = 0;
    }
  }
  __syncthreads();
  if (with_experts && ok) {  // every source's flag was acquired before the barrier
    Control* mine = control_of(env, me);
    const int64_t align = p.expert_alignment;
    for (int e = threadIdx.x; e < p.experts_per_rank; e += blockDim.x) {
      int64_t sum = 0;
      for (int s = 0; s < num_ranks; ++s) sum += ld_acquire_sys_s32(&mine->expert_counts[parity][s][e]);
      reinterpret_cast<volatile int64_t*>(p.host_expert_counts)[e] = (sum + align - 1) / align * align;
    }
  }
  // The header check: the host reads every header, this rank's and the verdict after the tokens (its one wait);
  // a fixed-size dispatch, which has no host wait, also writes the mismatch record.
  if (threadIdx.x == 0) {
    volatile int32_t* out = p.host_counts + num_ranks * num_ranks + num_ranks;
    int32_t own[kHeaderLen];
#pragma unroll
    for (int w = 0; w < kHeaderLen; ++w) own[w] = p.check.header[w];
    int found = 0;
    for (int r = 0; r < num_ranks; ++r)
      for (int w = 0; w < kHeaderWords; ++w) {
        const int32_t v = ok ? heads[r][w] : 0;
        out[r * kHeaderWords + w] = v;
        if (w < kHeaderLen && ok && v != own[w]) found = 1;
      }
    for (int w = 0; w < kHeaderLen; ++w) out[num_ranks * kHeaderWords + w] = own[w];
    out[num_ranks * kHeaderWords + kHeaderLen] = found;
    if (found && p.num_worst_tokens > 0)
      record_mismatch(wait_ctx(env), num_ranks, own, [&](int r, int w) { return heads[r][w]; });
    disagree = found;
  }
  __syncthreads();
  if (disagree && threadIdx.x < 32) {  // nothing is copied in a fresh dispatch before this verdict; see there
    bool any_copy_engine = false;
    for (int r = 0; r < num_ranks; ++r) any_copy_engine |= heads[r][kHeaderCopySeq] != 0;
    close_after_disagreement(env, epoch, kStageNotify, any_copy_engine, [](int) { return true; });
  }
  if (threadIdx.x != 0) return;
  int skip = ok ? (disagree ? 1 : 0) : 1;
  volatile int32_t* host = p.host_counts;
  for (int r = 0; r < num_ranks; ++r) {
    int acc = 0;
    for (int s = 0; s < num_ranks; ++s) {
      const int c = ok ? counts[s][r] : 0;
      acc += c;
      p.rank_prefix_matrix[s * num_ranks + r] = acc;
      host[s * num_ranks + r] = c;
    }
    // Fixed-size receive (no host check follows): every rank sees the same matrix, so every rank
    // makes the same decision and none waits for rows that will never come.
    if (ok && p.num_worst_tokens > 0 && (acc > p.num_worst_tokens || acc > p.rows_capacity) && !skip) {
      skip = 1;
      record_error(wait_ctx(env), kErrorCapacity, kStageDispatchCapacity, r, p.num_worst_tokens,
                   (static_cast<int64_t>(acc) << 32) | static_cast<int64_t>(p.rows_capacity & 0xffffffff));
    }
  }
  env.state->skip = skip;
  __threadfence_system();
}

// Per destination d: pos[t][d] (row of token t among those sent to d, or -1) and send_list[d][*].
__device__ __forceinline__ void notify_scan(const NotifyParams& p, int d) {
  const int num_ranks = p.env.num_ranks;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  __shared__ int warp_offset[32];
  __shared__ int chunk_total;
  int carry = 0;
  for (int base = 0; base < p.num_tokens; base += blockDim.x) {
    const int t = base + threadIdx.x;
    const bool in = t < p.num_tokens && p.is_token_in_rank[static_cast<int64_t>(t) * num_ranks + d];
    const uint32_t ballot = __ballot_sync(0xffffffffu, in);
    const int before_in_warp = __popc(ballot & ((1u << lane) - 1));
    if (lane == 0) warp_offset[warp] = __popc(ballot);
    __syncthreads();
    if (warp == 0) {
      const int v = lane < num_warps ? warp_offset[lane] : 0;
      int inclusive = v;
      for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += n;
      }
      if (lane < num_warps) warp_offset[lane] = inclusive - v;
      if (lane == 31) chunk_total = inclusive;
    }
    __syncthreads();
    const int idx = carry + warp_offset[warp] + before_in_warp;
    if (t < p.num_tokens) p.pos[static_cast<int64_t>(t) * num_ranks + d] = in ? idx : -1;
    if (in) p.send_list[static_cast<int64_t>(d) * p.num_tokens + idx] = t;
    carry += chunk_total;
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(NotifyParams p) {
  if (blockIdx.x == 0) notify_exchange(p);
  else notify_scan(p, blockIdx.x - 1);
}

// This thread waits for `*flag >= target` (see wait_flag); `trace` sums the time waited.
__device__ __forceinline__ bool traced_wait_flag(const KernelEnv& env, const uint64_t* flag, uint64_t target, int stage,
                                                 int peer, int detail, const BlockTrace& trace) {
  const uint64_t since = trace.now();
  const bool ok = wait_flag(wait_ctx(env), flag, target, stage, peer, detail);
  trace.add(kTraceWaitNs, since);
  return ok;
}

// Lane 0 waits for `*flag >= target`; the whole warp gets the verdict.
__device__ __forceinline__ bool warp_wait_flag(const KernelEnv& env, const uint64_t* flag, uint64_t target, int stage,
                                               int peer, int detail, const BlockTrace& trace) {
  bool ok = true;
  if ((threadIdx.x & 31) == 0) ok = traced_wait_flag(env, flag, target, stage, peer, detail, trace);
  return __shfl_sync(0xffffffffu, ok, 0);
}

// Warp 0 of block 0 of a copy-engine operation: once every peer entered it (so its buffer is free), set
// the go word that starts this rank's copy stream. Set even after a failed wait: the copy stream must
// never hang (the error is recorded and raised; the buffer is unusable from then on).
__device__ __forceinline__ void start_copy_engine(const KernelEnv& env, const CopyEngineParams& ce, uint64_t epoch,
                                                  int stage) {
  const int lane = threadIdx.x & 31;
  if (lane < env.num_ranks && lane != env.rank)
    wait_flag(wait_ctx(env), &control_of(env, env.rank)->arrive[lane], epoch, stage, lane, 0);
  __syncwarp();
  if (lane == 0) {
    __threadfence_system();
    st_release_sys(ce.go, ce.seq);
    if (ce.trace != nullptr) ce.trace[0] = static_cast<int64_t>(global_timer_ns());
  }
}

// Diagnostics: the first time any warp saw chunk k of source src landed (see CopyEngineParams::trace).
__device__ __forceinline__ void stamp_landed(const CopyEngineParams& ce, int src, int k) {
  if (ce.trace != nullptr)
    atomicMin(reinterpret_cast<unsigned long long*>(ce.trace + 1 + src * kMaxCopyEngineChunks + k),
              static_cast<unsigned long long>(global_timer_ns()));
}

// Copies the chunk bounds into shared memory with constant indices (a dynamic index into a kernel
// parameter would copy the parameter struct to local memory). Followed by a block barrier.
__device__ __forceinline__ void load_copy_engine_bounds(const CopyEngineParams& ce, int32_t* bounds) {
#pragma unroll
  for (int i = 0; i <= kMaxCopyEngineChunks; ++i)
    if (static_cast<int>(threadIdx.x) == i) bounds[i] = ce.bounds[i];
}

// Shared-memory counter add with acquire-release semantics at block scope (returns the old value).
__device__ __forceinline__ int32_t atomic_add_acq_rel_block(int32_t* counter, int32_t value) {
  int32_t old;
  asm volatile("atom.acq_rel.cta.shared::cta.add.s32 %0, [%1], %2;"
               : "=r"(old) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(counter))), "r"(value) : "memory");
  return old;
}

// Rows of a chunk go to the block's warps in turn: warp w takes rows j0 + w, j0 + w + warps, ...
__device__ __forceinline__ int first_row_of_warp(int j0) { return j0 + static_cast<int>(threadIdx.x >> 5); }
__device__ __forceinline__ int warps_per_block() { return static_cast<int>(blockDim.x >> 5); }

// Pushers' schedule, shared by dispatch and combine. Items are (chunk k, peer) pairs, k-major so that
// every peer gets its first chunks early; item i goes to push block i % num_push_blocks. Every warp
// walks it on its own (no block barrier): `push_rows(peer, j0, j1)` stores the warp's rows of chunk k
// into the peer's buffer, after the peer entered this operation (`stage` names that wait). The last
// warp to finish a chunk publishes it: every warp's lane 0 adds to the chunk's counter with
// acquire-release semantics after a warp sync, so the last one has observed all the block's stores
// of that chunk, and its release store to `flag_of(peer, k)` is cumulative at system scope. Only that
// warp waits for the release; the others go on with the next chunk. `done` holds kMaxChunks *
// kMaxRanks zeroed counters. A failed wait stops the warp's work; returns false then.
template <typename CountOf, typename PushRows, typename FlagOf>
__device__ __forceinline__ bool run_pushers(const KernelEnv& env, uint64_t epoch, int num_push_blocks, int stage,
                                            int32_t* done, BlockTrace& trace, CountOf count_of, PushRows push_rows,
                                            FlagOf flag_of) {
  const int num_ranks = env.num_ranks, me = env.rank;
  const int lane = threadIdx.x & 31;
  Control* mine = control_of(env, me);
  uint32_t arrived = 0;
  int item = 0;
  for (int k = 0; k < kMaxChunks; ++k) {
    bool any = false;
    for (int j = 1; j < num_ranks; ++j) {
      const int peer = (me + j) % num_ranks;
      const int count = count_of(peer);
      if (k >= num_chunks(count, env)) continue;
      any = true;
      if (item++ % num_push_blocks != static_cast<int>(blockIdx.x)) continue;
      if (!((arrived >> peer) & 1u)) {
        if (!warp_wait_flag(env, &mine->arrive[peer], epoch, stage, peer, k, trace)) return false;
        arrived |= 1u << peer;
        trace.first_wait();
      }
      const int rows = chunk_rows(count, env);
      const int j0 = k * rows;
      push_rows(peer, j0, min(count, j0 + rows));
      __syncwarp();
      if (lane == 0) {
        const uint64_t since = trace.now();
        if (atomic_add_acq_rel_block(&done[k * kMaxRanks + peer], 1) == warps_per_block() - 1)
          st_release_sys(flag_of(peer, k), epoch);
        trace.add(kTraceSyncNs, since);
      }
    }
    if (!any) break;
  }
  return true;
}

// ========================================================================================== dispatch
struct DispatchShared {
  int32_t prefix[kMaxRanks * kMaxRanks];
  int32_t chunk_done[kMaxChunks * kMaxRanks];  // pushers: warps done with (chunk, peer)
  int32_t copy_engine_bounds[kMaxCopyEngineChunks + 1];
  int32_t copy_engine_tokens[kMaxRanks];
  int flag;
  int32_t digest;  // cached dispatch: the layout digest of the handle's rank_prefix_matrix
};

// A row's metadata in the lanes' registers: the pushers load it before the row's data and store it after,
// so that its loads' latency hides behind the copy (loads after the copy cost every row one more
// dependent latency; CHANGELOG.md has the measurement). Lanes hold scales c and c + 32
// and top-k slot k = lane; `store_row_meta` sends the rest of wider rows (> 64 scales, > 32 slots) itself.
struct RowMeta {
  float scale[2];
  int64_t expert;
  int32_t weight;  // the fp32 weight's bits
};

__device__ __forceinline__ RowMeta load_row_meta(const DispatchParams& p, int t) {
  const int lane = threadIdx.x & 31;
  RowMeta m{{0.f, 0.f}, -1, 0};
  if (p.has_scales) {
    const float* src_scales = p.scales + static_cast<int64_t>(t) * p.num_scales;
    if (lane < p.num_scales) m.scale[0] = __ldg(src_scales + lane);
    if (lane + 32 < p.num_scales) m.scale[1] = __ldg(src_scales + lane + 32);
  }
  if (p.has_topk && lane < p.num_topk) {
    m.expert = __ldg(p.topk_idx + static_cast<int64_t>(t) * p.num_topk + lane);
    m.weight = __ldg(reinterpret_cast<const int32_t*>(p.topk_weights) + static_cast<int64_t>(t) * p.num_topk + lane);
  }
  return m;
}

// Warp: metadata of token t (`m` from load_row_meta), sent to rank `dst` as row `row` of dst's buffer.
__device__ __forceinline__ void store_row_meta(const DispatchParams& p, int dst, int t, int64_t row, const RowMeta& m) {
  const int lane = threadIdx.x & 31;
  uint8_t* data = p.data[dst];
  if (p.has_scales) {
    float* dst_scales = reinterpret_cast<float*>(data + p.off_scales) + row * p.num_scales;
    const float* src_scales = p.scales + static_cast<int64_t>(t) * p.num_scales;
    if (lane < p.num_scales) dst_scales[lane] = m.scale[0];
    if (lane + 32 < p.num_scales) dst_scales[lane + 32] = m.scale[1];
    for (int c = lane + 64; c < p.num_scales; c += 32) dst_scales[c] = __ldg(src_scales + c);
  }
  if (p.has_topk) {
    const int64_t lo = static_cast<int64_t>(dst) * p.experts_per_rank;
    int64_t* dst_idx = reinterpret_cast<int64_t*>(data + p.off_idx) + row * p.num_topk;
    int32_t* dst_w = reinterpret_cast<int32_t*>(data + p.off_weights) + row * p.num_topk;
    for (int k = lane; k < p.num_topk; k += 32) {
      const int64_t e = k < 32 ? m.expert : __ldg(p.topk_idx + static_cast<int64_t>(t) * p.num_topk + k);
      const int32_t w = k < 32 ? m.weight
                               : __ldg(reinterpret_cast<const int32_t*>(p.topk_weights) + static_cast<int64_t>(t) * p.num_topk + k);
      const bool local = e >= lo && e < lo + p.experts_per_rank;
      dst_idx[k] = local ? e - lo : -1;
      dst_w[k] = local ? w : 0;
    }
    if (lane == 0) reinterpret_cast<int32_t*>(data + p.off_src)[row] = t;
  }
}

// Warp: output row `row`'s top-k from a token's global expert ids and fp32 weights (`idx`, `w`: K each; in
// this rank's input, or written by a peer's copy engine, then read through L2): ids of this rank's experts
// become local ids, the others -1 with weight 0; `hist` counts the local ones. Then the row's source.
template <bool kPeerWritten>
__device__ __forceinline__ void store_local_topk(const DispatchParams& p, int64_t row, const int64_t* idx,
                                                 const int32_t* w, int src, int t, int32_t* hist) {
  const int lane = threadIdx.x & 31;
  const int64_t lo = static_cast<int64_t>(p.env.rank) * p.experts_per_rank;
  for (int k = lane; k < p.num_topk; k += 32) {
    const int64_t e = kPeerWritten ? __ldcg(reinterpret_cast<const long long*>(idx) + k) : __ldg(idx + k);
    const bool local = e >= lo && e < lo + p.experts_per_rank;
    p.recv_topk_idx[row * p.num_topk + k] = local ? e - lo : -1;
    reinterpret_cast<int32_t*>(p.recv_topk_weights)[row * p.num_topk + k] =
        local ? (kPeerWritten ? __ldcg(w + k) : __ldg(w + k)) : 0;
    if (local) atomicAdd(&hist[e - lo], 1);
  }
  if (lane == 0) {
    p.recv_src_idx[row] = t;
    p.recv_src_rank[row] = src;
  }
}

// Warp: this rank's own token t, received as output row `row` (data and metadata).
__device__ __forceinline__ void copy_self_row(const DispatchParams& p, int t, int64_t row, int32_t* hist) {
  const int lane = threadIdx.x & 31;
  if (!p.rows_in_place)
    warp_copy16(reinterpret_cast<int4*>(p.recv_x + row * p.x_bytes),
                reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(t) * p.x_bytes), p.x_bytes / 16, lane);
  if (p.has_scales && !p.rows_in_place)
    for (int c = lane; c < p.num_scales; c += 32)
      p.recv_scales[row * p.num_scales + c] = __ldg(p.scales + static_cast<int64_t>(t) * p.num_scales + c);
  if (p.has_topk)
    store_local_topk<false>(p, row, p.topk_idx + static_cast<int64_t>(t) * p.num_topk,
                            reinterpret_cast<const int32_t*>(p.topk_weights) + static_cast<int64_t>(t) * p.num_topk,
                            p.env.rank, t, hist);
}

// Warp: the data of output row `row` (x, scales) from row `staged` of this rank's buffer, where a peer
// wrote it: pushers in output order (staged == row), the copy engine token-indexed in the peer's slot.
__device__ __forceinline__ void copy_staged_data(const DispatchParams& p, int64_t row, int64_t staged) {
  const int lane = threadIdx.x & 31;
  const uint8_t* data = p.data[p.env.rank];
  warp_copy16(reinterpret_cast<int4*>(p.recv_x + row * p.x_bytes),
              reinterpret_cast<const int4*>(data + p.off_x + staged * p.x_bytes), p.x_bytes / 16, lane);
  if (p.has_scales)
    for (int c = lane; c < p.num_scales; c += 32)
      p.recv_scales[row * p.num_scales + c] =
          __ldcg(reinterpret_cast<const float*>(data + p.off_scales) + staged * p.num_scales + c);
}

// Warp: output row `row`, which rank `src`'s pushers wrote into this rank's buffer (data and metadata;
// the pushers converted the top-k to this rank's local ids).
__device__ __forceinline__ void drain_row(const DispatchParams& p, int src, int64_t row, int32_t* hist) {
  const int lane = threadIdx.x & 31;
  const uint8_t* data = p.data[p.env.rank];
  if (!p.rows_in_place) copy_staged_data(p, row, row);
  if (p.has_topk) {
    const long long* src_idx = reinterpret_cast<const long long*>(data + p.off_idx) + row * p.num_topk;
    const int32_t* src_w = reinterpret_cast<const int32_t*>(data + p.off_weights) + row * p.num_topk;
    for (int k = lane; k < p.num_topk; k += 32) {
      const long long e = __ldcg(src_idx + k);
      p.recv_topk_idx[row * p.num_topk + k] = e;
      reinterpret_cast<int32_t*>(p.recv_topk_weights)[row * p.num_topk + k] = __ldcg(src_w + k);
      if (e >= 0) atomicAdd(&hist[e], 1);
    }
    if (lane == 0) {
      p.recv_src_idx[row] = __ldcg(reinterpret_cast<const int32_t*>(data + p.off_src) + row);
      p.recv_src_rank[row] = src;
    }
  }
}

// Local block: padding rows of a fixed-size (num_worst_tokens) receive, as the torch backend fills them.
__device__ __forceinline__ void pad_rows(const DispatchParams& p, int64_t row0, int rows) {
  const int64_t n16 = p.rows_in_place ? 0 : static_cast<int64_t>(rows) * p.x_bytes / 16;
  int4* x = reinterpret_cast<int4*>(p.recv_x + row0 * p.x_bytes);
  for (int64_t i = threadIdx.x; i < n16; i += blockDim.x) x[i] = make_int4(0, 0, 0, 0);
  if (p.has_scales && !p.rows_in_place)
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(rows) * p.num_scales; i += blockDim.x)
      p.recv_scales[row0 * p.num_scales + i] = 0.f;
  if (p.has_topk) {
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(rows) * p.num_topk; i += blockDim.x) {
      p.recv_topk_idx[row0 * p.num_topk + i] = -1;
      p.recv_topk_weights[row0 * p.num_topk + i] = 0.f;
    }
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
      p.recv_src_idx[row0 + i] = -1;
      p.recv_src_rank[row0 + i] = -1;
    }
  }
}

// Local warps of a copy-engine dispatch, after the own rows: the rows of every peer in turn, warp g of W
// taking rows g, g + W, ... of the sequence. Row j of source s is its token t: cached_src_idx[j] (cached
// dispatch), or entry j of s's send list to this rank, which s's copy stream wrote into s's slot of the
// source-index region before its first chunk (fresh dispatch). The token's data (and, fresh, its top-k in
// global ids) sit at row t of s's slot once the chunk of t landed; a warp's tokens of one source increase,
// so it searches a chunk from the last one it waited for.
__device__ __forceinline__ bool drain_copy_engine_rows(const DispatchParams& p, const DispatchShared& sh, int g,
                                                       int all_warps, int32_t* hist, BlockTrace& trace,
                                                       uint64_t lane_copy_seq) {
  const KernelEnv& env = p.env;
  const int num_ranks = env.num_ranks, me = env.rank;
  Control* mine = control_of(env, me);
  const uint8_t* data = p.data[me];
  int seen = 0;  // rows of the peers' sequence before src's
  for (int j = 1; j < num_ranks; ++j) {
    const int src = (me - j + num_ranks) % num_ranks;
    const int count = pair_count(sh.prefix, num_ranks, src, me);
    const int tokens = sh.copy_engine_tokens[src];
    const int64_t first = rows_from_lower(sh.prefix, num_ranks, src, me);
    const int64_t slot = static_cast<int64_t>(src) * p.copy_engine_slot_rows;
    // The value src's copy stream writes: a cached dispatch's sender announced it in its header (lane src has
    // it); a fresh one's is the same on every rank (the host made it so after the count exchange).
    const uint64_t landed = p.write_arrival ? __shfl_sync(0xffffffffu, lane_copy_seq, src) : p.copy_engine.seq;
    int ready = -1;  // the last chunk this warp waited for
    const auto wait_chunk = [&](int k) {
      if (!warp_wait_flag(env, &mine->copy_engine_flag[src][k], landed, kStageDispatchRecv, src, k, trace))
        return false;
      if ((threadIdx.x & 31) == 0) stamp_landed(p.copy_engine, src, k);
      trace.first_wait();
      ready = k;
      return true;
    };
    int jj = ((g - seen) % all_warps + all_warps) % all_warps;
    seen += count;
    if (jj >= count) continue;
    const int32_t* list = p.cached_src_idx != nullptr ? p.cached_src_idx + first
                                                      : reinterpret_cast<const int32_t*>(data + p.off_src) + slot;
    if (p.cached_src_idx == nullptr && !wait_chunk(0)) return false;  // the send list came with chunk 0
    int next_t = __ldcg(list + jj);  // loaded a row ahead, as the pushers do
    for (; jj < count; jj += all_warps) {
      const int t = next_t;
      if (jj + all_warps < count) next_t = __ldcg(list + jj + all_warps);
      int k = max(ready, 0);
      while (t >= copy_engine_chunk_end(sh.copy_engine_bounds, p.copy_engine.chunks, tokens, k)) ++k;
      if (k != ready && !wait_chunk(k)) return false;
      copy_staged_data(p, first + jj, slot + t);
      if (p.has_topk)
        store_local_topk<true>(p, first + jj,
                               reinterpret_cast<const int64_t*>(data + p.off_idx) + (slot + t) * p.num_topk,
                               reinterpret_cast<const int32_t*>(data + p.off_weights) + (slot + t) * p.num_topk,
                               src, t, hist);
    }
  }
  return true;
}

constexpr int kPadRows = 64;

// Local warps of all local blocks together: first this rank's own rows, which need no wait (x is local),
// warp g of W taking rows g, g + W, ...; then the rows peers wrote into this rank's buffer (already in
// output order), chunk k of every source in turn, warp g taking rows g, g + W, ... of that sequence once
// their chunk's flag is set; then padding rows, a block per kPadRows rows. The own rows fill the time
// while peers' chunks arrive, and every chunk is drained by many warps at once, so no block drains the
// last chunk alone (faster than blocks taking whole chunks in turn, own and peers' interleaved; see
// docs/native.md).
__device__ __forceinline__ bool dispatch_local(const DispatchParams& p, const DispatchShared& sh, int32_t* hist,
                                               uint64_t epoch, BlockTrace& trace, uint64_t lane_copy_seq) {
  const int32_t* prefix = sh.prefix;
  const KernelEnv& env = p.env;
  const int num_ranks = env.num_ranks, me = env.rank;
  const int q = blockIdx.x - p.num_push_blocks, num_local = p.num_blocks - p.num_push_blocks;
  const int warps = warps_per_block();
  const int all_warps = num_local * warps, g = q * warps + static_cast<int>(threadIdx.x >> 5);
  const int my_first_row = rows_from_lower(prefix, num_ranks, me, me);
  const int total_rows = prefix[(num_ranks - 1) * num_ranks + me];
  const int32_t* my_list = p.send_list + static_cast<int64_t>(me) * p.num_tokens;
  Control* mine = control_of(env, me);
  const int self_count = pair_count(prefix, num_ranks, me, me);
  for (int j = g; j < self_count; j += all_warps) copy_self_row(p, my_list[j], my_first_row + j, hist);
  if (p.copy_engine.seq != 0) return drain_copy_engine_rows(p, sh, g, all_warps, hist, trace, lane_copy_seq);
  int seen = 0;  // rows of the peers' sequence before chunk k of src
  for (int k = 0; k < kMaxChunks; ++k) {
    bool any = false;
    for (int j = 1; j < num_ranks; ++j) {
      const int src = (me - j + num_ranks) % num_ranks;
      const int count = pair_count(prefix, num_ranks, src, me);
      if (k >= num_chunks(count, env)) continue;
      any = true;
      const int rows = chunk_rows(count, env);
      const int j0 = k * rows, j1 = min(count, j0 + rows);
      const int warp_first = j0 + ((g - seen) % all_warps + all_warps) % all_warps;  // (seen + jj - j0) % W == g
      seen += j1 - j0;
      if (warp_first >= j1) continue;
      if (!warp_wait_flag(env, &mine->dispatch_flag[src][k], epoch, kStageDispatchRecv, src, k, trace)) return false;
      trace.first_wait();
      const int64_t first = rows_from_lower(prefix, num_ranks, src, me);
      for (int jj = warp_first; jj < j1; jj += all_warps) drain_row(p, src, first + jj, hist);
    }
    if (!any) break;
  }
  int item = 0;
  for (int64_t r0 = total_rows; r0 < p.num_recv_rows; r0 += kPadRows)
    if (item++ % num_local == q) pad_rows(p, r0, static_cast<int>(min(static_cast<int64_t>(kPadRows), p.num_recv_rows - r0)));
  return true;
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(DispatchParams p) {
  extern __shared__ int32_t hist[];  // [experts_per_rank] received (row, local expert) pairs
  __shared__ DispatchShared sh;
  BlockTrace trace(p.trace);
  const KernelEnv& env = p.env;
  const int num_ranks = env.num_ranks, me = env.rank;
  const uint64_t epoch = current_epoch(env);
  // A cached dispatch is its operation's first kernel: block 0 announces this rank's header (with the layout
  // digest of the handle) and arrival; every block's warp 0 computes the digest for the check below.
  if (p.write_arrival && threadIdx.x < 32) {
    const int32_t digest = p.check.digest_from_prefix ? warp_layout_digest(p.rank_prefix_matrix, num_ranks)
                                                      : p.check.header[kHeaderLayout];
    if (threadIdx.x == 0) sh.digest = digest;
    if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) < num_ranks) announce_header(env, p.check, digest, epoch);
  }
  for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) sh.prefix[i] = p.rank_prefix_matrix[i];
  for (int i = threadIdx.x; i < kMaxChunks * kMaxRanks; i += blockDim.x) sh.chunk_done[i] = 0;
  load_copy_engine_bounds(p.copy_engine, sh.copy_engine_bounds);
#pragma unroll
  for (int i = 0; i < kMaxRanks; ++i)  // constant indices, as for the bounds
    if (static_cast<int>(threadIdx.x) == i) sh.copy_engine_tokens[i] = p.copy_engine_tokens[i];
  const bool count_experts = p.has_topk;
  if (count_experts)
    for (int i = threadIdx.x; i < p.experts_per_rank; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  bool skip = !p.write_arrival && *reinterpret_cast<volatile int32_t*>(&env.state->skip) != 0;
  // A cached dispatch checks the ranks' headers in every warp before its first cross-rank action (a fresh
  // one's notify did, and `skip` holds its verdict). Lane r's lane_copy_seq: rank r's copy-engine number.
  HeaderVerdict verdict = kHeadersAgree;
  uint64_t lane_copy_seq = 0;
  if (p.write_arrival) {
    verdict = check_headers_warp(env, p.check, sh.digest, epoch, kStageDispatchSend,
                                 blockIdx.x == 0 && threadIdx.x < 32, &lane_copy_seq, p.copy_engine.seq != 0);
    skip = verdict != kHeadersAgree;
  }
  const int32_t* prefix = sh.prefix;
  // Every rank checks every rank's received rows against the (identical) capacity and against the
  // output size (rows are written in place, so an overflow must never start): the same verdict everywhere.
  for (int r = 0; r < num_ranks && !skip; ++r) {
    const int rows = prefix[(num_ranks - 1) * num_ranks + r];
    if (rows > p.rows_capacity || (r == me && rows > p.num_recv_rows)) {
      skip = true;
      if (blockIdx.x == 0 && threadIdx.x == 0)
        record_error(wait_ctx(env), kErrorCapacity, kStageDispatchCapacity, r, p.num_recv_rows,
                     (static_cast<int64_t>(rows) << 32) | (p.rows_capacity & 0xffffffff));
    }
  }

  // A copy-engine dispatch starts its copy stream whatever the verdict (the host checked that every
  // source's tokens fit its slot, so the copies stay in bounds): the stream must never wait forever. After a
  // disagreement its copies are waited for before the epoch closes (close_after_disagreement).
  if (p.copy_engine.seq != 0 && blockIdx.x == 0 && threadIdx.x < 32)
    start_copy_engine(env, p.copy_engine, epoch, kStageDispatchSend);
  if (verdict == kHeadersDisagree && blockIdx.x == 0 && threadIdx.x < 32) {
    const bool any_copy_engine = __any_sync(0xffffffffu, lane_copy_seq != 0);
    const int32_t* bounds = sh.copy_engine_bounds;
    // The flags this rank's copy stream writes into `peer` (enqueue_copy_engine_dispatch): every non-empty
    // chunk, and chunk 0 of a fresh dispatch.
    close_after_disagreement(env, epoch, kStageDispatchSend, any_copy_engine, [&](int peer) {
      if (p.copy_engine.seq == 0) return true;
      const int chunks = p.copy_engine.chunks;
      for (int k = 0; k < chunks; ++k) {
        const int t0 = k == 0 ? 0 : copy_engine_chunk_end(bounds, chunks, p.num_tokens, k - 1);
        const int t1 = copy_engine_chunk_end(bounds, chunks, p.num_tokens, k);
        if (t1 == t0 && !(k == 0 && p.has_topk)) continue;
        if (!wait_flag(wait_ctx(env), &control_of(env, peer)->copy_engine_flag[me][k], p.copy_engine.seq,
                       kStageDispatchSend, peer, k))
          return false;
      }
      return true;
    });
  }

  if (!skip && static_cast<int>(blockIdx.x) < p.num_push_blocks) {
    // ------------------------------------------------------------------ pushers
    const auto push_rows = [&](int dst, int j0, int j1) {
      const int64_t base = rows_from_lower(prefix, num_ranks, me, dst);
      const int32_t* list = p.send_list + static_cast<int64_t>(dst) * p.num_tokens;
      uint8_t* dst_x = p.data[dst] + p.off_x;
      // The next row's token id and this row's metadata are in flight during the row's copy.
      int j = first_row_of_warp(j0);
      int t = j < j1 ? list[j] : 0;
      for (; j < j1; j += warps_per_block()) {
        const int next = j + warps_per_block();
        const int next_t = next < j1 ? list[next] : 0;
        const RowMeta meta = load_row_meta(p, t);
        warp_copy16(reinterpret_cast<int4*>(dst_x + (base + j) * p.x_bytes),
                    reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(t) * p.x_bytes), p.x_bytes / 16,
                    threadIdx.x & 31);
        store_row_meta(p, dst, t, base + j, meta);
        t = next_t;
      }
    };
    run_pushers(env, epoch, p.num_push_blocks, kStageDispatchSend, sh.chunk_done, trace,
                [&](int dst) { return pair_count(prefix, num_ranks, me, dst); }, push_rows,
                [&](int dst, int k) { return &control_of(env, dst)->dispatch_flag[me][k]; });
  } else if (!skip) {
    dispatch_local(p, sh, hist, epoch, trace, lane_copy_seq);
  }

  __syncthreads();
  trace.stamp(kTraceWorkDone);
  if (count_experts)
    for (int i = threadIdx.x; i < p.experts_per_rank; i += blockDim.x)
      if (hist[i]) atomicAdd(&p.expert_scratch[i], hist[i]);
  if (finish_block(env, p.num_blocks, &sh.flag)) {
    if (count_experts) {
      const int64_t align = p.expert_alignment;
      for (int i = threadIdx.x; i < p.experts_per_rank; i += blockDim.x) {
        const int64_t c = atomicExch(&p.expert_scratch[i], 0);
        p.num_recv_per_expert[i] = (c + align - 1) / align * align;
      }
    }
    if (threadIdx.x == 0) {
      env.state->done = 0;
      env.state->skip = 0;
      env.state->seq = epoch;
    }
  }
  trace.stamp(kTraceEnd);
}

// ========================================================================================== combine
struct CombineShared {
  int32_t prefix[kMaxRanks * kMaxRanks];
  int32_t chunk_done[kMaxChunks * kMaxRanks];  // pushers: warps done with (chunk, peer)
  int32_t copy_engine_bounds[kMaxCopyEngineChunks + 1];
  int flag;
  int32_t digest;  // the layout digest of the handle's rank_prefix_matrix
};

template <int kType> struct Vec;
template <> struct Vec<kBF16> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void add(float* acc, const int4& v) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] = acc[2 * i] + __uint_as_float(w[i] << 16);
      acc[2 * i + 1] = acc[2 * i + 1] + __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static int4 pack(const float* acc) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * i]));
      const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * i + 1]));
      w[i] = lo | (hi << 16);
    }
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
  }
};
template <> struct Vec<kFP32> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void add(float* acc, const int4& v) {
    acc[0] = acc[0] + __int_as_float(v.x);
    acc[1] = acc[1] + __int_as_float(v.y);
    acc[2] = acc[2] + __int_as_float(v.z);
    acc[3] = acc[3] + __int_as_float(v.w);
  }
  __device__ __forceinline__ static int4 pack(const float* acc) {
    return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]), __float_as_int(acc[3]));
  }
};

// Add a bias row segment (its own dtype) to the fp32 accumulators of `kElems` consecutive elements.
template <int kElems>
__device__ __forceinline__ void add_bias(float* acc, const void* bias, int type, int64_t first) {
  if (type == kBF16) {
    const __nv_bfloat16* b = static_cast<const __nv_bfloat16*>(bias) + first;
#pragma unroll
    for (int i = 0; i < kElems; ++i) acc[i] = acc[i] + __bfloat162float(b[i]);
  } else if (type == kFP32) {
    const float* b = static_cast<const float*>(bias) + first;
#pragma unroll
    for (int i = 0; i < kElems; ++i) acc[i] = acc[i] + __ldg(b + i);
  }
}

constexpr int kReduceUnroll = 4;  // 16-byte columns per lane in flight per source

__device__ __forceinline__ const int4* shfl_ptr(uint64_t ptr, int lane) {
  const uint32_t lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(ptr), lane);
  const uint32_t hi = __shfl_sync(0xffffffffu, static_cast<uint32_t>(ptr >> 32), lane);
  return reinterpret_cast<const int4*>((static_cast<uint64_t>(hi) << 32) | lo);
}

// Warp: what an expert-major combine sends back for received row `row` (CombineParams::expert_y): the fp32
// sum over the row's slots in increasing order, from 0, of weight * y (each product rounded first: no fused
// multiply-add) or of y, rounded once to the row type; bit for bit ep_moe_native::unpermute_sum's row.
// The elements of a 16-byte word of rows of kType as floats (exact, -0 included).
template <int kType>
__device__ __forceinline__ void unpack_word(const int4& v, float* out) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kType == kBF16) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      out[i] = __uint_as_float(w[i]);
    }
  }
}

template <int kType>
__device__ __forceinline__ void store_expert_row(const CombineParams& p, int4* dst, int64_t row, int n16, int lane) {
  constexpr int kElems = Vec<kType>::kElems;
  constexpr int kU = kReduceUnroll;  // 16-byte words per lane in flight per slot
  const int K = p.expert_topk;
  const int64_t* slots = p.sorted_slots + row * K;
  const int4* y = reinterpret_cast<const int4*>(p.expert_y);
  const int64_t lane_slot = lane < K ? __ldg(slots + lane) : -1;  // slot j < 32 is lane j's (then shuffled)
  for (int c0 = lane; c0 < n16; c0 += 32 * kU) {
    float acc[kU][kElems];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[u][e] = 0.0f;
    for (int j = 0; j < K; ++j) {
      const int64_t s = j < 32 ? __shfl_sync(0xffffffffu, lane_slot, j) : __ldg(slots + j);  // the same on all lanes
      if (s < 0 || s >= p.expert_slots) continue;
      const float w = p.expert_weights != nullptr ? __ldg(p.expert_weights + s) : 1.0f;
      int4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (c0 + 32 * u < n16) v[u] = __ldg(y + s * n16 + c0 + 32 * u);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (c0 + 32 * u >= n16) continue;
        float term[kElems];
        unpack_word<kType>(v[u], term);
        if (p.expert_weights != nullptr) {
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(w, term[e]));
        } else {
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[u][e] = __fadd_rn(acc[u][e], term[e]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (c0 + 32 * u < n16) dst[c0 + 32 * u] = Vec<kType>::pack(acc[u]);
  }
}

// One warp sums token t's top-k weights over the ranks in `mask` (when the combine has weights); lane r
// holds in `w_ptr` the address of rank r's.
__device__ __forceinline__ void reduce_weights(const CombineParams& p, int t, uint32_t mask, uint64_t w_ptr, int lane) {
  if (!p.has_weights) return;
  for (int k0 = 0; k0 < p.num_topk; k0 += 32) {
    const int k = k0 + lane;
    float acc = 0.f;
    uint32_t m = mask;
    while (m) {
      const int r = __ffs(m) - 1;
      m &= m - 1;
      const float* w = reinterpret_cast<const float*>(shfl_ptr(w_ptr, r));
      if (k < p.num_topk) acc = acc + (r == p.env.rank ? __ldg(w + k) : __ldcg(w + k));
    }
    if (k < p.num_topk) p.out_weights[static_cast<int64_t>(t) * p.num_topk + k] = acc;
  }
}

// The j-th source (rank) of `order` (4 bits per rank: the sources of a token in summation order).
__device__ __forceinline__ int source_at(uint32_t order, int j) { return static_cast<int>((order >> (4 * j)) & 15u); }

// One warp reduces 16-byte columns [col_begin, col_end) of token t: from its biases, then over the ranks
// in `mask` in the order `order` lists them (source_at; DeepEP V2's order), in fp32, rounded once; and
// (`with_weights`) the token's top-k weights. Lane r holds in `row_ptr` the address of rank r's row and
// in `w_ptr` that of its top-k weights; the own rank's row is read in place from y.
template <int kType>
__device__ __forceinline__ void reduce_token(const CombineParams& p, int t, uint32_t mask, uint32_t order,
                                             uint64_t row_ptr, uint64_t w_ptr, int lane, int col_begin,
                                             int col_end, bool with_weights) {
  using V = Vec<kType>;
  constexpr int E = V::kElems;
  const int64_t y_bytes = static_cast<int64_t>(p.hidden) * (kType == kBF16 ? 2 : 4);
  const int n16 = col_end;  // the loads' and stores' bound
  int4* out = reinterpret_cast<int4*>(p.out + static_cast<int64_t>(t) * y_bytes);
  for (int c0 = col_begin + lane; c0 - lane < n16; c0 += 32 * kReduceUnroll) {
    float acc[kReduceUnroll][E];
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
#pragma unroll
      for (int e = 0; e < E; ++e) acc[u][e] = 0.f;
      const int c = c0 + u * 32;
      if (c >= n16) continue;
      const int64_t first = static_cast<int64_t>(t) * p.hidden + static_cast<int64_t>(c) * E;
      if (p.bias0_type != kNone) add_bias<E>(acc[u], p.bias0, p.bias0_type, first);
      if (p.bias1_type != kNone) add_bias<E>(acc[u], p.bias1, p.bias1_type, first);
    }
    const int sources = __popc(mask);
    if (sources) {
      // Software pipeline over the sources: the next source's loads are in flight while the
      // current one is added (in the order `order` lists them).
      int r = source_at(order, 0);
      const int4* src = shfl_ptr(row_ptr, r);
      int4 cur[kReduceUnroll];
      load_lane_words(cur, src, c0, n16);
      for (int j = 1; j < sources; ++j) {
        r = source_at(order, j);
        src = shfl_ptr(row_ptr, r);
        int4 nxt[kReduceUnroll];
        load_lane_words(nxt, src, c0, n16);
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u)
          if (c0 + u * 32 < n16) V::add(acc[u], cur[u]);
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u) cur[u] = nxt[u];
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u)
        if (c0 + u * 32 < n16) V::add(acc[u], cur[u]);
    }
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      const int c = c0 + u * 32;
      if (c < n16) out[c] = V::pack(acc[u]);
    }
  }
  if (with_weights) reduce_weights(p, t, mask, w_ptr, lane);
}

// A reducer warp's work item: token t (columns of its slice), the ranks whose rows it sums (`mask`), the
// order of their sum (`order`, source_at) and, in lane r, the addresses of rank r's row and top-k weights.
struct ReduceItem {
  int t, slice;
  uint32_t mask, order;
  uint64_t row_ptr, w_ptr;
};

// Bulk-copy reducers (p.bulk_piece16 > 0). Dynamic shared memory: every warp's kBulkStages mbarriers, then
// their stage headers (token, first column, columns, sources), then the stages' rows: per warp and stage
// one segment of bulk_piece16 16-byte words per source.
constexpr int kBulkStages = 2;
constexpr int kReduceWarps = kThreads / 32;
constexpr int kBulkHeaderBytes = (kReduceWarps * kBulkStages * (8 + 16) + 127) / 128 * 128;
constexpr int kBulkSmemBudget = 200 << 10;  // beside the kernel's static shared memory (~8.5 KB)

__host__ __device__ __forceinline__ int64_t bulk_smem_bytes(int num_ranks, int piece16) {
  return kBulkHeaderBytes + static_cast<int64_t>(kReduceWarps) * kBulkStages * num_ranks * piece16 * 16;
}

// One warp's reduction through shared memory: each item's columns go in pieces of at most p.bulk_piece16
// words; lane 0 bulk-copies every source's segment of a piece into a stage (completing on its mbarrier)
// while the warp sums the piece of the stage before, so that a warp keeps kBulkStages pieces of all its
// sources in flight (the register reducer: 4 words per lane and source). `next_item(&item, &fresh)`:
// 1 (item filled in; `fresh`: a lane acquired a newly landed chunk), 0 (none left) or -1 (a wait failed).
// Returns false when a wait failed.
template <int kType, class NextItem>
__device__ __forceinline__ bool bulk_reduce(const CombineParams& p, uint8_t* smem, int warp, int lane,
                                            int slice_cols, int n16, NextItem&& next_item, BlockTrace& trace) {
  using V = Vec<kType>;
  constexpr int E = V::kElems;
  const int num_ranks = p.env.num_ranks, piece16 = p.bulk_piece16;
  const int64_t y_bytes = static_cast<int64_t>(n16) * 16;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * kBulkStages;
  int4* headers = reinterpret_cast<int4*>(smem + kReduceWarps * kBulkStages * 8) + warp * kBulkStages;
  int4* rows = reinterpret_cast<int4*>(smem + kBulkHeaderBytes) +
               static_cast<int64_t>(warp) * kBulkStages * num_ranks * piece16;
  if (lane == 0) {
    for (int s = 0; s < kBulkStages; ++s) mbar_init(bars + s, 1);
    fence_mbar_init();
  }
  __syncwarp();

  ReduceItem item;
  int col = 0, col_end = 0, issued = 0;  // the producer's next column in its item, the item's end
  bool ok = true;
  // Queues the next piece into stage `issued % kBulkStages` (free: its last piece was summed); false when
  // no piece is left or a wait failed (then ok is false).
  const auto issue = [&]() -> bool {
    if (col >= col_end) {
      bool fresh = false;
      const int got = next_item(&item, &fresh);
      if (got <= 0) {
        ok = got == 0;
        return false;
      }
      col = item.slice * slice_cols;
      col_end = min(n16, col + slice_cols);
      if (item.slice == 0) reduce_weights(p, item.t, item.mask, item.w_ptr, lane);
      if (fresh) {  // lane r acquired rank r's chunk; lane 0's copies read it through the async proxy
        __syncwarp();
        if (lane == 0) fence_proxy_async_global();
      }
    }
    const int s = issued % kBulkStages, len = min(piece16, col_end - col), sources = __popc(item.mask);
    int4* stage = rows + s * num_ranks * piece16;
    if (lane == 0) {
      headers[s] = make_int4(item.t, col, len, sources);
      fence_proxy_async_shared();  // the warp's reads of this stage's last piece come first
      mbar_arrive_expect_tx(bars + s, static_cast<uint32_t>(sources * len * 16));
    }
    for (int j = 0; j < sources; ++j) {  // stage segment j: the j-th source of the order
      const int4* src = shfl_ptr(item.row_ptr, source_at(item.order, j));
      if (lane == 0) bulk_load(stage + j * piece16, src + col, static_cast<uint32_t>(len * 16), bars + s);
    }
    col += len;
    ++issued;
    return true;
  };

  bool more = true;
  for (int s = 0; s < kBulkStages && more; ++s) more = issue();
  for (int done = 0; done < issued; ++done) {
    const int s = done % kBulkStages;
    mbar_wait(bars + s, static_cast<uint32_t>(done / kBulkStages) & 1);
    const int4 h = headers[s];  // token, first column, columns, sources
    const int4* stage = rows + s * num_ranks * piece16;
    int4* out = reinterpret_cast<int4*>(p.out + static_cast<int64_t>(h.x) * y_bytes) + h.y;
#pragma unroll 1  // (either loop unrolled, the kernel spills: it sits at its 128-register bound)
    for (int c = lane; c < h.z; c += 32) {
      float acc[E];
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] = 0.f;
      const int64_t first = static_cast<int64_t>(h.x) * p.hidden + static_cast<int64_t>(h.y + c) * E;
      if (p.bias0_type != kNone) add_bias<E>(acc, p.bias0, p.bias0_type, first);  // the biases first
      if (p.bias1_type != kNone) add_bias<E>(acc, p.bias1, p.bias1_type, first);
#pragma unroll 1
      for (int j = 0; j < h.w; ++j) V::add(acc, stage[j * piece16 + c]);  // the order, as in reduce_token
      out[c] = V::pack(acc);
    }
    __syncwarp();
    trace.first_wait();
    if (more) more = issue();
  }
  return ok;
}

template <int kType>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(CombineParams p) {
  __shared__ CombineShared sh;
  BlockTrace trace(p.trace);
  const KernelEnv& env = p.env;
  const int num_ranks = env.num_ranks, me = env.rank;
  const uint64_t epoch = current_epoch(env);
  // Block 0 announces this rank's header (with the layout digest of the handle) and arrival; every block's
  // warp 0 computes the digest for the check below.
  if (threadIdx.x < 32) {
    const int32_t digest = p.check.digest_from_prefix ? warp_layout_digest(p.rank_prefix_matrix, num_ranks)
                                                      : p.check.header[kHeaderLayout];
    if (threadIdx.x == 0) sh.digest = digest;
    if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) < num_ranks) announce_header(env, p.check, digest, epoch);
  }
  for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) sh.prefix[i] = p.rank_prefix_matrix[i];
  for (int i = threadIdx.x; i < kMaxChunks * kMaxRanks; i += blockDim.x) sh.chunk_done[i] = 0;
  load_copy_engine_bounds(p.copy_engine, sh.copy_engine_bounds);
  const int64_t y_bytes = static_cast<int64_t>(p.hidden) * (kType == kBF16 ? 2 : 4);
  __syncthreads();
  const int32_t* prefix = sh.prefix;
  Control* mine = control_of(env, me);

  // Every warp checks the ranks' headers before its first cross-rank action. Lane r's lane_copy_seq: rank r's
  // copy-engine number (the value its copy stream writes into copy_engine_flag).
  uint64_t lane_copy_seq = 0;
  const HeaderVerdict verdict = check_headers_warp(env, p.check, sh.digest, epoch, kStageCombineSend,
                                                   blockIdx.x == 0 && threadIdx.x < 32, &lane_copy_seq,
                                                   p.copy_engine.seq != 0);
  // Every rank checks every rank's rows against the (identical) capacity: the same verdict everywhere.
  bool skip = verdict != kHeadersAgree;
  for (int s = 0; s < num_ranks && !skip; ++s) {
    const int64_t rows = rows_back_from_lower(prefix, num_ranks, s, num_ranks);
    if (rows > p.rows_capacity) {
      skip = true;
      if (blockIdx.x == 0 && threadIdx.x == 0)
        record_error(wait_ctx(env), kErrorCapacity, kStageCombineCapacity, s, 0, (rows << 32) | (p.rows_capacity & 0xffffffff));
    }
  }
  bool failed = false;
  const bool copy_engine = p.copy_engine.seq != 0;
  // A copy-engine combine's block 0 releases its copy stream once every peer entered (whatever the verdict:
  // the stream must never wait forever); after a disagreement its copies are waited for before the epoch
  // closes (close_after_disagreement).
  if (copy_engine && blockIdx.x == 0 && threadIdx.x < 32) start_copy_engine(env, p.copy_engine, epoch, kStageCombineSend);
  if (verdict == kHeadersDisagree && blockIdx.x == 0 && threadIdx.x < 32) {
    const bool any_copy_engine = __any_sync(0xffffffffu, lane_copy_seq != 0);
    // The flags this rank's copy stream writes into `peer` (enqueue_copy_engine_combine): its non-empty chunks.
    close_after_disagreement(env, epoch, kStageCombineSend, any_copy_engine, [&](int peer) {
      if (!copy_engine) return true;
      const int count = pair_count(prefix, num_ranks, peer, me), chunks = p.copy_engine.chunks;
      for (int k = 0; k < chunks; ++k) {
        const int j0 = k == 0 ? 0 : copy_engine_chunk_end(sh.copy_engine_bounds, chunks, count, k - 1);
        if (copy_engine_chunk_end(sh.copy_engine_bounds, chunks, count, k) == j0) continue;
        if (!wait_flag(wait_ctx(env), &control_of(env, peer)->copy_engine_flag[me][k], p.copy_engine.seq,
                       kStageCombineSend, peer, k))
          return false;
      }
      return true;
    });
  }

  if (!skip && static_cast<int>(blockIdx.x) < p.num_push_blocks) {
    // ------------------------------------------------------------------ pushers
    // Rows that `src` sent this rank go back into src's buffer, after the rows src gets back from its
    // lower peers; they start at row `my_rows` of y (rows of lower sources come first there).
    const auto push_rows = [&](int src, int j0, int j1) {
      const int64_t my_rows = rows_from_lower(prefix, num_ranks, src, me);
      const int64_t base = rows_back_from_lower(prefix, num_ranks, src, me);
      uint8_t* data = p.data[src];
      const int lane = threadIdx.x & 31;
      for (int j = first_row_of_warp(j0); j < j1; j += warps_per_block()) {
        // Weight k = lane is loaded before the row's copy and stored after it (its latency hidden).
        int32_t* dst_w = reinterpret_cast<int32_t*>(data + p.off_weights) + (base + j) * p.num_topk;
        const int32_t* src_w = reinterpret_cast<const int32_t*>(p.weights) + (my_rows + j) * p.num_topk;
        const bool lane_weight = p.has_weights && lane < p.num_topk;
        const int32_t w = lane_weight ? __ldg(src_w + lane) : 0;
        if (p.expert_y != nullptr)
          store_expert_row<kType>(p, reinterpret_cast<int4*>(data + p.off_y + (base + j) * y_bytes), my_rows + j,
                                  static_cast<int>(y_bytes / 16), lane);
        else
          warp_copy16(reinterpret_cast<int4*>(data + p.off_y + (base + j) * y_bytes),
                      reinterpret_cast<const int4*>(p.y + (my_rows + j) * y_bytes), static_cast<int>(y_bytes / 16),
                      lane);
        if (lane_weight) dst_w[lane] = w;
        if (p.has_weights)
          for (int k = lane + 32; k < p.num_topk; k += 32) dst_w[k] = __ldg(src_w + k);
      }
    };
    run_pushers(env, epoch, p.num_push_blocks, kStageCombineSend, sh.chunk_done, trace,
                [&](int src) { return pair_count(prefix, num_ranks, src, me); }, push_rows,
                [&](int src, int k) { return &control_of(env, src)->combine_flag[me][k]; });
  } else if (!skip) {
    // ------------------------------------------------------------------ reducers
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    // Where the peers' rows land: pusher blocks publish epochs in combine_flag, the copy engine its
    // sequence numbers in copy_engine_flag (lane r waits for rank r's, which r announced in its header).
    const uint64_t(*landed)[kMaxChunks] = copy_engine ? mine->copy_engine_flag : mine->combine_flag;
    const uint64_t landed_target = copy_engine ? lane_copy_seq : epoch;
    const int q = blockIdx.x - p.num_push_blocks, num_reducers = p.num_blocks - p.num_push_blocks;
    // Lane r (< R) caches what it knows about rank r: where its rows start in this buffer, its
    // chunk size, and the last chunk seen complete.
    int64_t lane_base = 0;
    int lane_chunk_rows = 1, lane_ready_chunk = -1, lane_count = 0;
    if (lane < num_ranks) {
      lane_count = pair_count(prefix, num_ranks, me, lane);
      if (lane == me) {
        lane_base = rows_from_lower(prefix, num_ranks, me, me);
      } else {
        lane_base = rows_back_from_lower(prefix, num_ranks, me, lane);
      }
      lane_chunk_rows = chunk_rows(lane_count, env);
    }
    // The chunk of rank `lane`'s row `pos`: a lane's rows come in increasing order, so a copy-engine
    // chunk is searched from the last one waited for.
    const auto chunk_of = [&](int pos) {
      if (!copy_engine) return pos / lane_chunk_rows;
      int k = max(lane_ready_chunk, 0);
      while (pos >= copy_engine_chunk_end(sh.copy_engine_bounds, p.copy_engine.chunks, lane_count, k)) ++k;
      return k;
    };
    // Work items: reducer warp g (of all blocks) takes items g, g + all warps, ..., so that all warps walk
    // the tokens in the order their chunks land. With fewer tokens than warps each token's columns are
    // split into `slices` ranges of whole warp passes (item i: token i / slices, range i % slices), so
    // that every warp has work. (Faster than blocks taking groups of 2 x warps tokens at every size
    // measured; see CHANGELOG.md.) Lanes < R load the next item's routing while this one is reduced.
    const int all_warps = num_reducers * num_warps;
    const int n16 = static_cast<int>(y_bytes / 16);
    constexpr int kPass = 32 * kReduceUnroll;
    const int slices = max(1, min((n16 + kPass - 1) / kPass, all_warps / max(1, p.num_tokens)));
    const int slice_cols = ((n16 + slices - 1) / slices + kPass - 1) / kPass * kPass;
    const int num_items = p.num_tokens * slices;
    // Lane j < R also loads the token's j-th rank of the summation order (increasing rank without one).
    const auto load_route = [&](int i, bool* in, int* pos, int* rank_at) {
      *in = false;
      *pos = -1;
      *rank_at = lane;
      if (lane < num_ranks && i < num_items) {
        const int64_t t = i / slices;
        *in = p.is_token_in_rank[t * num_ranks + lane];
        *pos = p.pos[t * num_ranks + lane];
        if (p.summation_order != nullptr) *rank_at = p.summation_order[t * num_ranks + lane];
      }
    };
    int i = q * num_warps + warp;
    bool next_in;
    int next_pos, next_rank_at;
    load_route(i, &next_in, &next_pos, &next_rank_at);
    const auto next_item = [&](ReduceItem* item, bool* fresh) -> int {
      if (i >= num_items) return 0;
      const bool in = next_in;
      const int pos = next_pos, rank_at = next_rank_at;
      item->t = i / slices;
      item->slice = i % slices;
      load_route(i + all_warps, &next_in, &next_pos, &next_rank_at);
      i += all_warps;
      bool ok = true, waited = false;
      if (in && lane != me) {
        const int k = chunk_of(pos);
        if (k != lane_ready_chunk) {
          ok = traced_wait_flag(env, &landed[lane][k], landed_target, kStageCombineRecv, lane, k, trace);
          if (ok && copy_engine) stamp_landed(p.copy_engine, lane, k);
          lane_ready_chunk = k;
          waited = true;
        }
      }
      if (!__all_sync(0xffffffffu, ok)) return -1;
      *fresh = __any_sync(0xffffffffu, waited);
      item->mask = __ballot_sync(0xffffffffu, in);
      item->order = 0;
      for (int j = 0, n = 0; j < num_ranks; ++j) {  // the ranks of the mask, in the summation order
        const int r = __shfl_sync(0xffffffffu, rank_at, j);
        if ((item->mask >> r) & 1u) item->order |= static_cast<uint32_t>(r) << (4 * n++);
      }
      item->row_ptr = item->w_ptr = 0;
      if (in) {
        const int64_t row = lane_base + pos;
        if (lane == me) {
          item->row_ptr = reinterpret_cast<uint64_t>(p.y + row * y_bytes);
          item->w_ptr = reinterpret_cast<uint64_t>(p.weights + row * p.num_topk);
        } else {
          item->row_ptr = reinterpret_cast<uint64_t>(p.data[me] + p.off_y + row * y_bytes);
          item->w_ptr = reinterpret_cast<uint64_t>(p.data[me] + p.off_weights + row * p.num_topk * 4);
        }
      }
      return 1;
    };
    if (p.bulk_piece16 > 0) {
      extern __shared__ __align__(128) uint8_t bulk_smem[];
      failed = !bulk_reduce<kType>(p, bulk_smem, warp, lane, slice_cols, n16, next_item, trace);
    } else {
      ReduceItem item;
      bool fresh;
      int got;
      while ((got = next_item(&item, &fresh)) > 0) {
        reduce_token<kType>(p, item.t, item.mask, item.order, item.row_ptr, item.w_ptr, lane, item.slice * slice_cols,
                            min(n16, (item.slice + 1) * slice_cols), item.slice == 0);
        trace.first_wait();
      }
      failed = got < 0;
    }
  }

  __syncthreads();
  trace.stamp(kTraceWorkDone);
  if (finish_block(env, p.num_blocks, &sh.flag) && threadIdx.x == 0) {
    env.state->done = 0;
    env.state->seq = epoch;
  }
  trace.stamp(kTraceEnd);
}

// ========================================================================================== barrier
__global__ void barrier_kernel(KernelEnv env) {
  const uint64_t epoch = current_epoch(env);
  // A barrier announces a header too (operation "barrier", nothing else), so that a rank in a dispatch or a
  // combine against it sees a disagreement instead of a stale header; the check waits for every arrival.
  HeaderCheck barrier{};
  barrier.header[kHeaderOp] = kOpBarrier;
  if (static_cast<int>(threadIdx.x) < env.num_ranks) announce_header(env, barrier, 0, epoch);
  uint64_t copy_seq = 0;
  if (check_headers_warp(env, barrier, 0, epoch, kStageBarrier, true, &copy_seq, false) == kHeadersDisagree)
    close_after_disagreement(env, epoch, kStageBarrier, __any_sync(0xffffffffu, copy_seq != 0), [](int) { return true; });
  __syncthreads();
  if (threadIdx.x == 0) env.state->seq = epoch;
}

// One warp, an operation of its own: this rank's header of a call the host is about to take a decision on
// (the torch fallback, growing the buffer, new options), with the layout digest of `prefix` when
// hc.digest_from_prefix, announced and compared with every rank's; every header as seen, this rank's own and
// the verdict go to `host_out` in the layout of the notify's (NotifyParams::check), for the host's wait.
__global__ void exchange_kernel(KernelEnv env, HeaderCheck hc, const int32_t* prefix, int32_t* host_out) {
  const uint64_t epoch = current_epoch(env);
  const int lane = threadIdx.x, num_ranks = env.num_ranks;
  const int32_t digest = hc.digest_from_prefix ? warp_layout_digest(prefix, num_ranks) : hc.header[kHeaderLayout];
  if (lane < num_ranks) announce_header(env, hc, digest, epoch);
  int32_t seen[kHeaderWords];
  bool ok = true;
  if (lane < num_ranks) {
    ok = wait_flag(wait_ctx(env), &control_of(env, env.rank)->arrive[lane], epoch, kStageHeaderExchange, lane, 0);
    if (ok) load_header(env, hc, epoch, lane, seen);
  }
  bool differs = false;
  volatile int32_t* out = host_out;
  if (lane < num_ranks && ok) {
#pragma unroll
    for (int w = 0; w < kHeaderWords; ++w) {
      out[lane * kHeaderWords + w] = seen[w];
      if (w < kHeaderLen) differs |= seen[w] != (w == kHeaderLayout ? digest : hc.header[w]);
    }
    differs |= seen[kHeaderCopySeq] != 0;  // a rank in a copy-engine call disagrees with one exchanging (see there)
  }
  const bool all_ok = __all_sync(0xffffffffu, ok);
  const bool disagree = all_ok && __any_sync(0xffffffffu, differs);
  const bool any_copy_engine = __any_sync(0xffffffffu, lane < num_ranks && ok && seen[kHeaderCopySeq] != 0);
  if (lane == 0) {
#pragma unroll
    for (int w = 0; w < kHeaderLen; ++w) out[num_ranks * kHeaderWords + w] = w == kHeaderLayout ? digest : hc.header[w];
    out[num_ranks * kHeaderWords + kHeaderLen] = disagree ? 1 : 0;
  }
  if (disagree) close_after_disagreement(env, epoch, kStageHeaderExchange, any_copy_engine, [](int) { return true; });
  __syncwarp();
  if (lane == 0) env.state->seq = epoch;
}

// One thread: closes the epoch a notify opened (see launch_close_epoch).
__global__ void close_epoch_kernel(KernelEnv env) {
  const uint64_t epoch = current_epoch(env);
  env.state->done = 0;
  env.state->skip = 0;
  env.state->seq = epoch;
}

}  // namespace

// ========================================================================================== launchers
#ifndef __CUDACC_RTC__  // host code: the JIT build (ep_moe/native/jit/intranode.py) launches from Python
cudaError_t launch_notify(const NotifyParams& p, cudaStream_t stream) {
  notify_kernel<<<1 + p.env.num_ranks, kNotifyThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_dispatch(const DispatchParams& p, cudaStream_t stream) {
  const size_t smem = p.has_topk ? sizeof(int32_t) * p.experts_per_rank : 0;
  dispatch_kernel<<<p.num_blocks, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// 16-byte words per source and stage of a bulk-copy combine: the row cut into even pieces, each whole warp
// passes, as large as the budget allows; 0 where not even one warp pass per source fits.
static int bulk_piece16(int num_ranks, int n16) {
  const int64_t most = (kBulkSmemBudget - kBulkHeaderBytes) / (static_cast<int64_t>(kReduceWarps) * kBulkStages *
                                                               num_ranks * 16) / 32 * 32;
  if (most < 32 || n16 <= 0) return 0;
  const int64_t pieces = (n16 + most - 1) / most;
  return static_cast<int>(((n16 + pieces - 1) / pieces + 31) / 32 * 32);
}

cudaError_t launch_combine(const CombineParams& params, cudaStream_t stream) {
  CombineParams p = params;
  const auto kernel = p.y_type == kBF16 ? combine_kernel<kBF16> : combine_kernel<kFP32>;
  const int n16 = static_cast<int>(static_cast<int64_t>(p.hidden) * (p.y_type == kBF16 ? 2 : 4) / 16);
  p.bulk_piece16 = p.bulk_reduce ? bulk_piece16(p.env.num_ranks, n16) : 0;
  const int64_t smem = p.bulk_piece16 > 0 ? bulk_smem_bytes(p.env.num_ranks, p.bulk_piece16) : 0;
  if (smem > 0) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<p.num_blocks, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_barrier(const KernelEnv& env, cudaStream_t stream) {
  barrier_kernel<<<1, 32, 0, stream>>>(env);
  return cudaGetLastError();
}

cudaError_t launch_exchange(const KernelEnv& env, const HeaderCheck& check, const int32_t* prefix, int32_t* host_out,
                            cudaStream_t stream) {
  exchange_kernel<<<1, 32, 0, stream>>>(env, check, prefix, host_out);
  return cudaGetLastError();
}

cudaError_t launch_close_epoch(const KernelEnv& env, cudaStream_t stream) {
  close_epoch_kernel<<<1, 1, 0, stream>>>(env);
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace ep_moe
