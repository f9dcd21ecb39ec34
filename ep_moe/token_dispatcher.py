"""`TokenDispatcher`: what an MoE layer calls. It dispatches tokens to the ranks of their experts in the
expert-major layout (`ep_moe.buffer.expert_major_ops`: rows grouped by local expert, padded for a grouped GEMM) and combines
the experts' rows back, optionally weighted by the routing weights. Differentiable end to end."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .buffer.buffer_v1 import Buffer
from .buffer.expert_major_ops import ExpertHandle, expert_combine, expert_dispatch


@dataclass
class DispatchContext:
    """What `TokenDispatcher.combine` needs from the matching `TokenDispatcher.dispatch`."""

    handle: ExpertHandle
    num_tokens: int      # T
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
            overrides); on the hybrid backend, the in-node SMs of the hybrid model's plan (which also sets the
            chunk count, `ep_moe.tuning.hybrid_model.apply_hybrid_plan`); elsewhere the buffer's default.
        layer: this layer's name or index among the MoE layers (how plan overrides address it).

    Raises:
        ValueError: ``num_experts`` is not divisible by the group size.
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
        self.plan = None  # the CommPlan (a HybridPlan on the hybrid backend), once made

    def dispatch(self, hidden: Tensor, topk_idx: Tensor, topk_weights: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, DispatchContext]:
        """Send tokens to their experts' ranks, grouped by local expert (`ep_moe.buffer.expert_major_ops.expert_dispatch`).

        Args:
            hidden: ``[T, H]`` bf16/fp32. topk_idx: ``[T, K]`` int64 global expert ids (-1 = none).
            topk_weights: ``[T, K]`` fp32 routing probabilities.

        Returns:
            ``expert_input [M, H]`` (rows of local expert 0, then 1, ...; each group padded to
            ``expert_alignment``), ``expert_probs [M]`` fp32 (the routing weight of each row, 0 for
            padding), ``tokens_per_expert [L]`` int64 on the device (padded group sizes), and the
            context for `combine`.

        Raises:
            ValueError: a bad argument, named (as `ep_moe.buffer.expert_major_ops.expert_dispatch`).
        """
        num_sms = self._num_sms(hidden, topk_idx)
        out = expert_dispatch(self.buffer, hidden, topk_idx, topk_weights, self.num_experts, self.expert_alignment,
                              self.num_worst_tokens, num_sms)
        host = None
        if out.tokens_per_expert_list is not None:  # the layout's own host tensor where it has one (one rank)
            host = out.handle.layout.tokens_per_expert_host
            if host is None:
                host = torch.tensor(out.tokens_per_expert_list, dtype=torch.int64, device="cpu")
        return out.expert_x, out.expert_weights, out.tokens_per_expert, DispatchContext(out.handle, hidden.shape[0],
                                                                                       host)

    def _hybrid_num_sms(self, hidden: Tensor, topk_idx: Tensor) -> int:
        """Hybrid backend: this layer's plan from the hybrid model (`ep_moe.tuning.hybrid_model.apply_hybrid_plan`, made
        on the first call for the largest token count of any rank) sets the call's chunk count; its in-node SMs
        are the count unless one was given."""
        from .tuning.hybrid_model import apply_hybrid_plan

        backend = self.buffer.backend
        if self.plan is None:
            tokens = torch.tensor([hidden.shape[0]], device=self.buffer.device)
            torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MAX, group=self.buffer.group)
            self.plan = apply_hybrid_plan(backend, self.num_experts, topk_idx.shape[1], hidden.shape[1], int(tokens),
                                          hidden.element_size())
        elif not backend.chunks_fixed:
            backend.set_num_chunks(self.plan.num_chunks)
        return self.num_sms or self.plan.scaleup_sms

    def _num_sms(self, hidden: Tensor, topk_idx: Tensor) -> int:
        """The SM count of this layer: the explicit one, else (native backend) its tuning plan."""
        if self.buffer.backend_name == "hybrid":  # the hybrid model's plan: chunk count, SMs of the in-node hop
            return self._hybrid_num_sms(hidden, topk_idx)
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

    def combine(self, expert_output: Tensor, ctx: DispatchContext, weights: Tensor | None = None) -> Tensor:
        """Return the experts' rows to their tokens and sum them (`ep_moe.buffer.expert_major_ops.expert_combine`).

        Args:
            expert_output: ``[M, H]`` bf16/fp32 in the dispatch's expert-major order.
            ctx: the `DispatchContext` the matching `dispatch` returned.
            weights: ``[M]`` fp32 to weight each row by (e.g. ``expert_probs``; the sum is then ``sum w * y``
                in fp32), or None when the experts already applied them.

        Returns:
            ``[T, H]`` in ``expert_output``'s dtype.

        Raises:
            ValueError: ``expert_output`` does not match ``ctx`` (as `ep_moe.buffer.expert_major_ops.expert_combine`).
        """
        return expert_combine(self.buffer, expert_output, ctx.handle, weights)
