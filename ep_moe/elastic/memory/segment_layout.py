"""The symmetric memory types of `ep_moe.ElasticBuffer` and the byte layout of each (DeepEP V2's model).

Three types, chosen from the buffer's arguments by `choose_memory_type`:

* ``"gpu"`` (``num_cpu_bytes == 0``): the GPU memory `ep_moe.Buffer` already has; nothing is added here;
* ``"elastic"`` (``num_cpu_bytes > 0``, not hybrid): one contiguous virtual range, this rank's GPU bytes first, then
  its host bytes;
* ``"hybrid"`` (``num_cpu_bytes > 0``, ``allow_hybrid_mode`` and more than one rank on this node): the GPU segment,
  then one host segment per rank of the node, in group-rank order, each created by its rank and shared by file
  descriptor.

Every segment starts and ends on a 2 MiB boundary (`ALIGNMENT_BYTES`), so offsets are the same on every rank and
any dtype's rows can be viewed in place.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGNMENT_BYTES = 2 << 20
"""Every segment's offset and size is a multiple of this (2 MiB), as in DeepEP V2."""

MEMORY_TYPES = ("gpu", "elastic", "hybrid")


def align_up(num_bytes: int, alignment: int = ALIGNMENT_BYTES) -> int:
    """The smallest multiple of ``alignment`` that is >= ``num_bytes``."""
    return -(-num_bytes // alignment) * alignment


def choose_memory_type(num_cpu_bytes: int, allow_hybrid_mode: bool, num_local_ranks: int) -> str:
    """The memory type of a buffer: ``"gpu"`` without CPU bytes; ``"hybrid"`` when hybrid mode is allowed and the
    node has more than one rank of the group (only then is there a peer to share host segments with); else
    ``"elastic"``."""
    if num_cpu_bytes == 0:
        return "gpu"
    if allow_hybrid_mode and num_local_ranks > 1:
        return "hybrid"
    return "elastic"


@dataclass(frozen=True)
class Segment:
    """``size`` bytes at ``offset`` of the range. ``kind``: ``"gpu"`` or ``"host"``; ``owner``: the group rank that
    created the memory (a host segment of another rank is imported from it)."""

    kind: str
    owner: int
    offset: int
    size: int


@dataclass(frozen=True)
class MemoryLayout:
    """The segments of one rank's range, in address order (GPU first). ``local_ranks``: the group ranks of this
    node in order (hybrid: one host segment each; elastic: this rank only)."""

    memory_type: str
    rank: int
    local_ranks: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def gpu_segment(self) -> Segment:
        return self.segments[0]

    def host_segment(self, rank: int) -> Segment | None:
        """The host segment created by group rank ``rank``, or None when it is not mapped in this range."""
        for segment in self.segments[1:]:
            if segment.owner == rank:
                return segment
        return None


def memory_layout(memory_type: str, rank: int, local_ranks: list[int] | tuple[int, ...], num_bytes: int,
                  num_cpu_bytes: int) -> MemoryLayout:
    """The layout of ``rank``'s range for an elastic or hybrid memory (``num_bytes`` GPU bytes, ``num_cpu_bytes``
    host bytes per rank, each rounded up to 2 MiB). Raises ValueError for the GPU type (it has no range here) or a
    ``rank`` missing from ``local_ranks``."""
    if memory_type not in ("elastic", "hybrid"):
        raise ValueError(f"ep_moe.elastic.memory: memory_layout is for the elastic and hybrid types, got {memory_type!r}")
    local = tuple(sorted(local_ranks))
    if rank not in local:
        raise ValueError(f"ep_moe.elastic.memory: rank {rank} is not among the node's ranks {local}")
    gpu_size, host_size = align_up(num_bytes), align_up(num_cpu_bytes)
    owners = local if memory_type == "hybrid" else (rank,)
    segments = [Segment("gpu", rank, 0, gpu_size)]
    offset = gpu_size
    for owner in owners:
        segments.append(Segment("host", owner, offset, host_size))
        offset += host_size
    return MemoryLayout(memory_type, rank, local if memory_type == "hybrid" else (rank,), tuple(segments))


__all__ = ["ALIGNMENT_BYTES", "MEMORY_TYPES", "MemoryLayout", "Segment", "align_up", "choose_memory_type",
           "memory_layout"]
