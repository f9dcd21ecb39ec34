"""Hybrid mode's reduced combine (``allow_multiple_reduction=True``, docs/hybrid.md) on CPU with gloo: 4, 6 and 8
ranks viewed as 2 x 2, 2 x 3 and 4 x 2, compact and expanded layouts, exact and fixed size, chunk counts 1 to 5.

* Bit for bit equal to `reference_combine`, written here from DeepEP V2's order (loops over tokens): inside each
  node the ranks' rows in fp32 by each rank's last top-k position, rounded once; at the source the biases, then
  the node partials by each node's last top-k position, rounded once. On random and adversarial routings (every
  token on one node, entries of a few ranks interleaved, -1 entries, tokens with no expert, a node receiving
  nothing, a rank without tokens) and values (magnitudes 1e-3 to 1e3, cancelling rows).
* The same bits twice and for two chunk counts; within `error_bound` of the float64 sum (the flat combine
  within its own one-rounding bound).
* Gradients (a cached dispatch of the output's gradient) equal the flat buffer's.
* Network bytes of the combine equal the model's node-reduced count (`ep_moe.tuning.hybrid_model.exact_hop_rows`),
  below the unreduced mode's by the model's ratio; the in-node hop's bytes are the unreduced mode's.

Every spawned rank regenerates all ranks' inputs from seeds; one spawned run of 8 ranks holds every case (4 and 6
ranks on subgroups of it)."""

from __future__ import annotations

import pytest
import torch
from support.bits import assert_bits_equal
from support.world_sizes import run_world_sizes

from ep_moe.tuning.hybrid_model import exact_hop_rows, hybrid_row_bytes

HIDDEN, TOPK = 16, 4
# world size -> (nodes, the chunk counts of its two reduced buffers)
VIEWS = {4: (2, (1, 4)), 6: (2, (2, 5)), 8: (4, (3, 1))}
KINDS = ("random", "one_node", "interleaved", "empty_node")


def _routing(kind: str, rank: int, num_ranks: int, num_nodes: int, num_experts: int,
             gen: torch.Generator) -> torch.Tensor:
    """``[T, K]`` expert ids of one rank. ``random``: uniform, 20% -1 entries, token 0 with none;
    ``one_node``: each token's experts on one node (its own choice); ``interleaved``: each token's entries on two
    ranks, alternating (ranks a, b, a, b: every group's last position decides, not its first), token 1 on one rank;
    ``empty_node``: node 0's experts receive nothing and rank 1 has no tokens."""
    tokens = 0 if kind == "empty_node" and rank == 1 else 6 + rank % 3
    L, per_node = num_experts // num_ranks, num_experts // num_nodes
    if kind == "interleaved":
        rows = []
        for t in range(tokens):
            a, b = torch.randperm(num_ranks, generator=gen)[:2].tolist()
            if t == 1:
                b = a
            ea, eb = (r * L + torch.randperm(L, generator=gen)[:2] for r in (a, b))
            rows.append(torch.stack([ea[0], eb[0], ea[1], eb[1]]) if a != b else ea.repeat(2).unique()[:TOPK])
        idx = torch.full((tokens, TOPK), -1, dtype=torch.int64)
        for t, row in enumerate(rows):
            idx[t, :row.numel()] = row
        return idx
    if kind == "one_node":
        nodes = torch.randint(0, num_nodes, (tokens, 1), generator=gen)
        return nodes * per_node + torch.rand(tokens, per_node, generator=gen).argsort(dim=1)[:, :TOPK]
    pool = torch.arange(per_node if kind == "empty_node" else 0, num_experts)
    idx = pool[torch.rand(tokens, pool.numel(), generator=gen).argsort(dim=1)[:, :TOPK]]
    if kind == "random" and tokens:
        idx = idx.masked_fill(torch.rand(tokens, TOPK, generator=gen) < 0.2, -1)
        idx[0] = -1
    return idx


def _inputs(kind: str, num_ranks: int, num_nodes: int, num_experts: int, dtype: torch.dtype):
    """Every rank's ``x``, routing, weights and biases, and the tables the ranks' combine rows come from:
    ``values[r, s, t]`` ``[H]`` (rank r's row of source s's token t; magnitudes 1e-3 to 1e3, and for token 2 of
    every source rows that cancel) and ``row_weights[r, s, t]`` ``[K]`` fp32."""
    gen = torch.Generator().manual_seed(7000 * num_nodes + 31 * num_ranks + len(kind))
    idxs = [_routing(kind, s, num_ranks, num_nodes, num_experts, gen) for s in range(num_ranks)]
    T = max(1, max(i.shape[0] for i in idxs))
    values = torch.randn(num_ranks, num_ranks, T, HIDDEN, generator=gen) * \
        10.0 ** torch.randint(-3, 4, (num_ranks, num_ranks, T, 1), generator=gen)
    if T > 2:  # rank r's row of token 2 is (-1)^r x 1e3 + a small term: the sum cancels in every order but one
        values[:, :, 2] = (1e3 * (-1.0) ** torch.arange(num_ranks))[:, None, None] + values[:, :, 2] * 1e-3
    values = values.to(dtype)
    row_weights = torch.rand(num_ranks, num_ranks, T, TOPK, generator=gen) * \
        10.0 ** torch.randint(-3, 4, (num_ranks, num_ranks, T, 1), generator=gen)
    xs = [torch.randn(i.shape[0], HIDDEN, generator=gen).to(dtype) for i in idxs]
    ws = [torch.rand(i.shape[0], TOPK, generator=gen) for i in idxs]
    biases = [(torch.randn(i.shape[0], HIDDEN, generator=gen) * 10).to(dtype) for i in idxs]
    return xs, idxs, ws, biases, values, row_weights


def reference_combine(topk_idx: torch.Tensor, rows, width: int, num_experts: int, num_ranks: int, num_nodes: int,
                      dtype: torch.dtype, bias: tuple = (), accumulate: torch.dtype = torch.float32) -> torch.Tensor:
    """DeepEP V2's hybrid combine of one source's tokens, token by token: ``rows(r, t)`` is rank r's ``[C]`` row
    of token t (in ``dtype``, ``C = width``); inside each node the rows in ``accumulate`` by each rank's last position in the
    top-k list, rounded to ``dtype``; then from the biases' sum (``bias``: 0 to 2 ``[T, C]`` tensors) the node
    partials by each node's last position, rounded to ``dtype``. ``[T, C]``."""
    per_rank, per_node = num_experts // num_ranks, num_ranks // num_nodes
    out = []
    for t in range(topk_idx.shape[0]):
        rank_last: dict[int, int] = {}
        for k, e in enumerate(topk_idx[t].tolist()):
            if e >= 0:
                rank_last[e // per_rank] = k
        node_last: dict[int, int] = {}
        for r, k in rank_last.items():
            node_last[r // per_node] = max(node_last.get(r // per_node, -1), k)
        acc = None
        for b in bias:
            acc = b[t].to(accumulate) if acc is None else acc + b[t].to(accumulate)
        for n in sorted(node_last, key=node_last.get):
            partial = None
            for r in sorted((r for r in rank_last if r // per_node == n), key=rank_last.get):
                term = rows(r, t).to(accumulate)
                partial = term if partial is None else partial + term
            term = partial.to(dtype).to(accumulate)
            acc = term if acc is None else acc + term
        out.append((torch.zeros(width, dtype=accumulate) if acc is None else acc).to(dtype))
    return torch.stack(out) if out else torch.zeros(0, width, dtype=dtype)


def error_bound(dtype: torch.dtype, num_ranks: int, num_nodes: int, reduced: bool = True) -> float:
    """The bound docs/hybrid.md states, as a factor of ``A = |bias[0]| + |bias[1]| + sum_r |row_r|``: the reduced
    combine is within ``(2u + (R + S + 2) v)(1 + 2u) A`` of the exact sum (``u`` the unit roundoff of ``dtype``,
    ``v`` fp32's), the flat one within ``(u + (R + 2) v)(1 + 2u) A``."""
    u, v = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[dtype], 2.0 ** -24
    return ((2 * u + (num_ranks + num_nodes + 2) * v) if reduced else (u + (num_ranks + 2) * v)) * (1 + 2 * u)


def _combine_rows(eb, rank, x, idx, w, bias, E, values, row_weights, expand: bool, sync: bool, bound: int):
    """One dispatch and the combine of rows taken from the tables (compact: received row of (s, t) is
    ``values[rank, s, t]`` with weights ``row_weights[rank, s, t]``; expanded: the row of the first local pair of
    (s, t) is ``values[rank, s, t]``, its other pairs' rows are 0, weighted by the routing weights, the pairs'
    weights carried back). The tables on the buffer's device. Returns ``(combined, combined_weights)``."""
    rx, _, rw, h, _ = eb.dispatch(x, idx, w, num_experts=E, do_expand=expand, do_cpu_sync=sync,
                                  num_max_tokens_per_rank=bound)
    # each received row's source (V2's metadata: src_rank * bound + t; -1 past the received rows), which one
    # rank's expanded dispatch has too (it has no rank-major dispatch to read it from)
    source = h.recv_src_metadata[:, 0].long()
    valid = source >= 0
    src, tok = torch.where(valid, source // bound, -1), torch.where(valid, source % bound, -1)
    rows = torch.where(valid[:, None], values[rank, src.clamp(min=0), tok.clamp(min=0)], 0)
    if not expand:
        wts = torch.where(valid[:, None], row_weights[rank, src.clamp(min=0), tok.clamp(min=0)], 0.0)
        out, out_w, _ = eb.combine(rows, h, topk_weights=wts, bias=bias)
        return out, out_w
    slots = h.recv_src_metadata[:, 2:].long()  # [N, K]: each received row's expanded row per k (-1: none)
    first = torch.where(slots >= 0, torch.arange(TOPK, device=slots.device), TOPK).argmin(dim=1)
    first_slot = slots.gather(1, first[:, None])[:, 0]
    y = torch.zeros(rx.shape[0] + 1, rx.shape[1], dtype=rx.dtype, device=rx.device)  # row M: the spare
    y.index_copy_(0, torch.where(valid & (first_slot >= 0), first_slot, rx.shape[0]), rows)  # no host read
    y = y[:rx.shape[0]]
    out, out_w, _ = eb.combine(y, h, topk_weights=rw, bias=bias, expert_weights=rw)
    return out, out_w


def _expected(rank, idxs, ws, bias, E, R, S, values, row_weights, expand: bool, dtype):
    """`reference_combine` of this rank's tokens for `_combine_rows`' rows, and the terms' float64 sum and
    absolute sum (the bound's ``A``)."""
    idx, L = idxs[rank], E // R
    if expand:  # rank r's row: its first local pair's row times that pair's weight (fp32), rounded to dtype
        def row(r, t):
            k = next(k for k, e in enumerate(idx[t].tolist()) if e >= 0 and e // L == r)
            return (ws[rank][t, k] * values[r, rank, t].float()).to(dtype)
        weights = torch.where(idx >= 0, ws[rank], 0.0)
    else:
        def row(r, t):
            return values[r, rank, t]
        weights = reference_combine(idx, lambda r, t: row_weights[r, rank, t], TOPK, E, R, S, torch.float32)
    want = reference_combine(idx, row, HIDDEN, E, R, S, values.dtype, bias)
    exact = torch.zeros(idx.shape[0], HIDDEN, dtype=torch.float64)
    size = torch.zeros_like(exact)
    for b in bias:
        exact += b.double()
        size += b.double().abs()
    for t in range(idx.shape[0]):
        for r in sorted({e // L for e in idx[t].tolist() if e >= 0}):
            exact[t] += row(r, t).double()
            size[t] += row(r, t).double().abs()
    return want, weights, exact, size


def _worker(rank: int, num_ranks: int, group) -> int:
    from ep_moe import ElasticBuffer

    num_nodes, chunk_counts = VIEWS[num_ranks]
    E, R, S = 4 * num_ranks, num_ranks, num_nodes
    flat = ElasticBuffer(group, allow_hybrid_mode=False)
    reduced = [ElasticBuffer(group, num_scaleout_ranks=S, num_hybrid_chunks=c) for c in chunk_counts]
    unreduced = ElasticBuffer(group, num_scaleout_ranks=S, num_hybrid_chunks=2, allow_multiple_reduction=False)
    for eb, c in zip(reduced, chunk_counts):
        assert eb.buffer.backend_name == "hybrid" and eb.buffer.backend.allow_multiple_reduction
        assert eb.buffer.backend.num_chunks == c
    assert not unreduced.buffer.backend.allow_multiple_reduction
    checked = 0
    for kind in KINDS:
        for dtype in (torch.bfloat16, torch.float32) if kind == "random" else (torch.bfloat16,):
            xs, idxs, ws, biases, values, row_weights = _inputs(kind, R, S, E, dtype)
            x, idx, w = xs[rank], idxs[rank], ws[rank]
            bound = max(i.shape[0] for i in idxs)
            bias = (biases[rank], xs[rank]) if kind == "random" else biases[rank]
            bias_list = bias if isinstance(bias, tuple) else (bias,)
            for expand in (False, True):
                want, want_w, exact, size = _expected(rank, idxs, ws, bias_list, E, R, S, values, row_weights,
                                                      expand, dtype)
                for sync in (True, False):
                    where = f"{S}x{R // S} {kind} {dtype} expand={expand} sync={sync}"
                    runs = [_combine_rows(eb, rank, x, idx, w, bias, E, values, row_weights, expand, sync, bound)
                            for eb in (reduced[0], reduced[0], reduced[1])]
                    for i, (out, out_w) in enumerate(runs):  # twice on one buffer, then another chunk count
                        assert_bits_equal(out, want, f"{where} run {i}: combined vs the reference")
                        assert_bits_equal(out_w, want_w, f"{where} run {i}: combined weights vs the reference")
                    err = (runs[0][0].double() - exact).abs()
                    assert bool((err <= error_bound(dtype, R, S) * size).all()), \
                        f"{where}: {float((err / size.clamp(min=1e-30)).max())} x A past the bound"
                    out_flat = _combine_rows(flat, rank, x, idx, w, bias, E, values, row_weights, expand, sync,
                                             bound)[0]
                    err = (out_flat.double() - exact).abs()
                    assert bool((err <= error_bound(dtype, R, S, reduced=False) * size).all()), where
                    checked += 1
        if kind == "interleaved":
            continue
        # gradients of the combine's inputs: its backward is a cached dispatch of the output's gradients (and the
        # biases get the output's), the flat buffer's bits
        xs, idxs, ws, biases, _, _ = _inputs(kind, R, S, E, torch.bfloat16)
        bound = max(i.shape[0] for i in idxs)
        gen = torch.Generator().manual_seed(rank)
        grad = torch.randn(xs[rank].shape, generator=gen).to(torch.bfloat16)
        grad_w = torch.randn(xs[rank].shape[0], TOPK, generator=gen)
        for expand in (False, True):
            got = []
            for eb in (reduced[1], flat):
                rx, _, rw, h, _ = eb.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=E, do_expand=expand,
                                              num_max_tokens_per_rank=bound)
                y = (rx * 3 - 1).requires_grad_(True)
                rw = rw.clone().requires_grad_(True)
                b = biases[rank].clone().requires_grad_(True)
                if expand:
                    out, out_w, _ = eb.combine(y, h, expert_weights=rw, bias=b)
                    out.backward(grad)
                else:
                    out, out_w, _ = eb.combine(y, h, topk_weights=rw, bias=b)
                    torch.autograd.backward([out, out_w], [grad, grad_w])
                got.append((y.grad, rw.grad, b.grad))
            for i in range(3):
                assert_bits_equal(got[0][i], got[1][i], f"{S}x{R // S} {kind} expand={expand} gradient {i}")
            checked += 1
        # network bytes: one dispatch + combine on each mode, against the model's exact counts
        rows = exact_hop_rows(idxs, E, S)[rank]
        size = hybrid_row_bytes(HIDDEN, 2, TOPK)["combine"]
        counts = {}
        for eb in (reduced[0], unreduced):
            for sync in (True, False):
                eb.buffer.backend.traffic.reset()
                rx, _, _, h, _ = eb.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=E, do_cpu_sync=sync,
                                             num_max_tokens_per_rank=bound)
                eb.combine(rx, h)
                out_count = eb.buffer.backend.traffic.get("combine", "scaleout")
                up_count = eb.buffer.backend.traffic.get("combine", "scaleup")
                n = rows.combine_scaleout_node_reduced if eb is reduced[0] else rows.combine_scaleout
                where = f"{S}x{R // S} {kind} reduced={eb is reduced[0]} sync={sync}"
                assert (out_count.rows, out_count.bytes, out_count.calls) == (n, n * size, 1), \
                    f"{where}: counted {out_count}, model {n} rows of {size} B"
                assert (up_count.rows, up_count.bytes) == (rows.combine_scaleup, rows.combine_scaleup * size), \
                    f"{where}: {up_count}"
                if sync:  # exact size: only the rows in use cross the network
                    assert out_count.wire_bytes == out_count.bytes, f"{where}: {out_count}"
                counts[eb is reduced[0], sync] = out_count.bytes
        for sync in (True, False):  # the model's ratio (the exact counts' ratio: 1 where nothing crosses)
            assert counts[True, sync] * max(rows.combine_scaleout, 1) == \
                counts[False, sync] * rows.combine_scaleout_node_reduced, counts
            assert counts[True, sync] <= counts[False, sync]
        checked += 1
    for eb in reduced + [unreduced, flat]:
        eb.destroy()
    return checked


@pytest.fixture(scope="module")
def checked_by_world_size() -> dict[int, list[int]]:
    """`_worker` at 4, 6 and 8 ranks: 8 spawned ranks, 4 and 6 on subgroups of them."""
    return run_world_sizes(_worker, tuple(VIEWS), join_timeout_s=900)


@pytest.mark.parametrize("num_ranks", list(VIEWS))
def test_reduced_combine_is_v2s_order_deterministic_and_bounded(checked_by_world_size, num_ranks: int) -> None:
    per_rank = (len(KINDS) + 1) * 2 * 2 + (len(KINDS) - 1) * (2 + 1)  # round trips; gradients and traffic
    assert checked_by_world_size[num_ranks] == [per_rank] * num_ranks


def test_reference_combine_follows_v2s_order() -> None:
    """The reference itself, on one token by hand: 2 nodes x 2 ranks, experts = ranks; top-k ``[2, 0, 3, 1]``
    (rank last positions 2:0, 0:1, 3:2, 1:3; node 1 last at 2, node 0 at 3): node 1's partial ``r2 + r3``, then
    node 0's ``r0 + r1``, after the bias; each partial rounded to bf16."""
    rows = {0: torch.tensor([1.0]), 1: torch.tensor([2.0 ** -9]), 2: torch.tensor([256.0]), 3: torch.tensor([1.0])}
    got = reference_combine(torch.tensor([[2, 0, 3, 1]]), lambda r, t: rows[r].to(torch.bfloat16), 1, 4, 4, 2,
                            torch.bfloat16, (torch.tensor([[-256.0]], dtype=torch.bfloat16),))
    # node 1: 256 + 1 = 257 -> bf16 256; node 0: 1 + 2^-9 -> bf16 1; then -256 + 256 + 1 = 1
    assert got.tolist() == [[1.0]]
    flat = ((torch.tensor(-256.0) + 1 + 2.0 ** -9 + 256 + 1).to(torch.bfloat16)).item()
    assert flat == 2.0  # the flat order rounds once: another result, inside the bound


def test_one_rank_view_runs_the_reduced_combine(solo_group) -> None:
    """The 1 x 1 view (what one GPU runs in tests/hybrid/test_hybrid_gpu.py) on one gloo rank, reduced mode:
    compact and expanded (whose one-rank dispatch has no rank-major dispatch), exact and fixed size, against the
    reference."""
    from ep_moe import ElasticBuffer
    from ep_moe.backends.hybrid import HybridBackend, LogicalTopology

    eb = ElasticBuffer(solo_group, allow_hybrid_mode=False, allow_multiple_reduction=True)
    eb.buffer.backend = HybridBackend(solo_group, torch.device("cpu"), 10.0, LogicalTopology.blocks(1, 1),
                                      num_chunks=2, allow_multiple_reduction=True)
    E = 4
    for dtype in (torch.bfloat16, torch.float32):
        xs, idxs, ws, biases, values, row_weights = _inputs("random", 1, 1, E, dtype)
        bound = max(1, xs[0].shape[0])
        for expand in (False, True):
            want, want_w, _, _ = _expected(0, idxs, ws, (biases[0],), E, 1, 1, values, row_weights, expand, dtype)
            for sync in (True, False):
                out, out_w = _combine_rows(eb, 0, xs[0], idxs[0], ws[0], biases[0], E, values, row_weights, expand,
                                           sync, bound)
                where = f"1x1 {dtype} expand={expand} sync={sync}"
                assert_bits_equal(out, want, f"{where}: combined vs the reference")
                assert_bits_equal(out_w, want_w, f"{where}: combined weights vs the reference")
    eb.destroy()
