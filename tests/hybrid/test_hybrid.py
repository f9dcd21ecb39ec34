"""Hybrid mode (`ep_moe.backends.hybrid`, docs/hybrid.md) on CPU with gloo: 4, 6 and 8 ranks viewed as 2 x 2, 2 x 3, 2 x 4
and 4 x 2 give, with ``allow_multiple_reduction=False`` (the combine unreduced in the node), the flat path's outputs
bit for bit (compact and expanded layouts, exact and fixed size, cached dispatch, combine with weights and bias,
gradients) on random and adversarial routings (every token to one node,
a node receiving nothing, a rank without tokens); the bytes each hop carries, counted by the backend, equal the
model's exact count (`ep_moe.tuning.hybrid_model.exact_hop_rows`; its expectation: tests/tuning/test_hybrid_model.py).
The reduced combine (the default): tests/hybrid/test_hybrid_reduced.py.

Every spawned rank regenerates all ranks' inputs from seeds. One spawned run of 8 ranks holds every case (4 and 6
ranks on subgroups of it)."""

from __future__ import annotations

import socket

import pytest
import torch
from support.bits import assert_bits_equal
from support.world_sizes import run_world_sizes

from ep_moe.backends.hybrid import ENV_SCALEOUT_RANKS, LogicalTopology, logical_topology
from ep_moe.tuning.hybrid_model import exact_hop_rows, hybrid_row_bytes

HIDDEN, TOPK = 16, 3


def _routing(kind: str, rank: int, num_ranks: int, num_nodes: int, num_experts: int, gen: torch.Generator):
    """``[T, K]`` expert ids of one rank: ``random`` (some -1 entries, a token with none), ``one_node`` (every
    token to the last node's experts only), ``empty_node`` (node 0's experts receive nothing); rank 1 has no
    tokens in ``empty_node``."""
    tokens = 0 if kind == "empty_node" and rank == 1 else 5 + rank % 3
    per_node = num_experts // num_nodes
    pool = {"random": torch.arange(num_experts), "one_node": torch.arange(num_experts - per_node, num_experts),
            "empty_node": torch.arange(per_node, num_experts)}[kind]
    idx = pool[torch.rand(tokens, pool.numel(), generator=gen).argsort(dim=1)[:, :TOPK]]
    if kind == "random" and tokens:
        idx = idx.masked_fill(torch.rand(tokens, TOPK, generator=gen) < 0.2, -1)
        idx[0] = -1
    return idx


def _inputs(kind: str, num_ranks: int, num_nodes: int, num_experts: int, dtype: torch.dtype):
    xs, idxs, ws = [], [], []
    for s in range(num_ranks):
        gen = torch.Generator().manual_seed(1000 * num_nodes + 17 * s + len(kind))
        idx = _routing(kind, s, num_ranks, num_nodes, num_experts, gen)
        T = idx.shape[0]
        # magnitudes 1e-3 .. 1e3: a sum in another order shows in the bits
        xs.append((torch.randn(T, HIDDEN, generator=gen) * 10.0 ** torch.randint(-3, 4, (T, 1), generator=gen))
                  .to(dtype))
        idxs.append(idx)
        ws.append(torch.rand(T, TOPK, generator=gen))
    return xs, idxs, ws


def _round_trip(eb, x, idx, w, bias, E: int, expand: bool, sync: bool, bound: int):
    """Dispatch, an expert stand-in, combine (with weights), a cached dispatch, and the gradients of x and w."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    rx, ri, rw, h, _ = eb.dispatch(x, idx, w, num_experts=E, do_expand=expand, do_cpu_sync=sync,
                                   num_max_tokens_per_rank=bound)
    y = rx * 3 - 1
    if expand:
        out, out_w, _ = eb.combine(y, h, expert_weights=rw)
    else:
        out, out_w, _ = eb.combine(y, h, topk_weights=rw, bias=bias)
    out.float().pow(2).sum().backward()
    cached, _, cached_w, _, _ = eb.dispatch(x.detach() * 2, topk_weights=w.detach(), handle=h)
    return [rx, ri, rw, out, out_w, cached, cached_w, x.grad, w.grad, h.psum_num_recv_tokens_per_expert,
            torch.tensor(h.num_recv_tokens_per_expert_list, dtype=torch.int64)]


# world size -> its views (numbers of logical nodes)
VIEWS = {4: [2, 4], 6: [2], 8: [2, 4]}


def _worker(rank: int, num_ranks: int, group) -> int:
    from ep_moe import ElasticBuffer

    views = VIEWS[num_ranks]
    E = 4 * num_ranks  # every node holds >= TOPK experts (the one-node routing picks TOPK of them)
    flat = ElasticBuffer(group, allow_hybrid_mode=False, allow_multiple_reduction=False)
    assert flat.get_logical_domain_size() == (1, num_ranks) and flat.buffer.backend_name == "torch"
    assert flat.get_physical_domain_size() == (1, num_ranks)  # one host
    checked = 0
    for num_nodes in views:
        per_node = num_ranks // num_nodes
        eb = ElasticBuffer(group, num_scaleout_ranks=num_nodes, allow_multiple_reduction=False)
        assert eb.buffer.backend_name == "hybrid" and not eb.buffer.backend.allow_multiple_reduction
        assert eb.get_logical_domain_size() == (num_nodes, per_node)
        assert (eb.scaleout_rank_idx, eb.scaleup_rank_idx) == divmod(rank, per_node)
        traffic = eb.buffer.backend.traffic
        for kind in ("random", "one_node", "empty_node"):
            # fp32 (where another summation order shows in the bits; bf16 sums of few rows are often exact) on the
            # random routing only, to keep the 8-rank run short on a small CPU
            for dtype in (torch.bfloat16, torch.float32) if kind == "random" else (torch.bfloat16,):
                xs, idxs, ws = _inputs(kind, num_ranks, num_nodes, E, dtype)
                x, idx, w = xs[rank], idxs[rank], ws[rank]
                bias = torch.randn(x.shape[0], HIDDEN).to(dtype)
                bound = max(i.shape[0] for i in idxs)
                where = f"{num_nodes}x{per_node} {kind} {dtype}"
                for expand in (False, True):
                    for sync in (True, False):
                        if dtype == torch.float32 and expand != sync:
                            continue  # fp32 (where a different summation order shows): two of the modes
                        want = _round_trip(flat, x, idx, w, bias, E, expand, sync, bound)
                        traffic.reset()
                        got = _round_trip(eb, x, idx, w, bias, E, expand, sync, bound)
                        for i, (a, b) in enumerate(zip(got, want)):
                            assert_bits_equal(a, b, f"{where} expand={expand} sync={sync} output {i}")
                        checked += 1
                if dtype != torch.bfloat16:
                    continue
                # per-hop bytes: the counters of one plain dispatch + combine equal the model's exact counts
                rows = exact_hop_rows(idxs, E, num_nodes)[rank]
                size = hybrid_row_bytes(HIDDEN, x.element_size(), TOPK)
                for sync in (True, False):
                    traffic.reset()
                    rx, _, _, h, _ = eb.dispatch(x, idx, w, num_experts=E, do_cpu_sync=sync,
                                                 num_max_tokens_per_rank=bound)
                    eb.combine(rx, h)
                    eb.dispatch(x, handle=h)
                    for op, hop, n, row_bytes in (("dispatch", "scaleout", rows.dispatch_scaleout, size["dispatch"]),
                                                  ("dispatch", "scaleup", rows.dispatch_scaleup, size["dispatch"]),
                                                  ("cached_dispatch", "scaleout", rows.dispatch_scaleout,
                                                   size["cached_dispatch"]),
                                                  ("cached_dispatch", "scaleup", rows.dispatch_scaleup,
                                                   size["cached_dispatch"]),
                                                  ("combine", "scaleup", rows.combine_scaleup, size["combine"]),
                                                  ("combine", "scaleout", rows.combine_scaleout, size["combine"])):
                        count = traffic.get(op, hop)
                        assert (count.rows, count.bytes, count.calls) == (n, n * row_bytes, 1), \
                            f"{where} sync={sync} {op}/{hop}: counted {count}, model {n} rows of {row_bytes} B"
                        if sync and hop == "scaleout":  # exact size: only the rows in use cross the network
                            assert count.wire_bytes == count.bytes, f"{where} {op}/{hop}: {count}"
                    checked += 1
        eb.destroy()
    flat.destroy()
    if num_ranks == 4:  # a peer that never arrives: the error names the hop (rank 3 skips its scale-out hop)
        import torch.distributed as dist

        # (the smallest size runs last in `run_world_sizes`: the hop that rank 1 left waiting is never used again)
        eb = ElasticBuffer(group, num_scaleout_ranks=2, num_gpu_timeout_secs=2, allow_multiple_reduction=False)
        if rank != 3:
            try:
                eb.buffer.backend._hop("dispatch", "scaleout", torch.zeros(2, 4, dtype=torch.uint8), 2, 1, lambda: 1)
            except TimeoutError as exc:
                assert rank == 1 and "rank 1 of 4" in str(exc) and "scale-out hop" in str(exc), str(exc)
                checked += 1
            else:
                assert rank in (0, 2), "rank 1 should have timed out"  # ranks 0 and 2 form the other subgroup
        dist.barrier(group)
    return checked


@pytest.fixture(scope="module")
def checked_by_world_size() -> dict[int, list[int]]:
    """`_worker` at 4, 6 and 8 ranks: 8 spawned ranks, 4 and 6 on subgroups of them."""
    return run_world_sizes(_worker, tuple(VIEWS), join_timeout_s=900)


@pytest.mark.parametrize("num_ranks, views", list(VIEWS.items()))
def test_hybrid_equals_flat_and_counts_match_the_model(checked_by_world_size, num_ranks: int,
                                                       views: list[int]) -> None:
    per_view = 3 * (4 + 2) + 2  # kinds x (bf16 modes + traffic checks of both modes) + random's fp32 modes
    expected = [per_view * len(views)] * num_ranks
    if num_ranks == 4:
        expected[1] += 1  # the timeout check
    assert checked_by_world_size[num_ranks] == expected


def test_one_rank_hybrid_backend_equals_flat(solo_group) -> None:
    """The 1 x 1 view (both hops local: what one GPU runs in tests/hybrid/test_hybrid_gpu.py) on one gloo rank,
    unreduced (the flat bits)."""
    from ep_moe import ElasticBuffer
    from ep_moe.backends.hybrid import HybridBackend

    flat = ElasticBuffer(solo_group, allow_hybrid_mode=False, allow_multiple_reduction=False)
    hyb = ElasticBuffer(solo_group, allow_hybrid_mode=False, allow_multiple_reduction=False)
    hyb.buffer.backend = HybridBackend(solo_group, torch.device("cpu"), 10.0, LogicalTopology.blocks(1, 1),
                                       allow_multiple_reduction=False)
    xs, idxs, ws = _inputs("random", 1, 1, 4, torch.float32)
    bias = torch.randn(xs[0].shape[0], HIDDEN)
    for expand in (False, True):
        for sync in (True, False):
            want = _round_trip(flat, xs[0], idxs[0], ws[0], bias, 4, expand, sync, xs[0].shape[0])
            got = _round_trip(hyb, xs[0], idxs[0], ws[0], bias, 4, expand, sync, xs[0].shape[0])
            for i, (a, b) in enumerate(zip(got, want)):
                assert_bits_equal(a, b, f"1x1 expand={expand} sync={sync} output {i}")
    hyb.destroy()
    flat.destroy()
    with pytest.raises(ValueError, match="argument 'num_scaleout_ranks'"):
        ElasticBuffer(solo_group, num_scaleout_ranks=2)  # 2 does not divide 1 rank: refused before anything is made


def _uneven_groups_worker(rank: int, world_size: int) -> int:
    """Ranks 0 and 1 join a group that ranks 2 and 3 do not (as after a framework's groups), so the ranks hold
    different numbers of process groups; the hybrid buffer's hop groups must still meet (not wait until the
    timeout) and give the flat path's results."""
    import torch.distributed as dist

    from ep_moe import ElasticBuffer

    dist.new_group([0, 1])  # collective over the world; only ranks 0 and 1 hold it
    held = torch.tensor([len(dist.distributed_c10d._world.pg_names)])
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(counts, held)
    assert len({int(c) for c in counts}) > 1, f"the ranks should hold different numbers of groups: {counts}"
    E = 4 * world_size
    flat = ElasticBuffer(allow_hybrid_mode=False, allow_multiple_reduction=False)
    eb = ElasticBuffer(num_scaleout_ranks=2, num_gpu_timeout_secs=30, allow_multiple_reduction=False)
    assert eb.buffer.backend_name == "hybrid"
    xs, idxs, ws = _inputs("random", world_size, 2, E, torch.float32)
    bias = torch.randn(xs[rank].shape[0], HIDDEN)
    bound = max(i.shape[0] for i in idxs)
    want = _round_trip(flat, xs[rank], idxs[rank], ws[rank], bias, E, False, True, bound)
    got = _round_trip(eb, xs[rank], idxs[rank], ws[rank], bias, E, False, True, bound)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bits_equal(a, b, f"uneven groups, output {i}")
    eb.destroy()
    flat.destroy()
    return 1


def test_hybrid_buffer_with_ranks_holding_different_numbers_of_groups() -> None:
    """4 ranks viewed as 2 x 2, where ranks 0 and 1 made one process group more than ranks 2 and 3 (torch names a
    locally made group by its ranks and the number of groups its maker holds): the buffer is built and equals
    flat."""
    from ep_moe.distributed import run_distributed

    assert run_distributed(_uneven_groups_worker, 4, timeout_s=60.0, join_timeout_s=300.0) == [1, 1, 1, 1]


# ------------------------------------------------------------------------------------------ topology
def test_topology_views() -> None:
    t = LogicalTopology.blocks(8, 2)
    assert (t.num_scaleout_ranks, t.num_scaleup_ranks, t.is_hybrid) == (2, 4, True)
    assert t.scaleout_members(1) == [1, 5] and t.scaleup_members(1) == [4, 5, 6, 7] and t.rank_at(1, 2) == 6
    flat = LogicalTopology.flat(6)
    assert (flat.num_scaleout_ranks, flat.num_scaleup_ranks, flat.is_hybrid) == (1, 6, False)
    hosts = LogicalTopology.from_hosts(["a", "b", "b", "a"])  # ranks of a host need not be consecutive
    assert hosts.node_of == (0, 1, 1, 0) and hosts.local_of == (0, 0, 1, 1) and hosts.scaleout_members(1) == [3, 2]
    assert LogicalTopology.from_hosts(["a", "a", "b"]).num_scaleout_ranks == 1  # unequal hosts: flat
    assert LogicalTopology.from_hosts([socket.gethostname()] * 3).source == "flat"
    with pytest.raises(ValueError, match="argument 'num_scaleout_ranks'"):
        LogicalTopology.blocks(6, 4)
    with pytest.raises(ValueError, match="S x G grid"):
        LogicalTopology((0, 0, 1), (0, 1, 0))


def test_topology_overrides(monkeypatch) -> None:
    physical = LogicalTopology.flat(8)
    monkeypatch.setenv(ENV_SCALEOUT_RANKS, "4")
    assert logical_topology(physical, 8).num_scaleout_ranks == 4
    assert logical_topology(physical, 8, num_scaleout_ranks=2).num_scaleout_ranks == 2  # the argument wins
    assert logical_topology(physical, 8, allow_hybrid_mode=False).num_scaleout_ranks == 1
    monkeypatch.setenv(ENV_SCALEOUT_RANKS, "x")
    with pytest.raises(ValueError, match=ENV_SCALEOUT_RANKS):
        logical_topology(physical, 8)
    monkeypatch.delenv(ENV_SCALEOUT_RANKS)
    assert logical_topology(physical, 8) is physical
