"""How fast the copy engine pushes one rank's combine rows into the peer's symmetric buffer.

    torchrun --nproc-per-node 2 benchmarks/copy_engine_push.py [--mbytes 58.7]

Both ranks push at once (``copy_`` of contiguous views is one ``cudaMemcpyAsync``): the bytes as one copy
and in 8 / 16 / 64 pieces, with a ``cuStreamWriteValue64`` flag after each piece (what
the native backend's copy-engine calls queue), split over two streams, with the flags on a stream of their own
(each after an event behind its copy), and beside a local copy on another stream (SM and HBM traffic, as
the reducers make). A device sleep first lets the host queue everything, so the times are the GPU's.
Results: docs/native.md.

Checked after the runs of every case, on every rank (the receiving buffer and flags zeroed before them): the bytes
the previous rank pushed into this rank's buffer, bit for bit against that rank's source (each rank's differs), the
flags against the sequence numbers the last run wrote, and the local copy beside it. Each line ends with ``check
ok`` or ``check DIFF``; a mismatch is printed (case, rank, first differing element) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from _checked import gather_problems, mismatch, report, verdict

from ep_moe.distributed import init_from_torchrun  # importing ep_moe keeps NVLink multicast off

HEAD_START_CYCLES = 4_000_000  # ~2 ms at ~2 GHz: longer than the host needs to queue one run


def source(rank: int, nbytes: int) -> torch.Tensor:
    """Rank ``rank``'s bytes to push: random, from a seed of its own, so a receiver can make the sender's."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    return torch.randint(0, 255, (nbytes,), generator=gen, dtype=torch.uint8, device="cuda")


def main() -> int:
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
    src = source(rank, nbytes)
    received = buf[:nbytes]  # where the previous rank pushes, and its flags (int64: small values)
    received_flags = buf[nbytes:nbytes + 8192].view(torch.int64)
    expected = source((rank - 1) % dist.get_world_size(), nbytes)
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
    return report("copy_engine_push", problems) if rank == 0 else (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
