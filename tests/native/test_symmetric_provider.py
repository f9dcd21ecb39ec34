"""The choice of the native kernels' symmetric memory (``EP_MOE_SYMMETRIC_MEMORY``, `ep_moe.native.symmetric`) on
the CPU: the variable's values, the check that every rank names the same provider (every rank raises the same
error naming the ranks, before anything is allocated), the native backend's decisions for ranks sharing a GPU, the
VMM provider's uniform failure where it cannot map, and a gloo `Buffer` that stays on the CPU where no GPU exists.

The VMM provider's own logic (descriptor exchange, every rank's allocation mapped in rank order, ``ptrs``,
``peer_tensor``, a failure on one rank raised on every rank) runs on its CPU model: the device allocation and the
CUDA range replaced by a ``memfd`` segment and a reserved host range (`ep_moe.elastic.memory.host_mapping`), shared between the
processes the same way. The CUDA mapping itself is tested on a GPU (`test_native_shared_gpu.py`)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from support.shared_gpu import check_symmetric_buffer

from ep_moe.distributed import run_distributed
from ep_moe.elastic.memory.host_mapping import HostRange, create_shared_segment
from ep_moe.native.symmetric import SYMMETRIC_MEMORY_ENV, symmetric_memory_provider


def test_provider_values(monkeypatch):
    monkeypatch.delenv(SYMMETRIC_MEMORY_ENV, raising=False)
    assert symmetric_memory_provider() == "torch"
    for value, provider in (("", "torch"), ("torch", "torch"), (" VMM ", "vmm"), ("vmm", "vmm")):
        monkeypatch.setenv(SYMMETRIC_MEMORY_ENV, value)
        assert symmetric_memory_provider() == provider
    monkeypatch.setenv(SYMMETRIC_MEMORY_ENV, "nvshmem")
    with pytest.raises(ValueError, match=f"{SYMMETRIC_MEMORY_ENV} must be one of torch, nccl, vmm.*'nvshmem'"):
        symmetric_memory_provider()
    assert symmetric_memory_provider("vmm") == "vmm"


def test_env_report_names_the_provider(monkeypatch):
    from ep_moe.native import report

    monkeypatch.delenv(SYMMETRIC_MEMORY_ENV, raising=False)
    assert report._symmetric_memory().startswith(f"torch ({SYMMETRIC_MEMORY_ENV}=(unset)): torch.distributed.")
    monkeypatch.setenv(SYMMETRIC_MEMORY_ENV, "vmm")
    line = report._symmetric_memory()
    assert line.startswith(f"vmm ({SYMMETRIC_MEMORY_ENV}=vmm): CUDA VMM device memory shared by file descriptor"), line
    if not torch.cuda.is_available():
        assert line.endswith("unavailable: cpu is not a CUDA device"), line


def test_vmm_memory_needs_a_cuda_device():
    from ep_moe.elastic.memory.cuda_vmm import CudaDriverError, CudaRange, DeviceAllocation

    with pytest.raises(CudaDriverError, match="device memory cannot be shared: cpu is not a CUDA device"):
        DeviceAllocation(torch.device("cpu"), 2 << 20)
    with pytest.raises(CudaDriverError, match="VMM mapping is not available: cpu is not a CUDA device"):
        CudaRange(2 << 20, torch.device("cpu"), host=False)


def _set_provider(value: str | None) -> None:
    if value is None:
        os.environ.pop(SYMMETRIC_MEMORY_ENV, None)
    else:
        os.environ[SYMMETRIC_MEMORY_ENV] = value


def _raises(fn, *args) -> str:
    """``fn(*args)``'s exception as ``"Type: message"`` ('' when it returns)."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the caller compares the text
        return f"{type(exc).__name__}: {exc}"
    return ""


def _provider_worker(rank: int, world: int) -> list[str]:
    import ep_moe.native as native
    from ep_moe import Buffer
    from ep_moe.native.symmetric import (
        SymmetricBuffer,
        TorchSymmetricBuffer,
        VmmSymmetricBuffer,
        agreed_symmetric_memory_provider,
    )

    group, cpu = dist.group.WORLD, torch.device("cpu")
    seen = []
    # 1) rank 0 names vmm, the others nothing (torch): every rank raises, naming the ranks of each value
    _set_provider("vmm" if rank == 0 else None)
    seen.append(_raises(agreed_symmetric_memory_provider, group))
    seen.append(_raises(SymmetricBuffer, group, cpu, 1 << 20))  # the factory checks before it allocates
    # 2) a bad value on every rank: the same ValueError everywhere
    _set_provider("Nvshmem")
    seen.append(_raises(agreed_symmetric_memory_provider, group))
    # 3) subclasses constructed by name: every rank must construct the same one
    _set_provider("vmm")
    seen.append(_raises(VmmSymmetricBuffer if rank == 0 else TorchSymmetricBuffer, group, cpu, 1 << 20))
    # 4) the VMM provider where it cannot map (not a CUDA device): every rank raises, naming every rank
    seen.append(_raises(SymmetricBuffer, group, cpu, 1 << 20))
    # 5) the native backend's check agrees on the provider first, whatever the device (as if it were built);
    # 6) then decides alike on every rank from what every rank gathered
    decided, native._decided = native._decided, None  # the kernels can run (as far as this check asks)
    current_device, torch.cuda.current_device = torch.cuda.current_device, lambda: 0
    try:
        _set_provider(None if rank == 0 else "vmm")
        seen.append(_raises(native.unavailable_reason, group, cpu))
        _set_provider("vmm")
        seen.append(str(native.unavailable_reason(group, cpu)))
        # ranks on one GPU (as the check sees them): torch's symmetric memory refuses them; vmm would serve them,
        # where the driver can (not here: no GPU), and says so for every rank
        gpu = torch.device("cuda", 0)
        _set_provider(None)
        seen.append(str(native.unavailable_reason(group, gpu)))
        _set_provider("vmm")
        seen.append(str(native.unavailable_reason(group, gpu)))
    finally:
        native._decided = decided
        torch.cuda.current_device = current_device
    # 7) a gloo Buffer with vmm named but no GPU: the CPU and the torch backend, as without the variable
    buffer = Buffer(group, backend="auto")
    seen.append(f"{buffer.device} {buffer.backend_name}")
    buffer.destroy()
    # 8) with a GPU (as the choice sees it), the device of a gloo Buffer follows the agreed provider: the GPU for
    # vmm unless the torch backend is asked for; ranks that disagree all raise before choosing
    from ep_moe.buffer.buffer_v1 import _device_of

    available, torch.cuda.is_available = torch.cuda.is_available, lambda: True
    current_device, torch.cuda.current_device = torch.cuda.current_device, lambda: 0
    try:
        _set_provider("vmm")
        seen.append(" ".join(str(_device_of(group, requested)) for requested in ("auto", "native", "torch")))
        _set_provider(None)
        seen.append(str(_device_of(group, "auto")))
        _set_provider("vmm" if rank == 1 else None)
        seen.append(_raises(_device_of, group, "native"))
    finally:
        torch.cuda.is_available, torch.cuda.current_device = available, current_device
    return seen


def test_every_rank_must_name_the_same_provider():
    results = run_distributed(_provider_worker, 2, timeout_s=60, join_timeout_s=120)
    assert results[0] == results[1], results  # every rank raised the same error, so none was left waiting
    (mixed, factory, bad, by_name, no_cuda, native_mixed, native_cpu, torch_shared, vmm_shared, buffer,
     vmm_devices, torch_device, device_mixed) = results[0]
    assert mixed.startswith("ValueError") and "'vmm' on rank 0" in mixed and "'torch' on rank 1" in mixed, mixed
    assert SYMMETRIC_MEMORY_ENV in mixed and factory == mixed, factory
    assert bad.startswith("ValueError") and "'Nvshmem'" in bad and "must be one of torch, nccl, vmm" in bad, bad
    assert by_name.startswith("ValueError") and "'vmm' on rank 0;" in by_name and "'torch' on rank 1" in by_name
    assert no_cuda.startswith("PeerFdError") and "symmetric device memory" in no_cuda, no_cuda
    assert all(f"rank {r}: ValueError: argument 'device' must be a CUDA device" in no_cuda for r in range(2))
    assert native_mixed.startswith("ValueError") and "'torch' on rank 0" in native_mixed, native_mixed
    assert native_cpu == "the group runs on cpu, not CUDA", native_cpu
    if not torch.cuda.is_available():
        assert torch_shared.startswith("ranks 0, 1 share GPU 0") and SYMMETRIC_MEMORY_ENV in torch_shared, torch_shared
        assert all(f"rank {r}: {SYMMETRIC_MEMORY_ENV}=vmm, but the CUDA VMM calls cannot serve it" in vmm_shared
                   for r in range(2)), vmm_shared
    assert buffer == "cpu torch" or torch.cuda.is_available(), buffer
    assert vmm_devices == "cuda:0 cuda:0 cpu" and torch_device == "cpu", (vmm_devices, torch_device)
    assert device_mixed.startswith("ValueError") and "'vmm' on rank 1" in device_mixed, device_mixed


class _SegmentAllocation:
    """The CPU model of `DeviceAllocation`: a ``memfd`` segment, its descriptor in place of the exported one."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.size, self.fd = size, create_shared_segment(size, "ep_moe_test_vmm_buffer")
        self.handle = self.fd


class _HostRangeModel(HostRange):
    """The CPU model of `CudaRange`: allocations mapped by their descriptors into a reserved host range.
    ``refuse_imports``: `map_imported` raises (a mapping that fails on one rank)."""

    refuse_imports = False

    def __init__(self, size: int, device: torch.device, host: bool = True) -> None:
        assert not host, "the VMM provider maps no host memory"
        super().__init__(size)

    def map_allocation(self, offset: int, size: int, allocation: _SegmentAllocation) -> None:
        self.map_shared(offset, size, allocation.fd)

    def map_imported(self, offset: int, size: int, fd: int) -> None:
        if self.refuse_imports:
            raise RuntimeError("cuMemSetAccess failed: CUDA_ERROR_INVALID_DEVICE (simulated)")
        self.map_shared(offset, size, fd)


def _vmm_model_worker(rank: int, world: int) -> str:
    import ep_moe.native.symmetric as symmetric

    symmetric.DeviceAllocation, symmetric.CudaRange = _SegmentAllocation, _HostRangeModel
    torch.cuda.device = lambda device: contextlib.nullcontext()  # (no CUDA device to make current)
    _set_provider("vmm")
    buf = symmetric.SymmetricBuffer(dist.group.WORLD, torch.device("cuda", 0), (1 << 20) + 1)
    assert isinstance(buf, symmetric.VmmSymmetricBuffer) and buf.nbytes == 2 << 20
    assert buf.ptrs == [buf.ptrs[0] + r * buf.nbytes for r in range(world)]  # one range, in rank order
    check_symmetric_buffer(buf, rank, world)
    buf.destroy()
    assert buf.tensor is None and buf.ptrs == []
    _HostRangeModel.refuse_imports = rank == world - 1
    return _raises(symmetric.SymmetricBuffer, dist.group.WORLD, torch.device("cuda", 0), 1 << 20)


def test_vmm_provider_on_its_cpu_model():
    world = 3
    errors = run_distributed(_vmm_model_worker, world, timeout_s=60, join_timeout_s=120)
    assert all(e == errors[0] for e in errors), errors  # every rank raised the same error
    assert errors[0] == (f"RuntimeError: ep_moe: mapping {2 << 20} bytes of VMM symmetric memory failed: rank "
                         f"{world - 1}: RuntimeError: cuMemSetAccess failed: CUDA_ERROR_INVALID_DEVICE (simulated)")


def test_nccl_provider_is_a_value_and_names_itself(monkeypatch):
    from ep_moe.native import report
    from ep_moe.native.symmetric import _PROVIDER_CLASSES, NcclSymmetricBuffer

    for value in ("nccl", " NCCL "):
        monkeypatch.setenv(SYMMETRIC_MEMORY_ENV, value)
        assert symmetric_memory_provider() == "nccl"
    assert _PROVIDER_CLASSES["nccl"] is NcclSymmetricBuffer and NcclSymmetricBuffer.provider == "nccl"
    monkeypatch.setenv(SYMMETRIC_MEMORY_ENV, "nccl")
    line = report._symmetric_memory()
    assert line.startswith(f"nccl ({SYMMETRIC_MEMORY_ENV}=nccl): torch.distributed._symmetric_memory on its NCCL"), line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_provider_one_rank_buffer_equals_torch_backend(monkeypatch):
    """EP 1 on one GPU with the native backend's memory from torch's NCCL symmetric memory backend: the buffer's
    own copy is addressable, and dispatch / combine equal the torch backend bit for bit (the speed against the
    `torch` provider is measured by the `providers` step of `benchmarks/gpu_check.sh`)."""
    from ep_moe import native

    if not native.kernels_available():
        pytest.skip(f"no native kernels: {native.kernels_unavailable_reason()}")
    monkeypatch.setenv(SYMMETRIC_MEMORY_ENV, "nccl")  # the spawned rank inherits it
    result, = run_distributed(_nccl_one_rank, 1, backend="nccl", timeout_s=120, join_timeout_s=300)
    if isinstance(result, str):
        pytest.skip(result)
    assert result is True


def _nccl_one_rank(rank: int, world: int) -> bool | str:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from ep_moe import Buffer
    from ep_moe.native.symmetric import NcclSymmetricBuffer, SymmetricBuffer

    device = torch.device("cuda", torch.cuda.current_device())
    try:
        memory = SymmetricBuffer(dist.group.WORLD, device, 3 << 20)
    except RuntimeError as exc:  # this torch / NCCL does not offer the backend: the error names the variable
        assert SYMMETRIC_MEMORY_ENV in str(exc), exc
        return f"torch's NCCL symmetric memory backend is unavailable here: {exc}"
    assert isinstance(memory, NcclSymmetricBuffer) and symm_mem.get_backend(device) == "NCCL"
    assert memory.nbytes == 4 << 20 and memory.ptrs == [memory.tensor.data_ptr()]
    memory.peer_tensor(0)[:16].fill_(7)
    assert int(memory.tensor[:16].sum()) == 7 * 16
    memory.destroy()
    nat, ref = Buffer(backend="native", timeout_s=30.0), Buffer(backend="torch")
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(300, 2048, generator=g, device=device).to(torch.bfloat16)
    idx = torch.rand(300, 32, generator=g, device=device).topk(4, dim=1).indices
    w = torch.rand(300, 4, generator=g, device=device)
    outs = []
    for buf in (nat, ref):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 32)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        combined = buf.combine(recv_x, handle, topk_weights=recv_w)[0]
        outs.append((recv_x, combined))
    assert nat.backend_name == "native"
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    nat.destroy()
    ref.destroy()
    return True
