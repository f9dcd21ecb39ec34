"""`MoELayer`: router + token dispatcher + grouped experts (+ optional shared expert).

With an EP `Buffer` the layer dispatches through `ep_moe.TokenDispatcher` (each rank holds ``E / R``
experts); without one it uses `LocalTokenDispatcher`, which groups the tokens by expert in-process with
the same row order and the same fp32 sums, so it gives the same numbers as a one-rank `Buffer`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..buffer.buffer_v1 import Buffer
from ..buffer.expert_major_ops import ExpertHandle, local_expert_combine, local_expert_dispatch
from ..token_dispatcher import TokenDispatcher
from .experts import GroupedExperts, SwiGLU, scaled_output_std
from .model_config import ModelConfig
from .router import TopKRouter


class LocalTokenDispatcher:
    """`TokenDispatcher`'s interface for one process and all experts local: no communication
    (`ep_moe.buffer.expert_major_ops.local_expert_dispatch`). Rows, order and sums equal `TokenDispatcher` over a one-rank
    `Buffer` bit for bit."""

    def __init__(self, num_experts: int, expert_alignment: int = 1, num_worst_tokens: int = 0) -> None:
        if expert_alignment < 1:
            raise ValueError(f"LocalTokenDispatcher: argument 'expert_alignment' must be >= 1, got {expert_alignment}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_worst_tokens = num_worst_tokens

    def dispatch(self, hidden: Tensor, topk_idx: Tensor, topk_weights: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, ExpertHandle]:
        """Group ``hidden [T, H]`` by expert: ``(expert_input [M, H], expert_probs [M] fp32,
        tokens_per_expert [E] int64, ctx)`` as `TokenDispatcher.dispatch`."""
        out = local_expert_dispatch(hidden, topk_idx, topk_weights, self.num_experts, self.expert_alignment,
                                    self.num_worst_tokens, check_values=False)
        return out.expert_x, out.expert_weights, out.tokens_per_expert, out.handle

    def combine(self, expert_output: Tensor, ctx: ExpertHandle, weights: Tensor | None = None) -> Tensor:
        """Each token's expert rows summed (weighted by ``weights [M]`` when given), as `TokenDispatcher.combine`:
        ``[T, H]`` in ``expert_output``'s dtype."""
        return local_expert_combine(expert_output, ctx, weights)


class MoELayer(nn.Module):
    """Mixture-of-Experts FFN: ``[..., H] -> [..., H]`` (``[B, S, H]`` or ``[T, H]``).

    Args:
        config: a `ModelConfig` (its ``moe_*`` fields, ``hidden_size``, ``init_method_std``, ``params_dtype``).
        buffer: the EP group's `Buffer`, shared by all layers; None = every expert in this process.
        dp_group: the ranks that see different tokens (for the global aux loss and the expert-bias update).
        num_sms: SMs for this layer's dispatch/combine (0 = decided by its `TokenDispatcher` on the first call).
        expert_impl: `GroupedExperts` ``impl``.
        num_worst_tokens: > 0: fixed-size dispatch with this many received rows (an upper bound on the rows
            any EP rank receives, e.g. tokens per rank x EP size): nothing waits on the host, so a step can
            be captured in a CUDA graph; the experts skip the padding rows. 0: exact sizes (host syncs).

    After each forward, ``aux_loss`` is this layer's coefficient-scaled load-balancing + z-loss (0-dim fp32).

    Raises:
        ValueError: ``num_worst_tokens`` < 0, or ``num_moe_experts`` not divisible by the EP size.
    """

    def __init__(self, config: ModelConfig, buffer: Buffer | None = None, dp_group: dist.ProcessGroup | None = None,
                 num_sms: int = 0, expert_impl: str = "auto", num_worst_tokens: int = 0) -> None:
        super().__init__()
        c = config
        if num_worst_tokens < 0:
            raise ValueError(f"MoELayer: argument 'num_worst_tokens' must be >= 0, got {num_worst_tokens}")
        self.buffer = buffer
        self.num_experts = c.num_moe_experts
        self.num_sms = num_sms
        self.num_worst_tokens = num_worst_tokens
        ep_rank, ep_size = (buffer.rank, buffer.group_size) if buffer is not None else (0, 1)
        if c.num_moe_experts % ep_size:
            raise ValueError(f"MoELayer: 'num_moe_experts' ({c.num_moe_experts}) must be divisible by the EP size "
                             f"{ep_size}")
        dtype = c.torch_dtype
        out_std = scaled_output_std(c.init_method_std, c.num_layers)
        self.router = TopKRouter(
            c.hidden_size, c.num_moe_experts, c.moe_router_topk, score_function=c.moe_router_score_function,
            pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
            group_topk=c.moe_router_group_topk, topk_scaling_factor=c.moe_router_topk_scaling_factor,
            load_balancing_type=c.moe_router_load_balancing_type, aux_loss_coeff=c.moe_aux_loss_coeff,
            z_loss_coeff=c.moe_z_loss_coeff, enable_expert_bias=c.moe_router_enable_expert_bias,
            bias_update_rate=c.moe_router_bias_update_rate, force_load_balancing=c.moe_router_force_load_balancing,
            dp_group=dp_group, init_method_std=c.init_method_std)
        self.experts = GroupedExperts(c.num_moe_experts, c.hidden_size, c.moe_ffn_hidden_size, ep_rank, ep_size,
                                      dtype=dtype, init_method_std=c.init_method_std, output_init_std=out_std,
                                      impl=expert_impl)
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: nn.Parameter | None = None
        if c.moe_shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(c.hidden_size, c.moe_shared_expert_intermediate_size, dtype=dtype,
                                        init_method_std=c.init_method_std, output_init_std=out_std)
            if c.moe_shared_expert_gate:
                self.shared_expert_gate = nn.Parameter(torch.empty(1, c.hidden_size, dtype=dtype, device="cpu"))
        self.init_method_std = c.init_method_std
        self._dispatchers: dict[int, TokenDispatcher | LocalTokenDispatcher] = {}

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Initialise the shared-expert gate (the submodules have their own ``reset_parameters``).

        Args:
            generator: the ``torch.Generator`` of the normal draw (std ``init_method_std``, on the CPU), or None.
        """
        if self.shared_expert_gate is not None:
            w = torch.empty(self.shared_expert_gate.shape, dtype=torch.float32, device="cpu").normal_(
                0.0, self.init_method_std, generator=generator)
            self.shared_expert_gate.copy_(w)

    def dispatcher(self, expert_alignment: int) -> TokenDispatcher | LocalTokenDispatcher:
        """The dispatcher for this alignment (made once, then cached).

        Args:
            expert_alignment: the row alignment of each expert's group (what the experts' GEMM wants).

        Returns:
            A `TokenDispatcher` over the layer's buffer, or a `LocalTokenDispatcher` without one.
        """
        if expert_alignment not in self._dispatchers:
            if self.buffer is None:
                self._dispatchers[expert_alignment] = LocalTokenDispatcher(self.num_experts, expert_alignment,
                                                                           self.num_worst_tokens)
            else:
                self._dispatchers[expert_alignment] = TokenDispatcher(
                    self.buffer, self.num_experts, expert_alignment=expert_alignment,
                    num_worst_tokens=self.num_worst_tokens, num_sms=self.num_sms)
        return self._dispatchers[expert_alignment]

    @property
    def aux_loss(self) -> Tensor:
        """Coefficient-scaled load-balancing loss + z-loss of the last forward (0-dim fp32)."""
        return self.router.aux_loss + self.router.z_loss

    def forward(self, x: Tensor) -> Tensor:
        """Route, dispatch, run the experts, combine weighted by the routing weights, add the shared expert.

        Args:
            x: ``[B, S, H]`` or ``[T, H]`` hidden states (under autocast sent in the autocast dtype).

        Returns:
            ``x``'s shape; this layer's ``aux_loss`` is set for the step.
        """
        shape = x.shape
        seq_length = shape[1] if x.ndim == 3 else None
        hidden = x.reshape(-1, shape[-1])
        topk_idx, topk_weights = self.router(hidden, seq_length)
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type) and hidden.is_floating_point():
            # Under autocast the experts compute in the autocast dtype anyway: send that dtype (half the
            # bytes of fp32, and the grouped GEMM's input dtype).
            hidden = hidden.to(torch.get_autocast_dtype(device_type))
        dispatcher = self.dispatcher(self.experts.expert_alignment(hidden))
        expert_input, expert_probs, tokens_per_expert, ctx = dispatcher.dispatch(hidden, topk_idx, topk_weights)
        # the routing weights are applied in the combine (fp32, one rounding), not by the experts
        expert_output = self.experts(expert_input, tokens_per_expert)
        out = dispatcher.combine(expert_output, ctx, expert_probs)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(F.linear(hidden, self.shared_expert_gate))
            out = out + shared
        return out.view(shape)
