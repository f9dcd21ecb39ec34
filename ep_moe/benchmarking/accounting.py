"""Bytes moved by dispatch and combine, and the physical floor they imply (pure arithmetic).

Conventions (those of DeepEP's intranode test and of ``docs/benchmarks.md``):

* **DeepEP-counted bytes** of a rank: every row it receives, its own tokens included, times the
  payload of one row (``recv_x.numel() * element_size``; FP8 adds its scales). Combine is counted
  with the same bytes as the BF16 dispatch it reverses.
* **Link bytes**: only rows that cross to or from *another* rank. A GPU's NVLink ports are shared by
  all its peers, so the floor is set by the busiest rank and direction:
  ``max over ranks of max(bytes sent to peers, bytes received from peers)``, divided by the
  one-way peer bandwidth. Dispatch and combine move the same rows in opposite directions, so they
  have the same floor. Only the hidden states (and FP8 scales) are counted, not the top-k metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FP8_BLOCK = 128  # one fp32 scale per 128 hidden elements
ELEMENT_BYTES = {"bf16": 2, "fp32": 4, "fp8": 1}


def row_payload_bytes(hidden: int, dtype: str) -> int:
    """Bytes of one dispatched row's hidden state: ``hidden * element size``, plus the fp32 scales
    (``hidden / 128 * 4``) for ``dtype == "fp8"``."""
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"row_payload_bytes: argument 'dtype' must be one of {sorted(ELEMENT_BYTES)}, got {dtype!r}")
    if hidden <= 0:
        raise ValueError(f"row_payload_bytes: argument 'hidden' must be positive, got {hidden}")
    scales = (hidden // FP8_BLOCK) * 4 if dtype == "fp8" else 0
    return hidden * ELEMENT_BYTES[dtype] + scales


@dataclass(frozen=True)
class Traffic:
    """Bytes of one dispatch (or of the combine that reverses it) for every rank of the group.

    ``recv_bytes[r]``: DeepEP-counted bytes rank ``r`` receives (own rows included);
    ``sent_to_peers[r]`` / ``received_from_peers[r]``: bytes that cross NVLink out of / into ``r``;
    ``link_bytes``: the busiest rank-direction, which sets the floor.
    """

    recv_bytes: tuple[float, ...]
    sent_to_peers: tuple[float, ...]
    received_from_peers: tuple[float, ...]

    @property
    def mean_recv_bytes(self) -> float:
        return sum(self.recv_bytes) / len(self.recv_bytes)

    @property
    def link_bytes(self) -> float:
        return max(max(o, i) for o, i in zip(self.sent_to_peers, self.received_from_peers))


def traffic(count_matrix: Sequence[Sequence[float]], row_bytes: int) -> Traffic:
    """Bytes moved for a ``[R, R]`` matrix of rows sent ``count_matrix[source][destination]``
    (``num_tokens_per_rank`` of every source; may be an average over input sets, hence floats)."""
    num_ranks = len(count_matrix)
    if num_ranks == 0 or any(len(row) != num_ranks for row in count_matrix):
        raise ValueError(f"traffic: argument 'count_matrix' must be square [R, R], got {count_matrix!r}")
    if any(c < 0 for row in count_matrix for c in row):
        raise ValueError("traffic: argument 'count_matrix' must hold non-negative row counts")
    m = count_matrix
    recv = tuple(sum(m[s][r] for s in range(num_ranks)) * row_bytes for r in range(num_ranks))
    out = tuple(sum(m[r][d] for d in range(num_ranks) if d != r) * row_bytes for r in range(num_ranks))
    into = tuple(sum(m[s][r] for s in range(num_ranks) if s != r) * row_bytes for r in range(num_ranks))
    return Traffic(recv, out, into)


def floor_us(link_bytes: float, link_gbps: float) -> float:
    """Microseconds to move ``link_bytes`` one way at ``link_gbps`` GB/s (1 GB = 1e9 bytes)."""
    if link_gbps <= 0:
        raise ValueError(f"floor_us: argument 'link_gbps' must be positive, got {link_gbps}")
    return link_bytes / (link_gbps * 1e9) * 1e6


def gbps(nbytes: float, time_us: float) -> float:
    """GB/s (1e9 bytes per second) of ``nbytes`` moved in ``time_us`` microseconds."""
    if time_us <= 0:
        raise ValueError(f"gbps: argument 'time_us' must be positive, got {time_us}")
    return nbytes / (time_us * 1e-6) / 1e9


def floor_fraction(floor: float | None, time_us: float | None) -> float | None:
    """``floor / time``: 1.0 would mean the operation ran at the link's speed (None when unknown or
    when nothing crosses the link)."""
    if floor is None or time_us is None or floor <= 0 or time_us <= 0:
        return None
    return floor / time_us
