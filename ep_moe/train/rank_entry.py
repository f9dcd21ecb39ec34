"""One rank of ``ep-moe train`` with the ``ep_moe`` engine: picks the rank's `ep_moe.train.loop.TrainSteps` (the
two-stage `ep_moe.train.pipeline.PipelineSteps` when ``train.pp_size`` is 2, else
`ep_moe.train.loop.DataParallelSteps`) and runs the shared loop over it."""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from ep_moe.backends.hybrid.node_topology import node_key
from ep_moe.distributed import torchrun_env

from .failures import record_peers, set_stage
from .loop import DataParallelSteps, RunResult, TrainSteps, run_training
from .parallel import enable_determinism
from .pipeline import PipelineSteps
from .recipe_schema import Recipe


def train_rank(recipe: Recipe, device: torch.device) -> RunResult:
    """Train on this rank (the process group is already initialised). Collective: every rank calls it."""
    t0 = time.monotonic()
    t = recipe.train
    if t.deterministic:
        enable_determinism()
    torch.manual_seed(recipe.rng.seed)
    if torchrun_env() is not None:  # under a launcher: who is where, for the line a lost peer prints
        peers: list = [None] * dist.get_world_size()
        dist.all_gather_object(peers, {"node": node_key()[1], "host": socket.gethostname(), "pid": os.getpid()})
        record_peers(peers)
    set_stage("start-up (model, process groups)")
    if t.pp_size > 1:
        steps: TrainSteps = PipelineSteps(recipe, device)
    else:
        steps = DataParallelSteps(recipe, device)
    try:
        return run_training(recipe, steps, t0)
    finally:
        steps.close()


__all__ = ["train_rank"]
