"""Expert-major dispatch with the received rows left in place, and its combine with the rank-major rows formed as
they go out (`ep_moe.buffer.expert_major_ops`, the native backend's paths at EP >= 2; docs/native.md, "Expert-major rows in
the dispatch and combine kernels"), on the CPU:

* `ep_moe.permute.permute_received_rows` (the torch definition: own rows from the input through the send list,
  the others from the receive buffer's rank-major rows) equals `permute_rows_and_values` of the rank-major rows,
  for every rank position, exact and fixed-size layouts, empty own ranges, FP8 bytes; its errors name the argument;
* the whole path through `Buffer.dispatch_result(consume_in_place=...)` and the autograd function, at 2/3/4 gloo
  ranks, with a test double of the backend (`InPlaceTorchBackend`: the torch backend's dispatch, then a "receive
  buffer" whose own-rank rows and rows past the total are garbage, as in the native buffer; its combine of
  expert-major rows forms the rank-major rows from ``sorted_slots`` and the weights by a loop over rows and slots,
  not by ``unpermute_sum``, which the composed path uses), equals the composed path bit for bit: rows, weights, counts, both combine modes, and the gradients of x, of the routing weights, of the
  experts' rows and of their weights;
* a backend that cannot leave rows in place refuses ``consume_in_place`` with a named error.

The CUDA kernel of the same op is checked against this definition on the GPU
(tests/native/test_expert_major_kernels.py), the native dispatch mode at 2-4 processes on one GPU
(tests/native/test_native_shared_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from support.world_sizes import run_world_sizes
from support_core import Case, check, check_bits, make_inputs

from ep_moe import Buffer, ElasticBuffer
from ep_moe.backends.comm_backend import ReceivedRows
from ep_moe.backends.torch_backend import TorchBackend
from ep_moe.buffer.expert_major_ops import expert_cached_dispatch, expert_combine, expert_dispatch
from ep_moe.permute import expert_layout, max_slots, permute_received_rows, permute_rows_and_values

GARBAGE = 0x5A  # byte pattern of rows the in-place path must not read


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _rows_cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``cat`` of two row blocks of one dtype, through their bytes (FP8 included)."""
    return torch.cat([_bytes(a), _bytes(b)]).view(a.dtype)


def _receive_buffer(recv: torch.Tensor, first: int, end: int, total: int, spare: int) -> torch.Tensor:
    """``recv``'s rows as a receive buffer holds them: the own range [first, end) and every row from ``total`` on
    are garbage (never written there), and ``spare`` garbage rows more at the end (the buffer is larger)."""
    raw = torch.cat([_bytes(recv), torch.zeros(spare, recv.shape[1] * recv.element_size(), dtype=torch.uint8)])
    raw[first:end] = GARBAGE
    raw[total:] = GARBAGE
    return raw.view(recv.dtype)


# ------------------------------------------------------------------------------------------ the op, one process
def _send_lists(in_rank: torch.Tensor) -> list[torch.Tensor]:
    """Per destination, its tokens in increasing order, padded to T with 0 (int32): the native send list."""
    T = in_rank.shape[0]
    lists = []
    for r in range(in_rank.shape[1]):
        tokens = in_rank[:, r].nonzero().flatten().to(torch.int32)
        lists.append(torch.cat([tokens, tokens.new_zeros(T - tokens.shape[0])]))
    return lists


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_permute_received_rows_equals_the_rank_major_permute(num_ranks: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_ranks * 17 + dtype.itemsize)
    H, K, L = 32, 3, 4
    tokens = [int(t) for t in torch.randint(0, 9, (num_ranks,), generator=gen)]
    tokens[num_ranks - 1] = 0  # a rank that sends nothing (its own range is empty too)
    counts = torch.randint(0, 6, (num_ranks, num_ranks), generator=gen)
    counts = torch.minimum(counts, torch.tensor(tokens).unsqueeze(1))
    prefix = torch.cumsum(counts, 0).to(torch.int32)
    for rank in range(num_ranks):
        N = int(prefix[-1, rank])
        recv = torch.randn(N, H, generator=gen).to(dtype)
        idx = torch.randint(-1, L + 1, (N, K), generator=gen)  # L and -1: not pairs
        w = torch.rand(N, K, generator=gen)
        T = tokens[rank]
        own_x = torch.randn(T, H, generator=gen).to(dtype)
        first = int(prefix[rank - 1, rank]) if rank else 0
        end = int(prefix[rank, rank])
        in_rank = torch.zeros(T, num_ranks, dtype=torch.bool)
        in_rank[torch.randperm(T, generator=gen)[:end - first], rank] = True
        own_tokens = _send_lists(in_rank)[rank]
        _bytes(recv)[first:end] = _bytes(own_x).index_select(0, own_tokens[:end - first].to(torch.int64))
        for fixed in (0, 3):  # exact, and a fixed size with padding rows and slots past the total
            rows_n = N + fixed
            recv_n = _rows_cat(recv, torch.zeros(fixed, H).to(dtype))
            idx_n = torch.cat([idx, torch.full((fixed, K), -1)])
            w_n = torch.cat([w, torch.zeros(fixed, K)])
            layout = expert_layout(idx_n, L, 4, max_slots(rows_n, K, L, 4) if fixed else None)
            want_rows, want_w = permute_rows_and_values(recv_n, w_n, layout)
            buf = _receive_buffer(recv_n, first, end, N, spare=5)
            got_rows, got_w = permute_received_rows(buf, rows_n, own_x, own_tokens, prefix, rank, layout, w_n)
            where = f"R={num_ranks} rank={rank} {dtype} fixed={fixed}"
            check_bits(got_rows, want_rows, where, "rows")
            check_bits(got_w, want_w, where, "slot weights")
            alone, none = permute_received_rows(buf, rows_n, own_x, own_tokens, prefix, rank, layout)
            check_bits(alone, want_rows, where, "rows without values")
            check(none is None, where, "no slot values without values")


def test_permute_received_rows_errors_name_the_argument() -> None:
    layout = expert_layout(torch.tensor([[0, 1], [1, -1]]), 2)
    rows, own = torch.zeros(4, 8), torch.zeros(1, 8)
    tokens, prefix = torch.zeros(1, dtype=torch.int32), torch.tensor([[1, 1], [1, 2]], dtype=torch.int32)
    cases = [
        ("'rows' and 'own_x'", dict(own_x=torch.zeros(1, 8, dtype=torch.bfloat16))),
        ("'num_rows'", dict(num_rows=3)),
        ("'num_rows'", dict(rows=torch.zeros(1, 8))),
        ("'own_tokens'", dict(own_tokens=torch.zeros(2, dtype=torch.int32))),
        ("'own_tokens'", dict(own_tokens=torch.zeros(1, dtype=torch.int64))),
        ("'rank'", dict(rank=2)),
        ("'values'", dict(values=torch.zeros(2, 3))),
    ]
    for name, change in cases:
        args = dict(rows=rows, num_rows=2, own_x=own, own_tokens=tokens, rank_prefix_matrix=prefix, rank=1,
                    layout=layout, values=None) | change
        with pytest.raises(ValueError, match=name):
            permute_received_rows(**args)


# ------------------------------------------------------------------------------------------ the path, 2-4 ranks
def _rank_major_rows(y: torch.Tensor, weights: torch.Tensor | None, sorted_slots: torch.Tensor) -> torch.Tensor:
    """Row i of the rank-major rows formed from the expert-major rows ``y``, one row and one slot at a time
    (docs/semantics.md, "Expert-major layout", the combine with multiple reduction): from an fp32 zero (fp64 for
    fp64 ``y``), add ``weights[s] * y[s]`` (the product rounded to fp32, then added; ``y[s]`` unweighted without
    weights) for each of the row's slots in the order ``sorted_slots`` lists them (the layout's ``slot_of_pair``:
    top-k order; entries < 0 skipped), then round once to ``y``'s dtype. The order is the stated one, so the
    composed path must equal it bit for bit."""
    acc_dtype = torch.promote_types(y.dtype, torch.float32)
    out = torch.empty(sorted_slots.shape[0], y.shape[1], dtype=y.dtype)
    for i, row in enumerate(sorted_slots.tolist()):
        acc = torch.zeros(y.shape[1], dtype=acc_dtype)
        for s in (s for s in row if s >= 0):
            term = y[s].to(acc_dtype)
            acc = acc + (term if weights is None else weights[s].to(acc_dtype) * term)
        out[i] = acc.to(y.dtype)
    return out


class InPlaceTorchBackend(TorchBackend):
    """Test double: the torch backend's dispatch, then the received rows as the native kernels leave them (the
    peers' rows in a receive buffer whose own-rank rows and rows past the total are garbage; the own rows in x,
    through the send list to this rank), handed to ``consume`` (fresh and cached dispatches); a combine of
    expert-major rows forms the rank-major rows (`_rank_major_rows`, independent of the composed path's
    ``unpermute_sum``) and combines them."""

    name = "torch-in-place"
    expert_row_combines = 0
    cached_in_place = 0  # cached dispatches that left their rows in place

    def receives_in_place(self, row_bytes: int, num_experts: int) -> bool:
        return self.num_ranks > 1

    def combines_expert_rows(self, row_bytes: int) -> bool:
        return self.num_ranks > 1

    def combine(self, y, handle, topk_weights, bias, config=None, *, expert_rows=None):
        if expert_rows is not None:
            sorted_slots, weights = expert_rows
            y = _rank_major_rows(y, weights, sorted_slots)
            self.expert_row_combines += 1
        return super().combine(y, handle, topk_weights, bias, config)

    def dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, handle,
                 num_experts, expert_alignment, num_worst_tokens, config=None, *, consume=None):
        result = super().dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                                  handle, num_experts, expert_alignment, num_worst_tokens, config)
        if consume is None:
            return result
        self.cached_in_place += handle is not None
        me, prefix = self.rank, result.handle.rank_prefix_matrix.to(torch.int32)
        first, end = (int(prefix[me - 1, me]) if me else 0), int(prefix[me, me])
        total, rows = int(prefix[-1, me]), result.recv_x.shape[0]
        received = ReceivedRows(
            _receive_buffer(result.recv_x, first, end, total, spare=3),
            None if x_scales is None else _receive_buffer(result.recv_scales, first, end, total, spare=3),
            rows, x, x_scales, _send_lists(is_token_in_rank)[me], prefix, me)
        result = result._replace(recv_x=None, recv_scales=None)
        return result._replace(consumed=consume(result, received))


def _cases(num_ranks: int) -> list[Case]:
    E = 4 * num_ranks
    tokens = tuple(7 + 3 * s for s in range(num_ranks))
    return [
        Case("random", tokens, 64, 3, E, "random", "bf16", 1),
        Case("random fp32 A128", tokens, 32, 4, E, "random", "fp32", 128),
        Case("one expert A16", tokens, 32, 2, E, "one_expert", "bf16", 16),
        Case("all -1", tokens, 32, 2, E, "all_minus_one", "fp32", 1),
        Case("sparse (empty experts)", tokens, 32, 2, E, "sparse", "bf16", 16),
        Case("empty rank", (0,) + tokens[1:], 32, 2, E, "random", "bf16", 1),
        Case("fp8 pair A16", tokens, 256, 3, E, "random", "fp8", 16),
    ]


def _grads(out, x, w, seed: int):
    """Gradients of x and of the routing weights for fixed random output gradients (None for FP8)."""
    if isinstance(out.expert_x, tuple):
        return None, None
    gen = torch.Generator().manual_seed(seed)
    g_rows = torch.randn(out.expert_x.shape, generator=gen).to(out.expert_x.dtype)
    g_w = torch.randn(out.expert_weights.shape, generator=gen)
    used = [(o, g) for o, g in ((out.expert_x, g_rows), (out.expert_weights, g_w)) if o.requires_grad]
    inputs = [t for t in (x, w) if t.requires_grad]
    grads = iter(torch.autograd.grad([o for o, _ in used], inputs, [g for _, g in used]))
    return tuple(next(grads) if t.requires_grad else None for t in (x, w))


def _compare(in_place: Buffer, plain: Buffer, rank: int, num_ranks: int, case: Case, seed: int, fixed: int) -> None:
    where = f"{case.name} R={rank}/{num_ranks} fixed={fixed}"
    inp = make_inputs(case, num_ranks, seed)
    outs, grads = [], []
    for buffer in (in_place, plain):
        x = inp.x(rank)
        w = inp.weights[rank].clone()
        if not isinstance(x, tuple):  # odd seeds: only the routing weights need a gradient
            x, w = x.clone().requires_grad_(seed % 2 == 0), w.requires_grad_(True)
        out = expert_dispatch(buffer, x, inp.idxs[rank], w, case.experts, case.alignment, num_worst_tokens=fixed)
        outs.append(out)
        grads.append(_grads(out, x, w, seed + rank))
    got, want = outs
    check(got.handle.rows_in_place and not want.handle.rows_in_place, where, "the in-place path taken (only there)")
    for name in ("expert_x", "expert_weights"):
        a, b = getattr(got, name), getattr(want, name)
        if not isinstance(a, tuple):
            check(a.requires_grad == b.requires_grad, where, f"{name}.requires_grad as in the composed path")
    for name, a, b in (("expert_x", got.expert_x, want.expert_x), ("grad x", grads[0][0], grads[1][0]),
                       ("grad w", grads[0][1], grads[1][1])):
        for part_a, part_b in (zip(a, b) if isinstance(a, tuple) else [(a, b)]):
            if part_b is not None:
                check_bits(part_a, part_b, where, name)
    check_bits(got.expert_weights.detach(), want.expert_weights.detach(), where, "expert_weights")
    check(torch.equal(got.tokens_per_expert, want.tokens_per_expert), where, "tokens_per_expert")
    check(torch.equal(got.pairs_per_expert, want.pairs_per_expert), where, "pairs_per_expert")
    check(got.tokens_per_expert_list == want.tokens_per_expert_list, where, "tokens_per_expert_list")
    if isinstance(got.expert_x, tuple):
        return
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(got.expert_x.shape, generator=gen).to(got.expert_x.dtype)
    grad_out = torch.randn(inp.idxs[rank].shape[0], case.hidden, generator=gen).to(y.dtype)
    for multiple in (True, False):
        results = []
        before = in_place.backend.expert_row_combines
        for buffer, out in ((in_place, got), (plain, want)):
            y_in, w_in = y.clone().requires_grad_(True), out.expert_weights.detach().clone().requires_grad_(True)
            combined = expert_combine(buffer, y_in, out.handle, w_in, multiple)
            # gradients with multiple reduction (the path that changed); the other mode's output does not depend
            # on y where a rank received no pair, so its backward is not the same collective on every rank
            results.append((combined, *(torch.autograd.grad(combined, [y_in, w_in], grad_out) if multiple else ())))
        fused = in_place.backend.expert_row_combines - before
        check(fused == (1 if multiple else 0), where, f"rows formed as they go out only with multiple_reduction "
              f"(multiple_reduction={multiple}: {fused} calls)")
        for name, a, b in zip(("combine", "grad y", "grad expert weights"), *results):
            check_bits(a.detach(), b, where, f"{name} multiple_reduction={multiple}")


def _worker(rank: int, num_ranks: int, group) -> int:
    in_place, plain = Buffer(group, backend="torch", timeout_s=60), Buffer(group, backend="torch", timeout_s=60)
    in_place.backend = InPlaceTorchBackend(in_place.group, in_place.device, 60.0)
    checked = 0
    for seed, case in enumerate(_cases(num_ranks), start=1):
        most = max(case.tokens) * num_ranks  # a bound on the rows any rank receives: T = N, or T < N
        for fixed in (0, most + 5 * (seed % 2)):
            _compare(in_place, plain, rank, num_ranks, case, seed, fixed)
            checked += 1
    # bad input on the in-place path: the named errors, raised on every rank before anything is sent
    x, idx, w = torch.zeros(3, 32), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    for args, name in (((x, idx[:, 0], w), "topk_idx"), ((x, idx, w[:, :1]), "topk_weights"),
                       ((x.half(), idx, w), "x")):
        with pytest.raises(ValueError, match=f"'{name}'"):
            expert_dispatch(in_place, *args, 4 * num_ranks, 1)
    with pytest.raises(ValueError, match="'num_worst_tokens'"):
        expert_dispatch(in_place, x, idx, w, 4 * num_ranks, 1, num_worst_tokens=2)
    in_place.destroy()
    plain.destroy()
    return checked


def _all_workers(rank: int, num_ranks: int, group) -> dict:
    """Every multi-rank check of this file at this world size (one spawned job of 4 ranks runs them all)."""
    out = {"in_place": _worker(rank, num_ranks, group)}
    if num_ranks == 2:
        out["refusal"] = _refusal_worker(rank, num_ranks, group)
    if num_ranks <= 3:
        out["cached"] = _cached_worker(rank, num_ranks, group)
    return out


@pytest.fixture(scope="module")
def by_world_size() -> dict[int, list[dict]]:
    """`_all_workers` at 2, 3 and 4 ranks: 4 spawned ranks, the smaller sizes on subgroups of them."""
    return run_world_sizes(_all_workers, (2, 3, 4), join_timeout_s=600)


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_rows_in_place_equal_the_composed_path(by_world_size, num_ranks: int) -> None:
    assert [r["in_place"] for r in by_world_size[num_ranks]] == [2 * len(_cases(num_ranks))] * num_ranks


def _refusal_worker(rank: int, num_ranks: int, group) -> str:
    buffer = Buffer(group, backend="torch", timeout_s=60)
    x, idx, w = torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    assert not buffer.receives_in_place(x, 2)
    try:
        buffer.dispatch_result(x, topk_idx=idx, topk_weights=w, num_experts=2,
                               consume_in_place=lambda result, rows: None)
    except ValueError as exc:
        return str(exc)
    finally:
        buffer.destroy()
    return ""


def test_a_backend_without_rows_in_place_refuses_consume(by_world_size) -> None:
    messages = [r["refusal"] for r in by_world_size[2]]
    assert all("consume_in_place" in m for m in messages), messages


# ------------------------------------------------------------------------------------------ cached dispatches
def _leaves(x, w, grads: bool):
    if isinstance(x, tuple) or not grads:
        return x, w
    return x.clone().requires_grad_(True), w.clone().requires_grad_(True)


def _forward_and_grads(rows, weights, x, w, seed: int) -> list:
    """``[rows (and scales), weights, grad x, grad w]`` for fixed random output gradients (FP8: no gradients)."""
    parts = list(rows) if isinstance(rows, tuple) else [rows]
    out = [t.detach() for t in parts] + [weights.detach()]
    if isinstance(x, tuple):
        return out
    gen = torch.Generator().manual_seed(seed)
    g_rows = torch.randn(rows.shape, generator=gen).to(rows.dtype)
    g_w = torch.randn(weights.shape, generator=gen)
    return out + list(torch.autograd.grad([rows, weights], [x, w], [g_rows, g_w]))


def _cached_equals_fresh(ebs: list[ElasticBuffer], rank: int, num_ranks: int, case: Case, seed: int,
                         fixed: bool) -> None:
    """On both `ElasticBuffer`s (rows in place, composed) and both layouts: the cached dispatch of new rows and
    weights with the handle of a fresh dispatch equals a fresh dispatch of them with the same routing, bit for bit,
    forward and backward; the two buffers agree too, and `expert_cached_dispatch` itself with the expanded handle."""
    inp, inp2 = make_inputs(case, num_ranks, seed), make_inputs(case, num_ranks, seed + 1000)
    idx = inp.idxs[rank]
    bound = max(max(case.tokens), 1)
    sizing = dict(num_max_tokens_per_rank=bound, do_cpu_sync=False) if fixed else {}
    for expand in (False, True):
        where = f"{case.name} R={rank}/{num_ranks} fixed={fixed} expand={expand}"
        per_buffer = []
        for eb in ebs:
            h = eb.dispatch(inp.x(rank), idx, inp.weights[rank], num_experts=case.experts,
                            expert_alignment=case.alignment, do_expand=expand, **sizing)[3]
            before = getattr(eb.buffer.backend, "cached_in_place", 0)
            x, w = _leaves(inp2.x(rank), inp2.weights[rank], True)
            rows, _, weights, same, _ = eb.dispatch(x, topk_weights=w, handle=h)
            check(same is h, where, "the cached dispatch returns its handle")
            cached = _forward_and_grads(rows, weights, x, w, seed + rank)
            if eb is ebs[0]:
                taken = eb.buffer.backend.cached_in_place - before
                check(taken == int(expand), where, f"rows left in place by the expanded cached dispatch: {taken}")
            x, w = _leaves(inp2.x(rank), inp2.weights[rank], True)
            rows, _, weights, _, _ = eb.dispatch(x, idx, w, num_experts=case.experts, expert_alignment=case.alignment,
                                                 do_expand=expand, **sizing)
            fresh = _forward_and_grads(rows, weights, x, w, seed + rank)
            for i, (a, b) in enumerate(zip(cached, fresh, strict=True)):
                check_bits(a, b, where, f"cached vs fresh, output {i}")
            if expand:  # the op itself, without weights
                plain, none = expert_cached_dispatch(eb.buffer, inp2.x(rank), h.inner)
                check(none is None, where, "no weights without topk_weights")
                check_bits(plain[0] if isinstance(plain, tuple) else plain, cached[0], where, "without weights")
            per_buffer.append(cached)
        for i, (a, b) in enumerate(zip(*per_buffer, strict=True)):
            check_bits(a, b, where, f"rows in place vs composed, output {i}")


def _cached_worker(rank: int, num_ranks: int, group) -> int:
    ebs = [ElasticBuffer(group, backend="torch", num_gpu_timeout_secs=60, explicitly_destroy=True) for _ in range(2)]
    ebs[0].buffer.backend = InPlaceTorchBackend(ebs[0].buffer.group, ebs[0].buffer.device, 60.0)
    E = 4 * num_ranks
    tokens = tuple(5 + 2 * s for s in range(num_ranks))
    cases = [Case("random", tokens, 32, 3, E, "random", "bf16", 1),
             Case("random fp32 A16", tokens, 16, 4, E, "random", "fp32", 16),
             Case("one expert (ranks receive nothing)", tokens, 16, 2, E, "one_expert", "bf16", 1),
             Case("all -1", tokens, 16, 2, E, "all_minus_one", "fp32", 4),
             Case("empty rank", (0,) + tokens[1:], 16, 2, E, "random", "bf16", 1),
             Case("fp8 pair", tokens, 128, 2, E, "random", "fp8", 16)]
    checked = 0
    for seed, case in enumerate(cases, start=300):
        for fixed in (False, True):
            _cached_equals_fresh(ebs, rank, num_ranks, case, seed, fixed)
            checked += 1
    for eb in ebs:
        eb.destroy()
    return checked


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_cached_expert_dispatch_equals_the_fresh_one(by_world_size, num_ranks: int) -> None:
    assert [r["cached"] for r in by_world_size[num_ranks]] == [12] * num_ranks
