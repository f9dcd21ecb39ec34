"""When native calls move their rows through the copy engine instead of pusher blocks.

Combine: a combine's rows for one source are contiguous on both sides, so each chunk is one
device-to-device copy into the source's symmetric buffer (``csrc/copy_engine.cu``), queued on a side
stream; then no SM pushes and every block of the combine kernel reduces.

Dispatch: where nearly every token goes to every peer (top-8 of 256 experts on 2 ranks: 99.6 %), each
rank's whole ``x`` (and scales) goes by the copy engine into its slot of every peer's buffer, token by
token in order, and the receiver's blocks, all of them local, copy the rows they receive out of it: a
cached dispatch finds each row's token in the handle's ``recv_src_idx``, a fresh one in the sender's send
list, which the copy stream sends first together with the whole top-k (converted to local experts by the
receiver). The link carries the unrouted tokens too, hence the density condition. ``auto`` takes it for
cached dispatches only (see `wanted_for_dispatch`); 2 x H200, 4096 tokens, 24 SMs (eighth session): cached
dispatch 223.9 -> 210.3 us, FP8 149.6 -> 141.6, at 16 SMs 309.3 -> 215.6; with the flag stream (ninth) 198.4,
FP8 126.2, at 16 SMs 199.5.

The chunks can be spread over side streams, round robin (``EP_MOE_NATIVE_<OP>_COPY_ENGINE_STREAMS``), and
their flag writes moved to a stream of their own (``EP_MOE_NATIVE_<OP>_COPY_ENGINE_FLAG_STREAM``, 1 or 0):
each chunk's flags then wait for an event behind its copies, and the copy stream goes on with the next chunk
at once instead of waiting for the flag write's fence to drain the copy. Defaults: the dispatch one copy
stream and a flag stream, the combine one copy stream with its flags inline (measured below).

Either needs the layout's counts on the host (a handle of an exact-size dispatch; not
``num_worst_tokens``) and no CUDA-graph capture (the copies' flag values are host sequence numbers,
which a replay would repeat).

Measured on 2 x H200 (ep_moe/native/NOTES.md, seventh session): one 58.7 MB copy into the peer takes
160 us, each extra chunk with its flag write ~5 us, while the SM pushers of a 24-SM combine took ~220 us.
Small calls keep the pushers: below ~17 MB per pair the copy stream's fixed costs (the go handshake,
a few us per chunk) outweigh the SMs it frees.

``EP_MOE_NATIVE_<OP>_COPY_ENGINE`` (``OP`` = ``DISPATCH`` or ``COMBINE``): ``auto`` (default), ``1``
(whenever the host knows the layout) or ``0`` (never); ``EP_MOE_NATIVE_<OP>_COPY_ENGINE_SHARES``: how the
rows are cut into chunks, as relative sizes (every chunk costs the copy stream a few us, and the
receiver's tail after the last copy is that chunk's work, so the last chunks are small). Every rank must
use the same values: every rank decides from them and the shared counts alone.
"""

from __future__ import annotations

import os

from .chunking import choice_from_env, positive_int_from_env

OPS = ("dispatch", "combine")
MODE_ENV = {op: f"EP_MOE_NATIVE_{op.upper()}_COPY_ENGINE" for op in OPS}
SHARES_ENV = {op: f"EP_MOE_NATIVE_{op.upper()}_COPY_ENGINE_SHARES" for op in OPS}
DEFAULT_SHARES = {"dispatch": (6, 5, 4, 3, 2, 1), "combine": (2, 5, 6, 5, 3, 2, 1)}
# FP8 rows (x and its scales: two copies per chunk, half the bytes) take fewer chunks. 2 x H200, 4096 tokens,
# 24 SMs, cached dispatch on two streams (eighth session, one profile each, call us): 6,5,4,3,2,1 143.2,
# 4,3,2,1 136.0, 3,2,1 132.7; ninth session, one stream and a flag stream: 6,5,4,3,2,1 142.2, 3,2,1 126.0.
DEFAULT_FP8_DISPATCH_SHARES = (3, 2, 1)
MAX_CHUNKS = 16  # kMaxCopyEngineChunks
STREAMS_ENV = {op: f"EP_MOE_NATIVE_{op.upper()}_COPY_ENGINE_STREAMS" for op in OPS}
# 2 x H200, 24 SMs, 4096 tokens (eighth session): two streams let one chunk's copy run while another's
# flag write waits for its copy to drain (cached dispatch 224.1 -> 212.2 us, FP8 160.8 -> 145.6), but they
# move the first two chunks at once, so the first lands later (combine, whose reducers wait for it, 250.7 ->
# 279.0). A flag stream does the same for the dispatch without moving two chunks at once (ninth session,
# bench: cached dispatch 210.3 -> 198.4 us, FP8 141.6 -> 126.2), but the combine's reducers lose by it (one
# profile, call us: 240.5 -> 253.7 at 24 SMs; 228.2 -> 225.7 at 32).
DEFAULT_STREAMS = {"dispatch": 1, "combine": 1}
FLAG_STREAM_ENV = {op: f"EP_MOE_NATIVE_{op.upper()}_COPY_ENGINE_FLAG_STREAM" for op in OPS}
DEFAULT_FLAG_STREAM = {"dispatch": True, "combine": False}
MAX_STREAMS = 4  # kMaxCopyStreams
# auto: the largest pair must move at least this much. 2 x H200, hidden 7168 BF16, 24 SMs (combine call us,
# pushers / copy engine): 512 tokens (7.3 MB per pair) 64.4 / 88.0, 2048 (29 MB) 175.5 / 146.1, 4096
# (58.7 MB) 261.5 / 242.3; the lines cross near 17 MB.
AUTO_MIN_PAIR_BYTES = 16 << 20
AUTO_MAX_RANKS = 2  # measured only on 2 GPUs: one copy stream serves all peers in turn
# auto, dispatch: every peer must receive at least this share of every source's tokens (the rest crosses
# the link for nothing).
AUTO_MIN_DISPATCH_DENSITY = 0.9


def mode(op: str) -> str:
    """``auto``, ``1`` or ``0`` for ``op`` ("dispatch" or "combine")."""
    return choice_from_env(MODE_ENV[op], "auto", ("auto", "0", "1"))


def shares(op: str, fp8: bool = False) -> list[int]:
    """Relative chunk sizes for ``op`` (1 to 16 integers in [1, 1024]); ``fp8``: a dispatch of FP8 rows
    (its own default; the variable sets both)."""
    name = SHARES_ENV[op]
    value = os.environ.get(name)
    if value is None:
        return list(DEFAULT_FP8_DISPATCH_SHARES if fp8 and op == "dispatch" else DEFAULT_SHARES[op])
    parts = [p.strip() for p in value.split(",")]
    if not 1 <= len(parts) <= MAX_CHUNKS or not all(p.isdigit() and 1 <= int(p) <= 1024 for p in parts):
        raise ValueError(f"ep_moe native backend: {name} must be 1 to {MAX_CHUNKS} comma-separated integers "
                         f"in [1, 1024], got {value!r}")
    return [int(p) for p in parts]


def num_streams(op: str) -> int:
    """Side streams a copy-engine ``op`` spreads its chunks over, round robin (1 to 4)."""
    name = STREAMS_ENV[op]
    value = positive_int_from_env(name, DEFAULT_STREAMS[op])
    if value > MAX_STREAMS:
        raise ValueError(f"ep_moe native backend: {name} must be an integer in [1, {MAX_STREAMS}], got {value}")
    return value


def flag_stream(op: str) -> bool:
    """Whether a copy-engine ``op`` writes its flags on a stream of their own (default: dispatch yes,
    combine no)."""
    return choice_from_env(FLAG_STREAM_ENV[op], "1" if DEFAULT_FLAG_STREAM[op] else "0", ("0", "1")) == "1"


def prefix_matrix(counts: list[list[int]]) -> list[int]:
    """The ``[R, R]`` rank prefix matrix (rows ranks 0..s send rank r), flattened, from the count matrix."""
    num_ranks = len(counts)
    prefix, running = [], [0] * num_ranks
    for s in range(num_ranks):
        running = [running[r] + counts[s][r] for r in range(num_ranks)]
        prefix.extend(running)
    return prefix


def _largest_pair(counts: list[list[int]]) -> int:
    num_ranks = len(counts)
    return max((counts[s][r] for s in range(num_ranks) for r in range(num_ranks) if s != r), default=0)


def _forced(op: str, num_ranks: int) -> bool | None:
    """The answer the mode gives alone (``0``: no, ``1``: yes, one rank: no), or None under ``auto``."""
    choice = mode(op)
    if choice == "0" or num_ranks < 2:
        return False
    return True if choice == "1" else None


def wanted(counts: list[list[int]], row_bytes: int) -> bool:
    """Whether a combine of this layout (``[R][R]`` rows sent) goes through the copy engine (the same answer
    on every rank)."""
    num_ranks = len(counts)
    forced = _forced("combine", num_ranks)
    if forced is not None:
        return forced
    return num_ranks <= AUTO_MAX_RANKS and _largest_pair(counts) * row_bytes >= AUTO_MIN_PAIR_BYTES


def wanted_for_dispatch(counts: list[list[int]], tokens: list[int], row_bytes: int, cached: bool = True) -> bool:
    """Whether a dispatch of this layout (``[R][R]`` rows sent, ``[R]`` tokens per rank) sends every rank's
    whole ``x`` by the copy engine (the same answer on every rank). ``auto`` takes it for cached dispatches
    only: a fresh one launches right after the host waited for the counts, so the copy stream's host-side
    queuing (~20 calls) delays the kernel (2 x H200, 4096 tokens, 24 SMs: 573 us against 362 with pushers)."""
    num_ranks = len(counts)
    forced = _forced("dispatch", num_ranks)
    if forced is not None:
        return forced
    if not cached:
        return False
    dense = all(counts[s][r] >= AUTO_MIN_DISPATCH_DENSITY * tokens[s]
                for s in range(num_ranks) for r in range(num_ranks) if s != r)
    return num_ranks <= AUTO_MAX_RANKS and dense and max(tokens) * row_bytes >= AUTO_MIN_PAIR_BYTES
