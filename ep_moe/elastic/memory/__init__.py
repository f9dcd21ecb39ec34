"""ep_moe's symmetric memory model for `ep_moe.ElasticBuffer` (DeepEP V2's three memory types).

* `layout`: the types, their choice (`choose_memory_type`) and byte layouts, 2 MiB alignment;
* `fdshare`: ``(pid, fd)`` exchange over the group and ``pidfd_getfd`` imports between the ranks of a node;
* `host`: the CPU mapping (a reserved range, anonymous or ``memfd`` segments mapped at fixed offsets);
* `cuda_vmm`: the GPU mapping with the CUDA driver's VMM calls (device and host-NUMA allocations, fd export);
* `symmetric`: `SymmetricMemory`, one rank's mapped range, allocated collectively.

The GPU type is `ep_moe.Buffer`'s own memory and has no range here.
"""

from __future__ import annotations

import torch.distributed as dist

from .fdshare import PeerFdError, ranks_by_node
from .segment_layout import (
    ALIGNMENT_BYTES,
    MEMORY_TYPES,
    MemoryLayout,
    Segment,
    align_up,
    choose_memory_type,
    memory_layout,
)
from .symmetric_memory import SymmetricMemory


def memory_type_of_group(group: dist.ProcessGroup, num_cpu_bytes: int, allow_hybrid_mode: bool) -> str:
    """The memory type of a buffer on ``group`` (`choose_memory_type` with the largest number of the group's ranks
    on one node, so every rank chooses alike). Collective over ``group`` when ``num_cpu_bytes > 0``, else local."""
    if num_cpu_bytes == 0:
        return "gpu"
    return choose_memory_type(num_cpu_bytes, allow_hybrid_mode, max(len(n) for n in ranks_by_node(group)))


__all__ = ["ALIGNMENT_BYTES", "MEMORY_TYPES", "MemoryLayout", "PeerFdError", "Segment", "SymmetricMemory",
           "align_up", "choose_memory_type", "memory_layout", "memory_type_of_group"]
