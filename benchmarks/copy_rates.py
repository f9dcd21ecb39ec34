"""What one GPU can copy: plain copy kernels by SMs, threads and loads in flight, and the copy engine's push.

    torchrun --nproc-per-node 2 benchmarks/copy_rates.py            # local, push (store into the peer), pull
    python3 benchmarks/copy_rates.py                                 # one GPU: local only
    torchrun --nproc-per-node 2 benchmarks/copy_rates.py --copy-engine [--mbytes 58.7]   # the copy engine's push

The native dispatch/combine kernels move rows one warp per row; they were measured at about 65 % of the
per-SM rate of a plain grid-stride copy kernel (CHANGELOG.md). This measures
the ceiling for each shape the kernels could take: grid-stride 16-byte copies (``grid``) and one warp per
14 KB row (``row``, DeepEP's hidden 7168 in BF16; ``row_nc`` with the native kernels' non-coherent loads;
``row_list`` reading row ``list[r]``, a lookup before every row as the pushers do), with ``U`` 16-byte loads
in flight per thread, 512 or 1024 threads per block, one block per SM. 256 MiB per run; both GPUs copy at
once for push and pull (NVLink carries traffic both ways, as in dispatch). Prints GB/s per SM count,
median of 10 runs.

``tma`` moves each row with two bulk async copies (global -> shared -> global, the Hopper TMA unit): one
thread per block keeps ``U`` rows in flight (U x 14 KB of shared memory; U = 16 is the most that fits), to
see what one SM can push over NVLink without 16-byte stores from registers.

``reduce`` (local only, up to 512 threads) is the combine reducer's inner work without its waits: one warp
per 14 KB BF16 row adds the rows of two sources in fp32 and writes one row, U 16-byte loads per source in
flight; its GB/s counts the rows written (it reads twice as many bytes).

Checked after the runs of every SM count, on every rank: the bytes each kernel wrote (the destination is zeroed
before the runs) bit for bit against what it copies, the source's bytes (local, and the ranks' sources differ, so
push and pull show whose rows landed: push writes the next rank's buffer, which must then hold this rank's source;
pull reads it) or, for ``reduce``, torch's fp32 sum of the two halves rounded to bf16 (the kernel's arithmetic).
Each row ends with ``check ok`` or ``check DIFF``; a mismatch is printed (op, shape, SMs, first differing
element) and the exit status is 1.

``--copy-engine``: how fast the copy engine pushes one rank's combine rows into the peer's symmetric buffer (2 or
more GPUs). First the one copy that ``ep-moe bench --measure-link`` times
(`ep_moe.benchmarking.link.measure_peer_copy_gbps`, the slowest rank of each run). Both ranks push at once
(``copy_`` of contiguous views is one ``cudaMemcpyAsync``): the bytes as one copy and in 8 / 16 / 64 pieces, with a
``cuStreamWriteValue64`` flag after each piece (what the native backend's copy-engine calls queue), split over two
streams, with the flags on a stream of their own (each after an event behind its copy), and beside a local copy on
another stream (SM and HBM traffic, as the reducers make). A device sleep first lets the host queue everything, so
the times are the GPU's. Results: docs/native.md. Checked after the runs of every case, on every rank (the
receiving buffer and flags zeroed before them): the bytes the previous rank pushed into this rank's buffer, bit for
bit against that rank's source (each rank's differs), the flags against the sequence numbers the last run wrote,
and the local copy beside it. Each line ends with ``check ok`` or ``check DIFF``; a mismatch is printed (case,
rank, first differing element) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from _checked import gather_problems, mismatch, report, verdict

from ep_moe.distributed import TorchrunEnv, init_from_torchrun, torchrun_env

CUDA_SOURCE = r"""
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

template <int U>
__global__ void __launch_bounds__(1024) grid_copy(int4* __restrict__ dst, const int4* __restrict__ src, long long n16) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long base = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; base < n16;
       base += stride * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * stride < n16) v[u] = __ldcg(src + base + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * stride < n16) dst[base + u * stride] = v[u];
  }
}

__device__ __forceinline__ int4 ld_nc(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// One warp per row. kNc: non-coherent loads (as the native kernels read their input); list != null:
// the source row is list[r] (a send-list lookup before every row, as the native pushers do).
template <int U, bool kNc>
__global__ void __launch_bounds__(1024) row_copy(int4* __restrict__ dst, const int4* __restrict__ src, int rows, int row16,
                                                 const int* __restrict__ list) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    const int from = list != nullptr ? __ldg(list + r) : r;
    const int4* s = src + static_cast<long long>(from) * row16;
    int4* d = dst + static_cast<long long>(r) * row16;
    for (int base = lane; base < row16; base += 32 * U) {
      int4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + u * 32 < row16) v[u] = kNc ? ld_nc(s + base + u * 32) : __ldcg(s + base + u * 32);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + u * 32 < row16) d[base + u * 32] = v[u];
    }
  }
}

// Eight BF16 values of a and b added in fp32, rounded once.
__device__ __forceinline__ int4 add_bf16x8(const int4& a, const int4& b) {
  int4 out;
  const auto* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
  const auto* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
  auto* po = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
    po[i] = __floats2bfloat162_rn(fa.x + fb.x, fa.y + fb.y);
  }
  return out;
}

// One warp per row: dst[r] = a[r] + b[r] (BF16 rows, fp32 adds), U loads per source in flight per lane.
template <int U>
__global__ void __launch_bounds__(512, 1) row_reduce2(int4* __restrict__ dst, const int4* __restrict__ a,
                                                      const int4* __restrict__ b, int rows, int row16) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    const long long first = static_cast<long long>(r) * row16;
    for (int base = lane; base < row16; base += 32 * U) {
      int4 va[U], vb[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + u * 32 < row16) {
          va[u] = __ldcg(a + first + base + u * 32);
          vb[u] = __ldcg(b + first + base + u * 32);
        }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + u * 32 < row16) dst[first + base + u * 32] = add_bf16x8(va[u], vb[u]);
    }
  }
}

// ---- TMA (bulk async copies): one thread per block drives a ring of U row slots in shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bulk_load(void* slot, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(slot)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void bulk_wait_loaded(uint64_t* bar, uint32_t phase) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(phase) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* slot, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(slot)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Rows b, b + grid, ... of this block: row j goes through slot j % U (loaded by TMA, then stored by TMA
// from shared memory); a slot is reloaded once the store before the latest has read it.
template <int U>
__global__ void row_copy_tma(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, int rows, int row_bytes) {
  extern __shared__ __align__(128) uint8_t slots[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(slots + static_cast<size_t>(U) * row_bytes);
  if (threadIdx.x != 0) return;
  const int mine = rows > static_cast<int>(blockIdx.x) ? (rows - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const auto row_of = [&](int j) { return static_cast<long long>(blockIdx.x) + static_cast<long long>(j) * gridDim.x; };
  for (int u = 0; u < U; ++u) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bars + u)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  for (int j = 0; j < U && j < mine; ++j) bulk_load(slots + j * row_bytes, src + row_of(j) * row_bytes, row_bytes, bars + j);
  for (int j = 0; j < mine; ++j) {
    const int slot = j % U;
    bulk_wait_loaded(bars + slot, (j / U) & 1);
    bulk_store(dst + row_of(j) * row_bytes, slots + slot * row_bytes, row_bytes);
    const int next = j - 1 + U;  // reload the slot of row j - 1 once its store has read it
    if (j >= 1 && next < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      bulk_load(slots + (next % U) * row_bytes, src + row_of(next) * row_bytes, row_bytes, bars + next % U);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// shape: 0 grid-stride, 1 one warp per row, 2 the same with non-coherent loads, 3 the same through a
// row list (`list`, int32 [rows]), 4 the two-source reduction (sources: the two halves of src; nbytes/2
// written), 5 TMA bulk copies (U row slots per block, one issuing thread).
template <int U>
void launch(int shape, int64_t dst, int64_t src, int64_t nbytes, int row_bytes, const int* list, int blocks,
            int threads, cudaStream_t stream) {
  auto* d = reinterpret_cast<int4*>(dst);
  auto* s = reinterpret_cast<const int4*>(src);
  const int row16 = row_bytes / 16, rows = static_cast<int>(nbytes / row_bytes);
  if (shape == 5) {
    const size_t smem = static_cast<size_t>(U) * row_bytes + U * sizeof(uint64_t);
    cudaFuncSetAttribute(row_copy_tma<U>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    row_copy_tma<U><<<blocks, 32, smem, stream>>>(reinterpret_cast<uint8_t*>(dst), reinterpret_cast<const uint8_t*>(src),
                                                  rows, row_bytes);
  } else if (shape == 0) grid_copy<U><<<blocks, threads, 0, stream>>>(d, s, nbytes / 16);
  else if (shape == 4) row_reduce2<U><<<blocks, threads, 0, stream>>>(d, s, s + nbytes / 32, rows / 2, row16);
  else if (shape == 2) row_copy<U, true><<<blocks, threads, 0, stream>>>(d, s, rows, row16, nullptr);
  else row_copy<U, false><<<blocks, threads, 0, stream>>>(d, s, rows, row16, shape == 3 ? list : nullptr);
}

// Copy nbytes from address src to address dst (any GPU-visible addresses: local or a peer's).
int copy(int64_t shape, int64_t dst, int64_t src, int64_t nbytes, int64_t row_bytes, int64_t list, int64_t blocks,
         int64_t threads, int64_t unroll, int64_t stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int sh = static_cast<int>(shape), b = static_cast<int>(blocks), t = static_cast<int>(threads);
  const int rb = static_cast<int>(row_bytes);
  const int* l = reinterpret_cast<const int*>(list);
  if (sh == 5 && unroll < 2) return -1;  // the TMA ring reloads a slot one row late: it needs two slots
  switch (unroll) {
    case 1: launch<1>(sh, dst, src, nbytes, rb, l, b, t, s); break;
    case 4: launch<4>(sh, dst, src, nbytes, rb, l, b, t, s); break;
    case 8: launch<8>(sh, dst, src, nbytes, rb, l, b, t, s); break;
    case 16: launch<16>(sh, dst, src, nbytes, rb, l, b, t, s); break;
    default: return -1;
  }
  return static_cast<int>(cudaGetLastError());
}
"""

CPP_SOURCE = ("int copy(int64_t shape, int64_t dst, int64_t src, int64_t nbytes, int64_t row_bytes, int64_t list, "
              "int64_t blocks, int64_t threads, int64_t unroll, int64_t stream);")
SHAPES = {"grid": 0, "row": 1, "row_nc": 2, "row_list": 3, "reduce": 4, "tma": 5}

NBYTES = 256 << 20
ROW_BYTES = 7168 * 2


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline("ep_moe_copy_rates", CPP_SOURCE, cuda_sources=CUDA_SOURCE, functions=["copy"],
                       extra_cuda_cflags=["-O3"], verbose=False)


def median_gbps(ext, shape: str, dst: int, src: int, row_list: torch.Tensor, sms: int, threads: int, unroll: int,
                runs: int = 10) -> float:
    stream = torch.cuda.current_stream().cuda_stream
    times = []
    for i in range(runs + 2):
        if dist.is_initialized():
            torch.cuda.synchronize()
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        err = ext.copy(SHAPES[shape], dst, src, NBYTES, ROW_BYTES, row_list.data_ptr(), sms, threads, unroll, stream)
        end.record()
        end.synchronize()
        if err:
            raise RuntimeError(f"copy kernel failed: CUDA error {err}")
        if i >= 2:
            times.append(start.elapsed_time(end) * 1e-3)
    written = NBYTES // 2 if shape == "reduce" else NBYTES
    return written / statistics.median(times) / 1e9


def source(rank: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s NBYTES of source: finite bf16 values (the reduce adds them) that vary along the tensor and
    with the rank; any rank can make any rank's (integer arithmetic, the same on every device)."""
    i = torch.arange(NBYTES // 2, dtype=torch.int32, device=device)
    return ((i * 40503 + (rank + 1) * 9973) % 4093).float().div_(4093).sub_(0.5).bfloat16()


def written(shape: str) -> int:
    """The bf16 elements at the start of the destination that ``shape`` writes: every byte (grid), whole rows
    (the row shapes; NBYTES is not a multiple of a row), half of them (reduce)."""
    rows = NBYTES // ROW_BYTES
    return {"grid": NBYTES // 2, "reduce": rows // 2 * (ROW_BYTES // 2)}.get(shape, rows * (ROW_BYTES // 2))


HEAD_START_CYCLES = 4_000_000  # ~2 ms at ~2 GHz: longer than the host needs to queue one run


def push_source(rank: int, nbytes: int) -> torch.Tensor:
    """Rank ``rank``'s bytes to push: random, from a seed of its own, so a receiver can make the sender's."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    return torch.randint(0, 255, (nbytes,), generator=gen, dtype=torch.uint8, device="cuda")


def copy_engine_main(args: argparse.Namespace) -> int:
    """The copy engine's push cases (``--copy-engine``); the exit status."""
    from ep_moe.benchmarking.link import measure_peer_copy_gbps
    from ep_moe.benchmarking.timing import CudaEventTimer

    if (torchrun_env() or TorchrunEnv(rank=0, world_size=1, local_rank=0)).world_size < 2:
        raise SystemExit("--copy-engine needs 2 or more GPUs (torchrun --nproc-per-node 2 ...)")
    device = init_from_torchrun("cuda", timeout_s=600.0)
    rank = dist.get_rank()
    peer = (rank + 1) % dist.get_world_size()
    nbytes = int(args.mbytes * 1e6) // 16 * 16
    buf = symm_mem.empty(nbytes + 8192, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    dst = handle.get_buffer(peer, (nbytes,), torch.uint8)
    flags = handle.get_buffer(peer, (1024,), torch.uint64, storage_offset=nbytes // 8)
    src = push_source(rank, nbytes)
    received = buf[:nbytes]  # where the previous rank pushes, and its flags (int64: small values)
    received_flags = buf[nbytes:nbytes + 8192].view(torch.int64)
    expected = push_source((rank - 1) % dist.get_world_size(), nbytes)
    local_src = torch.randint(0, 255, (2 * nbytes,), dtype=torch.uint8, device="cuda")
    local_dst = torch.empty_like(local_src)
    # the CUDA 12 ABI of the stream memory operations (the unversioned symbol is the old, optional one)
    write_value = ctypes.CDLL("libcuda.so.1").cuStreamWriteValue64_v2
    write_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    flag_stream = torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(1024)]
    busy_stream = torch.cuda.Stream()
    seq = 0

    def timed(pieces: int, with_flags: bool = False, two_streams: bool = False, busy: bool = False,
              flags_apart: bool = False) -> tuple[float, list[str]]:
        """The median run's microseconds, and this rank's check problems after the runs."""
        nonlocal seq
        received.zero_()
        received_flags.zero_()
        local_dst.zero_()
        torch.cuda.synchronize()  # before the first run's barrier: no peer pushes into this buffer before
        times = []
        for _ in range(args.runs + 3):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if busy:
                with torch.cuda.stream(busy_stream):
                    torch.cuda._sleep(HEAD_START_CYCLES)
                    local_dst.copy_(local_src)
            with torch.cuda.stream(streams[0]):
                torch.cuda._sleep(HEAD_START_CYCLES)
                start.record()
            streams[1].wait_stream(streams[0])
            step = -(-nbytes // pieces) // 16 * 16 or 16
            for i, at in enumerate(range(0, nbytes, step)):
                stream = streams[i % 2] if two_streams else streams[0]
                with torch.cuda.stream(stream):
                    dst[at:at + step].copy_(src[at:at + step], non_blocking=True)
                if with_flags:
                    seq += 1
                    writer = stream
                    if flags_apart:  # the flag waits for an event behind the copy, on a stream of its own
                        events[i % 1024].record(stream)
                        flag_stream.wait_event(events[i % 1024])
                        writer = flag_stream
                    err = write_value(writer.cuda_stream, flags.data_ptr() + 8 * (i % 1024), seq, 0)
                    if err:
                        raise RuntimeError(f"cuStreamWriteValue64 failed: CUresult {err}")
            streams[0].wait_stream(streams[1])
            streams[0].wait_stream(flag_stream)
            with torch.cuda.stream(streams[0]):
                end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        dist.barrier()  # every rank's pushes into its peer are done
        found = [mismatch("bytes pushed by the previous rank", received, expected, None)]
        if with_flags:  # the last run's pieces wrote seq - count + 1 ... seq, the same on every rank
            count = len(range(0, nbytes, step))
            want = torch.zeros(1024, dtype=torch.int64, device="cuda")
            want[:count] = torch.arange(seq - count + 1, seq + 1, device="cuda")
            found.append(mismatch("flags written by the previous rank", received_flags, want, None))
        if busy:
            found.append(mismatch("local copy", local_dst, local_src, None))
        return sorted(times[3:])[args.runs // 2], [p for p in found if p]

    cases = [(1, False, False, False, False), (8, False, False, False, False), (16, False, False, False, False),
             (64, False, False, False, False), (4, True, False, False, False), (8, True, False, False, False),
             (16, True, False, False, False), (8, False, True, False, False), (4, True, True, False, False),
             (8, True, True, False, False), (16, True, True, False, False), (4, True, False, False, True),
             (8, True, False, False, True), (16, True, False, False, True), (1, False, False, True, False),
             (8, True, False, True, False), (8, True, True, True, False), (8, True, False, True, True)]
    gbps = measure_peer_copy_gbps(dist.group.WORLD, device, CudaEventTimer(), nbytes=nbytes, runs=args.runs)
    if rank == 0:
        print(f"copy engine push of {nbytes / 1e6:.1f} MB, one copy, slowest rank per run "
              f"(ep-moe bench --measure-link) {nbytes / gbps / 1e3:8.1f} us {gbps:7.1f} GB/s", flush=True)
    problems = []
    for pieces, with_flags, two_streams, busy, flags_apart in cases:
        what = (f"{pieces:3d} piece(s)" + (" + flags" if with_flags else "") + (" on 2 streams" if two_streams else "")
                + (" (flags on their own stream)" if flags_apart else "")
                + (f" + local copy of {2 * nbytes / 1e6:.0f} MB" if busy else ""))
        us, found = timed(pieces, with_flags, two_streams, busy, flags_apart)
        found = gather_problems([f"{what.strip()}: {p}" for p in found])
        problems += found
        if rank == 0:
            print(f"copy engine push of {nbytes / 1e6:.1f} MB, {what:45s} {us:8.1f} us {nbytes / us / 1e3:7.1f} GB/s  "
                  f"check {verdict(found)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return report("copy_rates --copy-engine", problems) if rank == 0 else (1 if problems else 0)



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", nargs="+", type=int, default=[1, 2, 4, 8, 16, 24, 32])
    parser.add_argument("--unroll", nargs="+", type=int, default=[1, 4, 8, 16], choices=[1, 4, 8, 16])
    parser.add_argument("--threads", nargs="+", type=int, default=[512, 1024])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--copy-engine", action="store_true",
                        help="time the copy engine's push into the peer instead of the copy kernels (2+ GPUs)")
    parser.add_argument("--mbytes", type=float, default=4096 * 14336 / 1e6,
                        help="--copy-engine: MB per rank (DeepEP's workload)")
    parser.add_argument("--runs", type=int, default=20, help="--copy-engine: timed runs per case")
    args = parser.parse_args()
    if args.copy_engine:
        return copy_engine_main(args)

    rank, world, local_rank = torchrun_env() or TorchrunEnv(rank=0, world_size=1, local_rank=0)
    if world > 1:
        device = init_from_torchrun("cuda", timeout_s=600.0)
    else:  # one GPU, no process group: local copies only
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    ext = build()
    src = source(rank, device)
    dst = torch.empty_like(src)
    row_list = torch.arange(NBYTES // ROW_BYTES, dtype=torch.int32, device=device)  # a send list: sorted rows
    targets = {"local": (dst.data_ptr(), src.data_ptr())}
    peer_buffer = None
    if world > 1:
        from ep_moe.native.symmetric import SymmetricBuffer

        peer_buffer = SymmetricBuffer(dist.group.WORLD, device, NBYTES)
        peer_buffer.tensor.view(torch.bfloat16).copy_(src)
        peer = (rank + 1) % world
        targets["push"] = (peer_buffer.ptrs[peer], src.data_ptr())  # store into the next rank's buffer
        targets["pull"] = (dst.data_ptr(), peer_buffer.ptrs[peer])  # load from it
        torch.cuda.synchronize()
        dist.barrier()
    # What each op's destination must hold after the runs (the first `written(shape)` elements), and where it is.
    half, out = NBYTES // 4, written("reduce")
    expected = {"local": src, "reduce": (src[:out].float() + src[half:half + out].float()).bfloat16()}
    destination = {"local": dst, "pull": dst}
    if world > 1:
        own = peer_buffer.tensor.view(torch.bfloat16)
        expected.update(push=source((rank - 1) % world, device), pull=source((rank + 1) % world, device))
        destination["push"] = own  # the previous rank pushes into this rank's buffer

    def prepare(op: str) -> None:
        """Zero what the runs write; before pulls, this rank's buffer holds its own source again (pushes
        overwrote it)."""
        destination[op].zero_()
        if op == "pull":
            own.copy_(src)

    problems = []
    if rank == 0:
        print(f"copy rates, {torch.cuda.get_device_name(device)}, {world} GPU(s); 256 MiB, GB/s copied per GPU "
              f"(median of 10); row = one warp per {ROW_BYTES}-byte row; U = 16-byte loads in flight per thread")
        print(f"{'op':6s} {'shape':8s} {'thr':>5s} {'U':>3s} " + " ".join(f"{n:>7d}" for n in args.sms)
              + "   GB/s/SM at the fewest SMs  check")
    for op, (d, s) in targets.items():
        for shape in args.shapes:
            if shape == "reduce" and op != "local":
                continue
            for threads in args.threads:
                if shape == "reduce" and threads > 512:  # its launch bounds
                    continue
                if shape == "tma" and threads != args.threads[0]:  # one issuing thread: threads do not matter
                    continue
                for unroll in args.unroll:
                    if shape == "tma" and unroll < 2:
                        continue
                    rates, found = [], []
                    for n in args.sms:
                        prepare(op)
                        rates.append(median_gbps(ext, shape, d, s, row_list, n, threads, unroll))
                        if world > 1:  # the peers' writes into this rank's buffer are done
                            torch.cuda.synchronize()
                            dist.barrier()
                        w = written(shape)
                        found += [p for p in [mismatch(f"{op} {shape}, {threads} threads, U {unroll}, {n} SMs: "
                                                       "destination after the last run", destination[op][:w],
                                                       expected["reduce" if shape == "reduce" else op][:w], None)]
                                  if p]
                    found = gather_problems(found)
                    problems += found
                    if world > 1:  # the slowest GPU sets the pace
                        t = torch.tensor(rates, device=device)
                        dist.all_reduce(t, op=dist.ReduceOp.MIN)
                        rates = t.tolist()
                    if rank == 0:
                        print(f"{op:6s} {shape:8s} {threads:5d} {unroll:3d} " + " ".join(f"{r:7.1f}" for r in rates)
                              + f"   {rates[0] / args.sms[0]:.1f}  check {verdict(found)}", flush=True)
    if world > 1:
        dist.barrier()
        peer_buffer.destroy()
        dist.destroy_process_group()
    return report("copy_rates", problems) if rank == 0 else (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
