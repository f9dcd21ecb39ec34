"""`TokenDispatcher`: what an MoE layer calls. It dispatches tokens to the ranks of their experts,
groups the received (token, expert) pairs by local expert (padded for a grouped GEMM), and undoes all
of that in `combine`. Differentiable end to end."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .buffer import Buffer
from .handle import DispatchHandle
from .layout import count_values, round_up
from .ops import combine, dispatch


def group_pairs_by_expert(topk_idx: Tensor, num_experts: int, alignment: int, num_slots: int | None = None
                          ) -> tuple[Tensor, Tensor]:
    """Slots of the (row, k) pairs, grouped by expert and each group padded to ``alignment``.

    Args:
        topk_idx: ``[N, K]`` int64 expert ids in ``[0, num_experts)``, -1 = none.
        num_slots: M, the output length; None = exactly the padded total (one host sync), else a bound
            at least that large (the tail is padding).

    Returns:
        ``pair_of_slot [M]`` int64 (index into ``topk_idx.flatten()``, ``N * K`` for padding slots; pairs
        of one expert in increasing (row, k)) and ``padded_counts [num_experts]`` int64.
    """
    num_pairs = topk_idx.numel()
    key = torch.where(topk_idx >= 0, topk_idx, num_experts).flatten()
    order = torch.sort(key, stable=True).indices  # pairs by (expert, row, k)
    counts = count_values(key, num_experts + 1)[:num_experts]
    padded = round_up(counts, alignment)
    if num_slots is None:
        num_slots = int(padded.sum())
    first_pair = torch.cumsum(counts, 0) - counts
    first_slot = torch.cumsum(padded, 0) - padded
    sorted_key = key[order]
    is_pair = sorted_key < num_experts
    expert = sorted_key.clamp(max=num_experts - 1)
    position = torch.arange(num_pairs, device=topk_idx.device)
    slot = torch.where(is_pair, first_slot[expert] + position - first_pair[expert], num_slots)
    pair_of_slot = torch.full((num_slots + 1,), num_pairs, dtype=torch.int64, device=topk_idx.device)
    pair_of_slot.scatter_(0, slot, torch.where(is_pair, order, num_pairs))  # non-pairs all land on the spare slot
    return pair_of_slot[:num_slots], padded


@dataclass
class DispatchContext:
    """What `TokenDispatcher.combine` needs from the matching `TokenDispatcher.dispatch`."""

    handle: DispatchHandle
    row_of_slot: Tensor  # [M] int64: received row feeding each expert-input slot; N for padding slots
    num_recv_rows: int   # N
    num_tokens: int      # T
    num_sms: int         # SMs the dispatch used; its combine uses the same
    tokens_per_expert_host: Tensor | None = None  # [L] int64 CPU: the padded group sizes, when known on the host


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
        # Exact: the padded total, from the host counts when the backend has them, else read from the device
        # (a host sync); fixed: the most any routing can need, no host sync.
        host_counts = out.num_recv_tokens_per_expert_host if out.num_recv_tokens_per_expert_host.numel() else None
        num_slots = int(host_counts.sum()) if host_counts is not None else None
        if self.num_worst_tokens:
            num_slots = self.num_worst_tokens * min(num_topk, local) + local * (self.expert_alignment - 1)
        pair_of_slot, padded = group_pairs_by_expert(out.recv_topk_idx, local, self.expert_alignment, num_slots)
        row_of_slot = torch.where(pair_of_slot < out.recv_topk_idx.numel(), pair_of_slot // max(num_topk, 1),
                                  num_rows)

        hidden_size = hidden.shape[1]
        padded_x = torch.cat([out.recv_x, out.recv_x.new_zeros(1, hidden_size)])
        expert_input = padded_x.index_select(0, row_of_slot)
        padded_w = torch.cat([out.recv_topk_weights.flatten(), out.recv_topk_weights.new_zeros(1)])
        expert_probs = padded_w.index_select(0, pair_of_slot)
        ctx = DispatchContext(out.handle, row_of_slot, num_rows, hidden.shape[0], num_sms, host_counts)
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
