"""The shared torch-op helpers (`ep_moe.buffer.routing_layout`, the dispatchers' expert grouping) against the independent
loop reference (`ep_moe.reference`, which shares no code with them), on random and adversarial routings."""

from __future__ import annotations

import pytest
import torch
from support.bits import assert_bits_equal

from ep_moe.buffer.routing_layout import aligned_expert_counts, dispatch_layout, local_topk
from ep_moe.layers import LocalTokenDispatcher
from ep_moe.permute import expert_layout, pair_values, permute_rows, unpermute_sum
from ep_moe.reference import reference_dispatch, reference_expert_groups, reference_layout

ROUTINGS = ("random", "with_minus_one", "all_minus_one", "one_expert", "last_expert", "one_rank", "empty")


def _routing(kind: str, tokens: int, topk: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "empty":
        return torch.zeros(0, topk, dtype=torch.int64)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    if kind == "with_minus_one":
        idx[torch.rand(idx.shape, generator=gen) < 0.3] = -1
    elif kind == "all_minus_one":
        idx[:] = -1
    elif kind == "one_expert":
        idx[:, 1:] = -1
        idx[:, 0] = 3
    elif kind == "last_expert":
        idx[:, 0] = experts - 1
        idx[:, 1:] = -1
    elif kind == "one_rank":  # every expert of rank 1 (of 4), nothing else
        idx = torch.stack([torch.randperm(experts // 4, generator=gen)[:topk] + experts // 4 for _ in range(tokens)])
    return idx


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_dispatch_layout_equals_the_reference(kind, num_ranks):
    gen = torch.Generator().manual_seed(num_ranks * 31 + len(kind))
    experts = 12 if num_ranks == 3 else 16
    idx = _routing(kind, 37, 3, experts, gen)
    for got, want in zip(dispatch_layout(idx, experts, num_ranks), reference_layout(idx, experts, num_ranks)):
        assert got.dtype == want.dtype and torch.equal(got, want), kind


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("alignment", [1, 4])
def test_receiver_view_helpers_equal_the_reference(kind, alignment):
    """`local_topk` and `aligned_expert_counts` (what the torch backend applies to received rows) give the
    reference dispatch's receiver view on every rank."""
    num_ranks, experts = 4, 16
    gen = torch.Generator().manual_seed(7 + alignment)
    idxs = [_routing(kind, 5 + 3 * s, 3, experts, gen) for s in range(num_ranks)]
    weights = [torch.rand(i.shape, generator=gen) for i in idxs]
    xs = [torch.randn(i.shape[0], 8, generator=gen) for i in idxs]
    refs = reference_dispatch(xs, idxs, weights, experts, alignment)
    for r, ref in enumerate(refs):
        rows = list(zip(ref.recv_src_rank.tolist(), ref.recv_src_idx.tolist()))
        received = torch.stack([idxs[s][t] for s, t in rows]) if rows else torch.zeros(0, 3, dtype=torch.int64)
        received_w = torch.stack([weights[s][t] for s, t in rows]) if rows else torch.zeros(0, 3)
        local_idx, local_w = local_topk(received, received_w, r, experts // num_ranks)
        assert torch.equal(local_idx, ref.recv_topk_idx), (kind, r)
        assert torch.equal(local_w, ref.recv_topk_weights), (kind, r)
        counts = aligned_expert_counts(local_idx, experts // num_ranks, alignment).tolist()
        assert counts == ref.num_recv_tokens_per_expert, (kind, r)


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("alignment", [1, 3, 16])
def test_expert_layout_equals_the_reference(kind, alignment):
    gen = torch.Generator().manual_seed(11 * alignment)
    experts = 16
    idx = _routing(kind, 29, 3, experts, gen)
    want_slots, want_counts = reference_expert_groups(idx, experts, alignment)
    layout = expert_layout(idx, experts, alignment)
    assert layout.pair_of_slot.tolist() == want_slots and layout.tokens_per_expert.tolist() == want_counts
    # each pair's slot, and each row's slots in increasing order
    for slot, pair in enumerate(want_slots):
        if pair < idx.numel():
            assert int(layout.slot_of_pair.view(-1)[pair]) == slot
    for row in range(idx.shape[0]):
        slots = sorted(s for s, pair in enumerate(want_slots) if pair < idx.numel() and pair // 3 == row)
        assert layout.sorted_slots[row].tolist() == slots + [-1] * (3 - len(slots))
    # With a bound on the slot count (fixed size): the same slots, then padding only.
    bound = len(want_slots) + 5
    layout = expert_layout(idx, experts, alignment, num_slots=bound)
    assert layout.pair_of_slot.tolist() == want_slots + [idx.numel()] * 5
    assert layout.tokens_per_expert.tolist() == want_counts


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("capacity", [1, 4, 40])
def test_expert_layout_with_a_capacity_equals_a_loop(kind, capacity):
    """DeepSpeed's capacity buffer: expert e owns slots [e * C, (e + 1) * C), filled by its first C pairs in
    (row, k) order; later pairs have no slot; counts known on the host."""
    gen = torch.Generator().manual_seed(capacity)
    experts, topk = 16, 3
    idx = _routing(kind, 29, topk, experts, gen)
    want_slots = [idx.numel()] * (experts * capacity)
    want_slot_of_pair = [-1] * idx.numel()
    seen = [0] * experts
    for pair, e in enumerate(idx.view(-1).tolist()):
        if 0 <= e < experts and seen[e] < capacity:
            want_slots[e * capacity + seen[e]] = pair
            want_slot_of_pair[pair] = e * capacity + seen[e]
        if 0 <= e < experts:
            seen[e] += 1
    layout = expert_layout(idx, experts, capacity=capacity)
    assert layout.pair_of_slot.tolist() == want_slots
    assert layout.slot_of_pair.view(-1).tolist() == want_slot_of_pair
    assert layout.tokens_per_expert.tolist() == [capacity] * experts
    assert layout.tokens_per_expert_host.tolist() == [capacity] * experts
    assert layout.pairs_per_expert.tolist() == [min(n, capacity) for n in seen]
    for row in range(idx.shape[0]):
        slots = sorted(s for s in want_slot_of_pair[row * topk:(row + 1) * topk] if s >= 0)
        assert layout.sorted_slots[row].tolist() == slots + [-1] * (topk - len(slots))


def test_expert_layout_capacity_errors_name_the_argument():
    idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="'capacity'"):
        expert_layout(idx, 4, capacity=-1)
    with pytest.raises(ValueError, match="'alignment'"):
        expert_layout(idx, 4, 2, capacity=3)
    with pytest.raises(ValueError, match="'num_slots'"):
        expert_layout(idx, 4, num_slots=5, capacity=3)


@pytest.mark.parametrize("kind", ROUTINGS)
def test_permute_and_weighted_unpermute_equal_loops(kind):
    """`permute_rows` copies each pair's row (FP8 bytes too), `unpermute_sum` adds w * y in top-k order in fp32
    (products rounded first), rounds once; rows without a pair are zero."""
    gen = torch.Generator().manual_seed(len(kind))
    idx = _routing(kind, 23, 3, 16, gen)
    tokens = idx.shape[0]
    layout = expert_layout(idx, 16, 4)
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        x = torch.randn(tokens, 8, generator=gen).to(dtype)
        got = permute_rows(x, layout)
        for slot, pair in enumerate(layout.pair_of_slot.tolist()):
            want = x[pair // 3] if pair < idx.numel() else torch.zeros(8).to(dtype)
            assert_bits_equal(got[slot], want, f"{dtype} slot {slot}")
    y = (torch.randn(layout.num_slots, 8, generator=gen) * 10.0 ** torch.randint(-4, 5, (layout.num_slots, 1),
                                                                                 generator=gen)).bfloat16()
    w = pair_values(torch.rand(tokens, 3, generator=gen), layout)
    for weights in (w, None):
        got = unpermute_sum(y, layout, weights)
        assert got.shape == (tokens, 8)
        for row in range(tokens):
            acc = torch.zeros(8)
            for k in range(3):  # top-k order: the slot of pair (row, k), if it has one
                slot = next((s for s, p in enumerate(layout.pair_of_slot.tolist()) if p == row * 3 + k), -1)
                if slot >= 0:
                    acc = acc + (y[slot].float() if weights is None else weights[slot] * y[slot].float())
            assert torch.equal(got[row], acc.bfloat16()), (kind, row)


def test_local_dispatcher_feeds_each_slot_its_reference_row():
    gen = torch.Generator().manual_seed(5)
    idx = _routing("with_minus_one", 19, 2, 6, gen)
    hidden = torch.randn(19, 4, generator=gen)
    weights = torch.rand(19, 2, generator=gen)
    expert_input, expert_probs, counts, _ = LocalTokenDispatcher(6, expert_alignment=4).dispatch(hidden, idx, weights)
    pair_of_slot, want_counts = reference_expert_groups(idx, 6, 4)
    assert counts.tolist() == want_counts
    for slot, pair in enumerate(pair_of_slot):
        padding = pair == idx.numel()
        want_row = torch.zeros(4) if padding else hidden[pair // 2]
        want_prob = 0.0 if padding else float(weights[pair // 2, pair % 2])
        assert torch.equal(expert_input[slot], want_row) and float(expert_probs[slot]) == want_prob, slot
