"""Hybrid mode's chunked overlap, its scale-up transports and FP8 (docs/hybrid.md), on CPU with gloo: 4 ranks as
2 x 2 and 6 ranks as 2 x 3 give, with ``allow_multiple_reduction=False``, the flat path's outputs bit for bit for chunk counts 1 to 5, the all-to-all and
the Buffer-dispatch ("torch", the native path's logic) scale-up hops, bf16/fp32 rows and FP8 pairs; the per-hop
counters equal the model's counts (FP8 rows included); the scale-out chunks are all posted before the first
scale-up hop runs, and chunk k's scale-up hop runs before chunk k+1 is waited for; a chunk count that differs
between ranks raises before any row moves; a missing peer's timeout names the hop and the chunk. With
``allow_multiple_reduction=True`` (the reduced combine) the FP8 round trip's combine is the same for every chunk
count and transport, within the reduced bound of the flat one; the mode must be equal on every rank.

The bf16/fp32 round trip and the inputs are tests/hybrid/test_hybrid.py's."""

from __future__ import annotations

import pytest
import torch
from support.bits import assert_bits_equal
from support.world_sizes import run_world_sizes
from test_hybrid import HIDDEN, TOPK, _inputs, _round_trip, _routing
from test_hybrid_reduced import error_bound

from ep_moe.tuning.hybrid_model import exact_hop_rows

FP8_HIDDEN = 128


def _fp8_inputs(kind: str, num_ranks: int, num_nodes: int, num_experts: int):
    """Per rank ``(x_e4m3 [T, 128], scales [T, 1] fp32, topk_idx, topk_weights)``, regenerated on every rank."""
    out = []
    for s in range(num_ranks):
        gen = torch.Generator().manual_seed(500 * num_nodes + 13 * s + len(kind))
        idx = _routing(kind, s, num_ranks, num_nodes, num_experts, gen)
        T = idx.shape[0]
        x = (torch.randn(T, FP8_HIDDEN, generator=gen) * 4).to(torch.float8_e4m3fn)
        out.append((x, torch.rand(T, FP8_HIDDEN // 128, generator=gen) + 0.5, idx, torch.rand(T, TOPK, generator=gen)))
    return out


def _fp8_round_trip(eb, x, scales, idx, w, E: int, expand: bool, sync: bool, bound: int,
                    absolute: bool = False) -> list:
    """An FP8 dispatch (forward only), a cached FP8 dispatch and a bf16 combine on its handle (``absolute``: of
    the rows' absolute values, the reduced bound's ``A`` within bf16 rounding)."""
    (rx, rs), ri, rw, h, _ = eb.dispatch((x, scales), idx, w, num_experts=E, do_expand=expand, do_cpu_sync=sync,
                                         num_max_tokens_per_rank=bound)
    (cx, cs), _, _, _, _ = eb.dispatch((x, scales), handle=h)
    y = rx.to(torch.bfloat16) * rs.repeat_interleave(128, dim=1).to(torch.bfloat16)
    if absolute:
        y, rw = y.abs(), (rw.abs() if rw is not None else None)
    out = eb.combine(y, h, expert_weights=rw)[0] if expand else eb.combine(y, h)[0]
    return [rx, rs, ri, rw, cx, cs, out, h.psum_num_recv_tokens_per_expert]


def _record_order(backend) -> list[tuple]:
    """Log the exchanges of ``backend`` as they are posted and waited for: ``(event, hop, chunk)``."""
    log: list[tuple] = []
    post, scaleup = backend._post, backend._scaleup

    def logged_post(op, hop, send, num_peers, capacity, payload_fn, counts, tally, chunk=0, num_chunks=1,
                    side=False):
        pending = post(op, hop, send, num_peers, capacity, payload_fn, counts, tally, chunk, num_chunks, side)
        if hop == "scaleout":
            log.append(("post", hop, chunk))
            finish = pending.result

            def result():
                log.append(("wait", hop, chunk))
                return finish()

            pending.result = result
        return pending

    def logged_scaleup(op, send, capacity, used, payload_fn, counts, tally, chunk, num_chunks, config):
        log.append(("run", "scaleup", chunk))
        return scaleup(op, send, capacity, used, payload_fn, counts, tally, chunk, num_chunks, config)

    backend._post, backend._scaleup = logged_post, logged_scaleup
    return log


def _check_pipeline(log: list[tuple], nc: int, where: str) -> None:
    """Dispatch: every chunk posted before the first wait; scale-up k before the wait of chunk k+1. Combine:
    scale-up k+1 after chunk k is posted and before any scale-out chunk is waited for."""
    at = {event: i for i, event in enumerate(log)}
    assert len(at) == len(log) == 3 * nc, f"{where}: {log}"
    if log[0][0] == "post":  # dispatch
        assert max(at[("post", "scaleout", k)] for k in range(nc)) < at[("wait", "scaleout", 0)], f"{where}: {log}"
        for k in range(nc - 1):
            assert at[("run", "scaleup", k)] < at[("wait", "scaleout", k + 1)], f"{where}: {log}"
    else:  # combine
        for k in range(nc - 1):
            assert at[("post", "scaleout", k)] < at[("run", "scaleup", k + 1)] < at[("wait", "scaleout", 0)], \
                f"{where}: {log}"


# world size -> its (logical nodes, chunks, scale-up transport) configurations
CONFIGS = {4: [(2, 1, "auto"), (2, 3, "torch"), (2, 5, "all_to_all")], 6: [(2, 2, "torch")]}


def _worker(rank: int, num_ranks: int, group) -> int:
    from ep_moe import ElasticBuffer
    from ep_moe.backends.hybrid.hybrid_backend import _Tally

    configs = CONFIGS[num_ranks]
    E = 4 * num_ranks
    flat = ElasticBuffer(group, allow_hybrid_mode=False, allow_multiple_reduction=False)
    checked = 0
    reduced_out: dict[tuple, torch.Tensor] = {}  # the reduced combine's result of each FP8 case, first config's
    for num_nodes, chunks, scaleup in configs:
        eb = ElasticBuffer(group, num_scaleout_ranks=num_nodes, num_hybrid_chunks=chunks, hybrid_scaleup=scaleup,
                           allow_multiple_reduction=False)
        ebr = ElasticBuffer(group, num_scaleout_ranks=num_nodes, num_hybrid_chunks=chunks, hybrid_scaleup=scaleup)
        assert ebr.buffer.backend.allow_multiple_reduction
        backend = eb.buffer.backend
        assert backend.scaleup_transport == ("all_to_all" if scaleup == "auto" else scaleup), backend.scaleup_reason
        assert backend.max_chunks == backend.num_chunks == chunks
        where = f"{num_nodes}x{num_ranks // num_nodes} chunks={chunks} scaleup={scaleup}"
        for kind in ("random", "empty_node"):
            for dtype in (torch.bfloat16, torch.float32):
                xs, idxs, ws = _inputs(kind, num_ranks, num_nodes, E, dtype)
                bias = torch.randn(xs[rank].shape[0], HIDDEN).to(dtype)
                bound = max(i.shape[0] for i in idxs)
                for expand, sync in ((False, True), (True, False)) if dtype == torch.float32 else \
                        ((False, False), (True, True)):
                    want = _round_trip(flat, xs[rank], idxs[rank], ws[rank], bias, E, expand, sync, bound)
                    got = _round_trip(eb, xs[rank], idxs[rank], ws[rank], bias, E, expand, sync, bound)
                    for i, (a, b) in enumerate(zip(got, want)):
                        assert_bits_equal(a, b, f"{where} {kind} {dtype} expand={expand} sync={sync} output {i}")
                    checked += 1
            fp8 = _fp8_inputs(kind, num_ranks, num_nodes, E)
            x, scales, idx, w = fp8[rank]
            bound = max(f[2].shape[0] for f in fp8)
            for expand, sync in ((False, True), (False, False), (True, True), (True, False)):
                want = _fp8_round_trip(flat, x, scales, idx, w, E, expand, sync, bound)
                got = _fp8_round_trip(eb, x, scales, idx, w, E, expand, sync, bound)
                for i, (a, b) in enumerate(zip(got, want)):
                    assert_bits_equal(a, b, f"{where} {kind} fp8 expand={expand} sync={sync} output {i}")
                # reduced: the dispatches' bits; a combine equal for every chunk count and transport, within the
                # reduced and the flat bounds of each other
                got = _fp8_round_trip(ebr, x, scales, idx, w, E, expand, sync, bound)
                for i, (a, b) in enumerate(zip(got, want)):
                    if i != 6:
                        assert_bits_equal(a, b, f"{where} {kind} fp8 reduced expand={expand} sync={sync} output {i}")
                assert_bits_equal(got[6], reduced_out.setdefault((kind, expand, sync), got[6]), f"{where} {kind} fp8 reduced")
                size = _fp8_round_trip(flat, x, scales, idx, w, E, expand, sync, bound, absolute=True)[6].double()
                limit = (error_bound(torch.bfloat16, num_ranks, num_nodes)
                         + error_bound(torch.bfloat16, num_ranks, num_nodes, reduced=False)) * (1 + 2 ** -7) * size
                assert bool(((got[6].double() - want[6].double()).abs() <= limit).all()), f"{where} {kind} fp8"
                checked += 1
            # per-hop counts of an FP8 dispatch: the model's rows of FP8 rows (1 byte per value, fp32 scales)
            rows = exact_hop_rows([f[2] for f in fp8], E, num_nodes)[rank]
            row_bytes = FP8_HIDDEN + 4 * (FP8_HIDDEN // 128) + 12 * TOPK + 16
            for sync in (True, False):
                backend.traffic.reset()
                rx, _, _, h, _ = eb.dispatch((x, scales), idx, w, num_experts=E, do_cpu_sync=sync,
                                             num_max_tokens_per_rank=bound)
                for hop, n in (("scaleout", rows.dispatch_scaleout), ("scaleup", rows.dispatch_scaleup)):
                    count = backend.traffic.get("dispatch", hop)
                    assert (count.rows, count.bytes, count.calls) == (n, n * row_bytes, 1), f"{where} {hop} {count}"
                    if sync:  # exact size: only the rows in use cross, on both hops
                        assert count.wire_bytes == count.bytes, f"{where} {hop} {count}"
                checked += 1
        if chunks >= 3:  # the pipeline's order, and a lower per-call chunk count on the same buffer
            xs, idxs, ws = _inputs("random", num_ranks, num_nodes, E, torch.bfloat16)
            log = _record_order(backend)
            rx, _, _, h, _ = eb.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=E)
            _check_pipeline(log, chunks, f"{where} dispatch")
            log.clear()
            eb.combine(rx, h)
            _check_pipeline(log, chunks, f"{where} combine")
            del backend._post, backend._scaleup
            log = _record_order(ebr.buffer.backend)  # the reduced combine keeps the pipeline's order
            eb_out = ebr.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=E)
            log.clear()
            ebr.combine(eb_out[0], eb_out[3])
            _check_pipeline(log, chunks, f"{where} reduced combine")
            del ebr.buffer.backend._post, ebr.buffer.backend._scaleup
            backend.set_num_chunks(2)
            bound = max(i.shape[0] for i in idxs)
            want = _round_trip(flat, xs[rank], idxs[rank], ws[rank], None, E, True, False, bound)
            got = _round_trip(eb, xs[rank], idxs[rank], ws[rank], None, E, True, False, bound)
            for i, (a, b) in enumerate(zip(got, want)):
                assert_bits_equal(a, b, f"{where} set_num_chunks(2) output {i}")
            checked += 1
        eb.destroy()
        ebr.destroy()
    if num_ranks == 4:
        import torch.distributed as dist

        from ep_moe.tuning import LayerShape
        from ep_moe.tuning.hybrid_model import plan_hybrid

        # no chunk count given: the hybrid model's plan of the call's shape sets it (a tiny shape: one chunk)
        eb = ElasticBuffer(group, num_scaleout_ranks=2, allow_multiple_reduction=False)
        assert not eb.buffer.backend.chunks_fixed and eb.buffer.backend.num_chunks == 4
        xs, idxs, ws = _inputs("random", num_ranks, 2, E, torch.bfloat16)
        bound = max(i.shape[0] for i in idxs)
        eb.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=E, num_max_tokens_per_rank=bound)
        plan = plan_hybrid(LayerShape(E, TOPK, HIDDEN, bound, 2), 2, 2, max_chunks=4, allow_multiple_reduction=False)
        assert eb.buffer.backend.num_chunks == plan.num_chunks == 1, (eb.buffer.backend.num_chunks, plan)
        # a TokenDispatcher on the hybrid buffer plans the same way and equals one on the flat buffer
        from ep_moe import TokenDispatcher

        eb.buffer.backend.set_num_chunks(3)
        hybrid_layer, flat_layer = (TokenDispatcher(b.buffer, num_experts=E, expert_alignment=4) for b in (eb, flat))
        got, want = (layer.dispatch(xs[rank], idxs[rank], ws[rank]) for layer in (hybrid_layer, flat_layer))
        assert eb.buffer.backend.num_chunks == hybrid_layer.plan.num_chunks == 1
        for i, (a, b) in enumerate(zip(got[:3], want[:3])):
            assert_bits_equal(a, b, f"TokenDispatcher output {i}")
        assert_bits_equal(hybrid_layer.combine(got[0] * 2, got[3]), flat_layer.combine(want[0] * 2, want[3]), "TokenDispatcher")
        eb.destroy()
        checked += 1

        try:  # a chunk count that differs between ranks: every rank raises, before any row moves
            ElasticBuffer(group, num_scaleout_ranks=2, num_hybrid_chunks=1 + rank % 2)
        except ValueError as exc:
            assert "num_hybrid_chunks" in str(exc) and "equal on every rank" in str(exc), str(exc)
            checked += 1
        try:  # a combine mode that differs between ranks: likewise
            ElasticBuffer(group, num_scaleout_ranks=2, allow_multiple_reduction=rank % 2 == 0)
        except ValueError as exc:
            assert "allow_multiple_reduction" in str(exc) and "equal on every rank" in str(exc), str(exc)
            checked += 1
        # a peer that never posts chunk 2 of the scale-out hop: the error names the hop and the chunk
        # (the smallest size runs last in `run_world_sizes`: the hop that rank 1 left waiting is never used again)
        eb = ElasticBuffer(group, num_scaleout_ranks=2, num_hybrid_chunks=2, num_gpu_timeout_secs=2)
        if rank != 3:
            send = torch.zeros(2, 4, dtype=torch.uint8)
            try:
                eb.buffer.backend._post("dispatch", "scaleout", send, 2, 1, lambda: 1, None, _Tally(), 1, 2).result()
            except TimeoutError as exc:
                assert rank == 1 and "chunk 2 of 2" in str(exc) and "scale-out hop" in str(exc), str(exc)
                checked += 1
            else:
                assert rank in (0, 2), "rank 1 should have timed out"
        dist.barrier(group)
    flat.destroy()
    return checked


@pytest.fixture(scope="module")
def checked_by_world_size() -> dict[int, list[int]]:
    """`_worker` at 4 and 6 ranks: 6 spawned ranks, 4 on a subgroup of them."""
    return run_world_sizes(_worker, tuple(CONFIGS), join_timeout_s=900)


@pytest.mark.parametrize("num_ranks, configs", list(CONFIGS.items()))
def test_chunked_overlap_scaleup_transports_and_fp8_equal_flat(checked_by_world_size, num_ranks: int,
                                                               configs) -> None:
    per_config = 2 * (4 + 4 + 2)  # kinds x (bf16/fp32 round trips + FP8 round trips + FP8 traffic checks)
    expected = [sum(per_config + (1 if c[1] >= 3 else 0) for c in configs)] * num_ranks
    if num_ranks == 4:
        expected = [e + 3 for e in expected]  # the planned chunk count, the disagreeing chunk counts and modes
        expected[1] += 1                      # the timeout
    assert checked_by_world_size[num_ranks] == expected
