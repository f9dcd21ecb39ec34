// A row pipeline through shared memory: warp 0 of a block loads pieces of rows with TMA bulk copies
// (many kilobytes in flight, no registers held), the other warps store each piece to its destination
// (a peer's buffer over NVLink, or a local output) and hand the stage back.
//
// Why: a warp that copies with 16-byte loads keeps only a few kilobytes in flight, so an SM moves
// ~30-45 GB/s; with a dozen 14 KB stages in flight per SM, loads stop being the limit. Every warp of
// the block walks the same sequence of pieces (counting them in `n`), so producer and consumers agree
// on stage and phase without talking; consumer warp c takes pieces n with n % kConsumers == c.
#pragma once

#include "common.cuh"

namespace ep_moe {

constexpr int kMaxStages = 16;
constexpr int kMaxStageBytes = 32 << 10;   // rows longer than this travel in several pieces
constexpr int kPipeSmemBytes = 200 << 10;  // dynamic shared memory for stages (and counters), at most
constexpr int kConsumers = kThreads / 32 - 1;

// ------------------------------------------------------------------------------------------ PTX
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Barrier initialisation visible to the async proxy (TMA) before its first use.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
// Global memory that generic-proxy writes (a peer's stores, acquired through a flag) made visible to
// this thread, now visible to its TMA reads too.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem_dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Wait for phase `parity` of a pipeline barrier. These waits are local to the block; they can only
// stall when another wait of this rank failed (then `abort` is set and this one gives up too).
static __device__ __noinline__ bool mbar_wait(WaitCtx ctx, uint64_t* bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return true;
  const uint64_t start = global_timer_ns();
  while (true) {
    if (mbar_try_wait(bar, parity)) return true;
    if (*reinterpret_cast<volatile int32_t*>(&ctx.state->abort) != 0) return false;
    const uint64_t waited = global_timer_ns() - start;
    if (waited > ctx.timeout_ns) {
      record_error(ctx, kErrorTimeout, kStagePipeline, ctx.rank, static_cast<int>(parity),
                   static_cast<int64_t>(waited));
      return false;
    }
  }
}

// ------------------------------------------------------------------------------------------ pipe
struct PipeShared {
  uint64_t full[kMaxStages];   // piece landed in the stage (TMA transaction count)
  uint64_t empty[kMaxStages];  // the consumer warp is done with the stage
};

// Stages of a pipe for rows of `row_bytes`, given `reserved` bytes of dynamic shared memory in use.
struct PipeShape {
  int stage_bytes, num_stages;
};
__host__ __device__ __forceinline__ PipeShape pipe_shape(int64_t row_bytes, int reserved) {
  const int stage = static_cast<int>(row_bytes < kMaxStageBytes ? row_bytes : kMaxStageBytes);
  const int fit = stage > 0 ? (kPipeSmemBytes - reserved) / stage : kMaxStages;
  return PipeShape{stage, fit < kMaxStages ? fit : kMaxStages};
}

struct RowPipe {
  uint8_t* stages;
  PipeShared* sh;
  int stage_bytes, num_stages;
  WaitCtx ctx;
  int64_t n = 0;  // pieces this warp has walked past
  int warp, lane;

  // One thread, before the block's first __syncthreads that precedes any use.
  __device__ __forceinline__ void init() const {
    for (int s = 0; s < num_stages; ++s) {
      mbar_init(&sh->full[s], 1);
      mbar_init(&sh->empty[s], 1);
    }
    fence_mbar_init();
  }
  __device__ __forceinline__ bool producer() const { return warp == 0; }

  // Producer warp (all lanes): queue piece n, `bytes` from `src`. False when the rank aborted.
  __device__ __forceinline__ bool load(const void* src, int bytes) {
    const int s = static_cast<int>(n % num_stages);
    bool ok = true;
    if (lane == 0) {
      if (n >= num_stages) ok = mbar_wait(ctx, &sh->empty[s], static_cast<uint32_t>((n / num_stages - 1) & 1));
      if (ok) {
        mbar_expect_tx(&sh->full[s], static_cast<uint32_t>(bytes));
        bulk_load(stages + static_cast<int64_t>(s) * stage_bytes, src, static_cast<uint32_t>(bytes), &sh->full[s]);
      }
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    if (ok) ++n;  // drain() waits for exactly the loads that were issued
    return ok;
  }

  // Consumer warps (all lanes): piece n goes to `dst`; only its consumer copies it. False on abort.
  __device__ __forceinline__ bool store(void* dst, int bytes) {
    const int64_t mine = n++;
    if (static_cast<int>(mine % kConsumers) != warp - 1) return true;
    const int s = static_cast<int>(mine % num_stages);
    if (!mbar_wait(ctx, &sh->full[s], static_cast<uint32_t>((mine / num_stages) & 1))) return false;
    const int4* src = reinterpret_cast<const int4*>(stages + static_cast<int64_t>(s) * stage_bytes);
    int4* out = reinterpret_cast<int4*>(dst);
    const int n16 = bytes / 16;
    constexpr int kU = 4;
    for (int base = lane; base < n16; base += 32 * kU) {
      int4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (base + u * 32 < n16) v[u] = src[base + u * 32];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (base + u * 32 < n16) out[base + u * 32] = v[u];
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&sh->empty[s]);
    return true;
  }

  // Producer, before the block exits: every queued load has landed (shared memory must not be
  // released under a TMA write, also when the consumers gave up).
  __device__ __forceinline__ void drain() {
    if (lane != 0) return;
    const int64_t first = n > num_stages ? n - num_stages : 0;
    for (int64_t m = first; m < n; ++m) {
      uint64_t* bar = &sh->full[m % num_stages];
      const uint32_t parity = static_cast<uint32_t>((m / num_stages) & 1);
      while (!mbar_try_wait(bar, parity)) {
      }
    }
  }
};

// Walk the pieces of a row of `row_bytes` at src / dst: the producer loads, consumers store.
__device__ __forceinline__ bool pipe_row(RowPipe& pipe, const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
  for (int64_t off = 0; off < row_bytes; off += pipe.stage_bytes) {
    const int bytes = static_cast<int>(row_bytes - off < pipe.stage_bytes ? row_bytes - off : pipe.stage_bytes);
    const bool ok = pipe.producer() ? pipe.load(src + off, bytes) : pipe.store(dst + off, bytes);
    if (!ok) return false;
  }
  return true;
}

}  // namespace ep_moe
