"""Native intranode kernels (CUDA, over symmetric memory) and the check of whether they can run.

The kernels compile on first use (`ep_moe.native.jit`: NVRTC or nvcc, into a disk cache that ``ep-moe jit warmup``
fills ahead of time) and launch from Python (`ep_moe.native.jit.intranode`). `kernels_unavailable_reason` says
why they cannot run in this process, `unavailable_reason` why the native backend cannot serve a group. Everything
here imports without CUDA. ``python -m ep_moe.native`` prints the environment report (``ep-moe env``).
"""

from __future__ import annotations

import importlib
import logging
import socket

import torch
import torch.distributed as dist

from ..elastic.memory.cuda_vmm import vmm_unavailable_reason
from .sizing import buffer_size_hint
from .symmetric import SYMMETRIC_MEMORY_ENV, agreed_symmetric_memory_provider, symmetric_memory_provider

log = logging.getLogger("ep_moe")

MAX_RANKS = 8  # the kernels address at most this many NVLink peers

_decided: str | None | bool = False  # kernels_unavailable_reason, once per process (False: not decided yet)


def kernels_unavailable_reason() -> str | None:
    """Why the intranode kernels cannot run in this process (one line), or None when they can: the JIT kernels
    run (`ep_moe.native.jit.unavailable_reason`) and, where no CUDA compiler is found, the disk cache holds the
    intranode kernels and the generic expert-major ops for this GPU's architecture (``ep-moe jit warmup``).
    Decided once per process."""
    global _decided
    if _decided is False:
        _decided = _decide_kernels()
    return _decided


def _decide_kernels() -> str | None:
    from . import jit

    why = jit.unavailable_reason()
    if why is not None:
        return why
    compiler, how = jit.compiler()
    if compiler is not None:
        return None
    from .jit import expert_major_exchange, intranode

    arch = jit.device_arch(torch.cuda.current_device())
    missing = [s.label for s in intranode.specializations() + expert_major_exchange.specializations()
               if not jit.in_cache(s, arch)]
    if not missing:
        return None
    return (f"no CUDA compiler ({how}) and the cache {jit.process_cache().directory} lacks {', '.join(missing)} "
            f"for {arch}; run `ep-moe jit warmup --arch {arch}` where a compiler is")


def kernels_available() -> bool:
    """True when the intranode kernels can run in this process (`kernels_unavailable_reason`)."""
    return kernels_unavailable_reason() is None


def intranode_kernels():
    """The intranode kernels' module, `ep_moe.native.jit.intranode` (``Env``, ``layout``, ``notify``,
    ``dispatch``, ``combine``, ``barrier`` and the constants of ``kernels/kernels.h``). Raises `RuntimeError` saying
    why when they cannot run here (`kernels_unavailable_reason`)."""
    if _jit_intranode is not None:
        return _jit_intranode
    why = kernels_unavailable_reason()
    if why is not None:
        raise RuntimeError(f"ep_moe.native: no intranode kernels: {why}")
    return _import_jit_intranode()


_jit_intranode = None  # ep_moe.native.jit.intranode once imported: no import statement per call (every operation)


def _import_jit_intranode():
    global _jit_intranode
    from .jit import intranode

    _jit_intranode = intranode
    return intranode


def unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why the native backend cannot serve ``group`` on ``device``, or None when it can.

    Collective where the kernels can run here (`kernels_unavailable_reason`): every rank of ``group`` must call it
    (it gathers each rank's ``EP_MOE_SYMMETRIC_MEMORY``, host, device and what it can map). Raises `ValueError` on every rank when the ranks name different symmetric memory providers
    (`symmetric.agreed_symmetric_memory_provider`). With the ``torch`` provider every rank needs a GPU of its own;
    with ``vmm`` ranks may share one. Ranks on distinct GPUs need peer access to each other.
    """
    why = kernels_unavailable_reason()
    if why is not None:
        return why
    provider = agreed_symmetric_memory_provider(group)
    if device.type != "cuda":
        return f"the group runs on {device.type}, not CUDA"
    num_ranks = dist.get_world_size(group)
    if num_ranks > MAX_RANKS:
        return f"the group has {num_ranks} ranks (native kernels serve at most {MAX_RANKS})"
    memory_reason = None
    if provider == "torch":
        try:  # (an import statement here would make `torch` a local name of this function)
            importlib.import_module("torch.distributed._symmetric_memory")
        except ImportError as exc:
            memory_reason = f"torch.distributed._symmetric_memory is unavailable ({exc})"
    else:
        reason = vmm_unavailable_reason(device, exportable=True, host=False)
        if reason is not None:
            memory_reason = f"{SYMMETRIC_MEMORY_ENV}=vmm, but the CUDA VMM calls cannot serve it: {reason}"
    here = (socket.gethostname(), torch.cuda.current_device(), memory_reason)
    everyone: list = [None] * num_ranks
    dist.all_gather_object(everyone, here, group=group)  # every rank decides from the same facts
    failed = [f"rank {r}: {why}" for r, (_, _, why) in enumerate(everyone) if why is not None]
    if failed:
        return "; ".join(failed)
    if len({host for host, *_ in everyone}) != 1:
        return "the group spans several hosts (native kernels are intranode only)"
    devices = [dev for _, dev, _ in everyone]
    if provider == "torch" and len(set(devices)) != num_ranks:
        shared = next(dev for dev in devices if devices.count(dev) > 1)
        ranks = [r for r, dev in enumerate(devices) if dev == shared]
        return (f"ranks {', '.join(map(str, ranks))} share GPU {shared}, which torch symmetric memory cannot serve "
                f"(set {SYMMETRIC_MEMORY_ENV}=vmm on every rank)")
    for dev in set(devices):
        if dev != here[1] and not torch.cuda.can_device_access_peer(here[1], dev):
            return f"GPU {here[1]} cannot access GPU {dev} as a peer (no NVLink/P2P)"
    return None


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout kernel: same outputs as `ep_moe.buffer.routing_layout.dispatch_layout` (``[R]`` int32 tokens per
    rank, ``[E]`` int32 tokens per expert, ``[T, R]`` bool), on the current CUDA stream."""
    per_rank, per_expert, in_rank = intranode_kernels().layout(topk_idx.contiguous(), num_experts, num_ranks)
    return per_rank, per_expert, in_rank


__all__ = ["MAX_RANKS", "SYMMETRIC_MEMORY_ENV", "agreed_symmetric_memory_provider", "buffer_size_hint",
           "dispatch_layout", "intranode_kernels", "kernels_available", "kernels_unavailable_reason",
           "symmetric_memory_provider", "unavailable_reason"]
