"""GPU check of the SM planner: the auto plan's measured time against a sweep of SM counts.

    torchrun --nproc-per-node 2 benchmarks/tune_check.py --json $OUT/tune_check.json

For each workload: calibrate (copy kernels + a kernel probe on a different shape), plan, then time
dispatch + combine with `ep_moe.Buffer` and ``Config(num_sms=n)`` at the planned count and at every count
of the sweep (8..48). Prints, last, one row per workload: planned SMs, predicted and measured us, the
sweep's best (SMs, us), the smallest count within 5 % of that best, and whether the plan is within 10 %
of the best while using no more SMs than that smallest count. Uses the native backend; if it cannot run,
falls back to the torch backend and says so (that backend ignores the SM count, so the check is moot).

Every time decides a verdict, so every measurement is checked: after each `DispatchBench.measure` (each SM count
of each pass, and each ``--refine`` step), the last timed dispatch (fixed size) and combine, as those calls left
them, against a torch-backend Buffer's exact-size dispatch of the same input and its combine of the same rows, bit
for bit (docs/semantics.md fixes every output, the fp32 order of the combine's sums included): the rows, the
padding after them and the handle's tensors (`ep_moe.benchmarking.checks.check_fixed`), and the combined tokens.
The sweep marks a failed point with ``!``, a workload's ``check`` column says ``ok`` or ``DIFF`` with the SM
counts, and every mismatch is printed (rank, SMs, first differing element) with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _checked import gather_problems, report, verdict

from ep_moe import Buffer
from ep_moe.benchmarking.checks import check_fixed, compare
from ep_moe.benchmarking.verification import named_outputs
from ep_moe.distributed import init_from_torchrun
from ep_moe.tuning import LayerShape, PlanCache, refine
from ep_moe.tuning.calibration import DispatchBench, calibrate
from ep_moe.tuning.machine_topology import detect_topology

WORKLOADS = (
    ("DeepEP intranode: E256 K8 H7168 T4096", LayerShape(256, 8, 7168, 4096)),
    ("E64 K6 H4096 T8192", LayerShape(64, 6, 4096, 8192)),
    ("DeepEP shape, 512 tokens: E256 K8 H7168 T512", LayerShape(256, 8, 7168, 512)),
)


class LastCalls:
    """The buffer as `DispatchBench` sees it: every call goes through to ``buffer``, and the latest dispatch's
    input and result and the latest combine's input rows and output are kept (after `DispatchBench.measure`: its
    last timed pair)."""

    def __init__(self, buffer) -> None:
        self._buffer = buffer
        self.dispatched: tuple | None = None
        self.combined: tuple[torch.Tensor, torch.Tensor] | None = None

    def __getattr__(self, name: str):
        return getattr(self._buffer, name)

    def dispatch(self, x, **kwargs):
        result = self._buffer.dispatch(x, **kwargs)
        self.dispatched = (x, result)
        return result

    def combine(self, y, handle, **kwargs):
        result = self._buffer.combine(y, handle, **kwargs)
        self.combined = (y, result[0])
        return result


class TimedCallCheck:
    """Checks the last timed call pair of `DispatchBench.measure` (collective: every rank checks after the same
    measurements) against ``reference``, a torch-backend Buffer: its exact-size dispatch of the same input with its
    own layout, and its combine of the same rows (the fixed-size handle's padding rows are ignored by definition)."""

    def __init__(self, bench, reference: Buffer) -> None:
        self.bench, self.reference = bench, reference
        self._dispatched: dict[int, tuple] = {}  # input set -> the reference's dispatch result

    def _reference_dispatch(self, k: int):
        if k not in self._dispatched:
            per_rank, _, per_expert, in_rank, _ = self.reference.get_dispatch_layout(self.bench.topk_idx,
                                                                                     self.bench.shape.num_experts)
            self._dispatched[k] = self.reference.dispatch(
                self.bench.xs[k], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=self.bench.topk_idx, topk_weights=self.bench.topk_weights)
        return self._dispatched[k]

    def problems(self, num_sms: int) -> list[str]:
        """This rank's mismatches of the pair the latest `measure` at ``num_sms`` SMs left."""
        calls = self.bench.buffer
        (x, result), (y, combined) = calls.dispatched, calls.combined
        k = next(i for i, t in enumerate(self.bench.xs) if t is x)
        exact = self._reference_dispatch(k)
        want = named_outputs("dispatch", exact)
        rows = want["recv_x"].shape[0]
        found = check_fixed(named_outputs("dispatch_fixed", result), want, rows)
        found += compare("combined_x vs the reference's combine of the same rows", combined,
                         self.reference.combine(y[:rows], exact[4])[0])
        return [f"{num_sms} SMs, last timed call (input set {k}): {p}" for p in found]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", default="8:48:2", help="first:last:step SM counts (default 8:48:2)")
    p.add_argument("--iters", type=int, default=30, help="timed calls per point and pass (median; default 30)")
    p.add_argument("--passes", type=int, default=3,
                   help="passes over the SM counts, each in a different order; a point's time is the median of its "
                        "passes, so slow drift (clocks, temperature) does not favour one end of the sweep (default 3)")
    p.add_argument("--use-cached-calibration", action="store_true", help="do not measure the rates again")
    p.add_argument("--refine", action="store_true", help="also run refine() around each plan (budget 5)")
    p.add_argument("--json", help="write every number to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    first, last, step = (int(v) for v in args.sweep.split(":"))
    workloads = WORKLOADS
    if torch.cuda.is_available():
        init_from_torchrun("cuda", timeout_s=600.0)
    else:  # a dry run of this script's own logic on CPU (gloo, torch backend, shrunken shapes)
        init_from_torchrun("cpu", timeout_s=600.0)
        workloads = tuple((f"{label} (CPU dry run: /16 tokens, H 256)",
                           LayerShape(s.num_experts, s.topk, 256, max(1, s.tokens // 16))) for label, s in WORKLOADS)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    started = time.monotonic()

    nvl_bytes = max(Buffer.get_buffer_size_hint(s.tokens, s.hidden, world, s.topk) for _, s in workloads)
    note = ""
    try:
        buffer = Buffer(num_nvl_bytes=nvl_bytes, backend="native")
    except RuntimeError as exc:
        note = (f"NOTE: the native backend cannot run here ({exc}); falling back to the torch backend, which "
                "ignores the SM count: the sweep below cannot test the planner.")
        say(note)
        buffer = Buffer(backend="torch")
    reference = buffer if buffer.backend_name == "torch" else Buffer(backend="torch")  # what the timed calls must give
    topology = detect_topology(world_size=world, local_world_size=world)
    say(f"topology: {topology.describe()}")
    rates = calibrate(topology=topology, buffer=buffer, force=not args.use_cached_calibration, say=say)
    say("rates: " + rates.describe())
    cache = PlanCache(topology, rates, use_env=False)

    counts = list(range(first, last + 1, step))
    rows, details, problems = [], [], []
    for label, shape in workloads:
        plan = cache.plan(shape)
        bench = DispatchBench(LastCalls(buffer), shape, seed=1)
        bench.check(plan.num_sms)
        checker, mine, seen = TimedCallCheck(bench, reference), [], []

        def measure(n: int, bench=bench, checker=checker, mine=mine, seen=seen) -> tuple[float, float]:
            """``bench.measure`` at ``n`` SMs, then the check of its last timed pair."""
            timing = bench.measure(n, iters=args.iters)
            mine.extend((n, p) for p in checker.problems(n))
            seen.append(n)  # the same on every rank
            return timing

        points = sorted(set(counts) | {plan.num_sms, plan.deepep_v2_sms or counts[0]})
        passes: dict[int, list[tuple[float, float]]] = {n: [] for n in points}
        for p in range(args.passes):
            order = points[:]
            random.Random(p).shuffle(order)  # the same order on every rank (collective calls line up)
            for n in order:
                passes[n].append(measure(n))
        measured = {n: (statistics.median(d for d, _ in v), statistics.median(c for _, c in v))
                    for n, v in passes.items()}
        plan.record(*measured[plan.num_sms])
        total = {n: sum(v) for n, v in measured.items()}
        best_n = min(counts, key=lambda n: total[n])
        best = total[best_n]
        within5 = min(n for n in counts if total[n] <= 1.05 * best)
        row = {"workload": label, "planned_sms": plan.num_sms, "predicted_us": plan.predicted_us,
               "measured_us": plan.measured_us, "measured_dispatch_us": plan.measured_dispatch_us,
               "measured_combine_us": plan.measured_combine_us, "best_sms": best_n, "best_us": best,
               "smallest_within_5pct": within5, "within_10pct": plan.measured_us <= 1.10 * best,
               "no_more_sms": plan.num_sms <= within5, "deepep_v2_sms": plan.deepep_v2_sms,
               "deepep_v2_us": total.get(plan.deepep_v2_sms)}
        if args.refine:
            refined = refine(plan, measure, budget=5, min_sms=2, max_sms=topology.num_sms or None)
            row.update(refined_sms=refined.num_sms, refined_us=refined.measured_us)
        found = gather_problems([f"{label}: {p}" for _, p in mine])
        failing = torch.zeros(max(seen) + 1, device=buffer.device)
        for n, _ in mine:
            failing[n] = 1
        dist.all_reduce(failing, op=dist.ReduceOp.MAX)  # the SM counts that failed on any rank
        failed = failing.nonzero().flatten().tolist()
        row.update(check=verdict(found) + (f" ({', '.join(map(str, failed))} SMs)" if failed else ""),
                   problems=found)
        problems += found
        rows.append(row)
        details.append({"workload": label, "shape": shape.label(), "plan": plan.to_dict(), "failed_sms": failed,
                        "sweep": {str(n): {"dispatch_us": d, "combine_us": c} for n, (d, c) in measured.items()}})

    say("")
    say("sweep (dispatch + combine us):")
    say("  SMs  " + "  ".join(f"{i + 1:>9}" for i in range(len(workloads))))
    for n in sorted({n for d in details for n in map(int, d["sweep"])}):
        cells = []
        for d in details:
            v = d["sweep"].get(str(n))
            mark = "!" if n in d["failed_sms"] else " "
            cells.append(f"{v['dispatch_us'] + v['combine_us']:9.1f}{mark}" if v else f"{'-':>9} ")
        say(f"  {n:>3}  " + "  ".join(cells))
    if problems:
        say("  (!: that SM count's timed calls gave wrong outputs; CHECK FAILED lines below)")
    say("")
    if note:
        say(note)
    say(f"backend {buffer.backend_name}; {world} x {topology.gpu_name}; median of {args.iters} calls, then of "
        f"{args.passes} passes in shuffled orders; times are "
        f"dispatch + combine in us (max over ranks); sweep {first}..{last} step {step}")
    header = ("#", "workload", "planned SMs", "predicted us", "measured us", "sweep best (SMs, us)",
              "smallest within 5%", "within 10%", "SMs <= smallest", "DeepEP V2 rule (SMs, us)", "check")
    if args.refine:
        header += ("refined (SMs, us)",)
    table = [header]
    for i, r in enumerate(rows, 1):
        line = (str(i), r["workload"], str(r["planned_sms"]), f"{r['predicted_us']:.1f}", f"{r['measured_us']:.1f}",
                f"{r['best_sms']}, {r['best_us']:.1f}", str(r["smallest_within_5pct"]),
                "yes" if r["within_10pct"] else "NO", "yes" if r["no_more_sms"] else "NO",
                f"{r['deepep_v2_sms']}, {r['deepep_v2_us']:.1f}" if r["deepep_v2_us"] else str(r["deepep_v2_sms"]),
                r["check"])
        if args.refine:
            line += (f"{r['refined_sms']}, {r['refined_us']:.1f}",)
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for j, row in enumerate(table):
        say("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if j == 0:
            say("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    say(f"({time.monotonic() - started:.0f} s)")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"backend": buffer.backend_name, "note": note, "topology": topology.to_dict(),
                       "rates": rates.to_dict(), "rows": rows, "details": details}, f, indent=2)
    if reference is not buffer:
        reference.destroy()
    buffer.destroy()
    dist.destroy_process_group()
    if rank == 0:
        return report("tune_check", problems)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
