"""Expert-major rows on one rank: the permute of (received) rows into one group per local expert, padded to an
alignment, for a grouped GEMM, and the weighted reduce of the experts' output rows back to one row per (received)
row. Differentiable (``torch.library`` custom ops with fake implementations, so ``torch.compile`` traces them).

Notation: N rows, K top-k columns, L experts of this rank, A alignment, M slots (expert-major rows), H hidden.
A *pair* ``(i, k)`` is row ``i``'s ``k``-th top-k entry when it names an expert of this rank; its flat index is
``i * K + k``. Slots hold the pairs of expert 0 in increasing ``(i, k)``, then zero padding up to a multiple of
A, then expert 1's, and so on; slots past the used total (a bound given for a fixed-size layout) are padding too.

* `expert_layout` computes where every pair goes (no host sync when ``num_slots`` is given).
* `permute_rows` copies each pair's row into its slot (bit for bit, FP8 included), zero on padding.
* `unpermute_sum` gives each row the fp32 sum over its pairs, in increasing slot order (= increasing expert),
  of ``weight * y[slot]`` (the product rounded to fp32, then added: no fused multiply-add), rounded once to
  y's dtype; rows without a pair get zeros. Gradients: ``y[slot]`` gets ``weight * grad[row]``, the weight
  ``<grad[row], y[slot]>`` in fp32.

On CUDA the work runs in the Triton kernels of `ep_moe.permute_triton` when they are available (bit-equal to the
torch code here, which serves the CPU and any machine without Triton); the public functions here check the
arguments once and call the kernels' unchecked launchers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import permute_triton
from .layout import count_values, round_up


class ExpertLayout(NamedTuple):
    """Where the pairs of ``[N, K]`` rows go in ``[M]`` expert-major slots (see the module docstring)."""

    pair_of_slot: Tensor       # [M] int64: the flat pair index feeding each slot; N * K for padding
    slot_of_pair: Tensor       # [N, K] int64: the slot of each pair, -1 for an entry that is not a pair
    sorted_slots: Tensor       # [N, K] int64: each row's slots in increasing order, then -1
    tokens_per_expert: Tensor  # [L] int64: each expert's slot count (its pairs rounded up to A)
    pairs_per_expert: Tensor   # [L] int64: each expert's pairs

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


def expert_layout(topk_idx: Tensor, num_experts: int, alignment: int = 1, num_slots: int | None = None
                  ) -> ExpertLayout:
    """The expert-major layout of ``topk_idx [N, K]`` int64 (expert ids in ``[0, num_experts)``, -1 = none).

    ``num_slots``: None = exactly the aligned total (one host read); else M, a bound at least that large
    (`max_slots` always is): nothing waits on the host, and the slots past the total are padding.
    """
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise ValueError(f"expert_layout: argument 'topk_idx' must be a [N, K] int64 tensor, got "
                         f"{tuple(topk_idx.shape)} {topk_idx.dtype}")
    if alignment < 1:
        raise ValueError(f"expert_layout: argument 'alignment' must be >= 1, got {alignment}")
    num_rows, num_topk = topk_idx.shape
    num_pairs = num_rows * num_topk
    device = topk_idx.device
    key = torch.where(topk_idx >= 0, topk_idx, num_experts).flatten()
    order = torch.sort(key, stable=True).indices  # pairs by (expert, row, k)
    pairs = count_values(key, num_experts + 1)[:num_experts]
    padded = round_up(pairs, alignment)
    if num_slots is None:
        num_slots = int(padded.sum())
    elif num_slots < 0:
        raise ValueError(f"expert_layout: argument 'num_slots' must be >= 0, got {num_slots}")
    first_pair = torch.cumsum(pairs, 0) - pairs
    first_slot = torch.cumsum(padded, 0) - padded
    sorted_key = key[order]
    is_pair = sorted_key < num_experts
    expert = sorted_key.clamp(max=num_experts - 1)
    position = torch.arange(num_pairs, device=device)
    slot = torch.where(is_pair, first_slot[expert] + position - first_pair[expert], num_slots)
    # one spare entry takes every non-pair (and, with a bound that is too small, every pair past it)
    pair_of_slot = torch.full((num_slots + 1,), num_pairs, dtype=torch.int64, device=device)
    pair_of_slot.scatter_(0, slot.clamp(max=num_slots), torch.where(is_pair, order, num_pairs))
    pair_of_slot = pair_of_slot[:num_slots]
    slot_of_pair = torch.full((num_pairs + 1,), num_slots, dtype=torch.int64, device=device)
    slot_of_pair.scatter_(0, pair_of_slot, torch.arange(num_slots, device=device))
    by_pair = slot_of_pair[:num_pairs].view(num_rows, num_topk)
    sorted_slots = by_pair.sort(dim=1).values
    sorted_slots = torch.where(sorted_slots < num_slots, sorted_slots, -1)
    return ExpertLayout(pair_of_slot, torch.where(by_pair < num_slots, by_pair, -1), sorted_slots, padded, pairs)


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


def _triton(*tensors: Tensor) -> bool:
    """The Triton kernels serve CUDA tensors of the dtypes they take (fp64, for gradcheck, stays in torch)."""
    return tensors[0].is_cuda and tensors[0].dtype != torch.float64 and permute_triton.available()


# ------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("ep_moe::permute_rows", mutates_args=())
def _permute_op(x: Tensor, pair_of_slot: Tensor, sorted_slots: Tensor) -> Tensor:
    num_topk = sorted_slots.shape[1]
    if _triton(x):
        out = torch.empty(pair_of_slot.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        return permute_triton.run_permute_rows(x.contiguous(), pair_of_slot, num_topk, out)
    return _permute_torch(x, pair_of_slot, num_topk)


@_permute_op.register_fake
def _(x, pair_of_slot, sorted_slots):
    return x.new_empty(pair_of_slot.shape[0], x.shape[1])


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _permute_backward(ctx, grad):
    pair_of_slot, sorted_slots = ctx.saved_tensors
    return torch.ops.ep_moe.unpermute_sum(grad.contiguous(), None, pair_of_slot, sorted_slots), None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("ep_moe::unpermute_sum", mutates_args=())
def _unpermute_op(y: Tensor, weights: Tensor | None, pair_of_slot: Tensor, sorted_slots: Tensor) -> Tensor:
    if _triton(y):
        out = torch.empty(sorted_slots.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
        return permute_triton.run_unpermute_sum(y.contiguous(), None if weights is None else weights.contiguous(),
                                            sorted_slots, out)
    return _unpermute_sum_torch(y, weights, sorted_slots)


@_unpermute_op.register_fake
def _(y, weights, pair_of_slot, sorted_slots):
    return y.new_empty(sorted_slots.shape[0], y.shape[1])


def _unpermute_setup(ctx, inputs, output):
    y, weights, pair_of_slot, sorted_slots = inputs
    ctx.weighted = weights is not None
    ctx.save_for_backward(y, weights, pair_of_slot)
    ctx.num_topk = sorted_slots.shape[1]


def _unpermute_backward(ctx, grad):
    y, weights, pair_of_slot = ctx.saved_tensors
    grad = grad.contiguous()
    grad_y = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_y = torch.ops.ep_moe.scale_permute(grad, weights, pair_of_slot, ctx.num_topk)
    if ctx.weighted and ctx.needs_input_grad[1]:
        grad_w = torch.ops.ep_moe.pair_dot(grad, y, pair_of_slot, ctx.num_topk)
    return grad_y, grad_w, None, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


@torch.library.custom_op("ep_moe::scale_permute", mutates_args=())
def _scale_permute_op(grad: Tensor, weights: Tensor | None, pair_of_slot: Tensor, num_topk: int) -> Tensor:
    if _triton(grad):
        out = torch.empty(pair_of_slot.shape[0], grad.shape[1], dtype=grad.dtype, device=grad.device)
        return permute_triton.run_scale_permute(grad, None if weights is None else weights.contiguous(), pair_of_slot,
                                            num_topk, out)
    return _scale_permute_torch(grad, weights, pair_of_slot, num_topk)


@_scale_permute_op.register_fake
def _(grad, weights, pair_of_slot, num_topk):
    return grad.new_empty(pair_of_slot.shape[0], grad.shape[1])


@torch.library.custom_op("ep_moe::pair_dot", mutates_args=())
def _pair_dot_op(grad: Tensor, y: Tensor, pair_of_slot: Tensor, num_topk: int) -> Tensor:
    if _triton(grad):
        out = torch.empty(pair_of_slot.shape[0], dtype=torch.float32, device=grad.device)
        return permute_triton.run_pair_dot(grad, y.contiguous(), pair_of_slot, num_topk, out)
    return _pair_dot_torch(grad, y, pair_of_slot, num_topk)


@_pair_dot_op.register_fake
def _(grad, y, pair_of_slot, num_topk):
    return torch.empty(pair_of_slot.shape[0], dtype=_acc_dtype(grad), device=grad.device)


# ------------------------------------------------------------------------------------------ public API
def permute_rows(x: Tensor, layout: ExpertLayout) -> Tensor:
    """``x [N, H]`` (any dtype) into ``[M, H]`` expert-major rows, zero on padding. Differentiable: the
    gradient of a row is the fp32 sum of its slots' gradients, rounded once."""
    if x.dim() != 2 or x.shape[0] != layout.num_rows:
        raise ValueError(f"permute_rows: argument 'x' must be [N={layout.num_rows}, H], got {tuple(x.shape)}")
    return torch.ops.ep_moe.permute_rows(x, layout.pair_of_slot, layout.sorted_slots)


def unpermute_sum(y: Tensor, layout: ExpertLayout, weights: Tensor | None = None) -> Tensor:
    """``y [M, H]`` (bf16/fp32) back to ``[N, H]``: each row the fp32 sum over its pairs, in increasing slot
    order, of ``weights[slot] * y[slot]`` (``weights [M]`` fp32; None = 1), rounded once to y's dtype.
    Differentiable in ``y`` and ``weights``."""
    if y.dim() != 2 or y.shape[0] != layout.num_slots:
        raise ValueError(f"unpermute_sum: argument 'y' must be [M={layout.num_slots}, H], got {tuple(y.shape)}")
    if y.dtype not in (torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"unpermute_sum: argument 'y' must be bf16 or fp32 (fp64 for gradcheck), got {y.dtype}")
    weight_dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
    if weights is not None and (weights.shape != (layout.num_slots,) or weights.dtype != weight_dtype):
        raise ValueError(f"unpermute_sum: argument 'weights' must be [M={layout.num_slots}] {weight_dtype}, got "
                         f"{tuple(weights.shape)} {weights.dtype}")
    return torch.ops.ep_moe.unpermute_sum(y, weights, layout.pair_of_slot, layout.sorted_slots)


def pair_values(values: Tensor, layout: ExpertLayout) -> Tensor:
    """``values [N, K]`` (e.g. routing weights) at each slot's pair: ``[M]``, 0 on padding. Differentiable."""
    flat = values.reshape(-1)
    valid = layout.pair_of_slot < flat.shape[0]
    if flat.shape[0] == 0:
        return values.new_zeros(layout.num_slots)
    picked = flat.index_select(0, layout.pair_of_slot.clamp(max=flat.shape[0] - 1))
    return torch.where(valid, picked, torch.zeros_like(picked))


__all__ = ["ExpertLayout", "expert_layout", "max_slots", "pair_values", "permute_rows", "unpermute_sum"]
