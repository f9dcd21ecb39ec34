"""The native backend's given data memory (`NativeBackend.use_data_memory`: an `ElasticBuffer`'s GPU segment), its
host side on CPU: rank 1 of a two-rank backend built without a GPU (the fixture of test_rows_in_place_host.py,
whose fake extension plays the kernels).

* `use_data_memory` builds the peers' mapping over the given bytes (`VmmSymmetricBuffer` with ``local``) and
  refuses a backend that has a data buffer already;
* the given memory never grows: a call that needs more raises ValueError naming the argument that sized it (after
  the call's header agreement), never allocating; a copy-engine layout that does not fit is just not taken; the
  backend's own memory still grows and counts its allocations;
* fixed-size calls are sized for ``num_worst_tokens`` rows with given memory (the bound its user keeps), ``R - 1``
  times that otherwise;
* an exact-size dispatch that does not fit raises after its count exchange, having closed the notify's epoch and
  sent no row;
* `VmmSymmetricBuffer` refuses a ``local`` that is not CUDA bytes.
"""

from __future__ import annotations

import pytest
import torch
from test_rows_in_place_host import ME, E, FakeKernels, _Data, _scenario
from test_rows_in_place_host import backend as _backend  # noqa: F401  (the fixture, used by name below)

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
    monkeypatch.setattr(nb, "SymmetricBuffer", lambda group, device, nbytes: made.append(nbytes) or _Data(nbytes))
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
    fixed._data = _Data(4096)  # given memory too small for the scenario's rows
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
