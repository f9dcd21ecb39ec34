"""How the combine's reducer warps read the rows they sum (``csrc/intranode.cu``).

Register reducers load four 16-byte words per lane and source, add them and load the next ones: a warp
has a few KB in flight. Bulk reducers have lane 0 copy pieces of the rows (~3 KB per source at 2 ranks)
into shared memory with ``cp.async.bulk`` while the warp sums the piece before: two pieces of every
source per warp in flight, ~190 KB per SM. The reduction is the same (fp32, rank order, one rounding), so
the results are equal bit for bit.

Measured on 2 x H200 at DeepEP's workload (4096 tokens, hidden 7168; ep_moe/native/NOTES.md, ninth session):
the register reducers of a copy-engine combine move ~45 GB/s per SM and fall behind the copies below 32 SMs
(call 300.7 / 244.9 / 223.9 us at 16 / 24 / 32 SMs); bulk ones 253.5 / 226.7 / 226.5. Beside pusher blocks
they lose (24 SMs: 266.5 -> 285.7 us), hence ``auto``.

``EP_MOE_NATIVE_COMBINE_BULK_REDUCE``: ``auto`` (default: when the copy engine carries the combine, so that
every block reduces), ``1`` (always) or ``0`` (never).
"""

from __future__ import annotations

from .chunking import choice_from_env

BULK_REDUCE_ENV = "EP_MOE_NATIVE_COMBINE_BULK_REDUCE"


def bulk_reduce(copy_engine: bool) -> bool:
    """Whether a combine's reducers load rows by bulk copies; ``copy_engine``: the copy engine carries its
    rows (no pusher blocks)."""
    value = choice_from_env(BULK_REDUCE_ENV, "auto", ("auto", "0", "1"))
    return copy_engine if value == "auto" else value == "1"
