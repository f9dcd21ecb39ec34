"""The single-rank expert-major kernels on one GPU: the JIT kernels (specialized per shape,
`ep_moe.native.jit.expert_major`) against the torch definitions of `ep_moe.permute` on the same GPU (the baseline).

    python3 benchmarks/jit_bench.py                       # DeepEP-like: 4096 tokens, hidden 7168, top-8 of 32
    python3 benchmarks/jit_bench.py --tokens 4096 --hidden 2048 4096 7168 --topk 8 --experts 32 --cold

Per shape it first checks that the torch definitions give the same bits as the JIT kernels (every output; the
weights' gradient, a dot product in each implementation's own summation order, within 1e-4), then times each
operation:

* ``layout``: the expert-major layout at a fixed size (``num_slots = max_slots``);
* ``permute``: rows and values into slots; ``reduce``: the weighted sum back; ``backward``: the reduce's
  gradients (rows and weights);
* ``gpu``: CUDA events around ``--iters`` back-to-back calls, per call (host time hidden when the GPU is busy);
* ``host``: the host's time per call (Python, allocation, launch), a loop of calls without waiting;
* the implementations take turns: ``--rounds`` rounds each time every op of every implementation once, and the
  median round is printed (a drift of the machine's speed then falls on all implementations alike).

``--cold`` points the JIT cache at a new temporary directory first, so the first call of each specialization
compiles; the compile (or load) time of every JIT kernel is printed. Prints one table per shape; ``--json``
writes the numbers.

``--intranode`` adds the intranode kernels at EP 1 (a one-rank group in this process): a ``Buffer(backend="native")``
(`ep_moe.native.jit.intranode`), outputs checked equal to the torch backend's bit for bit, then per call: ``layout`` (get_dispatch_layout), ``dispatch`` (fresh, fixed size:
``num_worst_tokens``, no host sync), ``cached`` (dispatch with the handle) and ``combine`` (with top-k weights),
GPU and host time as above:

    python3 benchmarks/jit_bench.py --intranode --tokens 128 4096 --hidden 7168 --topk 8 --experts 256

``--exchange-ops`` adds the generic expert-major ops built from ``ep_moe/native/kernels/expert_major_kernels.cuh``
(`ep_moe.native.jit.expert_major_exchange`), called directly:
``received`` (permute_received_rows: N = 2 T received rows, half of them this rank's own rows from its input, with
values), ``own_rows`` (unpermute_own_rows, weighted), ``routing`` (routing_map_to_topk over ``--experts`` experts) and
``routing_bwd`` (its backward), GPU and host time as above:

    python3 benchmarks/jit_bench.py --exchange-ops --tokens 128 4096 --hidden 7168 --topk 8 --experts 32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import torch

from ep_moe import native
from ep_moe import permute as P
from ep_moe.native import jit
from ep_moe.native.jit import expert_major as J


def implementations() -> dict[str, dict]:
    """Per implementation: layout(idx, L, A, M), permute(x, pos, K, values), reduce(y, w, sorted),
    backward(grad, y, w, pos, K) -> (grad_y, grad_w); missing ones are left out (and said so)."""
    impls: dict[str, dict] = {}
    if jit.available():
        impls["jit"] = {
            "layout": lambda idx, L, A, M: J.expert_layout(idx, L, A, M),
            "permute": lambda x, pos, K, v: J.permute_rows(x, pos, K, v),
            "reduce": lambda y, w, srt: J.unpermute_sum(y, w, srt, None, None)[0],
            "backward": lambda g, y, w, pos, K: J.unpermute_sum_backward(g, y, w, pos, K, True, True),
        }
    else:
        print(f"jit: unavailable ({jit.unavailable_reason()})")
    impls["torch"] = {
        "layout": lambda idx, L, A, M: P._expert_layout_torch(idx, L, A, M),
        "permute": lambda x, pos, K, v: (P._permute_torch(x, pos, K), P._slot_values_torch(v, pos)),
        "reduce": lambda y, w, srt: P._unpermute_sum_torch(y, w, srt),
        "backward": lambda g, y, w, pos, K: (P._scale_permute_torch(g, w, pos, K), P._pair_dot_torch(g, y, pos, K)),
    }
    return impls


def time_gpu(fn, iters: int) -> float:
    """Microseconds per call, CUDA events around ``iters`` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def time_host(fn, iters: int) -> float:
    """Host microseconds per call (the GPU queue absorbs the launches; synchronized before and after)."""
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - begin
    torch.cuda.synchronize()
    return host * 1e6 / iters


def measure(calls: dict[str, dict], iters: int, rounds: int, around=None) -> dict:
    """``calls[impl][op]`` timed in turns: each of ``rounds`` rounds times every op of every implementation once
    (GPU, then host), so a drift of the machine's speed falls on all of them alike; the median round per op.
    ``around(impl)``: a context manager held while ``impl``'s calls run (e.g. the environment that picks it)."""
    samples = {impl: {op: ([], []) for op in ops} for impl, ops in calls.items()}
    for _ in range(rounds):
        for impl, ops in calls.items():
            with around(impl) if around is not None else contextlib.nullcontext():
                for op, fn in ops.items():
                    samples[impl][op][0].append(time_gpu(fn, iters))
                    samples[impl][op][1].append(time_host(fn, iters))
    return {impl: {op: {"gpu_us": statistics.median(g), "host_us": statistics.median(h)} for op, (g, h) in ops.items()}
            for impl, ops in samples.items()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def run_shape(impls: dict, T: int, H: int, K: int, L: int, A: int, dtype: torch.dtype, iters: int, rounds: int
              ) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.rand(T, L, generator=gen, device="cuda")
    idx = scores.topk(min(K, L), dim=1).indices.to(torch.int64)
    if K > L:
        idx = torch.cat([idx, torch.full((T, K - L), -1, dtype=torch.int64, device="cuda")], 1)
    M = P.max_slots(T, K, L, A)
    x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    values = torch.rand(T * K, device="cuda", generator=gen)
    y = torch.randn(M, H, device="cuda", generator=gen).to(dtype)
    w = torch.rand(M, device="cuda", generator=gen)
    grad = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    ref = next(iter(impls))
    outputs = {}
    for name, impl in impls.items():
        lay = impl["layout"](idx, L, A, M)
        pos, srt = lay[0], lay[2]
        outputs[name] = (*lay[:5], *impl["permute"](x, pos, K, values), impl["reduce"](y, w, srt),
                         *impl["backward"](grad, y, w, pos, K))
    for name, outs in outputs.items():
        for i, (a, b) in enumerate(zip(outs, outputs[ref])):
            if i == len(outs) - 1 and name != ref:  # the weights' gradient: each implementation's summation order
                ok = torch.allclose(a, b, rtol=1e-4, atol=1e-4)
            else:
                ok = same(a, b)
            if not ok:
                raise SystemExit(f"{name} output {i} differs from {ref} (T={T} H={H} K={K} L={L})")
    lay = P._expert_layout_torch(idx, L, A, M)
    pos, srt = lay.pair_of_slot, lay.sorted_slots
    calls = {name: {"layout": lambda impl=impl: impl["layout"](idx, L, A, M),
                    "permute": lambda impl=impl: impl["permute"](x, pos, K, values),
                    "reduce": lambda impl=impl: impl["reduce"](y, w, srt),
                    "backward": lambda impl=impl: impl["backward"](grad, y, w, pos, K)}
             for name, impl in impls.items()}
    return measure(calls, iters, rounds)


def run_intranode(T: int, H: int, K: int, E: int, dtype: torch.dtype, iters: int, rounds: int) -> dict:
    """The native backend at EP 1 (see the module docstring)."""
    import ep_moe
    from ep_moe.native.jit import intranode

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    idx = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices.to(torch.int64)
    weights = torch.rand(T, K, device="cuda", generator=gen)
    config = ep_moe.Config(num_sms=24)
    calls, outputs, buffers = {}, {}, []
    if not native.kernels_available():
        raise SystemExit(f"intranode: unavailable ({native.kernels_unavailable_reason()})")
    for name in ("jit", "torch"):
        buf = ep_moe.Buffer(backend="native" if name == "jit" else "torch")
        buffers.append(buf)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=idx, topk_weights=weights, num_worst_tokens=T, config=config)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **kwargs)
        combined = buf.combine(recv_x, handle, topk_weights=recv_w, config=config)[0]
        outputs[name] = (per_rank, per_expert, in_rank, recv_x, recv_w, combined)
        calls[name] = {"layout": lambda buf=buf: buf.get_dispatch_layout(idx, E),
                       "dispatch": lambda buf=buf, kw=kwargs: buf.dispatch(x, **kw),
                       "cached": lambda buf=buf, h=handle: buf.dispatch(x, handle=h, config=config),
                       "combine": lambda buf=buf, h=handle, r=recv_x, w=recv_w: buf.combine(r, h, topk_weights=w,
                                                                                             config=config)}
    for i, (a, b) in enumerate(zip(outputs["jit"], outputs["torch"])):
        if not same(a, b):
            raise SystemExit(f"intranode output {i} of the native backend differs from the torch backend's (T={T} H={H})")
    result = measure({"jit": calls["jit"]}, iters, rounds)
    for buf in buffers:
        buf.destroy()
    if "jit" in result:
        result["jit_launches"] = dict(intranode.LAUNCHES)
    return result


def run_exchange_ops(T: int, H: int, K: int, L: int, A: int, dtype: torch.dtype, iters: int, rounds: int
                 ) -> dict:
    """The generic expert-major ops (see the module docstring)."""
    from ep_moe.native.jit import expert_major_exchange as E

    gen = torch.Generator(device="cuda").manual_seed(2)
    N, rank = 2 * T, 1  # two ranks; this is rank 1
    prefix = torch.tensor([[T, T], [2 * T, 2 * T]], dtype=torch.int32, device="cuda")  # rows [T, 2T) are own
    idx = torch.rand(N, L, device="cuda", generator=gen).topk(min(K, L), dim=1).indices.to(torch.int64)
    layout = P.expert_layout(idx, L, A, P.max_slots(N, idx.shape[1], L, A))
    rows = torch.randn(N, H, device="cuda", generator=gen).to(dtype)
    own_x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    own_tokens = torch.randperm(T, generator=torch.Generator().manual_seed(3)).to(torch.int32).cuda()
    values = torch.rand(N * idx.shape[1], device="cuda", generator=gen)
    y = torch.randn(layout.num_slots, H, device="cuda", generator=gen).to(dtype)
    w = torch.rand(layout.num_slots, device="cuda", generator=gen)
    scores = torch.rand(T, L, device="cuda", generator=gen)
    routing_map = torch.zeros(T, L, dtype=torch.bool, device="cuda").scatter_(1, scores.topk(min(K, L), 1).indices, True)
    probs = (scores * routing_map).to(dtype)
    grad_w = torch.randn(T, K, device="cuda", generator=gen)
    impls = {"jit": E}
    calls, outputs = {}, {}
    for name, ops in impls.items():
        topk_idx = ops.routing_map_to_topk(routing_map, probs, K)[0]
        op_calls = {
            "received": lambda ops=ops: ops.permute_received_rows(rows, N, own_x, own_tokens, prefix, rank,
                                                                   layout.pair_of_slot, layout.num_topk, values),
            "own_rows": lambda ops=ops: ops.unpermute_own_rows(y, w, layout.sorted_slots, prefix, rank),
            "routing": lambda ops=ops: ops.routing_map_to_topk(routing_map, probs, K),
            "routing_bwd": lambda ops=ops, t=topk_idx: ops.routing_map_to_topk_backward(grad_w, t, L, dtype),
        }
        outputs[name] = [op_calls["received"]()[0], op_calls["received"]()[1], op_calls["own_rows"]()[T:2 * T],
                         *op_calls["routing"](), op_calls["routing_bwd"]()]
        calls[name] = op_calls
    return measure(calls, iters, rounds)


def _print_timing(title: str, timing: dict, ops: tuple[str, ...]) -> None:
    """One table: per op, the GPU (host) µs per call of the JIT kernels."""
    width = max(9, max(len(op) for op in ops) + 1)
    print(f"\n{title}: gpu us per call (host us per call)")
    print(f"{'op':<{width}}{'jit':>22}")
    for op in ops:
        cell = f"{timing['jit'][op]['gpu_us']:9.1f} ({timing['jit'][op]['host_us']:6.1f})"
        print(f"{op:<{width}}{cell:>22}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--hidden", type=int, nargs="+", default=[7168])
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32, help="local experts")
    parser.add_argument("--alignment", type=int, default=16)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--iters", type=int, default=50, help="back-to-back calls per timing")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timings per op and implementation, taken in turns; the median is reported")
    parser.add_argument("--cold", action="store_true", help="a fresh JIT cache directory: first calls compile")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--intranode", action="store_true",
                        help="also the intranode dispatch/combine at EP 1 (--experts: all)")
    parser.add_argument("--exchange-ops", action="store_true",
                        help="also the generic expert-major ops (received rows, own rows, routing map)")
    args = parser.parse_args()
    if args.cold:
        os.environ["EP_MOE_CACHE_DIR"] = tempfile.mkdtemp(prefix="ep_moe_jit_bench_")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    impls = implementations()
    compiler = jit.compiler()
    print(f"GPU: {torch.cuda.get_device_name()}; JIT compiler: {compiler[0].identity if compiler[0] else compiler[1]};"
          f" cache: {jit.process_cache().directory}")
    results = []
    for T in args.tokens:
        for H in args.hidden:
            shape = dict(T=T, H=H, K=args.topk, L=args.experts, A=args.alignment, dtype=args.dtype)
            timing = run_shape(impls, T, H, args.topk, args.experts, args.alignment, dtype, args.iters, args.rounds)
            results.append({"shape": shape, "timing": timing})
            print(f"\nT={T} H={H} K={args.topk} L={args.experts} A={args.alignment} {args.dtype}: "
                  "gpu us per call (host us per call)")
            print(f"{'op':<9}" + "".join(f"{name:>22}" for name in timing))
            for op in ("layout", "permute", "reduce", "backward"):
                cells = [f"{t[op]['gpu_us']:9.1f} ({t[op]['host_us']:6.1f})" for t in timing.values()]
                print(f"{op:<9}" + "".join(f"{c:>22}" for c in cells))
    if args.intranode:
        import torch.distributed as dist

        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        for T in args.tokens:
            for H in args.hidden:
                timing = run_intranode(T, H, args.topk, args.experts, dtype, args.iters, args.rounds)
                results.append({"intranode": dict(T=T, H=H, K=args.topk, E=args.experts, dtype=args.dtype),
                                "timing": timing})
                _print_timing(f"intranode at EP 1, T={T} H={H} K={args.topk} E={args.experts} {args.dtype}",
                                  timing, ("layout", "dispatch", "cached", "combine"))
        dist.destroy_process_group()
    if args.exchange_ops:
        for T in args.tokens:
            for H in args.hidden:
                timing = run_exchange_ops(T, H, args.topk, args.experts, args.alignment, dtype, args.iters, args.rounds)
                results.append({"exchange_ops": dict(T=T, H=H, K=args.topk, L=args.experts, dtype=args.dtype),
                                "timing": timing})
                _print_timing(f"exchange ops, T={T} H={H} K={args.topk} L={args.experts} {args.dtype}", timing,
                                  ("received", "own_rows", "routing", "routing_bwd"))
    print("\nJIT kernels this process built or loaded:")
    for event in jit.history():
        if event.how != "memory":
            print(f"  {event.how:<9}{event.seconds:7.3f} s  {event.label}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"results": results, "jit": [list(e) for e in jit.history() if e.how != "memory"]}, f, indent=1)


if __name__ == "__main__":
    main()
