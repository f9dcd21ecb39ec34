"""The native backend's given data memory (`NativeBackend.use_data_memory`: an `ElasticBuffer`'s GPU segment), its
host side on CPU: rank 1 of a two-rank backend built without a GPU (the fixture of test_rows_in_place_host_paths.py,
whose fake kernels module plays the kernels).

* `use_data_memory` builds the peers' mapping over the given bytes (`VmmSymmetricBuffer` with ``local``) and
  refuses a backend that has a data buffer already;
* the given memory never grows: a call that needs more raises ValueError naming the argument that sized it (after
  the call's header agreement), never allocating; a copy-engine layout that does not fit is just not taken; the
  backend's own memory still grows and counts its allocations;
* fixed-size calls are sized for ``num_worst_tokens`` rows with given memory (the bound its user keeps), ``R - 1``
  times that otherwise;
* an exact-size dispatch that does not fit raises after its count exchange, having closed the notify's epoch and
  sent no row;
* `VmmSymmetricBuffer` with ``local`` maps only the peers (in rank order), allocates nothing and leaves the
  caller's descriptor open; it refuses a ``local`` that is not CUDA bytes; `SymmetricMemory` with ``share_gpu``
  makes its GPU segment one exportable allocation and keeps the descriptor until `close_gpu_fd`.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from support.native_backend_fakes import FakeData
from test_rows_in_place_host_paths import ME, E, FakeKernels, R, _scenario
from test_rows_in_place_host_paths import backend as _backend  # noqa: F401  (the fixture, used by name below)

from ep_moe.backends import native_backend as nb
from ep_moe.config import Config
from ep_moe.native.symmetric import _local_failure

SEGMENT = ("ElasticBuffer", "num_bytes")


class _Recorder:
    """Stands in for `VmmSymmetricBuffer`: records how it was built."""

    made: list = []

    def __init__(self, group, device, nbytes, *, local=None, local_fd=-1) -> None:
        self.nbytes, self.tensor, self.ptrs = nbytes, local, [0, 0]
        _Recorder.made.append((group, device, nbytes, local, local_fd))


def _no_allocation(*args, **kwargs):
    raise AssertionError("the backend allocated a data buffer of its own")


@pytest.fixture
def fixed(request, monkeypatch):
    """The two-rank backend at rank 1 with 2 MiB of given data memory."""
    b = request.getfixturevalue("_backend")
    monkeypatch.setattr(nb, "VmmSymmetricBuffer", _Recorder)
    monkeypatch.setattr(nb, "SymmetricBuffer", _no_allocation)
    _Recorder.made = []
    b._data = None
    local = torch.zeros(2 << 20, dtype=torch.uint8)
    b.use_data_memory(local, 17, *SEGMENT)
    assert _Recorder.made == [(b.group, b.device, 2 << 20, local, 17)] and b._fixed_data == SEGMENT
    return b


def test_use_data_memory_maps_the_given_bytes_once(fixed):
    assert fixed._data.tensor.numel() == 2 << 20 and fixed.data_allocations == 0
    with pytest.raises(RuntimeError, match="before the first call"):
        fixed.use_data_memory(torch.zeros(2 << 20, dtype=torch.uint8), 18, *SEGMENT)
    assert len(_Recorder.made) == 1


def test_given_memory_never_grows(fixed):
    agreed = []
    hidden = 1024
    fits = (2 << 20) // (hidden * 2 + 16)  # rows of bf16 x plus their metadata in 2 MiB
    fixed._fit(fits // 2, hidden, 2, 0, 4, agree=lambda: agreed.append(1))
    fixed._fit(None, hidden, 2, 0, 4, agree=lambda: agreed.append(1))  # unknown here: the kernels check
    fixed._fit(4 * fits, hidden, 2, 0, 4, optional=True)  # the caller does without (copy engine)
    assert agreed == [] and fixed.data_allocations == 0
    with pytest.raises(ValueError, match=r"ep_moe\.ElasticBuffer: argument 'num_bytes' must be at least") as err:
        fixed._fit(4 * fits, hidden, 2, 0, 4, agree=lambda: agreed.append(1))
    assert agreed == [1] and "does not grow" in str(err.value) and f"got {2 << 20}" in str(err.value)
    assert fixed._data.nbytes == 2 << 20 and fixed._retired == []


def test_own_memory_grows_and_counts(request, monkeypatch):
    b = request.getfixturevalue("_backend")
    made = []
    monkeypatch.setattr(nb, "SymmetricBuffer", lambda group, device, nbytes: made.append(nbytes) or FakeData(nbytes, R))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"synchronize": staticmethod(lambda: None)})())
    before = b._data
    b._fit(10_000, 1024, 2, 0, 4)
    assert len(made) == 1 and b._retired == [before] and b.data_allocations == 1 and b._fixed_data is None


def test_fixed_size_rows(fixed):
    fixed.num_ranks = 4
    assert fixed._worst_rows(100) == 100
    fixed._fixed_data = None
    assert fixed._worst_rows(100) == 300


class _ClosingKernels(FakeKernels):
    def close_epoch(self, env) -> None:
        self.calls.append(("close_epoch", (env,)))


def test_exact_dispatch_that_does_not_fit_closes_its_epoch(fixed, monkeypatch):
    s = _scenario(False, 1)
    fake = _ClosingKernels(fixed, s)
    monkeypatch.setattr(nb, "_c", lambda: fake)
    fixed._data = FakeData(4096, R)  # given memory too small for the scenario's rows
    with pytest.raises(ValueError, match="argument 'num_bytes'"):
        fixed.dispatch(s["x"], None, s["idx"], s["w"], s["in_rank"], s["per_rank"], None, E, 1, 0, Config())
    assert [name for name, _ in fake.calls] == ["notify", "close_epoch"]  # counts exchanged, no row sent
    assert fixed.rank == ME and fixed.data_allocations == 0


def test_local_checks():
    """(The size, device and descriptor checks need a CUDA tensor: tests/native/test_elastic_segment_gpu.py.)"""
    device = torch.device("cuda", 0)
    on_cpu = torch.empty(2 << 20, dtype=torch.uint8)
    assert "'local' must be a contiguous 1-D uint8 CUDA tensor" in _local_failure(on_cpu, 3, 2 << 20, 2 << 20, device)
    assert "'local' must be a contiguous" in _local_failure(torch.empty(4, 4), 3, 2 << 20, 2 << 20, device)


class _FakeDist:
    """Rank 1 of 3; every rank gathers the same object."""

    @staticmethod
    def get_rank(group) -> int:
        return 1

    @staticmethod
    def get_world_size(group) -> int:
        return 3

    @staticmethod
    def all_gather_object(out: list, obj, group=None) -> None:
        out[:] = [obj] * len(out)


class _FakeRange:
    """Stands in for `CudaRange`: records what is mapped where."""

    address = 1 << 40

    def __init__(self, size, device, host=True) -> None:
        self.size, self.maps = size, []

    def map_imported(self, offset, size, fd) -> None:
        self.maps.append(("imported", offset, size, fd))

    def map_allocation(self, offset, size, allocation) -> None:
        self.maps.append(("allocation", offset, size, allocation))

    def view(self, offset, size):
        raise AssertionError("the own copy is the given one: no view of the range")


def _new_fd() -> int:
    """A descriptor of this process (the read end of a pipe whose write end is closed)."""
    read, write = os.pipe()
    os.close(write)
    return read


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_vmm_buffer_maps_the_peers_around_the_given_copy(monkeypatch):
    """`VmmSymmetricBuffer(local=...)`: the peers' descriptors are mapped in rank order at ``r * nbytes``, this
    rank's slot is left unmapped and nothing is allocated; ``ptrs[rank]`` is the given copy's address; the peers'
    descriptors are closed, the caller's is not."""
    from ep_moe.native import symmetric

    n = 2 << 20
    local = torch.zeros(n, dtype=torch.uint8)
    peer0, peer2, own = _new_fd(), _new_fd(), _new_fd()
    ranges: list[_FakeRange] = []
    monkeypatch.setattr(symmetric, "dist", _FakeDist)
    monkeypatch.setattr(symmetric, "_local_failure", lambda *args: None)  # (the tensor is on the CPU here)
    monkeypatch.setattr(symmetric, "exchange_fds", lambda group, fd, failure, what: ([0, 1, 2], [peer0, fd, peer2]))
    monkeypatch.setattr(symmetric, "CudaRange", lambda *a, **k: ranges.append(_FakeRange(*a, **k)) or ranges[-1])
    monkeypatch.setattr(symmetric, "DeviceAllocation", _no_allocation)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    buf = symmetric.VmmSymmetricBuffer("group", torch.device("cuda", 0), n, local=local, local_fd=own)
    assert ranges[0].size == 3 * n and ranges[0].maps == [("imported", 0, n, peer0), ("imported", 2 * n, n, peer2)]
    assert buf.tensor is local and buf.peer_tensor(1) is local and buf.nbytes == n
    assert buf.ptrs == [_FakeRange.address, local.data_ptr(), _FakeRange.address + 2 * n]
    assert not _is_open(peer0) and not _is_open(peer2) and _is_open(own)
    os.close(own)


def test_segment_is_one_exportable_allocation(monkeypatch):
    """`SymmetricMemory` with ``share_gpu``: the GPU segment is one exportable allocation the range takes over;
    its descriptor stays with the memory until `close_gpu_fd`."""
    from ep_moe.elastic.memory import symmetric_memory as memory_symmetric

    class _Allocation:
        def __init__(self, device, size) -> None:
            self.size, self.fd = size, _new_fd()

    monkeypatch.setattr(memory_symmetric, "CudaRange", _FakeRange)
    monkeypatch.setattr(memory_symmetric, "DeviceAllocation", _Allocation)
    memory = memory_symmetric.SymmetricMemory.__new__(memory_symmetric.SymmetricMemory)
    memory.device, memory._share_gpu, memory.gpu_fd = torch.device("cuda", 0), True, -1
    memory._range = _FakeRange(4 << 20, memory.device)
    memory._map_private(0, 2 << 20)
    [(kind, offset, size, allocation)] = memory._range.maps
    assert (kind, offset, size) == ("allocation", 0, 2 << 20) and allocation.fd == -1
    fd = memory.gpu_fd
    assert _is_open(fd)
    memory.close_gpu_fd()
    assert memory.gpu_fd == -1 and not _is_open(fd)
