"""Hybrid mode on GPUs over NCCL: the two-hop backend equals the flat torch backend bit for bit (compact and
expanded, exact and fixed size, gradients), its fixed mode reads nothing on the host, and a fixed-size dispatch +
combine captured in a CUDA graph replays to the eager result. One GPU: the 1 x 1 view (both hops local, every
device op of the path run); two GPUs: the 2 x 1 and 1 x 2 views (the two-GPU run is the multi-GPU issue's)."""

from __future__ import annotations

import pytest
import torch

from ep_moe.distributed import run_distributed

pytestmark = pytest.mark.gpu


def _hybrid(eb, num_scaleout_ranks: int):
    """Put the two-hop backend under ``eb`` with the S x (R/S) view, even for S = 1 (where ElasticBuffer keeps the
    flat backend), so that one GPU exercises the hybrid code."""
    from ep_moe.hybrid import HybridBackend, LogicalTopology

    topology = LogicalTopology.blocks(eb.num_ranks, num_scaleout_ranks)
    eb.buffer.backend = HybridBackend(eb.group, eb.buffer.device, 60.0, topology)
    return eb


def _run(eb, x, idx, w, E: int, expand: bool, sync: bool, bound: int):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    rx, ri, rw, h, _ = eb.dispatch(x, idx, w, num_experts=E, do_expand=expand, do_cpu_sync=sync,
                                   num_max_tokens_per_rank=bound)
    y = rx * 3 - 1
    out = eb.combine(y, h, expert_weights=rw)[0] if expand else eb.combine(y, h, topk_weights=rw)[0]
    out.float().pow(2).sum().backward()
    cached = eb.dispatch(x.detach() * 2, handle=h)[0]
    return [t for t in (rx, ri, rw, out, cached, x.grad, w.grad) if t is not None]


def _worker(rank: int, world: int, num_scaleout_ranks: int) -> bool:
    from ep_moe import ElasticBuffer

    torch.cuda.set_device(rank)
    E, K, H, T = 8 * world, 4, 512, 96 + 8 * rank
    gen = torch.Generator().manual_seed(rank)
    x = (torch.randn(T, H, generator=gen) * 10.0 ** torch.randint(-3, 4, (T, 1), generator=gen)).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    idx[::7] = -1
    w = torch.rand(T, K, generator=gen)
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()
    bound = 96 + 8 * (world - 1)
    flat = ElasticBuffer(allow_hybrid_mode=False, backend="torch")
    hyb = _hybrid(ElasticBuffer(allow_hybrid_mode=False, backend="torch"), num_scaleout_ranks)
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        for expand in (False, True):
            for sync in (True, False):
                want = _run(flat, x.to(dtype), idx, w, E, expand, sync, bound)
                got = _run(hyb, x.to(dtype), idx, w, E, expand, sync, bound)
                ok &= len(got) == len(want) and all(
                    a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
                    for a, b in zip(got, want))
    # fixed mode reads nothing on the host: the sync debugger raises on any synchronizing call
    _run(hyb, x, idx, w, E, True, False, bound)  # warm-up (NCCL communicators, caches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rx, _, rw, h, _ = hyb.dispatch(x, idx, w, num_experts=E, do_expand=True, do_cpu_sync=False,
                                       num_max_tokens_per_rank=bound)
        hyb.combine(rx, h, expert_weights=rw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # a fixed-size dispatch + combine captured in a CUDA graph replays to the eager result
    def step():
        rx, _, rw, h, _ = hyb.dispatch(x, idx, w, num_experts=E, do_expand=True, do_cpu_sync=False,
                                       num_max_tokens_per_rank=bound)
        return hyb.combine(rx * 2, h, expert_weights=rw)[0]

    eager = step()
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
    return bool(ok and torch.equal(captured, eager))


def test_hybrid_one_gpu_equals_flat():
    assert run_distributed(_worker, 1, 1, backend="nccl", timeout_s=120) == [True]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("num_scaleout_ranks", [2, 1])
def test_hybrid_two_gpus_equals_flat(num_scaleout_ranks: int):
    assert run_distributed(_worker, 2, num_scaleout_ranks, backend="nccl", timeout_s=120) == [True, True]
