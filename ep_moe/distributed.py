"""Starting ranks and joining their process group: the one launcher of the library, the trainer, the
benchmarks and the tests.

Two ways in, one shape out (``fn(rank, world_size, *args)`` runs once per rank inside an initialised group):

* under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set, see `torchrun_env`): this process is one
  rank; `init_from_torchrun` joins the group (NCCL on ``cuda:LOCAL_RANK``, gloo on the CPU);
* otherwise `run_distributed` spawns the ranks on this host (gloo on the CPU, NCCL with one GPU per rank).

`launch` picks between them. NVLink multicast is switched off here (`disable_multicast`), once, when
``ep_moe`` is imported.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The native kernels use unicast peer stores and loads only; NVLink multicast must stay off on shared hosts.
MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast() -> None:
    """Keep torch's symmetric memory, NCCL and NVSHMEM off NVLink multicast in this process and the ranks it
    spawns, unless the user set these variables. Called when ``ep_moe`` is imported, before anything can
    create symmetric memory or an NCCL communicator."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


class TorchrunEnv(NamedTuple):
    rank: int
    world_size: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    """This process's place in a ``torchrun`` job, or None when it was not started by one."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return TorchrunEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(backend: str, rank: int, world_size: int, timeout_s: float, device: torch.device | None) -> None:
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


DEVICE_TYPES = ("cuda", "cpu")


def _check_device_type(device_type: str) -> None:
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"ep_moe.distributed: device_type must be one of {DEVICE_TYPES}, got {device_type!r}")


def init_from_torchrun(device_type: str = "cuda", timeout_s: float = 300.0) -> torch.device:
    """Join the ``torchrun`` job's group: NCCL on ``cuda:LOCAL_RANK`` for ``device_type="cuda"``, gloo for
    ``"cpu"``; ``timeout_s`` bounds each collective. Returns this rank's device. Raises `ValueError` for
    another ``device_type``, `RuntimeError` outside ``torchrun`` or when ``cuda:LOCAL_RANK`` does not exist."""
    _check_device_type(device_type)
    env = torchrun_env()
    if env is None:
        raise RuntimeError("ep_moe.distributed.init_from_torchrun: RANK, WORLD_SIZE and LOCAL_RANK are not set "
                           "(start the program with torchrun)")
    if device_type == "cuda":
        visible = torch.cuda.device_count()
        if env.local_rank >= visible:
            raise RuntimeError(f"ep_moe.distributed.init_from_torchrun: LOCAL_RANK is {env.local_rank} but "
                               f"{visible} CUDA devices are visible (one GPU per rank: --nproc-per-node at most "
                               f"{visible})")
        device = torch.device("cuda", env.local_rank)
        _join("nccl", env.rank, env.world_size, timeout_s, device)
        return device
    _join("gloo", env.rank, env.world_size, timeout_s, None)
    return torch.device("cpu")


def init_process_group(rank: int, world_size: int, port: int, backend: str = "gloo",
                       timeout_s: float = 120.0) -> None:
    """Join a TCP-rendezvous process group on 127.0.0.1 (one host); NCCL ranks take GPU ``rank % count``."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else None
    _join(backend, rank, world_size, timeout_s, device)


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
                    timeout_s: float = 120.0, join_timeout_s: float = 600.0, forward_signals: bool = False
                    ) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one group.

    ``fn`` must be importable (defined at module level). ``timeout_s`` bounds each collective (the
    process group's timeout); ``join_timeout_s`` the whole run, after which ranks are killed.
    ``forward_signals``: SIGINT/SIGTERM reaching this process are passed on to the ranks (which decide
    what to do with them) instead of stopping it. Returns each rank's return value, by rank; raises
    ``RuntimeError`` with the failing ranks' tracebacks.
    """
    previous = _forward_signals() if forward_signals else {}
    try:
        return _spawn_and_collect(fn, world_size, args, backend, timeout_s, join_timeout_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch(fn: Callable, nproc: int, *args: Any, device_type: str = "cpu", timeout_s: float = 300.0,
           join_timeout_s: float = 7 * 24 * 3600.0, forward_signals: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank of a job.

    Under ``torchrun`` this process is one rank (`init_from_torchrun`; ``nproc`` is ignored) and the result
    is ``[its value]``; otherwise ``nproc`` ranks are spawned (`run_distributed`: gloo for ``device_type``
    ``"cpu"``, NCCL with one GPU per rank for ``"cuda"``) and the result is every rank's value, by rank.
    The group is destroyed when ``fn`` returns. Raises `ValueError` for another ``device_type``.
    """
    _check_device_type(device_type)
    env = torchrun_env()
    if env is None:
        return run_distributed(fn, nproc, *args, backend="nccl" if device_type == "cuda" else "gloo",
                               timeout_s=timeout_s, join_timeout_s=join_timeout_s, forward_signals=forward_signals)
    init_from_torchrun(device_type, timeout_s)
    try:
        return [fn(env.rank, env.world_size, *args)]
    finally:
        dist.destroy_process_group()


def nccl_version() -> str | None:
    """The NCCL version torch was built with (e.g. ``"2.27.5"``), or None where torch has no NCCL."""
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a CPU build of torch, or NCCL not loadable
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _forward_signals() -> dict:
    """Pass SIGINT/SIGTERM on to this process's children instead of dying; returns the previous handlers."""
    def forward(signum, frame):
        for child in mp.active_children():
            try:
                os.kill(child.pid, signum)
            except ProcessLookupError:
                pass

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}


def _spawn_and_collect(fn: Callable, world_size: int, args: tuple, backend: str, timeout_s: float,
                       join_timeout_s: float) -> list[Any]:
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
