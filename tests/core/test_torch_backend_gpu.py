"""The torch backend over NCCL on real GPUs: equal to the reference, and CUDA-graph capturable with
``num_worst_tokens``. Runs on the 2-GPU device machine; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

import ep_moe
from ep_moe.distributed import run_distributed
from ep_moe.reference import reference_combine, reference_dispatch

pytestmark = pytest.mark.gpu

NEEDS_2_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _inputs(rank: int, tokens: int, hidden: int, experts: int, topk: int):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=gen)
    weights, idx = scores.topk(topk, dim=1)
    if tokens:
        idx[0] = -1  # a token that goes nowhere
    return x, idx, weights


def _equal_to_reference(rank: int, world: int) -> bool:
    tokens, hidden, experts, topk = 257, 512, 16, 4
    inputs = [_inputs(r, tokens + r, hidden, experts, topk) for r in range(world)]
    ref = reference_dispatch([i[0] for i in inputs], [i[1] for i in inputs], [i[2] for i in inputs], experts, 4)
    x, idx, w = (t.cuda() for t in inputs[rank])
    buffer = ep_moe.Buffer(backend="torch")
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w,
                                                                   num_experts=experts, expert_alignment=4)
    ok = torch.equal(recv_x.cpu(), ref[rank].recv_x) and torch.equal(recv_idx.cpu(), ref[rank].recv_topk_idx)
    ok &= torch.equal(recv_w.cpu(), ref[rank].recv_topk_weights) and counts == ref[rank].num_recv_tokens_per_expert
    ys = [(d.recv_x.float() * (r + 1)).to(torch.bfloat16) for r, d in enumerate(ref)]
    expected = reference_combine(ys, ref, [tokens + r for r in range(world)],
                                 topk_idxs=[i[1] for i in inputs], num_experts=experts)[rank][0]
    combined, _, _ = buffer.combine(ys[rank].cuda(), handle)
    return bool(ok and torch.equal(combined.cpu(), expected))


def _graph_capture(rank: int, world: int) -> bool:
    tokens, hidden, experts, topk = 128, 256, 8, 2
    x, idx, w = (t.cuda() for t in _inputs(rank, tokens, hidden, experts, topk))
    buffer = ep_moe.Buffer(backend="torch")
    worst = tokens * world

    def step():
        out = ep_moe.dispatch(buffer, x, idx, w, experts, num_worst_tokens=worst)
        return ep_moe.combine(buffer, out.recv_x, out.handle)[0]

    expected = step()  # eager, also warms up NCCL
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(captured, expected))


@NEEDS_2_GPUS
def test_torch_backend_over_nccl_equals_reference():
    assert all(run_distributed(_equal_to_reference, 2, backend="nccl", timeout_s=120))


@NEEDS_2_GPUS
def test_torch_backend_graph_capture_with_num_worst_tokens():
    assert all(run_distributed(_graph_capture, 2, backend="nccl", timeout_s=120))
