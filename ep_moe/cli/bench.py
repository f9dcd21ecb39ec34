"""``ep-moe bench``: time layout, dispatch and combine of every backend in one run, on the same routing.

For each token count, every backend gets the same random inputs (DeepEP's intranode workload by
default: 4096 tokens per rank, hidden 7168, top-8 of 256 experts). Before anything is timed, one call of
each operation on each input set is checked: layout against the reference, received rows and per-expert
counts against every rank's layout, cached dispatch against dispatch, fixed-size dispatch against dispatch
plus padding rows, ``combine(dispatch(x))`` against ``x`` summed once per rank it went to, FP8 rows against
the quantized BF16 rows, and every output of every backend bit for bit against the first one (torch), on
every input set. Then each operation is timed (see `ep_moe.benchmarking.timing`), every timed call's outputs
are compared with the checked call's by fingerprint (`ep_moe.benchmarking.verification`), and each is
reported with DeepEP-counted GB/s and the fraction of the NVLink floor it reaches
(`ep_moe.benchmarking.accounting`).

Launch: on GPUs, one NCCL process per visible GPU (spawned here, or under ``torchrun``); on CPU,
``--ranks`` gloo processes with small sizes and wall-clock times.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import native, permute
from ..benchmarking.accounting import row_payload_bytes, traffic
from ..benchmarking.checks import (
    EXPERT_FIXED_PADDING,
    check_fixed,
    check_layout,
    compare,
    expected_recv_counts,
    expert_round_trip_reference,
    round_trip_reference,
)
from ..benchmarking.results import Row, finalize, plot, table, write_json
from ..benchmarking.timing import (
    CudaEventTimer,
    RunGate,
    WallTimer,
    slowest_rank_per_run,
    summarize,
    time_runs,
)
from ..benchmarking.verification import CallCheck, CheckedCalls, Outputs, named_outputs
from ..benchmarking.workload import DTYPES, InputSet, make_input_set, num_input_sets, to_fp8_blocks
from ..buffer.buffer_v1 import Buffer
from ..buffer.expert_major_ops import expert_combine, expert_dispatch
from ..config import Config
from ..distributed import MULTICAST_OFF, launch, nccl_version, torchrun_env
from ..tuning import plan_for_layer

GPU_DEFAULTS = {"tokens": [4096], "hidden": 7168, "experts": 256, "topk": 8}  # DeepEP's intranode test
CPU_DEFAULTS = {"tokens": [64, 128, 256], "hidden": 256, "experts": 16, "topk": 4}  # a sweep: the plot has a curve
DEFAULT_LINK_GBPS = 394.0  # copy-engine peer copy, H200 pair over NV18 (CHANGELOG.md, baselines)
MAX_INPUT_SETS = 32
L2_FALLBACK_BYTES = 60 << 20


@dataclass(frozen=True)
class BackendSpec:
    """A backend to benchmark: its label in the report, the ``Buffer(backend=...)`` it asks for, whether it
    takes an SM budget (then it is timed at every ``--num-sms``; else once, SMs "-"), and ``factory``, what
    builds its `Buffer` on every rank: ``"module:function"``, importable there (a name, so that it reaches
    spawned ranks), called as `Buffer` is (``factory(group, backend=buffer_backend, num_nvl_bytes=...,
    timeout_s=..., check_inputs=False)``) and returning an `ep_moe.Buffer`. A factory benchmarks a
    transport that is not built in, e.g. a `Buffer` whose ``backend`` wraps or replaces the one it made."""

    name: str
    buffer_backend: str
    takes_sms: bool
    factory: str = "ep_moe.buffer.buffer_v1:Buffer"

    def __post_init__(self) -> None:
        module, _, attr = self.factory.partition(":") if isinstance(self.factory, str) else ("", "", "")
        if not module or not attr:
            raise ValueError(f"BackendSpec: argument 'factory' must be a string 'module:function', "
                             f"got {self.factory!r}")

    def build(self, group: dist.ProcessGroup, **kwargs) -> Buffer:
        """This rank's `Buffer`: ``factory(group, backend=buffer_backend, **kwargs)``."""
        module, _, attr = self.factory.partition(":")
        try:
            make = importlib.import_module(module)
            for part in attr.split("."):
                make = getattr(make, part)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"BackendSpec: argument 'factory' must name an importable callable, "
                             f"got {self.factory!r} ({type(exc).__name__}: {exc})") from exc
        buffer = make(group, backend=self.buffer_backend, **kwargs)
        if not isinstance(buffer, Buffer):
            raise ValueError(f"BackendSpec: argument 'factory' must return an ep_moe.Buffer, "
                             f"{self.factory!r} returned {type(buffer).__name__}")
        return buffer


BACKENDS = {"torch": BackendSpec("torch", "torch", False), "native": BackendSpec("native", "native", True)}


@dataclass(frozen=True)
class BenchSpec:
    """Everything a rank needs to run the benchmark (picklable: it travels to spawned ranks)."""

    backends: tuple[BackendSpec, ...]
    tokens: tuple[int, ...]
    hidden: int
    experts: int
    topk: int
    dtypes: tuple[str, ...]
    num_sms: tuple[int, ...]
    runs: int
    warmup: int
    device: str  # "cuda" or "cpu"
    link_gbps: float
    measure_link: bool = False
    seed: int = 0
    timeout_s: float = 120.0
    plan_sms: bool = False  # also time at the tuner's SM count for each shape
    expert_major: bool = False  # also time the expert-major dispatch (exact and fixed size) and weighted combine
    argv: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------ per rank
def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def _capped(problems: list[str], keep: int = 6) -> list[str]:
    """The first few problems (a broken kernel fails the same way in every set and rank)."""
    return problems[:keep] + ([f"... and {len(problems) - keep} more"] if len(problems) > keep else [])


def _collective(group: dist.ProcessGroup, fn: Callable[[], object]) -> tuple[list, list[str]]:
    """Run ``fn()`` on every rank and share the outcome: returns (each rank's value, errors by rank).

    An exception on one rank becomes an error every rank sees, so all of them skip the same work
    instead of waiting for each other in the next collective. ``fn`` must return something small.
    """
    try:
        value, error = fn(), None
    except Exception as exc:  # reported in the table, traceback on this rank's stderr
        traceback.print_exc()
        value, error = None, f"{type(exc).__name__}: {exc}"
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (error, value), group=group)
    errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(everyone) if e is not None]
    return [v for _, v in everyone], errors


class _RankBench:
    """One rank's share of the benchmark; every rank runs the same sequence of collectives."""

    def __init__(self, rank: int, world: int, spec: BenchSpec) -> None:
        self.rank, self.world, self.spec = rank, world, spec
        self.group = dist.group.WORLD
        self.cuda = spec.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.timer = CudaEventTimer() if self.cuda else WallTimer()
        self.gate = RunGate(self.group, self.device)
        self.cache_bytes = 0
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            self.cache_bytes = int(getattr(props, "L2_cache_size", 0) or L2_FALLBACK_BYTES)
        self.rows: list[Row] = []
        self.buffers: dict[str, Buffer] = {}
        self.sets_per_tokens: dict[int, int] = {}

    # -------------------------------------------------------------- rows
    def _emit(self, row: Row) -> None:
        self.rows.append(row)
        sms = "-" if row.num_sms is None else row.num_sms
        what = f"[bench] {row.backend:<7} {row.dtype or '-':<4} T={row.tokens:<6} SMs={sms:<3} {row.op:<15}"
        if row.median_us is None:
            _say(self.rank, f"{what} {row.check}: {'; '.join(row.problems)}")
        else:
            _say(self.rank, f"{what} {row.median_us:10.1f} us (p10 {row.p10_us:.1f}, p90 {row.p90_us:.1f})"
                            f"  check {row.check}  kernels {row.kernels}")

    def _measure(self, row: Row, op: str, fn: Callable[[int], object], num_sets: int, problems: list[str],
                 expected: list[Outputs]) -> None:
        """Time ``fn`` on every rank, checking every call against ``expected`` (per input set: the checked
        call's fingerprints); fill ``row`` with the slowest-rank statistics and every problem; emit it."""
        def timed() -> tuple[list[float], list[str]]:
            permute.reset_implementations_run()
            check = CallCheck(op, expected, self.spec.warmup, self.device)
            samples = time_runs(fn, runs=self.spec.runs, warmup=self.spec.warmup, num_sets=num_sets,
                                timer=self.timer, gate=self.gate, check=check)
            return samples, check.problems()

        found, errors = _collective(self.group, timed)
        if errors:
            row.check, row.problems = "error", _capped(problems) + _capped(errors)
        else:
            calls = [f"rank {r}: {p}" for r, (_, ps) in enumerate(found) for p in ps]
            row.problems = _capped(problems) + _capped(calls)
            row.check = "FAIL" if row.problems else "ok"
            stats = summarize(slowest_rank_per_run([s for s, _ in found]))
            row.median_us, row.p10_us, row.p90_us, row.runs = stats.median_us, stats.p10_us, stats.p90_us, stats.runs
            row.rank_median_us = [summarize(s).median_us for s, _ in found]
        row.kernels = self._kernels(row.backend, op)
        self._emit(row)

    def _kernels(self, backend: str, op: str) -> str:
        """Which kernels ran the timed calls of ``op`` on this rank: the buffer's transport and, for the
        expert-major operations, the implementations of the permute and reduce
        (`ep_moe.permute.implementations_run`)."""
        transport = self.buffers[backend].backend_name
        if op.startswith("expert_"):
            transport += f", permute {'+'.join(permute.implementations_run()) or 'none'}"
        return transport

    # -------------------------------------------------------------- setup
    def make_buffers(self) -> None:
        spec = self.spec
        elem = max(4 if d == "fp32" else 2 for d in spec.dtypes)
        nvl_bytes = Buffer.get_buffer_size_hint(max(spec.tokens), spec.hidden, self.world, spec.topk,
                                                dtype=torch.float32 if elem == 4 else torch.bfloat16)
        for b in spec.backends:
            made: dict[str, Buffer] = {}

            def make(b=b, made=made):
                made["buffer"] = b.build(self.group, num_nvl_bytes=nvl_bytes if b.buffer_backend != "torch" else 0,
                                         timeout_s=spec.timeout_s, check_inputs=False)
                return made["buffer"].backend_name

            _, errors = _collective(self.group, make)
            if errors:
                self._emit(Row(b.name, "setup", None, 0, None, check="error", problems=errors))
            else:
                self.buffers[b.name] = made["buffer"]

    def destroy_buffers(self) -> None:
        for buffer in self.buffers.values():
            try:
                buffer.destroy()
            except Exception:
                traceback.print_exc()
        self.buffers.clear()

    # -------------------------------------------------------------- one token count
    def run_tokens(self, tokens: int) -> None:
        spec = self.spec
        base = torch.float32 if spec.dtypes == ("fp32",) else torch.bfloat16
        set_bytes = tokens * spec.hidden * base.itemsize * (1 + min(self.world, spec.topk))
        num_sets = num_input_sets(set_bytes, self.cache_bytes, max_sets=MAX_INPUT_SETS)
        self.sets_per_tokens[tokens] = num_sets
        sets = [make_input_set(tokens, spec.hidden, spec.experts, spec.topk, self.world, base, self.device,
                               seed=spec.seed * 1_000_003 + tokens * 1009 + i * 101 + self.rank)
                for i in range(num_sets)]
        # Every rank's layout of every set: [sets, R, R + E] (rows per destination, then per expert).
        mine = torch.stack([torch.cat([s.num_tokens_per_rank.to(torch.int64), s.num_tokens_per_expert.to(torch.int64)])
                            for s in sets])
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine, group=self.group)
        layouts = torch.stack(gathered, dim=1).cpu()  # [sets, source, R + E]
        counts_by_set = layouts[:, :, :self.world]
        experts_by_set = layouts[:, :, self.world:]
        mean_counts = counts_by_set.double().mean(dim=0).tolist()

        payload_cache: dict[tuple[str, int], object] = {}

        def payload(dtype: str, i: int):
            if (dtype, i) not in payload_cache:
                x = sets[i].x
                payload_cache[(dtype, i)] = to_fp8_blocks(x) if dtype == "fp8" else x.to(DTYPES[dtype])
            return payload_cache[(dtype, i)]

        # Per workload ("layout" or a dtype): the checked calls of the first backend that ran it (torch), which
        # every later backend must equal bit for bit.
        first: dict[str, CheckedCalls] = {}
        for b in spec.backends:
            buffer = self.buffers.get(b.name)
            if buffer is None:
                continue
            self._layout(b, buffer, sets, tokens, num_sets, first)
            for dtype in spec.dtypes:
                planned = self._planned_sms(tokens, dtype) if b.takes_sms and spec.plan_sms else None
                budgets = dict.fromkeys(spec.num_sms + ((planned,) if planned else ()))
                for sms in (sorted(budgets) if b.takes_sms else (None,)):
                    self._dispatch_combine(b, buffer, sets, tokens, num_sets, dtype, sms, payload,
                                           counts_by_set, experts_by_set, mean_counts, first,
                                           planned=sms is not None and sms == planned)

    def _planned_sms(self, tokens: int, dtype: str) -> int:
        """The tuner's SM count for this shape (the same on every rank: same shape, topology and rates)."""
        spec = self.spec
        return plan_for_layer(spec.experts, spec.topk, spec.hidden, tokens, dtype, num_ranks=self.world).num_sms

    def _layout(self, b: BackendSpec, buffer: Buffer, sets: list[InputSet], tokens: int, num_sets: int,
                first: dict[str, CheckedCalls]) -> None:
        experts = self.spec.experts
        reference = first.get("layout")
        checked = CheckedCalls(b.name, self.device, keep_set0=reference is None)

        def layout(i: int):
            return buffer.get_dispatch_layout(sets[i].topk_idx, experts)

        def check() -> list[str]:
            problems = []
            for i, s in enumerate(sets):
                outputs = named_outputs("layout", layout(i))
                prints = checked.record("layout", i, outputs)
                found = check_layout(tuple(outputs.values()),
                                     (s.num_tokens_per_rank, s.num_tokens_per_expert, s.is_token_in_rank))
                if reference is not None:
                    found += reference.differences("layout", i, outputs, prints)
                problems += [f"set {i}: {p}" for p in found]
            return problems

        row = Row(b.name, "layout", None, tokens, None)
        found, errors = _collective(self.group, check)
        if errors:
            row.check, row.problems = "error", _capped(errors)
            self._emit(row)
            return
        first.setdefault("layout", checked)
        problems = [f"rank {r}: {p}" for r, ps in enumerate(found) for p in ps]
        self._measure(row, "layout", layout, num_sets, problems, checked.expected("layout"))

    def _dispatch_combine(self, b: BackendSpec, buffer: Buffer, sets: list[InputSet], tokens: int, num_sets: int,
                          dtype: str, sms: int | None, payload, counts_by_set: torch.Tensor,
                          experts_by_set: torch.Tensor, mean_counts: list[list[float]],
                          first: dict[str, CheckedCalls], planned: bool = False) -> None:
        config = Config(num_sms=sms) if sms is not None else None
        worst = tokens * self.world  # every rank has `tokens` tokens: no rank receives more rows
        handles, recv = [], []  # per input set, from its checked dispatch: what cached dispatch and combine reuse

        def fresh(i: int, num_worst_tokens: int = 0):
            s = sets[i]
            return buffer.dispatch(payload(dtype, i), num_tokens_per_rank=s.num_tokens_per_rank,
                                   is_token_in_rank=s.is_token_in_rank, num_tokens_per_expert=s.num_tokens_per_expert,
                                   topk_idx=s.topk_idx, topk_weights=s.topk_weights,
                                   num_worst_tokens=num_worst_tokens, config=config)

        calls: dict[str, Callable[[int], object]] = {
            "dispatch": fresh,
            "dispatch_cached": lambda i: buffer.dispatch(payload(dtype, i), handle=handles[i], config=config),
            "dispatch_fixed": lambda i: fresh(i, worst),  # num_worst_tokens rows: the received ones, then padding
        }
        if dtype != "fp8":  # combine takes no FP8
            calls["combine"] = lambda i: buffer.combine(recv[i], handles[i], config=config)
        expert_outputs = []  # per input set, from its checked expert-major dispatch: what its combine reuses

        def expert(i: int, num_worst_tokens: int = 0):
            s = sets[i]
            return expert_dispatch(buffer, payload(dtype, i), s.topk_idx, s.topk_weights, self.spec.experts,
                                   num_worst_tokens=num_worst_tokens, num_sms=sms or 0)

        if self.spec.expert_major:
            calls["expert_dispatch"] = expert
            calls["expert_dispatch_fixed"] = lambda i: expert(i, worst)
        if self.spec.expert_major and dtype != "fp8":  # the experts' output (combine's input) is never FP8
            calls["expert_combine"] = lambda i: expert_combine(buffer, expert_outputs[i].expert_x,
                                                               expert_outputs[i].handle,
                                                               expert_outputs[i].expert_weights)
        reference = first.get(dtype)
        quantized = first.get("bf16") if dtype == "fp8" else None  # its BF16 rows quantized: FP8's expected rows
        keep_quantized = dtype == "bf16" and reference is None and "fp8" in self.spec.dtypes
        checked = CheckedCalls(b.name, self.device, keep_set0=reference is None)

        def setup_and_check() -> list[tuple[str, str]]:
            """Call every operation once on every set (keeping the handles and received rows for the timed
            runs) and check the results; returns (operation, mismatch) pairs."""
            problems: list[tuple[str, str]] = []
            for i, s in enumerate(sets):
                result = fresh(i)
                handles.append(result[4])
                recv.append(result[0])
                if "expert_dispatch" in calls:
                    expert_outputs.append(expert(i))
                outputs = {op: named_outputs(op, result if op == "dispatch" else call(i)) for op, call in calls.items()}
                found = self._semantics(payload(dtype, i), s, outputs, counts_by_set[i], experts_by_set[i])
                for op, named in outputs.items():
                    prints = checked.record(op, i, named)
                    if reference is not None:  # bit for bit against the first backend (torch)
                        found += [(op, p) for p in reference.differences(op, i, named, prints)]
                    if op == "dispatch" and quantized is not None:  # quantizing received rows = receiving quantized rows
                        found += [(op, p) for p in quantized.differences(
                            op, i, named, prints, mine="quantized",
                            what=f"vs backend {quantized.backend}'s bf16 recv_x quantized")]
                if keep_quantized:
                    data, scales = to_fp8_blocks(outputs["dispatch"]["recv_x"])
                    checked.record("quantized", i, {"recv_x": data, "recv_scales": scales})
                problems += [(op, f"set {i}: {p}") for op, p in found]
            return problems

        traffic_of = traffic(mean_counts, row_payload_bytes(self.spec.hidden, dtype))
        rows = {op: Row(b.name, op, dtype, tokens, sms, planned, recv_bytes=traffic_of.mean_recv_bytes,
                        link_bytes=traffic_of.link_bytes) for op in calls}
        found, errors = _collective(self.group, setup_and_check)
        if errors:
            for row in rows.values():
                row.check, row.problems = "error", _capped(errors)
                self._emit(row)
            return
        first.setdefault(dtype, checked)
        problems = {op: [f"rank {r}: {p}" for r, ps in enumerate(found) for o, p in ps if o == op] for op in rows}
        for op, call in calls.items():
            self._measure(rows[op], op, call, num_sets, problems[op], checked.expected(op))

    def _semantics(self, x: torch.Tensor | tuple, s: InputSet, outputs: dict[str, Outputs],
                   counts_by_source: torch.Tensor, experts_by_source: torch.Tensor) -> list[tuple[str, str]]:
        """One input set's checked calls against what they must compute (docs/semantics.md): received rows and
        per-expert counts against every rank's layout, cached dispatch = dispatch, fixed-size dispatch =
        dispatch plus padding rows, ``combine(dispatch(x))`` = ``x`` summed once per rank it went to.
        ``x``: the dispatched payload; returns (operation, mismatch) pairs."""
        exact = outputs["dispatch"]
        rows, per_expert = expected_recv_counts(counts_by_source, experts_by_source, self.rank)
        got_rows = exact["recv_x"].shape[0]
        found = [("dispatch", p) for p in compare("received rows", got_rows, rows)
                 + compare("num_recv_tokens_per_expert", exact["num_recv_tokens_per_expert_list"], per_expert)]
        cached = outputs["dispatch_cached"]
        found += [("dispatch_cached", p) for name in ("recv_x", "recv_scales") if name in exact
                  for p in compare(f"cached dispatch {name} vs dispatch", cached.get(name), exact[name])]
        found += [("dispatch_fixed", p) for p in check_fixed(outputs["dispatch_fixed"], exact, got_rows)]
        if "combine" in outputs:
            found += [("combine", p) for p in compare("combine(dispatch(x))", outputs["combine"]["combined_x"],
                                                      round_trip_reference(x, s.is_token_in_rank))]
        if "expert_dispatch" in outputs:
            found += self._expert_semantics(x, s, outputs, per_expert)
        return found

    def _expert_semantics(self, x: torch.Tensor, s: InputSet, outputs: dict[str, Outputs], per_expert: list[int]
                          ) -> list[tuple[str, str]]:
        """The expert-major calls of one input set: the exact dispatch's per-expert counts (alignment 1) and
        row count against every rank's layout, the fixed-size one = the exact one plus zero slots, and
        ``expert_combine(expert_dispatch(x), weights)`` = each token's ``w * x`` summed per rank, then over
        ranks (`expert_round_trip_reference`)."""
        exact = outputs["expert_dispatch"]
        rows = sum(per_expert)
        found = [("expert_dispatch", p) for p in compare("expert-major rows", exact["expert_x"].shape[0], rows)
                 + compare("expert-major tokens_per_expert_list", exact["tokens_per_expert_list"], per_expert)]
        found += [("expert_dispatch_fixed", p) for p in check_fixed(outputs["expert_dispatch_fixed"], exact, rows,
                                                                    EXPERT_FIXED_PADDING)]
        if "expert_combine" not in outputs:  # FP8: the rows are checked against the torch backend's, bit for bit
            return found
        want = expert_round_trip_reference(x, s.topk_idx, s.topk_weights, self.world, self.spec.experts)
        found += [("expert_combine", p) for p in compare("expert_combine(expert_dispatch(x))",
                                                         outputs["expert_combine"]["combined_x"], want)]
        return found

    # -------------------------------------------------------------- link
    def link_speed(self) -> tuple[float | None, str]:
        spec = self.spec
        if not self.cuda:
            return None, "n/a (CPU ranks: no NVLink)"
        if not spec.measure_link:
            return spec.link_gbps, "given" if spec.link_gbps != DEFAULT_LINK_GBPS else "default (2 x H200, NV18)"
        from ..benchmarking.link import measure_peer_copy_gbps

        values, errors = _collective(self.group, lambda: measure_peer_copy_gbps(self.group, self.device, self.timer))
        if errors:
            _say(self.rank, f"[bench] link measurement failed, using {spec.link_gbps:g} GB/s: {'; '.join(errors)}")
            return spec.link_gbps, f"given (measurement failed: {errors[0]})"
        _say(self.rank, f"[bench] copy-engine peer copy, 1 GiB, all ranks at once: {values[0]:.1f} GB/s per direction")
        return values[0], "measured: copy-engine peer copy in this run"

    def meta(self, link_gbps: float | None, link_source: str) -> dict:
        spec = self.spec
        device_name = torch.cuda.get_device_name(self.device) if self.cuda else "CPU (gloo)"
        return {
            "command": "ep-moe bench " + " ".join(spec.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "ranks": self.world, "device": device_name, "device_type": spec.device, "timer": self.timer.description,
            "hidden": spec.hidden, "experts": spec.experts, "topk": spec.topk, "tokens": list(spec.tokens),
            "dtypes": list(spec.dtypes), "num_sms": list(spec.num_sms), "plan_sms": spec.plan_sms,
            "backends": [b.name for b in spec.backends],
            "buffer_backends": {n: buf.backend_name for n, buf in self.buffers.items()},
            "runs": spec.runs, "warmup": spec.warmup, "input_sets": dict(self.sets_per_tokens),
            "link_gbps": link_gbps, "link_source": link_source,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl_version() if self.cuda else None,
            "env": {k: os.environ.get(k) for k in MULTICAST_OFF},  # as ep_moe's import left them
        }


def run_rank(rank: int, world: int, spec: BenchSpec) -> dict | None:
    """The benchmark on one rank of an initialized process group; rank 0 returns
    ``{"meta": dict, "rows": [Row]}`` (derived columns not filled yet), the others None."""
    bench = _RankBench(rank, world, spec)
    bench.make_buffers()
    try:
        for tokens in spec.tokens:
            bench.run_tokens(tokens)
            if bench.cuda:
                torch.cuda.empty_cache()  # this token count's inputs and outputs are gone
        link_gbps, link_source = bench.link_speed()
        meta = bench.meta(link_gbps, link_source)
    finally:
        bench.destroy_buffers()
    return {"meta": meta, "rows": bench.rows} if rank == 0 else None


# ------------------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ep-moe bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time get_dispatch_layout, dispatch, cached dispatch and combine of every backend in one run,\n"
                    "on the same routing. One call per operation and input set is checked (every output bit for\n"
                    "bit against the torch backend, on every input set); every timed call is checked against it.\n"
                    "Prints a progress line per measurement, then one table.",
        epilog="GPU: one NCCL rank per visible GPU, CUDA-event times; or run under\n"
               "  torchrun --nproc-per-node N -m ep_moe.cli bench ...\n"
               "CPU: --ranks gloo processes, small default sizes, wall-clock times, no NVLink floor.\n"
               "Defaults on GPU: DeepEP's intranode workload (--tokens 4096 --hidden 7168 --experts 256\n"
               "--topk 8); on CPU: --tokens 64 128 256 --hidden 256 --experts 16 --topk 4.\n"
               "Exit status: 0 when every check passed, 1 when a check failed (a checked or a timed call)\n"
               "or an operation raised.")
    p.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=None,
                   help="backends to compare (default: torch, and native where its kernels run)")
    p.add_argument("--tokens", nargs="+", type=int, default=None, metavar="T",
                   help="tokens per rank; several values make a sweep (e.g. 128 256 ... 16384)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size H (a multiple of 128 for fp8)")
    p.add_argument("--experts", type=int, default=None, help="number of experts E (divisible by the ranks)")
    p.add_argument("--topk", type=int, default=None, help="experts per token K")
    p.add_argument("--dtype", nargs="+", choices=["bf16", "fp8", "fp32"], default=["bf16", "fp8"], dest="dtypes",
                   help="hidden-state types; fp8 is the pair (x_e4m3, scales[T, H/128]) and is dispatched only "
                        "(default: bf16 fp8)")
    p.add_argument("--num-sms", nargs="+", type=int, default=[24], metavar="N",
                   help="SM budgets passed as Config(num_sms=N) to dispatch/combine (even; a sweep when several; "
                        "backends without an SM budget, torch, are timed once and shown as '-') (default: 24)")
    p.add_argument("--plan-sms", action="store_true",
                   help="also time each shape at the SM count the tuner plans for it (ep_moe.tuning.plan_for_layer: "
                        "the calibration cache or datasheet rates; EP_MOE_NUM_SMS overrides), marked * in the table")
    p.add_argument("--expert-major", action="store_true",
                   help="also time the expert-major dispatch (rows grouped by local expert: exact and fixed size; "
                        "FP8 pairs too) and its weighted combine (bf16/fp32), checked like the others")
    p.add_argument("--runs", type=int, default=50, help="timed runs per operation; the median and p10/p90 are "
                                                          "reported (>= 30 for numbers to quote) (default: 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs before timing (default: 10)")
    p.add_argument("--ranks", type=int, default=None,
                   help="processes to spawn: GPUs to use (default: all visible) or CPU ranks (default: 2); "
                        "ignored under torchrun")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where to run (default: cuda when a GPU is visible, else cpu)")
    p.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                   help=f"one-way peer bandwidth for the floor, GB/s (default: {DEFAULT_LINK_GBPS:g}, the "
                        "copy-engine peer copy measured on the H200 pair)")
    p.add_argument("--measure-link", action="store_true",
                   help="measure the peer bandwidth in this run (1 GiB copy-engine copy into the next rank's "
                        "symmetric buffer, all ranks at once) and use it for the floor")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens and routing (default: 0)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds any wait for a peer may last before it fails (default: 120)")
    p.add_argument("--json", metavar="PATH", help="write the meta data and every row as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: time vs tokens, and time vs SMs (GPU only)")
    return p


def _resolve(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> tuple[BenchSpec, int]:
    """Check the arguments, fill the defaults for the device; return the spec and the rank count."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    torchrun = torchrun_env()
    if torchrun is not None:
        world = torchrun.world_size
    elif args.device == "cuda":
        visible = torch.cuda.device_count()
        world = visible if args.ranks is None else args.ranks
        if not 1 <= world <= visible:
            parser.error(f"--ranks: must be between 1 and the {visible} visible GPUs, got {world}")
    else:
        world = 2 if args.ranks is None else args.ranks
        if world < 1:
            parser.error(f"--ranks: must be >= 1, got {world}")
    defaults = GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    experts_given = args.experts is not None
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not experts_given and args.experts % world:
        args.experts = max(world, args.experts // world * world)  # as DeepEP's test: (256 // R) * R
    if any(t < 1 for t in args.tokens):
        parser.error(f"--tokens: every value must be >= 1, got {args.tokens}")
    if args.hidden < 1:
        parser.error(f"--hidden: must be >= 1, got {args.hidden}")
    if args.experts < 1 or args.experts % world:
        parser.error(f"--experts: must be a positive multiple of the {world} ranks, got {args.experts}")
    if not 1 <= args.topk <= args.experts:
        parser.error(f"--topk: must be between 1 and --experts ({args.experts}), got {args.topk}")
    if "fp8" in args.dtypes:
        if args.hidden % 128:
            parser.error(f"--hidden: must be a multiple of 128 for --dtype fp8, got {args.hidden}")
        if not hasattr(torch, "float8_e4m3fn"):
            parser.error("--dtype fp8: this torch has no float8_e4m3fn")
    if any(n < 2 or n % 2 for n in args.num_sms):
        parser.error(f"--num-sms: every value must be an even number >= 2, got {args.num_sms}")
    if args.runs < 1:
        parser.error(f"--runs: must be >= 1, got {args.runs}")
    if args.warmup < 0:
        parser.error(f"--warmup: must be >= 0, got {args.warmup}")
    if args.link_gbps <= 0:
        parser.error(f"--link-gbps: must be positive, got {args.link_gbps}")
    if args.timeout <= 0:
        parser.error(f"--timeout: must be positive, got {args.timeout}")
    names = args.backends
    if names is None:
        names = ["torch"] + (["native"] if native.kernels_available() and args.device == "cuda" else [])
    elif "native" in names:
        if args.device != "cuda":
            parser.error("--backends native: the native backend needs CUDA GPUs (this run is on CPU)")
        if not native.kernels_available():
            parser.error(f"--backends native: no native kernels here ({native.kernels_unavailable_reason()})")
    # torch first: the other backends are compared with it, bit for bit, and timed against it.
    names = sorted(dict.fromkeys(names), key=lambda n: (n != "torch", n))
    dtypes = tuple(sorted(dict.fromkeys(args.dtypes), key=lambda d: d == "fp8"))  # bf16 before fp8: fp8 is checked against it
    spec = BenchSpec(
        backends=tuple(BACKENDS[n] for n in names), tokens=tuple(dict.fromkeys(args.tokens)), hidden=args.hidden,
        experts=args.experts, topk=args.topk, dtypes=dtypes, num_sms=tuple(dict.fromkeys(args.num_sms)),
        runs=args.runs, warmup=args.warmup, device=args.device, link_gbps=args.link_gbps,
        measure_link=args.measure_link, seed=args.seed, timeout_s=args.timeout, plan_sms=args.plan_sms,
        expert_major=args.expert_major, argv=tuple(argv))
    return spec, world


def run(spec: BenchSpec, world: int) -> dict | None:
    """Run the benchmark (spawning ranks, or as one rank under torchrun). Returns rank 0's result
    (None on the other torchrun ranks)."""
    return launch(run_rank, world, spec, device_type=spec.device, timeout_s=spec.timeout_s,
                  join_timeout_s=3600.0)[0]


def report(result: dict, json_path: str | None = None, plot_path: str | None = None) -> tuple[str, bool]:
    """Fill derived columns, write JSON/PNG; return the table and whether every check passed."""
    meta, rows = result["meta"], result["rows"]
    finalize(rows, meta["link_gbps"])
    runs = meta["runs"]
    sets = ", ".join(f"{n} at T={t}" for t, n in meta["input_sets"].items())
    header = [
        f"ep-moe bench: {meta['ranks']} ranks on {meta['device']}; hidden {meta['hidden']}, top-{meta['topk']} of "
        f"{meta['experts']} experts, random scores (DeepEP's intranode routing)",
        f"time: {meta['timer']}, median and p10-p90 of {runs} runs (slowest rank of each run), {meta['warmup']} "
        f"warm-up runs, barrier between runs, rotating input sets ({sets})"
        + ("" if runs >= 30 else f"  [only {runs} runs: do not quote]"),
        "GB/s: DeepEP-counted received bytes (own tokens included) / median time; "
        "vs torch: torch's time / this time",
    ]
    if meta["link_gbps"]:
        header.append(f"floor: busiest rank's bytes over NVLink (hidden states only) at {meta['link_gbps']:.1f} GB/s "
                      f"({meta['link_source']}); of floor = floor / time")
    else:
        header.append(f"floor, of floor: {meta['link_source']}; wall-clock times of CPU processes, not GPU numbers")
    if meta.get("plan_sms"):
        header.append("SMs marked *: the tuner's plan for that shape (ep_moe.tuning.plan_for_layer)")
    notes = []
    if json_path:
        write_json(json_path, meta, rows)
        notes.append(f"wrote {json_path}")
    if plot_path:
        # On CPU no backend uses SMs: the time-vs-SMs panel would mean nothing there.
        why_not = plot(plot_path, rows, title=header[0], num_sms=meta["num_sms"],
                       sm_panel=meta.get("device_type", "cuda") == "cuda")
        notes.append(f"plot skipped: {why_not}" if why_not else f"wrote {plot_path}")
    all_ok = bool(rows) and all(r.check == "ok" for r in rows)
    return "\n".join(notes + ["", table(rows, header)]), all_ok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    spec, world = _resolve(args, parser, argv)
    result = run(spec, world)
    if result is None:  # a torchrun rank other than 0
        return 0
    text, all_ok = report(result, args.json, args.plot)
    print(text, flush=True)
    return 0 if all_ok else 1


__all__ = ["BACKENDS", "BackendSpec", "BenchSpec", "build_parser", "main", "report", "run", "run_rank"]
