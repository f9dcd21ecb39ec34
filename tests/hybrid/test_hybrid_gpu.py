"""Hybrid mode on GPUs: with ``allow_multiple_reduction=False`` the two-hop backend equals the flat torch backend
bit for bit (compact and expanded, exact and fixed size, gradients, FP8 pairs), its fixed mode reads nothing on the
host, and a fixed-size dispatch + combine captured in a CUDA graph replays to the eager result; with both scale-up
transports (the native kernels on the node's subgroup, all-to-all) and the scale-out hop chunked on its side stream.
The reduced combine (``allow_multiple_reduction=True``) equals tests/hybrid/test_hybrid_reduced.py's token-by-token
reference of DeepEP V2's order bit for bit, for two chunk counts, reads nothing on the host in fixed mode and
replays from a CUDA graph. One GPU over NCCL: the 1 x 1 view (the scale-out hop a one-rank NCCL exchange on the
side stream, the scale-up hop the native one-rank path or a copy); 2, 3 and 4 processes sharing GPU 0 over gloo
(2 x 1, 3 x 1, 2 x 2); two GPUs over NCCL: the 2 x 1 and 1 x 2 views.

Run: ``pytest -m gpu tests/hybrid/test_hybrid_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from support.bits import assert_bits_equal, bits_equal
from test_hybrid_reduced import KINDS, _combine_rows, _expected, _inputs

from ep_moe.distributed import run_distributed

pytestmark = pytest.mark.gpu


def _hybrid(eb, num_scaleout_ranks: int, scaleup: str, num_chunks: int, allow_multiple_reduction: bool = False):
    """Put the two-hop backend under ``eb`` with the S x (R/S) view, even for S = 1 (where ElasticBuffer keeps the
    flat backend), so that one GPU exercises the hybrid code."""
    from ep_moe.backends.hybrid import HybridBackend, LogicalTopology

    topology = LogicalTopology.blocks(eb.num_ranks, num_scaleout_ranks)
    eb.buffer.backend = HybridBackend(eb.group, eb.buffer.device, 60.0, topology, num_chunks=num_chunks,
                                      scaleup=scaleup, allow_multiple_reduction=allow_multiple_reduction)
    assert eb.buffer.backend.scaleup_transport == scaleup, eb.buffer.backend.scaleup_reason
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


def _run_fp8(eb, x8, scales, idx, w, E: int, expand: bool, sync: bool, bound: int):
    (rx, rs), ri, rw, h, _ = eb.dispatch((x8, scales), idx, w, num_experts=E, do_expand=expand, do_cpu_sync=sync,
                                         num_max_tokens_per_rank=bound)
    (cx, cs), _, _, _, _ = eb.dispatch((x8, scales), handle=h)
    out = eb.combine(rx.to(torch.bfloat16), h, expert_weights=rw)[0] if expand else \
        eb.combine(rx.to(torch.bfloat16), h)[0]
    return [rx, rs, ri, rw, cx, cs, out]


def _all_bits_equal(got: list, want: list) -> bool:
    """Equal bits, position by position; an output the layout does not return (None, e.g. the expanded layout's
    top-k ids) must be None on both sides."""
    return len(got) == len(want) and all(bits_equal(a, b) for a, b in zip(got, want))


def _no_sync_and_graph(step, what: str) -> dict[str, bool]:
    """``step()``, a fixed-size dispatch + combine returning a tensor, reads nothing on the host (the sync
    debugger raises on any synchronizing call) and, captured in a CUDA graph, replays to its eager result."""
    eager = step()  # also the warm-up (communicators, caches, native buffer sizes)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        no_sync = True
    except RuntimeError:
        no_sync = False
    finally:
        torch.cuda.set_sync_debug_mode(0)
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
    return {f"{what} fixed size without host reads": no_sync, f"{what} CUDA graph replay": torch.equal(captured, eager)}


def _reduced(rank: int, world: int, num_scaleout_ranks: int, scaleup: str, num_chunks: int,
             flat_backend: str, shared: bool) -> dict[str, bool]:
    """The reduced combine on this GPU view against the CPU reference (compact and expanded, exact and fixed
    size, ``num_chunks`` and one chunk); except on a shared GPU (gloo): without host reads in fixed mode, and
    replayed from a CUDA graph."""
    from ep_moe import ElasticBuffer

    R, S = world, num_scaleout_ranks
    E, device = 4 * R, torch.device("cuda", torch.cuda.current_device())
    buffers = [_hybrid(ElasticBuffer(allow_hybrid_mode=False, backend=flat_backend), S, scaleup, c, True)
               for c in (num_chunks, 1)]
    ok = {}
    for kind in [k for k in KINDS if k in ("random", "one_node")]:
        for dtype in (torch.bfloat16, torch.float32):
            xs, idxs, ws, biases, values, row_weights = _inputs(kind, R, S, E, dtype)
            bound = max(1, max(i.shape[0] for i in idxs))
            x, idx, w, b = (t.to(device) for t in (xs[rank], idxs[rank], ws[rank], biases[rank]))
            tables = values.to(device), row_weights.to(device)
            for expand in (False, True):
                want, want_w, _, _ = _expected(rank, idxs, ws, (biases[rank],), E, R, S, values, row_weights, expand,
                                               dtype)
                for sync in (True, False):
                    for eb in buffers:
                        out, out_w = _combine_rows(eb, rank, x, idx, w, b, E, *tables, expand, sync, bound)
                        name = f"reduced {kind} {dtype} expand={expand} sync={sync} chunks={eb.buffer.backend.num_chunks}"
                        try:
                            assert_bits_equal(out.cpu(), want, name)
                            assert_bits_equal(out_w.cpu(), want_w, name + " weights")
                            ok[name] = True
                        except AssertionError:
                            ok[name] = False
    if not shared:  # gloo's collectives wait on the host and cannot be captured
        xs, idxs, ws, biases, values, row_weights = _inputs("random", R, S, E, torch.bfloat16)
        bound = max(1, max(i.shape[0] for i in idxs))
        x, idx, w, b = (t.to(device) for t in (xs[rank], idxs[rank], ws[rank], biases[rank]))
        tables = values.to(device), row_weights.to(device)
        ok |= _no_sync_and_graph(lambda: _combine_rows(buffers[0], rank, x, idx, w, b, E, *tables, True, False,
                                                       bound)[0], "reduced")
    for eb in buffers:
        eb.destroy()
    return ok


def _worker(rank: int, world: int, num_scaleout_ranks: int, scaleup: str, num_chunks: int,
            shared: bool = False) -> dict[str, bool]:
    """Every check of this module on one view; ``shared``: all ranks on GPU 0 in a gloo group, whose buffers
    are on the GPU through the native backend's VMM memory (``EP_MOE_SYMMETRIC_MEMORY=vmm``; the flat reference
    is then the native backend, bit-equal to the torch one)."""
    import os

    from ep_moe import ElasticBuffer
    from ep_moe.native.symmetric import SYMMETRIC_MEMORY_ENV

    if shared:
        os.environ[SYMMETRIC_MEMORY_ENV] = "vmm"
    torch.cuda.set_device(0 if shared else rank)
    flat_backend = "auto" if shared else "torch"
    E, K, H, T = 8 * world, 4, 512, 96 + 8 * rank
    gen = torch.Generator().manual_seed(rank)
    x = (torch.randn(T, H, generator=gen) * 10.0 ** torch.randint(-3, 4, (T, 1), generator=gen)).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    idx[::7] = -1
    w = torch.rand(T, K, generator=gen)
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()
    x8, scales = (x.float() / 64).to(torch.float8_e4m3fn), torch.rand(T, H // 128, generator=gen).cuda() + 0.5
    bound = 96 + 8 * (world - 1)
    flat = ElasticBuffer(allow_hybrid_mode=False, backend=flat_backend)
    hyb = _hybrid(ElasticBuffer(allow_hybrid_mode=False, backend=flat_backend), num_scaleout_ranks, scaleup,
                  num_chunks)
    assert flat.buffer.device.type == "cuda", flat.buffer.backend_reason
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        for expand in (False, True):
            for sync in (True, False):
                ok &= _all_bits_equal(_run(hyb, x.to(dtype), idx, w, E, expand, sync, bound),
                                  _run(flat, x.to(dtype), idx, w, E, expand, sync, bound))
    for expand in (False, True):
        for sync in (True, False):
            ok &= _all_bits_equal(_run_fp8(hyb, x8, scales, idx, w, E, expand, sync, bound),
                              _run_fp8(flat, x8, scales, idx, w, E, expand, sync, bound))
    results = {"unreduced equals flat": bool(ok)}
    if not shared:  # gloo's collectives wait on the host and cannot be captured

        def step():
            rx, _, rw, h, _ = hyb.dispatch(x, idx, w, num_experts=E, do_expand=True, do_cpu_sync=False,
                                           num_max_tokens_per_rank=bound)
            return hyb.combine(rx * 2, h, expert_weights=rw)[0]

        results |= _no_sync_and_graph(step, "unreduced")
    hyb.destroy()
    flat.destroy()
    return results | _reduced(rank, world, num_scaleout_ranks, scaleup, num_chunks, flat_backend, shared)


def _failures(results: list[dict[str, bool]]) -> list[str]:
    return [f"rank {rank}: {name}" for rank, checks in enumerate(results) for name, ok in checks.items() if not ok]


def _native_built() -> bool:
    from ep_moe import native

    return native.kernels_available()


@pytest.mark.parametrize("scaleup, num_chunks", [("all_to_all", 3), ("native", 2)])
def test_hybrid_one_gpu_equals_flat(scaleup: str, num_chunks: int):
    if scaleup == "native" and not _native_built():
        pytest.skip("the native kernels cannot run here (ep-moe env says why)")
    assert _failures(run_distributed(_worker, 1, 1, scaleup, num_chunks, backend="nccl", timeout_s=120)) == []


@pytest.mark.parametrize("world, num_scaleout_ranks, scaleup", [(2, 2, "all_to_all"), (3, 3, "torch"),
                                                                (4, 2, "all_to_all"), (4, 2, "torch")])
def test_hybrid_processes_sharing_one_gpu(world: int, num_scaleout_ranks: int, scaleup: str):
    """2 to 4 processes on GPU 0 in one gloo group (CUDA tensors): both combine modes as on separate GPUs."""
    from ep_moe.elastic.memory.cuda_vmm import vmm_unavailable_reason

    if not _native_built():
        pytest.skip("the native kernels cannot run here (ep-moe env says why)")
    reason = vmm_unavailable_reason(torch.device("cuda", 0), exportable=True, host=False)
    if reason is not None:
        pytest.skip(f"VMM device memory cannot be shared between processes here: {reason}")
    results = run_distributed(_worker, world, num_scaleout_ranks, scaleup, 3, True, backend="gloo", timeout_s=300,
                              join_timeout_s=900)
    assert _failures(results) == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("num_scaleout_ranks", [2, 1])
@pytest.mark.parametrize("scaleup", ["all_to_all", "native"])
def test_hybrid_two_gpus_equals_flat(num_scaleout_ranks: int, scaleup: str):
    if scaleup == "native" and not _native_built():
        pytest.skip("the native kernels cannot run here (ep-moe env says why)")
    assert _failures(run_distributed(_worker, 2, num_scaleout_ranks, scaleup, 2, backend="nccl", timeout_s=120)) == []
