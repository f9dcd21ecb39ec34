"""Which stream `Buffer`'s calls run on (CPU, with fake streams).

A synchronous call runs on the current stream, after the communication stream's pending work (an asynchronous
call's, or anything queued there once `get_comm_stream` handed it out), so calls of one buffer never overlap:
they share the symmetric buffer. An asynchronous call runs on the communication stream after the current one (or
``previous_event``), marks its tensors in use by both streams and returns an event. A call may raise after it
queued kernels (the native backend raises a rank disagreement after its launches); the current stream still
follows them, as after a call that returned, so that a `barrier()` queued next cannot run beside them."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from ep_moe.buffer.buffer_v1 import Buffer
from ep_moe.buffer.event_overlap import EventOverlap


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event: _Event) -> None:
        self.log.append(f"{self.name} waits for event {event.name}")


class _Event:
    def __init__(self, name: str = "", log: list | None = None) -> None:
        self.name, self.log = name, log

    def record(self, stream: _Stream) -> None:
        self.name = f"on {stream.name}"
        stream.log.append(f"event recorded on {stream.name}")


@pytest.fixture
def streams(monkeypatch):
    log: list[str] = []
    compute, comm = _Stream("compute", log), _Stream("comm", log)
    current = [compute]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    buffer = SimpleNamespace(_comm_stream=comm, device=torch.device("cuda", 0), _comm_pending=False,
                             _comm_shared=False, _compute_pending=False)
    return buffer, log, current


def _queue_then(log: list, current: list, error: Exception | None = None):
    def call():
        log.append(f"kernels queued on {current[-1].name}")
        if error is not None:
            raise error
        return "out"
    return call


def test_a_synchronous_call_runs_on_the_current_stream(streams) -> None:
    buffer, log, current = streams
    out, event = Buffer._run(buffer, _queue_then(log, current), [], None, False)
    assert out == "out" and event.event is None
    assert log == ["kernels queued on compute"]


def test_a_synchronous_call_waits_for_previous_event(streams) -> None:
    buffer, log, current = streams
    Buffer._run(buffer, _queue_then(log, current), [], EventOverlap(_Event("before")), False)
    assert log == ["compute waits for event before", "kernels queued on compute"]


def test_an_asynchronous_call_runs_on_the_communication_stream_and_later_calls_follow_it(streams) -> None:
    buffer, log, current = streams
    out, event = Buffer._run(buffer, _queue_then(log, current), [], None, True)
    assert out == "out" and event.event.name == "on comm"
    Buffer._run(buffer, _queue_then(log, current), [], None, False)
    Buffer._run(buffer, _queue_then(log, current), [], None, False)  # the pending work was waited for once
    assert log == ["comm waits for compute", "kernels queued on comm", "event recorded on comm",
                   "compute waits for comm", "kernels queued on compute", "kernels queued on compute"]
    assert current == [current[0]]


def test_an_asynchronous_call_after_previous_event_waits_for_it_not_for_the_current_stream(streams) -> None:
    buffer, log, current = streams
    Buffer._run(buffer, _queue_then(log, current), [], EventOverlap(_Event("before")), True)
    assert log[:2] == ["comm waits for event before", "kernels queued on comm"]


def test_an_asynchronous_call_after_previous_event_also_follows_an_earlier_synchronous_call(streams) -> None:
    """``previous_event`` may have been recorded before a synchronous call of the buffer that now runs on the
    current stream: the asynchronous call waits for that stream too, once."""
    buffer, log, current = streams
    before = EventOverlap(_Event("before"))
    Buffer._run(buffer, _queue_then(log, current), [], None, False)
    Buffer._run(buffer, _queue_then(log, current), [], before, True)
    Buffer._run(buffer, _queue_then(log, current), [], before, True)  # nothing synchronous in between
    assert log == ["kernels queued on compute",
                   "comm waits for event before", "comm waits for compute", "kernels queued on comm",
                   "event recorded on comm",
                   "comm waits for event before", "kernels queued on comm", "event recorded on comm"]


def test_work_on_the_handed_out_communication_stream_is_waited_for(streams) -> None:
    buffer, log, current = streams
    Buffer.get_comm_stream(buffer)
    Buffer._run(buffer, _queue_then(log, current), [], None, False)
    Buffer._run(buffer, _queue_then(log, current), [], None, False)
    assert log == ["compute waits for comm", "kernels queued on compute"] * 2


@pytest.mark.parametrize("async_finish", [False, True])
def test_a_call_that_raises_after_queuing_kernels_leaves_the_current_stream_behind_them(streams, async_finish
                                                                                        ) -> None:
    buffer, log, current = streams
    with pytest.raises(ValueError, match="ranks disagree"):
        Buffer._run(buffer, _queue_then(log, current, ValueError("ranks disagree")), [], None, async_finish)
    if async_finish:
        assert log == ["comm waits for compute", "kernels queued on comm", "compute waits for comm"]
    else:
        assert log == ["kernels queued on compute"]
    assert current[-1].name == "compute"
    before = len(log)
    Buffer._run(buffer, _queue_then(log, current), [], None, False)  # nothing pending any more
    assert log[before:] == ["kernels queued on compute"]


class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is a CUDA one and logs the streams it is marked in use by."""

    is_cuda = True

    def record_stream(self, stream) -> None:
        self.marked.append(stream.name)


def _fake_cuda_tensor() -> _FakeCudaTensor:
    t = torch.Tensor._make_subclass(_FakeCudaTensor, torch.empty(1))
    t.marked = []
    return t


def test_an_asynchronous_result_s_cuda_tensors_are_marked_in_use_by_the_current_stream(streams) -> None:
    """Every CUDA tensor of a nested result (tuples, NamedTuples, lists) is marked and held by the event; the
    lists of counts in it are walked without a call per number, CPU tensors and other objects are left alone;
    the inputs are marked in use by the communication stream."""
    buffer, log, current = streams
    first, second, cpu, given = _fake_cuda_tensor(), _fake_cuda_tensor(), torch.empty(1), _fake_cuda_tensor()
    result = (first, None, list(range(256)), (cpu, [second, 3], "name"), 2.5)
    out, event = Buffer._run(buffer, lambda: result, [given, None], None, True)
    assert out is result
    assert first.marked == ["compute"] and second.marked == ["compute"] and given.marked == ["comm"]
    assert any(t is first for t in event.extra_tensors) and any(t is given for t in event.extra_tensors)


def test_a_synchronous_result_is_not_marked(streams) -> None:
    buffer, log, current = streams
    first, given = _fake_cuda_tensor(), _fake_cuda_tensor()
    Buffer._run(buffer, lambda: (first,), [given], None, False)
    assert first.marked == [] and given.marked == []
