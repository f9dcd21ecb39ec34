"""Several world sizes in one spawned job (tests/ is on sys.path: pytest puts conftest.py's folder there).

A spawned CPU rank costs seconds (its interpreter imports torch and the test module) while a multi-rank case
of the core tests takes less, so a test that covers world sizes 2, 3, 4 and 8 spawns the largest size once
(`run_world_sizes`): that size runs on the whole group, each smaller size ``n`` on the subgroup of ranks
``[0, n)``, one size after the other (a rank outside the remaining subgroups returns when its sizes are done).
Code that runs on the default group (the trainer) gets a one-rank world after a multi-rank one in rank 0 of the
same job (`continue_alone`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ep_moe.distributed import free_port, run_distributed


def run_world_sizes(worker: Callable, sizes: Sequence[int], *args: Any, timeout_s: float = 120.0,
                    join_timeout_s: float = 600.0) -> dict[int, list[Any]]:
    """``worker(rank, num_ranks, group, *args)`` once per world size in ``sizes`` (each ``>= 1``), on
    ``max(sizes)`` spawned ranks: ``group`` is None (the default group, as torch.distributed and ep_moe's buffers
    read it) for the largest size, the subgroup of ranks ``[0, num_ranks)`` for the others, and ``rank`` the rank
    in it. ``worker`` must be importable (module level) and must pass ``group`` to everything collective. Returns ``{num_ranks: [every rank's value, by rank]}``;
    raises `ep_moe.distributed.RankFailures` as `run_distributed` does."""
    order = sorted(set(sizes), reverse=True)
    results = run_distributed(_sizes_worker, order[0], worker, order, args, timeout_s=timeout_s,
                              join_timeout_s=join_timeout_s)
    return {n: [results[r][n] for r in range(n)] for n in sizes}


def _sizes_worker(rank: int, world_size: int, worker: Callable, order: list[int], args: tuple) -> dict[int, Any]:
    groups = {n: None if n == world_size else _first_ranks(n, world_size) for n in order}
    return {n: worker(rank, n, groups[n], *args) for n in order if rank < n}


def _first_ranks(n: int, world_size: int):
    """The group of ranks ``[0, n)`` on its members (collective over the whole group). Each rank joins one group of
    the partition ``[0, n)``, ``[n, world_size)``, so that every rank holds as many process groups as its peers:
    torch names a group made with ``use_local_synchronization`` (ep_moe's hybrid backend makes its hop groups so)
    by its ranks and the number of groups this process holds, which must agree on every member."""
    group, _ = dist.new_subgroups_by_enumeration([list(range(n)), list(range(n, world_size))])
    return group


def continue_alone(rank: int, timeout_s: float = 300.0) -> bool:
    """For code that runs on the default group (the trainer) and needs a one-rank world after a multi-rank one,
    without spawning another interpreter. Collective over the default group: every rank waits for the others
    and leaves it; rank 0 then joins a new default group of its own (world size 1) and gets True, the others get
    False (they have no group left and should return). The launcher destroys the one-rank group at the end."""
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s))
    return True
