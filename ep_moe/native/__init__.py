"""Native intranode kernels (CUDA, over symmetric memory) and the check of whether they can run.

The extension ``ep_moe.native._C`` exists only where ``setup.py`` found a CUDA toolkit and a CUDA
build of torch. Everything here imports without it.
"""

from __future__ import annotations

import importlib.util
import logging
import socket

import torch
import torch.distributed as dist

from .sizing import buffer_size_hint

log = logging.getLogger("ep_moe")

MAX_RANKS = 8  # the kernels address at most this many NVLink peers

try:  # the compiled kernels, when they were built
    from . import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # CPU-only install: report once, when someone asks for the backend
    _C = None
    if importlib.util.find_spec(f"{__name__}._C") is None:
        _IMPORT_ERROR = "not compiled: setup.py builds it only where a CUDA toolkit and a CUDA torch are found"
    else:
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
    num_ranks = dist.get_world_size(group)
    if num_ranks > MAX_RANKS:
        return f"the group has {num_ranks} ranks (native kernels serve at most {MAX_RANKS})"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory is unavailable ({exc})"
    here = (socket.gethostname(), torch.cuda.current_device())
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, here, group=group)
    if len({host for host, _ in everyone}) != 1:
        return "the group spans several hosts (native kernels are intranode only)"
    for _host, dev in everyone:
        if dev != here[1] and not torch.cuda.can_device_access_peer(here[1], dev):
            return f"GPU {here[1]} cannot access GPU {dev} as a peer (no NVLink/P2P)"
    return None


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout kernel: same outputs as `ep_moe.layout.dispatch_layout` (``[R]`` int32 tokens per
    rank, ``[E]`` int32 tokens per expert, ``[T, R]`` bool), on the current CUDA stream."""
    if _C is None:
        raise RuntimeError(f"ep_moe.native: the CUDA extension is not built ({_IMPORT_ERROR})")
    per_rank, per_expert, in_rank = _C.layout(topk_idx.contiguous(), num_experts, num_ranks)
    return per_rank, per_expert, in_rank


__all__ = ["MAX_RANKS", "buffer_size_hint", "dispatch_layout", "extension_available", "unavailable_reason"]
