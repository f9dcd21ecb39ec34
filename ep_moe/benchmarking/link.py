"""Measure the one-way peer bandwidth (for the floor) in the benchmark's own run: every rank copies
a buffer into its next peer's symmetric buffer with ``copy_`` (a ``cudaMemcpyAsync``, so the copy
engine does it), all ranks at once, so every link carries traffic in both directions as in dispatch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .timing import RunGate, Timer, slowest_rank_per_run, summarize, time_runs


def measure_peer_copy_gbps(group: dist.ProcessGroup, device: torch.device, timer: Timer,
                           nbytes: int = 1 << 30, runs: int = 10, warmup: int = 3) -> float:
    """GB/s (1e9 B/s) of one rank's copy into its next peer, the slowest rank of each run; collective.

    Uses ``torch.distributed._symmetric_memory`` (peer pointers over NVLink). Raises when it is not
    available or the group has one rank.
    """
    import torch.distributed._symmetric_memory as symm_mem

    world = dist.get_world_size(group)
    if world < 2:
        raise RuntimeError("the group has a single rank: there is no peer to copy to")
    rank = dist.get_rank(group)
    name = group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed by older torch, a no-op later
    if enable is not None:
        enable(name)
    target = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(target, name)
    source = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, device=device)  # not zeros
    peer = handle.get_buffer((rank + 1) % world, (nbytes,), torch.uint8)
    samples = time_runs(lambda _: peer.copy_(source), runs=runs, warmup=warmup, num_sets=1, timer=timer,
                        gate=RunGate(group, device))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, samples, group=group)
    median_us = summarize(slowest_rank_per_run(gathered)).median_us
    torch.cuda.synchronize()
    dist.barrier(group=group)  # nobody frees its buffer (on return) while a peer may still write into it
    return nbytes / (median_us * 1e-6) / 1e9
