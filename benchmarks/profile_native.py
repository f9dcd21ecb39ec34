"""Where the native kernels spend their time: per-block timelines at DeepEP's intranode workload.

    torchrun --nproc-per-node 2 benchmarks/profile_native.py --num-sms 16 24 32 --push 0.25 0.33 0.5

For every SM budget and pusher fraction, each operation (fresh dispatch, cached dispatch, dispatch with
``num_worst_tokens``, combine) is timed three ways, median over ``--runs`` rotating input sets:

* ``call``: CUDA events around the Python call, the GPU released only after the host queued it (a
  long device sleep first), so host time is not counted unless the call waits on the host;
* ``host``: the host's time inside the call (Python, checks, allocation, launch, host waits);
* ``kernel``: first block start to last block end of the dispatch/combine kernel, from the global-timer
  stamps each block writes (`NativeBackend.trace_kernels`), and inside it when the pushers and the
  local (dispatch) or reducer (combine) blocks finished their share, relative to the kernel's start.

Rank 0 prints one line per (operation, configuration). Not a replacement for ``ep-moe bench`` (no
result checks): a diagnostic for tuning the kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from ep_moe import Buffer, Config
from ep_moe import native as native_kernels
from ep_moe.benchmarking.workload import make_input_set, to_fp8_blocks
from ep_moe.distributed import init_from_torchrun

SLEEP_CYCLES = 4_000_000  # ~2 ms at H200 clocks: longer than the host needs to queue any call


WARPS_PER_BLOCK = 16  # ep_moe/native/kernels/kernels.h kThreads / 32


def kernel_phases(trace: torch.Tensor, num_push: int) -> tuple[float, ...]:
    """From a [blocks, TRACE_SLOTS] trace, in microseconds: kernel span, pushers done, local/reducers done,
    then per warp on average: pushers' wait for the peer, pushers' chunk handshakes, local/reducer waits for
    chunks (a reducer's lanes wait in turn, so its figure sums them)."""
    t = trace.cpu().double()
    start = t[:, 0].min()
    span = (t[:, 3].max() - start) / 1e3
    push_done = (t[:num_push, 2].max() - start) / 1e3 if num_push else 0.0
    local_done = (t[num_push:, 2].max() - start) / 1e3

    def per_warp(rows: torch.Tensor, slot: int) -> float:
        return float(rows[:, slot].sum() / 1e3 / max(1, rows.shape[0] * WARPS_PER_BLOCK))

    pushers, local = t[:num_push], t[num_push:]
    return (float(span), float(push_done), float(local_done), per_warp(pushers, 4), per_warp(pushers, 5),
            per_warp(local, 4))


def copy_engine_timeline(trace: torch.Tensor, blocks: torch.Tensor, chunks_per_source: int) -> str:
    """The copy-engine timeline of a traced call, in us after the kernel's first block started: when the go
    word was set and when each source's chunks were first seen landed ('' when the call had no copy engine)."""
    never = torch.iinfo(torch.int64).max
    t = trace.cpu().tolist()
    if t[0] == never:
        return ""
    start = int(blocks.cpu()[:, 0].min())
    parts = [f"go {(t[0] - start) / 1e3:.1f}"]
    for src in range((len(t) - 1) // chunks_per_source):
        landed = [v for v in t[1 + src * chunks_per_source:1 + (src + 1) * chunks_per_source] if v != never]
        if landed:
            parts.append(f"rank {src} chunks " + " ".join(f"{(v - start) / 1e3:.1f}" for v in landed))
    return "copy engine (us after the kernel's start): " + "; ".join(parts)


def profile_ops(buf: Buffer, sets: list, cfg: Config, worst: int, measure, num_push: int, fp8: bool) -> list:
    """[(op, measurement)] for fresh, cached and fixed-size dispatch and (BF16 only) combine with ``cfg``."""
    outs = {}
    xs = [to_fp8_blocks(s.x) if fp8 else s.x for s in sets]

    def fresh(i: int, num_worst_tokens: int = 0) -> None:
        s = sets[i]
        outs[i] = buf.dispatch(xs[i], num_tokens_per_rank=s.num_tokens_per_rank, is_token_in_rank=s.is_token_in_rank,
                               num_tokens_per_expert=s.num_tokens_per_expert, topk_idx=s.topk_idx,
                               topk_weights=s.topk_weights, num_worst_tokens=num_worst_tokens, config=cfg)

    ops = [("dispatch", measure(fresh, "dispatch", num_push)),
           ("dispatch_cached", measure(lambda i: buf.dispatch(xs[i], handle=outs[i][4], config=cfg),
                                       "dispatch_cached", num_push))]
    if not fp8:  # the combine takes BF16 rows
        ops.append(("combine", measure(lambda i: buf.combine(outs[i][0], outs[i][4], config=cfg), "combine",
                                       num_push)))
    return ops + [("dispatch_worst", measure(lambda i: fresh(i, worst), "dispatch", num_push))]


def host_profile(buf: Buffer, sets: list, rank: int, calls: int = 200) -> None:
    """Rank 0 prints the functions where the host spends its time in cached dispatch + combine (both
    ranks run the calls; the GPU work is queued behind a long sleep so the host never waits for it)."""
    import cProfile
    import pstats

    s = sets[0]
    out = buf.dispatch(s.x, num_tokens_per_rank=s.num_tokens_per_rank, is_token_in_rank=s.is_token_in_rank,
                       num_tokens_per_expert=s.num_tokens_per_expert, topk_idx=s.topk_idx, topk_weights=s.topk_weights)
    torch.cuda.synchronize()
    dist.barrier()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        buf.dispatch(s.x, handle=out[4])
        buf.combine(out[0], out[4])
    profiler.disable()
    torch.cuda.synchronize()
    if rank == 0:
        print(f"host profile: {calls} x (cached dispatch + combine), top functions by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-sms", nargs="+", type=int, default=[24])
    parser.add_argument("--push", nargs="+", type=float, default=[1 / 3], help="fractions of the SMs that push")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--fp8", action="store_true", help="dispatch FP8 rows with their scales (no combine)")
    parser.add_argument("--host-profile", action="store_true",
                        help="also print where the host's time goes (cProfile of 200 cached dispatches and combines)")
    args = parser.parse_args()

    device = init_from_torchrun("cuda", timeout_s=600.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    hint = Buffer.get_buffer_size_hint(args.tokens, args.hidden, world, args.topk)
    buf = Buffer(num_nvl_bytes=hint, backend="native", check_inputs=False)
    native = buf.backend
    sets = [make_input_set(args.tokens, args.hidden, args.experts, args.topk, world, torch.bfloat16, device,
                           seed=i * 101 + rank) for i in range(3)]
    token = torch.ones(1, device=device)

    timelines: dict[str, str] = {}  # op -> this rank's copy-engine timeline of its last traced call

    def measure(fn, op: str, num_push: int):
        calls, hosts, phases = [], [], []
        for i in range(args.runs + 3):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            dist.all_reduce(token)
            native.trace_kernels = True
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn(i % len(sets))
            t1 = time.perf_counter()
            end.record()
            native.trace_kernels = False
            end.synchronize()
            if i >= 3:
                calls.append(start.elapsed_time(end) * 1e3)
                hosts.append((t1 - t0) * 1e6)
                phases.append(kernel_phases(native.last_trace[op], native.last_push_blocks[op]))
                timelines[op] = copy_engine_timeline(native.last_copy_engine_trace[op], native.last_trace[op],
                                                     native_kernels.intranode_kernels().MAX_COPY_ENGINE_CHUNKS)
        mine = torch.tensor([statistics.median(calls), statistics.median(hosts),
                             *(statistics.median(p[j] for p in phases) for j in range(6))], device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return mine.tolist()

    if rank == 0:
        print(f"profile: {world} ranks, T={args.tokens} H={args.hidden} top-{args.topk} of {args.experts}, "
              f"{'fp8' if args.fp8 else 'bf16'}; "
              f"median of {args.runs}, slowest rank; us")
        print(f"{'op':16s} {'SMs':>4s} {'push':>5s} {'call':>8s} {'host':>8s} {'kernel':>8s} {'pushers':>8s} "
              f"{'local':>8s} {'p.wait':>7s} {'p.sync':>7s} {'l.wait':>7s}   (waits and syncs: us per warp)")
    for sms in args.num_sms:
        for frac in args.push:
            native_options = dataclasses.replace(buf.native_options, dispatch_push_fraction=frac,
                                                 combine_push_fraction=frac)
            cfg = Config(num_sms=sms, native=native_options)
            num_push = native._split(cfg, "dispatch")[1]
            for op, (call, host, span, push_done, local_done, p_wait, p_sync, l_wait) in profile_ops(
                    buf, sets, cfg, world * args.tokens, measure, num_push, args.fp8):
                if rank == 0:
                    print(f"{op:16s} {sms:4d} {frac:5.2f} {call:8.1f} {host:8.1f} {span:8.1f} {push_done:8.1f} "
                          f"{local_done:8.1f} {p_wait:7.1f} {p_sync:7.1f} {l_wait:7.1f}", flush=True)
                    if timelines.get(op):
                        print(f"    {timelines.pop(op)}", flush=True)
    if args.host_profile:
        host_profile(buf, sets, rank)
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
