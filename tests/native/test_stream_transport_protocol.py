"""The native PP/AGRS transport's protocol on CPU: `ep_moe.elastic.pipeline_comm` and `ep_moe.elastic.agrs` with the native
transport (`ep_moe.native.stream_transport`) run at 1 to 4 ranks as threads of this process, over a stand-in of
the GPU parts:

* the symmetric buffer: one host tensor per rank (filled with garbage first, as GPU memory is), every rank's
  address known to all (`ptrs`, `peer_tensor`);
* the driver: ``cuStreamWriteValue64`` stores the value at the address at once, the batched copy is ``memmove``;
  copies run when queued (a valid schedule of the real streams: on the GPU nothing is queued behind a stream wait
  but the waiter's own header read);
* the guarded wait: polls the words from the host until the deadline, then writes the awaited values, records the
  failure and raises with the real waiter's wording;
* the current stream checks that it only ever waits on events that have completed (the design's rule that a
  missing peer can never block it).

What runs for real: slots, channels and message numbers, flow control, headers and their checks, the AGRS
header exchange (rows by parity), placements, data words, sums, session reuse, reconfiguration and the errors.
The GPU semantics themselves (stream order, fences, the copy engine) are tested in test_stream_transport_gpu.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist
from support.bits import assert_bits_equal

import ep_moe.native.stream_transport as transport
import ep_moe.native.symmetric as symmetric
from ep_moe.elastic.agrs import AGRSCapacityError, AGRSMismatchError, AGRSMixin, AGRSTimeoutError
from ep_moe.elastic.pipeline_comm import PipelineCommMixin, PPConfigError, PPMismatchError, PPTimeoutError
from ep_moe.native.sizing import align_up
from ep_moe.native.stream_ops import SignalWaiter

_local = threading.local()


class _World:
    """What the threads of one run share: a barrier and a table for the collectives."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.barrier = threading.Barrier(num_ranks, timeout=60)
        self.table: list = [None] * num_ranks

    def gather(self, value):
        rank = _local.rank
        self.barrier.wait()
        self.table[rank] = value
        self.barrier.wait()
        values = list(self.table)
        self.barrier.wait()
        return values


_WORLD: _World | None = None


class _Word:
    def __init__(self, view: torch.Tensor, value: int, label: str) -> None:
        assert view.dtype == torch.int64 and view.numel() == 1
        self.view, self.value, self.label = view, value, label

    @property
    def addr(self) -> int:
        return self.view.data_ptr()


def _load(addr: int) -> int:
    return ctypes.c_int64.from_address(addr).value


class _Ops:
    has_batch_copy = True
    batched = 0

    def write(self, stream: int, addr: int, value: int) -> None:
        assert addr % 8 == 0
        ctypes.c_int64.from_address(addr).value = value

    def batch_copy(self, stream: int, copies) -> None:
        assert stream != 0
        type(self).batched += 1
        for dst, src, n in copies:
            ctypes.memmove(dst, src, n)


class _Event:
    done = True


class _Stream:
    cuda_stream = 1  # not the legacy default stream: the batched copy may run

    def wait_event(self, event) -> None:
        assert event.done, "the current stream waits on an event that has not completed"


class _Waiter:
    """The guarded wait with the same contract and wording, polling from the host."""

    check = SignalWaiter.check

    def __init__(self, device, rank: int, num_ranks: int, timeout_s: float) -> None:
        self.rank, self.num_ranks, self.timeout_s = rank, num_ranks, float(timeout_s)
        self.ops, self.stream, self.failure = _Ops(), _Stream(), None

    def wait(self, words, error, op, stage, then=None):
        self.check(error, op)
        deadline = time.monotonic() + self.timeout_s
        while not all(_load(w.addr) >= w.value for w in words):
            if time.monotonic() > deadline:
                missing = [(w, _load(w.addr)) for w in words if _load(w.addr) < w.value]
                for w in words:
                    self.ops.write(0, w.addr, w.value)
                detail = ", ".join(f"{w.label}: word {have} < {w.value}" for w, have in missing)
                message = (f"rank {self.rank} of {self.num_ranks} timed out in stage '{stage}' after waiting "
                           f"{self.timeout_s:g} s for its peer(s) ({detail}); the stream was released")
                self.failure = (error, message)
                raise error(f"ep_moe.ElasticBuffer.{op}: {message}")
            time.sleep(2e-4)
        if then is not None:
            then(self.stream)
        return _Event()

    def destroy(self) -> None:
        pass


class _SymmetricBuffer:
    def __init__(self, group, device, nbytes: int) -> None:
        self.nbytes = align_up(max(int(nbytes), 1))
        self.rank = _local.rank
        self.tensor = torch.full((self.nbytes,), 0xAB, dtype=torch.uint8)  # GPU memory starts undefined
        self._all = _WORLD.gather(self.tensor)
        self.ptrs = [t.data_ptr() for t in self._all]

    def peer_tensor(self, rank: int) -> torch.Tensor:
        return self._all[rank]

    def destroy(self) -> None:
        pass


class _Host(PipelineCommMixin, AGRSMixin):
    """The parts of `ElasticBuffer` the mixins use, with the native backend's name."""

    def __init__(self, rank: int, num_ranks: int, timeout_s: float = 20.0) -> None:
        self.group, self.rank, self.num_ranks, self.num_bytes = None, rank, num_ranks, 64 << 20
        self.buffer = types.SimpleNamespace(device=torch.device("cpu"), backend_name="native")
        self.num_gpu_timeout_secs = timeout_s

    def _check_live(self, op: str) -> None:
        pass


@pytest.fixture
def simulated(monkeypatch):
    stream = _Stream()
    monkeypatch.setattr(transport, "Word", _Word)
    monkeypatch.setattr(transport, "SignalWaiter", _Waiter)
    monkeypatch.setattr(transport, "stream_ops", lambda: _Ops())
    monkeypatch.setattr(symmetric, "SymmetricBuffer", _SymmetricBuffer)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(dist, "barrier", lambda group=None: _WORLD.gather(None) and None)

    def all_gather_object(out, obj, group=None):
        out[:] = _WORLD.gather(obj)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.delenv("EP_MOE_PPAGRS_TRANSPORT", raising=False)
    monkeypatch.delenv("EP_MOE_STREAM_BATCH_COPY", raising=False)
    return monkeypatch


def _threads(fn, num_ranks: int, *args) -> list:
    global _WORLD
    _WORLD = _World(num_ranks)
    results, errors = [None] * num_ranks, [None] * num_ranks

    def run(rank: int) -> None:
        _local.rank = rank
        try:
            results[rank] = fn(rank, num_ranks, *args)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors[rank] = exc
            _WORLD.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None:
        raise first
    return results


def _values(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    n = torch.Size(shape).numel()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(n, 1) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw[: n * dtype.itemsize].view(dtype).reshape(shape).clone()


CASES = [(torch.bfloat16, (16, 33)), (torch.float32, (7,)), (torch.int64, (3, 5)), (torch.float16, ()),
         (torch.uint8, (0,)), (torch.float64, (9, 3)), (torch.bool, (10,)), (torch.int8, (4099,))]


# ------------------------------------------------------------------------------------------ PP
def _ring(rank: int, num_ranks: int, inflight: int) -> int:
    host = _Host(rank, num_ranks)
    host.pp_set_config(8192, inflight)
    assert host._pp.transport == "native"
    prev, nxt = (rank - 1) % num_ranks, (rank + 1) % num_ranks
    checked = 0
    for rnd in range(3):
        for first in range(0, len(CASES), inflight):
            batch = CASES[first: first + inflight]
            for k, (dtype, shape) in enumerate(batch):
                x = _values(dtype, shape, 7919 * rank + 100 * rnd + first + k)
                host.pp_send(x.t() if x.dim() == 2 else x, nxt)  # a non-contiguous sender now and then
                if num_ranks > 2:
                    host.pp_send(_values(dtype, shape, 31 * rank + 100 * rnd + first + k), prev)
                x.zero_()  # may change at once (a transposed view shares it)
            for k, (dtype, shape) in enumerate(batch):
                sent_shape = shape[::-1] if len(shape) == 2 else shape
                got = torch.empty(sent_shape, dtype=dtype)
                host.pp_recv(got, prev)
                want = _values(dtype, shape, 7919 * prev + 100 * rnd + first + k)
                assert_bits_equal(got, want.t() if want.dim() == 2 else want, f"rank {rank} round {rnd} {dtype}")
                checked += 1
                if num_ranks > 2:
                    back = (torch.empty(shape[::-1], dtype=dtype).t() if len(shape) == 2  # a non-contiguous receiver
                            else torch.empty(shape, dtype=dtype))
                    host.pp_recv(back, nxt)
                    assert_bits_equal(back, _values(dtype, shape, 31 * nxt + 100 * rnd + first + k),
                                      f"rank {rank} round {rnd} {dtype} from the next rank")
                    checked += 1
        if rnd == 1:  # a new configuration in the middle: message numbers carry on
            host.pp_set_config(4096 * (rnd + 2), inflight)
    return checked


@pytest.mark.parametrize("num_ranks,inflight", [(1, 1), (1, 3), (2, 1), (2, 3), (3, 2), (4, 3)])
def test_pp_ring_over_the_native_transport(simulated, num_ranks, inflight):
    per_round = len(CASES) * (2 if num_ranks > 2 else 1)
    assert _threads(_ring, num_ranks, inflight) == [3 * per_round] * num_ranks


def test_pp_unbatched_copies(simulated):
    simulated.setenv("EP_MOE_STREAM_BATCH_COPY", "0")
    _Ops.batched = 0
    assert _threads(_ring, 2, 2) == [3 * len(CASES)] * 2
    assert _Ops.batched == 0
    simulated.delenv("EP_MOE_STREAM_BATCH_COPY")
    _threads(_ring, 2, 2)
    assert _Ops.batched > 0


def _flow_control(rank: int, num_ranks: int) -> float:
    host = _Host(rank, num_ranks)
    host.pp_set_config(64, 1)
    if rank == 0:
        start = time.monotonic()
        for k in range(3):
            host.pp_send(torch.full((4,), float(k)), 1)
        return time.monotonic() - start
    for k in range(3):
        time.sleep(0.3)
        got = torch.empty(4)
        host.pp_recv(got, 0)
        assert torch.equal(got, torch.full((4,), float(k)))
    return 0.0


def test_a_full_channel_waits_for_the_receiver(simulated):
    send_time, _ = _threads(_flow_control, 2)
    assert send_time >= 0.55, send_time  # sends 2 and 3 each waited for a receive (one slot)


def _misuse(rank: int, num_ranks: int) -> list[str]:
    host = _Host(rank, num_ranks)
    caught = []
    try:
        host.pp_set_config(64 * (rank + 1), 2)  # different on each rank
    except PPConfigError as exc:
        caught.append(str(exc))
    host.pp_set_config(256, 2)
    nxt, prev = (rank + 1) % num_ranks, (rank - 1) % num_ranks
    host.pp_send(torch.ones(8), nxt)
    host.pp_send(torch.ones(8) * 2, nxt)
    try:
        host.pp_recv(torch.empty(4, 2, dtype=torch.float64), prev)
    except PPMismatchError as exc:
        caught.append(str(exc))
    got = torch.empty(8)
    host.pp_recv(got, prev)  # the mismatched message was dropped, order kept
    assert torch.equal(got, torch.ones(8) * 2)
    return caught


def test_pp_misuse_names_both_sides(simulated):
    for rank, (config, mismatch) in enumerate(_threads(_misuse, 2)):
        assert "the ranks configure different PP slots (rank 0: 64-byte slots x 2, rank 1: 128-byte slots x 2)" \
            in config, config
        assert (f"disagree on message #0 from rank {1 - rank} to rank {rank}: tensor: rank {1 - rank} sent "
                "torch.float32(8,), rank " f"{rank} receives into torch.float64(4, 2)") in mismatch, mismatch


def _never_sent(rank: int, num_ranks: int) -> str | None:
    host = _Host(rank, num_ranks, timeout_s=0.5)
    host.pp_set_config(64, 2)
    host.agrs_set_config(256, 2)
    message = None
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(PPTimeoutError) as info:
            host.pp_recv(torch.empty(4), 1)
        assert 0.5 <= time.monotonic() - start < 5
        message = str(info.value)
        with pytest.raises(PPTimeoutError, match="stopped after an earlier timeout"):
            host.pp_send(torch.ones(4), 1)
        with pytest.raises(AGRSTimeoutError, match="stopped after an earlier timeout"):
            host.create_agrs_session()
    _WORLD.gather(None)
    return message


def test_a_recv_with_no_send_times_out_naming_rank_and_stage(simulated):
    message = _threads(_never_sent, 2)[0]
    assert message.startswith("ep_moe.ElasticBuffer.pp_recv: rank 0 of 2 timed out in stage 'pp_recv header of "
                              "message #0 from rank 1' after waiting 0.5 s"), message
    assert "rank 1's message #0: word 0 < 1" in message, message


# ------------------------------------------------------------------------------------------ AGRS
def _rank_order_sum(parts: list[torch.Tensor], row: int) -> torch.Tensor:
    acc_dtype = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    acc = parts[0][row].to(acc_dtype).clone()
    for p in parts[1:]:
        acc = acc + p[row].to(acc_dtype)
    return acc.to(parts[0].dtype)


def _scaled(dtype, shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 4, shape, generator=gen)).to(dtype)


def _sessions(rank: int, num_ranks: int) -> int:
    host = _Host(rank, num_ranks)
    host.agrs_set_config(64 * 1024 + 8 * rank, 6)  # the memory takes the largest of the ranks' values
    assert host._agrs.transport == "native"
    checked = 0
    for session in range(3):
        host.create_agrs_session()
        inplace = host.agrs_get_inplace_tensor((8, 33), torch.bfloat16)
        inplace.copy_(_values(torch.bfloat16, (8, 33), 100 * rank + session))
        plain = _values(torch.float32, (7,), 200 * rank + session)
        odd = _values(torch.int64, (5, 3), 300 * rank + session).t()
        empty = torch.empty(0, 4)
        (g_in, g_plain, g_odd, g_empty), handle = host.all_gather([inplace, plain, odd, empty])
        handle()
        assert g_in[rank].data_ptr() == inplace.data_ptr() and g_empty.shape == (num_ranks, 0, 4)
        for i in range(num_ranks):
            assert_bits_equal(g_in[i], _values(torch.bfloat16, (8, 33), 100 * i + session), f"in-place slot {i}")
            assert_bits_equal(g_plain[i], _values(torch.float32, (7,), 200 * i + session), f"gathered slot {i}")
            assert torch.equal(g_odd[i], _values(torch.int64, (5, 3), 300 * i + session).t())
            checked += 3
        single, handle = host.all_gather(torch.full((3,), float(rank)))
        handle()
        assert torch.equal(single, torch.arange(num_ranks, dtype=torch.float32)[:, None].expand(num_ranks, 3))
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            shard, handle = host.reduce_scatter(_scaled(dtype, (num_ranks, 5, 7), 400 * rank + session))
            handle()
            parts = [_scaled(dtype, (num_ranks, 5, 7), 400 * i + session) for i in range(num_ranks)]
            assert_bits_equal(shard, _rank_order_sum(parts, rank), f"reduce_scatter {dtype} session {session}")
            checked += 1
        host.destroy_agrs_session()
        if session == 0:  # a new configuration (new memory, exchange counter from 0); session numbers carry on
            host.agrs_set_config(96 * 1024, 6)
    assert host._agrs.session == 3
    return checked


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_agrs_sessions_over_the_native_transport(simulated, num_ranks):
    assert _threads(_sessions, num_ranks) == [3 * (3 * num_ranks + 4)] * num_ranks


def _agrs_misuse(rank: int, num_ranks: int) -> list[str]:
    host = _Host(rank, num_ranks)
    host.agrs_set_config(1024, 3)
    caught = []
    host.create_agrs_session()
    for call in (lambda: host.all_gather([torch.ones(4 + rank)]),                # different shapes
                 lambda: host.all_gather([torch.ones(257 if rank == 1 else 4)])):  # rank 1 has no room
        try:
            call()
        except (AGRSMismatchError, AGRSCapacityError) as exc:
            caught.append(f"{type(exc).__name__}: {exc}")
    host.destroy_agrs_session()
    host.create_agrs_session()  # usable again after the errors (nothing moved)
    (g,), h = host.all_gather([torch.full((2,), float(rank))])
    h()
    assert torch.equal(g, torch.arange(num_ranks, dtype=torch.float32)[:, None].expand(num_ranks, 2))
    host.destroy_agrs_session()
    return caught


def _placement(rank: int, num_ranks: int) -> str:
    host = _Host(rank, num_ranks)
    host.agrs_set_config(1024, 3)
    host.create_agrs_session()
    first = host.agrs_get_inplace_tensor((4,) if rank == 0 else (8,), torch.float32)
    second = host.agrs_get_inplace_tensor((8,) if rank == 0 else (4,), torch.float32)
    small, large = (first, second) if rank == 0 else (second, first)
    try:
        host.all_gather([small, large])  # same tensors, placed at different chunks on the two ranks
    except AGRSMismatchError as exc:
        return str(exc)
    return "no error"


def test_agrs_misuse_raises_on_every_rank(simulated):
    results = _threads(_agrs_misuse, 2)
    assert len(results[0]) == len(results[1]) == 2, results
    assert results[0][0] == results[1][0]  # the capacity message differs only in its "this rank" part
    assert all(r[1].split(" (this rank")[0] == results[0][1].split(" (this rank")[0] for r in results), results
    assert results[0][0].startswith("AGRSMismatchError: ep_moe.ElasticBuffer.all_gather (session 1, operation #1): "
                                    "the ranks pass different tensors"), results[0][0]
    assert "the session is full on rank 1: bytes" in results[0][1], results[0][1]
    placements = _threads(_placement, 2)
    assert placements[0] == placements[1] and "place the tensors at different chunks" in placements[0], placements


def _agrs_never_joins(rank: int, num_ranks: int) -> str | None:
    host = _Host(rank, num_ranks, timeout_s=0.5)
    host.agrs_set_config(256, 2)
    message = None
    if rank == 0:
        host.create_agrs_session()
        with pytest.raises(AGRSTimeoutError) as info:
            host.all_gather([torch.ones(4)])
        message = str(info.value)
    _WORLD.gather(None)
    return message


def test_a_peer_that_never_joins_times_out_naming_rank_and_stage(simulated):
    message = _threads(_agrs_never_joins, 2)[0]
    assert ("rank 0 of 2 timed out in stage 'all_gather #1 of session 1: header exchange' after waiting 0.5 s for "
            "its peer(s) (rank 1's header: word 0 < 1)") in message, message


# ------------------------------------------------------------------------------------------ the guarded wait
class _QueueStream:
    """A stream whose queued waits hold back what is recorded after them (`_QueueEvent`)."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream, self.waits, self.synchronized = handle, [], 0

    def synchronize(self) -> None:
        assert self.query(), "synchronizing a blocked stream would hang"
        self.synchronized += 1

    def query(self) -> bool:
        return all(_load(addr) >= value for addr, value in self.waits)


class _QueueEvent:
    def __init__(self) -> None:
        self.waits = []

    def record(self, stream) -> None:
        self.waits = list(stream.waits)

    def query(self) -> bool:
        return all(_load(addr) >= value for addr, value in self.waits)


class _QueueOps(_Ops):
    def __init__(self) -> None:
        self.streams = []

    def create_stream(self, device, highest_priority: bool) -> _QueueStream:
        self.streams.append(_QueueStream(100 + len(self.streams)))
        self.streams[-1].highest_priority = highest_priority
        return self.streams[-1]

    def wait(self, stream: int, addr: int, value: int) -> None:
        next(s for s in self.streams if s.cuda_stream == stream).waits.append((addr, value))


@pytest.fixture
def queued(monkeypatch):
    import ep_moe.native.stream_ops as stream_ops

    ops = _QueueOps()
    monkeypatch.setattr(stream_ops, "stream_ops", lambda: ops)
    monkeypatch.setattr(stream_ops, "_pool", stream_ops.StreamPool())  # a pool over these streams only
    monkeypatch.setattr(torch.cuda, "Event", _QueueEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return ops


def test_guarded_wait_returns_when_the_words_arrive(queued):
    waiter = SignalWaiter(torch.device("cpu"), 1, 2, timeout_s=10.0)
    assert [s.highest_priority for s in queued.streams] == [False, True]  # the waiter's and the rescue stream
    words = torch.zeros(2, dtype=torch.int64)
    seen = []

    def late_writes():
        time.sleep(0.2)
        words[1] = 4
        words[0] = 9

    writer = threading.Thread(target=late_writes)
    writer.start()
    start = time.monotonic()
    waiter.wait([_Word(words[0:1], 9, "rank 0's rows"), _Word(words[1:2], 3, "rank 0's header")], TimeoutError,
                "all_gather", "stage", then=lambda stream: seen.append(stream))
    writer.join()
    assert 0.15 < time.monotonic() - start < 5 and seen == [waiter.stream]
    waiter.check(TimeoutError, "all_gather")  # no failure recorded
    waiter.destroy()
    assert all(s.synchronized == 1 for s in queued.streams)  # drained, then back in the pool (never destroyed)
    waiter.destroy()  # again: nothing happens
    second = SignalWaiter(torch.device("cpu"), 1, 2, timeout_s=10.0)  # reuses both streams
    assert len(queued.streams) == 2 and {second.stream, second._rescue} == set(queued.streams)
    assert second.stream.highest_priority is False and second._rescue.highest_priority is True
    second.destroy()
    with pytest.raises(RuntimeError, match="all_gather: rank 1: the PP/AGRS stream waiter was destroyed"):
        second.wait([], TimeoutError, "all_gather", "stage")


def test_guarded_wait_times_out_rescues_and_refuses_further_work(queued):
    waiter = SignalWaiter(torch.device("cpu"), 0, 3, timeout_s=0.3)
    words = torch.tensor([5, 1], dtype=torch.int64)
    start = time.monotonic()
    with pytest.raises(PPTimeoutError) as info:
        waiter.wait([_Word(words[0:1], 5, "rank 1's rows"), _Word(words[1:2], 2, "rank 2's rows")], PPTimeoutError,
                    "pp_recv", "pp_recv header of message #4 from rank 2")
    assert 0.3 <= time.monotonic() - start < 5
    assert str(info.value) == ("ep_moe.ElasticBuffer.pp_recv: rank 0 of 3 timed out in stage 'pp_recv header of "
                               "message #4 from rank 2' after waiting 0.3 s for its peer(s) (rank 2's rows: word 1 "
                               "< 2); the stream was released")
    assert words.tolist() == [5, 2]  # the rescue wrote the awaited value: the stream's wait is satisfied
    with pytest.raises(AGRSTimeoutError, match=r"rank 0: the PP/AGRS stream transport stopped after an earlier "
                                               r"timeout \(rank 0 of 3 timed out in stage 'pp_recv header"):
        waiter.check(AGRSTimeoutError, "all_gather")
    with pytest.raises(PPTimeoutError, match="stopped after an earlier timeout"):
        waiter.wait([], PPTimeoutError, "pp_send", "another stage")


def test_a_stream_left_blocked_is_kept_out_of_the_pool(queued, monkeypatch):
    import ep_moe.native.stream_ops as stream_ops

    monkeypatch.setattr(stream_ops, "RESCUE_GRACE_S", 0.2)
    monkeypatch.setattr(queued, "write", lambda stream, addr, value: None)  # the rescue's write never lands
    waiter = SignalWaiter(torch.device("cpu"), 0, 2, timeout_s=0.2)
    blocked, rescue = waiter.stream, waiter._rescue
    words = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(PPTimeoutError, match="the stream could not be released"):
        waiter.wait([_Word(words, 1, "rank 1's message #0")], PPTimeoutError, "pp_recv", "stage")
    waiter.destroy()  # does not synchronize the blocked stream (that would hang: `_QueueStream` asserts)
    pool = stream_ops.stream_pool()
    assert pool.abandoned == [blocked] and blocked.synchronized == 0 and rescue.synchronized == 1
    assert pool.free_count(torch.device("cpu"), False) == 0 and pool.free_count(torch.device("cpu"), True) == 1
    second = SignalWaiter(torch.device("cpu"), 0, 2, timeout_s=0.2)
    assert second.stream not in (blocked, rescue) and second._rescue is rescue  # a fresh stream for the waits
    words[0] = 1  # the late peer: the blocked stream drains; it stays out of the pool all the same
    second.destroy()
    assert pool.free_count(torch.device("cpu"), False) == 1 and pool.abandoned == [blocked]


def test_the_pool_refuses_foreign_and_double_releases(queued):
    import ep_moe.native.stream_ops as stream_ops

    pool = stream_ops.stream_pool()
    stream = pool.acquire(torch.device("cpu"), False)
    pool.release(stream)
    with pytest.raises(ValueError, match="was released twice"):
        pool.release(stream)
    with pytest.raises(ValueError, match="is not from this pool"):
        pool.release(_QueueStream(7))
    assert pool.acquire(torch.device("cpu"), False) is stream and pool.acquire(torch.device("cpu"), True) is not stream
