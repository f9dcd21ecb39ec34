"""The CPU form of the memory model: one reserved virtual range per rank, its segments mapped at their layout
offsets with ``mmap``. Private segments (the "GPU" segment on CPU, an elastic host segment) are anonymous memory;
a hybrid host segment is a ``memfd`` that every rank of the node maps, so a write by its owner is seen by all.

Tensors over the range (`HostRange.view`) keep the range alive; it is unmapped when the last one is gone."""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

PROT_NONE, PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
MAP_FIXED = 0x10  # Linux, every architecture
MAP_NORESERVE = 0x4000  # x86_64 and aarch64 (asm-generic)
MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int) -> int:
    ptr = _libc.mmap(addr, size, prot, flags, fd, 0)
    if ptr is None or ptr == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"ep_moe.elastic.memory: mmap of {size} bytes failed: {os.strerror(err)}")
    return ptr


def create_shared_segment(size: int, name: str = "ep_moe_host_segment") -> int:
    """A new anonymous shared-memory file (``memfd_create``) of ``size`` bytes; the caller owns the descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


class HostRange:
    """``size`` bytes of reserved address space; `map_private` / `map_shared` back parts of it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.address = _mmap(None, max(size, 1), PROT_NONE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1)

    def map_private(self, offset: int, size: int) -> None:
        """Back ``[offset, offset + size)`` with zeroed memory of this process only."""
        if size:
            _mmap(self.address + offset, size, PROT_RW,
                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1)

    def map_shared(self, offset: int, size: int, fd: int) -> None:
        """Map the first ``size`` bytes of the shared file ``fd`` at ``offset`` (the mapping outlives ``fd``)."""
        if size:
            _mmap(self.address + offset, size, PROT_RW, mmap.MAP_SHARED | MAP_FIXED, fd)

    def view(self, offset: int, size: int) -> torch.Tensor:
        """A uint8 CPU tensor over ``[offset, offset + size)``; it keeps the range mapped while it lives."""
        if offset < 0 or offset + size > self.size:
            raise ValueError(f"ep_moe.elastic.memory: [{offset}, {offset + size}) is outside the {self.size}-byte range")
        if size == 0:
            return torch.empty(0, dtype=torch.uint8, device="cpu")
        array = (ctypes.c_uint8 * size).from_address(self.address + offset)
        array._range = self  # the tensor holds the array (torch.frombuffer), the array holds the range
        return torch.frombuffer(array, dtype=torch.uint8)

    def __del__(self) -> None:
        address = getattr(self, "address", None)
        if address is not None and _libc is not None:  # (module globals may be gone at interpreter exit)
            _libc.munmap(address, max(self.size, 1))
            self.address = None


__all__ = ["HostRange", "create_shared_segment"]
