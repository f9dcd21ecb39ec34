"""Native intranode kernels (CUDA, over symmetric memory) and the check of whether they can run.

The extension ``ep_moe.native._C`` exists only where ``setup.py`` found a CUDA toolkit and a CUDA
build of torch. Everything here imports without it.
"""

from __future__ import annotations

import logging
import socket

import torch
import torch.distributed as dist

from .sizing import buffer_size_hint

log = logging.getLogger("ep_moe")

try:  # the compiled kernels, when they were built
    from . import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # CPU-only install: report once, when someone asks for the backend
    _C = None
    _IMPORT_ERROR = str(exc) or type(exc).__name__


def extension_available() -> bool:
    """True when the CUDA extension was built and imports."""
    return _C is not None


def unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why the native backend cannot serve ``group`` on ``device``, or None when it can.

    Collective: every rank of ``group`` must call it (it gathers host names and devices).
    """
    if _C is None:
        return f"the CUDA extension ep_moe.native._C is not built ({_IMPORT_ERROR})"
    if device.type != "cuda":
        return f"the group runs on {device.type}, not CUDA"
    here = (socket.gethostname(), torch.cuda.current_device())
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, here, group=group)
    if len({host for host, _ in everyone}) != 1:
        return "the group spans several hosts (native kernels are intranode only)"
    for _host, dev in everyone:
        if dev != here[1] and not torch.cuda.can_device_access_peer(here[1], dev):
            return f"GPU {here[1]} cannot access GPU {dev} as a peer (no NVLink/P2P)"
    return None


__all__ = ["buffer_size_hint", "extension_available", "unavailable_reason"]
