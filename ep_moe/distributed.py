"""Starting and joining process groups: spawned gloo ranks on CPU (tests, the CPU trainer) or the
``torchrun`` environment on GPU."""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, port: int, backend: str = "gloo",
                       timeout_s: float = 120.0) -> None:
    """Join a TCP-rendezvous process group on 127.0.0.1 (one host)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn: Callable,
            args: tuple, results) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world_size, port, backend, timeout_s)
    try:
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException as exc:  # report to the parent with the traceback, then re-raise
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 120.0, join_timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one group.

    ``fn`` must be importable (defined at module level). ``timeout_s`` bounds each collective (the
    process group's timeout); ``join_timeout_s`` the whole run, after which ranks are killed. Returns
    each rank's return value, by rank; raises ``RuntimeError`` with the failing ranks' tracebacks.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, backend, timeout_s, fn, args, results))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + join_timeout_s
    # Read results while the ranks run: a large result would otherwise block its sender forever.
    while len(outcome) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.5)
            outcome[rank] = (status, value)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(outcome.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in outcome]
    if errors or missing:
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors)
                           + (f"\nranks without a result: {missing} (exit codes {codes})" if missing else ""))
    return [outcome[r][1] for r in range(world_size)]
