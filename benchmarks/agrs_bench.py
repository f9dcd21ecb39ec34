"""AGRS all-gather / reduce-scatter and PP ring send/recv: the native transport (copy engine + stream memory
operations, `ep_moe.native.stream_transport`) against NCCL in the same run.

    torchrun --nproc-per-node 2 benchmarks/agrs_bench.py        # 2..8 GPUs of one node
    python3 benchmarks/agrs_bench.py --nproc 2                  # the same, spawned

* all-gather: ``--tensors`` (4) tensors of ``--mib`` (64) MiB per rank in one `ElasticBuffer.all_gather` of in-place
  tensors (`agrs_get_inplace_tensor`, so nothing is copied locally) plus ``handle()``, against one NCCL
  ``all_gather_into_tensor`` per tensor; the native call is timed on the default stream (one ``cudaMemcpyAsync``
  per peer and tensor) and on a side stream (one ``cuMemcpyBatchAsync`` per operation where the driver has it);
* reduce-scatter: a ``[R, (tensors x mib MiB) / R]`` bf16 input per rank, `ElasticBuffer.reduce_scatter` plus
  ``handle()`` (which sums in fp32 in rank order: that sum is the transport's only SM work) against NCCL's
  ``reduce_scatter_tensor`` (which sums in bf16 on its own SMs);
* PP: every rank sends a ``--mib`` MiB tensor to the next rank and receives one from the previous (`pp_send` /
  `pp_recv` on the native and the torch transport).

Bus bandwidth follows nccl-tests: all-gather and reduce-scatter move ``(R - 1) / R`` of the ``R x`` per-rank bytes
over each rank's links, so busbw = ``(R - 1) x per-rank bytes / time`` (all-gather: per-rank bytes = one rank's
tensors; reduce-scatter: per-rank bytes = one rank's output shard); PP: bytes of one message / time. GB/s =
1e9 bytes/s, the median of ``--iters`` timed iterations (CUDA events around the call and its ``handle()``; the
native calls include their host waits).

Checked, on every rank, in full: the first call and the last timed call of every variant (kept by the timed call).
All-gather (native on either stream, NCCL): every rank's every tensor bit for bit; the tensors hold integers
0..255 (exact in bf16) that change along the tensor, with rank and tensor, and, for the native calls, with every
timed iteration (refilled before it, untimed), so that memory left from an earlier iteration cannot pass.
Reduce-scatter: the native shard bit for bit against the rank-order fp32 sum of every rank's rows (gathered with
NCCL), NCCL's within `_checked.RTOL` of bf16 (it adds in bf16, in its own order). PP: the whole received message
against the sender's value of that iteration (refilled before each, the landing tensor poisoned). Each line says
``check ok`` or ``check DIFF``; a mismatch is printed (variant, rank, first differing element) and the exit status
is 1.

SMs used: the native transfers and signals are queued as copies (``cudaMemcpyAsync`` / ``cuMemcpyBatchAsync``) and
stream memory operations, never as kernels. The script counts the kernels torch.profiler (CUPTI) records during
one native all-gather: 0 is printed as "SMs used by the transfer: 0"; NCCL's calls each launch a kernel over its
channels' SMs. At 1 rank there is nothing to move: the script says it needs 2 GPUs and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from _checked import RTOL, gather_problems, mismatch, report, verdict
from torch.profiler import ProfilerActivity, profile

from ep_moe import ElasticBuffer
from ep_moe.benchmarking.timing import median_event_seconds
from ep_moe.distributed import launch

MiB = 1 << 20


def _median_seconds(fn, iters: int, before=None) -> float:
    """GPU seconds of ``fn`` (median), every rank released together: ``before()``, then a barrier and a device
    synchronize ahead of each run."""
    def gate() -> None:
        if before is not None:
            before()
        dist.barrier()
        torch.cuda.synchronize()

    return median_event_seconds(fn, iters, before=gate)


def _kernels_during(fn) -> tuple[int, int, list[str]]:
    """(kernels, copies, kernel names) CUPTI records while ``fn`` runs (synchronized)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels, copies = [], 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if event.name.startswith(("Memcpy", "Memset")):
            copies += 1
        else:
            kernels.append(event.name)
    return len(kernels), copies, sorted(set(kernels))


def _run(rank: int, num_ranks: int, args: argparse.Namespace) -> dict | None:
    if num_ranks < 2:
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    per_tensor = args.mib * MiB
    per_rank = args.tensors * per_tensor
    num_bytes = -(-(num_ranks * per_rank + 64 * MiB) // (2 * MiB)) * (2 * MiB)
    eb = ElasticBuffer(None, num_bytes=num_bytes, backend="auto", explicitly_destroy=True, num_gpu_timeout_secs=120)
    if eb.buffer.backend_name != "native":
        raise SystemExit(f"agrs_bench: the buffer's backend is {eb.buffer.backend_name!r} "
                         f"({eb.buffer.backend_reason}); the native transport needs the native backend")
    eb.agrs_set_config(per_rank, 1, transport="native")
    elems = per_tensor // 2
    result = {"rank": rank, "ranks": num_ranks, "batched": None}
    problems: dict[str, list[str]] = {}

    def check(variant: str, what: str, got: torch.Tensor, want: torch.Tensor, rtol: float | None = None) -> None:
        found = mismatch(what, got, want, rtol)
        problems.setdefault(variant, []).extend([f"{variant}: {found}"] if found else [])

    # ---- all-gather
    ramp = torch.arange(elems, device=device, dtype=torch.int32)

    def pattern(r: int, k: int, it: int) -> torch.Tensor:
        """Rank ``r``'s tensor ``k`` in iteration ``it``: integers 0..255 (exact in bf16) along the tensor, shifted
        by rank, tensor and iteration, so that another rank's or tensor's row, or an earlier iteration's, shows."""
        return ((ramp + 7 * (r * args.tensors + k) + 13 * it) % 256).to(torch.bfloat16)

    def fill(tensors, it: int) -> None:
        for k, t in enumerate(tensors):
            t.copy_(pattern(rank, k, it))

    def check_gathered(variant: str, call: str, gathered, it: int) -> None:
        for k, g in enumerate(gathered):
            for r in range(num_ranks):
                check(variant, f"{call}: tensor {k} from rank {r}", g[r], pattern(r, k, it))

    def native_gather() -> None:
        """One checked call (untimed)."""
        eb.create_agrs_session()
        tensors = eb.agrs_get_inplace_tensor([(elems,)] * args.tensors, torch.bfloat16)
        fill(tensors, 0)
        gathered, handle = eb.all_gather(list(tensors))
        handle()
        check_gathered("all-gather native", "first call", gathered, 0)
        eb.destroy_agrs_session()

    sources = [pattern(rank, k, 0) for k in range(args.tensors)]
    outputs = [torch.empty(num_ranks * elems, dtype=torch.bfloat16, device=device) for _ in range(args.tensors)]

    def nccl_gather():
        for out, src in zip(outputs, sources):
            dist.all_gather_into_tensor(out, src)

    native_gather()
    nccl_gather()
    check_gathered("all-gather NCCL", "first call", [o.view(num_ranks, elems) for o in outputs], 0)
    # time only all_gather + handle: the session around it is opened (and its tensors filled) outside the events
    timed = {"it": 0}

    def native_gather_timed():
        gathered, handle = eb.all_gather(list(timed["tensors"]))
        handle()
        timed["gathered"] = gathered  # a view of the session memory: valid until the next open_session

    def open_session():
        if eb._agrs.open:
            eb.destroy_agrs_session()
        eb.create_agrs_session()
        timed["tensors"] = eb.agrs_get_inplace_tensor([(elems,)] * args.tensors, torch.bfloat16)
        timed["it"] += 1
        fill(timed["tensors"], timed["it"])

    native_s = _median_seconds(native_gather_timed, args.iters, before=open_session)
    check_gathered("all-gather native", "last timed call", timed["gathered"], timed["it"])
    side = torch.cuda.Stream(device)  # not the legacy default stream: one batched copy call where the driver has it
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        native_side_s = _median_seconds(native_gather_timed, args.iters, before=open_session)
    torch.cuda.current_stream(device).wait_stream(side)
    check_gathered("all-gather native, side stream", "last timed call", timed["gathered"], timed["it"])
    eb.destroy_agrs_session()
    nccl_s = _median_seconds(nccl_gather, args.iters)
    check_gathered("all-gather NCCL", "last timed call", [o.view(num_ranks, elems) for o in outputs], 0)
    open_session()
    kernels, copies, names = _kernels_during(native_gather_timed)
    eb.destroy_agrs_session()
    nccl_kernels, _, nccl_names = _kernels_during(nccl_gather)
    bus = (num_ranks - 1) * per_rank / 1e9
    result.update(ag_native=bus / native_s, ag_native_side=bus / native_side_s, ag_nccl=bus / nccl_s,
                  ag_kernels=kernels, ag_copies=copies, ag_kernel_names=names, ag_nccl_kernels=nccl_kernels,
                  ag_nccl_names=nccl_names)

    # ---- reduce-scatter (per-rank input: per_rank bytes, [R, per_rank / R / 2] bf16)
    shard = per_rank // 2 // num_ranks
    x = torch.randn(num_ranks, shard, device=device, generator=torch.Generator(device).manual_seed(rank)).bfloat16()
    out = torch.empty(shard, dtype=torch.bfloat16, device=device)
    last = {}

    def native_rs():
        eb.create_agrs_session()
        got, handle = eb.reduce_scatter(x)
        handle()
        eb.destroy_agrs_session()
        last["got"] = got  # a tensor of its own (the session is gone)
        return got

    got = native_rs()
    parts = [torch.empty_like(x) for _ in range(num_ranks)]
    dist.all_gather(parts, x)
    acc = parts[0][rank].float()
    for p in parts[1:]:
        acc = acc + p[rank].float()
    del parts
    check("reduce-scatter native", "first call vs the rank-order fp32 sum", got, acc.bfloat16())
    rs_native_s = _median_seconds(native_rs, args.iters)  # includes opening/closing the session (one exchange each)
    check("reduce-scatter native", "last timed call vs the rank-order fp32 sum", last.pop("got"), acc.bfloat16())
    out.fill_(float("nan"))
    rs_nccl_s = _median_seconds(lambda: dist.reduce_scatter_tensor(out, x.view(-1)), args.iters)
    check("reduce-scatter NCCL", "last timed call vs the rank-order fp32 sum", out, acc, RTOL[torch.bfloat16])
    rs_bus = (num_ranks - 1) * shard * 2 / 1e9
    result.update(rs_native=rs_bus / rs_native_s, rs_nccl=rs_bus / rs_nccl_s)

    # ---- PP ring
    nxt, prev = (rank + 1) % num_ranks, (rank - 1) % num_ranks
    message = torch.empty((per_tensor // 2,), dtype=torch.bfloat16, device=device)
    landing = torch.empty_like(message)
    ring_it = {"it": 0}

    def value(r: int, it: int) -> float:
        """Rank ``r``'s message in iteration ``it`` (an integer, exact in bf16)."""
        return float(r + num_ranks * (it % 16))

    def next_message() -> None:
        """Before each iteration (untimed): a new message, and the landing tensor poisoned."""
        ring_it["it"] += 1
        message.fill_(value(rank, ring_it["it"]))
        landing.fill_(-1.0)

    for transport in ("native", "torch"):
        eb.pp_set_config(per_tensor, 2, transport=transport)

        def ring():
            eb.pp_send(message, nxt)
            eb.pp_recv(landing, prev)

        next_message()
        ring()
        check(f"PP {transport}", "first call", landing, torch.full_like(landing, value(prev, ring_it["it"])))
        result[f"pp_{transport}"] = per_tensor / 1e9 / _median_seconds(ring, args.iters, before=next_message)
        check(f"PP {transport}", "last timed call", landing, torch.full_like(landing, value(prev, ring_it["it"])))
    waiter = getattr(eb, "_stream_waiter", None)  # the transports' SignalWaiter (ep_moe.native.stream_transport)
    result["batched"] = waiter.ops.has_batch_copy if waiter is not None else None
    eb.destroy()
    result["checks"] = {variant: gather_problems(found) for variant, found in problems.items()}
    dist.barrier()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=4, help="tensors per all-gather")
    parser.add_argument("--mib", type=int, default=64, help="MiB per tensor (and per PP message)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=1, help="ranks when not under torchrun (one GPU each)")
    args = parser.parse_args()
    results = launch(_run, args.nproc, args, device_type="cuda")
    if results[0] is None:
        print("agrs_bench: needs 2 or more GPUs (ranks); at 1 rank AGRS and PP move nothing between GPUs "
              "(torchrun --nproc-per-node 2 benchmarks/agrs_bench.py)")
        return 0
    problems = [p for found in results[0]["checks"].values() for p in found]  # every rank's, gathered on each
    for r in results:
        if r["rank"] != 0:
            continue
        R = r["ranks"]

        def ok(*variants: str, r=r) -> str:
            return "check " + verdict([p for v in variants for p in r["checks"][v]])

        print(f"agrs_bench at {R} ranks, rank 0 (bus bandwidth, nccl-tests' convention; median of {args.iters}):")
        print(f"  all-gather {args.tensors} x {args.mib} MiB: native {r['ag_native']:.1f} GB/s "
              f"({ok('all-gather native')}), NCCL all_gather_into_tensor {r['ag_nccl']:.1f} GB/s "
              f"({ok('all-gather NCCL')}; {r['ag_native'] / r['ag_nccl']:.2f}x); native on a side stream "
              f"{r['ag_native_side']:.1f} GB/s ({ok('all-gather native, side stream')}; "
              f"{'one batched copy call per operation' if r['batched'] else 'one copy per peer and tensor'})")
        print(f"    SMs used by the native transfer: {0 if r['ag_kernels'] == 0 else 'some'} "
              f"({r['ag_kernels']} kernels, {r['ag_copies']} copies recorded by CUPTI"
              f"{': ' + ', '.join(r['ag_kernel_names']) if r['ag_kernels'] else ''}); NCCL: {r['ag_nccl_kernels']} "
              f"kernels ({', '.join(r['ag_nccl_names'])[:120]})")
        print(f"  reduce-scatter {args.tensors * args.mib} MiB per rank (bf16): native {r['rs_native']:.1f} GB/s "
              f"(incl. the fp32 sum and a session open/close; {ok('reduce-scatter native')}), NCCL "
              f"reduce_scatter_tensor {r['rs_nccl']:.1f} GB/s ({ok('reduce-scatter NCCL')})")
        print(f"  PP ring, {args.mib} MiB messages: native {r['pp_native']:.1f} GB/s ({ok('PP native')}), torch "
              f"(NCCL send/recv) {r['pp_torch']:.1f} GB/s ({ok('PP torch')})")
        print(f"  batched copy call (cuMemcpyBatchAsync): {'available' if r['batched'] else 'not available'}")
    if results[0]["rank"] != 0:  # another rank's process under torchrun: rank 0 reports
        return 1 if problems else 0
    return report("agrs_bench", problems)


if __name__ == "__main__":
    sys.exit(main())
