"""The native backend's host side of the expert-major paths (docs/native.md, "Expert-major rows in the dispatch and
combine kernels"), on CPU: rank 1 of a two-rank `NativeBackend` built without a GPU, whose kernels module is a fake
that plays the kernels' part (as in test_native_mismatch_host_paths.py): its notify writes a count matrix and the send lists, its
dispatch with ``rows_in_place`` (fresh or cached) writes the received rows' metadata and puts the peer's rows where the pushers would
(rank-major, in this rank's data buffer; garbage where the own rows and the padding would be), and its combine
records what it was given. Checked: the kernels' argument counts and the in-place flag; `expert_major`'s consume
(layout, then `permute_received_rows` on the buffer view and the own input through the send list) gives the
composed path's expert-major rows and weights bit for bit, exact and fixed size, bf16 and the FP8 pair, also for a
cached dispatch with the handle of an in-place one (`_cached_dispatch_in_place`); the
combine of expert-major rows passes the rows, weights and slots last, forms the own rows first, never takes the copy
engine, and counts its calls; `expert_major_fused=False` and the JIT-only case refuse both modes."""

from __future__ import annotations

import pytest
import torch
from support.bits import assert_bits_equal
from support.native_backend_fakes import ERROR_WORDS, fake_native_backend

from ep_moe.backends import native_backend as nb
from ep_moe.backends.comm_backend import DispatchResult
from ep_moe.buffer import expert_major_ops as expert_major
from ep_moe.buffer.routing_layout import dispatch_layout
from ep_moe.config import Config, NativeOptions
from ep_moe.permute import (
    _unpermute_sum_torch,
    expert_layout,
    max_slots,
    permute_rows,
    permute_rows_and_values,
)

GARBAGE = 0x5A
R, ME, T, H, K, E = 2, 1, 7, 256, 3, 8  # two ranks, this is rank 1; four local experts
L = E // R
PEER_ROWS = 5  # rows rank 0 sends rank 1


class FakeKernels:
    """The binding's notify, dispatch and combine at rank 1 of 2 (see the module docstring)."""

    MAX_RANKS, ERROR_WORDS, MAX_NOTIFY_EXPERTS, TRACE_SLOTS, COPY_ENGINE_TRACE_SLOTS = 8, ERROR_WORDS, 1024, 6, 129

    def __init__(self, backend, scenario) -> None:
        self.backend, self.s = backend, scenario
        self.calls: list[tuple[str, tuple]] = []

    def notify(self, *args, bind: bool = False) -> None:
        assert len(args) == 15, len(args)
        prefix, pos, send_list, host_counts = args[3], args[4], args[5], args[6]
        counts = self.s["counts"]
        prefix.copy_(torch.cumsum(counts, 0).to(torch.int32))
        in_rank = args[1]
        send_list.zero_()
        pos.fill_(-1)
        lists = send_list.view(R, T)
        for r in range(R):
            tokens = in_rank[:, r].nonzero().flatten()
            lists[r, :tokens.numel()] = tokens.to(torch.int32)
            pos[tokens, r] = torch.arange(tokens.numel(), dtype=torch.int32)
        host_counts[:R * R] = counts.flatten().to(torch.int32)
        host_counts[R * R:R * R + R] = torch.tensor([T, T], dtype=torch.int32)
        host_counts[R * (R + 1):] = 0  # every rank's header as seen equal to this one's: no disagreement
        if args[12] is not None:  # host_expert_counts (exact size): the aligned received pairs per expert
            args[12][:L] = self.s["aligned_counts"]
        self.calls.append(("notify", args))

    def dispatch(self, *args, bind: bool = False) -> None:
        assert len(args) == 35, len(args)
        if args[7] is None:  # cached: only the peer's rows, where the pushers put them
            return self._cached_dispatch(*args)
        regions, recv_x, recv_scales = args[2], args[10], args[11]
        recv_idx, recv_w, src_idx, src_rank, counts_out = args[12], args[13], args[14], args[15], args[17]
        rows_capacity, in_place = args[19], args[34]
        assert in_place and recv_x.shape[0] == 0 and recv_scales is None and args[26] == 0  # no copy engine
        n = recv_idx.shape[0]
        self._land_peer_rows(regions)
        used = self.s["recv_idx"].shape[0]
        recv_idx.fill_(-1)
        recv_w.zero_()
        recv_idx[:used], recv_w[:used] = self.s["recv_idx"], self.s["recv_w"]
        src_idx.fill_(-1)
        src_rank.fill_(-1)
        counts_out.copy_(self.s["aligned_counts"])
        assert n >= used and rows_capacity >= n
        self.calls.append(("dispatch", args))

    def _land_peer_rows(self, regions) -> None:
        data = self.backend._data.tensor
        data.fill_(GARBAGE)  # never written where the own rows and the padding would be
        row_bytes = H * self.s["x"].element_size()
        peer = self.s["peer_x"].contiguous().view(torch.uint8).view(PEER_ROWS, row_bytes)
        data[regions[0]:regions[0] + PEER_ROWS * row_bytes].view(PEER_ROWS, row_bytes).copy_(peer)
        if self.s["peer_scales"] is not None:
            start = regions[1]  # offsets of the x, scales, top-k, weights and source regions
            scales = self.s["peer_scales"].contiguous().view(torch.uint8).view(-1)
            data[start:start + scales.numel()].copy_(scales)

    def _cached_dispatch(self, *args) -> None:
        recv_x, recv_scales, rows_capacity, write_arrival = args[10], args[11], args[19], args[20]
        cached_src_idx, in_place = args[31], args[34]
        assert in_place and recv_x.shape[0] == 0 and recv_scales is None and args[26] == 0  # no copy engine
        assert write_arrival and all(a is None for a in args[12:18]), "a cached dispatch writes no metadata"
        assert cached_src_idx is not None and rows_capacity >= cached_src_idx.shape[0]  # N, for the kernel
        self._land_peer_rows(args[2])
        self.calls.append(("cached dispatch", args))

    def combine(self, *args, bind: bool = False) -> None:
        assert len(args) == 30, len(args)  # ..., expert_y, expert_weights, sorted_slots, summation_order
        order = args[29]  # the handle's: [T, R] int32 per token, or None (increasing rank)
        assert order is None or (order.dtype == torch.int32 and tuple(order.shape) == tuple(args[6].shape)), order
        args[12].zero_()  # out
        self.calls.append(("combine", args))


def _scenario(fp8: bool, alignment: int) -> dict:
    """Rank 1's tokens and routing, and what rank 0 sends it (rows, local top-k, weights)."""
    gen = torch.Generator().manual_seed(7 + alignment + fp8)
    x = torch.randn(T, H, generator=gen).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scales = torch.rand(T, H // 128, generator=gen) + 0.5 if fp8 else None
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[1] = -1  # a token that goes nowhere
    w = torch.rand(T, K, generator=gen)
    per_rank, _, in_rank = dispatch_layout(idx, E, R)
    own = in_rank[:, ME].nonzero().flatten()
    peer_x = torch.randn(PEER_ROWS, H, generator=gen).to(x.dtype)
    peer_scales = torch.rand(PEER_ROWS, H // 128, generator=gen) + 0.5 if fp8 else None
    peer_idx = torch.randint(-1, L, (PEER_ROWS, K), generator=gen)
    peer_w = torch.where(peer_idx >= 0, torch.rand(PEER_ROWS, K, generator=gen), 0.0)
    own_idx = torch.where((idx[own] >= ME * L) & (idx[own] < (ME + 1) * L), idx[own] - ME * L, -1)
    own_w = torch.where(own_idx >= 0, w[own], 0.0)
    recv_idx, recv_w = torch.cat([peer_idx, own_idx]), torch.cat([peer_w, own_w])
    pairs = torch.stack([(recv_idx == e).sum() for e in range(L)])
    counts = torch.tensor([[3, PEER_ROWS], per_rank.tolist()])
    recv_x = torch.cat([peer_x.view(torch.uint8), x[own].view(torch.uint8)]).view(x.dtype)
    recv_scales = torch.cat([peer_scales, scales[own]]) if fp8 else None
    return dict(x=x, scales=scales, idx=idx, w=w, per_rank=per_rank, in_rank=in_rank, peer_x=peer_x,
                peer_scales=peer_scales, recv_idx=recv_idx, recv_w=recv_w, recv_x=recv_x, recv_scales=recv_scales,
                counts=counts, aligned_counts=(pairs + alignment - 1) // alignment * alignment)


@pytest.fixture
def backend(monkeypatch):
    b = fake_native_backend(ME, R, None, 4 << 20)
    monkeypatch.setattr(nb.native, "kernels_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return b


class _Buffer:
    """What `expert_major._dispatch_in_place` and `_cached_dispatch_in_place` use of a `Buffer`: the group size and
    `dispatch_result` (fresh and cached)."""

    group_size = R

    def __init__(self, backend) -> None:
        self.backend = backend

    def dispatch_result(self, x, handle=None, topk_idx=None, topk_weights=None, expert_alignment=1,
                        num_worst_tokens=0, config=None, num_experts=0, consume_in_place=None):
        data, scales = x if isinstance(x, tuple) else (x, None)
        if handle is not None:  # cached
            result = self.backend.dispatch(data, scales, None, None, handle.is_token_in_rank, None, handle, 0, 1,
                                           handle.num_worst_tokens, config or Config(), consume=consume_in_place)
            return result, None
        per_rank, _, in_rank = dispatch_layout(topk_idx, num_experts, R)
        result = self.backend.dispatch(data, scales, topk_idx, topk_weights, in_rank, per_rank, None, num_experts,
                                       expert_alignment, num_worst_tokens, config or Config(),
                                       consume=consume_in_place)
        return result, None


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("alignment,fixed", [(1, 0), (4, 0), (1, 2 * T), (16, 2 * T + 3)])
def test_in_place_dispatch_gives_the_composed_rows(backend, monkeypatch, fp8, alignment, fixed):
    s = _scenario(fp8, alignment)
    fake = FakeKernels(backend, s)
    monkeypatch.setattr(nb, "_c", lambda: fake)
    x = (s["x"], s["scales"]) if fp8 else s["x"]
    result, layout, expert_x, expert_w, expert_scales = expert_major._dispatch_in_place(
        _Buffer(backend), x, s["idx"], s["w"], E, alignment, fixed, 0)
    assert [name for name, _ in fake.calls] == ["notify", "dispatch"] and backend.in_place_dispatches == 1
    assert isinstance(result, DispatchResult) and result.recv_x is None and result.recv_scales is None
    n = fixed or s["recv_idx"].shape[0]
    recv_idx = torch.cat([s["recv_idx"], torch.full((n - s["recv_idx"].shape[0], K), -1)])
    recv_w = torch.cat([s["recv_w"], torch.zeros(n - s["recv_w"].shape[0], K)])
    pad = n - s["recv_x"].shape[0]
    recv_x = torch.cat([s["recv_x"].view(torch.uint8), torch.zeros(pad, H * s["x"].element_size(),
                                                                    dtype=torch.uint8)]).view(s["x"].dtype)
    want_layout = expert_layout(recv_idx, L, alignment, max_slots(fixed, K, L, alignment) if fixed else None)
    want_x, want_w = permute_rows_and_values(recv_x, recv_w, want_layout)
    for got, want in ((layout.pair_of_slot, want_layout.pair_of_slot), (expert_w, want_w)):
        assert torch.equal(got, want)
    assert_bits_equal(expert_x, want_x, "expert_x")
    if fp8:
        scales = torch.cat([s["recv_scales"], torch.zeros(pad, H // 128)])
        assert torch.equal(expert_scales, permute_rows(scales, want_layout))
    else:
        assert expert_scales is None
    if not fixed:
        assert result.num_recv_tokens_per_expert_list == s["aligned_counts"].tolist()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("fixed", [0, 2 * T + 3])
def test_cached_in_place_dispatch_gives_the_composed_rows(backend, monkeypatch, fp8, fixed):
    """The cached dispatch with the handle of an in-place one leaves its rows in place too: the binding gets the
    flag, no top-k and the handle's recv_src_idx (for N), the consume reads the peer's new rows from the buffer and
    the own ones from the new x through the handle's send list, and gives the composed rows and weights."""
    s = _scenario(fp8, 4)
    fake = FakeKernels(backend, s)
    monkeypatch.setattr(nb, "_c", lambda: fake)
    x = (s["x"], s["scales"]) if fp8 else s["x"]
    result, layout, _, _, _ = expert_major._dispatch_in_place(_Buffer(backend), x, s["idx"], s["w"], E, 4, fixed, 0)
    handle = expert_major.ExpertHandle(layout, result.handle, s["idx"], 0, True)
    # new rows with the same routing: this rank's x and the peer's rows negated, the scales doubled (exact)
    x2 = (-s["x"].float()).to(s["x"].dtype)
    s["peer_x"] = (-s["peer_x"].float()).to(s["x"].dtype)
    scales2 = None if not fp8 else s["scales"] * 2
    if fp8:
        s["peer_scales"] = s["peer_scales"] * 2
    n = fixed or s["recv_idx"].shape[0]
    recv_w = torch.cat([s["recv_w"], torch.zeros(n - s["recv_w"].shape[0], K)])  # the weights' cached dispatch
    monkeypatch.setattr(expert_major, "cached_dispatch_weights", lambda buffer, w, h, num_sms: recv_w)
    expert_x, expert_w, expert_scales = expert_major._cached_dispatch_in_place(
        _Buffer(backend), (x2, scales2) if fp8 else x2, handle, s["w"], 0)
    assert [name for name, _ in fake.calls] == ["notify", "dispatch", "cached dispatch"]
    assert backend.in_place_dispatches == 2 and fake.calls[-1][1][31] is result.handle.recv_src_idx
    own = s["in_rank"][:, ME].nonzero().flatten()
    pad = n - s["recv_x"].shape[0]
    recv_x = torch.cat([s["peer_x"].view(torch.uint8), x2[own].view(torch.uint8),
                        torch.zeros(pad, H * x2.element_size(), dtype=torch.uint8)]).view(x2.dtype)
    want_x, want_w = permute_rows_and_values(recv_x, recv_w, layout)
    assert_bits_equal(expert_x, want_x, "expert_x")
    assert torch.equal(expert_w, want_w)
    if fp8:
        scales = torch.cat([s["peer_scales"], scales2[own], torch.zeros(pad, H // 128)])
        assert torch.equal(expert_scales, permute_rows(scales, layout))
    else:
        assert expert_scales is None


def test_combine_of_expert_rows_passes_them_to_the_kernel(backend, monkeypatch):
    s = _scenario(False, 1)
    fake = FakeKernels(backend, s)
    monkeypatch.setattr(nb, "_c", lambda: fake)
    result, layout, expert_x, expert_w, _ = expert_major._dispatch_in_place(
        _Buffer(backend), s["x"], s["idx"], s["w"], E, 1, 0, 0)
    formed = []

    def own_rows(y, weights, sorted_slots, prefix, rank):  # the op's contract: only the own rows are defined
        rows = _unpermute_sum_torch(y, weights, sorted_slots)
        first, end = int(prefix[rank - 1, rank]), int(prefix[rank, rank])
        out = torch.full_like(rows, float("nan"))
        out[first:end] = rows[first:end]
        formed.append((first, end))
        return out

    monkeypatch.setattr(nb, "_own_rows", own_rows)
    y = torch.randn(expert_x.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out, out_w = backend.combine(y, result.handle, None, (None, None), Config(),
                                 expert_rows=(layout.sorted_slots, expert_w))
    assert out.shape == (T, H) and out_w is None and backend.expert_row_combines == 1
    (name, args), = fake.calls[-1:]
    first, end = formed[0]
    assert name == "combine" and (first, end) == (PEER_ROWS, s["recv_idx"].shape[0])
    own = args[8]  # y: the own rows the reducers read in place
    want = _unpermute_sum_torch(y, expert_w, layout.sorted_slots)
    assert torch.equal(own[first:end], want[first:end])
    assert args[26] is y and args[27] is expert_w and torch.equal(args[28], layout.sorted_slots)
    assert args[19] == 0, "never the copy engine"
    with pytest.raises(ValueError, match="'expert_rows'"):
        backend.combine(y, result.handle, None, (torch.zeros(T, H, dtype=torch.bfloat16), None), Config(),
                        expert_rows=(layout.sorted_slots, expert_w))


def test_both_modes_off_without_the_option_or_the_kernels(backend, monkeypatch):
    assert backend.receives_in_place(H * 2, E) and backend.combines_expert_rows(H * 2)
    assert not backend.receives_in_place(H * 2 + 2, E), "rows the kernels do not take"
    backend.options = NativeOptions(expert_major_fused=False)
    assert not backend.receives_in_place(H * 2, E) and not backend.combines_expert_rows(H * 2)
    backend.options = NativeOptions()
    monkeypatch.setattr(nb.native, "kernels_available", lambda: False)
    assert not backend.receives_in_place(H * 2, E) and not backend.combines_expert_rows(H * 2)
    with pytest.raises(ValueError, match="'consume'"):
        backend.dispatch(torch.zeros(T, H, dtype=torch.bfloat16), None, torch.zeros(T, K, dtype=torch.int64),
                         torch.zeros(T, K), torch.ones(T, R, dtype=torch.bool), torch.full((R,), T), None, E, 1, 0,
                         Config(), consume=lambda result, rows: None)
