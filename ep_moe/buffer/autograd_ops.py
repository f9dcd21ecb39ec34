"""Differentiable dispatch and combine, registered as ``torch.library`` custom ops (`ep_moe.custom_op.CustomOp`:
eager calls skip the dispatcher).

* ``ep_moe::dispatch``: backward = a combine of the gradients (``topk_weights`` too, masked to the
  entries that were local on the receiving rank, the only ones that carry the weight).
* ``ep_moe::combine``: backward = a cached dispatch of the gradient (and of the weights' gradient).
* ``ep_moe::cached_dispatch``: backward = a combine.

Each op has a fake (meta) implementation, so ``torch.compile`` traces through them, and selective
activation checkpointing can name them (``torch.ops.ep_moe.dispatch.default``). The buffer is passed by
its integer id; a dispatch handle travels flattened (`_handle_args`: its six tensors, then its
``num_worst_tokens``) and is rebuilt by `_handle`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..config import Config
from ..custom_op import CustomOp
from .buffer_v1 import Buffer, buffer_by_id
from .dispatch_handle import DispatchHandle


class DispatchOutput(NamedTuple):
    """Result of `dispatch` (N received rows, K top-k, L local experts)."""

    recv_x: Tensor                      # [N, H], x's dtype
    recv_topk_idx: Tensor               # [N, K] int64 local expert ids, -1 elsewhere
    recv_topk_weights: Tensor           # [N, K] fp32, 0 where not local
    num_recv_tokens_per_expert: Tensor  # [L] int64 on the device, aligned
    handle: DispatchHandle
    # The same counts as a CPU tensor when the backend knows them without waiting for the GPU (exact-size
    # dispatch on a backend with `host_expert_counts`: torch and native), else an empty CPU tensor.
    num_recv_tokens_per_expert_host: Tensor


def _handle(rank_prefix_matrix: Tensor, recv_src_idx: Tensor, recv_src_rank: Tensor, is_token_in_rank: Tensor,
            backend_state: Tensor, summation_order: Tensor, num_worst_tokens: int) -> DispatchHandle:
    """The `DispatchHandle` flattened by `_handle_args` (an empty tensor stands for None)."""
    num_recv = -1 if num_worst_tokens else recv_src_idx.shape[0]
    state = backend_state if backend_state.numel() else None
    order = summation_order if summation_order.numel() else None
    return DispatchHandle(rank_prefix_matrix, recv_src_idx, recv_src_rank, is_token_in_rank, num_recv,
                          num_worst_tokens, state, order)


def _handle_args(handle: DispatchHandle) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """A handle as custom-op arguments: its tensors (an empty one for no backend state), then
    ``num_worst_tokens``, which says how to read them (``num_recv_tokens`` follows from both)."""
    device = handle.is_token_in_rank.device
    state = handle.backend_state
    if state is None:
        state = torch.empty(0, dtype=torch.uint8, device=device)
    order = handle.summation_order
    if order is None:
        order = torch.empty(0, handle.num_ranks, dtype=torch.int32, device=device)
    return (handle.rank_prefix_matrix, handle.recv_src_idx, handle.recv_src_rank, handle.is_token_in_rank, state,
            order, handle.num_worst_tokens)


def _config(num_sms: int) -> Config | None:
    """The ops carry only the SM count of a `Config`; 0 means the buffer's default."""
    return Config(num_sms=num_sms) if num_sms > 0 else None


_ALIAS_CHECK = getattr(torch._C, "_any_output_is_alias_to_input_or_output", None)  # (args, kwargs, outputs)


def _fresh(outputs: tuple, inputs: tuple) -> tuple:
    """``outputs`` with a copy wherever one shares memory with an input or an earlier output (torch refuses such
    outputs of a custom op): a view (it shows in ``_base``, except under inference mode) or the same storage (a
    one-rank backend may hand an input back, or two outputs out of one allocation). Empty tensors count too: torch
    compares the storages themselves, so two empty views of one allocation alias."""
    if not any(t._base is not None for t in outputs) and _ALIAS_CHECK is not None and not _ALIAS_CHECK(
            inputs, {}, outputs):
        return outputs  # the common case, every output its own allocation: torch's own check, in one C++ call

    def keys(t) -> set[int]:
        if not isinstance(t, Tensor):
            return set()
        storage = t.untyped_storage()
        return {storage._cdata, storage.data_ptr()} if storage.nbytes() else {storage._cdata}

    taken = set().union(*map(keys, inputs))
    fresh = []
    for t in outputs:
        if t._base is not None or not keys(t).isdisjoint(taken):
            t = t.clone()
        taken |= keys(t)
        fresh.append(t)
    return tuple(fresh)


# ------------------------------------------------------------------------------------------ dispatch
def _dispatch_impl(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, buffer_id: int, num_experts: int,
                   expert_alignment: int, num_worst_tokens: int, num_sms: int
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    buffer = buffer_by_id(buffer_id)
    result, _ = buffer.dispatch_result(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
                                       expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                                       config=_config(num_sms))
    host = torch.empty(0, dtype=torch.int64, device="cpu")
    if _has_host_counts(buffer, num_worst_tokens):
        listed = result.num_recv_tokens_per_expert_list
        host = (torch.tensor(listed, dtype=torch.int64, device="cpu") if listed is not None
                else result.num_recv_tokens_per_expert.cpu())
    outs = (result.recv_x, result.recv_topk_idx, result.recv_topk_weights, result.num_recv_tokens_per_expert,
            *_handle_args(result.handle)[:6])
    return (*_fresh(outs, (x, topk_idx, topk_weights)), host)


def _has_host_counts(buffer: Buffer, num_worst_tokens: int) -> bool:
    """Whether the dispatch op returns the per-expert counts on the host (decided from the backend and the
    mode alone, so that the fake implementation agrees)."""
    return buffer.backend.host_expert_counts and not num_worst_tokens


def _dispatch_fake(x, topk_idx, topk_weights, buffer_id, num_experts, expert_alignment, num_worst_tokens, num_sms):
    buffer = buffer_by_id(buffer_id)
    num_ranks = buffer.group_size
    rows = num_worst_tokens or torch.library.get_ctx().new_dynamic_size()
    num_topk = topk_idx.shape[1]
    int32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty(rows, x.shape[1]), topk_idx.new_empty(rows, num_topk), topk_weights.new_empty(rows, num_topk),
            topk_idx.new_empty(num_experts // num_ranks), torch.empty(num_ranks, num_ranks, **int32),
            torch.empty(rows, **int32), torch.empty(rows, **int32),
            torch.empty(x.shape[0], num_ranks, dtype=torch.bool, device=x.device),
            torch.empty(0, dtype=torch.uint8, device=x.device),
            torch.empty(x.shape[0] if num_ranks > 1 else 0, num_ranks, **int32),
            torch.empty(num_experts // num_ranks if _has_host_counts(buffer, num_worst_tokens) else 0,
                        dtype=torch.int64, device="cpu"))


def _dispatch_setup(ctx, inputs, output):
    ctx.buffer_id, ctx.num_worst_tokens, ctx.num_sms = inputs[3], inputs[6], inputs[7]
    ctx.hidden, ctx.x_dtype = inputs[0].shape[1], inputs[0].dtype
    ctx.save_for_backward(output[1], *output[4:10])  # the received top-k ids and the handle's tensors


def _dispatch_backward(ctx, grad_x, grad_idx, grad_w, *_):
    recv_idx, *handle_tensors = ctx.saved_tensors
    rows = recv_idx.shape[0]
    if grad_x is None:
        grad_x = torch.zeros(rows, ctx.hidden, dtype=ctx.x_dtype, device=recv_idx.device)
    if grad_w is None:
        grad_w = torch.zeros(recv_idx.shape, dtype=torch.float32, device=recv_idx.device)
    # Only the entries local to this rank were copied from the input weights; the others are constant 0.
    grad_w = torch.where(recv_idx >= 0, grad_w, torch.zeros_like(grad_w))
    combined, combined_w = _COMBINE(grad_x.contiguous(), grad_w, None, None, *handle_tensors, ctx.num_worst_tokens,
                                    ctx.buffer_id, ctx.num_sms)
    return combined, None, combined_w, None, None, None, None, None


_DISPATCH = CustomOp("dispatch", _dispatch_impl, _dispatch_setup, _dispatch_backward)
_DISPATCH.op.register_fake(_dispatch_fake)


# ------------------------------------------------------------------------------------------ combine
def _combine_impl(x: Tensor, topk_weights: Tensor | None, bias_0: Tensor | None, bias_1: Tensor | None,
                  rank_prefix_matrix: Tensor, recv_src_idx: Tensor, recv_src_rank: Tensor, is_token_in_rank: Tensor,
                  backend_state: Tensor, summation_order: Tensor, num_worst_tokens: int, buffer_id: int, num_sms: int
                  ) -> tuple[Tensor, Tensor]:
    handle = _handle(rank_prefix_matrix, recv_src_idx, recv_src_rank, is_token_in_rank, backend_state,
                     summation_order, num_worst_tokens)
    combined, combined_w, _ = buffer_by_id(buffer_id).combine(x, handle, topk_weights, (bias_0, bias_1),
                                                              config=_config(num_sms))
    if combined_w is None:
        combined_w = torch.zeros(is_token_in_rank.shape[0], 0, dtype=torch.float32, device=x.device)
    return _fresh((combined, combined_w), (x, topk_weights, bias_0, bias_1))


def _combine_fake(x, topk_weights, bias_0, bias_1, rank_prefix_matrix, recv_src_idx, recv_src_rank, is_token_in_rank,
                  backend_state, summation_order, num_worst_tokens, buffer_id, num_sms):
    num_tokens = is_token_in_rank.shape[0]
    num_topk = topk_weights.shape[1] if topk_weights is not None else 0
    return x.new_empty(num_tokens, x.shape[1]), x.new_empty(num_tokens, num_topk, dtype=torch.float32)


def _combine_setup(ctx, inputs, output):
    x, topk_weights, bias_0, bias_1, *handle_tensors, num_worst_tokens, buffer_id, num_sms = inputs
    ctx.buffer_id, ctx.num_worst_tokens, ctx.num_sms = buffer_id, num_worst_tokens, num_sms
    ctx.has_weights = topk_weights is not None
    ctx.bias_dtypes = tuple(b.dtype if b is not None else None for b in (bias_0, bias_1))
    ctx.save_for_backward(*handle_tensors)


def _combine_backward(ctx, grad_out, grad_w):
    handle_tensors = ctx.saved_tensors
    grad_x = _CACHED_DISPATCH(grad_out.contiguous(), *handle_tensors, ctx.num_worst_tokens, ctx.buffer_id,
                              ctx.num_sms)
    grad_weights = None
    if ctx.has_weights and grad_w is not None:
        num_topk = grad_w.shape[1]
        padded = torch.nn.functional.pad(grad_w, (0, -num_topk % 4))  # 16-byte rows for every backend
        grad_weights = _CACHED_DISPATCH(padded.contiguous(), *handle_tensors, ctx.num_worst_tokens, ctx.buffer_id,
                                        ctx.num_sms)[:, :num_topk]
    grad_bias = [grad_out.to(d) if d is not None else None for d in ctx.bias_dtypes]
    return (grad_x, grad_weights, *grad_bias, None, None, None, None, None, None, None, None, None)


_COMBINE = CustomOp("combine", _combine_impl, _combine_setup, _combine_backward)
_COMBINE.op.register_fake(_combine_fake)


# ------------------------------------------------------------------------------------------ cached dispatch
def _cached_dispatch_impl(x: Tensor, rank_prefix_matrix: Tensor, recv_src_idx: Tensor, recv_src_rank: Tensor,
                          is_token_in_rank: Tensor, backend_state: Tensor, summation_order: Tensor,
                          num_worst_tokens: int, buffer_id: int, num_sms: int) -> Tensor:
    handle = _handle(rank_prefix_matrix, recv_src_idx, recv_src_rank, is_token_in_rank, backend_state,
                     summation_order, num_worst_tokens)
    recv_x, *_ = buffer_by_id(buffer_id).dispatch(x, handle=handle, config=_config(num_sms))
    return _fresh((recv_x,), (x, rank_prefix_matrix, recv_src_idx, recv_src_rank, is_token_in_rank,
                              backend_state, summation_order))[0]


def _cached_dispatch_fake(x, rank_prefix_matrix, recv_src_idx, recv_src_rank, is_token_in_rank, backend_state,
                          summation_order, num_worst_tokens, buffer_id, num_sms):
    return x.new_empty(recv_src_idx.shape[0], x.shape[1])


def _cached_dispatch_setup(ctx, inputs, output):
    ctx.num_worst_tokens, ctx.buffer_id, ctx.num_sms = inputs[7], inputs[8], inputs[9]
    ctx.save_for_backward(*inputs[1:7])


def _cached_dispatch_backward(ctx, grad):
    combined, _ = _COMBINE(grad.contiguous(), None, None, None, *ctx.saved_tensors, ctx.num_worst_tokens,
                           ctx.buffer_id, ctx.num_sms)
    return (combined, None, None, None, None, None, None, None, None, None)


_CACHED_DISPATCH = CustomOp("cached_dispatch", _cached_dispatch_impl, _cached_dispatch_setup,
                            _cached_dispatch_backward)
_CACHED_DISPATCH.op.register_fake(_cached_dispatch_fake)


# ------------------------------------------------------------------------------------------ public API
def dispatch(buffer: Buffer, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, num_experts: int,
             expert_alignment: int = 1, num_worst_tokens: int = 0, num_sms: int = 0) -> DispatchOutput:
    """Send each token to the ranks of its experts, differentiably (docs/semantics.md, "Differentiable ops").

    Args:
        buffer: the EP group's `Buffer`.
        x: ``[T, H]`` bf16/fp32 (fp64 too on the torch backend), the tokens; gradients flow to it.
        topk_idx: ``[T, K]`` int64 global expert ids, -1 for none.
        topk_weights: ``[T, K]`` fp32 routing weights; gradients flow to them.
        num_experts: E, divisible by the group size R.
        expert_alignment: round each local expert's received count up to a multiple of this.
        num_worst_tokens: > 0: every output has exactly this many rows and nothing waits on the host.
        num_sms: > 0: the SM budget of this call and of its backward; 0: the buffer's default.

    Returns:
        A `DispatchOutput`: ``recv_x [N, H]`` in x's dtype, ``recv_topk_idx [N, K]`` int64 local ids or -1,
        ``recv_topk_weights [N, K]`` fp32 (0 where not local), ``num_recv_tokens_per_expert [L]`` int64 on the
        device (aligned), the `DispatchHandle`, and ``num_recv_tokens_per_expert_host``, the same counts as a
        CPU tensor when the backend knows them without waiting for the GPU, else empty.

    Raises:
        ValueError: a bad argument, named (as `Buffer.dispatch`).
        RuntimeError: ``buffer`` was destroyed.
    """
    (recv_x, recv_idx, recv_w, counts, rank_prefix_matrix, recv_src_idx, recv_src_rank, is_token_in_rank,
     state, order, host_counts) = _DISPATCH(x, topk_idx, topk_weights, buffer.buffer_id, num_experts,
                                            expert_alignment, num_worst_tokens, num_sms)
    handle = _handle(rank_prefix_matrix, recv_src_idx, recv_src_rank, is_token_in_rank, state, order,
                     num_worst_tokens)
    return DispatchOutput(recv_x, recv_idx, recv_w, counts, handle, host_counts)


def combine(buffer: Buffer, x: Tensor, handle: DispatchHandle, topk_weights: Tensor | None = None,
            bias: Tensor | tuple[Tensor | None, Tensor | None] | None = None, num_sms: int = 0
            ) -> tuple[Tensor, Tensor | None]:
    """Return each received row to its source and sum per token, differentiably (see `Buffer.combine`).

    Args:
        buffer: the EP group's `Buffer`.
        x: ``[N, H]`` bf16/fp32 (fp64 too on the torch backend), one row per received row of the dispatch
            that made ``handle``; gradients flow to it.
        handle: the `DispatchHandle` of that dispatch.
        topk_weights: ``[N, K]`` fp32 summed the same way, or None; gradients flow to them.
        bias: ``[T, H]`` or a pair of them (either may be None), where the fp32 sum starts; gradients flow to them.
        num_sms: > 0: the SM budget of this call and of its backward; 0: the buffer's default.

    Returns:
        ``(combined [T, H] in x's dtype, combined_topk_weights [T, K] fp32 or None)``.

    Raises:
        ValueError: a bad argument, named (as `Buffer.combine`).
        RuntimeError: ``buffer`` was destroyed.
    """
    bias_0, bias_1 = bias if isinstance(bias, tuple | list) else (bias, None)
    combined, combined_w = _COMBINE(x, topk_weights, bias_0, bias_1, *_handle_args(handle), buffer.buffer_id,
                                    num_sms)
    return combined, (combined_w if topk_weights is not None else None)


def cached_dispatch(buffer: Buffer, x: Tensor, handle: DispatchHandle, num_sms: int = 0) -> Tensor:
    """Re-dispatch new rows with an earlier dispatch's layout, differentiably (a cached dispatch).

    Args:
        buffer: the EP group's `Buffer`.
        x: ``[T, H]`` bf16/fp32 (fp64 too on the torch backend), T the token count of the dispatch that made
            ``handle``; gradients flow to it (the backward is a combine).
        handle: the `DispatchHandle` of that dispatch.
        num_sms: > 0: the SM budget of this call and of its backward; 0: the buffer's default.

    Returns:
        ``recv_x [N, H]`` in x's dtype, the rows in the order of that dispatch (zero padding rows for a fixed-size
        handle).

    Raises:
        ValueError: a bad argument, named (as `Buffer.dispatch` with ``handle``).
        RuntimeError: ``buffer`` was destroyed.
    """
    return _CACHED_DISPATCH(x, *_handle_args(handle), buffer.buffer_id, num_sms)


def cached_dispatch_weights(buffer: Buffer, weights: Tensor, handle: DispatchHandle, num_sms: int = 0) -> Tensor:
    """Differentiable re-dispatch of ``weights [T, K]`` fp32 with an earlier dispatch's layout: ``[N, K]``, each
    received row the source token's K weights (also those of experts on other ranks). They travel as 16-byte rows
    (K padded to a multiple of 4), as the ops' own backward sends them, so that every backend takes them."""
    num_topk = weights.shape[1]
    padded = torch.nn.functional.pad(weights, (0, -num_topk % 4)).contiguous()
    return cached_dispatch(buffer, padded, handle, num_sms)[:, :num_topk]
