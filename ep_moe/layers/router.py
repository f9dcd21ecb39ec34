"""`TopKRouter`: picks each token's top-k experts and their weights, in fp32.

Scores: ``softmax`` or ``sigmoid`` of ``x @ W`` (W ``[E, H]`` fp32, math in fp32 whatever the activation
dtype). Selection may add an aux-loss-free expert bias (selection only), may be limited to the best
``group_topk`` of ``num_groups`` expert groups (DeepSeek-V3), or may be forced to a balanced round-robin
assignment. Losses (already multiplied by their coefficients, kept on the module after each forward):

* ``aux_loss`` (Switch/GShard): ``coeff * E * sum_e f_e * P_e`` with ``f_e`` = fraction of the
  (token, expert) pairs that chose ``e`` (counts all-reduced over ``dp_group`` when given) and ``P_e`` =
  mean routing probability of ``e`` over this rank's tokens. Equals ``coeff`` when perfectly balanced.
* ``seq_aux_loss`` (DeepSeek-V3): the same formula inside every sequence, averaged over sequences.
* z-loss: ``z_coeff * mean_t logsumexp(logits_t)^2``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..buffer.routing_layout import count_values

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


def _bad(arg: str, expected: str, got) -> ValueError:
    return ValueError(f"TopKRouter: argument '{arg}' must be {expected}, got {got!r}")


def group_limited_topk(scores: Tensor, topk: int, num_groups: int, group_topk: int) -> Tensor:
    """Top-k expert ids ``[T, K]`` int64 among the ``group_topk`` best of ``num_groups`` expert groups.

    A group's score is the sum of its best ``topk // group_topk`` expert scores (DeepSeek-V3 and
    Megatron-core); experts of the other groups cannot be chosen. ``scores``: ``[T, E]`` fp32.
    """
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    best_groups = group_scores.topk(group_topk, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return masked.topk(topk, dim=-1).indices


class TopKRouter(nn.Module):
    """Top-k router with fp32 weights and math.

    Args:
        hidden_size: H. num_experts: E. topk: K (1 <= K <= E).
        score_function: ``"softmax"`` or ``"sigmoid"``.
        pre_softmax: softmax only: weights are the softmax over all E experts at the chosen ids
            (they do not sum to 1). Default (Megatron-core's default): softmax over the K chosen logits.
        num_groups, group_topk: group-limited routing (both or neither; ``E % num_groups == 0``,
            ``group_topk <= num_groups``, ``K % group_topk == 0``).
        topk_scaling_factor: multiply the final weights by this (DeepSeek-V3's routed scaling factor).
        normalize_sigmoid_topk: sigmoid with K > 1: divide the K weights by their sum (Megatron, DeepSeek-V3).
        load_balancing_type: ``"aux_loss"``, ``"seq_aux_loss"`` or ``"none"``.
        aux_loss_coeff: coefficient of the load-balancing loss (0 disables it).
        z_loss_coeff: coefficient of the z-loss (None or 0 disables it).
        enable_expert_bias: aux-loss-free balancing: a bias ``[E]`` fp32 buffer added to the scores for
            selection only, updated by `update_expert_bias`.
        bias_update_rate: step of that update.
        force_load_balancing: ignore the scores for selection and send token t to experts
            ``(t * K + k) % E`` (exactly balanced when ``T * K % E == 0``; for memory-fit checks). Weights
            are still the scores at those ids, so the router keeps a gradient. Deterministic with no seed
            needed; the same choice for a token at every EP size when each rank's ``T * K % E == 0``.
        dp_group: the group whose ranks see different tokens (data parallel, EP included): the global
            ``aux_loss`` and the expert-bias update sum token counts over it. None: this rank only.
        init_method_std: std of the normal init of the weight (`reset_parameters`).
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int, score_function: str = "softmax",
                 pre_softmax: bool = False, num_groups: int | None = None, group_topk: int | None = None,
                 topk_scaling_factor: float | None = None, normalize_sigmoid_topk: bool = True,
                 load_balancing_type: str = "aux_loss", aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float | None = None, enable_expert_bias: bool = False,
                 bias_update_rate: float = 1e-3, force_load_balancing: bool = False,
                 dp_group: dist.ProcessGroup | None = None, init_method_std: float = 0.02) -> None:
        super().__init__()
        if not (isinstance(num_experts, int) and num_experts >= 1):
            raise _bad("num_experts", "a positive int", num_experts)
        if not (isinstance(topk, int) and 1 <= topk <= num_experts):
            raise _bad("topk", f"an int in [1, num_experts={num_experts}]", topk)
        if score_function not in SCORE_FUNCTIONS:
            raise _bad("score_function", f"one of {SCORE_FUNCTIONS}", score_function)
        if load_balancing_type not in LOAD_BALANCING_TYPES:
            raise _bad("load_balancing_type", f"one of {LOAD_BALANCING_TYPES}", load_balancing_type)
        if pre_softmax and score_function != "softmax":
            raise _bad("pre_softmax", "False unless score_function is 'softmax'", pre_softmax)
        if (num_groups is None) != (group_topk is None):
            raise _bad("group_topk", "given together with num_groups (both or neither)", group_topk)
        if num_groups is not None:
            if not (isinstance(num_groups, int) and num_groups >= 1 and num_experts % num_groups == 0):
                raise _bad("num_groups", f"a positive divisor of num_experts={num_experts}", num_groups)
            if not (isinstance(group_topk, int) and 1 <= group_topk <= num_groups and topk % group_topk == 0):
                raise _bad("group_topk", f"an int in [1, num_groups={num_groups}] dividing topk={topk}",
                           group_topk)
            if topk // group_topk > num_experts // num_groups:
                raise _bad("group_topk", f"large enough that topk/group_topk <= experts per group "
                           f"({num_experts // num_groups})", group_topk)
        if aux_loss_coeff < 0 or (z_loss_coeff is not None and z_loss_coeff < 0):
            raise _bad("aux_loss_coeff", "non-negative (and z_loss_coeff too)", (aux_loss_coeff, z_loss_coeff))
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.topk = topk
        self.score_function = score_function
        self.pre_softmax = pre_softmax
        self.num_groups = num_groups
        self.group_topk = group_topk
        self.topk_scaling_factor = topk_scaling_factor
        self.normalize_sigmoid_topk = normalize_sigmoid_topk
        self.load_balancing_type = load_balancing_type
        self.aux_loss_coeff = float(aux_loss_coeff)
        self.z_loss_coeff = float(z_loss_coeff or 0.0)
        self.enable_expert_bias = enable_expert_bias
        self.bias_update_rate = float(bias_update_rate)
        self.force_load_balancing = force_load_balancing
        self.dp_group = dp_group
        self.init_method_std = init_method_std

        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32, device="cpu"))
        if enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device="cpu"))
            # (token, expert) pairs routed since the last update_expert_bias (training forwards only)
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(num_experts, dtype=torch.float32, device="cpu"),
                                 persistent=False)
        else:
            self.expert_bias = None
        self.reset_parameters()
        self.reset_stats()
        zero = torch.zeros((), dtype=torch.float32, device="cpu")
        self.aux_loss: Tensor = zero   # coefficient-scaled, with grad; set by forward
        self.z_loss: Tensor = zero

    # ------------------------------------------------------------------ parameters and dtype
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_method_std) weight drawn in fp32 from ``generator`` on the CPU."""
        with torch.no_grad():
            w = torch.empty(self.weight.shape, dtype=torch.float32, device="cpu").normal_(
                0.0, self.init_method_std, generator=generator)
            self.weight.copy_(w)

    def _apply(self, fn, recurse: bool = True):
        """``module.to(dtype)`` would cast the router too; keep its weight and buffers in fp32."""
        super()._apply(fn, recurse)
        for name, t in list(self._parameters.items()) + list(self._buffers.items()):
            if t is not None and t.is_floating_point() and t.dtype != torch.float32:
                if isinstance(t, nn.Parameter):
                    t.data = t.data.float()
                else:
                    self._buffers[name] = t.float()
        return self

    # ------------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        """Clear the statistics accumulated by forward (see `stats`)."""
        # Kept as device tensors (no host sync per forward); read by `stats`.
        self._stat_tokens_per_expert: Tensor | None = None
        self._stat_aux: Tensor | None = None
        self._stat_z: Tensor | None = None
        self._stat_calls = 0

    def stats(self) -> tuple[Tensor | None, Tensor | None, Tensor | None, int]:
        """``(tokens per expert [E] fp32 on this rank, sum of raw aux losses, sum of raw z-losses, calls)``
        since `reset_stats` (None before the first forward). Raw = without coefficient; with
        ``load_balancing_type`` "none" or a zero coefficient the aux value is the global formula over
        this rank's tokens, computed for monitoring only."""
        return self._stat_tokens_per_expert, self._stat_aux, self._stat_z, self._stat_calls

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, seq_length: int | None = None) -> tuple[Tensor, Tensor]:
        """Route ``x [T, H]`` (any float dtype).

        Args:
            seq_length: S, needed by ``seq_aux_loss``: tokens are ``B`` sequences of ``S``, in order.

        Returns:
            ``topk_idx [T, K]`` int64 (distinct experts per token) and ``topk_weights [T, K]`` fp32.
            Sets ``self.aux_loss`` and ``self.z_loss`` (0-dim fp32, coefficient-scaled, differentiable).
        """
        if x.ndim != 2 or x.shape[1] != self.hidden_size:
            raise _bad("x", f"a [T, {self.hidden_size}] tensor", tuple(x.shape))
        num_tokens = x.shape[0]
        # fp32 even inside torch.autocast (which would run the linear in bf16)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())  # [T, E] fp32
            if self.score_function == "softmax":
                scores = torch.softmax(logits, dim=-1)
            else:
                scores = torch.sigmoid(logits)

        topk_idx = self._select(scores.detach(), num_tokens, x.device)
        if self.score_function == "softmax" and not self.pre_softmax:
            topk_weights = torch.softmax(logits.gather(1, topk_idx), dim=-1)
        else:
            topk_weights = scores.gather(1, topk_idx)
            if self.score_function == "sigmoid" and self.normalize_sigmoid_topk and self.topk > 1:
                topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.topk_scaling_factor is not None:
            topk_weights = topk_weights * self.topk_scaling_factor

        counts = count_values(topk_idx, self.num_experts).float()  # no host sync, unlike bincount
        self._record(logits, scores, topk_idx, counts, num_tokens, seq_length)
        return topk_idx, topk_weights

    def _select(self, scores: Tensor, num_tokens: int, device: torch.device) -> Tensor:
        if self.force_load_balancing:
            t = torch.arange(num_tokens, device=device).unsqueeze(1)
            k = torch.arange(self.topk, device=device).unsqueeze(0)
            return (t * self.topk + k) % self.num_experts
        selection = scores if self.expert_bias is None else scores + self.expert_bias
        if self.num_groups is not None:
            return group_limited_topk(selection, self.topk, self.num_groups, self.group_topk)
        return selection.topk(self.topk, dim=-1).indices

    def _aux_probs(self, scores: Tensor) -> Tensor:
        """Per-token probabilities over all experts for the balance loss (sigmoid: normalised)."""
        if self.score_function == "softmax":
            return scores
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)

    def _record(self, logits: Tensor, scores: Tensor, topk_idx: Tensor, counts: Tensor, num_tokens: int,
                seq_length: int | None) -> None:
        num_experts, topk = self.num_experts, self.topk
        probs = self._aux_probs(scores)
        use_aux = self.load_balancing_type != "none" and self.aux_loss_coeff > 0
        if use_aux and self.load_balancing_type == "seq_aux_loss":
            if not seq_length or num_tokens % seq_length:
                raise _bad("seq_length", f"a divisor of the number of tokens {num_tokens} for seq_aux_loss",
                           seq_length)
            raw_aux = self._seq_aux(probs, topk_idx, seq_length)
        elif use_aux:
            global_counts, global_tokens = counts, float(num_tokens)
            if self.dp_group is not None:
                both = torch.cat([counts, counts.new_tensor([num_tokens])])
                dist.all_reduce(both, group=self.dp_group)
                global_counts, global_tokens = both[:num_experts], both[num_experts]
            raw_aux = num_experts * (global_counts / (global_tokens * topk) * probs.mean(dim=0)).sum()
        else:
            with torch.no_grad():
                raw_aux = num_experts * (counts / (num_tokens * topk) * probs.mean(dim=0)).sum()
        self.aux_loss = raw_aux * self.aux_loss_coeff if use_aux else logits.new_zeros(())
        raw_z = torch.logsumexp(logits, dim=-1).square().mean()
        self.z_loss = raw_z * self.z_loss_coeff if self.z_loss_coeff > 0 else logits.new_zeros(())

        with torch.no_grad():
            if self._stat_calls == 0:
                self._stat_tokens_per_expert = torch.zeros_like(counts)
                self._stat_aux = torch.zeros_like(raw_z)
                self._stat_z = torch.zeros_like(raw_z)
            self._stat_tokens_per_expert += counts
            self._stat_aux += raw_aux.detach()
            self._stat_z += raw_z.detach()
            self._stat_calls += 1
            if self.expert_bias is not None and self.training:
                self.local_tokens_per_expert += counts

    def _seq_aux(self, probs: Tensor, topk_idx: Tensor, seq_length: int) -> Tensor:
        num_seqs = probs.shape[0] // seq_length
        num_experts = self.num_experts
        seq_of_pair = torch.arange(num_seqs, device=probs.device).repeat_interleave(seq_length * self.topk)
        flat = seq_of_pair * num_experts + topk_idx.flatten()
        seq_counts = count_values(flat, num_seqs * num_experts).view(num_seqs, num_experts).float()
        f = seq_counts * (num_experts / (seq_length * self.topk))
        p = probs.view(num_seqs, seq_length, num_experts).mean(dim=1)
        return (f * p).sum(dim=-1).mean()

    # ------------------------------------------------------------------ aux-loss-free balancing
    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """``bias += rate * sign(mean_load - load)`` from the counts since the last call, summed over
        ``dp_group``; then clear the counts. Call once per optimizer step on every rank (collective
        when ``dp_group`` is given). No-op without ``enable_expert_bias``."""
        if self.expert_bias is None:
            return
        load = self.local_tokens_per_expert.clone()
        if self.dp_group is not None:
            dist.all_reduce(load, group=self.dp_group)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.local_tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, experts={self.num_experts}, topk={self.topk}, "
                f"score={self.score_function}, groups={self.num_groups}/{self.group_topk}, "
                f"balance={self.load_balancing_type}, expert_bias={self.enable_expert_bias}")
