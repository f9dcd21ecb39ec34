"""One block of symmetric memory per EP group: the same size on every rank, every rank's copy addressable from
this process (peer pointers), from one of three providers chosen by ``EP_MOE_SYMMETRIC_MEMORY`` (read here only,
`symmetric_memory_provider`):

* ``torch`` (default): `torch.distributed._symmetric_memory` (`TorchSymmetricBuffer`). One GPU per rank: its
  rendezvous refuses ranks that share a device.
* ``nccl``: the same torch API over its NCCL backend (``symm_mem.set_backend("NCCL")``: NCCL's window
  registration, NCCL >= 2.27; `NcclSymmetricBuffer`). The group must be an NCCL group, one GPU per rank; torch's
  backend is process-wide and fixed by the first symmetric allocation, so a process uses one of ``torch`` and
  ``nccl``. Which of the two is faster is measured on two GPUs (the two-GPU issue).
* ``vmm``: the CUDA driver's virtual-memory calls (`VmmSymmetricBuffer`): every rank exports a device allocation
  as a POSIX file descriptor, the ranks of the node exchange them (`ep_moe.elastic.memory.fdshare.exchange_fds`), and each
  maps every rank's allocation, in rank order, into one reserved range. Works over any process group (gloo
  included) and for ranks that share one GPU, which is how the multi-rank kernels are tested on one GPU. With
  ``local`` it maps the peers around a copy that exists already (an `ep_moe.ElasticBuffer`'s GPU segment, which
  the native backend then uses as its dispatch/combine memory) instead of allocating one.

The kernels only use unicast peer stores and loads: NVLink multicast stays off (`ep_moe.distributed.disable_multicast`,
when ``ep_moe`` is imported).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from ..elastic.memory.cuda_vmm import CudaRange, DeviceAllocation
from ..elastic.memory.fdshare import exchange_fds
from .sizing import align_up

SYMMETRIC_MEMORY_ENV = "EP_MOE_SYMMETRIC_MEMORY"
PROVIDERS = ("torch", "nccl", "vmm")


def symmetric_memory_provider(value: str | None = None) -> str:
    """The provider ``value`` names (default: ``EP_MOE_SYMMETRIC_MEMORY``; unset or empty: ``"torch"``), one of
    `PROVIDERS`, case and surrounding spaces ignored. Raises `ValueError` naming the variable for another value."""
    raw = os.environ.get(SYMMETRIC_MEMORY_ENV) if value is None else value
    provider = (raw or "").strip().lower() or "torch"
    if provider not in PROVIDERS:
        raise ValueError(f"ep_moe: {SYMMETRIC_MEMORY_ENV} must be one of {', '.join(PROVIDERS)} (unset: torch), "
                         f"got {raw!r}")
    return provider


def agreed_symmetric_memory_provider(group: dist.ProcessGroup) -> str:
    """Collective over ``group`` (one ``all_gather_object``): the provider every rank's ``EP_MOE_SYMMETRIC_MEMORY``
    names. Every rank raises the same `ValueError` when they differ (each value with its ranks) or when the
    common value is not a provider."""
    raw = os.environ.get(SYMMETRIC_MEMORY_ENV)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, raw, group=group)
    named = [(theirs or "").strip().lower() or "torch" for theirs in everyone]
    if len(set(named)) > 1:
        raise ValueError(f"ep_moe: {SYMMETRIC_MEMORY_ENV} must be equal on every rank of the group (unset means "
                         f"torch), got {values_with_ranks(named)}")
    return symmetric_memory_provider(raw)


def values_with_ranks(everyone: list) -> str:
    """``'vmm' on rank 0; 'torch' on ranks 1, 2``: each value of ``everyone`` (rank r's at r; hashable) with its
    ranks, for the error of a collective check that the ranks agree."""
    ranks_by_value: dict[object, list[int]] = {}
    for rank, value in enumerate(everyone):
        ranks_by_value.setdefault(value, []).append(rank)
    return "; ".join(f"{value!r} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                     for value, ranks in ranks_by_value.items())


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    from torch._C._distributed_c10d import _SymmetricMemory

    try:  # a block of its own (no pool): offsets within the allocation are the same on every rank
        return _SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device)
    except (TypeError, RuntimeError):
        import torch.distributed._symmetric_memory as symm_mem

        return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)


def _rendezvous(tensor: torch.Tensor, group: dist.ProcessGroup):
    import torch.distributed._symmetric_memory as symm_mem

    try:
        return symm_mem.rendezvous(tensor, group)
    except RuntimeError:
        # Older torch needs the group registered first (newer torch deprecates the call).
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group.group_name)
        return symm_mem.rendezvous(tensor, group)


class SymmetricBuffer(ABC):
    """``nbytes`` (rounded up to 2 MiB) of device memory on every rank of ``group``.

    ``SymmetricBuffer(group, device, nbytes)`` makes one of the provider ``EP_MOE_SYMMETRIC_MEMORY`` names
    (`TorchSymmetricBuffer`, `NcclSymmetricBuffer` or `VmmSymmetricBuffer`, all subclasses; constructing a subclass
    picks it). Collective:
    every rank constructs it with the same size, and every rank must use the same provider (checked first, one
    ``all_gather_object``: every rank raises the same `ValueError` naming the ranks).

    Attributes: ``nbytes``; ``rank`` (in ``group``); ``tensor`` (this rank's copy, uint8 ``[nbytes]``); ``ptrs``
    (``ptrs[r]``: the address of rank ``r``'s copy, valid in this process on ``device``). Contents start
    undefined (users zero what they need, as the native backend does with its control block).
    """

    provider = ""
    nbytes: int
    rank: int
    tensor: torch.Tensor | None
    ptrs: list[int]

    def __new__(cls, group: dist.ProcessGroup, device: torch.device, nbytes: int, **kwargs):
        agreed = False
        if cls is SymmetricBuffer:  # the provider every rank's EP_MOE_SYMMETRIC_MEMORY names (collective)
            cls = _PROVIDER_CLASSES[agreed_symmetric_memory_provider(group)]
            agreed = True
        buffer = super().__new__(cls)
        buffer._provider_agreed = agreed
        return buffer

    def _agree_on_provider(self, group: dist.ProcessGroup) -> None:
        """A subclass constructed by name: check (collectively) that every rank constructs the same one."""
        if self._provider_agreed:
            return
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, self.provider, group=group)
        if len(set(everyone)) > 1:
            raise ValueError(f"ep_moe: every rank of the group must use the same symmetric memory provider, got "
                             f"{values_with_ranks(everyone)}")

    @abstractmethod
    def peer_tensor(self, rank: int) -> torch.Tensor:
        """uint8 ``[nbytes]`` over rank ``rank``'s copy, addressable from this GPU (this rank's own is
        ``tensor``). Copies into it (``copy_``, the copy engine) land in the peer's memory. Raises `ValueError`
        for a rank outside the group."""

    @abstractmethod
    def destroy(self) -> None:
        """Drop this rank's references (the memory is released once no rank maps it)."""

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < len(self.ptrs):
            raise ValueError(f"ep_moe: argument 'rank' must be in [0, {len(self.ptrs)}), got {rank}")


def _local_failure(local: torch.Tensor, local_fd: int, nbytes: int, asked: int, device: torch.device) -> str | None:
    """Why ``local`` / ``local_fd`` cannot be this rank's copy of a `VmmSymmetricBuffer` of ``nbytes``, or None."""
    if not isinstance(local, torch.Tensor) or local.dtype != torch.uint8 or local.dim() != 1 \
            or not local.is_contiguous() or local.device.type != "cuda":
        return "ValueError: argument 'local' must be a contiguous 1-D uint8 CUDA tensor"
    if local.numel() != nbytes or asked != nbytes:
        return (f"ValueError: argument 'local' must hold nbytes={asked} bytes, a multiple of 2 MiB, got "
                f"{local.numel()}")
    if local.device != device:
        return f"ValueError: argument 'local' must be on {device}, got {local.device}"
    if isinstance(local_fd, bool) or not isinstance(local_fd, int) or local_fd < 0:
        return f"ValueError: argument 'local_fd' must be the descriptor exporting local's allocation, got {local_fd!r}"
    return None


class TorchSymmetricBuffer(SymmetricBuffer):
    """`SymmetricBuffer` on ``torch.distributed._symmetric_memory`` (one GPU per rank)."""

    provider = "torch"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, nbytes: int) -> None:
        self._agree_on_provider(group)
        self.nbytes = align_up(max(int(nbytes), 1))
        self.group = group
        self.rank = dist.get_rank(group)
        with torch.cuda.device(device):
            self.tensor = _allocate(self.nbytes, device)
            self._handle = _rendezvous(self.tensor, group)
        base = list(self._handle.buffer_ptrs)
        offset = self.tensor.data_ptr() - base[self.rank]
        offsets: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(offsets, offset, group=group)
        if len(set(offsets)) != 1:
            raise RuntimeError(f"ep_moe: symmetric buffer landed at different offsets on the ranks ({offsets}); "
                               "set TORCH_SYMMMEM_IMPLICIT_POOL=0")
        self.ptrs: list[int] = [p + offset for p in base]
        self._offset = offset

    def peer_tensor(self, rank: int) -> torch.Tensor:
        self._check_rank(rank)
        if rank == self.rank:
            return self.tensor
        return self._handle.get_buffer(rank, (self.nbytes,), torch.uint8, self._offset)

    def destroy(self) -> None:
        self._handle = None
        self.tensor = None
        self.ptrs = []


class NcclSymmetricBuffer(TorchSymmetricBuffer):
    """`TorchSymmetricBuffer` with torch's symmetric memory on its NCCL backend (NCCL window registration): the
    allocation and the peers' addresses come from NCCL. Raises `RuntimeError` naming ``EP_MOE_SYMMETRIC_MEMORY``
    where this torch or NCCL does not offer the backend, or where this process allocated symmetric memory with
    another backend already."""

    provider = "nccl"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, nbytes: int) -> None:
        _use_nccl_backend(device)
        super().__init__(group, device, nbytes)


def _use_nccl_backend(device: torch.device) -> None:
    """Set torch's symmetric memory backend to NCCL for ``device`` (process-wide; a no-op when it is already)."""
    import torch.distributed._symmetric_memory as symm_mem

    try:
        if symm_mem.get_backend(device) != "NCCL":
            symm_mem.set_backend("NCCL")
        current = symm_mem.get_backend(device)
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
        raise RuntimeError(f"ep_moe: {SYMMETRIC_MEMORY_ENV}=nccl needs torch's NCCL symmetric memory backend "
                           f"(torch.distributed._symmetric_memory.set_backend('NCCL'), NCCL >= 2.27), which this "
                           f"process cannot use: {type(exc).__name__}: {exc}") from exc
    if current != "NCCL":
        raise RuntimeError(f"ep_moe: {SYMMETRIC_MEMORY_ENV}=nccl, but torch's symmetric memory backend on {device} "
                           f"is {current!r} (fixed by an earlier allocation in this process)")


class VmmSymmetricBuffer(SymmetricBuffer):
    """`SymmetricBuffer` over the CUDA driver's VMM calls: rank ``r``'s copy is its own device allocation, mapped
    in every rank's process at ``r * nbytes`` of one reserved range (``ptrs[r] = base + r * nbytes``).

    Every rank grants its own device read-write access to the whole range: ranks on one GPU share it directly;
    a rank on another GPU of the node needs peer access to it (``cuMemSetAccess`` fails otherwise, and the
    error says so). All ranks must be on one host. A failure on any rank (allocation, export, exchange,
    mapping) raises a `RuntimeError` on every rank naming the ranks and their errors, so none is left waiting.

    ``local``: this rank's copy already exists (e.g. the GPU segment of an `ep_moe.ElasticBuffer`'s range,
    `ep_moe.elastic.memory.SymmetricMemory` with ``share_gpu``): uint8 ``[nbytes]`` on ``device`` (``nbytes`` a multiple
    of 2 MiB) over one VMM allocation exported as ``local_fd``. Nothing is allocated then: the peers import
    ``local_fd`` and map it like any rank's allocation, ``tensor`` is ``local`` and ``ptrs[rank]`` its address
    (this rank's slot of the range stays unmapped); the caller keeps ``local``'s memory and ``local_fd`` (open
    until this constructor returns) and frees them after `destroy`. Every rank passes ``local`` or none does.
    """

    provider = "vmm"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, nbytes: int, *,
                 local: torch.Tensor | None = None, local_fd: int = -1) -> None:
        self._agree_on_provider(group)
        self.nbytes = align_up(max(int(nbytes), 1))
        self.group = group
        self.rank = dist.get_rank(group)
        num_ranks = dist.get_world_size(group)
        self.tensor, self.ptrs, self._range = None, [], None
        own, failure, fd = None, None, -1
        if device.type != "cuda":
            failure = f"ValueError: argument 'device' must be a CUDA device, got {device}"
        elif local is not None:
            device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
            failure = _local_failure(local, local_fd, self.nbytes, nbytes, device)
            fd = local_fd
        else:
            device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
            try:
                with torch.cuda.device(device):
                    own = DeviceAllocation(device, self.nbytes)
                fd = own.fd
            except (OSError, RuntimeError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
        # every rank's descriptor (raises on every rank, naming the ranks, when any rank failed above)
        local_ranks, fds = exchange_fds(group, fd, failure, what="symmetric device memory")
        try:
            if len(local_ranks) != num_ranks:
                raise RuntimeError(f"the group spans several hosts (ranks {local_ranks} are on this one): VMM "
                                   "symmetric memory is intranode only")
            with torch.cuda.device(device):
                memory = CudaRange(num_ranks * self.nbytes, device, host=False)
                for r in range(num_ranks):  # in rank order, this rank's own allocation included (unless local)
                    if r != self.rank:
                        memory.map_imported(r * self.nbytes, self.nbytes, fds[r])
                    elif local is None:
                        memory.map_allocation(r * self.nbytes, self.nbytes, own)
                self.tensor = memory.view(self.rank * self.nbytes, self.nbytes) if local is None else local
            self._range = memory
        except (OSError, RuntimeError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            for r, other in enumerate(fds):  # the mappings hold the memory; the descriptors are not needed any more
                if other is not None and (r != self.rank or local is None):  # (local_fd is the caller's)
                    os.close(other)
            if own is not None:
                own.fd = -1  # closed above (it was this rank's entry of fds)
        failures: list = [None] * num_ranks
        dist.all_gather_object(failures, failure, group=group)
        failed = [f"rank {r}: {f}" for r, f in enumerate(failures) if f is not None]
        if failed:
            self.tensor, self._range = None, None
            raise RuntimeError(f"ep_moe: mapping {self.nbytes} bytes of VMM symmetric memory failed: "
                               + "; ".join(failed))
        self.ptrs = [self.tensor.data_ptr() if r == self.rank else self._range.address + r * self.nbytes
                     for r in range(num_ranks)]

    def peer_tensor(self, rank: int) -> torch.Tensor:
        self._check_rank(rank)
        if rank == self.rank:
            return self.tensor
        return self._range.view(rank * self.nbytes, self.nbytes)

    def destroy(self) -> None:
        # The range is unmapped once its last view is gone; a peer's allocation lives until its owner and every
        # rank that mapped it let go.
        self.tensor = None
        self._range = None
        self.ptrs = []


_PROVIDER_CLASSES: dict[str, type[SymmetricBuffer]] = {"torch": TorchSymmetricBuffer, "nccl": NcclSymmetricBuffer,
                                                       "vmm": VmmSymmetricBuffer}

__all__ = ["PROVIDERS", "SYMMETRIC_MEMORY_ENV", "NcclSymmetricBuffer", "SymmetricBuffer", "TorchSymmetricBuffer",
           "VmmSymmetricBuffer", "agreed_symmetric_memory_provider", "symmetric_memory_provider", "values_with_ranks"]
