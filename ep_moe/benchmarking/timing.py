"""Timing loops with a pluggable clock: CUDA events on GPU, ``time.perf_counter`` on CPU.

The same loop serves both, so the CPU benchmark (CI) runs the code path the GPU benchmark runs.
Before every run, a *gate* lines the ranks up (a barrier, so runs never overlap) and the run uses the
next of several input sets in turn (so that a cache does not serve the inputs).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Timer(Protocol):
    """A clock: ``mark()`` records a point in time, ``elapsed_us(a, b)`` reads the span between two
    marks once ``sync()`` has returned."""

    description: str

    def mark(self) -> Any: ...

    def sync(self) -> None: ...

    def elapsed_us(self, start: Any, end: Any) -> float: ...


class WallTimer:
    """Host wall-clock time (CPU ranks: every gloo collective has finished when its call returns)."""

    description = "wall-clock time.perf_counter"

    def mark(self) -> float:
        return time.perf_counter()

    def sync(self) -> None:
        pass

    def elapsed_us(self, start: float, end: float) -> float:
        return (end - start) * 1e6


class CudaEventTimer:
    """GPU time between CUDA events recorded on the current stream (`ep_moe.Buffer` joins its
    communication stream back into the current stream before a synchronous call returns)."""

    description = "CUDA events"

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        torch.cuda.synchronize()

    def elapsed_us(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) * 1e3  # elapsed_time is in milliseconds


def median_event_seconds(fn: Callable[[], object], iters: int, before: Callable[[], object] | None = None) -> float:
    """Median GPU seconds of ``fn()`` over ``iters`` runs, each between two CUDA events on the current stream
    (a quick timer for the scripts in ``benchmarks/``); ``before()``, if given, runs untimed ahead of each run (e.g.
    a barrier and a device synchronize)."""
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return statistics.median(times)


class RunGate:
    """What precedes each timed run: every rank finishes its GPU work and meets the others.

    On GPU, after the host barrier, a device sleep (``head_start_us``, longer than the host needs to
    queue a call) lets the host queue the whole run ahead of the GPU, then a one-element all-reduce
    releases every GPU at the same moment. So the time is the GPU's: Python and launch overhead count
    only where the call waits on the host (an exact-size dispatch reads the counts), and a run does not
    start on one GPU while its peer is still being launched.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, head_start_us: float = 2000.0) -> None:
        self.group = group
        self.cuda = device.type == "cuda"
        self._token = torch.ones(1, dtype=torch.float32, device=device) if self.cuda else None
        self._sleep = getattr(torch.cuda, "_sleep", None) if self.cuda else None
        # ~2 GHz SM clock: cycles for the head start (a shorter or longer sleep only changes idle time).
        self._sleep_cycles = int(head_start_us * 2000)

    def __call__(self) -> None:
        if not self.cuda:
            dist.barrier(group=self.group)
            return
        torch.cuda.synchronize()
        dist.barrier(group=self.group)
        torch.cuda.synchronize()
        if self._sleep is not None:
            self._sleep(self._sleep_cycles)
        dist.all_reduce(self._token, op=dist.ReduceOp.MAX, group=self.group)


def time_runs(fn: Callable[[int], object], *, runs: int, warmup: int, num_sets: int, timer: Timer,
              gate: Callable[[], None], check: Callable[[int, int, object], None] | None = None) -> list[float]:
    """Time ``fn(set_index)`` ``runs`` times after ``warmup`` untimed calls; set indices rotate over
    ``range(num_sets)``. Returns the ``runs`` durations in microseconds, in order.

    ``check(call, set_index, result)``, when given, sees every call's result, warm-up calls included (``call``
    counts from 0 over the whole loop: the timed run ``j``, from 1, is call ``warmup + j - 1``). It runs after
    the call's end mark, so whatever it queues on the device runs after the timed region, and the next run's
    gate waits for it: it adds nothing to the times."""
    if runs < 1 or warmup < 0 or num_sets < 1:
        raise ValueError(f"time_runs: need runs >= 1, warmup >= 0, num_sets >= 1; got {runs}, {warmup}, {num_sets}")
    marks = []
    for i in range(warmup + runs):
        gate()
        start = timer.mark()
        result = fn(i % num_sets)
        end = timer.mark()
        if check is not None:
            check(i, i % num_sets, result)
        del result  # outputs die here, after the end mark (and the check's work) was queued
        if i >= warmup:
            marks.append((start, end))
    timer.sync()
    return [timer.elapsed_us(start, end) for start, end in marks]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default method), in plain Python so that the benchmark needs nothing beyond torch."""
    if not values:
        raise ValueError("percentile: argument 'values' must not be empty")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: argument 'q' must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    """Median and spread of one measurement, microseconds."""

    median_us: float
    p10_us: float
    p90_us: float
    runs: int


def summarize(samples: Sequence[float]) -> Stats:
    return Stats(percentile(samples, 50), percentile(samples, 10), percentile(samples, 90), len(samples))


def slowest_rank_per_run(per_rank_samples: Sequence[Sequence[float]]) -> list[float]:
    """Run ``i`` of a collective ends when its slowest rank ends: ``max over ranks`` of each run."""
    lengths = {len(s) for s in per_rank_samples}
    if len(lengths) != 1:
        raise ValueError(f"slowest_rank_per_run: ranks timed different numbers of runs: {sorted(lengths)}")
    return [max(run) for run in zip(*per_rank_samples)]
