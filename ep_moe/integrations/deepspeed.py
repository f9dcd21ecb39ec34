"""DeepSpeed integration: `MoE`, a drop-in for ``deepspeed.moe.layer.MoE`` whose tokens travel through ep_moe.

What stays DeepSpeed's: the constructor and ``forward`` contract (``(out, l_aux, exp_counts)``), the gate (its own
``TopKGate``: routing, capacity, dropped tokens, ``l_aux``, ``exp_counts``), the expert modules with their
parameter names and flags, the groups of ``deepspeed.utils.groups``, and ``isinstance(layer,
deepspeed.moe.layer.MoE)``, so that ``deepspeed.initialize``, the MoE-aware optimizer grouping and the per-expert
checkpoint files treat the layer as DeepSpeed's. What changes is the token movement: each token goes once to each
rank that holds one of its experts (ep_moe's `TokenDispatcher`) instead of an ``[E, C, H]`` capacity-padded
all-to-all, and each local expert runs on exactly its tokens.

Two modes, chosen by DeepSpeed's own ``drop_tokens`` argument:

* ``drop_tokens=True`` (DeepSpeed's default): DeepSpeed's capacity semantics, the same dropped tokens, and
  outputs, ``l_aux``, ``exp_counts`` and gradients equal to DeepSpeed's.
* ``drop_tokens=False`` (recommended): dropless, DeepSpeed's "infinite capacity" without the padding. At top-2 the
  gate's routing is computed here (`dropless_top2_routes`, bit for bit DeepSpeed's gate).

Not supported (clear errors): tensor-parallel non-expert layers and expert tensor parallelism. ``use_tutel=True``
is accepted and ignored. Versions, parameter names and the CPU setup: docs/training.md, section "DeepSpeed".
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn

try:
    import deepspeed.comm as ds_comm
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from deepspeed.moe.sharded_moe import (
        FIRST_ALLTOALL_TIMER,
        MOE_TIMER,
        SECOND_ALLTOALL_TIMER,
        MOELayer,
        TopKGate,
        gumbel_rsample,
    )
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size
except ImportError as _exc:  # pragma: no cover - exercised only without deepspeed
    raise ImportError(
        "ep_moe.integrations.deepspeed needs DeepSpeed: "
        "DS_BUILD_OPS=0 pip install torch==<your torch> deepspeed==0.19.8") from _exc

from ep_moe.buffer.buffer_v1 import Buffer
from ep_moe.buffer.expert_major_ops import local_expert_combine, local_expert_dispatch
from ep_moe.token_dispatcher import TokenDispatcher

log = logging.getLogger("ep_moe")

__all__ = ["MoE", "EPMOELayer", "init_deepspeed_comm", "replace_deepspeed_moe", "release_buffers",
           "gate_supports_sparse_routes"]

# One Buffer per (process group, backend), shared by every layer of that group (as DeepEP shares one).
_buffers: dict[tuple[int, str], tuple[torch_dist.ProcessGroup, Buffer]] = {}
_release_count = 0  # bumped by release_buffers: layers then rebuild their dispatcher on a fresh Buffer


def gate_supports_sparse_routes() -> bool:
    """Whether this DeepSpeed's ``TopKGate.forward`` can return per-route (index, gate) pairs.

    Newer DeepSpeed returns ``(l_aux, capacity, E, indices [k, S] int32, locations, gates [k, S], exp_counts)``
    with ``sparse_routes=True``; older ones return only the dense ``[S, E, C]`` combine weights, which this
    module converts (same result, more memory).
    """
    import inspect

    return "sparse_routes" in inspect.signature(TopKGate.forward).parameters


_SPARSE_ROUTES = gate_supports_sparse_routes()


def init_deepspeed_comm(build_shm_op: bool = False) -> None:
    """Make ``deepspeed.comm`` use the ``torch.distributed`` group that is already initialized.

    DeepSpeed's expert groups (``deepspeed.utils.groups``) need ``deepspeed.comm`` initialized; its
    ``init_distributed`` accepts an existing ``torch.distributed`` group. On the CPU accelerator it
    would also JIT-compile a shared-memory all-reduce op (about 30-60 s on a small machine) that only
    DeepSpeed's inference all-reduce uses; ``build_shm_op=False`` marks that op unavailable so that
    nothing is compiled. Call before ``deepspeed.initialize`` (which then finds comm initialized).
    Also sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` where unset (``deepspeed.initialize`` requires them;
    ranks spawned on one host have no launcher to set them). Idempotent.
    """
    if not torch_dist.is_initialized():
        raise RuntimeError("init_deepspeed_comm: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    # deepspeed.initialize insists on the launcher's variables; spawned single-host ranks lack them.
    os.environ.setdefault("RANK", str(torch_dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(torch_dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available()
                                            and torch_dist.get_backend() == "nccl" else torch_dist.get_rank()))
    if ds_comm.is_initialized():
        return
    if not build_shm_op:
        import deepspeed.ops

        compatible = deepspeed.ops.__compatible_ops__  # probed once, cached by DeepSpeed; edits persist
        for name in ("deepspeed_shm_comm",):
            if name in compatible:
                compatible[name] = False
    ds_comm.init_distributed(dist_backend=torch_dist.get_backend(), verbose=False)


def takes_dropless_top2(gate: nn.Module, used_token: Tensor | None) -> bool:
    """Whether `dropless_top2_routes` gives this call's routing: DeepSpeed's own ``TopKGate`` (with per-route output)
    at top-2 without capacity, no ``used_token`` mask, no input jitter and no gate timer; anything else goes through
    the gate's own forward."""
    return (_SPARSE_ROUTES and type(gate) is TopKGate and gate.k == 2 and not gate.drop_tokens and used_token is None
            and gate.wg.weight.shape[0] >= 2 and not gate.wall_clock_breakdown
            and not (gate.noisy_gate_policy == "Jitter" and gate.training))


def dropless_top2_routes(gate: TopKGate, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The routing of DeepSpeed's top-2 gate without capacity (``drop_tokens=False``) for ``tokens [S, H]``, computing
    only what a dropless layer reads: ``(l_aux, topk_idx [S, 2] int64, topk_weights [S, 2] fp32, exp_counts [E]
    int64)``.

    Why: DeepSpeed's gate also computes every route's place in a capacity buffer, two cumulative sums over an
    ``[S, E]`` int64 one-hot, which a dropless layer never reads and which dominate the gate's GPU time (see
    docs/native.md); the layer then waits for them when it reads its expert counts on the host.

    The values are the gate's: logits of the fp32 input by the fp32 ``wg`` weights; the first expert the argmax of
    the softmax; the second the argmax of the logits plus, when ``top2_2nd_expert_sampling``, DeepSpeed's own Gumbel
    draw (``gumbel_rsample``, the same draw from the global RNG) with the first masked out; each route's weight its
    softmax probability divided by the pair's sum (clamped at fp32's eps); ``l_aux = mean(mean_s(gates) *
    fraction of tokens whose first expert is e) * E^2``; ``exp_counts`` the routes per expert. Checked against the
    gate in tests/integrations/test_deepspeed.py (routes, ``l_aux`` and counts equal, gradients within 1e-5)."""
    logits = torch.nn.functional.linear(tokens.float(), gate.wg.weight.float())
    probs = torch.softmax(logits, dim=1)
    num_experts = probs.shape[1]
    first = probs.argmax(dim=1)
    first_one_hot = torch.nn.functional.one_hot(first, num_experts)
    if gate.top2_2nd_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    second = logits.masked_fill(first_one_hot.bool(), float("-inf")).argmax(dim=1)
    topk_idx = torch.stack([first, second], dim=1)
    chosen = probs.gather(1, topk_idx)
    total = torch.clamp(chosen.sum(dim=1, keepdim=True), min=torch.finfo(chosen.dtype).eps)
    topk_weights = chosen / total
    first_share = first_one_hot.float().mean(dim=0)
    l_aux = (probs.mean(dim=0) * first_share).mean() * num_experts * num_experts
    exp_counts = (first_one_hot + torch.nn.functional.one_hot(second, num_experts)).sum(dim=0).detach()
    return l_aux, topk_idx, topk_weights, exp_counts


def _buffer_for(group: torch_dist.ProcessGroup, backend: str) -> Buffer:
    key = (id(group), backend)
    hit = _buffers.get(key)
    if hit is not None and hit[0] is group:
        return hit[1]
    # Expert ids come from the gate (top-k over the experts, in range by construction): no value checks,
    # which would cost a host sync per layer.
    buffer = Buffer(group, backend=backend, check_inputs=False)
    _buffers[key] = (group, buffer)
    return buffer


def release_buffers() -> None:
    """Destroy the Buffers this module created (before ``destroy_process_group``, or in tests)."""
    global _release_count
    for _, buffer in _buffers.values():
        buffer.destroy()
    _buffers.clear()
    _release_count += 1


def _dense_to_routes(combine_weights: Tensor, dispatch_mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Older DeepSpeed's gate output ``[S, E, C]`` -> ``(topk_idx [S, k] int64 (-1 = dropped),
    topk_weights [S, k] fp32)``; weights keep their autograd graph."""
    weights = combine_weights.sum(dim=-1)          # [S, E]: a kept (token, expert) pair has one slot
    kept = dispatch_mask.any(dim=-1)               # [S, E]
    k = min(k, kept.shape[1])
    order = torch.sort(kept.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :k]
    valid = kept.gather(1, order)
    topk_idx = torch.where(valid, order, torch.full_like(order, -1))
    topk_weights = weights.gather(1, order) * valid
    return topk_idx, topk_weights.float()


class EPMOELayer(MOELayer):
    """DeepSpeed's ``MOELayer`` (gate + experts, same attributes, timers and ``l_aux``/``exp_counts``)
    with the token movement of ep_moe. Built by `MoE`; rarely used directly.

    Args:
        gate: DeepSpeed ``TopKGate`` (its ``drop_tokens`` picks capacity or dropless mode).
        experts: DeepSpeed ``Experts`` holding this rank's ``num_local_experts`` experts.
        ep_group_name, ep_size, num_local_experts: as DeepSpeed's ``MOELayer``.
        buffer: an ep_moe `Buffer` over the expert-parallel group to use (default: one shared per group).
        backend: the ep_moe backend of the default Buffer (``"auto"``, ``"native"``, ``"torch"``).
    """

    def __init__(self, gate: nn.Module, experts: nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False, *, buffer: Buffer | None = None,
                 backend: str = "auto") -> None:
        super().__init__(gate, experts, ep_group_name, ep_size, num_local_experts, use_tutel=False)
        if use_tutel:
            log.info("ep_moe: use_tutel=True is ignored; tokens move through ep_moe")
        self._buffer = buffer
        self._backend = backend
        self._dispatcher: TokenDispatcher | None = None
        self._dispatcher_release = _release_count
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None

    @classmethod
    def from_deepspeed(cls, layer: MOELayer, *, buffer: Buffer | None = None, backend: str = "auto") -> EPMOELayer:
        """Wrap a DeepSpeed ``MOELayer``'s gate and experts (the same modules and parameters)."""
        new = cls(layer.gate, layer.experts, layer.ep_group_name, layer.ep_size, layer.num_local_experts,
                  buffer=buffer, backend=backend)
        new.wall_clock_breakdown = layer.wall_clock_breakdown
        new.train(layer.training)
        if layer.ep_group is not None:
            new.ep_group = layer.ep_group  # the gate already holds it
        return new

    # ------------------------------------------------------------------ groups
    def _set_ep_group(self, ep_group) -> None:
        """Set the expert-parallel group (idempotent, unlike DeepSpeed's, so that calling
        ``set_deepspeed_parallelism()`` before ``deepspeed.initialize`` is harmless)."""
        if self.ep_group is ep_group and self.gate.ep_group is ep_group:
            return
        self.ep_group = ep_group
        self.gate.ep_group = ep_group
        self._dispatcher = None

    def _ensure_ep_group(self) -> None:
        """Create DeepSpeed's expert/data-parallel groups on first use when nobody did.

        DeepSpeed's own layer needs ``set_deepspeed_parallelism()`` (called by ``deepspeed.initialize``)
        or runs its all-to-all on a ``None`` group; here the first forward creates the groups the same
        way (a collective: every rank runs its layers in the same order). With tensor parallelism
        (``groups.mpu``) the groups must be made explicitly.
        """
        if self.ep_group is not None or self.ep_size == 1:
            return
        if not torch_dist.is_initialized():
            raise RuntimeError(f"ep_moe MoE: ep_size={self.ep_size} needs torch.distributed to be initialized")
        if groups.mpu is not None:
            raise RuntimeError("ep_moe MoE: call set_deepspeed_parallelism() (or deepspeed.initialize) "
                               "before forward when an mpu is set")
        init_deepspeed_comm()
        if self.ep_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size)
            if torch_dist.get_rank() == 0:
                log.info("ep_moe: created DeepSpeed expert/data-parallel groups %s "
                         "(set_deepspeed_parallelism was not called)", self.ep_group_name)
        self._set_ep_group(groups._get_expert_parallel_group(self.ep_group_name))

    def _get_dispatcher(self) -> TokenDispatcher:
        if self._dispatcher is None or self._dispatcher_release != _release_count:
            group_size = torch_dist.get_world_size(self.ep_group)
            if group_size != self.ep_size:
                raise RuntimeError(f"ep_moe MoE: expert-parallel group '{self.ep_group_name}' has {group_size} "
                                   f"ranks, expected ep_size={self.ep_size}")
            buffer = self._buffer if self._buffer is not None else _buffer_for(self.ep_group, self._backend)
            if buffer.group_size != self.ep_size:
                raise ValueError(f"ep_moe MoE: argument 'buffer' spans {buffer.group_size} ranks, expected "
                                 f"ep_size={self.ep_size}")
            self._dispatcher = TokenDispatcher(buffer, self.ep_size * self.num_local_experts)
            self._dispatcher_release = _release_count
        return self._dispatcher

    # ------------------------------------------------------------------ forward
    def _route(self, tokens: Tensor, used_token: Tensor | None) -> tuple[Tensor, Tensor, int]:
        """Run DeepSpeed's gate; set ``l_aux``/``exp_counts``; return ``(topk_idx [S, k] int64 with -1
        for dropped routes, topk_weights [S, k] fp32, capacity)``: the gate's per-expert capacity in capacity
        mode with per-route output (every expert then has at most that many routes), else 0."""
        if takes_dropless_top2(self.gate, used_token):
            self.l_aux, topk_idx, topk_weights, self.exp_counts = dropless_top2_routes(self.gate, tokens)
            return topk_idx, topk_weights, 0
        if _SPARSE_ROUTES:
            self.l_aux, capacity, _, indices, _locations, gates, self.exp_counts = self.gate(
                tokens, used_token, True, False)
            num_topk = indices.shape[0]
            # DeepSpeed computes the capacity on the host in capacity mode (int() is no device sync there)
            capacity = int(capacity) if self.gate.drop_tokens else 0
            # flatten + view: standard strides even for k == 1 (a transposed [S, 1] counts as contiguous)
            return (indices.t().long().flatten().view(-1, num_topk),
                    gates.t().float().flatten().view(-1, num_topk), capacity)
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(tokens, used_token)
        return (*_dense_to_routes(combine_weights, dispatch_mask, self.gate.k), 0)

    def _run_experts(self, expert_input: Tensor, counts: list[int]) -> Tensor:
        """Each local expert on its contiguous rows (every expert runs, on zero rows too, so that its
        parameters always get a gradient, as in DeepSpeed)."""
        outputs = []
        for chunk, expert in zip(expert_input.split(counts), self.experts.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs)

    def _local_forward(self, tokens: Tensor, topk_idx: Tensor, topk_weights: Tensor, capacity: int) -> Tensor:
        """ep_size == 1: every expert is local; the expert-major permute and weighted reduce, no communication
        (each token's rows summed in fp32 in increasing expert, rounded once). ``capacity`` > 0: every expert
        runs on exactly that many rows (as in DeepSpeed's layer; no host read of the counts), else on its own."""
        out = local_expert_dispatch(tokens, topk_idx, topk_weights, self.num_local_experts, check_values=False,
                                    expert_capacity=capacity)
        expert_out = self._run_experts(out.expert_x, out.tokens_per_expert_list)
        return local_expert_combine(expert_out, out.handle, out.expert_weights)

    def forward(self, *input: Tensor, **kwargs) -> Tensor:
        """``input[0]``: hidden states ``[..., H]``; ``input[1]`` (optional): ``used_token`` mask
        ``[S]`` (top-1 only, as DeepSpeed). Returns the combined output in the input's shape and dtype
        and sets ``self.l_aux`` (scalar fp32) and ``self.exp_counts`` (``[E]`` int64, this rank's routes
        before capacity)."""
        if self.wall_clock_breakdown:
            self.timers(MOE_TIMER).start()
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else None
        if bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
            raise NotImplementedError("ep_moe MoE: tensor-parallel non-expert layers (groups.mpu with TP > 1) "
                                      "are not supported; use deepspeed.moe.layer.MoE there")
        self._ensure_ep_group()
        tokens = hidden.reshape(-1, hidden.shape[-1])
        topk_idx, topk_weights, capacity = self._route(tokens, used_token)
        if self.ep_size == 1:
            out = self._local_forward(tokens, topk_idx, topk_weights, capacity)
        else:
            dispatcher = self._get_dispatcher()
            if self.wall_clock_breakdown:
                self.timers(FIRST_ALLTOALL_TIMER).start()
            expert_input, probs, tokens_per_expert, ctx = dispatcher.dispatch(tokens, topk_idx, topk_weights)
            if self.wall_clock_breakdown:
                self.timers(FIRST_ALLTOALL_TIMER).stop()
                self.time_falltoall = self.timers(FIRST_ALLTOALL_TIMER).elapsed(reset=False)
            counts = ctx.tokens_per_expert_host if ctx.tokens_per_expert_host is not None else tokens_per_expert
            expert_out = self._run_experts(expert_input, counts.tolist())
            if self.wall_clock_breakdown:
                self.timers(SECOND_ALLTOALL_TIMER).start()
            # weighted in the combine: w * y summed in fp32 over a token's experts, rounded once per rank
            out = dispatcher.combine(expert_out, ctx, probs).to(hidden.dtype)
            if self.wall_clock_breakdown:
                self.timers(SECOND_ALLTOALL_TIMER).stop()
                self.time_salltoall = self.timers(SECOND_ALLTOALL_TIMER).elapsed(reset=False)
        if self.wall_clock_breakdown:
            self.timers(MOE_TIMER).stop()
            self.time_moe = self.timers(MOE_TIMER).elapsed(reset=False)
        return out.reshape(hidden.shape)


class MoE(DeepSpeedMoE):
    """``deepspeed.moe.layer.MoE`` with ep_moe token movement. Same arguments, same ``forward``
    (``(output, l_aux, exp_counts)``), same parameter names, flags and groups; a subclass, so DeepSpeed's
    engine, optimizer grouping and MoE checkpointing see a DeepSpeed MoE layer.

    ``drop_tokens=True``: DeepSpeed's capacity semantics (same tokens dropped, same results).
    ``drop_tokens=False``: dropless (recommended): every token reaches its top-k experts.

    Keyword-only extras: ``buffer`` (an ep_moe `Buffer` over the expert-parallel group; default one shared
    per group) and ``backend`` (``"auto"``/``"native"``/``"torch"`` for that default Buffer).
    ``use_tutel`` is ignored; ``enable_expert_tensor_parallelism`` with tensor parallelism is not supported.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, *, buffer: Buffer | None = None,
                 backend: str = "auto") -> None:
        _check_args(hidden_size, num_experts, ep_size, k)
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                         min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, False,
                         enable_expert_tensor_parallelism, top2_2nd_expert_sampling)
        if use_tutel:
            log.info("ep_moe: use_tutel=True is ignored; tokens move through ep_moe")
        self.deepspeed_moe = EPMOELayer.from_deepspeed(self.deepspeed_moe, buffer=buffer, backend=backend)

    @property
    def drop_tokens(self) -> bool:
        """True: DeepSpeed capacity semantics; False: dropless."""
        return bool(self.deepspeed_moe.gate.drop_tokens)

    @classmethod
    def from_deepspeed(cls, layer: DeepSpeedMoE, *, drop_tokens: bool | None = None,
                       buffer: Buffer | None = None, backend: str = "auto") -> MoE:
        """An ep_moe `MoE` sharing ``layer``'s modules and parameters (nothing is copied: the same
        gate, experts and residual MLP, so the weights, their flags and any optimizer state that refers
        to them are kept). ``drop_tokens`` (None = keep) switches between capacity and dropless mode."""
        if not isinstance(layer, DeepSpeedMoE):
            raise ValueError(f"from_deepspeed: argument 'layer' must be a deepspeed.moe.layer.MoE, "
                             f"got {type(layer).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        module_state = ("_parameters", "_buffers", "_modules")
        for name, value in vars(layer).items():
            if name in module_state:
                object.__setattr__(new, name, dict(value))
            elif not name.startswith("_"):
                object.__setattr__(new, name, value)
        new.training = layer.training
        inner = layer.deepspeed_moe
        if isinstance(inner, EPMOELayer):
            inner = EPMOELayer.from_deepspeed(inner, buffer=buffer or inner._buffer, backend=backend)
        else:
            inner = EPMOELayer.from_deepspeed(inner, buffer=buffer, backend=backend)
        new.deepspeed_moe = inner
        if drop_tokens is not None:
            new.deepspeed_moe.gate.drop_tokens = bool(drop_tokens)
        return new


def _check_args(hidden_size: int, num_experts: int, ep_size: int, k: int) -> None:
    for name, value in (("hidden_size", hidden_size), ("num_experts", num_experts), ("ep_size", ep_size),
                        ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"ep_moe MoE: argument '{name}' must be a positive int, got {value!r}")
    if num_experts % ep_size:
        raise ValueError(f"ep_moe MoE: argument 'num_experts' ({num_experts}) must be divisible by "
                         f"ep_size ({ep_size})")
    if k > num_experts:
        raise ValueError(f"ep_moe MoE: argument 'k' ({k}) must be at most num_experts ({num_experts})")


def replace_deepspeed_moe(model: nn.Module, *, drop_tokens: bool | None = None, buffer: Buffer | None = None,
                          backend: str = "auto") -> nn.Module:
    """Swap every ``deepspeed.moe.layer.MoE`` in ``model`` for an ep_moe `MoE` sharing its weights.

    Call before ``deepspeed.initialize`` (the optimizer is built from the same parameters either way).
    ``drop_tokens``: None keeps each layer's setting; False makes every swapped layer dropless.
    Returns ``model`` (or the replacement, when ``model`` itself is a DeepSpeed MoE layer).
    """
    def swap(layer: nn.Module) -> nn.Module | None:
        if isinstance(layer, DeepSpeedMoE) and not isinstance(layer, MoE):
            return MoE.from_deepspeed(layer, drop_tokens=drop_tokens, buffer=buffer, backend=backend)
        if isinstance(layer, MoE) and drop_tokens is not None:
            layer.deepspeed_moe.gate.drop_tokens = bool(drop_tokens)
        return None

    top = swap(model)
    if top is not None:
        return top
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = swap(child)
            if new is not None:
                setattr(parent, name, new)
                swapped += 1
    if swapped and (not torch_dist.is_initialized() or torch_dist.get_rank() == 0):
        log.info("ep_moe: replaced %d deepspeed.moe.layer.MoE layer(s)", swapped)
    return model
