"""How the native kernels cut the rows of one source-destination pair into chunks (flag-published units),
mirrored from ``csrc/common.cuh`` (``chunk_rows``, ``num_chunks``) for the host and the planner.

More chunks start the receiver sooner, fewer cost fewer handshakes. Measured on 2 x H200 at DeepEP's
workload (ep_moe/native/NOTES.md): dispatch is fastest at 48-96 chunks per pair, combine at 128 (its
reducers wait for chunks in token order). A chunk holds at least `DEFAULT_MIN_CHUNK_ROWS` rows: one per
warp of a block, so that small batches (128 tokens/rank) keep every warp of a pusher block busy (4 rows
per chunk: dispatch 47 -> 26 us kernel time on 2 x H200). The variables override the defaults; they must
be equal on every rank.
"""

from __future__ import annotations

import math
import os

CHUNKS_ENV = {"dispatch": "EP_MOE_NATIVE_DISPATCH_CHUNKS", "combine": "EP_MOE_NATIVE_COMBINE_CHUNKS"}
DEFAULT_CHUNKS_PER_PAIR = {"dispatch": 64, "combine": 128}
MIN_CHUNK_ROWS_ENV = "EP_MOE_NATIVE_MIN_CHUNK_ROWS"
DEFAULT_MIN_CHUNK_ROWS = 16


def positive_int_from_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit() or int(value) < 1:  # the extension checks upper bounds
        raise ValueError(f"ep_moe native backend: {name} must be a positive integer, got {value!r}")
    return int(value)


def choice_from_env(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The variable's value (stripped, lower case) if it is one of ``choices``, else ``default`` when unset."""
    value = os.environ.get(name, default).strip().lower()
    if value not in choices:
        allowed = ", ".join(choices[:-1]) + " or " + choices[-1]
        raise ValueError(f"ep_moe native backend: {name} must be {allowed}, got {value!r}")
    return value


def chunks_per_pair(op: str) -> int:
    """Most chunks per source-destination pair for ``op`` ("dispatch" or "combine")."""
    return positive_int_from_env(CHUNKS_ENV[op], DEFAULT_CHUNKS_PER_PAIR[op])


def min_chunk_rows() -> int:
    """Rows a chunk holds at least (unless the pair has fewer)."""
    return positive_int_from_env(MIN_CHUNK_ROWS_ENV, DEFAULT_MIN_CHUNK_ROWS)


def num_chunks(rows: float, op: str) -> int:
    """Chunks the kernels cut ``rows`` rows of one pair into for ``op`` (0 for no rows); a fractional
    (expected) count is rounded to the nearest row."""
    count = round(rows)
    if count <= 0:
        return 0
    per_chunk = max(math.ceil(count / chunks_per_pair(op)), min_chunk_rows())
    return math.ceil(count / per_chunk)
