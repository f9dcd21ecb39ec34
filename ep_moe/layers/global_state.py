"""EP-size-independent state dicts: experts stored one tensor per GLOBAL expert id.

A model's ``state_dict()`` holds each `GroupedExperts` weight as ``[L, ...]`` (this rank's L experts).
The global form replaces ``<prefix>.w1`` by ``<prefix>.w1.<g>`` for every global expert ``g`` (e.g.
``layers.0.moe.experts.w1.17``, shape ``[H, F]``), gathered over the EP group, so a checkpoint saved at one
EP size loads at another. Everything else is replicated and kept as is.

`to_global` / `to_local` work on any mapping keyed like the model's state dict, so a trainer can convert
per-parameter optimizer state (e.g. Adam moments by parameter name) the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .experts import GroupedExperts

EXPERT_WEIGHTS = ("w1", "w2", "w3")
_GLOBAL_KEY = re.compile(r"^(?P<base>.+)\.(?P<expert>\d+)$")


def expert_modules(model: nn.Module) -> dict[str, GroupedExperts]:
    """``{module name: GroupedExperts}`` of ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, GroupedExperts)}


def _expert_key(key: str, experts: Mapping[str, GroupedExperts]) -> GroupedExperts | None:
    prefix, _, leaf = key.rpartition(".")
    return experts.get(prefix) if leaf in EXPERT_WEIGHTS else None


def _check_group(module: GroupedExperts, ep_group: dist.ProcessGroup | None, what: str) -> None:
    size = dist.get_world_size(ep_group) if ep_group is not None else 1
    rank = dist.get_rank(ep_group) if ep_group is not None else 0
    if (size, rank) != (module.ep_size, module.ep_rank):
        raise ValueError(f"{what}: argument 'ep_group' (rank {rank} of {size}) does not match the model's "
                         f"experts (EP rank {module.ep_rank} of {module.ep_size})")


def to_global(local_state: Mapping[str, Tensor], model: nn.Module, ep_group: dist.ProcessGroup | None = None
              ) -> dict[str, Tensor]:
    """Turn ``local_state`` (keys as in ``model.state_dict()``) into the global form.

    Collective over ``ep_group`` (every EP rank calls it with the same keys in the same order); every rank
    gets the whole result. Expert entries are new tensors, the others are ``local_state``'s own.
    """
    experts = expert_modules(model)
    out: dict[str, Tensor] = {}
    for key, value in local_state.items():
        module = _expert_key(key, experts)
        if module is None:
            out[key] = value
            continue
        _check_group(module, ep_group, "to_global")
        if value.shape[0] != module.num_local_experts:
            raise ValueError(f"to_global: '{key}' must have {module.num_local_experts} local experts in dim 0, "
                             f"got shape {tuple(value.shape)}")
        value = value.detach().contiguous()
        if ep_group is not None and module.ep_size > 1:
            parts = [torch.empty_like(value) for _ in range(module.ep_size)]
            dist.all_gather(parts, value, group=ep_group)
            value = torch.cat(parts)
        for g in range(module.num_experts):
            out[f"{key}.{g}"] = value[g].clone()
    return out


def to_local(global_state: Mapping[str, Tensor], model: nn.Module, ep_group: dist.ProcessGroup | None = None,
             strict: bool = True) -> dict[str, Tensor]:
    """The inverse of `to_global` for this rank: stacks this rank's experts ``[L, ...]`` (no communication;
    ``ep_group``, when given, is only checked against the experts' EP rank and size).

    With ``strict``, a missing expert or an expert id beyond the model's ``num_experts`` raises ValueError.
    """
    experts = expert_modules(model)
    out: dict[str, Tensor] = {}
    per_weight: dict[str, dict[int, Tensor]] = {}
    for key, value in global_state.items():
        match = _GLOBAL_KEY.match(key)
        module = _expert_key(match["base"], experts) if match else None
        if module is None:
            out[key] = value
        else:
            per_weight.setdefault(match["base"], {})[int(match["expert"])] = value
    for prefix, module in experts.items():
        if ep_group is not None:  # no communication here: the modules know their EP rank; this is a check
            _check_group(module, ep_group, "load_global_state_dict")
        for leaf in EXPERT_WEIGHTS:
            base = f"{prefix}.{leaf}"
            found = per_weight.pop(base, {})
            if not found and not strict:
                continue
            extra = sorted(g for g in found if g >= module.num_experts)
            if strict and extra:
                raise ValueError(f"load_global_state_dict: the checkpoint has experts {extra} of '{base}' but the "
                                 f"model has {module.num_experts} experts")
            wanted = range(module.first_expert, module.first_expert + module.num_local_experts)
            missing = [g for g in wanted if g not in found]
            if missing:
                if strict:
                    raise ValueError(f"load_global_state_dict: missing '{base}.<g>' for experts {missing}")
                continue
            out[base] = torch.stack([found[g] for g in wanted])
    if strict and per_weight:
        raise ValueError(f"load_global_state_dict: expert keys for unknown modules: {sorted(per_weight)}")
    return out


def global_state_dict(model: nn.Module, ep_group: dist.ProcessGroup | None = None) -> dict[str, Tensor]:
    """``model.state_dict()`` with experts by global id, on every EP rank (collective over ``ep_group``)."""
    return to_global(model.state_dict(), model, ep_group)


def load_global_state_dict(model: nn.Module, state: Mapping[str, Tensor], ep_group: dist.ProcessGroup | None = None,
                           strict: bool = True) -> None:
    """Load a `global_state_dict` (saved at any EP size) into ``model``: each rank takes its own experts."""
    model.load_state_dict(to_local(state, model, ep_group, strict), strict=strict)
