"""How many bytes the symmetric buffer of one EP group needs (pure arithmetic, no CUDA)."""

from __future__ import annotations

ALIGNMENT = 2 << 20  # symmetric allocations are made in 2 MiB granules
CONTROL_BYTES = 1 << 20  # counters, signal slots and prefix matrices


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def row_bytes(hidden: int, num_topk: int, elem_size: int, fp8_scales: bool) -> int:
    """Bytes one dispatched row occupies in a receive buffer: data, scales, top-k ids/weights, source."""
    scales = (hidden // 128) * 4 if fp8_scales else 0
    raw = hidden * elem_size + scales + num_topk * (8 + 4) + 8
    return (raw + 15) // 16 * 16


def buffer_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int,
                     elem_size: int = 2, fp8_scales: bool = False) -> int:
    """Bytes for a buffer in which one rank can receive every token of every rank (the worst case),
    each row as wide as the wider of a dispatch row and a combine row; rounded up to 2 MiB."""
    dispatch_row = row_bytes(hidden, num_topk, elem_size, fp8_scales)
    combine_row = row_bytes(hidden, num_topk, max(elem_size, 2), False)
    rows = num_ranks * num_max_tokens_per_rank
    return align_up(rows * max(dispatch_row, combine_row) + CONTROL_BYTES)
