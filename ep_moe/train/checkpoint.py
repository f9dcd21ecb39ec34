"""Trainer checkpoints that load at any EP size.

A checkpoint is a folder ``<save>/step_<NNNNNNN>/`` with

* ``model.pt``: `ep_moe.layers.global_state_dict` (experts one tensor per global expert id);
* ``optimizer.pt``: AdamW state by parameter name, expert moments converted the same way (by global
  expert id, with `ep_moe.layers.to_global`), so the optimizer is resharded too, not only the model;
* ``trainer.pt``: the step (the data position: batches are a function of the step), the recipe, the
  world and EP sizes, and every rank's RNG states (restored only when the world size matches; the
  trainer draws no random numbers after initialisation, so they matter only for user extensions).

Rank 0 writes into a temporary folder and renames it, then points ``<save>/latest`` at it, so a run
killed at any moment (``kill -9``) leaves the previous checkpoint intact and loadable.

Every engine uses the same folders: ``<save>/step_<NNNNNNN>/``, the ``<save>/latest`` pointer (a file holding
the folder's name, as DeepSpeed's) and ``checkpoint.keep_last`` (`step_dir_name`, `read_latest`,
`write_latest`, `prune`); what is inside a folder is the engine's own (Megatron: one file per rank;
DeepSpeed: its checkpoint with per-expert files).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ep_moe.layers.global_state import global_state_dict, load_global_state_dict, to_global, to_local

FORMAT_VERSION = 1
LATEST = "latest"
FILES = ("model.pt", "optimizer.pt", "trainer.pt")


def save_due(checkpoint, step: int, last: bool, stopping: bool) -> bool:
    """Whether every engine saves after ``step``: with ``checkpoint.save`` set, at the last step, when stopping
    (Ctrl-C), and every ``checkpoint.save_interval`` steps (0: never in between)."""
    c = checkpoint
    return c.save is not None and (last or stopping or bool(c.save_interval and step % c.save_interval == 0))


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def _is_checkpoint(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in FILES)


def read_latest(save_dir: str) -> str | None:
    """The folder ``<save_dir>/latest`` names, if it exists (any engine), else None."""
    pointer = os.path.join(save_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        name = f.read().strip()
    path = os.path.join(save_dir, name)
    return path if name and os.path.isdir(path) else None


def find_engine_checkpoint(save: str | None, load: str | None, resume: bool, is_checkpoint, what: str
                           ) -> str | None:
    """Where an engine starts from: with ``resume``, the latest checkpoint in ``save`` (if any); else ``load``
    (a checkpoint folder, or a save folder: its latest); else None. ``is_checkpoint(path)`` tells this engine's
    checkpoints; ``what`` names them in the error for a ``load`` that is neither."""
    if resume and save is not None:
        latest = read_latest(save)
        if latest is not None and is_checkpoint(latest):
            return latest
    if load is not None:
        if is_checkpoint(load):
            return load
        latest = read_latest(load)
        if latest is not None and is_checkpoint(latest):
            return latest
        raise ValueError(f"checkpoint.load: {load!r} is neither {what} nor a save folder whose 'latest' is one")
    return None


def write_latest(save_dir: str, name: str) -> None:
    """Point ``<save_dir>/latest`` at the folder ``name`` (atomically: a killed run leaves the old pointer)."""
    pointer_tmp = os.path.join(save_dir, f".{LATEST}.tmp")
    with open(pointer_tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
    os.replace(pointer_tmp, os.path.join(save_dir, LATEST))


def step_of(path: str) -> int | None:
    """The step of a folder named `step_dir_name`, else None."""
    name = os.path.basename(os.path.normpath(path))
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def latest_checkpoint(save_dir: str) -> str | None:
    """The ep_moe engine's checkpoint ``<save_dir>/latest`` points at, or None."""
    path = read_latest(save_dir)
    return path if path is not None and _is_checkpoint(path) else None


def resolve_load_path(path: str) -> str:
    """A checkpoint folder, or a save folder (then its latest checkpoint)."""
    if _is_checkpoint(path):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"checkpoint.load: {path!r} is neither a checkpoint folder (with {', '.join(FILES)}) "
                         f"nor a save folder with a '{LATEST}' checkpoint")
    return latest


def find_checkpoint_to_load(recipe) -> str | None:
    """``checkpoint.resume``: the latest checkpoint in ``checkpoint.save`` (if any); otherwise
    ``checkpoint.load`` (if set); otherwise None (a fresh start)."""
    c = recipe.checkpoint
    if c.resume and c.save is not None:
        latest = latest_checkpoint(c.save)
        if latest is not None:
            return latest
    if c.load is not None:
        return resolve_load_path(c.load)
    return None


# ---------------------------------------------------------------------------------------------- optimizer
def optimizer_global_state(model: torch.nn.Module, state: Mapping[torch.nn.Parameter, dict[str, Any]],
                           ep_group: dist.ProcessGroup | None) -> dict[str, Any]:
    """``{"tensors": {state key: {global param key: tensor}}, "scalars": {state key: {param name: tensor}}}`` of
    ``state`` (an optimizer's ``state``, or the complete state a sharded trainer gathered: every parameter of this
    rank's model part).

    Collective over ``ep_group``: per-parameter moments (same shape as the parameter) of expert weights go
    through `to_global`; 0-dim entries (Adam's ``step``) are kept by parameter name.
    """
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        for key, value in state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.ndim == 0:
                scalars.setdefault(key, {})[name] = value.detach().cpu().clone()
            elif value.shape == param.shape:
                tensors.setdefault(key, {})[name] = value.detach()
            else:
                raise ValueError(f"checkpoint: optimizer state '{key}' of '{name}' has shape {tuple(value.shape)}, "
                                 f"not the parameter's {tuple(param.shape)}")
    out_tensors = {key: {k: v.cpu() for k, v in to_global(mapping, model, ep_group).items()}
                   for key, mapping in sorted(tensors.items())}
    return {"tensors": out_tensors, "scalars": scalars}


def load_optimizer_global_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                                ep_group: dist.ProcessGroup | None) -> None:
    """Put a saved `optimizer_global_state` (any EP size) into ``optimizer`` (no communication): the state of the
    parameters ``optimizer`` steps (a sharded optimizer or a pipeline stage steps only some of the model's)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    params = dict(model.named_parameters())
    for key, mapping in state["tensors"].items():
        local = to_local(mapping, model, ep_group, strict=True)
        unknown = sorted(set(local) - set(params))
        if unknown:
            raise ValueError(f"checkpoint: optimizer state for unknown parameters {unknown[:5]}")
        for name, value in local.items():
            param = params[name]
            if value.shape != param.shape:
                raise ValueError(f"checkpoint: optimizer state '{key}' of '{name}' has shape {tuple(value.shape)}, "
                                 f"the parameter {tuple(param.shape)}")
            if id(param) in stepped:
                optimizer.state[param][key] = value.to(param.device).clone()
    for key, mapping in state["scalars"].items():
        for name, value in mapping.items():
            if name not in params:
                raise ValueError(f"checkpoint: optimizer state '{key}' for unknown parameter '{name}'")
            if id(params[name]) in stepped:
                optimizer.state[params[name]][key] = value.clone()


# ---------------------------------------------------------------------------------------------- RNG
def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------------------------- save / load
def save_checkpoint(recipe, model, optimizer_state: Mapping[torch.nn.Parameter, dict[str, Any]], ps,
                    step: int) -> str:
    """Save step ``step`` into ``checkpoint.save`` (collective: every rank calls it); returns the folder.
    ``optimizer_state``: every parameter's optimizer state on this rank (``optimizer.state``, or what a sharded
    trainer gathered); ``model`` must hold every parameter's current value (a pipeline stage first takes the
    other stage's)."""
    save_dir = recipe.checkpoint.save
    ep_group = model.ep_group
    model_state = {k: v.detach().cpu() for k, v in global_state_dict(model, ep_group).items()}
    optim_state = optimizer_global_state(model, optimizer_state, ep_group)
    rng_states: list[Any] = [None] * ps.world_size
    if ps.world_size > 1:
        dist.all_gather_object(rng_states, _rng_state(ps.device))
    else:
        rng_states[0] = _rng_state(ps.device)
    final = os.path.join(save_dir, step_dir_name(step))
    if ps.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        tmp = os.path.join(save_dir, f".tmp_{step_dir_name(step)}_{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        trainer = {"format_version": FORMAT_VERSION, "step": step,
                   "consumed_samples": step * recipe.train.global_batch_size, "world_size": ps.world_size,
                   "ep_size": ps.ep_size, "recipe": recipe.to_dict(), "rng_states": rng_states,
                   "saved_at": time.time()}
        torch.save(model_state, os.path.join(tmp, "model.pt"))
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
        torch.save(trainer, os.path.join(tmp, "trainer.pt"))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_latest(save_dir, step_dir_name(step))
        prune(save_dir, step, recipe.checkpoint.keep_last)
    if ps.world_size > 1:
        dist.barrier()
    return final


def prune(save_dir: str, step: int, keep_last: int) -> None:
    """Remove checkpoints of earlier steps beyond the newest ``keep_last`` (0 = keep all), and stale
    temporary folders of killed saves."""
    for name in os.listdir(save_dir):
        if name.startswith(".tmp_"):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    if keep_last <= 0:
        return
    earlier = sorted(n for n in os.listdir(save_dir)
                     if n.startswith("step_") and n[5:].isdigit() and int(n[5:]) < step)
    for name in earlier[: max(0, len(earlier) - (keep_last - 1))]:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def load_checkpoint(path: str, model, optimizer, ps) -> int:
    """Load a checkpoint saved at any EP size into this rank's model and optimizer; returns its step."""
    trainer = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True)
    if trainer.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path!r}: format version {trainer.get('format_version')} is not "
                         f"{FORMAT_VERSION}")
    saved_model = trainer["recipe"]["model"]
    current = model.config
    for key in ("vocab_size", "num_layers", "hidden_size", "num_moe_experts", "moe_ffn_hidden_size"):
        if saved_model.get(key) != getattr(current, key):
            raise ValueError(f"checkpoint {path!r}: model.{key} is {saved_model.get(key)} there, "
                             f"{getattr(current, key)} in this recipe")
    model_state = torch.load(os.path.join(path, "model.pt"), map_location="cpu", weights_only=True)
    load_global_state_dict(model, model_state, model.ep_group)
    optim_state = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
    load_optimizer_global_state(model, optimizer, optim_state, model.ep_group)
    if trainer["world_size"] == ps.world_size:
        _set_rng_state(trainer["rng_states"][ps.rank], ps.device)
    return int(trainer["step"])


def checkpoint_info(path: str) -> dict[str, Any]:
    """Step, world and EP size of a checkpoint (for messages and tests)."""
    trainer = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True)
    return {k: trainer[k] for k in ("step", "world_size", "ep_size", "consumed_samples")}
