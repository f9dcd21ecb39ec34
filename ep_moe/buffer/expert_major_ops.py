"""Expert-major dispatch and weighted combine, differentiable (docs/semantics.md, "Expert-major layout").

`expert_dispatch` sends each token to the ranks of its experts and returns, on every rank, one row per
(source rank s, token t, top-k entry k) whose expert e is local: ordered by e, then s, then t, then k, each
expert's group padded with zero rows to a multiple of the alignment. `expert_combine` returns the experts' rows,
weighted, to their tokens. Both are compositions of the rank-major ops (`ep_moe.buffer.autograd_ops`) with the local permute and
reduce (`ep_moe.permute`), so every backend gives the same bits and autograd needs nothing more: the gradient of
the dispatch is the unweighted combine, the gradient of the combine sends ``w * grad_out[t]`` to each pair's
row and gives each weight ``<grad_out[t], y[row]>`` in fp32. A one-rank group needs no communication: the
rows are permuted from the input directly (same results).

Fixed size (``num_worst_tokens`` > 0, a bound on the rows any rank receives): the outputs have
`ep_moe.permute.max_slots` rows and nothing waits on the host, so the layer can be captured in a CUDA graph.

Where the buffer's backend `receives_in_place` (the native kernels at two or more ranks), the dispatch does not
copy the received rows into rank-major ``recv_x``: its kernel leaves the peers' rows in the receive buffer, and
one permute reads each row there (or, for this rank's own tokens, from ``x``) and writes it into its expert-major
slots (`ep_moe.permute.permute_received_rows`); ``handle.rows_in_place`` says so. Likewise its combine
(``allow_multiple_reduction=True``) does not form the rank-major rows first: the backend sums each row's expert-major
rows, weighted, as it sends the row back (`Buffer.combine_expert_rows`). Same bits, same gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..config import Config
from ..permute import (
    ExpertLayout,
    check_unpermute_args,
    expert_layout,
    max_slots,
    permute_received_rows,
    permute_rows,
    permute_rows_and_values,
    permute_rows_backward,
    unpermute_sum,
    unpermute_sum_backward,
)
from .argument_checks import (
    HIDDEN_DTYPES,
    _fail,
    check_num_experts,
    check_positive_int,
    check_tensor,
    check_topk,
    split_hidden,
)
from .autograd_ops import cached_dispatch, cached_dispatch_weights, combine, dispatch
from .buffer_v1 import Buffer
from .dispatch_handle import DispatchHandle


class ExpertHandle(NamedTuple):
    """What `expert_combine` needs from the matching `expert_dispatch`."""

    layout: ExpertLayout               # the received rows' pairs -> expert-major rows
    dispatch: DispatchHandle | None    # the rank-major dispatch's handle (None on a one-rank group)
    topk_idx: Tensor                   # [T, K] int64: the source's routing (global expert ids)
    num_sms: int                       # the dispatch's SMs; its combine uses the same
    # the backend left the received rows in place and one permute read them there (no rank-major copy)
    rows_in_place: bool = False


class ExpertDispatchOutput(NamedTuple):
    """Result of `expert_dispatch` (M expert-major rows, L local experts)."""

    expert_x: Tensor | tuple[Tensor, Tensor]  # [M, H]: bit-equal copies of the source rows, zero on padding
    #                                            (FP8 input: the pair (rows [M, H], scales [M, H/128] fp32))
    expert_weights: Tensor      # [M] fp32: each row's routing weight, 0 on padding (differentiable)
    tokens_per_expert: Tensor   # [L] int64 on the device: rows per expert, padding included (aligned)
    pairs_per_expert: Tensor    # [L] int64 on the device: (token, expert) pairs per expert (unaligned)
    handle: ExpertHandle
    # the aligned counts on the host when they are known without waiting for the device (exact-size mode on a
    # backend that exchanges them, or one rank), else None
    tokens_per_expert_list: list[int] | None


def expert_dispatch(buffer: Buffer, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, num_experts: int,
                    expert_alignment: int = 1, num_worst_tokens: int = 0, num_sms: int = 0) -> ExpertDispatchOutput:
    """Send each token to the ranks of its experts, one row per (token, local expert) pair, grouped by expert.

    The layout, its sizes and gradients: docs/semantics.md, section "Expert-major layout".

    Args:
        buffer: the EP group's `Buffer`.
        x: ``[T, H]`` bf16/fp32 (differentiable), or the FP8 pair ``(x_e4m3 [T, H], scales [T, H/128] fp32)``
            (forward only, as DeepEP's FP8 dispatch: no gradient reaches ``x`` or ``topk_weights``).
        topk_idx: ``[T, K]`` int64 global expert ids, -1 for none.
        topk_weights: ``[T, K]`` fp32 routing weights (differentiable for a bf16/fp32 ``x``).
        num_experts: E, divisible by the group size R; L = E / R are local.
        expert_alignment: pad each local expert's rows with zero rows to a multiple of this (A).
        num_worst_tokens: > 0: fixed size, a bound on the rows any rank receives (one rank: ``T`` at most);
            ``M = num_worst_tokens * min(K, L) + L * (A - 1)`` and nothing waits on the host.
        num_sms: > 0: the SM budget of this dispatch, its combine and their backward.

    Returns:
        An `ExpertDispatchOutput`: ``expert_x [M, H]`` (bit-equal copies of the source rows, zero on padding; the
        pair of rows and scales for FP8), ``expert_weights [M]`` fp32 (0 on padding), ``tokens_per_expert [L]``
        and ``pairs_per_expert [L]`` int64 on the device (aligned, unaligned), the `ExpertHandle`, and
        ``tokens_per_expert_list``, the aligned counts on the host when known without a sync, else None.

    Raises:
        ValueError: a bad argument, named.
    """
    op = "expert_dispatch"
    check_positive_int(op, "expert_alignment", expert_alignment, 1)
    check_positive_int(op, "num_worst_tokens", num_worst_tokens, 0)
    check_num_experts(op, num_experts, buffer.group_size)
    local = num_experts // buffer.group_size
    num_topk = topk_idx.shape[1] if topk_idx.dim() == 2 else 0
    if isinstance(x, tuple | list):
        return _expert_dispatch_fp8(buffer, x, topk_idx, topk_weights, num_experts, expert_alignment,
                                    num_worst_tokens, num_sms)
    if buffer.group_size == 1:
        check_tensor(op, "x", x, dtypes=buffer.backend.supported_dtypes, ndim=2, device=buffer.device)
        return local_expert_dispatch(x, topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens,
                                     check_values=buffer.check_inputs, num_sms=num_sms)
    if _takes_rows_in_place(buffer, x, num_experts):
        box: dict = {}
        expert_x, expert_weights = _ExpertDispatchInPlace.apply(x, topk_weights, buffer, topk_idx, num_experts,
                                                                expert_alignment, num_worst_tokens, num_sms, box)
        result, layout = box["result"], box["layout"]
        handle = ExpertHandle(layout, result.handle, topk_idx, num_sms, True)
        counts = None if num_worst_tokens else result.num_recv_tokens_per_expert_list
        return ExpertDispatchOutput(expert_x, expert_weights, layout.tokens_per_expert, layout.pairs_per_expert,
                                    handle, counts)
    out = dispatch(buffer, x, topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens, num_sms)
    host = out.num_recv_tokens_per_expert_host
    if num_worst_tokens:
        num_slots = max_slots(num_worst_tokens, num_topk, local, expert_alignment)
    else:
        num_slots = int(host.sum()) if host.numel() else None  # else one host read, in expert_layout
    layout = expert_layout(out.recv_topk_idx, local, expert_alignment, num_slots)
    handle = ExpertHandle(layout, out.handle, topk_idx, num_sms)
    expert_x, expert_weights = permute_rows_and_values(out.recv_x, out.recv_topk_weights, layout)
    if host.numel():
        counts = host.tolist()
    else:
        counts = None if layout.tokens_per_expert_host is None else layout.tokens_per_expert_host.tolist()
    return ExpertDispatchOutput(expert_x, expert_weights, layout.tokens_per_expert, layout.pairs_per_expert, handle,
                                counts)


def _expert_dispatch_fp8(buffer: Buffer, x, topk_idx: Tensor, topk_weights: Tensor, num_experts: int,
                         alignment: int, num_worst_tokens: int, num_sms: int) -> ExpertDispatchOutput:
    """`expert_dispatch` of an FP8 pair: the rank-major dispatch of `Buffer` (which carries the scales), then
    the permute of rows and scales by one layout. No autograd."""
    op = "expert_dispatch"
    num_ranks = buffer.group_size
    local = num_experts // num_ranks
    data, scales = split_hidden(op, x, buffer.device)
    topk_weights = topk_weights.detach() if isinstance(topk_weights, Tensor) else topk_weights
    if num_ranks > 1 and _takes_rows_in_place(buffer, data, num_experts):
        result, layout, expert_x, expert_weights, expert_scales = _dispatch_in_place(
            buffer, (data, scales), topk_idx, topk_weights, num_experts, alignment, num_worst_tokens, num_sms)
        handle = ExpertHandle(layout, result.handle, topk_idx, num_sms, True)
        return ExpertDispatchOutput((expert_x, expert_scales), expert_weights, layout.tokens_per_expert,
                                    layout.pairs_per_expert, handle,
                                    None if num_worst_tokens else result.num_recv_tokens_per_expert_list)
    if num_ranks == 1:
        check_topk(op, topk_idx, topk_weights, data.shape[0], num_experts, data.device,
                   buffer.check_inputs and not num_worst_tokens and not torch.compiler.is_compiling()
                   and not (data.is_cuda and torch.cuda.is_current_stream_capturing()))
        if num_worst_tokens and data.shape[0] > num_worst_tokens:
            raise _fail(op, "num_worst_tokens", f">= the {data.shape[0]} tokens here (one rank receives its own)",
                        num_worst_tokens)
        recv_x, recv_scales, recv_idx, recv_w, host, inner = data, scales, topk_idx, topk_weights, None, None
    else:
        result, _ = buffer.dispatch_result((data, scales), topk_idx=topk_idx, topk_weights=topk_weights,
                                           expert_alignment=alignment, num_worst_tokens=num_worst_tokens,
                                           config=Config(num_sms) if num_sms else None, num_experts=num_experts)
        recv_x, recv_scales, recv_idx, recv_w = (result.recv_x, result.recv_scales, result.recv_topk_idx,
                                                 result.recv_topk_weights)
        host, inner = (None if num_worst_tokens else result.num_recv_tokens_per_expert_list), result.handle
    if num_worst_tokens:
        num_slots = max_slots(num_worst_tokens, topk_idx.shape[1], local, alignment)
    else:
        num_slots = sum(host) if host is not None else None  # else one host read, in expert_layout
    layout = expert_layout(recv_idx, local, alignment, num_slots)
    with torch.no_grad():
        expert_x, expert_weights = permute_rows_and_values(recv_x, recv_w, layout)
        expert_scales = permute_rows(recv_scales, layout)
    if host is None and layout.tokens_per_expert_host is not None:
        host = layout.tokens_per_expert_host.tolist()
    return ExpertDispatchOutput((expert_x, expert_scales), expert_weights, layout.tokens_per_expert,
                                layout.pairs_per_expert, ExpertHandle(layout, inner, topk_idx, num_sms),
                                None if num_worst_tokens else host)


def _takes_rows_in_place(buffer: Buffer, x, num_experts: int) -> bool:
    """Whether this dispatch leaves the received rows in place (decided from shapes and the backend alone, the
    same on every rank; not while torch.compile traces: the rank-major ops are the traceable path)."""
    return (isinstance(x, Tensor) and x.dim() == 2 and not torch.compiler.is_compiling()
            and buffer.receives_in_place(x, num_experts))


def _dispatch_in_place(buffer: Buffer, x, topk_idx: Tensor, topk_weights: Tensor, num_experts: int, alignment: int,
                       num_worst_tokens: int, num_sms: int):
    """The dispatch that leaves its received rows in place, then, on its stream, the layout of the received
    top-k and the permute of rows (and FP8 scales) straight from the receive buffer and ``x``: ``(result,
    layout, expert_x, expert_weights, expert_scales or None)``. No autograd."""
    local = num_experts // buffer.group_size

    def consume(result, received):
        # Runs right after the dispatch kernel on its stream (the arguments checked), before any later call of this
        # buffer (whose kernels come behind it on that stream) lets the peers write the receive buffer again.
        if num_worst_tokens:
            num_slots = max_slots(num_worst_tokens, result.recv_topk_idx.shape[1], local, alignment)
        else:
            listed = result.num_recv_tokens_per_expert_list
            num_slots = sum(listed) if listed is not None else None  # else one host read, in expert_layout
        layout = expert_layout(result.recv_topk_idx, local, alignment, num_slots)
        own = (received.own_tokens, received.rank_prefix_matrix, received.rank)
        rows, slot_weights = permute_received_rows(received.rows, received.num_rows, received.own_x, *own, layout,
                                                   result.recv_topk_weights)
        scales = None
        if received.scales is not None:
            scales, _ = permute_received_rows(received.scales, received.num_rows, received.own_scales, *own, layout)
        return layout, rows, slot_weights, scales

    result, _ = buffer.dispatch_result(x, topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=alignment,
                                       num_worst_tokens=num_worst_tokens, config=Config(num_sms) if num_sms else None,
                                       num_experts=num_experts, consume_in_place=consume)
    return (result, *result.consumed)


class _ExpertDispatchInPlace(torch.autograd.Function):
    """(x [T, H], topk_weights [T, K]) -> (expert_x [M, H], expert_weights [M]) by `_dispatch_in_place` (the
    result and layout go into ``box``). The backward is the composed path's: the permute's gradient to
    rank-major rows (`permute_rows_backward`), then the rank-major dispatch's (a combine of those rows and of
    the weights' gradients masked to the local entries), bit for bit."""

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, num_experts, alignment, num_worst_tokens, num_sms, box):
        result, layout, expert_x, expert_weights, _ = _dispatch_in_place(
            buffer, x, topk_idx, topk_weights, num_experts, alignment, num_worst_tokens, num_sms)
        box.update(result=result, layout=layout)
        ctx.buffer, ctx.num_sms, ctx.handle, ctx.layout = buffer, num_sms, result.handle, layout
        ctx.recv_idx = result.recv_topk_idx
        ctx.rows_shape, ctx.rows_dtype = expert_x.shape, expert_x.dtype
        return expert_x, expert_weights

    @staticmethod
    def backward(ctx, grad_rows, grad_weights):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_w):
            return (None,) * 9
        layout, recv_idx = ctx.layout, ctx.recv_idx
        if grad_rows is None:  # only the weights were used
            grad_rows = torch.zeros(ctx.rows_shape, dtype=ctx.rows_dtype, device=recv_idx.device)
        if need_w and grad_weights is None:  # only the rows were used
            grad_weights = torch.zeros(ctx.rows_shape[0], dtype=torch.float32, device=recv_idx.device)
        grad_recv_x, grad_recv_w = permute_rows_backward(grad_rows, grad_weights if need_w else None, layout)
        if grad_recv_w is None:
            grad_recv_w = torch.zeros(recv_idx.shape, dtype=torch.float32, device=recv_idx.device)
        # only the entries local to this rank carry a weight; the others are constant 0
        grad_recv_w = torch.where(recv_idx >= 0, grad_recv_w, torch.zeros_like(grad_recv_w))
        grad_x, grad_w = combine(ctx.buffer, grad_recv_x, ctx.handle, grad_recv_w, num_sms=ctx.num_sms)
        return (grad_x if need_x else None), (grad_w if need_w else None), None, None, None, None, None, None, None


def expert_cached_dispatch(buffer: Buffer, x, handle: ExpertHandle, topk_weights: Tensor | None = None,
                           num_sms: int = 0) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor | None]:
    """Dispatch new rows with the routing and layout of an earlier `expert_dispatch` (no routing is sent again).

    Where the rows travel (in place or by the rank-major cached dispatch): docs/semantics.md, "Expert-major layout".

    Args:
        buffer: the EP group's `Buffer`.
        x: ``[T, H]`` bf16/fp32 (differentiable), or the FP8 pair ``(x_e4m3 [T, H], scales [T, H/128] fp32)``
            (forward only); T the token count of the dispatch that made ``handle``.
        handle: the `ExpertHandle` of that dispatch.
        topk_weights: ``[T, K]`` fp32 (differentiable), or None.
        num_sms: > 0: the SM budget of this call and its backward; 0: the handle's.

    Returns:
        ``(expert_x [M, H] (the pair of rows and scales for FP8), expert_weights [M] fp32 or None)``: bit for bit
        what `expert_dispatch` returns for these ``x`` and ``topk_weights`` with the handle's routing, gradients
        included (the backward is the unweighted expert-major combine, as the fresh dispatch's).

    Raises:
        ValueError: a bad argument, named (``handle``, ``num_sms``, ``x``, ``topk_weights``).
    """
    op = "expert_cached_dispatch"
    if not isinstance(handle, ExpertHandle):
        raise _fail(op, "handle", "the ExpertHandle of expert_dispatch", type(handle).__name__)
    check_positive_int(op, "num_sms", num_sms, 0)
    num_sms = num_sms or handle.num_sms
    fp8 = isinstance(x, tuple | list)
    if fp8:
        data, scales = split_hidden(op, x, buffer.device)
    else:
        check_tensor(op, "x", x, dtypes=buffer.backend.supported_dtypes, ndim=2, device=buffer.device)
        data, scales = x, None
    if data.shape[0] != handle.topk_idx.shape[0]:
        raise _fail(op, "x", f"[T={handle.topk_idx.shape[0]}, H] (the handle's dispatch)", tuple(data.shape))
    if topk_weights is not None:
        check_tensor(op, "topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2, device=data.device,
                     shape=tuple(handle.topk_idx.shape))
    layout = handle.layout
    if handle.dispatch is not None and _takes_cached_rows_in_place(buffer, data):
        if fp8:
            weights = None if topk_weights is None else topk_weights.detach()
            expert_x, expert_w, expert_scales = _cached_dispatch_in_place(buffer, (data, scales), handle, weights,
                                                                          num_sms)
            return (expert_x, expert_scales), expert_w
        expert_x, expert_w = _ExpertCachedDispatchInPlace.apply(x, topk_weights, buffer, handle, num_sms)
        return expert_x, (expert_w if topk_weights is not None else None)
    if fp8:  # the rank-major cached dispatch of `Buffer` carries the scales; no autograd
        with torch.no_grad():
            rows = (data, scales) if handle.dispatch is None else \
                buffer.dispatch((data, scales), handle=handle.dispatch, config=Config(num_sms) if num_sms else None)[0]
            recv_w = topk_weights if topk_weights is None or handle.dispatch is None else \
                cached_dispatch_weights(buffer, topk_weights, handle.dispatch, num_sms)
            expert_w = None
            if recv_w is None:
                expert_x = permute_rows(rows[0], layout)
            else:
                expert_x, expert_w = permute_rows_and_values(rows[0], recv_w, layout)
            return (expert_x, permute_rows(rows[1], layout)), expert_w
    rows = x if handle.dispatch is None else cached_dispatch(buffer, x, handle.dispatch, num_sms)
    if topk_weights is None:
        return permute_rows(rows, layout), None
    recv_w = topk_weights if handle.dispatch is None else \
        cached_dispatch_weights(buffer, topk_weights, handle.dispatch, num_sms)
    return permute_rows_and_values(rows, recv_w, layout)


def _takes_cached_rows_in_place(buffer: Buffer, data: Tensor) -> bool:
    """Whether a cached dispatch of ``data`` leaves the received rows in place (shapes and backend alone: the same
    on every rank; not while torch.compile traces)."""
    return not torch.compiler.is_compiling() and buffer.receives_in_place(data, 0)


def _cached_dispatch_in_place(buffer: Buffer, x, handle: ExpertHandle, topk_weights: Tensor | None, num_sms: int):
    """The cached dispatch of ``x`` (a tensor or the FP8 pair) that leaves its received rows in place, then, on its
    stream, the permute of rows (and scales) by the handle's layout straight from the receive buffer and ``x``:
    ``(expert_x, expert_weights or None, expert_scales or None)``. The weights go first, by their own (rank-major)
    cached dispatch. No autograd."""
    layout = handle.layout
    recv_w = None if topk_weights is None else cached_dispatch_weights(buffer, topk_weights, handle.dispatch,
                                                                        num_sms)

    def consume(result, received):
        # Runs right after the dispatch kernel on its stream, before any later call of this buffer lets the peers
        # write the receive buffer again (see `_dispatch_in_place`).
        own = (received.own_tokens, received.rank_prefix_matrix, received.rank)
        rows, slot_weights = permute_received_rows(received.rows, received.num_rows, received.own_x, *own, layout,
                                                   recv_w)
        scales = None
        if received.scales is not None:
            scales, _ = permute_received_rows(received.scales, received.num_rows, received.own_scales, *own, layout)
        return rows, slot_weights, scales

    result, _ = buffer.dispatch_result(x, handle=handle.dispatch, config=Config(num_sms) if num_sms else None,
                                       consume_in_place=consume)
    return result.consumed


class _ExpertCachedDispatchInPlace(torch.autograd.Function):
    """(x [T, H], topk_weights [T, K] or None) -> (expert_x [M, H], expert_weights [M] (empty without weights)) by
    `_cached_dispatch_in_place`. The backward is the fresh dispatch's (`_ExpertDispatchInPlace`): the permute's
    gradient to rank-major rows, then one rank-major combine of those rows and of the weights' gradients."""

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, handle, num_sms):
        expert_x, expert_weights, _ = _cached_dispatch_in_place(buffer, x, handle, topk_weights, num_sms)
        ctx.buffer, ctx.handle, ctx.num_sms = buffer, handle, num_sms
        ctx.rows_shape, ctx.rows_dtype = expert_x.shape, expert_x.dtype
        ctx.has_weights = topk_weights is not None
        if expert_weights is None:
            expert_weights = expert_x.new_empty(0, dtype=torch.float32)
        return expert_x, expert_weights

    @staticmethod
    def backward(ctx, grad_rows, grad_weights):
        need_x, need_w = ctx.needs_input_grad[0], ctx.has_weights and ctx.needs_input_grad[1]
        if not (need_x or need_w):
            return None, None, None, None, None
        layout = ctx.handle.layout
        device = layout.slot_of_pair.device
        if grad_rows is None:  # only the weights were used
            grad_rows = torch.zeros(ctx.rows_shape, dtype=ctx.rows_dtype, device=device)
        # with weights, their gradients always travel (zeros where unused), so the combine is the same collective on
        # every rank
        if ctx.has_weights and grad_weights is None:  # only the rows were used
            grad_weights = torch.zeros(ctx.rows_shape[0], dtype=torch.float32, device=device)
        grad_recv_x, grad_recv_w = permute_rows_backward(grad_rows, grad_weights if ctx.has_weights else None, layout)
        grad_x, grad_w = combine(ctx.buffer, grad_recv_x, ctx.handle.dispatch, grad_recv_w, num_sms=ctx.num_sms)
        return (grad_x if need_x else None), (grad_w if need_w else None), None, None, None


def local_expert_dispatch(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, num_experts: int,
                          expert_alignment: int = 1, num_worst_tokens: int = 0, *, check_values: bool = True,
                          num_sms: int = 0, expert_capacity: int = 0) -> ExpertDispatchOutput:
    """`expert_dispatch` with every expert in this process (a one-rank group, or no group at all): the
    tokens are the received rows, in order, so they are permuted directly. ``check_values``: also check the
    expert ids' range (a host sync; never during CUDA-graph capture or in fixed size).

    ``expert_capacity`` C > 0 (alignment 1, exact size): every expert gets exactly C rows (``M = L * C``, as
    DeepSpeed's capacity buffer), its first C pairs in (token, k) order and zero padding; a pair past C is
    dropped (its token gets nothing from that expert). The counts are ``[C] * L`` on the host, with no host read."""
    op = "expert_dispatch"
    check_positive_int(op, "expert_alignment", expert_alignment, 1)
    check_positive_int(op, "num_worst_tokens", num_worst_tokens, 0)
    check_positive_int(op, "expert_capacity", expert_capacity, 0)
    if expert_capacity and (expert_alignment != 1 or num_worst_tokens):
        raise _fail(op, "expert_capacity", "0 unless expert_alignment is 1 and num_worst_tokens 0",
                    expert_capacity)
    if not isinstance(x, Tensor):
        raise _fail(op, "x", "a [T, H] tensor", type(x).__name__)
    check_tensor(op, "x", x, dtypes=HIDDEN_DTYPES + (torch.float64,), ndim=2, device=x.device)
    # the ids' range is checked with a host read: never while a graph is captured or traced, nor in fixed size
    check_values = check_values and not num_worst_tokens and not torch.compiler.is_compiling()
    check_values = check_values and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
    check_topk(op, topk_idx, topk_weights, x.shape[0], num_experts, x.device, check_values)
    if num_worst_tokens and x.shape[0] > num_worst_tokens:
        raise _fail(op, "num_worst_tokens", f">= the {x.shape[0]} tokens here (one rank receives its own)",
                    num_worst_tokens)
    num_slots = max_slots(num_worst_tokens, topk_idx.shape[1], num_experts, expert_alignment) \
        if num_worst_tokens else None
    layout = expert_layout(topk_idx, num_experts, expert_alignment, num_slots, expert_capacity)
    handle = ExpertHandle(layout, None, topk_idx, num_sms)
    counts = None if num_worst_tokens else layout.tokens_per_expert_host.tolist()
    expert_x, expert_weights = permute_rows_and_values(x, topk_weights, layout)
    return ExpertDispatchOutput(expert_x, expert_weights, layout.tokens_per_expert, layout.pairs_per_expert, handle,
                                counts)


def expert_combine(buffer: Buffer, y: Tensor, handle: ExpertHandle, weights: Tensor | None = None,
                   allow_multiple_reduction: bool = True) -> Tensor:
    """Return the expert-major rows of an `expert_dispatch` to their tokens and sum them, weighted.

    Both summation orders: docs/semantics.md, section "Expert-major layout", paragraph "Combine".

    Args:
        buffer: the EP group's `Buffer`.
        y: ``[M, H]`` bf16/fp32, the expert-major rows of the dispatch that made ``handle``; differentiable.
        handle: the `ExpertHandle` of that dispatch.
        weights: ``[M]`` fp32 to weight each row by (differentiable), or None for plain sums.
        allow_multiple_reduction: True: every rank sums ``w * y`` over its rows of a token in top-k order in fp32,
            rounds to y's dtype and sends one row back; the source sums those rows in fp32 in DeepEP V2's order
            and rounds once. False: the source sums ``w * y`` over all of the token's rows in top-k order in fp32
            and rounds once (each row crosses as fp32: ``[N, K * H]`` rows, which the native buffer must hold).

    Returns:
        ``[T, H]`` in y's dtype, T the tokens of the dispatch on this rank.

    Raises:
        ValueError: ``handle`` is not an `ExpertHandle`, or ``y`` is not ``[M, H]`` with the handle's M.
    """
    op = "expert_combine"
    if not isinstance(handle, ExpertHandle):
        raise _fail(op, "handle", "the ExpertHandle of expert_dispatch", type(handle).__name__)
    layout = handle.layout
    if not isinstance(y, Tensor) or y.dim() != 2 or y.shape[0] != layout.num_slots:
        raise _fail(op, "y", f"a [M={layout.num_slots}, H] tensor (M from the handle's dispatch)",
                    tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__)
    if handle.dispatch is not None and allow_multiple_reduction and _combines_expert_rows(buffer, y):
        check_unpermute_args(y, layout, weights)
        return _ExpertCombineRows.apply(y, weights, buffer, handle)
    if handle.dispatch is None or allow_multiple_reduction:
        rows = unpermute_sum(y, layout, weights)  # all experts in one process: both modes are this sum
        if handle.dispatch is None:
            return rows
        return combine(buffer, rows, handle.dispatch, num_sms=handle.num_sms)[0]
    return _combine_each_pair(buffer, y, handle, weights)


def _combines_expert_rows(buffer: Buffer, y: Tensor) -> bool:
    """Whether this combine sums the expert-major rows as they go out (shapes and backend alone: the same on every
    rank; not while torch.compile traces)."""
    return (y.dtype in (torch.bfloat16, torch.float32) and not torch.compiler.is_compiling()
            and buffer.combines_expert_rows(y))


class _ExpertCombineRows(torch.autograd.Function):
    """(y [M, H], weights [M] or None) -> [T, H] by `Buffer.combine_expert_rows`. The backward is the composed
    path's (a cached dispatch of the output's gradient, then `unpermute_sum`'s gradient), bit for bit."""

    @staticmethod
    def forward(ctx, y, weights, buffer, handle):
        config = Config(num_sms=handle.num_sms) if handle.num_sms > 0 else None
        out = buffer.combine_expert_rows(y, handle.dispatch, handle.layout.slot_of_pair, weights, config)
        ctx.save_for_backward(y, weights)
        ctx.buffer, ctx.handle = buffer, handle
        return out

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensors
        handle = ctx.handle
        grad_rows = cached_dispatch(ctx.buffer, grad.contiguous(), handle.dispatch, handle.num_sms)
        need_w = weights is not None and ctx.needs_input_grad[1]
        grad_y, grad_w = unpermute_sum_backward(grad_rows, y, handle.layout, weights, ctx.needs_input_grad[0], need_w)
        return grad_y, grad_w, None, None


def local_expert_combine(y: Tensor, handle: ExpertHandle, weights: Tensor | None = None) -> Tensor:
    """`expert_combine` of a `local_expert_dispatch` (no group): ``[T, H]``."""
    if not isinstance(handle, ExpertHandle) or handle.dispatch is not None:
        raise _fail("expert_combine", "handle", "the ExpertHandle of local_expert_dispatch", type(handle).__name__)
    return unpermute_sum(y, handle.layout, weights)


def _combine_each_pair(buffer: Buffer, y: Tensor, handle: ExpertHandle, weights: Tensor | None) -> Tensor:
    """``allow_multiple_reduction=False`` (`_sum_each_pair`), differentiable by `_ExactCombine` (while torch.compile
    traces: by autograd through the ops, the same gradients with a K times wider backward)."""
    if torch.compiler.is_compiling():
        return _sum_each_pair(buffer, y, handle, weights)
    return _ExactCombine.apply(y, weights, buffer, handle)


def _sum_each_pair(buffer: Buffer, y: Tensor, handle: ExpertHandle, weights: Tensor | None) -> Tensor:
    """``allow_multiple_reduction=False`` in one rank-major combine: received row i carries, as its column block k
    (fp32, ``[N, K * H]``), ``w * y`` of its pair (i, k), 0 where it has none; a token gets each column block from
    exactly one rank (the others send 0), so the combine's fp32 sum over ranks is exact, and the K blocks reach the
    source bit for bit (the bytes of K combines of ``[N, H]`` fp32 in one collective). The source then sums the
    K blocks in top-k order in fp32 and rounds once."""
    layout = handle.layout
    num_rows, num_topk = layout.slot_of_pair.shape
    hidden = y.shape[1]
    products = _pair_products(y, weights)
    slots = layout.slot_of_pair.reshape(-1)  # pair (i, k) at i * K + k: row i's K blocks side by side
    if y.shape[0]:
        picked = products.index_select(0, slots.clamp(min=0))
        rows = torch.where((slots >= 0).unsqueeze(1), picked, 0.0)
    else:
        # A rank that received no pair (y is [0, H]) still sends its zero rows through the autograd graph
        # (``+ products.sum()`` adds an exact 0): the combine's backward is a collective every rank must enter.
        rows = products.new_zeros(slots.shape[0], hidden) + products.sum()
    blocks = combine(buffer, rows.view(num_rows, num_topk * hidden), handle.dispatch, num_sms=handle.num_sms)[0]
    num_tokens = handle.topk_idx.shape[0]
    ranked = blocks.view(num_tokens, num_topk, hidden)  # in top-k order (an entry without an expert: 0)
    # The order of the fp32 sum is the contract: one add per k, from 0 (no reduction op keeps that order on
    # every device).
    acc = torch.zeros_like(ranked[:, 0])
    for k in range(num_topk):
        acc = acc + ranked[:, k]
    return acc.to(y.dtype)


def _pair_products(y: Tensor, weights: Tensor | None) -> Tensor:
    """Each slot's ``w * y`` in fp32 (fp64 with fp64 weights, as in gradcheck), or ``y`` in fp32 without weights."""
    return y.float() if weights is None else weights.unsqueeze(1) * y.float()


class _ExactCombine(torch.autograd.Function):
    """(y [M, H], weights [M] or None) -> [T, H] by `_sum_each_pair`. The backward sends the output's gradient
    ``g [T, H]`` once (a cached dispatch of ``[T, H]``, not of the K blocks, each of which gets the same ``g``):
    every pair's slot gets its token's ``g``, so ``grad_y = w * g`` (rounded to y's dtype) and ``grad_w = <g, y>``
    (fp32) -- the gradients autograd derives through `_sum_each_pair`, bit for bit (``g`` is taken as ``g + 0``,
    as the sums into zeros there take it, so a -0 arrives as +0)."""

    @staticmethod
    def forward(ctx, y, weights, buffer, handle):
        out = _sum_each_pair(buffer, y, handle, weights)
        ctx.save_for_backward(y, weights)
        ctx.buffer, ctx.handle = buffer, handle
        return out

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensors
        handle = ctx.handle
        need_y, need_w = ctx.needs_input_grad[0], weights is not None and ctx.needs_input_grad[1]
        acc_dtype = torch.promote_types(torch.float32, weights.dtype) if weights is not None else torch.float32
        g = grad.to(acc_dtype) + 0.0
        received = cached_dispatch(ctx.buffer, g.contiguous(), handle.dispatch, handle.num_sms)
        at_slots = permute_rows(received, handle.layout)  # [M, H]: each pair's token's g, 0 on padding
        grad_y = grad_w = None
        if need_y:
            grad_y = (at_slots if weights is None else at_slots * weights.unsqueeze(1)).to(y.dtype)
        if need_w:
            grad_w = (at_slots * y.float()).sum(1)
        return grad_y, grad_w, None, None


__all__ = ["ExpertDispatchOutput", "ExpertHandle", "expert_cached_dispatch", "expert_combine", "expert_dispatch",
           "local_expert_combine", "local_expert_dispatch"]
