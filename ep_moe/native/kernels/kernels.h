// The parameter structs and constants of the intranode kernels (raw pointers and sizes; no torch), and each
// operation's contract as a launch function's declaration (never defined: ep_moe/native/jit/intranode.py fills
// the structs and launches the kernels, ep_moe/native/jit/copy_engine.py queues the copy-engine halves).
#pragma once

#ifdef __CUDACC_RTC__
#include "rtc_prelude.h"  // NVRTC (the JIT build) has no toolkit headers
#else
#include <cstdint>
#include <cuda_runtime.h>
#endif

namespace ep_moe {

constexpr int kMaxRanks = 8;        // one NVLink domain of one host
constexpr int kMaxChunks = 256;     // signal slots per (source, destination) pair
constexpr int kMaxNotifyExperts = 1024;  // local experts whose counts travel in the count exchange
constexpr int kControlBytes = 128 << 10;
constexpr int kThreads = 512;       // threads of the dispatch / combine blocks
constexpr int kMaxCopyEngineChunks = 16;  // chunks per pair of a copy-engine call
constexpr int kMaxCopyStreams = 4;  // side streams one copy-engine call spreads its chunks over

// ------------------------------------------------------------------------------------------ rank agreement
// The header every rank announces for each collective operation, before any row moves: the first kHeaderLen
// words are the torch backend's (ep_moe/backends/agreement.py, same slots and codes) and are compared; the two
// native-only words are not. kHeaderCopySeq: a cached dispatch's or a combine's copy-engine sequence number of
// this call (0: no copy engine), which its receivers wait for in copy_engine_flag (each sender's own, so that
// ranks whose sequence numbers drifted apart in a disagreement still wait for the right value). kHeaderLastSeq:
// in a fresh dispatch's notify, the rank's last sequence number (the host takes the largest over the ranks, so
// that a fresh copy-engine dispatch uses one number on every rank, above every flag written so far).
constexpr int kHeaderLen = 8;
constexpr int kHeaderWords = 10;
enum HeaderSlot { kHeaderOp = 0, kHeaderHidden, kHeaderDtype, kHeaderScales, kHeaderTopk, kHeaderExperts,
                  kHeaderWorst, kHeaderLayout, kHeaderCopySeq, kHeaderLastSeq };
enum HeaderOp { kOpDispatch = 1, kOpCachedDispatch = 2, kOpCombine = 3, kOpBarrier = 4 };

// Error record in pinned host memory (int32 words), written by the first failing wait of a rank.
enum ErrorWord { kErrCode = 0, kErrRank, kErrStage, kErrChannel, kErrPeer, kErrDetail, kErrValueLo, kErrValueHi,
                 kErrWords = 16 };
enum ErrorCode { kErrorNone = 0, kErrorTimeout = 1, kErrorCapacity = 2 };
// Mismatch record: the int32 words after the error record (error + kErrWords), written by the first kernel of
// a rank that finds the ranks' headers unequal (and only while kMismatchFound is 0: the host clears it when it
// raises). Not an error record: the epoch still closes and the buffer stays usable. kMismatchOwn: this rank's
// own header; kMismatchSeen: every rank's header as this rank's kernel saw it ([kMaxRanks][kHeaderLen]).
enum MismatchWord { kMismatchFound = 0, kMismatchRank, kMismatchRanks, kMismatchOwn,
                    kMismatchSeen = kMismatchOwn + kHeaderLen,
                    kMismatchWords = kMismatchSeen + kMaxRanks * kHeaderLen };
enum Stage {
  kStageNotify = 1,          // dispatch count exchange: waiting for a peer's counts
  kStageDispatchSend = 2,    // dispatch: waiting for a peer to enter the operation before writing to it
  kStageDispatchRecv = 3,    // dispatch: waiting for a peer's rows
  kStageCombineSend = 4,     // combine: waiting for a peer to enter the operation
  kStageCombineRecv = 5,     // combine: waiting for a peer's rows
  kStageBarrier = 6,         // barrier
  kStageDispatchCapacity = 7,
  kStageCombineCapacity = 8,
  kStageHeaderExchange = 9,  // a header exchange before a host-side decision (launch_exchange)
};

struct LocalState;

// Per-block timeline of a dispatch or combine kernel (diagnostics; written when `trace` is set):
// entry, the first peer wait satisfied (pushers: the peer entered; local blocks / reducers: the
// first chunk landed), the block's share of the work done, exit (after the last block closed the epoch);
// then two sums over the block's warps, in ns: time spent waiting for peers' flags, and (pushers) time
// spent in the per-chunk handshake (block counter and system-scope release).
enum TraceSlot { kTraceStart = 0, kTraceFirstWait, kTraceWorkDone, kTraceEnd, kTraceWaitNs, kTraceSyncNs, kTraceSlots };

struct KernelEnv {
  int rank;
  int num_ranks;
  uint8_t* ctrl[kMaxRanks];   // every rank's control block (symmetric), indexed by rank
  LocalState* state;          // this rank's private device state
  int32_t* error;             // pinned host error record (device-visible)
  uint64_t timeout_ns;
  int chunks_per_pair;        // rows one source sends one destination go in at most this many chunks
  int min_chunk_rows;         // ... of at least this many rows
};

// ------------------------------------------------------------------------------------------ layout
struct LayoutParams {
  const int64_t* topk_idx;      // [T, K]
  int num_tokens, num_topk, num_experts, num_ranks;
  int32_t* num_tokens_per_rank;    // [R]  (zeroed by the launcher)
  int32_t* num_tokens_per_expert;  // [E]  (zeroed by the launcher)
  bool* is_token_in_rank;          // [T, R]
};
cudaError_t launch_layout(const LayoutParams& p, cudaStream_t stream);

// ------------------------------------------------------------------------------------------ header check
// This rank's header of a call (kHeaderWords words; see HeaderSlot), compared with every rank's before any row
// moves (notify for a fresh dispatch; the kernel itself for a cached dispatch and a combine).
struct HeaderCheck {
  int32_t header[kHeaderWords];
  bool digest_from_prefix;  // slot kHeaderLayout: the layout digest of rank_prefix_matrix (cached dispatch, combine)
  // Test only (null: off, at no cost): a device int32 [3] (source rank, slot, value added): the kernel sees that
  // source's header with the value added to that slot, so that a one-rank group can run the mismatch path.
  // Read when the kernel runs, so a CUDA-graph replay sees the values of the moment.
  const int32_t* test_perturb;
};

// ------------------------------------------------------------------------------------------ notify
struct NotifyParams {
  KernelEnv env;
  // The tensors first, in the order a bound launch rewrites them (NOTIFY_BOUND, ep_moe/native/jit/intranode.py).
  const bool* is_token_in_rank;   // [T, R]
  const void* num_tokens_per_rank;  // [R], int32 or int64
  int32_t* rank_prefix_matrix;    // [R, R] out: rows ranks 0..s send rank r (cumulative over s)
  int32_t* pos;                   // [T, R] out: row of token t among those sent to r, or -1
  int32_t* send_list;             // [R, T] out: send_list[r][j] = token of the j-th row sent to r
  const int64_t* topk_idx;        // [T, K] expert ids, -1 for none (read for the per-expert counts only)
  bool counts_int64;
  int num_tokens;
  int32_t* host_counts;           // [R * R + R] out (pinned): rows s sends r, then every source's tokens
  int num_worst_tokens;           // > 0: check capacity on the device (no host sync follows)
  int64_t rows_capacity;          // dispatch rows the receive buffer holds
  // Per-expert counts (exact-size dispatch; null host_expert_counts: not exchanged): every rank counts its
  // tokens per expert from topk_idx, sends each peer the counts of that peer's experts, and writes the
  // aligned sums of what it receives to the host, so the host has them at the count sync.
  int num_topk, experts_per_rank, expert_alignment;
  int64_t* host_expert_counts;    // [L] out (pinned, device-mapped): aligned counts of rows per local expert
  // The header check: host_counts continues after the tokens with every rank's header as seen ([R][kHeaderWords]),
  // this rank's own (kHeaderLen) and the verdict (1: the ranks disagree; the dispatch kernel then moves nothing).
  // A fixed-size dispatch (no host wait follows) also writes the mismatch record.
  HeaderCheck check;
};
cudaError_t launch_notify(const NotifyParams& p, cudaStream_t stream);

// ------------------------------------------------------------------------------------------ copy engine
// What a kernel and its copy stream share when rows travel by the copy engine (seq > 0): the host's sequence
// number of the operation, which the copy stream writes into the receivers' copy_engine_flag; the go word
// that block 0 sets once every peer entered the operation (the copy stream waits for it, since it may then
// write into the peers' buffers); and the chunks: chunk k of n rows ends at n * bounds[k + 1] / bounds[chunks]
// (cumulative shares, bounds[0] = 0).
struct CopyEngineParams {
  uint64_t seq;
  uint64_t* go;
  int chunks;
  int32_t bounds[kMaxCopyEngineChunks + 1];
  // Diagnostics (null: off): global-timer ns when the go word was set ([0]) and when a warp first saw
  // chunk k of source s landed ([1 + s * kMaxCopyEngineChunks + k]; the host fills them with INT64_MAX).
  int64_t* trace;
};
constexpr int kCopyEngineTraceSlots = 1 + kMaxRanks * kMaxCopyEngineChunks;
// The host streams of a copy-engine call: chunk k's copies go on copy[k % num_copy], each peer's flag write
// for it after them on the same stream, or, with a flag stream, on that stream once an event recorded
// behind the chunk's copies completed (the copy stream then starts the next chunk without waiting for the
// flag write's fence to drain the copies).
struct CopyStreamSet {
  const cudaStream_t* copy;
  int num_copy;
  cudaStream_t flags;  // null: flag writes on the copy streams
};

// ------------------------------------------------------------------------------------------ dispatch
struct DispatchParams {
  KernelEnv env;
  uint8_t* data[kMaxRanks];       // every rank's symmetric data buffer
  int64_t off_x, off_scales, off_idx, off_weights, off_src;  // regions in the data buffer
  // The tensors and the received row count first, in the order a bound launch rewrites them (DISPATCH_BOUND: a
  // cached dispatch's, up to num_recv_rows; FRESH_DISPATCH_BOUND: all, ep_moe/native/jit/intranode.py).
  const int32_t* rank_prefix_matrix;  // [R, R]
  const int32_t* send_list;       // [R, T]
  const uint8_t* x;               // [T, x_bytes]
  const float* scales;            // [T, num_scales] or null
  uint8_t* recv_x;                // [N, x_bytes]
  float* recv_scales;             // [N, num_scales]
  int num_recv_rows;              // N: received rows, or num_worst_tokens (rows past the total are padding)
  const int64_t* topk_idx;        // [T, K] (fresh dispatch)
  const float* topk_weights;      // [T, K]
  int64_t* recv_topk_idx;         // [N, K]
  float* recv_topk_weights;       // [N, K]
  int32_t* recv_src_idx;          // [N]
  int32_t* recv_src_rank;         // [N]
  int32_t* expert_scratch;        // [L] zero on entry, zero on exit
  int64_t* num_recv_per_expert;   // [L] out, aligned
  int num_tokens;
  int x_bytes;                    // row bytes, a multiple of 16
  int num_scales;
  bool has_scales;                // FP8 rows (flags, not null pointers: an empty tensor has none)
  bool has_topk;                  // a fresh dispatch (top-k ids and weights travel); false: cached
  int num_topk;
  int experts_per_rank;
  int64_t rows_capacity;          // rows each rank's data buffer holds in this layout
  int expert_alignment;
  bool write_arrival;             // cached dispatch: this kernel is the operation's first
  int num_blocks, num_push_blocks;
  int64_t* trace;                 // [num_blocks, kTraceSlots] stamps and sums (ns) or null
  // Copy-engine dispatch (copy_engine.seq > 0, num_push_blocks 0): every source's whole x (and scales;
  // in a fresh dispatch also its top-k in global ids and its send list to this rank) lands, token-indexed,
  // in its slot of this rank's buffer (source s: rows [s * slot_rows, + tokens[s])) by the source's copy
  // stream (enqueue_copy_engine_dispatch), chunks cutting the tokens; every block copies locally: the own
  // rows, then row j of source s from its token (cached_src_idx[j], or entry j of the staged send list).
  CopyEngineParams copy_engine;
  int32_t copy_engine_tokens[kMaxRanks];
  int64_t copy_engine_slot_rows;
  const int32_t* cached_src_idx;  // [N] the handle's recv_src_idx (cached dispatch), or null (fresh)
  HeaderCheck check;              // cached dispatch (write_arrival): compared in the kernel; fresh: by notify
  // Rows left in place (a fresh or cached dispatch of the expert-major path; never with the copy engine): the
  // local blocks wait for every chunk and write the metadata (fresh: top-k, weights, source, counts, padding;
  // cached: none) but copy no row data (recv_x, recv_scales null). A later kernel on the same stream reads the peers' rows from this
  // rank's buffer, where they landed in output order, and the own rows from x (permute_received_rows).
  bool rows_in_place;
};
cudaError_t launch_dispatch(const DispatchParams& p, cudaStream_t stream);
// The copy-engine half of a dispatch launched with the same `p`, queued after the kernel on `streams`
// (CopyStreamSet): wait until *go >= seq; a fresh dispatch first copies each peer its send list and the whole
// top-k; then chunk by chunk and peer by peer one copy of x's rows (and one of the scales) into this rank's
// slot of the peer's buffer, each chunk's flag write ordered after its copies with a memory fence.
// `host_prefix`: [R, R].
cudaError_t enqueue_copy_engine_dispatch(const DispatchParams& p, const int32_t* host_prefix,
                                         const CopyStreamSet& streams);

// ------------------------------------------------------------------------------------------ combine
enum ElemType { kNone = 0, kBF16 = 1, kFP32 = 2 };
struct CombineParams {
  KernelEnv env;
  uint8_t* data[kMaxRanks];
  int64_t off_y, off_weights;      // regions in the data buffer
  int64_t rows_capacity;
  // The tensors first, in the order a bound launch rewrites them (COMBINE_BOUND, ep_moe/native/jit/intranode.py).
  const int32_t* rank_prefix_matrix;  // [R, R] from the handle
  const bool* is_token_in_rank;    // [T, R]
  const int32_t* pos;              // [T, R]
  const uint8_t* y;                // [N, hidden] of y_type
  const float* weights;            // [N, K]
  const void* bias0;               // [T, hidden] of bias0_type, or null
  const void* bias1;
  uint8_t* out;                    // [T, hidden] of y_type
  float* out_weights;              // [T, K] or null
  // [T, R]: per token, the ranks in the order their rows are added (DeepEP V2's), or null: increasing rank.
  const int32_t* summation_order;
  int num_tokens;
  int y_type, hidden;
  bool has_weights;                // top-k weights are combined too
  int num_topk;
  int bias0_type, bias1_type;
  int num_blocks, num_push_blocks;
  int64_t* trace;                  // [num_blocks, kTraceSlots] stamps and sums (ns) or null
  // Copy-engine combine (copy_engine.seq > 0, num_push_blocks 0): the rows go back to their sources by
  // the copy engine (enqueue_copy_engine_combine), not by pusher blocks; every block reduces, waiting for
  // copy_engine_flag[source][chunk] >= copy_engine.seq. Chunks cut each pair's rows.
  CopyEngineParams copy_engine;
  // Reducers load the rows with bulk copies into shared memory (a few pieces of rows per warp in flight)
  // instead of into registers. launch_combine sets bulk_piece16 (16-byte words of one source's segment per
  // stage; 0: register reducers) where the block's shared memory holds at least a warp pass per source.
  bool bulk_reduce;
  int bulk_piece16;
  HeaderCheck check;
  // Expert-major combine (expert_y non-null; never with the copy engine): the pushers send, for received row
  // i, the fp32 sum over its slots sorted_slots[i] (in order; entries < 0 skipped) of expert_weights[s] * expert_y[s]
  // (each product rounded first: no fused multiply-add; plain sums without weights), from 0, rounded once
  // to y_type: the arithmetic of ep_moe_native::unpermute_sum, computed as the row goes out. y then holds only
  // this rank's own rows (read in place by the reducers; ep_moe_native::unpermute_own_rows).
  const uint8_t* expert_y;         // [expert_slots, hidden] of y_type
  const float* expert_weights;     // [expert_slots] or null
  const int64_t* sorted_slots;     // [N, expert_topk]
  int expert_topk;
  int64_t expert_slots;
};
cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream);

// The copy-engine half of a combine launched with the same `p` (copy_engine.seq > 0), queued after the
// kernel on `streams` (CopyStreamSet): wait until *go >= seq, then, chunk by chunk and peer by peer, one
// device-to-device copy of this rank's rows into the peer's buffer (the peer's top-k weights with its first
// chunk), each chunk's flag write into the peer's copy_engine_flag ordered after its copies with a memory
// fence. `host_prefix`: the [R, R] rank prefix matrix on the host.
cudaError_t enqueue_copy_engine_combine(const CombineParams& p, const int32_t* host_prefix,
                                        const CopyStreamSet& streams);
// Most rows any rank gets back in a combine of this layout (host; [R, R] prefix matrix on the host).
int64_t most_rows_back(const int32_t* host_prefix, int num_ranks);

// ------------------------------------------------------------------------------------------ barrier
cudaError_t launch_barrier(const KernelEnv& env, cudaStream_t stream);
// Closes the epoch a notify opened when no dispatch kernel follows it (an exact-size dispatch whose header check
// failed: the host raises instead of launching the dispatch; without this, the next notify would reuse the epoch).
cudaError_t launch_close_epoch(const KernelEnv& env, cudaStream_t stream);
// A header exchange as an operation of its own (one warp; an epoch): announces `check` (with the layout digest
// of `prefix`, [R, R] int32 on the device, when check.digest_from_prefix), compares it with every rank's and
// writes what the notify's header check writes (NotifyParams::check) to `host_out` (pinned, device-mapped).
// Run before a host-side decision that must be the same on every rank (the torch fallback, a larger buffer).
cudaError_t launch_exchange(const KernelEnv& env, const HeaderCheck& check, const int32_t* prefix, int32_t* host_out,
                            cudaStream_t stream);

}  // namespace ep_moe
