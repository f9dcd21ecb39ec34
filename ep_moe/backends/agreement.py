"""What every rank of one call must agree on before rows move, and the check that they do.

A collective whose sizes differ between ranks does not fail cleanly: gloo aborts the process ("Received
data size doesn't match", SIGABRT) and NCCL hangs or reads past the end. The sizes of the row exchanges
follow from per-call values (the hidden size, the dtype, top-k, the number of experts, the fixed size, the
handle's layout), so every call of the ``torch`` backend first exchanges a header of `HEADER_LEN` int64
holding them, in an exchange whose size depends on nothing per call (the group size and the backend's
state, equal on every rank). Every rank then has every rank's header and raises the same `ValueError`
naming the fields and the ranks' values (`check_headers`), before any row is sent.

Header, by slot: the operation, the hidden size, the dtype of ``x``, the FP8 scales' width (0: none), top-k
(combine: the width of ``topk_weights``, -1: none), the number of experts (0 where none is given), the
fixed size (``num_worst_tokens``, the handle's for a cached dispatch or a combine) and the layout digest of
the handle (`layout_digest`; 0 for a fresh dispatch).
"""

from __future__ import annotations

import torch

OP_DISPATCH, OP_CACHED_DISPATCH, OP_COMBINE = 1, 2, 3
OP_BARRIER = 4  # the native backend's barrier announces a header too (the torch backend's does not)
OP_NAMES = {OP_DISPATCH: "dispatch", OP_CACHED_DISPATCH: "cached dispatch (handle=)", OP_COMBINE: "combine",
            OP_BARRIER: "barrier"}

HEADER_LEN = 8
_OP, _HIDDEN, _DTYPE, _SCALES, _TOPK, _EXPERTS, _WORST, _LAYOUT = range(HEADER_LEN)

# Stable codes of the dtypes rows may have (0: another dtype, named by its code only).
_DTYPES = tuple(d for d in (torch.bfloat16, torch.float32, torch.float64, getattr(torch, "float8_e4m3fn", None),
                            torch.float16) if d is not None)


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]) if 0 < code <= len(_DTYPES) else f"dtype code {code}"


def _none_below_zero(v: int) -> str:
    return "none" if v < 0 else str(v)


def _none_at_zero(v: int) -> str:
    return "none" if v == 0 else str(v)


def _layout(v: int) -> str:
    return f"layout {v:#010x}"


# (what the field is called in a message, how a value reads) by slot; the operation's own wording for top-k.
_FIELDS = {
    _HIDDEN: ("the hidden size", str),
    _DTYPE: ("the dtype", _dtype_name),
    _SCALES: ("the FP8 scales' width", _none_at_zero),
    _TOPK: ("top-k (topk_idx.shape[1])", str),
    _EXPERTS: ("num_experts", str),
    _WORST: ("num_worst_tokens", str),
    _LAYOUT: ("the handle (the layout of the dispatch that made it)", _layout),
}
_COMBINE_TOPK = ("topk_weights (given, and their width)", _none_below_zero)
_HANDLE_WORST = ("the handle's num_worst_tokens", str)


def header(op: int, hidden: int, dtype: torch.dtype, scales: int = 0, topk: int = 0, experts: int = 0,
           worst: int = 0) -> tuple[int, ...]:
    """The header's first ``HEADER_LEN - 1`` slots (the layout digest, a tensor, is appended by the caller)."""
    return (op, hidden, dtype_code(dtype), scales, topk, experts, worst)


def _ranks_with(values: list[int], show, labels: list[str] | None = None) -> str:
    """``rank 0 has 4096, rank 1 has 2048`` (ranks sharing a value grouped: ``ranks 0, 2 have ...``).
    ``labels``: who each value belongs to, instead of ``rank i`` (grouped as ``A, B have``)."""
    groups: dict[int, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    parts = []
    for v, ranks in groups.items():
        if labels is not None:
            who = f"{labels[ranks[0]]} has" if len(ranks) == 1 else f"{', '.join(labels[i] for i in ranks)} have"
        else:
            who = f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} have"
        parts.append(f"{who} {show(v)}")
    return ", ".join(parts)


def disagreements(headers: list[list[int]], labels: list[str] | None = None) -> list[str]:
    """One phrase per header field the ranks disagree on (empty when they agree). ``headers[r]`` is rank
    ``r``'s (or ``labels[r]``'s); when the operations differ only that is reported (the other fields then mean
    different things)."""
    ops = [h[_OP] for h in headers]
    if len(set(ops)) > 1:
        return [f"the operation: {_ranks_with(ops, lambda v: OP_NAMES.get(v, f'operation {v}'), labels)}"]
    op = ops[0]
    found = []
    for slot, (name, show) in _FIELDS.items():
        if slot == _TOPK and op == OP_COMBINE:
            name, show = _COMBINE_TOPK
        elif slot == _WORST and op != OP_DISPATCH:
            name, show = _HANDLE_WORST
        values = [h[slot] for h in headers]
        if len(set(values)) > 1:
            found.append(f"{name}: {_ranks_with(values, show, labels)}")
    return found


def mismatch_message(op_name: str, headers: list[list[int]], labels: list[str] | None = None) -> str | None:
    """``"ep_moe.OP: ranks disagree on FIELD: rank 0 has A, rank 1 has B[; on ...]"``, or None when every
    header is the same (``labels``: see `disagreements`)."""
    found = disagreements(headers, labels)
    return f"ep_moe.{op_name}: ranks disagree on " + "; on ".join(found) if found else None


def check_headers(op_name: str, headers: list[list[int]]) -> None:
    """Raise the `ValueError` of `mismatch_message` unless every rank's header is the same. Every rank calls it
    with the same gathered headers, so all raise."""
    message = mismatch_message(op_name, headers)
    if message is not None:
        raise ValueError(message)


def assert_headers_on_device(gathered: torch.Tensor) -> None:
    """The GPU form of `check_headers` where the host may not wait: a device-side assert (every rank sees the
    same headers, so every rank's assert fires) queued before any row exchange."""
    torch._assert_async((gathered == gathered[:1]).all(),
                        "ep_moe: ranks disagree on the shape, dtype, fixed size or handle of a dispatch/combine "
                        "(the same call on a CPU group raises a ValueError naming the field)")


# The layout digest: a hash of the handle's rank_prefix_matrix, equal on every rank (every rank builds that
# matrix from the same exchanged counts), so it stays the same however the handle travels (the custom ops
# rebuild handles from their tensors). Two dispatches with the same count matrix share it; their row
# exchanges then have the same sizes, so mixing them up cannot break a collective.
_PRIME = 2**31 - 1


def digest_multipliers(num_ranks: int, device: torch.device) -> torch.Tensor:
    """``[R * R]`` int64 multipliers of `layout_digest` (made once per backend, outside any graph capture)."""
    return torch.tensor([pow(48271, i + 1, _PRIME) for i in range(num_ranks * num_ranks)], dtype=torch.int64,
                        device=device)


def layout_digest(rank_prefix_matrix: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor in ``[1, 2**31 - 1]``, on the matrix's device (no host sync)."""
    flat = rank_prefix_matrix.reshape(-1).to(torch.int64) % _PRIME
    return (flat * multipliers % _PRIME).sum() % _PRIME + 1
