"""`SymmetricMemory`: one rank's elastic or hybrid range, allocated collectively over the group.

On a CUDA device the range is mapped with the driver's VMM calls (`ep_moe.elastic.memory.cuda_vmm`); on the CPU (gloo) the
same layout is mapped with ``mmap`` (`ep_moe.elastic.memory.host_mapping`), the hybrid host segments being ``memfd`` files shared
the same way, so the hybrid exchange (``(pid, fd)`` over the group, ``pidfd_getfd``, mapping in rank order) runs
for real in CPU tests.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from .cuda_vmm import CudaRange, DeviceAllocation, HostAllocation, close_fd
from .fdshare import exchange_fds
from .host_mapping import HostRange, create_shared_segment
from .segment_layout import memory_layout


class SymmetricMemory:
    """The mapped range of one rank (layout: `ep_moe.elastic.memory.segment_layout.memory_layout`).

    Attributes:
        memory_type: ``"elastic"`` or ``"hybrid"``.
        layout: the segments, in address order.
        device: where the tensors live: the CUDA device (every segment GPU-visible, host ones included) or cpu.
        gpu: uint8 ``[layout.gpu_segment.size]`` over the GPU segment.
        host: uint8 ``[num_cpu_bytes rounded to 2 MiB]`` over this rank's own host segment.
        host_segments: per group rank, its host segment as mapped here (uint8), or None where it is not mapped
            (elastic: every peer; hybrid: ranks of other nodes).
        gpu_fd: with ``share_gpu`` on a CUDA device, a POSIX file descriptor exporting the GPU segment's
            allocation (owned here until `close_gpu_fd` or `close`), through which the peers map it (the native
            backend's dispatch/combine memory, `ep_moe.native.symmetric.VmmSymmetricBuffer` with ``local``);
            else -1.
    """

    def __init__(self, memory_type: str, group: dist.ProcessGroup, num_bytes: int, num_cpu_bytes: int,
                 device: torch.device, share_gpu: bool = False) -> None:
        """Collective over ``group``: allocate and map. ``share_gpu`` (CUDA only, ignored on the CPU): the GPU
        segment is one exportable device allocation (``gpu_fd``) instead of a private one. Every rank raises
        (RuntimeError naming the failed ranks) when any rank failed, so none is left waiting; a bad
        ``memory_type`` raises ValueError first."""
        self.gpu_fd = -1
        if memory_type not in ("elastic", "hybrid"):
            raise ValueError(f"ep_moe.elastic.memory: SymmetricMemory is for the elastic and hybrid types, got "
                             f"{memory_type!r}")
        failure = None
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                self._build(memory_type, group, num_bytes, num_cpu_bytes, device,
                            share_gpu and device.type == "cuda")
        except (OSError, RuntimeError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        failures: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(failures, failure, group=group)
        failed = [f"rank {r}: {f}" for r, f in enumerate(failures) if f is not None]
        if failed:
            self.close_gpu_fd()
            raise RuntimeError(f"ep_moe.elastic.memory: allocating the {memory_type} memory failed: " + "; ".join(failed))

    def _build(self, memory_type: str, group: dist.ProcessGroup, num_bytes: int, num_cpu_bytes: int,
               device: torch.device, share_gpu: bool) -> None:
        rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.memory_type = memory_type
        self.device = device
        self._share_gpu = share_gpu
        cuda = device.type == "cuda"
        if memory_type == "hybrid":
            # This rank's host segment first (its size does not depend on the node), then the exchange.
            host_size = memory_layout("hybrid", rank, [rank], num_bytes, num_cpu_bytes).segments[1].size
            own, fd, failure = None, -1, None
            try:
                own = HostAllocation(device, host_size) if cuda else None
                fd = own.fd if cuda else create_shared_segment(host_size, f"ep_moe_host_segment_rank{rank}")
            except (OSError, RuntimeError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
            try:
                local_ranks, fds = exchange_fds(group, fd, failure)
            except BaseException:
                if not cuda and fd >= 0:
                    os.close(fd)  # (a HostAllocation closes its own)
                raise
            self.layout = memory_layout("hybrid", rank, local_ranks, num_bytes, num_cpu_bytes)
            try:
                self._range = CudaRange(self.layout.total_bytes, device) if cuda else HostRange(self.layout.total_bytes)
                gpu = self.layout.gpu_segment
                self._map_private(gpu.offset, gpu.size)
                for segment in self.layout.segments[1:]:  # in rank order
                    if cuda and segment.owner == rank:
                        self._range.map_allocation(segment.offset, segment.size, own)
                    elif cuda:
                        self._range.map_imported(segment.offset, segment.size, fds[segment.owner])
                    else:
                        self._range.map_shared(segment.offset, segment.size, fds[segment.owner])
            finally:
                for other in fds:  # the mappings keep the memory; the descriptors are not needed any more
                    if other is not None:
                        os.close(other)
                if own is not None:
                    own.fd = -1  # closed above (it was this rank's entry of fds)
        elif memory_type == "elastic":
            self.layout = memory_layout("elastic", rank, [rank], num_bytes, num_cpu_bytes)
            self._range = CudaRange(self.layout.total_bytes, device) if cuda else HostRange(self.layout.total_bytes)
            gpu, host = self.layout.segments
            self._map_private(gpu.offset, gpu.size)
            if cuda:
                self._range.map_host(host.offset, host.size)
            else:
                self._range.map_private(host.offset, host.size)
        gpu = self.layout.gpu_segment
        self.gpu = self._range.view(gpu.offset, gpu.size)
        self.host_segments: list[torch.Tensor | None] = [None] * num_ranks
        for segment in self.layout.segments[1:]:
            self.host_segments[segment.owner] = self._range.view(segment.offset, segment.size)
        self.host = self.host_segments[rank]
        self._host_span = None
        self.rank, self.num_ranks = rank, num_ranks

    def _map_private(self, offset: int, size: int) -> None:
        """The GPU segment: this GPU's memory (exportable with ``share_gpu``), or private host memory on CPU."""
        if not isinstance(self._range, CudaRange):
            self._range.map_private(offset, size)
        elif self._share_gpu:
            allocation = DeviceAllocation(self.device, size)
            self._range.map_allocation(offset, size, allocation)  # the range owns the memory from here
            self.gpu_fd, allocation.fd = allocation.fd, -1
        else:
            self._range.map_device(offset, size)

    def close_gpu_fd(self) -> None:
        """Close ``gpu_fd`` (once the peers have imported it; the mappings keep the memory)."""
        close_fd(self.gpu_fd)
        self.gpu_fd = -1

    def host_span(self) -> torch.Tensor:
        """uint8 over every host segment of the range, contiguous (they are adjacent, in rank order)."""
        if self._host_span is None:
            first, last = self.layout.segments[1], self.layout.segments[-1]
            self._host_span = self._range.view(first.offset, last.offset + last.size - first.offset)
        return self._host_span

    def all_host_segments_mapped(self) -> bool:
        """Whether every rank's host segment is mapped here (a hybrid group on one node, or one rank)."""
        return all(s is not None for s in self.host_segments)

    def close(self) -> None:
        """Drop this object's tensors (and ``gpu_fd``); the range is unmapped once no tensor over it is left (a
        native backend whose dispatch/combine memory is the GPU segment holds one until it is destroyed)."""
        self.close_gpu_fd()
        self.gpu = self.host = self._host_span = None
        self.host_segments = [None] * self.num_ranks
        self._range = None


__all__ = ["SymmetricMemory"]
