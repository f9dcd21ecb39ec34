"""Core dispatch/combine on the torch backend over gloo, checked bit for bit against the
single-process reference (`ep_moe.reference`) on random and adversarial routings (docs/semantics.md).

Each group (8 spawned ranks, then subgroups of 2, 3 and 4 of them) runs every case of `_cases`; every rank
regenerates all ranks' inputs from the case seed and checks its own outputs. A mismatch raises at once with
the case name, so the peers fail fast (their next collective sees the closed connection).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.world_sizes import run_world_sizes
from support_core import (
    Case,
    check,
    check_bits,
    check_equal,
    make_inputs,
    small_ints,
)

from ep_moe import Buffer, DispatchHandle, EventOverlap
from ep_moe.backends.comm_backend import DispatchResult
from ep_moe.reference import reference_combine, reference_dispatch, reference_layout

TOKENS = (33, 7, 1, 16, 0, 12, 5, 9)  # different T per rank, multiples of nothing


def _cases(num_ranks: int) -> list[Case]:
    R = num_ranks
    ts = TOKENS[:R]
    return [
        Case("random-bf16", ts, 640, 4, 4 * R, "random", "bf16", alignment=4),
        Case("random-fp32", ts, 96, 3, 2 * R, "random", "fp32", alignment=128),  # up to 3 ranks per token
        Case("random-fp8", ts, 384, 3, 3 * R, "random", "fp8", alignment=4),
        Case("all-minus-one", ts, 128, 2, 2 * R, "all_minus_one", "bf16", alignment=4),
        Case("one-expert", ts, 384, 3, 3 * R, "one_expert", "fp32", alignment=4),
        Case("one-rank", ts, 256, 2, 2 * R, "one_rank", "bf16", alignment=128),
        Case("idle-experts-fp8", ts, 640, 2, 4 * R, "sparse", "fp8", alignment=4),
        Case("one-token-each", (1,) * R, 128, 2, 2 * R, "random", "bf16"),
        Case("zero-token-ranks", (0, 7, 0, 3, 0, 0, 11, 1)[:R], 384, 2, 2 * R, "random", "fp32", alignment=4),
        Case("rank0-receives-nothing", (5, 0, 9, 2, 4, 4, 1, 0)[:R], 128, 2, 2 * R, "skip_rank0", "bf16"),
        Case("all-empty", (0,) * R, 128, 2, 2 * R, "random", "fp8"),
    ]


def _as_pair(recv_x) -> tuple[torch.Tensor, torch.Tensor | None]:
    return recv_x if isinstance(recv_x, tuple) else (recv_x, None)


def _check_fresh_dispatch(out, ref, where: str, num_ranks: int) -> None:
    recv_x, recv_idx, recv_w, counts, handle, event = out
    data, scales = _as_pair(recv_x)
    check_bits(data, ref.recv_x, where, "recv_x")
    if ref.recv_scales is not None:
        check_bits(scales, ref.recv_scales, where, "recv_x scales")
    check_bits(recv_idx, ref.recv_topk_idx, where, "recv_topk_idx")
    check_bits(recv_w, ref.recv_topk_weights, where, "recv_topk_weights")
    check(type(counts) is list and all(type(c) is int for c in counts), where,
          f"num_recv_tokens_per_expert_list must be a list of int, got {counts!r}")
    check(counts == ref.num_recv_tokens_per_expert, where,
          f"num_recv_tokens_per_expert_list {counts} != {ref.num_recv_tokens_per_expert}")
    check(isinstance(handle, DispatchHandle), where, f"handle is a {type(handle).__name__}")
    check_bits(handle[0], ref.rank_prefix_matrix, where, "handle[0] (rank_prefix_matrix)")
    check(tuple(handle[0].shape) == (num_ranks, num_ranks), where, "rank_prefix_matrix is not [R, R]")
    check_bits(handle.recv_src_idx, ref.recv_src_idx, where, "handle.recv_src_idx")
    check_bits(handle.recv_src_rank, ref.recv_src_rank, where, "handle.recv_src_rank")
    check(handle.num_recv_tokens == ref.recv_x.shape[0], where, "handle.num_recv_tokens")
    check(isinstance(event, EventOverlap) and event.event is None, where, "event on CPU")


def _run_case(buffer: Buffer, rank: int, num_ranks: int, case: Case, seed: int) -> int:
    """All checks of one case on this rank; returns the number of checked calls."""
    R, E, H = num_ranks, case.experts, case.hidden
    where = f"{case.name} R={R} rank={rank}"
    inp = make_inputs(case, R, seed)
    x, idx, w = inp.x(rank), inp.idxs[rank], inp.weights[rank]
    T = case.tokens[rank]

    # ---- layout vs plain loops
    per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(idx, E)
    want_rank, want_expert, want_in_rank = reference_layout(idx, E, R)
    check_bits(per_rank, want_rank, where, "num_tokens_per_rank")
    check(per_rdma is None, where, "num_tokens_per_rdma_rank must be None")
    check_bits(per_expert, want_expert, where, "num_tokens_per_expert")
    check_bits(in_rank, want_in_rank, where, "is_token_in_rank")
    check(isinstance(event, EventOverlap), where, "layout event")

    # ---- fresh dispatch vs the reference, for each alignment
    alignments = sorted({1, case.alignment})
    refs = {a: reference_dispatch(inp.xs, inp.idxs, inp.weights, E, a, scales=inp.scales) for a in alignments}
    handle = None
    for a in alignments:
        out = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, expert_alignment=a)
        _check_fresh_dispatch(out, refs[a][rank], f"{where} align={a}", R)
        handle = out[4]
    exact_out = out
    ref, all_refs = refs[alignments[-1]][rank], refs[alignments[-1]]
    # Without the layout tensors (computed inside from topk_idx and num_experts): the same.
    out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=alignments[-1], num_experts=E)
    _check_fresh_dispatch(out, ref, f"{where} no-layout-args", R)

    # ---- cached dispatch (x only) equals the fresh one
    cached = buffer.dispatch(x, handle=handle)
    check(len(cached) == 6 and all(c is None for c in cached[1:5]), where, "cached dispatch tuple shape")
    for got, want, name in zip(_as_pair(cached[0]), _as_pair(exact_out[0]), ("recv_x", "scales")):
        if want is not None:
            check_bits(got, want, where, f"cached dispatch {name}")

    # ---- combine vs the reference: no weights; weights + one bias; weights + two biases
    ydtype = torch.bfloat16 if case.dtype in ("fp8", "bf16") else torch.float32
    gen = torch.Generator().manual_seed(seed * 104729)
    num_recv = [r.recv_x.shape[0] for r in all_refs]
    # Rows of very different magnitudes: fp32 sums of three or more then depend on their order.
    ys = [(torch.randn(n, H, generator=gen) * 10.0 ** torch.randint(-4, 5, (n, 1), generator=gen)).to(ydtype)
          for n in num_recv]
    yws = [torch.rand(n, case.topk, generator=gen) for n in num_recv]
    bias0 = [torch.randn(t, H, generator=gen).to(ydtype) for t in case.tokens]
    bias1 = [torch.randn(t, H, generator=gen).to(ydtype) for t in case.tokens]
    variants = {
        "plain": (None, None),
        "weights+bias": (yws, [(b, None) for b in bias0]),
        "weights+2bias": (yws, list(zip(bias0, bias1))),
    }
    for name, (weights, biases) in variants.items():
        want_x, want_w = reference_combine(ys, all_refs, list(case.tokens), weights, biases, inp.idxs, E)[rank]
        bias_arg = None if biases is None else (biases[rank][0] if biases[rank][1] is None else biases[rank])
        got_x, got_w, ev = buffer.combine(ys[rank], handle, topk_weights=None if weights is None else weights[rank],
                                          bias=bias_arg)
        check_bits(got_x, want_x, where, f"combine[{name}] x")
        if want_w is None:
            check(got_w is None, where, f"combine[{name}] weights must be None without topk_weights")
        else:
            check_bits(got_w, want_w, where, f"combine[{name}] topk_weights")
        check(isinstance(ev, EventOverlap), where, "combine event")

    # ---- round trip and conservation (small integers: every sum is exact)
    rt_dtype = torch.float32 if case.dtype == "fp32" else torch.bfloat16
    xi = small_ints(T, H, rt_dtype, torch.Generator().manual_seed(seed * 13 + rank))
    recv_i = buffer.dispatch(xi, handle=handle)[0]
    combined = buffer.combine(recv_i, handle)[0]
    ranks_per_token = in_rank.sum(1, keepdim=True)
    check_equal(combined, (xi.float() * ranks_per_token).to(rt_dtype), where, "combine(dispatch(x)) == x * ranks")
    totals = torch.tensor([float(in_rank.sum()), float(recv_i.shape[0]),
                           float((xi.double() * ranks_per_token).sum()), float(recv_i.double().sum()),
                           float((idx >= 0).sum()), float(sum(refs[1][rank].num_recv_tokens_per_expert)),
                           float(w.double()[idx >= 0].sum()), float(exact_out[2].double().sum())],
                          dtype=torch.float64)
    dist.all_reduce(totals, group=buffer.group)
    sent, received, sum_sent, sum_received, pairs_sent, pairs_received, w_sent, w_received = totals.tolist()
    check(sent == received, where, f"rows sent {sent} != rows received {received}")
    check(sum_sent == sum_received, where, f"checksum sent {sum_sent} != received {sum_received}")
    check(pairs_sent == pairs_received, where, f"(token, expert) pairs {pairs_sent} != {pairs_received}")
    check(abs(w_sent - w_received) <= 1e-9 * max(1.0, abs(w_sent)), where,
          f"weights sent {w_sent} != received {w_received}")

    # ---- num_worst_tokens: fixed-size outputs whose valid rows are the exact ones
    num_rows = ref.recv_x.shape[0]
    for worst in sorted({max(max(num_recv), 1), max(num_recv) + 5}):
        ww = f"{where} num_worst_tokens={worst}"
        out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=alignments[-1],
                              num_worst_tokens=worst, num_experts=E)
        recv_x, recv_idx, recv_w, counts, whandle, _ = out
        data, scales = _as_pair(recv_x)
        check(data.shape == (worst, H), ww, f"recv_x shape {tuple(data.shape)}")
        check_bits(data[:num_rows], ref.recv_x, ww, "valid recv_x rows")
        if ref.recv_scales is not None:
            check_bits(scales[:num_rows], ref.recv_scales, ww, "valid scales rows")
        check_bits(recv_idx[:num_rows], ref.recv_topk_idx, ww, "valid recv_topk_idx rows")
        check_bits(recv_w[:num_rows], ref.recv_topk_weights, ww, "valid recv_topk_weights rows")
        pad = worst - num_rows
        check_bits(recv_idx[num_rows:], torch.full((pad, case.topk), -1), ww, "padding recv_topk_idx")
        check_bits(recv_w[num_rows:], torch.zeros(pad, case.topk), ww, "padding recv_topk_weights")
        check(counts == [], ww, f"counts list must be empty with num_worst_tokens, got {counts}")
        check(whandle.num_worst_tokens == worst and whandle.num_recv_tokens == -1, ww, "handle sizes")
        check_bits(whandle[0], ref.rank_prefix_matrix, ww, "rank_prefix_matrix")
        check_bits(whandle.recv_src_idx[:num_rows], ref.recv_src_idx, ww, "recv_src_idx")
        check_bits(whandle.recv_src_rank[:num_rows], ref.recv_src_rank, ww, "recv_src_rank")
        minus = torch.full((pad,), -1, dtype=torch.int32)
        check_bits(whandle.recv_src_idx[num_rows:], minus, ww, "padding recv_src_idx")
        check_bits(whandle.recv_src_rank[num_rows:], minus, ww, "padding recv_src_rank")
        # The device counts are still there (dispatch_result keeps them).
        result, _ = buffer.dispatch_result(x, topk_idx=idx, topk_weights=w, expert_alignment=alignments[-1],
                                           num_worst_tokens=worst, num_experts=E)
        check(isinstance(result, DispatchResult), ww, "dispatch_result type")
        check(result.num_recv_tokens_per_expert.tolist() == ref.num_recv_tokens_per_expert, ww,
              "dispatch_result counts")
        # Cached dispatch through the padded handle.
        cdata, cscales = _as_pair(buffer.dispatch(x, handle=whandle)[0])
        check(cdata.shape == (worst, H), ww, "cached recv_x shape")
        check_bits(cdata[:num_rows], ref.recv_x, ww, "cached valid recv_x rows")
        if ref.recv_scales is not None:
            check_bits(cscales[:num_rows], ref.recv_scales, ww, "cached valid scales rows")
        # Combine through the padded handle ignores the padding rows (filled with garbage here).
        garbage = torch.full((pad, H), 1e4).to(ydtype)
        y_pad = torch.cat([ys[rank], garbage])
        yw_pad = torch.cat([yws[rank], torch.full((pad, case.topk), 1e4)])
        want_x, want_w = reference_combine(ys, all_refs, list(case.tokens), yws,
                                           list(zip(bias0, bias1)), inp.idxs, E)[rank]
        got_x, got_w, _ = buffer.combine(y_pad, whandle, topk_weights=yw_pad, bias=(bias0[rank], bias1[rank]))
        check_bits(got_x, want_x, ww, "combine through the padded handle")
        check_bits(got_w, want_w, ww, "combined topk_weights through the padded handle")
        recv_i = buffer.dispatch(xi, handle=whandle)[0]
        combined = buffer.combine(recv_i, whandle)[0]
        check_equal(combined, (xi.float() * ranks_per_token).to(rt_dtype), ww, "padded round trip")
    return 1


def _capacity_case(buffer: Buffer, rank: int, num_ranks: int) -> None:
    """Every rank receives every token (one expert per rank), so every rank overflows together."""
    R = num_ranks
    case = Case("capacity", TOKENS[:R], 128, R, 2 * R, "every_rank", "bf16")
    inp = make_inputs(case, R, seed=99)
    total = sum(case.tokens)
    with _raises(ValueError, "num_worst_tokens", f"capacity R={R} rank={rank}"):
        buffer.dispatch(inp.x(rank), topk_idx=inp.idxs[rank], topk_weights=inp.weights[rank],
                        num_experts=case.experts, num_worst_tokens=total - 1)
    # The group is still in step: an exact-capacity dispatch works and has no padding.
    out = buffer.dispatch(inp.x(rank), topk_idx=inp.idxs[rank], topk_weights=inp.weights[rank],
                          num_experts=case.experts, num_worst_tokens=total)
    ref = reference_dispatch(inp.xs, inp.idxs, inp.weights, case.experts)[rank]
    check_bits(out[0], ref.recv_x, f"capacity R={R} rank={rank}", "recv_x at exact capacity")


class _raises:
    """``pytest.raises`` for spawned ranks: the error type and a word of its message."""

    def __init__(self, exc_type: type, needle: str, where: str) -> None:
        self.exc_type, self.needle, self.where = exc_type, needle, where

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        check(exc_type is not None, self.where, f"expected {self.exc_type.__name__} naming {self.needle!r}")
        if not issubclass(exc_type, self.exc_type) or self.needle not in str(exc):
            return False  # re-raise the unexpected error as it is
        return True


def _api_case(buffer: Buffer, rank: int, num_ranks: int) -> None:
    """DeepEP's tuple shapes and the overlap arguments (accepted and harmless on CPU)."""
    where = f"api R={num_ranks} rank={rank}"
    case = Case("api", TOKENS[:num_ranks], 128, 2, 2 * num_ranks, "random", "bf16")
    inp = make_inputs(case, num_ranks, seed=5)
    x, idx, w, E = inp.x(rank), inp.idxs[rank], inp.weights[rank], case.experts
    check(buffer.rank == rank and buffer.group_size == num_ranks, where, "rank / group_size")
    check(buffer.device == torch.device("cpu") and buffer.backend_name == "torch", where, "device / backend")
    check(isinstance(buffer.buffer_id, int), where, "buffer_id")
    overlap = dict(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
    layout = buffer.get_dispatch_layout(idx, E, **overlap)
    check(isinstance(layout, tuple) and len(layout) == 5, where, "get_dispatch_layout returns 5 items")
    per_rank, _, per_expert, in_rank, event = layout
    check(per_rank.dtype == torch.int32 and per_rank.shape == (num_ranks,), where, "num_tokens_per_rank")
    check(per_expert.dtype == torch.int32 and per_expert.shape == (E,), where, "num_tokens_per_expert")
    check(in_rank.dtype == torch.bool and in_rank.shape == (x.shape[0], num_ranks), where, "is_token_in_rank")
    check(isinstance(event, EventOverlap), where, "layout event")
    event.current_stream_wait()
    with event:
        pass
    out = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                          topk_idx=idx, topk_weights=w, config=Buffer.get_dispatch_config(num_ranks), **overlap)
    check(isinstance(out, tuple) and len(out) == 6, where, "dispatch returns 6 items")
    recv_x, recv_idx, recv_w, counts, handle, event = out
    n = recv_x.shape[0]
    check(recv_x.dtype == torch.bfloat16 and recv_x.shape == (n, 128), where, "recv_x")
    check(recv_idx.dtype == torch.int64 and recv_idx.shape == (n, 2), where, "recv_topk_idx")
    check(recv_w.dtype == torch.float32 and recv_w.shape == (n, 2), where, "recv_topk_weights")
    check(len(counts) == E // num_ranks, where, "one count per local expert")
    prefix = handle[0]
    check(prefix is handle.rank_prefix_matrix and prefix.dtype == torch.int32
          and prefix.shape == (num_ranks, num_ranks), where, "handle[0] is the [R, R] int32 rank_prefix_matrix")
    check(int(prefix[-1, rank]) == n, where, "rank_prefix_matrix[-1, rank] == rows received")
    check(isinstance(event, EventOverlap) and event.event is None, where, "async event on CPU is empty")
    with event:
        pass
    combined = buffer.combine(recv_x, handle, topk_weights=recv_w, config=Buffer.get_combine_config(num_ranks),
                              **overlap)
    check(isinstance(combined, tuple) and len(combined) == 3, where, "combine returns 3 items")
    check(combined[0].shape == x.shape and combined[0].dtype == x.dtype, where, "combined_x")
    check(combined[1].shape == w.shape and combined[1].dtype == torch.float32, where, "combined_topk_weights")
    check(isinstance(combined[2], EventOverlap), where, "combine event")
    cached = buffer.dispatch(x, handle=handle, **overlap)
    check(len(cached) == 6 and cached[1:5] == (None, None, None, None), where, "cached dispatch tuple")
    result, event = buffer.dispatch_result(x, topk_idx=idx, topk_weights=w, num_experts=E)
    check(isinstance(result, DispatchResult) and isinstance(event, EventOverlap), where, "dispatch_result")
    check(result.num_recv_tokens_per_expert.dtype == torch.int64, where, "device counts are int64")
    buffer.barrier()


def _dispatch_worker(rank: int, num_ranks: int, group: dist.ProcessGroup) -> int:
    buffer = Buffer(group, backend="torch", timeout_s=30)
    checked = 0
    for seed, case in enumerate(_cases(num_ranks), start=1):
        checked += _run_case(buffer, rank, num_ranks, case, seed)
    _capacity_case(buffer, rank, num_ranks)
    _api_case(buffer, rank, num_ranks)
    buffer.destroy()
    return checked


@pytest.fixture(scope="module")
def checked_by_world_size(request) -> dict[int, list[int]]:
    """The selected world sizes' runs in one spawned job of the largest (8 unless ``-m "not slow"`` leaves it
    out), the smaller sizes on subgroups of it."""
    selected = {item.callspec.params["num_ranks"] for item in request.session.items
                if item.module is request.module and "checked_by_world_size" in item.fixturenames}
    return run_world_sizes(_dispatch_worker, sorted(selected), join_timeout_s=300)


@pytest.mark.parametrize("num_ranks", [2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_dispatch_combine_equal_reference(checked_by_world_size, num_ranks: int) -> None:
    assert checked_by_world_size[num_ranks] == [len(_cases(num_ranks))] * num_ranks


# ------------------------------------------------------------------------------ in-process API details
def test_buffer_size_hint_is_2mib_aligned_and_grows() -> None:
    base = dict(num_max_tokens_per_rank=256, hidden=1024, num_ranks=4, num_topk=4)
    size = Buffer.get_buffer_size_hint(**base)
    assert isinstance(size, int) and size > 0 and size % (2 << 20) == 0
    for key, bigger in [("num_max_tokens_per_rank", 4096), ("hidden", 7168), ("num_ranks", 8)]:
        assert Buffer.get_buffer_size_hint(**{**base, key: bigger}) > size, key
    assert Buffer.get_buffer_size_hint(**{**base, "num_max_tokens_per_rank": 4096, "num_topk": 64}) > \
        Buffer.get_buffer_size_hint(**{**base, "num_max_tokens_per_rank": 4096})
    assert Buffer.get_buffer_size_hint(**base, dtype=torch.float32) >= size
    assert Buffer.get_buffer_size_hint(**base, fp8=True) % (2 << 20) == 0


def test_capture_and_event_overlap_on_cpu() -> None:
    event = Buffer.capture()
    assert isinstance(event, EventOverlap)
    if not torch.cuda.is_available():
        assert event.event is None
    with event as entered:
        assert entered is event
    event.current_stream_wait()
    kept = torch.ones(3)
    assert EventOverlap(None, [kept]).extra_tensors == (kept,)
