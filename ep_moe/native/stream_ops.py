"""Stream memory operations and guarded waits: the signalling half of the copy-engine PP/AGRS transport
(`ep_moe.native.stream_transport`), with no kernel on the SMs.

* `StreamOps`: the CUDA driver's ``cuStreamWriteValue64`` / ``cuStreamWaitValue64`` (the CUDA 12 ABI, ``_v2``)
  and, where the driver has it (CUDA 13's ``cuMemcpyBatchAsync_v2``), one batched copy call, through ``ctypes``
  on ``libcuda`` (`ep_moe.elastic.memory.cuda_vmm.driver`). Every return code is checked (`StreamOpError` names the call
  and the driver's error name).
* `StreamPool`: the private streams of the waiters, created on demand and kept for the process's lifetime (torch
  may use a stream it has seen long after its user is done with it; see the class).
* `SignalWaiter`: a wait for 64-bit signal words (``word >= value``) that cannot hang. The words are awaited on a
  stream of the waiter's own (``cuStreamWaitValue64``, then optionally a small device-to-host copy), an event is
  recorded behind them, and the calling thread polls the event until a deadline. Past the deadline the waiter
  reads the words (to say which are missing), writes the awaited values itself from a second stream of the
  highest priority (priorities are per hardware channel, so that write cannot queue behind the blocked wait),
  waits for the blocked stream to drain, and raises the caller's ``TimeoutError`` naming rank and stage. The
  waiter is then failed: every later call raises the same error (as the native kernels' error record does).

The host thus waits only for the awaited words (and what the waiter's own stream queues after them), never for
the work queued before on the caller's stream.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence

import torch

# cuda.h
CU_STREAM_WAIT_VALUE_GEQ = 0x0          # (int64_t)(*addr - value) >= 0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0     # a memory fence before the write: earlier copies on the stream land first
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1
CU_STREAM_NON_BLOCKING = 0x1
BATCH_COPY_MIN_DRIVER = 13000           # cuMemcpyBatchAsync_v2 (no failIdx argument) is CUDA 13's

RESCUE_GRACE_S = 10.0
"""How long a timed-out wait gives its rescue write to unblock the waiter's stream before reporting that it could
not."""


class StreamOpError(RuntimeError):
    """A CUDA driver call of the stream transport failed (the call and the driver's error name are in the message)."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (cuda.h, CUDA 12.8+): 24 bytes."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


class StreamOps:
    """The driver entry points of the transport (load with `stream_ops`)."""

    def __init__(self) -> None:
        from ..elastic.memory.cuda_vmm import CudaDriverError, driver

        try:
            lib = driver()
        except CudaDriverError as exc:
            raise StreamOpError(str(exc)) from exc
        u64, vp, uint = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint
        self._lib = lib
        self._write = self._entry(("cuStreamWriteValue64_v2", "cuStreamWriteValue64"), [vp, u64, u64, uint])
        self._wait = self._entry(("cuStreamWaitValue64_v2", "cuStreamWaitValue64"), [vp, u64, u64, uint])
        pint = ctypes.POINTER(ctypes.c_int)
        self._create = self._entry(("cuStreamCreateWithPriority",), [ctypes.POINTER(vp), uint, ctypes.c_int])
        self._priorities = self._entry(("cuCtxGetStreamPriorityRange",), [pint, pint])
        version = ctypes.c_int()
        get_version = self._entry(("cuDriverGetVersion",), [ctypes.POINTER(ctypes.c_int)])
        self._check(get_version(ctypes.byref(version)), "cuDriverGetVersion")
        self.driver_version = version.value
        self._batch = None
        if self.driver_version >= BATCH_COPY_MIN_DRIVER and hasattr(lib, "cuMemcpyBatchAsync_v2"):
            sz = ctypes.POINTER(ctypes.c_size_t)
            self._batch = self._entry(("cuMemcpyBatchAsync_v2",),
                                      [ctypes.POINTER(u64), ctypes.POINTER(u64), sz, ctypes.c_size_t,
                                       ctypes.POINTER(MemcpyAttributes), sz, ctypes.c_size_t, vp])

    def _entry(self, names: Sequence[str], argtypes: list):
        for name in names:
            fn = getattr(self._lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                return fn
        raise StreamOpError(f"ep_moe.native.stream_ops: the CUDA driver has none of {', '.join(names)}")

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(result, ctypes.byref(name))
            raise StreamOpError(f"ep_moe.native.stream_ops: {call} failed: {(name.value or b'?').decode()} "
                                f"({result})")

    def write(self, stream: int, addr: int, value: int) -> None:
        """Queue on ``stream`` the write of the 64-bit ``value`` to device address ``addr`` (this GPU's memory or a
        peer's mapped into it), after a fence: the copies queued before it on ``stream`` land first."""
        self._check(self._write(ctypes.c_void_p(stream), addr, value, CU_STREAM_WRITE_VALUE_DEFAULT),
                    f"cuStreamWriteValue64(addr=0x{addr:x}, value={value})")

    def wait(self, stream: int, addr: int, value: int) -> None:
        """Queue on ``stream`` a wait until the 64-bit word at ``addr`` is >= ``value`` (no deadline of its own:
        `SignalWaiter` guards it)."""
        self._check(self._wait(ctypes.c_void_p(stream), addr, value, CU_STREAM_WAIT_VALUE_GEQ),
                    f"cuStreamWaitValue64(addr=0x{addr:x}, value={value})")

    def create_stream(self, device: torch.device, highest_priority: bool) -> torch.cuda.ExternalStream:
        """A new non-blocking stream of ``device`` that no other code uses (torch's own streams come from a shared
        pool), of the default or the highest priority. There is deliberately no way to destroy it: take streams
        from `StreamPool` (`stream_pool`), which keeps them for the process's lifetime."""
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # the device's primary context is current in this thread
            priority = 0
            if highest_priority:
                least, greatest = ctypes.c_int(), ctypes.c_int()
                self._check(self._priorities(ctypes.byref(least), ctypes.byref(greatest)),
                            "cuCtxGetStreamPriorityRange")
                priority = greatest.value
            handle = ctypes.c_void_p()
            self._check(self._create(ctypes.byref(handle), CU_STREAM_NON_BLOCKING, priority),
                        "cuStreamCreateWithPriority")
        return torch.cuda.ExternalStream(handle.value, device=device)

    @property
    def has_batch_copy(self) -> bool:
        return self._batch is not None

    def batch_copy(self, stream: int, copies: Sequence[tuple[int, int, int]]) -> None:
        """One ``cuMemcpyBatchAsync`` of ``copies`` ((dst address, src address, bytes)) on ``stream`` (not the
        legacy default stream, 0), sources read in stream order, the copy engine preferred. Requires
        `has_batch_copy`."""
        if self._batch is None:
            raise StreamOpError("ep_moe.native.stream_ops: this driver has no cuMemcpyBatchAsync_v2 (CUDA 13)")
        if stream == 0:
            raise StreamOpError("ep_moe.native.stream_ops: cuMemcpyBatchAsync cannot run on the legacy default stream")
        count = len(copies)
        if not count:
            return
        dsts = (ctypes.c_uint64 * count)(*(c[0] for c in copies))
        srcs = (ctypes.c_uint64 * count)(*(c[1] for c in copies))
        sizes = (ctypes.c_size_t * count)(*(c[2] for c in copies))
        attrs = MemcpyAttributes()
        attrs.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attrs.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        first = (ctypes.c_size_t * 1)(0)
        self._check(self._batch(dsts, srcs, sizes, count, ctypes.byref(attrs), first, 1, ctypes.c_void_p(stream)),
                    f"cuMemcpyBatchAsync({count} copies)")


_ops: StreamOps | None = None


def stream_ops() -> StreamOps:
    """The process's `StreamOps` (loaded on first use). Raises `StreamOpError` without a CUDA driver."""
    global _ops
    if _ops is None:
        _ops = StreamOps()
    return _ops


class StreamPool:
    """The private streams of `SignalWaiter`: per (device, priority), created by `StreamOps.create_stream` when none
    is free, handed back by `release` and reused, never destroyed.

    Why never destroyed: torch keeps using a stream it has seen after its user is done with it. A pinned host tensor
    that took part in a ``non_blocking`` copy on the stream (a waiter's header read, the rescue's word read) has the
    stream noted in torch's CachingHostAllocator, which records an event on it when the tensor is freed, however
    late that is; after ``cuStreamDestroy`` that record fails inside a C++ destructor and the process aborts. A
    stream whose work stays blocked (a timed-out wait that the rescue could not release) is not reused either.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple, list] = {}
        self._key: dict[int, tuple] = {}    # cuda_stream handle -> its pool key, for every stream made here
        self.abandoned: list = []           # streams left blocked: out of the pool, still alive

    @staticmethod
    def _pool_key(device: torch.device, highest_priority: bool) -> tuple:
        index = device.index
        if index is None and device.type == "cuda":
            index = torch.cuda.current_device()
        return (device.type, index, bool(highest_priority))

    def acquire(self, device: torch.device, highest_priority: bool) -> torch.cuda.ExternalStream:
        """A stream of ``device`` (of the highest priority or the default one) that no one else holds."""
        key = self._pool_key(device, highest_priority)
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        stream = stream_ops().create_stream(device, highest_priority)
        with self._lock:
            self._key[stream.cuda_stream] = key
        return stream

    def release(self, stream: torch.cuda.ExternalStream) -> None:
        """Hand back ``stream`` (of `acquire`) once its work is done; the caller must not use it afterwards. Raises
        ValueError for a stream this pool did not make or one handed back twice."""
        with self._lock:
            key = self._key.get(stream.cuda_stream)
            if key is None:
                raise ValueError(f"ep_moe.native.stream_ops: stream 0x{stream.cuda_stream:x} is not from this pool")
            free = self._free.setdefault(key, [])
            if any(s.cuda_stream == stream.cuda_stream for s in free):
                raise ValueError(f"ep_moe.native.stream_ops: stream 0x{stream.cuda_stream:x} was released twice")
            free.append(stream)

    def abandon(self, stream: torch.cuda.ExternalStream) -> None:
        """Keep ``stream`` (blocked for good) out of the pool; it is still not destroyed."""
        with self._lock:
            self.abandoned.append(stream)

    def free_count(self, device: torch.device, highest_priority: bool) -> int:
        """How many streams of that kind wait in the pool."""
        with self._lock:
            return len(self._free.get(self._pool_key(device, highest_priority), []))


_pool: StreamPool | None = None
_pool_lock = threading.Lock()


def stream_pool() -> StreamPool:
    """The process's `StreamPool`."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = StreamPool()
        return _pool


class Word:
    """A signal word to wait for: ``view`` (a one-element int64 tensor in this GPU's memory, e.g. of this rank's copy
    of a symmetric buffer) must reach ``value``; ``label`` names it in a timeout's message (``"rank 1's data"``)."""

    __slots__ = ("view", "value", "label")

    def __init__(self, view: torch.Tensor, value: int, label: str) -> None:
        if view.dtype != torch.int64 or view.numel() != 1 or view.device.type != "cuda":
            raise ValueError(f"ep_moe.native.stream_ops: a signal word is one int64 on a GPU, got {view.dtype}"
                             f"{tuple(view.shape)} on {view.device}")
        self.view, self.value, self.label = view, value, label

    @property
    def addr(self) -> int:
        return self.view.data_ptr()


def poll_until(done: Callable[[], bool], deadline: float) -> bool:
    """Poll ``done`` until it returns True (True) or ``time.monotonic()`` passes ``deadline`` (False): a short spin,
    then sleeps growing to 1 ms."""
    spin_until = time.monotonic() + 2e-3
    pause = 2e-5
    while not done():
        now = time.monotonic()
        if now >= deadline:
            return done()
        if now >= spin_until:
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, 1e-3)
    return True


class SignalWaiter:
    """Guarded waits for signal words on one device (see the module's docstring).

    ``rank``, ``num_ranks`` and ``timeout_s`` (the deadline of every wait) go into the messages, which start with
    ``ep_moe.ElasticBuffer.<op>``. CUDA only.
    """

    def __init__(self, device: torch.device, rank: int, num_ranks: int, timeout_s: float) -> None:
        self.device, self.rank, self.num_ranks, self.timeout_s = device, rank, num_ranks, float(timeout_s)
        self.ops = stream_ops()
        self._pool = stream_pool()
        self.stream = self._pool.acquire(device, highest_priority=False)
        self._rescue = self._pool.acquire(device, highest_priority=True)
        self._word_host = torch.empty(1, dtype=torch.int64, device="cpu", pin_memory=torch.cuda.is_available())
        self.failure: tuple[type[Exception], str] | None = None
        self._stuck = False  # a timed-out wait whose stream could not be released

    def check(self, error: type[Exception], op: str) -> None:
        """Raise ``error`` when an earlier wait of this waiter timed out (the transport refuses further work)."""
        if self.failure is not None:
            _, message = self.failure
            raise error(f"ep_moe.ElasticBuffer.{op}: rank {self.rank}: the PP/AGRS stream transport stopped after an "
                        f"earlier timeout ({message})")

    def wait(self, words: Sequence[Word], error: type[Exception], op: str, stage: str,
             then: Callable[[torch.cuda.Stream], None] | None = None) -> torch.cuda.Event:
        """Wait until every word of ``words`` reached its value, then run ``then(stream)`` (which may queue e.g. a
        device-to-host copy on the waiter's stream) and wait for that too. Returns the completed event (a stream
        that waits on it sees the words' writers' data). Raises ``error`` naming the rank and ``stage`` after
        ``timeout_s``, with the words still missing."""
        self.check(error, op)
        if self.stream is None:
            raise RuntimeError(f"ep_moe.ElasticBuffer.{op}: rank {self.rank}: the PP/AGRS stream waiter was destroyed")
        event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            handle = self.stream.cuda_stream
            for word in words:
                self.ops.wait(handle, word.addr, word.value)
            if then is not None:
                then(self.stream)
            event.record(self.stream)
        if poll_until(event.query, time.monotonic() + self.timeout_s):
            return event
        missing = self._rescue_words(words)
        released = poll_until(event.query, time.monotonic() + RESCUE_GRACE_S)
        detail = ", ".join(f"{w.label}: word {have} < {w.value}" for w, have in missing) or "the words arrived late"
        message = (f"rank {self.rank} of {self.num_ranks} timed out in stage '{stage}' after waiting {self.timeout_s:g}"
                   f" s for its peer(s) ({detail}); "
                   + ("the stream was released" if released else
                      "the stream could not be released (a CUDA stream of this process stays blocked)"))
        self.failure, self._stuck = (error, message), not released
        raise error(f"ep_moe.ElasticBuffer.{op}: {message}")

    def destroy(self) -> None:
        """Hand the waiter's streams back to the pool after their work (a stream that stayed blocked after a timeout
        is kept out of it). The waiter cannot wait afterwards; calling this again does nothing."""
        for stream in (self.stream, self._rescue):
            if stream is None:
                continue
            if self._stuck and not stream.query():
                self._pool.abandon(stream)  # synchronizing it would hang
                continue
            stream.synchronize()
            self._pool.release(stream)
        self.stream = self._rescue = None

    def _rescue_words(self, words: Sequence[Word]) -> list[tuple[Word, int]]:
        """Read each word, then write its awaited value, from the rescue stream; the words that were short."""
        missing = []
        with torch.cuda.stream(self._rescue):
            for word in words:
                have = self._read(word.view)
                if have is None or have < word.value:
                    missing.append((word, have))
                self.ops.write(self._rescue.cuda_stream, word.addr, word.value)
        return missing

    def _read(self, view: torch.Tensor) -> int | None:
        """The word ``view`` read through the rescue stream (None when the read does not finish in 1 s)."""
        done = torch.cuda.Event()
        self._word_host.copy_(view.reshape(1), non_blocking=True)
        done.record(self._rescue)
        if not poll_until(done.query, time.monotonic() + 1.0):
            return None
        return int(self._word_host[0])



__all__ = ["MemcpyAttributes", "SignalWaiter", "StreamOpError", "StreamOps", "StreamPool", "Word", "poll_until",
           "stream_ops", "stream_pool"]
