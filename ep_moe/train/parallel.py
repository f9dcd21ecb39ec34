"""Process groups and gradient reduction for expert + data parallel training.

World of ``W`` ranks, EP size ``P``: EP groups are ``P`` contiguous ranks (``[0..P-1], [P..2P-1], ...``);
the expert-data-parallel group of a rank holds the ranks with the same EP rank (``r % P``). Every rank is
a data-parallel rank for the non-expert weights (they are replicated on all ``W`` ranks).

Gradients: each rank back-propagates ``loss_micro * (1 / (accum * W))`` per micro-batch, so summing
non-expert gradients over the world, and expert gradients over the expert-data-parallel group, gives
the gradient of the mean loss over the global batch (an expert's gradient already holds the
contributions of every token of its EP group: they arrive through the dispatch backward).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..buffer.buffer_v1 import Buffer
from ..tuning.layer_plans import PlanCache, recipe_layers
from .recipe_schema import Recipe


@dataclass
class ParallelState:
    rank: int
    world_size: int
    ep_size: int
    ep_rank: int                        # rank inside the EP group
    ep_group: dist.ProcessGroup
    expert_dp_group: dist.ProcessGroup  # same EP rank in every EP group
    dp_group: dist.ProcessGroup         # the world: non-expert weights are replicated everywhere
    device: torch.device
    deterministic: bool = False

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // self.ep_size


def build_parallel_state(ep_size: int, device: torch.device, deterministic: bool, stages: int = 1) -> ParallelState:
    """Create the EP and expert-data-parallel groups (every rank creates every group, in the same order).

    ``stages`` > 1 (a pipeline): the world is cut into ``stages`` contiguous blocks of ``W / stages`` ranks, and the
    state is this rank's block's: ``rank`` and ``world_size`` inside the block, the groups inside it, and
    ``dp_group`` the block (with one stage, the world)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % stages:
        raise ValueError(f"train.pp_size: must divide the world size {world}, got {stages}")
    size = world // stages
    if size % ep_size:
        raise ValueError(f"model.expert_model_parallel_size: must divide the ranks of a stage ({size}), got {ep_size}")
    blocks = [list(range(b * size, (b + 1) * size)) for b in range(stages)]
    ep_groups = [block[g * ep_size:(g + 1) * ep_size] for block in blocks for g in range(size // ep_size)]
    edp_groups = [block[j::ep_size] for block in blocks for j in range(ep_size)]
    ep_group, _ = dist.new_subgroups_by_enumeration(ep_groups)
    expert_dp_group, _ = dist.new_subgroups_by_enumeration(edp_groups)
    if stages == 1:
        dp_group = dist.group.WORLD
    else:
        dp_group, _ = dist.new_subgroups_by_enumeration(blocks)
    local = rank % size
    return ParallelState(local, size, ep_size, local % ep_size, ep_group, expert_dp_group, dp_group, device,
                         deterministic)


def build_ep_buffer(ps: ParallelState, backend: str, hybrid_mode: bool = False,
                    num_scaleout_ranks: int | None = None) -> Buffer | None:
    """The `Buffer` of this rank's EP group, shared by every MoE layer; None at EP 1 (the layers then keep all
    experts in-process, with the same numbers). Collective over the EP group.

    ``hybrid_mode`` (``ep_moe.hybrid_mode``): where the EP group spans more than one node, dispatch and combine
    go through `ep_moe.backends.hybrid.HybridBackend` (two hops; the same numbers as the flat path). The nodes are the
    launch's (`ep_moe.backends.hybrid.node_topology.host_topology`: torchrun's agents, SLURM's nodes, else the hosts), unless
    ``num_scaleout_ranks`` (``ep_moe.num_scaleout_ranks``) or ``EP_MOE_SCALEOUT_RANKS`` cuts the group into that
    many nodes of consecutive ranks (`ep_moe.backends.hybrid.logical_topology`). One node: the flat buffer, as without
    hybrid mode. ``buffer.backend_reason`` says which view was taken and from where."""
    if ps.ep_size == 1:
        return None
    # Expert ids come from the layers' own routers (in range by construction): no value checks, which would
    # cost a host sync per MoE layer.
    buffer = Buffer(ps.ep_group, backend=backend, check_inputs=False)
    if not hybrid_mode:
        return buffer
    from ..backends.hybrid import HybridBackend, discover_topology

    topology = discover_topology(ps.ep_group, True, num_scaleout_ranks)
    if topology.is_hybrid:
        flat, buffer.backend = buffer.backend, HybridBackend(ps.ep_group, buffer.device, buffer.timeout_s, topology,
                                                             native_options=buffer.native_options)
        flat.destroy()
        buffer.backend_reason = (f"hybrid mode, {topology.num_scaleout_ranks} x {topology.num_scaleup_ranks} "
                                 f"({topology.source})")
    else:
        buffer.backend_reason += f"; hybrid mode: one node ({topology.source})"
    return buffer


def layer_num_sms(recipe: Recipe, buffer: Buffer | None) -> list[int]:
    """The SM count of each MoE layer of ``recipe``: its ``ep_moe.num_sms`` (per layer or for all), else its
    ``ep_moe.tuning_plan``, else the tuner where the backend takes an SM count (native), else
    `ep_moe.config.DEFAULT_NUM_SMS` (`ep_moe.tuning.layer_plans` has the whole order; ``ep-moe tune RECIPE`` prints
    the same plans). Raises `ValueError` for a bad count or plan file. Every rank computes the same counts."""
    data = recipe.to_dict()
    if recipe.ep_moe.tuning_plan is not None:
        data["ep_moe"]["tuning_plan"] = recipe.resolve_path(recipe.ep_moe.tuning_plan)
    shape, ep_size, moe_layers = recipe_layers(data)
    cache = PlanCache.from_recipe(data["ep_moe"], num_moe_layers=len(moe_layers))
    takes_sms = buffer is not None and buffer.backend_name == "native"
    return cache.num_sms_per_layer(shape, len(moe_layers), num_ranks=ep_size, use_model=takes_sms)


def enable_determinism() -> None:
    """Deterministic kernels everywhere (raise on ops that have none); no TF32, no cuDNN autotuning."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, deterministic: bool) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place.

    ``deterministic``: gather every rank's tensor and add them in rank order on every rank, so the result
    does not depend on the collective's algorithm (ring/tree, chunking, protocol); it costs ``group size``
    times the memory and traffic, which is fine for models that fit a test machine.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    if not deterministic:
        dist.all_reduce(tensor, group=group)
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    tensor.copy_(acc)
    return tensor


def _flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
    if not grads:
        return torch.zeros(0, dtype=torch.float32, device="cpu")
    return torch.cat(grads)


def _unflatten_into(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype).clone()
        offset += n


def sync_gradients(non_expert: list[torch.nn.Parameter], expert: list[torch.nn.Parameter],
                   ps: ParallelState) -> None:
    """Sum non-expert gradients over the world and expert gradients over the expert-data-parallel group
    (one flat fp32 bucket each). Parameters without a gradient count as zero on that rank."""
    for params, group in ((non_expert, ps.dp_group), (expert, ps.expert_dp_group)):
        if not params or dist.get_world_size(group) == 1:
            continue
        flat = _flat_grads(params).to(ps.device)
        all_reduce_sum(flat, group, ps.deterministic)
        _unflatten_into(flat, params)


def clip_grad_norm(non_expert: list[torch.nn.Parameter], expert: list[torch.nn.Parameter], max_norm: float,
                   ps: ParallelState) -> float:
    """Clip by the global L2 norm over all (synchronised) gradients; returns the norm before clipping.

    Non-expert gradients are identical on every rank; expert gradients are split over the EP group (and
    replicated over the expert-data-parallel group), so their squared norm is summed over the EP group.
    """
    def sq(params):
        grads = [p.grad.float() for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=ps.device)
        return torch.stack([g.pow(2).sum() for g in grads]).double().sum()

    expert_sq = sq(expert).reshape(1)
    all_reduce_sum(expert_sq, ps.ep_group, ps.deterministic)
    norm = float(torch.sqrt(sq(non_expert) + expert_sq[0]))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in list(non_expert) + list(expert):
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
