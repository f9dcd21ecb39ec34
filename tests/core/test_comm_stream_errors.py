"""`Buffer`'s communication stream when a backend call raises (CPU, with fake streams): a call may raise after it
queued kernels (the native backend raises a rank disagreement after its launches), so the current stream still
waits for the communication stream, as after a call that returned; otherwise a `barrier()` on the current stream
could run beside those kernels (tests/native/test_native_mismatch_host_paths.py shows what that does to the epochs)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from ep_moe.buffer.buffer_v1 import Buffer


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


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
    return SimpleNamespace(_comm_stream=comm, device=torch.device("cuda", 0)), log, current


def _queue_then(log: list, current: list, error: Exception | None):
    def call():
        log.append(f"kernels queued on {current[-1].name}")
        if error is not None:
            raise error
        return "out"
    return call


def test_a_call_that_returns_joins_the_streams(streams) -> None:
    buffer, log, current = streams
    out, _ = Buffer._run(buffer, _queue_then(log, current, None), [], None, False)
    assert out == "out"
    assert log == ["comm waits for compute", "kernels queued on comm", "compute waits for comm"]


def test_a_call_that_raises_after_queuing_kernels_still_joins_the_streams(streams) -> None:
    buffer, log, current = streams
    with pytest.raises(ValueError, match="ranks disagree"):
        Buffer._run(buffer, _queue_then(log, current, ValueError("ranks disagree")), [], None, False)
    assert log == ["comm waits for compute", "kernels queued on comm", "compute waits for comm"]
    assert current[-1].name == "compute"


class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is a CUDA one and logs the streams it is marked in use by."""

    is_cuda = True

    def record_stream(self, stream) -> None:
        self.marked.append(stream.name)


def _fake_cuda_tensor() -> _FakeCudaTensor:
    t = torch.Tensor._make_subclass(_FakeCudaTensor, torch.empty(1))
    t.marked = []
    return t


def test_a_result_s_cuda_tensors_are_marked_in_use_by_the_current_stream(streams) -> None:
    """Every CUDA tensor of a nested result (tuples, NamedTuples, lists) is marked; the lists of counts in it are
    walked without a call per number, CPU tensors and other objects are left alone."""
    buffer, log, current = streams
    first, second, cpu = _fake_cuda_tensor(), _fake_cuda_tensor(), torch.empty(1)
    result = (first, None, list(range(256)), (cpu, [second, 3], "name"), 2.5)
    out, _ = Buffer._run(buffer, lambda: result, [], None, False)
    assert out is result
    assert first.marked == ["compute"] and second.marked == ["compute"]
