"""Expert-major rows on one rank: the permute of (received) rows into one group per local expert, padded to an
alignment, for a grouped GEMM, and the weighted reduce of the experts' output rows back to one row per (received)
row. Differentiable. Each step is a torch.library custom op (``ep_moe::``), so ``torch.compile`` captures it whole
and the compiled graph runs its implementation (the kernels below).

Notation: N rows, K top-k columns, L experts of this rank, A alignment, M slots (expert-major rows), H hidden.
A *pair* ``(i, k)`` is row ``i``'s ``k``-th top-k entry when it names an expert of this rank; its flat index is
``i * K + k``. Slots hold the pairs of expert 0 in increasing ``(i, k)``, then zero padding up to a multiple of
A, then expert 1's, and so on; slots past the used total (a bound given for a fixed-size layout) are padding too.

* `expert_layout` computes where every pair goes (no host sync when ``num_slots`` is given).
* `permute_rows` copies each pair's row into its slot (bit for bit, FP8 included), zero on padding;
  `permute_rows_and_values` also gives each slot its pair's value (e.g. the routing weight), 0 on padding.
* `unpermute_sum` gives each row the fp32 sum over its pairs, in top-k order (DeepEP V2's),
  of ``weight * y[slot]`` (the product rounded to fp32, then added: no fused multiply-add), rounded once to
  y's dtype; rows without a pair get zeros. Gradients: ``y[slot]`` gets ``weight * grad[row]``, the weight
  ``<grad[row], y[slot]>`` in fp32.

Where the work runs, eagerly and in compiled graphs alike (the same bits everywhere; the weights' gradient is a
dot product whose summation order is each implementation's own, fixed): on CUDA, the JIT kernels of
`ep_moe.native.jit.expert_major` (compiled on first use per shape, or loaded from the cache ``ep-moe jit warmup``
filled; the permute of received rows in place from `ep_moe.native.jit.expert_major_exchange`); on CPU, for float64
(e.g. gradcheck) and where the JIT kernels cannot run, the torch definitions here. The public functions check
their arguments once; the kernels' entry points do not check again.
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

import torch
from torch import Tensor

from .buffer.routing_layout import count_values, round_up
from .custom_op import CustomOp, needs_dispatcher
from .native import jit
from .native.jit import expert_major as jit_kernels

log = logging.getLogger("ep_moe")


class ExpertLayout(NamedTuple):
    """Where the pairs of ``[N, K]`` rows go in ``[M]`` expert-major slots (see the module docstring)."""

    pair_of_slot: Tensor       # [M] int64: the flat pair index feeding each slot; N * K for padding
    slot_of_pair: Tensor       # [N, K] int64: the slot of each pair, -1 for an entry that is not a pair
    sorted_slots: Tensor       # [N, K] int64: each row's slots in increasing order, then -1
    tokens_per_expert: Tensor  # [L] int64: each expert's slot count (its pairs rounded up to A)
    pairs_per_expert: Tensor   # [L] int64: each expert's pairs
    # [L] int64 on the host: tokens_per_expert, when the layout was made at its exact size (read with the total)
    tokens_per_expert_host: Tensor | None = None

    @property
    def num_topk(self) -> int:
        return self.sorted_slots.shape[1]

    @property
    def num_rows(self) -> int:
        return self.sorted_slots.shape[0]

    @property
    def num_slots(self) -> int:
        return self.pair_of_slot.shape[0]


def max_slots(num_rows: int, num_topk: int, num_experts: int, alignment: int) -> int:
    """The most slots any routing of ``num_rows`` rows can need: every row has at most ``min(K, L)`` pairs, and
    every expert at most ``A - 1`` padding slots."""
    return num_rows * min(num_topk, num_experts) + num_experts * (alignment - 1)


def expert_layout(topk_idx: Tensor, num_experts: int, alignment: int = 1, num_slots: int | None = None,
                  capacity: int = 0) -> ExpertLayout:
    """The expert-major layout of ``topk_idx [N, K]`` int64 (expert ids in ``[0, num_experts)``, -1 = none).

    ``num_slots``: None = exactly the aligned total (one host read, which also brings the counts to the host:
    ``tokens_per_expert_host``); else M, a bound at least that large (`max_slots` always is): nothing waits on
    the host, and the slots past the total are padding. An id outside ``[0, num_experts)`` is not a pair.

    ``capacity`` C > 0 (with ``alignment`` 1): every expert owns exactly C slots (``M = L * C``, expert e's from
    ``e * C``; DeepSpeed's capacity buffer), its first C pairs in ``(i, k)`` order fill them and any later pair
    has no slot (dropped: its rows get nothing back); ``tokens_per_expert_host`` is ``[C] * L``, with no host read.
    """
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise ValueError(f"expert_layout: argument 'topk_idx' must be a [N, K] int64 tensor, got "
                         f"{tuple(topk_idx.shape)} {topk_idx.dtype}")
    if alignment < 1:
        raise ValueError(f"expert_layout: argument 'alignment' must be >= 1, got {alignment}")
    if num_experts < 1:
        raise ValueError(f"expert_layout: argument 'num_experts' must be >= 1, got {num_experts}")
    if num_slots is not None and num_slots < 0:
        raise ValueError(f"expert_layout: argument 'num_slots' must be >= 0, got {num_slots}")
    if capacity < 0:
        raise ValueError(f"expert_layout: argument 'capacity' must be >= 0, got {capacity}")
    if capacity and alignment != 1:
        raise ValueError(f"expert_layout: argument 'alignment' must be 1 with a capacity, got {alignment}")
    if capacity and num_slots not in (None, num_experts * capacity):
        raise ValueError(f"expert_layout: argument 'num_slots' must be None or num_experts * capacity = "
                         f"{num_experts * capacity} with a capacity, got {num_slots}")
    exact = num_slots is None and not capacity
    bound = -1 if num_slots is None else num_slots
    if not needs_dispatcher((topk_idx,)):  # eager: the parts as they come (see `CustomOp`)
        parts, host = _expert_layout_parts(topk_idx, num_experts, alignment, bound, capacity)
        return ExpertLayout(*parts, host)
    packed, exact_pair_of_slot, host = _EXPERT_LAYOUT(topk_idx, num_experts, alignment, bound, capacity)
    head, pairs = _layout_sizes(topk_idx, num_experts, bound, capacity)
    rows, topk = topk_idx.shape
    pair_of_slot = exact_pair_of_slot if exact else packed[:head]
    slot_of_pair, sorted_slots, tokens, counts = packed[head:].split_with_sizes(
        (pairs, pairs, num_experts, num_experts))
    return ExpertLayout(pair_of_slot, slot_of_pair.view(rows, topk), sorted_slots.view(rows, topk), tokens, counts,
                        host if exact or capacity else None)


def _expert_layout_torch(topk_idx: Tensor, num_experts: int, alignment: int, num_slots: int | None,
                         capacity: int = 0) -> ExpertLayout:
    num_rows, num_topk = topk_idx.shape
    num_pairs = num_rows * num_topk
    device = topk_idx.device
    key = torch.where((topk_idx >= 0) & (topk_idx < num_experts), topk_idx, num_experts).flatten()
    order = torch.sort(key, stable=True).indices  # pairs by (expert, row, k)
    pairs = count_values(key, num_experts + 1)[:num_experts]
    first_pair = torch.cumsum(pairs, 0) - pairs
    host = None
    if capacity:
        padded = torch.full_like(pairs, capacity)
        host = torch.full((num_experts,), capacity, dtype=torch.int64, device="cpu")
        num_slots = num_experts * capacity
        pairs = pairs.clamp(max=capacity)
    else:
        padded = round_up(pairs, alignment)
        if num_slots is None:
            host = padded.cpu()
            num_slots = int(host.sum())
    first_slot = torch.cumsum(padded, 0) - padded
    sorted_key = key[order]
    is_pair = sorted_key < num_experts
    expert = sorted_key.clamp(max=num_experts - 1)
    within = torch.arange(num_pairs, device=device) - first_pair[expert]  # the pair's place in its expert
    if capacity:
        is_pair &= within < capacity
    slot = torch.where(is_pair, first_slot[expert] + within, num_slots)
    # one spare entry takes every non-pair (and, with a bound that is too small, every pair past it)
    pair_of_slot = torch.full((num_slots + 1,), num_pairs, dtype=torch.int64, device=device)
    pair_of_slot.scatter_(0, slot.clamp(max=num_slots), torch.where(is_pair, order, num_pairs))
    pair_of_slot = pair_of_slot[:num_slots]
    slot_of_pair = torch.full((num_pairs + 1,), num_slots, dtype=torch.int64, device=device)
    slot_of_pair.scatter_(0, pair_of_slot, torch.arange(num_slots, device=device))
    by_pair = slot_of_pair[:num_pairs].view(num_rows, num_topk)
    sorted_slots = by_pair.sort(dim=1).values
    sorted_slots = torch.where(sorted_slots < num_slots, sorted_slots, -1)
    return ExpertLayout(pair_of_slot, torch.where(by_pair < num_slots, by_pair, -1), sorted_slots, padded, pairs,
                        host)


# ------------------------------------------------------------------------------------------ torch definitions
def _bits(t: Tensor) -> Tensor:
    """``t``'s bytes as integers of the same width (so that any dtype, FP8 included, is copied exactly)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _rows_of(pair_of_slot: Tensor, num_rows: int, num_topk: int) -> tuple[Tensor, Tensor]:
    """(row of each slot, clamped into range; whether the slot holds a pair)."""
    valid = pair_of_slot < num_rows * num_topk
    rows = torch.div(pair_of_slot, max(num_topk, 1), rounding_mode="floor").clamp(max=max(num_rows - 1, 0))
    return rows, valid


def _permute_torch(x: Tensor, pair_of_slot: Tensor, num_topk: int) -> Tensor:
    rows, valid = _rows_of(pair_of_slot, x.shape[0], num_topk)
    if x.shape[0] == 0:
        return x.new_zeros(pair_of_slot.shape[0], x.shape[1])
    gathered = _bits(x).index_select(0, rows)
    return torch.where(valid.unsqueeze(1), gathered, torch.zeros_like(gathered)).view(x.dtype)


def _received_rows_torch(rows: Tensor, num_rows: int, own_x: Tensor, own_tokens: Tensor, rank_prefix_matrix: Tensor,
                         rank: int) -> Tensor:
    """The ``num_rows`` received rows, rank-major, of a dispatch that left them in place: row i is
    ``own_x[own_tokens[i - first]]`` for ``first <= i < end`` (this rank's own rows: ``rank_prefix_matrix[rank - 1,
    rank]`` and ``[rank, rank]``), else ``rows[i]``."""
    prefix = rank_prefix_matrix.to(torch.int64)
    first = prefix[rank - 1, rank] if rank > 0 else prefix.new_zeros(())
    index = torch.arange(num_rows, device=rows.device)
    num_own = own_x.shape[0]
    # bounded by T as the kernel is (a prefix matrix or send list of a dispatch that moved nothing is garbage)
    own = (index >= first) & (index < prefix[rank, rank]) & (index - first < num_own)
    peers = _bits(rows[:num_rows])
    if num_own == 0:
        return peers.view(rows.dtype)
    tokens = own_tokens.to(torch.int64).index_select(0, (index - first).clamp(0, num_own - 1))
    own &= (tokens >= 0) & (tokens < num_own)
    mine = _bits(own_x).index_select(0, tokens.clamp(0, num_own - 1))
    return torch.where(own.unsqueeze(1), mine, peers).view(rows.dtype)


def _acc_dtype(t: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _unpermute_sum_torch(y: Tensor, weights: Tensor | None, sorted_slots: Tensor) -> Tensor:
    acc = torch.zeros(sorted_slots.shape[0], y.shape[1], dtype=_acc_dtype(y), device=y.device)
    for j in range(sorted_slots.shape[1]):
        slots = sorted_slots[:, j]
        valid = (slots >= 0).unsqueeze(1)
        safe = slots.clamp(min=0)
        term = y.index_select(0, safe).to(acc.dtype) if y.shape[0] else acc
        if weights is not None and y.shape[0]:
            term = weights.index_select(0, safe).unsqueeze(1) * term  # rounded first, then added
        acc = torch.where(valid, acc + term, acc)
    return acc.to(y.dtype)


def _scale_permute_torch(grad: Tensor, weights: Tensor | None, pair_of_slot: Tensor, num_topk: int) -> Tensor:
    if weights is None:
        return _permute_torch(grad, pair_of_slot, num_topk)
    rows, valid = _rows_of(pair_of_slot, grad.shape[0], num_topk)
    if grad.shape[0] == 0:
        return grad.new_zeros(pair_of_slot.shape[0], grad.shape[1])
    scaled = (weights.unsqueeze(1) * grad.index_select(0, rows).to(_acc_dtype(grad))).to(grad.dtype)
    return torch.where(valid.unsqueeze(1), scaled, torch.zeros_like(scaled))


def _pair_dot_torch(grad: Tensor, y: Tensor, pair_of_slot: Tensor, num_topk: int) -> Tensor:
    rows, valid = _rows_of(pair_of_slot, grad.shape[0], num_topk)
    if grad.shape[0] == 0:
        return torch.zeros(pair_of_slot.shape[0], dtype=_acc_dtype(grad), device=y.device)
    acc = _acc_dtype(grad)
    dots = (grad.index_select(0, rows).to(acc) * y.to(acc)).sum(dim=1)
    return torch.where(valid, dots, torch.zeros_like(dots))


# ------------------------------------------------------------------------------------------ implementations
# Two implementations of the same contract, chosen per call by where the tensors are (`kernel_implementation`):
# the JIT kernels (`ep_moe.native.jit.expert_major`, specialized per shape, launched from Python) and the torch
# definitions above (CPU, float64, and CUDA where the JIT kernels cannot run).
NATIVE_MAX_EXPERTS = 1024  # experts the JIT layout kernels count in shared memory; beyond, torch
assert NATIVE_MAX_EXPERTS == jit_kernels.MAX_EXPERTS


def kernel_implementation(t: Tensor) -> str:
    """Which implementation the kernels of tensors like ``t`` come from: ``"jit"`` (`ep_moe.native.jit`),
    or ``"torch"`` (see above; also for other callers of the generic expert-major ops, e.g. the
    Megatron integration's routing map)."""
    if not t.is_cuda or t.dtype == torch.float64:
        return "torch"
    return "jit" if jit.available() else "torch"


# Which implementations ran in this process (`implementations_run`), and whether the torch fallback on a GPU has
# been said: benchmarks and `ep-moe env` name what ran instead of what a choice would give.
_ran: set[str] = set()
_ran_lock = threading.Lock()
_fallback_said = False


def torch_fallback_reason(t: Tensor) -> str:
    """Why CUDA tensors like ``t`` run as torch code, in one line."""
    if t.dtype == torch.float64:
        return "float64 has no kernel"
    return f"JIT: {jit.unavailable_reason() or 'not chosen'}"


def _note_ran(how: str, t: Tensor, why: str | None = None) -> str:
    """Record that implementation ``how`` runs a call on tensors like ``t`` and return ``how``. The first torch
    run on a GPU in the process is logged once, with ``why`` (or the reason the kernels could not run). Called by
    the custom ops' implementations: eagerly, and when a compiled graph runs them."""
    global _fallback_said
    if how not in _ran:
        with _ran_lock:
            _ran.add(how)
    if how == "torch" and t.is_cuda and not _fallback_said:
        _fallback_said = True
        log.warning("ep_moe.permute: the expert-major kernels run as torch code on %s (%s)", t.device,
                    why or torch_fallback_reason(t))
    return how


def implementations_run() -> tuple[str, ...]:
    """The implementations (``"jit"``, ``"torch"``; sorted) that ran an
    expert-major call in this process since it started or since `reset_implementations_run`."""
    with _ran_lock:
        return tuple(sorted(_ran))


def reset_implementations_run() -> None:
    """Forget which implementations ran (e.g. between a benchmark's warm-up and its timed calls)."""
    with _ran_lock:
        _ran.clear()


def _slot_values_torch(values: Tensor, pair_of_slot: Tensor) -> Tensor:
    flat = values.reshape(-1)
    if flat.shape[0] == 0:
        return values.new_zeros(pair_of_slot.shape[0])
    valid = pair_of_slot < flat.shape[0]
    picked = flat.index_select(0, pair_of_slot.clamp(max=flat.shape[0] - 1))
    return torch.where(valid, picked, torch.zeros_like(picked))


def _permute(x: Tensor, pair_of_slot: Tensor, num_topk: int, values: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(rows [M, H], slot_values [M] or None)."""
    how = _note_ran(kernel_implementation(x), x)
    if how == "jit":
        fp32_values = values is None or values.dtype == torch.float32  # other values: the rows here, the values below
        rows, slot_values = jit_kernels.permute_rows(x.contiguous(), pair_of_slot, num_topk,
                                                     values.contiguous() if values is not None and fp32_values else None)
        if values is None or fp32_values:
            return rows, None if values is None else slot_values
    else:
        rows = _permute_torch(x, pair_of_slot, num_topk)
    return rows, None if values is None else _slot_values_torch(values, pair_of_slot)


def _unpermute(y: Tensor, weights: Tensor | None, sorted_slots: Tensor, slot_values: Tensor | None = None,
               slot_of_pair: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(out [N, H], pair_values [N, K] or None: ``slot_values`` at each pair's slot, 0 where it has none)."""
    how = _note_ran(kernel_implementation(y), y)
    if how == "jit":
        out, pair_values = jit_kernels.unpermute_sum(
            y.contiguous(), None if weights is None else weights.contiguous(), sorted_slots,
            None if slot_values is None else slot_values.contiguous(), slot_of_pair)
        return out, None if slot_values is None else pair_values
    out = _unpermute_sum_torch(y, weights, sorted_slots)
    if slot_values is None:
        return out, None
    safe = slot_of_pair.clamp(min=0)
    picked = slot_values.index_select(0, safe.flatten()).view(slot_of_pair.shape) if slot_values.numel() else \
        torch.zeros(slot_of_pair.shape, dtype=slot_values.dtype, device=y.device)
    return out, torch.where(slot_of_pair >= 0, picked, torch.zeros_like(picked))


def _unpermute_backward(grad: Tensor, y: Tensor, weights: Tensor | None, pair_of_slot: Tensor, num_topk: int,
                        need_grad_y: bool, need_grad_weights: bool) -> tuple[Tensor | None, Tensor | None]:
    """(grad_y [M, H] or None, grad_weights [M] or None) of `unpermute_sum`."""
    how = _note_ran(kernel_implementation(grad), grad)
    if how == "jit":
        grad_y, grad_w = jit_kernels.unpermute_sum_backward(
            grad, y.contiguous(), None if weights is None else weights.contiguous(), pair_of_slot, num_topk,
            need_grad_y, need_grad_weights)
        return (grad_y if need_grad_y else None), (grad_w if need_grad_weights else None)
    grad_y = grad_w = None
    if need_grad_y:
        grad_y = _scale_permute_torch(grad, weights, pair_of_slot, num_topk)
    if need_grad_weights:
        grad_w = _pair_dot_torch(grad, y, pair_of_slot, num_topk)
    return grad_y, grad_w


# ------------------------------------------------------------------------------------------ custom ops
# The family as torch.library custom ops (namespace ``ep_moe``): an op's implementation picks the JIT kernels or the
# torch definitions when it runs (in a compiled graph too, so the JIT kernels run there on CUDA); its fake
# implementation gives the output shapes while torch.compile traces; the forward ops' autograd formulas call the
# backward ops. Outputs never alias inputs or each other (a custom op's rule): the layout comes back packed in one
# tensor, which `expert_layout` splits into views. In eager mode each op runs without the dispatcher
# (`ep_moe.custom_op.CustomOp`).
_EMPTY_F32 = dict(dtype=torch.float32)


def _layout_sizes(topk_idx: Tensor, num_experts: int, num_slots: int, capacity: int) -> tuple[int, int]:
    """(slots at the head of the packed layout: M, or 0 at the exact size, ``num_slots`` -1; pairs N * K)."""
    head = num_experts * capacity if capacity else max(num_slots, 0)
    return head, topk_idx.shape[0] * topk_idx.shape[1]


def _expert_layout_parts(topk_idx: Tensor, num_experts: int, alignment: int, num_slots: int, capacity: int
                         ) -> tuple[tuple[Tensor, ...], Tensor | None]:
    """``((pair_of_slot, slot_of_pair, sorted_slots, tokens_per_expert, pairs_per_expert), host counts or None)`` of
    `expert_layout` (``num_slots`` -1: the exact size) by the JIT kernels or the torch definitions."""
    how, why = kernel_implementation(topk_idx), None
    if how != "torch" and num_experts > NATIVE_MAX_EXPERTS:
        how, why = "torch", f"{num_experts} experts: the layout kernels count at most {NATIVE_MAX_EXPERTS}"
    _note_ran(how, topk_idx, why)
    if how == "jit":
        parts = jit_kernels.expert_layout(topk_idx.contiguous(), num_experts, alignment, num_slots, capacity)
        return tuple(parts[:5]), parts[5] if num_slots < 0 or capacity else None  # exact size or capacity
    layout = _expert_layout_torch(topk_idx, num_experts, alignment, None if num_slots < 0 else num_slots, capacity)
    return tuple(layout[:5]), layout.tokens_per_expert_host


def _expert_layout_impl(topk_idx: Tensor, num_experts: int, alignment: int, num_slots: int, capacity: int
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """`expert_layout` (``num_slots`` -1: the exact size) as ``(packed [head + 2 N K + 2 L] int64: pair_of_slot
    (its [M] unless at the exact size), slot_of_pair, sorted_slots, tokens_per_expert, pairs_per_expert;
    pair_of_slot [M] at the exact size, else [0]; the host counts [L] on the CPU at the exact size or with a
    capacity, else [0])``."""
    exact = num_slots < 0 and not capacity
    parts, host = _expert_layout_parts(topk_idx, num_experts, alignment, num_slots, capacity)
    pieces = [t.reshape(-1) for t in ((() if exact else (parts[0],)) + tuple(parts[1:5]))]
    packed = _one_piece(pieces)
    exact_pair_of_slot = parts[0] if exact else topk_idx.new_empty(0)
    host = torch.empty(0, dtype=torch.int64) if host is None else host
    return packed, exact_pair_of_slot, host


_EXPERT_LAYOUT = CustomOp("expert_layout", _expert_layout_impl)


def _one_piece(pieces: list[Tensor]) -> Tensor:
    """``pieces`` (1-D, one dtype) as one tensor: the view that spans them where they lie back to back in one
    allocation (the JIT layout's outputs), else their concatenation."""
    first, total = pieces[0], sum(t.shape[0] for t in pieces)
    size = first.element_size()
    at = first.data_ptr()
    for t in pieces:
        if t.data_ptr() != at or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return torch.cat(pieces)
        at += t.shape[0] * size
    return first.as_strided((total,), (1,))


@_EXPERT_LAYOUT.op.register_fake
def _(topk_idx, num_experts, alignment, num_slots, capacity):
    exact = num_slots < 0 and not capacity
    head, pairs = _layout_sizes(topk_idx, num_experts, num_slots, capacity)
    packed = topk_idx.new_empty(head + 2 * pairs + 2 * num_experts)
    slots = torch.library.get_ctx().new_dynamic_size() if exact else 0
    host = torch.empty(num_experts if exact or capacity else 0, dtype=torch.int64, device="cpu")
    return packed, topk_idx.new_empty(slots), host


def _permute_rows_impl(x: Tensor, values: Tensor | None, pair_of_slot: Tensor, slot_of_pair: Tensor,
                     sorted_slots: Tensor) -> tuple[Tensor, Tensor]:
    """`permute_rows_and_values`: ``(rows [M, H] of x's dtype, slot_values [M] of values' dtype, [0] fp32 without
    values)``; ``sorted_slots`` is the backward's."""
    rows, slot_values = _permute(x, pair_of_slot, slot_of_pair.shape[1], values)
    return rows, slot_values if slot_values is not None else x.new_empty(0, **_EMPTY_F32)


def _permute_rows_fake(x, values, pair_of_slot, slot_of_pair, sorted_slots):
    slots = pair_of_slot.shape[0]
    return x.new_empty(slots, x.shape[1]), (x.new_empty(0, **_EMPTY_F32) if values is None else
                                            values.new_empty(slots))


def _permute_rows_setup(ctx, inputs, output) -> None:
    x, values, _, slot_of_pair, sorted_slots = inputs
    ctx.save_for_backward(slot_of_pair, sorted_slots)
    ctx.values_shape = None if values is None else values.shape
    ctx.values_dtype = None if values is None else values.dtype
    ctx.rows_shape, ctx.rows_dtype = output[0].shape, output[0].dtype


def _permute_rows_grad(ctx, grad_rows, grad_slot_values):
    """The plain reduce of the rows' gradients and the gather of the slot values' gradients, in one call."""
    slot_of_pair, sorted_slots = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0]
    want_values = ctx.values_shape is not None and ctx.needs_input_grad[1]
    if not (need_x or want_values):
        return None, None, None, None, None
    if grad_rows is None:  # only the slot values were used
        grad_rows = torch.zeros(ctx.rows_shape, dtype=ctx.rows_dtype, device=sorted_slots.device)
    if want_values and grad_slot_values is None:  # only the rows were used
        grad_slot_values = torch.zeros(ctx.rows_shape[0], dtype=ctx.values_dtype, device=sorted_slots.device)
    grad_x, grad_values = _PERMUTE_ROWS_BACKWARD(
        grad_rows, grad_slot_values if want_values else None, sorted_slots, slot_of_pair)
    return (grad_x if need_x else None), (grad_values.view(ctx.values_shape) if want_values else None), None, None, None


_PERMUTE_ROWS = CustomOp("permute_rows", _permute_rows_impl, _permute_rows_setup, _permute_rows_grad)
_PERMUTE_ROWS.op.register_fake(_permute_rows_fake)


def _permute_rows_backward_impl(grad_rows: Tensor, grad_slot_values: Tensor | None, sorted_slots: Tensor,
                              slot_of_pair: Tensor) -> tuple[Tensor, Tensor]:
    """`permute_rows_backward`: ``(grad_x [N, H], grad_values [N, K] of grad_slot_values' dtype, [0] fp32 without
    them)``."""
    out, pair_values = _unpermute(grad_rows.contiguous(), None, sorted_slots, grad_slot_values, slot_of_pair)
    return out, pair_values if pair_values is not None else grad_rows.new_empty(0, **_EMPTY_F32)


_PERMUTE_ROWS_BACKWARD = CustomOp("permute_rows_backward", _permute_rows_backward_impl)


@_PERMUTE_ROWS_BACKWARD.op.register_fake
def _(grad_rows, grad_slot_values, sorted_slots, slot_of_pair):
    return (grad_rows.new_empty(sorted_slots.shape[0], grad_rows.shape[1]),
            grad_rows.new_empty(0, **_EMPTY_F32) if grad_slot_values is None else
            grad_slot_values.new_empty(slot_of_pair.shape))


def _unpermute_sum_impl(y: Tensor, weights: Tensor | None, pair_of_slot: Tensor, slot_order: Tensor) -> Tensor:
    """`unpermute_sum`: ``out [N, H]`` of y's dtype, each row's pairs summed in ``slot_order [N, K]``'s order;
    ``pair_of_slot`` is the backward's."""
    return _unpermute(y, weights, slot_order)[0]


def _unpermute_sum_fake(y, weights, pair_of_slot, slot_order):
    return y.new_empty(slot_order.shape[0], y.shape[1])


def _unpermute_sum_setup(ctx, inputs, output) -> None:
    y, weights, pair_of_slot, slot_order = inputs
    ctx.save_for_backward(y, weights, pair_of_slot)
    ctx.num_topk = slot_order.shape[1]


def _unpermute_sum_grad(ctx, grad):
    """Both gradients in one call."""
    y, weights, pair_of_slot = ctx.saved_tensors
    need_y, need_w = ctx.needs_input_grad[0], weights is not None and ctx.needs_input_grad[1]
    if not (need_y or need_w):
        return None, None, None, None
    grad_y, grad_w = _UNPERMUTE_SUM_BACKWARD(grad, y, weights, pair_of_slot, ctx.num_topk, need_y, need_w)
    return (grad_y if need_y else None), (grad_w if need_w else None), None, None


_UNPERMUTE_SUM = CustomOp("unpermute_sum", _unpermute_sum_impl, _unpermute_sum_setup, _unpermute_sum_grad)
_UNPERMUTE_SUM.op.register_fake(_unpermute_sum_fake)


def _unpermute_sum_backward_impl(grad: Tensor, y: Tensor, weights: Tensor | None, pair_of_slot: Tensor, num_topk: int,
                               need_grad_y: bool, need_grad_weights: bool) -> tuple[Tensor, Tensor]:
    """`unpermute_sum_backward`: ``(grad_y [M, H] of y's dtype, [0] unless need_grad_y; grad_weights [M] fp32
    (fp64 for fp64), [0] unless need_grad_weights)``."""
    grad_y, grad_w = _unpermute_backward(grad.contiguous(), y, weights, pair_of_slot, num_topk, need_grad_y,
                                         need_grad_weights)
    return (grad_y if grad_y is not None else y.new_empty(0),
            grad_w if grad_w is not None else y.new_empty(0, dtype=_acc_dtype(y)))


_UNPERMUTE_SUM_BACKWARD = CustomOp("unpermute_sum_backward", _unpermute_sum_backward_impl)


@_UNPERMUTE_SUM_BACKWARD.op.register_fake
def _(grad, y, weights, pair_of_slot, num_topk, need_grad_y, need_grad_weights):
    slots = pair_of_slot.shape[0]
    return (y.new_empty((slots, y.shape[1]) if need_grad_y else (0,)),
            y.new_empty(slots if need_grad_weights else 0, dtype=_acc_dtype(y)))


def _permute_received_rows_impl(rows: Tensor, num_rows: int, own_x: Tensor, own_tokens: Tensor,
                              rank_prefix_matrix: Tensor, rank: int, pair_of_slot: Tensor, num_topk: int,
                              values: Tensor | None) -> tuple[Tensor, Tensor]:
    """`permute_received_rows`: ``(rows [M, H] of rows' dtype, slot_values [M] fp32, [0] without values)``."""
    how = _note_ran(kernel_implementation(rows), rows)
    if how == "jit":
        # imported here: the intranode JIT module it comes with is not needed before
        from .native.jit import expert_major_exchange

        out, slot_values = expert_major_exchange.permute_received_rows(
            rows, num_rows, own_x.contiguous(), own_tokens.contiguous(),
            rank_prefix_matrix.to(torch.int32).contiguous(), rank, pair_of_slot, num_topk,
            None if values is None else values.contiguous())
        return out, slot_values if values is not None else rows.new_empty(0, **_EMPTY_F32)
    received = _received_rows_torch(rows, num_rows, own_x, own_tokens, rank_prefix_matrix, rank)
    out = _permute_torch(received, pair_of_slot, num_topk)
    return out, (_slot_values_torch(values, pair_of_slot) if values is not None else rows.new_empty(0, **_EMPTY_F32))


_PERMUTE_RECEIVED_ROWS = CustomOp("permute_received_rows", _permute_received_rows_impl)


@_PERMUTE_RECEIVED_ROWS.op.register_fake
def _(rows, num_rows, own_x, own_tokens, rank_prefix_matrix, rank, pair_of_slot, num_topk, values):
    slots = pair_of_slot.shape[0]
    return rows.new_empty(slots, rows.shape[1]), rows.new_empty(slots if values is not None else 0, **_EMPTY_F32)


# ------------------------------------------------------------------------------------------ public API
def permute_rows(x: Tensor, layout: ExpertLayout) -> Tensor:
    """``x [N, H]`` (any dtype) into ``[M, H]`` expert-major rows, zero on padding. Differentiable: the
    gradient of a row is the fp32 sum of its slots' gradients, rounded once."""
    _check_rows(x, layout)
    return _PERMUTE_ROWS(x, None, layout.pair_of_slot, layout.slot_of_pair, layout.sorted_slots)[0]


def permute_rows_and_values(x: Tensor, values: Tensor, layout: ExpertLayout) -> tuple[Tensor, Tensor]:
    """`permute_rows` of ``x`` and `pair_values` of ``values [N, K]`` fp32 (e.g. routing weights) in one call:
    ``(rows [M, H], slot_values [M])``. Differentiable in both."""
    _check_rows(x, layout)
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    if values.shape != layout.slot_of_pair.shape or values.dtype != dtype:
        raise ValueError(f"permute_rows_and_values: argument 'values' must be [N={layout.num_rows}, "
                         f"K={layout.num_topk}] float32, got {tuple(values.shape)} {values.dtype}")
    return _PERMUTE_ROWS(x, values, layout.pair_of_slot, layout.slot_of_pair, layout.sorted_slots)


def _check_rows(x: Tensor, layout: ExpertLayout) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[0] != layout.num_rows:
        raise ValueError(f"permute_rows: argument 'x' must be [N={layout.num_rows}, H], got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")


def unpermute_sum(y: Tensor, layout: ExpertLayout, weights: Tensor | None = None) -> Tensor:
    """``y [M, H]`` (bf16/fp32) back to ``[N, H]``: each row the fp32 sum over its pairs, in top-k order (k = 0,
    1, ..., as DeepEP V2's expanded combine), of ``weights[slot] * y[slot]`` (``weights [M]`` fp32; None = 1),
    rounded once to y's dtype. Differentiable in ``y`` and ``weights``."""
    check_unpermute_args(y, layout, weights)
    # slot_of_pair lists each row's slots in top-k order, -1 where entry k is no pair: every implementation
    # skips those entries, so it serves as the order of the sum
    return _UNPERMUTE_SUM(y, weights, layout.pair_of_slot, layout.slot_of_pair)


def check_unpermute_args(y: Tensor, layout: ExpertLayout, weights: Tensor | None) -> None:
    """`unpermute_sum`'s argument checks (a ValueError naming the argument)."""
    if y.dim() != 2 or y.shape[0] != layout.num_slots:
        raise ValueError(f"unpermute_sum: argument 'y' must be [M={layout.num_slots}, H], got {tuple(y.shape)}")
    if y.dtype not in (torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"unpermute_sum: argument 'y' must be bf16 or fp32 (fp64 for gradcheck), got {y.dtype}")
    weight_dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
    if weights is not None and (weights.shape != (layout.num_slots,) or weights.dtype != weight_dtype):
        raise ValueError(f"unpermute_sum: argument 'weights' must be [M={layout.num_slots}] {weight_dtype}, got "
                         f"{tuple(weights.shape)} {weights.dtype}")


def unpermute_sum_backward(grad: Tensor, y: Tensor, layout: ExpertLayout, weights: Tensor | None,
                           need_grad_y: bool, need_grad_weights: bool) -> tuple[Tensor | None, Tensor | None]:
    """What `unpermute_sum`'s autograd backward computes for ``grad [N, H]``: ``(grad_y [M, H] or None,
    grad_weights [M] fp32 or None)``."""
    grad_y, grad_w = _UNPERMUTE_SUM_BACKWARD(grad, y, weights, layout.pair_of_slot, layout.num_topk, need_grad_y,
                                             need_grad_weights)
    return (grad_y if need_grad_y else None), (grad_w if need_grad_weights else None)


def permute_received_rows(rows: Tensor, num_rows: int, own_x: Tensor, own_tokens: Tensor,
                          rank_prefix_matrix: Tensor, rank: int, layout: ExpertLayout,
                          values: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """`permute_rows_and_values` of the ``num_rows`` (N) received rows of a dispatch that left them where they
    landed: the peers' rows in ``rows [>= N, H]`` (the receive buffer, rank-major: row i there is received row i)
    and this rank's own rows in ``own_x [T, H]`` (its input): received row i is ``own_x[own_tokens[i - first]]``
    for ``first <= i < end``, from ``rank_prefix_matrix [R, R]`` int32 (``first = [rank - 1, rank]``, 0 for rank
    0, ``end = [rank, rank]``), read on the device; ``own_tokens [T]`` int32 (the rank's send list to itself).
    Each row is read once and written into each of its slots; no host sync. ``values [N, K]`` fp32 or None.

    Forward only (no autograd; `permute_rows_backward` is its gradient). Returns ``(rows [M, H] of rows' dtype,
    zero on padding; slot_values [M] fp32 or None)``, bit for bit `permute_rows_and_values` of the rank-major
    rows."""
    if rows.dim() != 2 or own_x.dim() != 2 or rows.shape[1] != own_x.shape[1] or rows.dtype != own_x.dtype:
        raise ValueError(f"permute_received_rows: arguments 'rows' and 'own_x' must be [*, H] of one dtype, got "
                         f"{tuple(rows.shape)} {rows.dtype} and {tuple(own_x.shape)} {own_x.dtype}")
    if num_rows != layout.num_rows or num_rows > rows.shape[0]:
        raise ValueError(f"permute_received_rows: argument 'num_rows' must be the layout's N={layout.num_rows} "
                         f"and at most rows.shape[0]={rows.shape[0]}, got {num_rows}")
    if own_tokens.dtype != torch.int32 or own_tokens.shape != (own_x.shape[0],):
        raise ValueError(f"permute_received_rows: argument 'own_tokens' must be [T={own_x.shape[0]}] int32, got "
                         f"{tuple(own_tokens.shape)} {own_tokens.dtype}")
    num_ranks = rank_prefix_matrix.shape[0]
    if rank_prefix_matrix.shape != (num_ranks, num_ranks) or not 0 <= rank < num_ranks:
        raise ValueError(f"permute_received_rows: argument 'rank' must be in [0, R) of the [R, R] "
                         f"rank_prefix_matrix, got {rank} and {tuple(rank_prefix_matrix.shape)}")
    if values is not None and (values.shape != layout.slot_of_pair.shape or values.dtype != torch.float32):
        raise ValueError(f"permute_received_rows: argument 'values' must be [N={layout.num_rows}, "
                         f"K={layout.num_topk}] float32, got {tuple(values.shape)} {values.dtype}")
    out, slot_values = _PERMUTE_RECEIVED_ROWS(rows, num_rows, own_x, own_tokens, rank_prefix_matrix, rank,
                                              layout.pair_of_slot, layout.num_topk, values)
    return out, None if values is None else slot_values


def permute_rows_backward(grad_rows: Tensor, grad_slot_values: Tensor | None, layout: ExpertLayout
                          ) -> tuple[Tensor, Tensor | None]:
    """The gradient of `permute_rows_and_values` (what its autograd backward computes): ``(grad_x [N, H], the fp32
    sum of each row's slots' gradients rounded once; grad_values [N, K] or None: each pair's slot's gradient, 0
    where it has none)``. ``grad_slot_values [M]`` or None."""
    out, pair_values = _PERMUTE_ROWS_BACKWARD(grad_rows, grad_slot_values, layout.sorted_slots,
                                              layout.slot_of_pair)
    return out, None if grad_slot_values is None else pair_values


def pair_values(values: Tensor, layout: ExpertLayout) -> Tensor:
    """``values [N, K]`` (e.g. routing weights) at each slot's pair: ``[M]``, 0 on padding. Differentiable."""
    return _slot_values_torch(values, layout.pair_of_slot)


__all__ = ["ExpertLayout", "expert_layout", "implementations_run", "kernel_implementation", "max_slots", "pair_values",
           "permute_received_rows", "permute_rows", "permute_rows_and_values", "permute_rows_backward",
           "reset_implementations_run", "torch_fallback_reason", "unpermute_sum", "unpermute_sum_backward"]
