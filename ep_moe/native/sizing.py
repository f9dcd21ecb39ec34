"""How many bytes the symmetric buffer of one EP group needs, and how a call lays out its rows in it
(pure arithmetic, no CUDA: every rank computes the same layout from the same sizes)."""

from __future__ import annotations

import functools
from typing import NamedTuple

ALIGNMENT = 2 << 20  # symmetric allocations are made in 2 MiB granules
CONTROL_BYTES = 1 << 20  # counters, signal slots and prefix matrices


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def row_bytes(hidden: int, num_topk: int, elem_size: int, fp8_scales: bool) -> int:
    """Bytes one dispatched row occupies in a receive buffer: data, scales, top-k ids/weights, source."""
    scales = (hidden // 128) * 4 if fp8_scales else 0
    return align_up(hidden * elem_size + scales + num_topk * (8 + 4) + 8, 16)


def buffer_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int,
                     elem_size: int = 2, fp8_scales: bool = False) -> int:
    """Bytes for a buffer in which one rank can receive every token of every rank (the worst case),
    each row as wide as the wider of a dispatch row and a combine row; rounded up to 2 MiB."""
    dispatch_row = row_bytes(hidden, num_topk, elem_size, fp8_scales)
    combine_row = row_bytes(hidden, num_topk, max(elem_size, 2), False)
    rows = num_ranks * num_max_tokens_per_rank
    return align_up(rows * max(dispatch_row, combine_row) + CONTROL_BYTES)


class DispatchRegions(NamedTuple):
    """Where a dispatch puts its rows in a data buffer: ``rows`` rows fit; byte offsets of each part."""

    rows: int
    x: int
    scales: int
    idx: int
    weights: int
    src: int


class CombineRegions(NamedTuple):
    rows: int
    y: int
    weights: int


@functools.lru_cache(maxsize=256)  # pure in its ints, asked on every call
def dispatch_regions(data_bytes: int, x_bytes: int, scale_bytes: int, num_topk: int) -> DispatchRegions:
    """Regions of a dispatch whose rows carry ``x_bytes`` of data, ``scale_bytes`` of FP8 scales and
    ``num_topk`` local expert ids (int64) and weights (fp32), plus the source token index (int32)."""
    per_row = x_bytes + scale_bytes + 12 * num_topk + 4
    rows = max(0, (data_bytes - 5 * 16) // per_row)
    x = 0
    scales = align_up(x + rows * x_bytes, 16)
    idx = align_up(scales + rows * scale_bytes, 16)
    weights = align_up(idx + rows * 8 * num_topk, 16)
    src = align_up(weights + rows * 4 * num_topk, 16)
    assert src + rows * 4 <= data_bytes
    return DispatchRegions(rows, x, scales, idx, weights, src)


@functools.lru_cache(maxsize=256)  # pure in its ints, asked on every call
def combine_regions(data_bytes: int, y_bytes: int, num_topk: int) -> CombineRegions:
    """Regions of a combine whose rows carry ``y_bytes`` of data and ``num_topk`` fp32 weights."""
    per_row = y_bytes + 4 * num_topk
    rows = max(0, (data_bytes - 2 * 16) // per_row)
    weights = align_up(rows * y_bytes, 16)
    assert weights + rows * 4 * num_topk <= data_bytes
    return CombineRegions(rows, 0, weights)


@functools.lru_cache(maxsize=256)  # pure in its ints, asked on every call
def data_bytes_for(rows: int, hidden: int, elem_size: int, num_scales: int, num_topk: int) -> int:
    """Data-buffer bytes (2 MiB aligned) for ``rows`` rows both of a dispatch of this shape and of the
    combine that follows it (whose rows are at least bf16: FP8 dispatches come back in bf16)."""
    dispatch = rows * (hidden * elem_size + 4 * num_scales + 12 * num_topk + 4) + 5 * 16
    combine = rows * (hidden * max(elem_size, 2) + 4 * num_topk) + 2 * 16
    return align_up(max(dispatch, combine, 1))
