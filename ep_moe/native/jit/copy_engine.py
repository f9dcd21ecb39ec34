"""The copy-engine halves of a dispatch and a combine for the JIT module, in Python over the CUDA driver API, queued
after the kernel that the same parameter struct launched.

What they queue: on every copy stream a wait until the kernel's go word reaches the call's
sequence number (``cuStreamWaitValue64``: the kernel sets it once every peer entered the call); then, chunk by chunk
and peer by peer, device-to-device copies into the peer's symmetric buffer (``cuMemcpyDtoDAsync``; chunk k on copy
stream k % streams) and, per peer, the write of the sequence number into the peer's
``Control::copy_engine_flag[this rank][k]`` (``cuStreamWriteValue64``, which orders it after the stream's earlier
copies): on the copy stream itself, or, with a flag stream, there after an event recorded behind the chunk's copies.
Combine: this rank's rows for each source, contiguous on both sides, the top-k weights with the pair's first chunk.
Dispatch: a fresh one first sends each peer its send list and the whole top-k (with chunk 0), then every chunk of
this rank's tokens (x and scales) into this rank's slot of every peer's buffer.

The driver calls go through an `Ops` object (`CudaOps` on a GPU; the CPU tests use one that copies host memory),
so the whole schedule is testable without a GPU.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Protocol

from . import params as P

MAX_CHUNKS = dict(P.CONSTANTS)["kMaxChunks"]  # Control::copy_engine_flag is [kMaxRanks][kMaxChunks] uint64
WAIT_VALUE_GEQ = 0x0        # CU_STREAM_WAIT_VALUE_GEQ
WRITE_VALUE_DEFAULT = 0x0   # CU_STREAM_WRITE_VALUE_DEFAULT: the write waits for the stream's earlier work
EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING


class Ops(Protocol):
    """The stream operations a copy-engine call queues (streams and addresses as ints)."""

    def wait_value(self, stream: int, address: int, value: int) -> None: ...
    def write_value(self, stream: int, address: int, value: int) -> None: ...
    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def after_chunk(self, k: int, before: int, after: int) -> None:
        """``after`` waits for the work queued so far on ``before`` (an event per chunk k)."""
        ...


class CudaOps:
    """`Ops` over libcuda, for one device: the CUDA 12 ABI of the stream memory operations (the ``_v2`` entry
    points), ``cuMemcpyDtoDAsync`` (peers' memory is addressed through unified virtual addresses), and one event per
    chunk created once; a lock covers an event's record and the wait on it (a wait takes the event's state when it
    is queued, so the event may be recorded again by the next call, but not in between by another thread)."""

    def __init__(self, device: int) -> None:
        from .driver import driver

        self.device = device
        drv = self._drv = driver()
        lib = drv.lib
        u64, vp = ctypes.c_uint64, ctypes.c_void_p
        for name in ("cuStreamWaitValue64_v2", "cuStreamWriteValue64_v2"):
            getattr(lib, name).argtypes = [vp, u64, u64, ctypes.c_uint]
        lib.cuMemcpyDtoDAsync_v2.argtypes = [u64, u64, ctypes.c_size_t, vp]
        lib.cuEventRecord.argtypes = [vp, vp]
        lib.cuStreamWaitEvent.argtypes = [vp, vp, ctypes.c_uint]
        self._lib = lib
        drv.use_primary_context(device)
        self._events = []
        for _ in range(P.MAX_COPY_ENGINE_CHUNKS):
            event = vp()
            drv.check(lib.cuEventCreate(ctypes.byref(event), EVENT_DISABLE_TIMING), "cuEventCreate")
            self._events.append(event)
        self._lock = threading.Lock()

    def wait_value(self, stream: int, address: int, value: int) -> None:
        self._drv.check(self._lib.cuStreamWaitValue64_v2(stream, address, value, WAIT_VALUE_GEQ), "cuStreamWaitValue64")

    def write_value(self, stream: int, address: int, value: int) -> None:
        self._drv.check(self._lib.cuStreamWriteValue64_v2(stream, address, value, WRITE_VALUE_DEFAULT),
                        "cuStreamWriteValue64")

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._drv.check(self._lib.cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def after_chunk(self, k: int, before: int, after: int) -> None:
        with self._lock:
            self._drv.check(self._lib.cuEventRecord(self._events[k], before), "cuEventRecord")
            self._drv.check(self._lib.cuStreamWaitEvent(after, self._events[k], 0), "cuStreamWaitEvent")


_ops: dict[int, CudaOps] = {}
_ops_lock = threading.Lock()


def cuda_ops(device: int) -> CudaOps:
    """The device's `CudaOps` (made once per process)."""
    with _ops_lock:
        found = _ops.get(device)
        if found is None:
            found = _ops[device] = CudaOps(device)
        return found


# ------------------------------------------------------------------------------------------ rows (common.cuh)
def rows_from_lower(prefix: list[int], num_ranks: int, s: int, r: int) -> int:
    """Rows destination r receives from sources below s."""
    return prefix[(s - 1) * num_ranks + r] if s > 0 else 0


def pair_count(prefix: list[int], num_ranks: int, s: int, r: int) -> int:
    """Rows source s sends destination r."""
    return prefix[s * num_ranks + r] - rows_from_lower(prefix, num_ranks, s, r)


def rows_back_from_lower(prefix: list[int], num_ranks: int, s: int, r: int) -> int:
    """Rows rank s gets back in a combine from its peers below r (where peer r's rows start in s's buffer)."""
    return sum(pair_count(prefix, num_ranks, s, q) for q in range(r) if q != s)


def most_rows_back(prefix: list[int], num_ranks: int) -> int:
    """Most rows any rank gets back in a combine of this layout."""
    return max(rows_back_from_lower(prefix, num_ranks, s, num_ranks) for s in range(num_ranks))


def chunk_end(bounds: list[int], chunks: int, count: int, k: int) -> int:
    """End (exclusive) of chunk k of ``count`` rows cut by the cumulative shares ``bounds``."""
    return count * bounds[k + 1] // bounds[chunks]


# ------------------------------------------------------------------------------------------ the schedule
class _Streams:
    """One call's streams."""

    def __init__(self, ops: Ops, env: P.KernelEnv, ce: P.CopyEngineParams, copy_streams: list[int], flag_stream: int,
                 flags_offset: int) -> None:
        self.ops, self.copy_streams, self.flag_stream = ops, copy_streams, flag_stream
        self.ctrl = list(env.ctrl)
        self.rank, self.num_ranks = env.rank, env.num_ranks
        self.seq, self.go, self.chunks = ce.seq, ce.go, ce.chunks
        self.bounds = list(ce.bounds)
        self.flags_offset = flags_offset
        self.pending = 0  # peers whose flag of the current chunk waits for chunk_queued

    def wait_for_go(self) -> None:
        for stream in self.copy_streams:
            self.ops.wait_value(stream, self.go, self.seq)

    def stream(self, k: int) -> int:
        return self.copy_streams[k % len(self.copy_streams)]

    def copy(self, k: int, dst: int, src: int, nbytes: int) -> None:
        self.ops.copy(dst, src, nbytes, self.stream(k))

    def publish(self, stream: int, peer: int, k: int) -> None:
        flag = self.ctrl[peer] + self.flags_offset + (self.rank * MAX_CHUNKS + k) * 8
        self.ops.write_value(stream, flag, self.seq)

    def peer_queued(self, peer: int, k: int) -> None:
        if self.flag_stream == 0:
            self.publish(self.stream(k), peer, k)
        else:
            self.pending |= 1 << peer

    def chunk_queued(self, k: int) -> None:
        if self.flag_stream == 0 or self.pending == 0:
            return
        self.ops.after_chunk(k, self.stream(k), self.flag_stream)
        for peer in range(self.num_ranks):
            if (self.pending >> peer) & 1:
                self.publish(self.flag_stream, peer, k)
        self.pending = 0

    def chunk_start(self, n: int, k: int) -> int:
        """First row of chunk k of n rows (k = chunks: n)."""
        return chunk_end(self.bounds, self.chunks, n, k - 1)


def enqueue_combine(ops: Ops, p: P.CombineParams, prefix: list[int], copy_streams: list[int], flag_stream: int,
                    flags_offset: int) -> None:
    """The copy-engine half of the combine launched with ``p`` (``enqueue_copy_engine_combine``)."""
    cs = _Streams(ops, p.env, p.copy_engine, copy_streams, flag_stream, flags_offset)
    cs.wait_for_go()
    num_ranks, me = p.env.num_ranks, p.env.rank
    y_bytes = p.hidden * (2 if p.y_type == 1 else 4)
    w_bytes = p.num_topk * 4 if p.has_weights else 0
    for k in range(cs.chunks):  # chunk k of every peer in turn, so that each peer's first rows land early
        for j in range(1, num_ranks):
            src = (me + j) % num_ranks
            count = pair_count(prefix, num_ranks, src, me)
            j0, j1 = cs.chunk_start(count, k), cs.chunk_start(count, k + 1)
            if j1 == j0:
                continue  # an empty chunk: the reducers never wait for it
            my_rows = rows_from_lower(prefix, num_ranks, src, me)
            base = rows_back_from_lower(prefix, num_ranks, src, me)
            data = p.data[src]
            if j0 == 0 and w_bytes > 0:  # the top-k weights go with the pair's first rows
                cs.copy(k, data + p.off_weights + base * w_bytes, p.weights + my_rows * w_bytes, count * w_bytes)
            cs.copy(k, data + p.off_y + (base + j0) * y_bytes, p.y + (my_rows + j0) * y_bytes, (j1 - j0) * y_bytes)
            cs.peer_queued(src, k)
        cs.chunk_queued(k)


def enqueue_dispatch(ops: Ops, p: P.DispatchParams, prefix: list[int], copy_streams: list[int], flag_stream: int,
                     flags_offset: int) -> None:
    """The copy-engine half of the dispatch launched with ``p`` (``enqueue_copy_engine_dispatch``)."""
    cs = _Streams(ops, p.env, p.copy_engine, copy_streams, flag_stream, flags_offset)
    cs.wait_for_go()
    num_ranks, me = p.env.num_ranks, p.env.rank
    scale_bytes = p.num_scales * 4 if p.has_scales else 0
    slot = me * p.copy_engine_slot_rows  # this rank's rows in a peer's buffer
    if p.has_topk:  # a fresh dispatch: the send list to each peer and the whole top-k ahead of chunk 0
        idx_bytes, w_bytes = p.num_topk * 8, p.num_topk * 4
        for j in range(1, num_ranks):
            dst = (me + j) % num_ranks
            data = p.data[dst]
            count = pair_count(prefix, num_ranks, me, dst)
            if count > 0:
                cs.copy(0, data + p.off_src + slot * 4, p.send_list + dst * p.num_tokens * 4, count * 4)
            cs.copy(0, data + p.off_idx + slot * idx_bytes, p.topk_idx, p.num_tokens * idx_bytes)
            cs.copy(0, data + p.off_weights + slot * w_bytes, p.topk_weights, p.num_tokens * w_bytes)
    for k in range(cs.chunks):
        t0, t1 = cs.chunk_start(p.num_tokens, k), cs.chunk_start(p.num_tokens, k + 1)
        if t1 == t0 and not (k == 0 and p.has_topk):  # no waiter, except chunk 0 of a fresh one (the send list)
            continue
        for j in range(1, num_ranks):
            dst = (me + j) % num_ranks
            data = p.data[dst]
            if t1 > t0:
                cs.copy(k, data + p.off_x + (slot + t0) * p.x_bytes, p.x + t0 * p.x_bytes, (t1 - t0) * p.x_bytes)
                if scale_bytes > 0:
                    cs.copy(k, data + p.off_scales + (slot + t0) * scale_bytes, p.scales + t0 * scale_bytes,
                            (t1 - t0) * scale_bytes)
            cs.peer_queued(dst, k)
        cs.chunk_queued(k)


__all__ = ["CudaOps", "Ops", "chunk_end", "cuda_ops", "enqueue_combine", "enqueue_dispatch", "most_rows_back",
           "pair_count", "rows_back_from_lower", "rows_from_lower"]
