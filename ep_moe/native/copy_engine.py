"""When a native combine sends its rows back through the copy engine instead of pusher blocks.

A combine's rows for one source are contiguous on both sides, so each chunk is one device-to-device copy
into the source's symmetric buffer (``csrc/copy_engine.cu``), queued on a side stream; then no SM
pushes and every block of the combine kernel reduces. The host must know the layout's row counts
(an exact-size dispatch's handle; not ``num_worst_tokens``) and must not be capturing a CUDA graph
(the copies' flag values are host sequence numbers, which a replay would repeat).

Measured on 2 x H200 (ep_moe/native/NOTES.md, seventh session): one 58.7 MB copy into the peer takes
160 us, each extra chunk with its flag write ~5 us, while the SM pushers of a 24-SM combine took ~220 us.
Small combines keep the pushers: below ~17 MB per pair the copy stream's fixed costs (the go handshake,
a few us per chunk) outweigh the SMs it frees.

``EP_MOE_NATIVE_COMBINE_COPY_ENGINE``: ``auto`` (default), ``1`` (whenever the host knows the layout) or
``0`` (never); ``EP_MOE_NATIVE_COPY_ENGINE_SHARES``: how a pair's rows are cut into chunks, as relative
sizes (default ``2,5,6,5,3,2,1``: every chunk costs the copy stream a few us, and the reducers' tail
after the last copy is that chunk's work, so the chunks are big in the middle and small at the end).
Both must be equal on every rank: every rank decides from them and the shared count matrix alone.
"""

from __future__ import annotations

import os

MODE_ENV = "EP_MOE_NATIVE_COMBINE_COPY_ENGINE"
SHARES_ENV = "EP_MOE_NATIVE_COPY_ENGINE_SHARES"
DEFAULT_SHARES = (2, 5, 6, 5, 3, 2, 1)
MAX_CHUNKS = 16  # kMaxCopyEngineChunks
# auto: the largest pair must move at least this much. 2 x H200, hidden 7168 BF16, 24 SMs (combine call us,
# pushers / copy engine): 512 tokens (7.3 MB per pair) 64.4 / 88.0, 2048 (29 MB) 175.5 / 146.1, 4096
# (58.7 MB) 261.5 / 242.3; the lines cross near 17 MB.
AUTO_MIN_PAIR_BYTES = 16 << 20
AUTO_MAX_RANKS = 2  # measured only on 2 GPUs: one copy stream serves all peers in turn


def mode() -> str:
    value = os.environ.get(MODE_ENV, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"ep_moe native backend: {MODE_ENV} must be auto, 0 or 1, got {value!r}")
    return value


def shares() -> list[int]:
    """Relative chunk sizes of a pair's rows (1 to 16 integers in [1, 1024])."""
    value = os.environ.get(SHARES_ENV)
    if value is None:
        return list(DEFAULT_SHARES)
    parts = [p.strip() for p in value.split(",")]
    if not 1 <= len(parts) <= MAX_CHUNKS or not all(p.isdigit() and 1 <= int(p) <= 1024 for p in parts):
        raise ValueError(f"ep_moe native backend: {SHARES_ENV} must be 1 to {MAX_CHUNKS} comma-separated integers "
                         f"in [1, 1024], got {value!r}")
    return [int(p) for p in parts]


def prefix_matrix(counts: list[list[int]]) -> list[int]:
    """The ``[R, R]`` rank prefix matrix (rows ranks 0..s send rank r), flattened, from the count matrix."""
    num_ranks = len(counts)
    prefix, running = [], [0] * num_ranks
    for s in range(num_ranks):
        running = [running[r] + counts[s][r] for r in range(num_ranks)]
        prefix.extend(running)
    return prefix


def wanted(counts: list[list[int]], row_bytes: int) -> bool:
    """Whether a combine of this layout (``[R][R]`` rows sent) goes through the copy engine (the same answer
    on every rank)."""
    choice = mode()
    num_ranks = len(counts)
    if choice == "0" or num_ranks < 2:
        return False
    if choice == "1":
        return True
    largest = max(counts[s][r] for s in range(num_ranks) for r in range(num_ranks) if s != r)
    return num_ranks <= AUTO_MAX_RANKS and largest * row_bytes >= AUTO_MIN_PAIR_BYTES
