"""`TokenDispatcher`: what an MoE layer calls. It dispatches tokens to the ranks of their experts,
groups the received (token, expert) pairs by local expert (padded for a grouped GEMM), and undoes all
of that in `combine`. Differentiable end to end."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .buffer import Buffer
from .handle import DispatchHandle
from .layout import count_values
from .ops import combine, dispatch


@dataclass
class DispatchContext:
    """What `TokenDispatcher.combine` needs from the matching `TokenDispatcher.dispatch`."""

    handle: DispatchHandle
    row_of_slot: Tensor  # [M] int64: received row feeding each expert-input slot; N for padding slots
    num_recv_rows: int   # N
    num_tokens: int      # T
    num_sms: int         # SMs the dispatch used; its combine uses the same


class TokenDispatcher:
    """Expert-parallel token dispatcher over one `Buffer`.

    Args:
        buffer: the EP group's `Buffer`; its group size R must divide ``num_experts``.
        num_experts: E, all experts of the layer; this rank holds ``E / R`` of them (L).
        expert_alignment: pad each local expert's group of rows to a multiple of this (zero rows, prob 0).
        num_worst_tokens: if > 0, fixed-size outputs and no host sync (see `Buffer.dispatch`).
        num_sms: SMs for this layer's dispatch and combine; 0 = on the native backend, the tuning plan of
            this layer's shape (`ep_moe.tuning.plan_for_layer`, made on the first call, with its
            overrides), elsewhere the buffer's default.
        layer: this layer's name or index among the MoE layers (how plan overrides address it).
    """

    def __init__(self, buffer: Buffer, num_experts: int, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 num_sms: int = 0, layer: int | str | None = None):
        if num_experts % buffer.group_size:
            raise ValueError(f"TokenDispatcher: argument 'num_experts' must be divisible by the EP size "
                             f"{buffer.group_size}, got {num_experts}")
        self.buffer = buffer
        self.num_experts = num_experts
        self.num_local_experts = num_experts // buffer.group_size
        self.expert_alignment = expert_alignment
        self.num_worst_tokens = num_worst_tokens
        self.num_sms = num_sms
        self.layer = layer
        self.plan = None  # the CommPlan, once made

    def dispatch(self, hidden: Tensor, topk_idx: Tensor, topk_weights: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, DispatchContext]:
        """Send tokens to their experts' ranks and group them by local expert.

        Args:
            hidden: ``[T, H]`` bf16/fp32. topk_idx: ``[T, K]`` int64 global expert ids (-1 = none).
            topk_weights: ``[T, K]`` fp32 routing probabilities.

        Returns:
            ``expert_input [M, H]`` (rows of local expert 0, then 1, ...; each group padded to
            ``expert_alignment``), ``expert_probs [M]`` fp32 (the routing weight of each row, 0 for
            padding), ``tokens_per_expert [L]`` int64 on the device (padded group sizes), and the
            context for `combine`.
        """
        num_sms = self._num_sms(hidden, topk_idx)
        out = dispatch(self.buffer, hidden, topk_idx, topk_weights, self.num_experts, self.expert_alignment,
                       self.num_worst_tokens, num_sms)
        num_rows, num_topk = out.recv_topk_idx.shape
        local = self.num_local_experts
        flat = out.recv_topk_idx.flatten()
        key = torch.where(flat >= 0, flat, local)
        order = torch.sort(key, stable=True).indices  # pairs by (expert, row, k)
        counts = count_values(key, local + 1)[:local]
        padded = out.num_recv_tokens_per_expert
        if self.num_worst_tokens:
            num_slots = self.num_worst_tokens * min(num_topk, local) + local * (self.expert_alignment - 1)
        else:
            num_slots = int(padded.sum())
        first_pair = torch.cumsum(counts, 0) - counts
        first_slot = torch.cumsum(padded, 0) - padded
        sorted_key = key[order]
        is_pair = sorted_key < local
        expert = sorted_key.clamp(max=local - 1)
        position = torch.arange(order.numel(), device=order.device)
        slot = torch.where(is_pair, first_slot[expert] + position - first_pair[expert], num_slots)
        pair_of_slot = torch.full((num_slots + 1,), order.numel(), dtype=torch.int64, device=order.device)
        pair_of_slot.index_copy_(0, slot, torch.where(is_pair, order, order.numel()))
        pair_of_slot = pair_of_slot[:num_slots]
        row_of_slot = torch.where(pair_of_slot < order.numel(), pair_of_slot // max(num_topk, 1), num_rows)

        hidden_size = hidden.shape[1]
        padded_x = torch.cat([out.recv_x, out.recv_x.new_zeros(1, hidden_size)])
        expert_input = padded_x.index_select(0, row_of_slot)
        padded_w = torch.cat([out.recv_topk_weights.flatten(), out.recv_topk_weights.new_zeros(1)])
        expert_probs = padded_w.index_select(0, pair_of_slot)
        ctx = DispatchContext(out.handle, row_of_slot, num_rows, hidden.shape[0], num_sms)
        return expert_input, expert_probs, padded, ctx

    def _num_sms(self, hidden: Tensor, topk_idx: Tensor) -> int:
        """The SM count of this layer: the explicit one, else (native backend) its tuning plan."""
        if self.num_sms or self.buffer.backend_name != "native":
            return self.num_sms
        if self.plan is None:
            from .tuning import plan_for_layer

            # Ranks may hold different token counts; plan for the largest so that all agree (one
            # collective, on the first call only).
            tokens = torch.tensor([hidden.shape[0]], device=self.buffer.device)
            torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MAX, group=self.buffer.group)
            self.plan = plan_for_layer(self.num_experts, topk_idx.shape[1], hidden.shape[1], int(tokens),
                                       hidden.dtype, num_ranks=self.buffer.group_size, layer=self.layer)
        return self.plan.num_sms

    def combine(self, expert_output: Tensor, ctx: DispatchContext) -> Tensor:
        """Sum each received row's expert outputs (fp32), return rows to their sources and sum there.

        Args:
            expert_output: ``[M, H]``, already scaled by ``expert_probs`` if the model wants that.

        Returns:
            ``[T, H]`` in ``expert_output``'s dtype.
        """
        hidden = expert_output.shape[1]
        acc_dtype = torch.promote_types(expert_output.dtype, torch.float32)
        per_row = torch.zeros(ctx.num_recv_rows + 1, hidden, dtype=acc_dtype, device=expert_output.device)
        per_row = per_row.index_add(0, ctx.row_of_slot, expert_output.to(acc_dtype))[:ctx.num_recv_rows]
        combined, _ = combine(self.buffer, per_row.to(expert_output.dtype), ctx.handle, num_sms=ctx.num_sms)
        return combined
