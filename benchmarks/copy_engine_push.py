"""How fast the copy engine pushes one rank's combine rows into the peer's symmetric buffer.

    torchrun --nproc-per-node 2 benchmarks/copy_engine_push.py [--mbytes 58.7]

Both ranks push at once (``copy_`` of contiguous views is one ``cudaMemcpyAsync``): the bytes as one copy
and in 8 / 16 / 64 pieces, with a ``cuStreamWriteValue64`` flag after each piece (what
the native backend's copy-engine calls queue), split over two streams, with the flags on a stream of their own
(each after an event behind its copy), and beside a local copy on another stream (SM and HBM traffic, as
the reducers make). A device sleep first lets the host queue everything, so the times are the GPU's.
Results: docs/native.md.
"""

from __future__ import annotations

import argparse
import ctypes

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from ep_moe.distributed import init_from_torchrun  # importing ep_moe keeps NVLink multicast off

HEAD_START_CYCLES = 4_000_000  # ~2 ms at ~2 GHz: longer than the host needs to queue one run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=float, default=4096 * 14336 / 1e6, help="MB per rank (DeepEP's workload)")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    init_from_torchrun("cuda", timeout_s=600.0)
    rank = dist.get_rank()
    peer = (rank + 1) % dist.get_world_size()
    nbytes = int(args.mbytes * 1e6) // 16 * 16
    buf = symm_mem.empty(nbytes + 8192, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    dst = handle.get_buffer(peer, (nbytes,), torch.uint8)
    flags = handle.get_buffer(peer, (1024,), torch.uint64, storage_offset=nbytes // 8)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    local_src = torch.empty(2 * nbytes, dtype=torch.uint8, device="cuda")
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
              flags_apart: bool = False) -> float:
        nonlocal seq
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
        return sorted(times[3:])[args.runs // 2]

    cases = [(1, False, False, False, False), (8, False, False, False, False), (16, False, False, False, False),
             (64, False, False, False, False), (4, True, False, False, False), (8, True, False, False, False),
             (16, True, False, False, False), (8, False, True, False, False), (4, True, True, False, False),
             (8, True, True, False, False), (16, True, True, False, False), (4, True, False, False, True),
             (8, True, False, False, True), (16, True, False, False, True), (1, False, False, True, False),
             (8, True, False, True, False), (8, True, True, True, False), (8, True, False, True, True)]
    for pieces, with_flags, two_streams, busy, flags_apart in cases:
        us = timed(pieces, with_flags, two_streams, busy, flags_apart)
        if rank == 0:
            what = (f"{pieces:3d} piece(s)" + (" + flags" if with_flags else "") + (" on 2 streams" if two_streams else "")
                    + (" (flags on their own stream)" if flags_apart else "")
                    + (f" + local copy of {2 * nbytes / 1e6:.0f} MB" if busy else ""))
            print(f"copy engine push of {nbytes / 1e6:.1f} MB, {what:45s} {us:8.1f} us {nbytes / us / 1e3:7.1f} GB/s",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
