"""Measure the rates the bandwidth model needs, once per machine, and cache them in a JSON file.

What is measured (on GPU; `calibrate` is collective over the EP group):

* per-SM local rates: a JIT grid-stride kernel on k SMs (one program per SM) that reads, writes or
  copies 256 MiB; the per-SM rate is the throughput on 2 and 4 SMs divided by k;
* peer rates: every rank stores into the next rank's buffer at once (`torch.distributed._symmetric_memory`
  peer tensors, NVLink multicast off) with k SMs, and with ``copy_`` (the copy engine);
* the kernels themselves (optional, native backend): dispatch and combine of a probe shape at a few SM
  counts, to which `ep_moe.tuning.fit_kernel` fits overhead, link and SM scales.

On a machine without a GPU nothing is measured: `calibrate` and `load_rates` return the datasheet defaults
and say so. The cache file is ``$EP_MOE_CALIBRATION`` if set, else ``$EP_MOE_CACHE_DIR/calibration.json``,
else ``~/.cache/ep_moe/calibration.json``; entries are keyed by GPU model, driver and group topology. A file
that cannot be used (damaged, another format version, no entry for this machine) gives the datasheet rates
with one warning, or, named by a caller (``load_rates(path=...)``), a `CalibrationFileError`.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import disable_multicast
from .bandwidth_model import LayerShape
from .machine_topology import Topology, detect_topology
from .plan import PlanPolicy, link_seconds, op_costs, sm_seconds
from .rates import FitSample, Rates, fit_kernel

log = logging.getLogger("ep_moe")

ENV_CALIBRATION = "EP_MOE_CALIBRATION"
ENV_CACHE_DIR = "EP_MOE_CACHE_DIR"
CACHE_VERSION = 1
STREAM_BYTES = 256 << 20
LOCAL_PROBE_SMS = (2, 4)
PEER_PROBE_SMS = (2, 4, 8, 16, 32)
# The kernel probe: a shape none of the checked workloads uses, at two batch sizes and four SM counts.
PROBE_SHAPES = (LayerShape(128, 8, 6144, 1024), LayerShape(128, 8, 6144, 4096))
PROBE_SMS = (8, 16, 32, 64)

STREAM_THREADS = 512  # threads of one program (block) of the stream kernel


def _stream_function(mode: int, device: int):
    """The JIT stream kernel ``ep_stream`` of ``kernels/stream_probe.cu`` for ``mode`` (0 copy, 1 read, 2 write) on
    ``device``, built at first use. Raises `ep_moe.native.jit.JitUnavailable` where JIT kernels cannot run."""
    from ..native import jit
    from ..native.jit.driver import I64, PTR

    if not jit.available():
        raise jit.JitUnavailable(jit.unavailable_reason())
    source = jit.KernelSource.of("stream_probe.cu", {"EP_MODE": mode})
    return jit.module(source, device).function("ep_stream", (PTR, PTR, I64))


# ------------------------------------------------------------------------------------------ cache file
def cache_path() -> Path:
    """Where calibrations are cached (see the module docstring)."""
    if os.environ.get(ENV_CALIBRATION):
        return Path(os.environ[ENV_CALIBRATION]).expanduser()
    base = os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "ep_moe")
    return Path(base) / "calibration.json"


def cache_key(topology: Topology, backend: str) -> str:
    return f"{topology.key()}|{backend}"


def _hardware_key(topology: Topology, backend: str) -> str:
    """The key without the group's shape: a calibration made for another EP size on the same hardware."""
    return f"{topology.gpu_name}|{topology.num_sms}|{topology.nvlink_links}x{topology.nvlink_link_gbs:g}|" \
           f"{topology.driver}|{backend}"


class CalibrationFileError(ValueError):
    """A calibration file that cannot be used (unreadable, not a calibration cache, another format version, a
    malformed entry, or no entry for this machine): ``path`` and ``why`` say which file and what is wrong."""

    def __init__(self, path: Path, why: str) -> None:
        self.path, self.why = Path(path), why
        super().__init__(f"calibration {path}: {why}")


def _entries(path: Path) -> dict:
    """The file's entries ({} when there is no file); `CalibrationFileError` for one that cannot be used."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationFileError(path, f"cannot be read ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationFileError(path, f"is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or "version" not in data or not isinstance(data.get("entries"), dict):
        raise CalibrationFileError(path, "is not a calibration cache (it needs 'version' and an 'entries' object)")
    if data["version"] != CACHE_VERSION:
        raise CalibrationFileError(path, f"has format version {data['version']!r}; this ep_moe reads version "
                                         f"{CACHE_VERSION}")
    return data["entries"]


def _read_cache(path: Path) -> dict:
    """The entries to keep when writing ``path``: none of a file that cannot be used (it is replaced)."""
    try:
        return _entries(path)
    except CalibrationFileError as exc:
        log.warning("ep_moe: %s; it is replaced by a new file", exc)
        return {}


def save_rates(topology: Topology, rates: Rates, backend: str = "native", path: str | os.PathLike | None = None) -> Path:
    """Store ``rates`` under this topology's key (other entries kept); returns the file written."""
    path = Path(path) if path is not None else cache_path()
    entries = _read_cache(path)
    entries[cache_key(topology, backend)] = {
        "hardware": _hardware_key(topology, backend), "topology": topology.to_dict(), "rates": rates.to_dict(),
        "saved": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def _cached_rates(topology: Topology, backend: str, path: Path) -> Rates | None:
    """The rates ``path`` holds for ``topology`` (or for the same hardware at another EP size, with a note);
    None when there is no file. `CalibrationFileError` for a file that cannot be used or has no entry for
    this machine."""
    entries = _entries(path)
    if not entries:
        return None
    key = cache_key(topology, backend)
    entry, note = entries.get(key), None
    if entry is None:
        hardware = _hardware_key(topology, backend)
        entry = next((e for e in entries.values() if isinstance(e, dict) and e.get("hardware") == hardware), None)
        if entry is None:
            others = sorted(str(k) for k in entries)
            listed = "; ".join(others[:3]) + (f"; and {len(others) - 3} more" if len(others) > 3 else "")
            raise CalibrationFileError(path, f"has no entry for this machine ({key}); it was calibrated for: {listed}")
        try:
            note = f"calibrated for another group ({Topology.from_dict(entry['topology']).describe()})"
        except (KeyError, TypeError, ValueError):
            note = "calibrated for another group"
    if not isinstance(entry, dict) or not isinstance(entry.get("rates"), dict):
        raise CalibrationFileError(path, f"its entry for this machine ({key}) has no 'rates' object")
    try:
        rates = Rates.from_dict(entry["rates"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CalibrationFileError(path, f"its entry for this machine ({key}) is malformed: {exc}") from None
    rates = replace(rates, source=f"{rates.source}; cached in {path}")
    return replace(rates, notes=rates.notes + (note,)) if note else rates


def _datasheet(topology: Topology, why: str) -> Rates:
    defaults = Rates.defaults(topology)
    return replace(defaults, source=f"datasheet defaults ({why})")


def load_rates(topology: Topology, backend: str = "native", path: str | os.PathLike | None = None) -> Rates:
    """The cached calibration for ``topology`` (or for the same hardware at another EP size, with a note),
    else the datasheet defaults (their ``source`` says why).

    The cache file (`cache_path`) is optional: a missing one gives the datasheet rates quietly; one that
    cannot be used (unreadable, damaged, another format version, a malformed entry, no entry for this
    machine) gives them with one warning, ``calibration <path> ignored: <why>; using datasheet rates``.
    A file named by ``path`` is what the caller asked for: the same problems raise `CalibrationFileError`
    (a `ValueError`) naming the file and the problem, and so does a missing file.
    """
    explicit = path is not None
    path = Path(path) if explicit else cache_path()
    try:
        rates = _cached_rates(topology, backend, path)
    except CalibrationFileError as exc:
        if explicit:
            raise
        log.warning("ep_moe: calibration %s ignored: %s; using datasheet rates", path, exc.why)
        return _datasheet(topology, f"calibration {path} ignored: {exc.why}")
    if rates is not None:
        return rates
    if explicit:
        raise CalibrationFileError(path, "does not exist")
    if not topology.has_gpu:
        return _datasheet(topology, "no GPU here: nothing measured")
    return _datasheet(topology, f"no calibration for this machine in {path}")


# ------------------------------------------------------------------------------------------ timing helpers
HEAD_START_CYCLES = 4_000_000  # ~2 ms of device sleep per queued call pair: more than the host takes to queue it


def _loop_us(fn: Callable[[], object], reps: int = 10, warmup: int = 2) -> float:
    """Mean us per call of ``fn`` over ``reps`` back-to-back launches on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def _stream(src: torch.Tensor, dst: torch.Tensor, programs: int, mode: int) -> None:
    """``programs`` blocks of the stream kernel over ``src``'s int32 elements (16-byte aligned, as torch allocates)
    on the current stream of ``src``'s device; ``dst`` holds at least as many (read mode: programs * 512)."""
    device = src.get_device()
    fn = _stream_function(mode, device)
    fn.launch(programs, STREAM_THREADS, torch.cuda.current_stream(device).cuda_stream, src.data_ptr(), dst.data_ptr(),
              src.numel())


# ------------------------------------------------------------------------------------------ measurements
def measure_local_sm_rates(device: torch.device, sms: tuple[int, ...] = LOCAL_PROBE_SMS) -> dict[str, float]:
    """Per-SM GB/s of local reads, writes and copies (bytes read per second for a copy), one GPU."""
    n = STREAM_BYTES // 4
    src = torch.randint(0, 1 << 20, (n,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    out: dict[str, float] = {}
    for name, mode in (("copy", 0), ("read", 1), ("write", 2)):
        per_sm = []
        for k in sms:
            us = statistics.median(_loop_us(lambda k=k, mode=mode: _stream(src, dst, k, mode), reps=3)
                                   for _ in range(3))
            per_sm.append(STREAM_BYTES / (us * 1e-6) / 1e9 / k)
        out[name] = statistics.median(per_sm)
    return out


def measure_peer_rates(group: dist.ProcessGroup, device: torch.device,
                       sms: tuple[int, ...] = PEER_PROBE_SMS) -> dict[str, float]:
    """Every rank stores into the next rank's symmetric buffer at once. Returns GB/s per direction:
    ``push_<k>`` with k SMs, ``copy_engine`` with ``copy_``, ``per_sm`` (push on few SMs / k), ``link``
    (the best push). Collective; NVLink multicast stays off (`ep_moe.distributed.disable_multicast`)."""
    import torch.distributed._symmetric_memory as symm_mem

    disable_multicast()  # before the rendezvous that would read the variables

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = STREAM_BYTES // 4
    buf = symm_mem.empty(n, dtype=torch.int32, device=device)
    handle = symm_mem.rendezvous(buf, group)
    peer = handle.get_buffer((rank + 1) % world, (n,), torch.int32)
    src = torch.randint(0, 1 << 20, (n,), dtype=torch.int32, device=device)
    results: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], None]) -> None:
        samples = []
        for _ in range(3):
            torch.cuda.synchronize()
            dist.barrier(group)  # everyone starts together: both directions are loaded at once
            samples.append(_loop_us(fn, reps=8, warmup=0))  # compiled already (local stage): start in step
        results[name] = STREAM_BYTES / (statistics.median(samples) * 1e-6) / 1e9

    for k in sms:
        timed(f"push_{k}", lambda k=k: _stream(src, peer, k, 0))
    timed("copy_engine", lambda: peer.copy_(src))
    torch.cuda.synchronize()
    dist.barrier(group)  # no rank frees its buffer while a peer may still be storing into it
    small = [results[f"push_{k}"] / k for k in sms if k <= 4] or [results[f"push_{sms[0]}"] / sms[0]]
    results["per_sm"] = statistics.median(small)
    results["link"] = max(results[f"push_{k}"] for k in sms)
    return results


class DispatchBench:
    """Times `Buffer.dispatch` and `Buffer.combine` of one shape at chosen SM counts (collective).

    Inputs are made once: random-score top-k routing as in DeepEP's tests (``|randn| + 1``, per-rank
    seeds), several activation tensors rotated so the L2 cache does not serve them, and the layout.

    Args:
        buffer: an `ep_moe.Buffer` (any backend; on CPU the wall clock replaces CUDA events).
        shape: the layer shape (``shape.tokens`` per rank).
    """

    def __init__(self, buffer, shape: LayerShape, seed: int = 0, rotations: int = 3) -> None:
        self.buffer, self.shape = buffer, shape
        device = buffer.device
        gen = torch.Generator(device=device).manual_seed(seed * 1009 + buffer.rank)
        scores = torch.randn(shape.tokens, shape.num_experts, generator=gen, dtype=torch.float32,
                             device=device).abs() + 1
        values, self.topk_idx = scores.topk(shape.topk, dim=1)
        self.topk_weights = torch.softmax(values, dim=1).float()
        dtype = {1: torch.bfloat16, 2: torch.bfloat16, 4: torch.float32}[shape.dtype_bytes]
        self.xs = [torch.randn(shape.tokens, shape.hidden, generator=gen, dtype=torch.float32, device=device).to(dtype)
                   for _ in range(rotations)]
        if shape.dtype_bytes == 1:
            self.xs = [(x.to(torch.float8_e4m3fn), torch.rand(shape.tokens, shape.hidden // 128, generator=gen,
                                                              dtype=torch.float32, device=device) + 0.5) for x in self.xs]
        self.combine_dtype = torch.bfloat16 if shape.dtype_bytes <= 2 else torch.float32
        self.layout = buffer.get_dispatch_layout(self.topk_idx, shape.num_experts)
        self._combine_inputs: dict[int, list[torch.Tensor]] = {}

    def routing_matrix(self) -> list[list[int]]:
        """``rows[src][dst]``: rows each rank sends to each rank (gathered from every rank)."""
        per_rank = self.layout[0].to(torch.int64)
        everyone = [torch.empty_like(per_rank) for _ in range(self.buffer.group_size)]
        dist.all_gather(everyone, per_rank, group=self.buffer.group)
        return [t.tolist() for t in everyone]

    def _dispatch(self, x, num_sms: int, num_worst_tokens: int = 0):
        per_rank, _, per_expert, in_rank, _ = self.layout
        return self.buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=self.topk_idx,
                                    topk_weights=self.topk_weights, num_worst_tokens=num_worst_tokens,
                                    config=self._config(num_sms))

    @staticmethod
    def _config(num_sms: int):
        from ..config import Config

        return Config(num_sms=num_sms)

    def check(self, num_sms: int) -> None:
        """combine(dispatch(x)) must equal x times the number of ranks each token went to (bf16/fp32)."""
        if self.shape.dtype_bytes == 1:
            return
        x = self.xs[0]
        recv_x, *_, handle, _ = self._dispatch(x, num_sms)
        combined, _, _ = self.buffer.combine(recv_x, handle, config=self._config(num_sms))
        copies = self.layout[3].sum(dim=1, keepdim=True).to(torch.float32)
        expected = (x.float() * copies).to(x.dtype)
        bad = (combined != expected).any(dim=1).nonzero().flatten()[:5].tolist()
        # Every rank learns the outcome, so that all of them raise (none is left waiting in a collective).
        failed = torch.tensor([1 if bad else 0], device=self.buffer.device)
        dist.all_reduce(failed, op=dist.ReduceOp.SUM, group=self.buffer.group)
        if int(failed.item()):
            raise RuntimeError(f"DispatchBench.check: combine(dispatch(x)) != x * ranks at {num_sms} SMs on "
                               f"{int(failed.item())} rank(s) ({self.shape.label()}; rank {self.buffer.rank}'s "
                               f"first bad tokens: {bad})")

    def measure(self, num_sms: int, iters: int = 30, warmup: int = 5) -> tuple[float, float]:
        """(dispatch us, combine us): each rank's median over ``iters`` timed calls, then the max over
        ranks (every rank returns the same numbers).

        The dispatch is the fixed-size one (``num_worst_tokens``: every rank's tokens), which never
        waits on the host, so the time is the GPU's and changes with the SM count alone (the exact-size
        dispatch adds a host round trip that no SM count changes, and the host's jitter). On GPU the
        ``warmup + iters`` dispatch/combine pairs are queued back to back behind a device sleep, as a
        training step queues them, and each call is timed between CUDA events on either side of it: the
        ranks start at slightly different times after a barrier, and queued calls absorb that skew in the
        warm-up pairs instead of adding it to every timed call. On CPU each call is timed by the wall
        clock after a barrier."""
        device, group = self.buffer.device, self.buffer.group
        most_tokens = torch.tensor([self.shape.tokens], device=device)  # the same bound on every rank
        dist.all_reduce(most_tokens, op=dist.ReduceOp.MAX, group=group)
        worst = int(most_tokens.item()) * self.buffer.group_size
        if device.type == "cuda":
            dispatch_us, combine_us = self._queued_us(num_sms, worst, iters, warmup)
        else:
            dispatch_us, combine_us = self._wall_clock_us(num_sms, worst, iters, warmup)
        mine = torch.tensor([statistics.median(dispatch_us), statistics.median(combine_us)], dtype=torch.float64,
                            device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        return float(mine[0]), float(mine[1])

    def _queued_us(self, num_sms: int, worst: int, iters: int, warmup: int) -> tuple[list[float], list[float]]:
        pairs = warmup + iters
        for attempt in range(3):
            self._sync(self.buffer.device, self.buffer.group)
            marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(pairs)]
            torch.cuda._sleep(HEAD_START_CYCLES * pairs << attempt)
            sleep_done = torch.cuda.Event()
            sleep_done.record()
            for i, (before, between, after) in enumerate(marks):
                before.record()
                recv_x, *_, handle, _ = self._dispatch(self.xs[i % len(self.xs)], num_sms, worst)
                between.record()
                self.buffer.combine(self._combine_input(recv_x, i), handle, config=self._config(num_sms))
                after.record()
            # The device must not have caught up with the host (then host gaps would be timed): every
            # rank learns whether any did, and all try again with a longer head start together.
            starved = torch.tensor([1.0 if sleep_done.query() else 0.0], dtype=torch.float32,
                                   device=self.buffer.device)
            torch.cuda.synchronize()
            dist.all_reduce(starved, op=dist.ReduceOp.MAX, group=self.buffer.group)
            if not starved.item():
                break
        else:
            log.warning("ep_moe: DispatchBench: the host could not queue %d call pairs ahead of the GPU; the "
                        "times include host gaps", pairs)
        timed = marks[warmup:]
        return ([1e3 * b.elapsed_time(m) for b, m, _ in timed], [1e3 * m.elapsed_time(a) for _, m, a in timed])

    def _wall_clock_us(self, num_sms: int, worst: int, iters: int, warmup: int) -> tuple[list[float], list[float]]:
        dispatch_us, combine_us = [], []
        for i in range(warmup + iters):
            self._sync(self.buffer.device, self.buffer.group)
            t0 = time.perf_counter()
            recv_x, *_, handle, _ = self._dispatch(self.xs[i % len(self.xs)], num_sms, worst)
            t1 = time.perf_counter()
            y = self._combine_input(recv_x, i)
            self._sync(self.buffer.device, self.buffer.group)
            t2 = time.perf_counter()
            self.buffer.combine(y, handle, config=self._config(num_sms))
            t3 = time.perf_counter()
            if i >= warmup:
                dispatch_us.append((t1 - t0) * 1e6)
                combine_us.append((t3 - t2) * 1e6)
        return dispatch_us, combine_us

    def _combine_input(self, recv_x, i: int) -> torch.Tensor:
        data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        rows = data.shape[0]
        if rows not in self._combine_inputs:  # made once: inside a timed window only in the first pair
            self._combine_inputs[rows] = [torch.randn(rows, self.shape.hidden, dtype=torch.float32,
                                                      device=data.device).to(self.combine_dtype)
                                          for _ in range(len(self.xs))]
        pool = self._combine_inputs[rows]
        return pool[i % len(pool)]

    @staticmethod
    def _sync(device: torch.device, group) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group)
        if device.type == "cuda":
            torch.cuda.synchronize()


def buffer_measure_fn(buffer, shape: LayerShape, iters: int = 20, warmup: int = 3
                      ) -> Callable[[int], tuple[float, float]]:
    """A ``measure_fn`` for `ep_moe.tuning.refine`: (dispatch us, combine us) at an SM count, the same on
    every rank (collective: every rank must call it with the same counts)."""
    bench = DispatchBench(buffer, shape)
    return lambda num_sms: bench.measure(num_sms, iters, warmup)


def fit_kernels(buffer, topology: Topology, rates: Rates, shapes=PROBE_SHAPES, sms=PROBE_SMS,
                iters: int = 20) -> tuple[Rates, list[dict]]:
    """Time dispatch and combine of the probe shapes and fit each op's `KernelFit` (collective)."""
    samples: dict[str, list[FitSample]] = {"dispatch": [], "combine": []}
    raw = []
    policy = PlanPolicy()
    usable = [n for n in sms if n <= (topology.num_sms or max(sms))]
    for shape in shapes:
        bench = DispatchBench(buffer, shape, seed=7)
        costs = op_costs(shape, topology, policy, bench.routing_matrix())  # per rank, from the real routing
        bench.check(usable[0])
        for n in usable:
            measured = bench.measure(n, iters=iters, warmup=3)
            for index, op in enumerate(("dispatch", "combine")):
                timings = [(1e6 * max(link_seconds(pair[index], rates).values(), default=0.0),
                            1e6 * sm_seconds(pair[index], rates, n)) for pair in costs]
                link_us, sm_us = max(timings, key=max)  # the busiest rank
                samples[op].append(FitSample(link_us, sm_us, measured[index]))
            raw.append({"shape": shape.label(), "num_sms": n, "dispatch_us": measured[0], "combine_us": measured[1]})
    fits = {op: fit_kernel(s) for op, s in samples.items()}
    return rates.with_fits(fits["dispatch"], fits["combine"]), raw


def calibrate(group: dist.ProcessGroup | None = None, topology: Topology | None = None, *,
              path: str | os.PathLike | None = None, force: bool = False, buffer=None,
              say: Callable[[str], None] = print) -> Rates:
    """Measure this machine's rates (or read them from the cache) and return them.

    Collective over ``group`` when torch.distributed is initialized (every rank gets the same rates;
    rank 0 writes the cache). Without a GPU it returns the datasheet defaults and says so.

    Args:
        topology: the EP group (default: detected for ``group``).
        force: measure even when the cache has an entry.
        buffer: an `ep_moe.Buffer` on ``group``; when its backend is ``native`` the kernels are probed and
            fitted (see `fit_kernels`), else only the copy benchmarks run.
        say: where progress lines go (rank 0 only).
    """
    initialized = dist.is_available() and dist.is_initialized()
    group = group if group is not None or not initialized else dist.group.WORLD
    rank = dist.get_rank(group) if initialized else 0
    world = dist.get_world_size(group) if initialized else 1
    topology = topology or detect_topology(world_size=world)
    backend = buffer.backend_name if buffer is not None else "native"
    file = Path(path) if path is not None else cache_path()
    try:  # the file this writes: one that cannot be used is replaced, not an error
        cached = _cached_rates(topology, backend, file)
        exact = cached is not None and cache_key(topology, backend) in _entries(file)
    except CalibrationFileError as exc:
        cached, exact = _datasheet(topology, f"calibration {file} ignored: {exc.why}"), False
    if cached is None:
        cached = _datasheet(topology, "no GPU here: nothing measured" if not topology.has_gpu
                            else f"no calibration for this machine in {file}")
    if not torch.cuda.is_available():
        if rank == 0:
            say(f"calibration: no GPU here, nothing measured: {cached.source}")
        return cached
    if not force and cached.measured and exact:
        if rank == 0:
            say(f"calibration: using the cached one ({cached.source})")
        return cached
    device = torch.device("cuda", torch.cuda.current_device())
    defaults = Rates.defaults(topology)
    notes: list[str] = []
    values: dict[str, float] = {}

    def stage(name: str, fn: Callable[[], dict[str, float]]) -> dict[str, float] | None:
        """Run a measurement; every rank learns whether all ranks succeeded (no rank is left waiting)."""
        try:
            out, ok = fn(), 1
        except Exception as exc:  # report, keep the defaults for what this stage would have measured
            out, ok = None, 0
            notes.append(f"{name} not measured on rank {rank}: {type(exc).__name__}: {exc}")
        if initialized:
            flag = torch.tensor([ok], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            if out is not None and not int(flag.item()):
                notes.append(f"{name} not measured: it failed on another rank")
            ok = int(flag.item())
            if ok and out:
                vec = torch.tensor(list(out.values()), dtype=torch.float64, device=device)
                dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=group)  # the slowest rank's numbers
                out = dict(zip(out.keys(), vec.tolist()))
        if rank == 0 and ok and out:
            say(f"calibration: {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()) + " GB/s")
        return out if ok else None

    local = stage("per-SM local rates", lambda: measure_local_sm_rates(device))
    if local:
        values.update(sm_read_gbs=local["read"], sm_write_gbs=local["copy"])
        notes.append(f"per SM: read {local['read']:.1f}, write-only {local['write']:.1f}, copy {local['copy']:.1f} GB/s")
    if world > 1 and topology.intranode:
        peer = stage("peer stores", lambda: measure_peer_rates(group, device))
        if peer:
            values.update(nvlink_gbs=peer["link"], sm_peer_write_gbs=peer["per_sm"], copy_engine_gbs=peer["copy_engine"])
    elif world > 1:
        notes.append("the group spans nodes: NVLink and RDMA rates are datasheet values")
    rates = replace(defaults, **values, measured=bool(values),
                    source=f"measured on {topology.gpu_name} ({topology.driver})" if values else defaults.source,
                    notes=tuple(notes))
    if buffer is not None and buffer.backend_name == "native":
        try:
            rates, raw = fit_kernels(buffer, topology, rates)
            if rank == 0:
                for r in raw:
                    say(f"calibration: probe {r['shape']} at {r['num_sms']} SMs: dispatch {r['dispatch_us']:.1f} us, "
                        f"combine {r['combine_us']:.1f} us")
        except Exception as exc:  # keep the copy-benchmark rates; say why the kernels were not fitted
            rates = replace(rates, notes=rates.notes + (f"kernel probe failed: {type(exc).__name__}: {exc}",))
    elif buffer is not None:
        rates = replace(rates, notes=rates.notes + (f"kernels not probed: backend {buffer.backend_name!r} "
                                                    "does not use an SM count",))
    if rank == 0:
        written = save_rates(topology, rates, backend, path)
        say(f"calibration: saved to {written}")
    if initialized:
        box = [rates.to_dict()]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        rates = Rates.from_dict(box[0])
    return rates


__all__ = ["CACHE_VERSION", "ENV_CACHE_DIR", "ENV_CALIBRATION", "CalibrationFileError", "DispatchBench", "buffer_measure_fn", "cache_key",
           "cache_path", "calibrate", "fit_kernels", "load_rates", "measure_local_sm_rates", "measure_peer_rates",
           "save_rates"]
