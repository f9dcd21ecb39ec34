"""The host-side rules of the native kernels, from a `NativeOptions` and what every rank knows alike.

* Chunking (mirrored from ``kernels/common.cuh``: ``chunk_rows``, ``num_chunks``): the rows of one
  source-destination pair are cut into at most ``<op>_chunks`` flag-published chunks of at least
  ``min_chunk_rows`` rows each (`num_chunks`); the planner counts the pushers' rounds with the same rule.
* Copy engine: a combine's rows for one source are contiguous on both sides, so each chunk can be one
  device-to-device copy into the source's symmetric buffer, queued on side streams, while every block of
  the kernel reduces (`wanted`). A dispatch can likewise send each rank's whole ``x`` (and scales) into
  its slot of every peer's buffer, the receivers' blocks copying out the rows they receive (a cached
  dispatch finds each row's token in the handle's ``recv_src_idx``, a fresh one in the sender's send list,
  which the copy stream sends first with the whole top-k); the link then carries the unrouted tokens too,
  hence the density rule of `wanted_for_dispatch`. Either needs the layout's counts on the host (an
  exact-size dispatch, not ``num_worst_tokens``) and no CUDA-graph capture (the copies' flag values are
  host sequence numbers, which a replay would repeat); the caller checks both. The chunks are cut by
  relative sizes (`copy_engine_shares`), spread over side streams round robin (`copy_engine_streams`),
  and their flag writes may go on a stream of their own (`copy_engine_flag_stream`): each chunk's flags
  then wait for an event behind its copies, and the copy stream goes on at once.
* Reducers (`bulk_reduce`): the combine's reducer warps either load rows into registers or have lane 0
  copy pieces of them into shared memory with ``cp.async.bulk``; the sums are equal bit for bit.

Every rank must decide alike, so every function here depends only on its arguments, and the options
must be equal on every rank (`check_same_on_every_rank`).
"""

from __future__ import annotations

import math
from dataclasses import fields

import torch.distributed as dist

from ..config import NativeOptions
from .symmetric import values_with_ranks

OPS = ("dispatch", "combine")

# Under "auto" (copy engine):
AUTO_MIN_PAIR_BYTES = 16 << 20  # below this per pair the copy stream's fixed costs outweigh the SMs it frees
AUTO_MAX_RANKS = 2  # one copy stream serves all peers in turn; measured faster on 2 ranks only
AUTO_MIN_DISPATCH_DENSITY = 0.9  # share of every source's tokens each peer must receive (the rest is waste)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"ep_moe.native.policy: argument 'op' must be 'dispatch' or 'combine', got {op!r}")


# ------------------------------------------------------------------------------------------ chunking
def chunks_per_pair(options: NativeOptions, op: str) -> int:
    """Most chunks per source-destination pair for ``op`` ("dispatch" or "combine")."""
    _check_op(op)
    return options.dispatch_chunks if op == "dispatch" else options.combine_chunks


def num_chunks(options: NativeOptions, op: str, rows: float) -> int:
    """Chunks the kernels cut ``rows`` rows of one pair into for ``op`` (0 for no rows); a fractional
    (expected) count is rounded to the nearest row."""
    count = round(rows)
    if count <= 0:
        return 0
    per_chunk = max(math.ceil(count / chunks_per_pair(options, op)), options.min_chunk_rows)
    return math.ceil(count / per_chunk)


def push_fraction(options: NativeOptions, op: str) -> float:
    """The share of a call's SMs that push rows over NVLink in ``op``."""
    _check_op(op)
    return options.dispatch_push_fraction if op == "dispatch" else options.combine_push_fraction


# ------------------------------------------------------------------------------------------ copy engine
def copy_engine_shares(options: NativeOptions, op: str, fp8: bool = False) -> list[int]:
    """Relative chunk sizes of a copy-engine ``op``; ``fp8``: a dispatch of FP8 rows (its own shares)."""
    _check_op(op)
    if op == "combine":
        return list(options.combine_copy_engine_shares)
    return list(options.dispatch_copy_engine_fp8_shares if fp8 else options.dispatch_copy_engine_shares)


def copy_engine_streams(options: NativeOptions, op: str) -> int:
    """Side streams a copy-engine ``op`` spreads its chunks over, round robin."""
    _check_op(op)
    return options.dispatch_copy_engine_streams if op == "dispatch" else options.combine_copy_engine_streams


def copy_engine_flag_stream(options: NativeOptions, op: str) -> bool:
    """Whether a copy-engine ``op`` writes its chunks' flags on a stream of their own."""
    _check_op(op)
    if op == "dispatch":
        return options.dispatch_copy_engine_flag_stream
    return options.combine_copy_engine_flag_stream


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


def _forced(options: NativeOptions, op: str, num_ranks: int) -> bool | None:
    """The answer the mode gives alone ("off" or one rank: no; "on": yes), or None under "auto"."""
    mode = options.dispatch_copy_engine if op == "dispatch" else options.combine_copy_engine
    if mode == "off" or num_ranks < 2:
        return False
    return True if mode == "on" else None


def wanted(options: NativeOptions, counts: list[list[int]], row_bytes: int) -> bool:
    """Whether a combine of this layout (``[R][R]`` rows sent, rows of ``row_bytes``) returns its rows by the
    copy engine. "auto": on at most `AUTO_MAX_RANKS` ranks when the largest pair moves at least
    `AUTO_MIN_PAIR_BYTES`."""
    num_ranks = len(counts)
    forced = _forced(options, "combine", num_ranks)
    if forced is not None:
        return forced
    return num_ranks <= AUTO_MAX_RANKS and _largest_pair(counts) * row_bytes >= AUTO_MIN_PAIR_BYTES


def wanted_for_dispatch(options: NativeOptions, counts: list[list[int]], tokens: list[int], row_bytes: int,
                        cached: bool = True) -> bool:
    """Whether a dispatch of this layout (``[R][R]`` rows sent, ``[R]`` tokens per rank, rows of
    ``row_bytes``) sends every rank's whole ``x`` by the copy engine. "auto": cached dispatches only (a
    fresh one launches right after the host waited for the counts, and queuing the copies would delay its
    kernel), on at most `AUTO_MAX_RANKS` ranks, when every peer receives at least
    `AUTO_MIN_DISPATCH_DENSITY` of every source's tokens and the largest ``x`` is at least
    `AUTO_MIN_PAIR_BYTES`."""
    num_ranks = len(counts)
    forced = _forced(options, "dispatch", num_ranks)
    if forced is not None:
        return forced
    if not cached:
        return False
    dense = all(counts[s][r] >= AUTO_MIN_DISPATCH_DENSITY * tokens[s]
                for s in range(num_ranks) for r in range(num_ranks) if s != r)
    return num_ranks <= AUTO_MAX_RANKS and dense and max(tokens) * row_bytes >= AUTO_MIN_PAIR_BYTES


# ------------------------------------------------------------------------------------------ reducers
def bulk_reduce(options: NativeOptions, copy_engine: bool) -> bool:
    """Whether a combine's reducers load rows by bulk copies; ``copy_engine``: the copy engine carries its
    rows (then no block pushes and every block reduces, which is where "auto" takes bulk copies)."""
    mode = options.combine_bulk_reduce
    return copy_engine if mode == "auto" else mode == "on"


# ------------------------------------------------------------------------------------------ every rank alike
def check_same_on_every_rank(options: NativeOptions, group: dist.ProcessGroup | None = None) -> None:
    """Raise `ValueError` unless every rank of ``group`` (default: the world) holds equal ``options``,
    naming the first field that differs and each value with its ranks. Collective: every rank of the
    group must call it (one ``all_gather_object``)."""
    everyone: list[NativeOptions | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, options, group=group)
    for field in fields(NativeOptions):
        values = [getattr(theirs, field.name) for theirs in everyone]
        if len(set(values)) > 1:
            raise ValueError(f"ep_moe.NativeOptions: field '{field.name}' must be equal on every rank of the "
                             f"group, got {values_with_ranks(values)}")
