"""Host time of the differentiable ops called eagerly (`ep_moe.custom_op.CustomOp`) against the same ops through
the dispatcher (``CustomOp.op``, the ``torch.library`` custom op), on CPU: one rank (a gloo group of one), the
torch backend, small shapes, so that the difference is the call path's own Python.

    python3 benchmarks/custom_op_overhead.py [--calls 300] [--rounds 9]

Per operation, microseconds per call on both paths, the fastest of ``--rounds`` rounds of ``--calls`` calls, and
their difference. The inputs need gradients (the autograd wrapper is where the dispatcher's path costs most), and
``fwd+bwd`` adds the backward of a dispatch + combine. Every round's last outputs and gradients are compared bit for
bit between the paths; a difference exits 1 naming the operation.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import ep_moe
from ep_moe import Buffer
from ep_moe.buffer import autograd_ops
from ep_moe.custom_op import CustomOp
from ep_moe.distributed import free_port

OPS: tuple[CustomOp, ...] = (autograd_ops._DISPATCH, autograd_ops._COMBINE, autograd_ops._CACHED_DISPATCH)
NUM_EXPERTS, TOKENS, HIDDEN, TOPK = 8, 8, 16, 2


def workloads(buffer: Buffer, through_dispatcher: bool) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """The timed calls, each returning what is compared: eager (`CustomOp`) or through the dispatcher (its ``op``;
    the backward formulas' own calls are eager on both paths)."""
    dispatch, combine, cached_dispatch = (op.op if through_dispatcher else op for op in OPS)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).requires_grad_()
    idx = torch.randint(-1, NUM_EXPERTS, (TOKENS, TOPK), generator=gen)
    w = torch.rand(TOKENS, TOPK, generator=gen).requires_grad_()
    handle = ep_moe.dispatch(buffer, x.detach(), idx, w.detach(), NUM_EXPERTS).handle
    handle_args = (*autograd_ops._handle_args(handle), buffer.buffer_id, 0)
    y = torch.randn(handle.num_recv_tokens, HIDDEN, generator=gen).requires_grad_()
    dispatch_args = (x, idx, w, buffer.buffer_id, NUM_EXPERTS, 1, 0, 0)

    def fwd_bwd() -> list[torch.Tensor]:
        x.grad = None
        out = dispatch(*dispatch_args)
        combined, _ = combine(out[0], None, None, None, *out[4:10], 0, buffer.buffer_id, 0)
        combined.sum().backward()
        return [combined.detach(), x.grad]

    return {"dispatch": lambda: list(dispatch(*dispatch_args)[:4]),
            "combine": lambda: list(combine(y, None, None, None, *handle_args)),
            "cached_dispatch": lambda: [cached_dispatch(x, *handle_args)],
            "dispatch + combine, fwd+bwd": fwd_bwd}


def per_call_us(paths: tuple[Callable[[], object], ...], calls: int, rounds: int) -> list[float]:
    """Microseconds per call of each path: the fastest of ``rounds`` rounds of ``calls`` calls, the paths' rounds
    taken in turns (so that a slower stretch of the machine falls on both)."""
    best = [float("inf")] * len(paths)
    for _ in range(rounds):
        for i, fn in enumerate(paths):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.set_num_threads(1)
    buffer = Buffer(backend="torch")
    failed = False
    print(f"{'op (inputs need grad)':30s} {'eager us':>9s} {'dispatcher us':>14s} {'saved us':>9s}")
    through_dispatcher = workloads(buffer, True)
    for name, fn in workloads(buffer, False).items():
        eager, through = per_call_us((fn, through_dispatcher[name]), args.calls, args.rounds)
        eager_out, through_out = fn(), through_dispatcher[name]()
        same = all(torch.equal(a, b) for a, b in zip(eager_out, through_out, strict=True))
        failed |= not same
        print(f"{name:30s} {eager:9.1f} {through:14.1f} {through - eager:9.1f}" + ("" if same else "  DIFF"))
    buffer.destroy()
    dist.destroy_process_group()
    if failed:
        print("custom_op_overhead: the eager path's outputs differ from the dispatcher's", file=sys.stderr)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
