"""Starting ranks and joining their process group: the one launcher of the library, the trainer, the
benchmarks and the tests.

Two ways in, one shape out (``fn(rank, world_size, *args)`` runs once per rank inside an initialised group):

* under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set, see `torchrun_env`): this process is one
  rank; `init_from_torchrun` joins the group (NCCL on ``cuda:LOCAL_RANK``, gloo on the CPU);
* otherwise `run_distributed` spawns the ranks on this host (gloo on the CPU, NCCL with one GPU per rank).

`launch` picks between them. NVLink multicast is switched off by `disable_multicast`, which a rank calls before
it joins its group here, and `ep_moe.Buffer` / `ep_moe.ElasticBuffer` call when they are made.

Spawned ranks never outlive their launcher (`_die_with_parent`); a rank's exception reaches the launcher as
a `RankFailure` (its type, message and traceback), a rank killed by a signal as a death, all in one
`RankFailures` error.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

log = logging.getLogger("ep_moe")

# The native kernels use unicast peer stores and loads only; NVLink multicast must stay off on shared hosts.
MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


_multicast_logged = False  # the first call that set a variable has said so


def disable_multicast() -> dict[str, str]:
    """Keep torch's symmetric memory, NCCL and NVSHMEM off NVLink multicast in this process and the ranks it
    spawns, unless the user set these variables (`MULTICAST_OFF`). Called where ep_moe makes what reads them: a
    rank joining its group (`launch`, `init_process_group`) and a `Buffer` or `ElasticBuffer` being made; never at
    import. The first call that sets a variable says so in one INFO line of the ``ep_moe`` logger.

    Returns:
        The variables this call set (name -> value); empty when every one was already set.
    """
    global _multicast_logged
    changed = {name: value for name, value in MULTICAST_OFF.items() if name not in os.environ}
    os.environ.update(changed)
    if changed and not _multicast_logged:
        _multicast_logged = True
        log.info("ep_moe: NVLink multicast off in this process and the ranks it starts (%s); set them to "
                 "override", ", ".join(f"{name}={value}" for name, value in changed.items()))
    return changed


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
    disable_multicast()  # before the communicator (NCCL reads NCCL_NVLS_ENABLE when it is made)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    store = _attempt_store(timeout_s)
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def _attempt_store(timeout_s: float) -> dist.Store | None:
    """Under torchelastic with its agent's store (``TORCHELASTIC_USE_AGENT_STORE``): that store, seen through a
    prefix of this attempt of the group. The agents keep one store server for every attempt, so without the
    prefix a restarted group would read the previous attempt's peer addresses and fail to connect. The attempt
    is counted in the store itself (every rank adds 1 to one key as it joins: attempt = (its count - 1) //
    WORLD_SIZE), since ``TORCHELASTIC_RESTART_COUNT`` can differ between agents of one attempt (an agent that
    restarts because another one left does not count it). None elsewhere (``init_process_group``'s own
    ``env://``)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    server = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    attempt = (server.add("ep_moe/joined_ranks", 1) - 1) // int(os.environ["WORLD_SIZE"])
    return dist.PrefixStore(f"ep_moe/attempt_{attempt}/", server)


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


class RankFailure(NamedTuple):
    """One rank's exception, as it reached the launcher."""

    rank: int
    exc_type: str        # the exception's class name (``ValueError``)
    message: str         # ``str(exc)``
    traceback: str       # the formatted traceback, as printed by Python


# Messages of errors that a rank raises because a peer died or failed (the peer's own error is the news).
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "remote worker crashing", "broken pipe",
              "remote process exited", "socket closed", "connection refused")


class RankFailures(RuntimeError):
    """Spawned ranks failed. ``str()`` is the whole story (every failing rank's traceback); the parts:

    * ``failures``: `RankFailure` per rank that raised, by rank;
    * ``deaths``: ``{rank: signal number}`` for ranks killed by a signal the launcher did not send (the OS,
      ``kill -9``);
    * ``exit_codes``: ``{rank: status}`` for ranks that exited without a result and without a signal;
    * ``stopped``: ranks the launcher stopped after another rank failed (or the run's time ran out);
    * ``timed_out``: the run passed ``join_timeout_s``.
    """

    def __init__(self, failures: list[RankFailure], deaths: dict[int, int] | None = None,
                 exit_codes: dict[int, int] | None = None, stopped: list[int] | None = None,
                 timed_out: bool = False) -> None:
        self.failures = sorted(failures)
        self.deaths = dict(sorted((deaths or {}).items()))
        self.exit_codes = dict(sorted((exit_codes or {}).items()))
        self.stopped = sorted(stopped or [])
        self.timed_out = timed_out
        super().__init__(self._describe())

    def __reduce__(self):  # picklable with its fields (a job that runs jobs, multiprocessing pools)
        return type(self), (self.failures, self.deaths, self.exit_codes, self.stopped, self.timed_out)

    def _describe(self) -> str:
        lines = [f"rank {f.rank}: {f.exc_type}: {f.message}\n{f.traceback}" for f in self.failures]
        lines += [f"rank {r} died: {signal_text(s)}" for r, s in self.deaths.items()]
        missing = sorted([*self.deaths, *self.exit_codes, *self.stopped])
        if missing:
            codes: dict[int, Any] = {r: -s for r, s in self.deaths.items()}
            codes.update(self.exit_codes)
            codes.update({r: "stopped" for r in self.stopped})
            lines.append(f"ranks without a result: {missing} (exit codes {dict(sorted(codes.items()))})"
                         + (" after the run's time limit (join_timeout_s)" if self.timed_out else ""))
        return "distributed run failed:\n" + "\n".join(lines)

    def primary_failures(self) -> list[RankFailure]:
        """The failures that are news: those not caused by a peer's death or failure (a gloo "connection
        closed by peer" and the like), unless there is nothing else to show."""
        own = [f for f in self.failures if not is_peer_lost(f.message)]
        return own if own or self.deaths or self.exit_codes else list(self.failures)


def is_peer_lost(message: str) -> bool:
    """Whether a rank's error message says that a peer went away (a consequence, not a cause)."""
    text = message.lower()
    return any(marker in text for marker in _PEER_LOST)


def signal_text(signum: int) -> str:
    """``"signal 9 (SIGKILL)"``."""
    try:
        return f"signal {signum} ({signal.Signals(signum).name})"
    except ValueError:
        return f"signal {signum}"


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int, rank: int) -> None:
    """End this rank when the process that spawned it ends, however it ends (``kill -9`` included), so that
    no orphan trains on, writing checkpoints and metrics.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (the kernel kills this process when the spawning thread
    exits); elsewhere, and as a second line of defence, a daemon thread that checks the parent's pid every
    0.5 s and exits the process with one line when the parent is gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                try:
                    sys.stderr.write(f"ep_moe.distributed: rank {rank}: its launcher (pid {parent_pid}) is gone; "
                                     "exiting\n")
                    sys.stderr.flush()
                finally:
                    os._exit(1)

    threading.Thread(target=watch, name="ep_moe-parent-watch", daemon=True).start()


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn: Callable,
            args: tuple, results, parent_pid: int) -> None:
    # What this process imported (torch, fn's module) is never garbage: kept out of every collection, the
    # collector has far less to walk, at the end of the process above all (about 0.4 s less per rank).
    gc.freeze()
    _die_with_parent(parent_pid, rank)
    torch.set_num_threads(1)
    failed = False
    try:
        init_process_group(rank, world_size, port, backend, timeout_s)
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException as exc:  # reported to the parent, with the traceback (the parent prints it)
        results.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
        failed = True
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    if failed:
        raise SystemExit(1)  # quietly: the launcher has the traceback


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 120.0, join_timeout_s: float = 600.0, forward_signals: bool = False
                    ) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one group.

    ``fn`` must be importable (defined at module level). ``timeout_s`` bounds each collective (the
    process group's timeout); ``join_timeout_s`` the whole run, after which ranks are killed.
    ``forward_signals``: SIGINT/SIGTERM reaching this process are passed on to the ranks (which decide
    what to do with them) instead of stopping it. Returns each rank's return value, by rank; raises
    `RankFailures` (a ``RuntimeError`` whose message has the failing ranks' tracebacks, with the same facts
    in fields) when a rank raises, dies or gives no result.

    Failures: once a rank has raised or died (a rank killed by a signal is noticed within about a second),
    the others get ``FAILURE_GRACE_S`` to report, then are killed. Ranks die with this process, however it
    ends (``kill -9`` included; see `_die_with_parent`).
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


# After the first failure (an error or a dead rank), how long the other ranks get to report before they are
# stopped: enough for the same error on every rank, or a peer's "connection closed", to arrive.
FAILURE_GRACE_S = 5.0
# A rank that exited without a result is counted dead once its result has had this long to arrive.
_RESULT_DRAIN_S = 1.0


# The resource tracker (a helper process of multiprocessing) warns at its exit about the semaphores of a
# process that was killed (the launcher's result queue after ``kill -9``): expected then, so not shown.
_QUIET_TRACKER = "ignore:resource_tracker:UserWarning"


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (if it is not running yet) without its leak warning: it takes
    its warning options from this process's ``sys.warnoptions``."""
    if _QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(_QUIET_TRACKER)


def _spawn_and_collect(fn: Callable, world_size: int, args: tuple, backend: str, timeout_s: float,
                       join_timeout_s: float, failure_grace_s: float = FAILURE_GRACE_S) -> list[Any]:
    _quiet_resource_tracker()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker,
                         args=(rank, world_size, port, backend, timeout_s, fn, args, results, os.getpid()))
             for rank in range(world_size)]
    outcome: dict[int, tuple[str, Any]] = {}
    exited_at: dict[int, float] = {}       # ranks seen exited before their result arrived
    stopped: list[int] = []
    timed_out = False
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + join_timeout_s
        failed_at: float | None = None
        # Read results while the ranks run (a large result would otherwise block its sender forever), and
        # watch the processes: a rank killed by a signal reports nothing.
        while True:
            try:
                rank, status, value = results.get(timeout=0.2)
                outcome[rank] = (status, value)
                if status == "error" and failed_at is None:
                    failed_at = time.monotonic()
            except queue.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in outcome and r not in exited_at and p.exitcode is not None:
                    exited_at[r] = now
            gone = {r for r, t in exited_at.items() if r not in outcome and now - t >= _RESULT_DRAIN_S}
            if failed_at is None and any(procs[r].exitcode != 0 for r in gone):
                failed_at = now
            pending = [r for r in range(world_size) if r not in outcome and r not in gone]
            if not pending:
                break
            if failed_at is not None and now - failed_at >= failure_grace_s:
                stopped = [r for r in pending if procs[r].exitcode is None]
                break
            if now >= deadline:
                stopped, timed_out = [r for r in pending if procs[r].exitcode is None], True
                break
        for r in stopped:
            procs[r].kill()
        while True:  # results that were on their way when the loop ended
            try:
                rank, status, value = results.get(timeout=0.1)
            except queue.Empty:
                break
            outcome.setdefault(rank, (status, value))
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()) if not (stopped or timed_out) else 5.0)
            if p.is_alive():
                p.kill()
                p.join()
    finally:  # the launcher itself was interrupted: take the ranks down with it
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
                p.join()
    failures = [RankFailure(r, *v) for r, (s, v) in sorted(outcome.items()) if s == "error"]
    no_result = [r for r in range(world_size) if r not in outcome and r not in stopped]
    deaths = {r: -procs[r].exitcode for r in no_result if (procs[r].exitcode or 0) < 0}
    exit_codes = {r: procs[r].exitcode for r in no_result if r not in deaths}
    if failures or deaths or exit_codes or stopped:
        raise RankFailures(failures, deaths, exit_codes, stopped, timed_out)
    return [outcome[r][1] for r in range(world_size)]
