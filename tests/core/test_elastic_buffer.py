"""`ep_moe.ElasticBuffer` (DeepEP V2's buffer API) against the loop reference (`ep_moe.reference`), bit for bit, at 1
to 4 gloo ranks: the compact layout (`reference_dispatch` / `reference_combine`) and the expanded one
(`reference_expert_dispatch` / `reference_expert_combine`), each exact (``do_cpu_sync=True``) and fixed size
(``do_cpu_sync=False``: the exact result plus padding), fresh and cached (``handle=``); the handle's fields; the
gradients against `ep_moe.buffer.autograd_ops` / `ep_moe.buffer.expert_major_ops` called directly; the errors and the lifecycle
(docs/semantics.md, "ElasticBuffer")."""

from __future__ import annotations

import gc

import pytest
import torch
from support.world_sizes import run_world_sizes
from support_core import Case, check, check_bits, check_equal, make_inputs

from ep_moe import Buffer, ElasticBuffer, EventOverlap
from ep_moe.buffer import autograd_ops as ops
from ep_moe.buffer.buffer_v1 import buffer_by_id
from ep_moe.buffer.expert_major_ops import expert_combine, expert_dispatch
from ep_moe.permute import max_slots
from ep_moe.reference import (
    reference_combine,
    reference_dispatch,
    reference_expert_combine,
    reference_expert_dispatch,
)


def _cases(num_ranks: int) -> list[Case]:
    E = 4 * num_ranks
    tokens = tuple(9 + 4 * s for s in range(num_ranks))
    return [
        Case("random", tokens, 256, 3, E, "random", "bf16", 1),
        Case("random fp32 A16", tokens, 128, 4, E, "random", "fp32", 16),
        Case("one rank", tokens, 128, 3, E, "one_rank", "bf16", 1),
        Case("empty rank, sparse", (0,) + tokens[1:], 128, 2, E, "sparse", "fp32", 4),
    ]


def _rows(num_rows: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows of very different magnitudes (a wrong summation order shows)."""
    return (torch.randn(num_rows, hidden, generator=gen)
            * 10.0 ** torch.randint(-3, 4, (num_rows, 1), generator=gen)).to(dtype)


def _psum_expand(aligned: list[int], unaligned: list[int]) -> list[int]:
    """V2's expanded prefix sum: expert e's first row plus its unaligned count."""
    out, start = [], 0
    for a, u in zip(aligned, unaligned):
        out.append(start + u)
        start += a
    return out


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def _compact(eb: ElasticBuffer, rank: int, num_ranks: int, case: Case, seed: int, where: str) -> int:
    inp = make_inputs(case, num_ranks, seed)
    x, idx, w = inp.xs[rank], inp.idxs[rank], inp.weights[rank]
    bound = max(max(case.tokens), 1)
    refs = reference_dispatch(inp.xs, inp.idxs, inp.weights, case.experts, case.alignment)
    ref = refs[rank]
    n = ref.recv_x.shape[0]

    recv_x, recv_idx, recv_w, h, event = eb.dispatch(x, idx, w, num_experts=case.experts,
                                                     expert_alignment=case.alignment)
    check(isinstance(event, EventOverlap) and event.event is None, where, "event")
    check_bits(recv_x, ref.recv_x, where, "compact recv_x")
    check_bits(recv_idx, ref.recv_topk_idx, where, "compact recv_topk_idx")
    check_bits(recv_w, ref.recv_topk_weights, where, "compact recv_topk_weights")
    check(not h.do_expand and h.num_recv_tokens == n and h.num_sms == Buffer.num_sms, where, "handle scalars")
    check(h.num_recv_tokens_per_expert_list == ref.num_recv_tokens_per_expert, where, "handle count list")
    check(h.num_expanded_tokens == sum(ref.num_recv_tokens_per_expert), where, "num_expanded_tokens")
    check_bits(h.psum_num_recv_tokens_per_expert,
               torch.tensor(_cumsum(ref.num_recv_tokens_per_expert), dtype=torch.int32), where, "compact psum")
    check_bits(h.psum_num_recv_tokens_per_scaleup_rank, ref.rank_prefix_matrix[:, rank].contiguous(), where,
               "psum per source rank")
    check(h.num_unaligned_recv_tokens_per_expert is None and torch.equal(h.topk_idx, idx), where, "handle tensors")

    gen = torch.Generator().manual_seed(seed * 31)
    ys = [_rows(r.recv_x.shape[0], case.hidden, x.dtype, gen) for r in refs]
    yws = [r.recv_topk_weights * 3 for r in refs]
    want, want_w = reference_combine(ys, refs, list(case.tokens), yws, topk_idxs=inp.idxs,
                                    num_experts=case.experts)[rank]
    combined, combined_w, _ = eb.combine(ys[rank], h, topk_weights=yws[rank])
    check_equal(combined, want, where, "compact combine")
    check_equal(combined_w, want_w, where, "compact combined_topk_weights")
    check(eb.combine(ys[rank], h)[1] is None, where, "no weights in, none out")

    # No host sync: W rows, the exact ones first, then padding; the combine ignores the padding rows.
    W = bound * num_ranks
    fx, fidx, fw, fh, _ = eb.dispatch(x, idx, w, num_experts=case.experts, expert_alignment=case.alignment,
                                      num_max_tokens_per_rank=bound, do_cpu_sync=False)
    check(fx.shape[0] == W and fh.num_worst_tokens == W, where, "fixed-size rows")
    check_bits(fx[:n], ref.recv_x, where, "fixed recv_x")
    check_bits(fidx[:n], ref.recv_topk_idx, where, "fixed recv_topk_idx")
    check_bits(fw[:n], ref.recv_topk_weights, where, "fixed recv_topk_weights")
    check(bool((fx[n:] == 0).all() and (fidx[n:] == -1).all() and (fw[n:] == 0).all()), where, "padding rows")
    check(fh.num_recv_tokens_per_expert_list == [] and fh.num_recv_tokens == -1, where, "no host counts")
    check_bits(fh.psum_num_recv_tokens_per_expert, h.psum_num_recv_tokens_per_expert, where, "fixed psum")
    padded = torch.cat([ys[rank], torch.full((W - n, case.hidden), 7.0, dtype=x.dtype)])
    padded_w = torch.cat([yws[rank], torch.full((W - n, case.topk), 5.0)])
    fc, fcw, _ = eb.combine(padded, fh, topk_weights=padded_w)
    check_equal(fc, want, where, "fixed combine")
    check_equal(fcw, want_w, where, "fixed combined_topk_weights")

    # Cached dispatch: the same layout for other rows (and weights), exact and fixed-size handles.
    xs2 = [t * 2 for t in inp.xs]
    ref2 = reference_dispatch(xs2, inp.idxs, inp.weights, case.experts, case.alignment)[rank]
    cx, cidx, cw, ch, _ = eb.dispatch(xs2[rank], handle=h)
    check(ch is h and cw is None and cidx is recv_idx, where, "cached returns")
    check_bits(cx, ref2.recv_x, where, "cached recv_x")
    cx, _, cw, _, _ = eb.dispatch(xs2[rank], topk_weights=w, handle=fh, do_cpu_sync=False)
    check_bits(cx[:n], ref2.recv_x, where, "cached fixed recv_x")
    check_bits(cw[:n], ref.recv_topk_weights, where, "cached fixed recv_topk_weights")
    check(bool((cx[n:] == 0).all()), where, "cached fixed padding")
    return 1


def _expanded(eb: ElasticBuffer, rank: int, num_ranks: int, case: Case, seed: int, where: str) -> int:
    inp = make_inputs(case, num_ranks, seed)
    x, idx, w = inp.xs[rank], inp.idxs[rank], inp.weights[rank]
    bound = max(max(case.tokens), 1)
    refs = reference_expert_dispatch(inp.xs, inp.idxs, inp.weights, case.experts, case.alignment)
    ref = refs[rank]
    m = ref.expert_x.shape[0]

    ex, eidx, ew, h, _ = eb.dispatch(x, idx, w, num_experts=case.experts, expert_alignment=case.alignment,
                                     do_expand=True)
    check(eidx is None and h.do_expand, where, "expanded: no recv_topk_idx")
    check_bits(ex, ref.expert_x, where, "expanded recv_x")
    check_bits(ew, ref.expert_weights, where, "expanded recv_topk_weights")
    check(h.num_recv_tokens_per_expert_list == ref.num_recv_tokens_per_expert, where, "expanded count list")
    check(h.num_expanded_tokens == m, where, "num_expanded_tokens")
    check_bits(h.psum_num_recv_tokens_per_expert,
               torch.tensor(_psum_expand(ref.num_recv_tokens_per_expert, ref.num_recv_pairs_per_expert),
                            dtype=torch.int32), where, "expanded psum")
    check_bits(h.num_unaligned_recv_tokens_per_expert,
               torch.tensor(ref.num_recv_pairs_per_expert, dtype=torch.int32), where, "unaligned counts")
    check(int(h.psum_num_recv_tokens_per_scaleup_rank[-1]) == h.num_recv_tokens, where, "rows behind the expansion")

    gen = torch.Generator().manual_seed(seed * 37)
    ys = [_rows(r.expert_x.shape[0], case.hidden, x.dtype, gen) for r in refs]
    yws = [r.expert_weights * 3 for r in refs]
    tokens = list(case.tokens)
    plain = reference_expert_combine(ys, refs, inp.idxs, tokens, None, True)[rank]
    weighted = reference_expert_combine(ys, refs, inp.idxs, tokens, yws, True)[rank]
    combined, combined_w, _ = eb.combine(ys[rank], h, topk_weights=ew)
    check_equal(combined, plain, where, "expanded combine (weights not applied)")
    check_equal(combined_w, torch.where(idx >= 0, w, torch.zeros_like(w)), where, "expanded combined_topk_weights")
    check_equal(eb.combine(ys[rank], h, expert_weights=yws[rank])[0], weighted, where, "expanded weighted combine")

    # No host sync: the exact rows plus zero padding up to max_slots(W, K, L, A).
    W = bound * num_ranks
    slots = max_slots(W, case.topk, case.experts // num_ranks, case.alignment)
    fref = reference_expert_dispatch(inp.xs, inp.idxs, inp.weights, case.experts, case.alignment, slots)
    fx, _, fw, fh, _ = eb.dispatch(x, idx, w, num_experts=case.experts, expert_alignment=case.alignment,
                                   num_max_tokens_per_rank=bound, do_cpu_sync=False, do_expand=True)
    check_bits(fx, fref[rank].expert_x, where, "fixed expanded recv_x")
    check_bits(fw, fref[rank].expert_weights, where, "fixed expanded recv_topk_weights")
    check(fh.num_recv_tokens_per_expert_list == [] and fh.num_expanded_tokens == -1, where, "fixed: no host counts")
    check_bits(fh.psum_num_recv_tokens_per_expert, h.psum_num_recv_tokens_per_expert, where, "fixed expanded psum")
    fys = [_rows(slots, case.hidden, x.dtype, gen) for _ in refs]
    fwant = reference_expert_combine(fys, fref, inp.idxs, tokens, [r.expert_weights for r in fref], True)[rank]
    check_equal(eb.combine(fys[rank], fh, expert_weights=fw)[0], fwant, where, "fixed expanded combine")

    # Cached dispatch through the expanded handle.
    xs2 = [t * 2 for t in inp.xs]
    ref2 = reference_expert_dispatch(xs2, inp.idxs, inp.weights, case.experts, case.alignment)[rank]
    cx, cidx, cw, ch, _ = eb.dispatch(xs2[rank], handle=h, do_expand=True)
    check(ch is h and cidx is None and cw is None, where, "cached expanded returns")
    check_bits(cx, ref2.expert_x, where, "cached expanded recv_x")
    cx, _, cw, _, _ = eb.dispatch(xs2[rank], topk_weights=w, handle=fh)
    check_bits(cx, reference_expert_dispatch(xs2, inp.idxs, inp.weights, case.experts, case.alignment,
                                             slots)[rank].expert_x, where, "cached fixed expanded recv_x")
    check_bits(cw, fref[rank].expert_weights, where, "cached fixed expanded weights")
    return 1


def _single_reduction(rank: int, num_ranks: int, group) -> None:
    """``allow_multiple_reduction=False``: the expanded combine sums every row once at the source."""
    eb = ElasticBuffer(group, allow_multiple_reduction=False, backend="torch", num_gpu_timeout_secs=60)
    case = _cases(num_ranks)[0]
    inp = make_inputs(case, num_ranks, 77)
    refs = reference_expert_dispatch(inp.xs, inp.idxs, inp.weights, case.experts, case.alignment)
    ex, _, ew, h, _ = eb.dispatch(inp.xs[rank], inp.idxs[rank], inp.weights[rank], num_experts=case.experts,
                                  do_expand=True)
    gen = torch.Generator().manual_seed(78)
    ys = [_rows(r.expert_x.shape[0], case.hidden, ex.dtype, gen) for r in refs]
    want = reference_expert_combine(ys, refs, inp.idxs, list(case.tokens), [r.expert_weights for r in refs],
                                    False)[rank]
    check_equal(eb.combine(ys[rank], h, expert_weights=ew)[0], want, f"R={rank}/{num_ranks}", "single reduction")
    eb.destroy()


def _gradients(eb: ElasticBuffer, rank: int, num_ranks: int) -> None:
    """A backward through ElasticBuffer equals the same through `ep_moe.buffer.autograd_ops` / `ep_moe.buffer.expert_major_ops`."""
    where = f"grad R={rank}/{num_ranks}"
    case = Case("grad", tuple(7 + s for s in range(num_ranks)), 64, 3, 4 * num_ranks, "random", "fp32", 4)
    inp = make_inputs(case, num_ranks, 5)
    gen = torch.Generator().manual_seed(100 + rank)
    g = torch.randn(case.tokens[rank], case.hidden, generator=gen)

    def leaves():
        return inp.xs[rank].clone().requires_grad_(), inp.weights[rank].clone().requires_grad_()

    for expand in (False, True):
        x, w = leaves()
        rx, _, rw, h, _ = eb.dispatch(x, inp.idxs[rank], w, num_experts=case.experts, expert_alignment=4,
                                      do_expand=expand)
        if expand:
            out = eb.combine(torch.tanh(rx) * 1.5, h, expert_weights=rw)[0]
        else:
            out = eb.combine(torch.tanh(rx) * rw.sum(1, keepdim=True), h)[0]
        (out * g).sum().backward()
        x2, w2 = leaves()
        if expand:
            d = expert_dispatch(eb.buffer, x2, inp.idxs[rank], w2, case.experts, 4)
            out2 = expert_combine(eb.buffer, torch.tanh(d.expert_x) * 1.5, d.handle, d.expert_weights)
        else:
            d = ops.dispatch(eb.buffer, x2, inp.idxs[rank], w2, case.experts, 4)
            out2 = ops.combine(eb.buffer, torch.tanh(d.recv_x) * d.recv_topk_weights.sum(1, keepdim=True),
                               d.handle)[0]
        (out2 * g).sum().backward()
        check_equal(out, out2.detach(), where, f"expand={expand} forward")
        check(x.grad is not None and w.grad is not None, where, f"expand={expand} gradients flow")
        check_equal(x.grad, x2.grad, where, f"expand={expand} grad x")
        check_equal(w.grad, w2.grad, where, f"expand={expand} grad topk_weights")
        # combined_topk_weights carries each weight back once: d/dw sum(2 * combined_w) = 2 where routed
        x, w = leaves()
        rx, _, rw, h, _ = eb.dispatch(x, inp.idxs[rank], w, num_experts=case.experts, do_expand=expand)
        cw = eb.combine(rx, h, topk_weights=rw * 2)[1]
        cw.sum().backward()
        check_equal(w.grad, (inp.idxs[rank] >= 0).float() * 2, where, f"expand={expand} grad via combined weights")


def _fp8(eb: ElasticBuffer, rank: int, num_ranks: int, seed: int) -> int:
    """The FP8 pair, forward only: compact and expanded, exact and fixed size, fresh and cached; rows and scales
    bit for bit the reference's, and the compact combine of bf16 rows works on the FP8 dispatch's handle."""
    case = Case("fp8", tuple(9 + 4 * s for s in range(num_ranks)), 256, 3, 4 * num_ranks, "random", "fp8", 4)
    where = f"fp8 R={rank}/{num_ranks}"
    inp = make_inputs(case, num_ranks, seed)
    x, idx, w = inp.x(rank), inp.idxs[rank], inp.weights[rank]
    bound = max(case.tokens)
    ref = reference_dispatch(inp.xs, inp.idxs, inp.weights, case.experts, case.alignment, scales=inp.scales)
    n = ref[rank].recv_x.shape[0]
    for sync in (True, False):
        (rx, rs), ridx, rw, h, _ = eb.dispatch(x, idx, w, num_experts=case.experts, expert_alignment=case.alignment,
                                               num_max_tokens_per_rank=bound, do_cpu_sync=sync)
        check_bits(rx[:n], ref[rank].recv_x, where, f"compact rows (sync={sync})")
        check_bits(rs[:n], ref[rank].recv_scales, where, f"compact scales (sync={sync})")
        check_bits(rw[:n], ref[rank].recv_topk_weights, where, f"compact weights (sync={sync})")
        check(bool((rs[n:] == 0).all() and (ridx[n:] == -1).all()), where, "compact padding")
        (cx, cs), _, _, _, _ = eb.dispatch(x, handle=h)
        check_bits(cx, rx, where, "cached compact rows")
        check_bits(cs, rs, where, "cached compact scales")
        ys = [torch.ones(r.recv_x.shape[0], case.hidden, dtype=torch.bfloat16) for r in ref]
        want, _ = reference_combine(ys, ref, list(case.tokens), topk_idxs=inp.idxs,
                                    num_experts=case.experts)[rank]
        y = torch.cat([ys[rank], torch.zeros(rx.shape[0] - n, case.hidden, dtype=torch.bfloat16)])
        check_equal(eb.combine(y, h)[0], want, where, f"combine after an FP8 dispatch (sync={sync})")
        slots = None if sync else max_slots(bound * num_ranks, case.topk, case.experts // num_ranks, case.alignment)
        eref = reference_expert_dispatch(inp.xs, inp.idxs, inp.weights, case.experts, case.alignment, slots,
                                         scales=inp.scales)[rank]
        (ex, es), _, ew, eh, _ = eb.dispatch(x, idx, w, num_experts=case.experts, expert_alignment=case.alignment,
                                             num_max_tokens_per_rank=bound, do_cpu_sync=sync, do_expand=True)
        check_bits(ex, eref.expert_x, where, f"expanded rows (sync={sync})")
        check_bits(es, eref.expert_scales, where, f"expanded scales (sync={sync})")
        check_bits(ew, eref.expert_weights, where, f"expanded weights (sync={sync})")
        (cx, cs), _, cw, _, _ = eb.dispatch(x, topk_weights=w, handle=eh)
        check_bits(cx, ex, where, "cached expanded rows")
        check_bits(cs, es, where, "cached expanded scales")
        check_bits(cw, ew, where, "cached expanded weights")
    return 1


def _worker(rank: int, num_ranks: int, group) -> int:
    eb = ElasticBuffer(group, num_max_tokens_per_rank=0, backend="torch", num_gpu_timeout_secs=60)
    check(eb.num_ranks == num_ranks and eb.rank == rank and eb.num_bytes % (2 << 20) == 0, f"R={rank}", "attrs")
    checked = 0
    for seed, case in enumerate(_cases(num_ranks), start=1):
        where = f"{case.name} R={rank}/{num_ranks}"
        checked += _compact(eb, rank, num_ranks, case, seed, where)
        checked += _expanded(eb, rank, num_ranks, case, seed, where)
    checked += _fp8(eb, rank, num_ranks, 77)
    _gradients(eb, rank, num_ranks)
    if num_ranks > 1:
        _single_reduction(rank, num_ranks, group)
    eb.barrier(with_cpu_sync=True)
    eb.destroy()
    return checked


def _all_workers(rank: int, num_ranks: int, group) -> dict:
    """Every multi-rank check of this file at this world size (one spawned job of 4 ranks runs them all)."""
    out = {"equal": _worker(rank, num_ranks, group)}
    if num_ranks == 1:
        out["errors"] = _errors_worker(rank, num_ranks, group)
    return out


@pytest.fixture(scope="module")
def by_world_size() -> dict[int, list[dict]]:
    """`_all_workers` at 1, 2, 3 and 4 ranks: 4 spawned ranks, the smaller sizes on subgroups of them."""
    return run_world_sizes(_all_workers, (1, 2, 3, 4), join_timeout_s=600)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_elastic_buffer_equals_the_reference(by_world_size, num_ranks: int) -> None:
    checked = [r["equal"] for r in by_world_size[num_ranks]]
    assert checked == [2 * len(_cases(num_ranks)) + 1] * num_ranks


def _raises(fn, name: str) -> None:
    try:
        fn()
    except ValueError as exc:
        assert f"argument '{name}'" in str(exc), str(exc)
    else:
        raise AssertionError(f"no ValueError naming {name!r}")


def _errors_worker(rank: int, num_ranks: int, group) -> bool:
    _raises(lambda: ElasticBuffer(group, num_cpu_bytes=-1, backend="torch"), "num_cpu_bytes")
    _raises(lambda: ElasticBuffer(group, num_bytes=12345, backend="torch"), "num_bytes")
    _raises(lambda: ElasticBuffer(group, backend="nccl"), "backend")
    _raises(lambda: ElasticBuffer(group, num_gpu_timeout_secs=0, backend="torch"), "num_gpu_timeout_secs")
    hint = ElasticBuffer.get_buffer_size_hint(group, 128, 256, num_topk=4)
    assert hint % (2 << 20) == 0 and hint >= Buffer.get_buffer_size_hint(128, 256, num_ranks, 4)
    assert ElasticBuffer.get_buffer_size_hint(group, 128, 256, 4, allow_multiple_reduction=False) >= hint
    eb = ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=256, num_topk=4, backend="torch",
                       explicitly_destroy=True)
    assert eb.num_bytes == hint and eb.num_max_tokens_per_rank == 128 and eb.get_theoretical_num_sms(8, 2) > 0
    eb.num_max_tokens_per_rank = 0
    T, E = 6, 4
    x, w = torch.randn(T, 128), torch.rand(T, 2)
    idx = torch.tensor([[0, 1], [2, -1], [3, 1], [-1, -1], [0, 2], [1, 3]])
    _raises(lambda: eb.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False), "num_max_tokens_per_rank")
    _raises(lambda: eb.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False, num_max_tokens_per_rank=T - 1),
            "num_max_tokens_per_rank")
    _raises(lambda: eb.dispatch(x, None, w, num_experts=E), "topk_idx")
    _raises(lambda: eb.dispatch(x, idx, w), "num_experts")
    _raises(lambda: eb.dispatch(x, idx, w, num_experts=0), "num_experts")
    _raises(lambda: eb.dispatch(x, idx, w, num_experts=E, expert_alignment=0), "expert_alignment")
    _raises(lambda: eb.dispatch((x, x), idx, w, num_experts=E), "x[0]")  # a pair must be FP8 rows + scales
    _, _, _, h, _ = eb.dispatch(x, idx, w, num_experts=E)
    _, _, _, he, _ = eb.dispatch(x, idx, w, num_experts=E, do_expand=True)
    _raises(lambda: eb.dispatch(x, idx, handle=h), "topk_idx")
    _raises(lambda: eb.dispatch(x, handle=h, do_cpu_sync=True), "do_cpu_sync")
    _raises(lambda: eb.dispatch(x, handle=h, do_expand=True), "do_expand")
    _raises(lambda: eb.dispatch(x, handle=h, num_experts=2 * E), "num_experts")
    _raises(lambda: eb.dispatch(x[:2], handle=h), "x")
    _raises(lambda: eb.dispatch(x, handle=h.inner), "handle")
    _raises(lambda: eb.combine(x, h.inner), "handle")
    _raises(lambda: eb.combine(x, h, expert_weights=torch.ones(T)), "expert_weights")
    rows = he.inner.layout.num_slots
    _raises(lambda: eb.combine(torch.randn(rows, 128), he, topk_weights=torch.ones(rows, 2)), "topk_weights")
    _raises(lambda: eb.combine(torch.randn(rows + 1, 128), he), "x")
    eb.destroy()
    eb.destroy()  # idempotent
    try:
        eb.dispatch(x, idx, w, num_experts=E)
    except RuntimeError as exc:
        assert "destroyed" in str(exc)
    else:
        raise AssertionError("a destroyed buffer dispatched")
    # explicitly_destroy=False: collected buffers free their resources
    collected = ElasticBuffer(group, backend="torch")
    buffer_id = collected.buffer.buffer_id
    collected = None
    gc.collect()
    try:
        buffer_by_id(buffer_id)
    except RuntimeError:
        return True
    return False


def test_elastic_buffer_errors_and_lifecycle(by_world_size) -> None:
    assert [r["errors"] for r in by_world_size[1]] == [True]
