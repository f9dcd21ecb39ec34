"""The torch side shared by every JIT launcher (`intranode`, `expert_major`, `expert_major_exchange` and the layout
probe's read-back): the current raw stream of a device, a tensor's device index, and the checks of a launcher's
tensor arguments with the error they raise, ``ValueError("ep_moe.native.jit[.<op>]: <message>")`` naming the
argument, before anything is launched.

They run on every launch: no ``torch.device`` or ``Stream`` object per call, and the checks test the usual case
inline before they build a message.
"""

from __future__ import annotations

import torch
from torch import Tensor

# raw_stream(device: int) -> int, the current stream of ``device`` as a ``cudaStream_t``: torch's private raw getter
# (what torch.compile's generated code calls) when present, else the public API
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)

# device_index(t: Tensor) -> int, ``t``'s CUDA device index (-1 for a CPU tensor): ``Tensor.get_device`` itself
device_index = Tensor.get_device


def fail(message: str, op: str = "") -> ValueError:
    """The error of an unfit launcher argument: ``ValueError("ep_moe.native.jit.<op>: <message>")``, without
    ``.<op>`` where ``op`` is empty."""
    return ValueError(f"ep_moe.native.jit.{op}: {message}" if op else f"ep_moe.native.jit: {message}")


def check_cuda(t: Tensor, name: str) -> None:
    """Raises `fail` naming argument ``name`` unless ``t`` is a contiguous CUDA tensor (on any device)."""
    if not t.is_cuda or not t.is_contiguous():
        raise fail(f"argument '{name}' must be a contiguous CUDA tensor")


def ptr(t: Tensor | None, name: str) -> int:
    """The address of an optional tensor argument (0 when absent; never dereferenced then), checked as
    `check_cuda`."""
    if t is None:
        return 0
    if not (t.is_cuda and t.is_contiguous()):  # inline: a launcher passes up to 10 of them per call
        check_cuda(t, name)
    return t.data_ptr()


def check_all(names: tuple[str, ...], *tensors: Tensor) -> None:
    """`check_cuda` of every tensor (``names[i]`` names ``tensors[i]``), in one call on the usual path."""
    for t in tensors:
        if not (t.is_cuda and t.is_contiguous()):
            for u, name in zip(tensors, names):
                check_cuda(u, name)
            return


def check_on(t: Tensor, op: str, name: str, device: int) -> None:
    """Raises `fail` of ``op`` naming argument ``name`` unless ``t`` is a contiguous CUDA tensor on device index
    ``device`` (the `device_index` of the op's first tensor; -1, a CPU tensor's, refuses every tensor)."""
    if not (t.is_cuda and t.get_device() == device and t.is_contiguous()):
        if not t.is_cuda or t.get_device() != device:
            raise fail(f"argument '{name}' must be on cuda:{device}, got {t.device}" if device >= 0 else
                       f"argument '{name}' must be a CUDA tensor, got {t.device}", op)
        raise fail(f"argument '{name}' must be contiguous", op)


def check_typed(t: Tensor, dtype: torch.dtype, op: str, name: str, device: int) -> None:
    """`check_on`, and ``t`` is of ``dtype``."""
    check_on(t, op, name, device)
    if t.dtype != dtype:
        raise fail(f"argument '{name}' must be {dtype}, got {t.dtype}", op)


def is_pinned(t: Tensor) -> bool:
    """Whether ``t`` is pinned host memory (``Tensor.is_pinned``: a CUDA pointer query per call)."""
    return not t.is_cuda and t.is_pinned()


__all__ = ["check_all", "check_cuda", "check_on", "check_typed", "device_index", "fail", "is_pinned", "ptr", "raw_stream"]
