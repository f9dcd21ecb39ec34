"""Single-process reference of the layout, dispatch, combine and expert grouping over all ranks' inputs at
once (`docs/semantics.md`).

Plain loops over ranks, tokens and top-k entries, written from the stated semantics alone: nothing here is
shared with the backends, the layers or `ep_moe.buffer.routing_layout` (which the torch backend uses), so a mistake there
cannot hide in the oracle too. Slow and obviously right; every backend and every shared helper is tested
against it.

Notation: R ranks, E experts, L = E / R local experts, T_s tokens of rank s, K top-k, H hidden, A alignment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _round_up(count: int, alignment: int) -> int:
    return -(-count // alignment) * alignment


def reference_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``get_dispatch_layout`` of one rank's ``topk_idx [T, K]`` (-1 = none): ``(num_tokens_per_rank [R] int32,
    num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)``, on the CPU. Expert ``e`` lives on rank
    ``e // L``; a token counts once per rank however many of its experts live there."""
    experts_per_rank = num_experts // num_ranks
    rows = topk_idx.tolist()
    in_rank = [[False] * num_ranks for _ in rows]
    per_expert = [0] * num_experts
    for t, experts in enumerate(rows):
        for e in experts:
            if e >= 0:
                in_rank[t][e // experts_per_rank] = True
                per_expert[e] += 1
    per_rank = [sum(row[r] for row in in_rank) for r in range(num_ranks)]
    return (torch.tensor(per_rank, dtype=torch.int32, device="cpu"),
            torch.tensor(per_expert, dtype=torch.int32, device="cpu"),
            torch.tensor(in_rank, dtype=torch.bool, device="cpu").reshape(len(rows), num_ranks))


@dataclass
class ReferenceDispatch:
    """Expected dispatch outputs on one rank (N received rows)."""

    recv_x: torch.Tensor               # [N, H]
    recv_scales: torch.Tensor | None   # [N, H/128] for FP8
    recv_topk_idx: torch.Tensor        # [N, K] local ids or -1
    recv_topk_weights: torch.Tensor    # [N, K] 0 where not local
    num_recv_tokens_per_expert: list[int]
    recv_src_rank: torch.Tensor        # [N] int32
    recv_src_idx: torch.Tensor         # [N] int32
    rank_prefix_matrix: torch.Tensor   # [R, R] int32


def reference_dispatch(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor], topk_weights: list[torch.Tensor],
                       num_experts: int, expert_alignment: int = 1,
                       scales: list[torch.Tensor] | None = None) -> list[ReferenceDispatch]:
    """Dispatch of every rank ``s``'s ``xs[s] [T_s, H]`` as seen by every rank ``r``: the rows of every source
    rank in rank order, each source's in token order, once per rank the token has an expert on; top-k ids made
    local (``e - r * L``, -1 elsewhere) with their weights (0 elsewhere); per local expert the received
    (token, expert) pairs rounded up to ``expert_alignment``."""
    num_ranks = len(xs)
    experts_per_rank = num_experts // num_ranks
    in_rank = [reference_layout(idx, num_experts, num_ranks)[2].tolist() for idx in topk_idxs]
    counts = [[sum(row[r] for row in in_rank[s]) for r in range(num_ranks)] for s in range(num_ranks)]
    prefix = [[sum(counts[q][r] for q in range(s + 1)) for r in range(num_ranks)] for s in range(num_ranks)]
    num_topk = topk_idxs[0].shape[1]
    out = []
    for r in range(num_ranks):
        first = r * experts_per_rank
        sources = [(s, t) for s in range(num_ranks) for t in range(xs[s].shape[0]) if in_rank[s][t][r]]
        local_idx, local_w = [], []
        pairs = [0] * experts_per_rank
        for s, t in sources:
            ids, weights = topk_idxs[s][t].tolist(), topk_weights[s][t]
            row_idx, row_w = [], []
            for k, e in enumerate(ids):
                if first <= e < first + experts_per_rank:
                    row_idx.append(e - first)
                    row_w.append(weights[k])
                    pairs[e - first] += 1
                else:
                    row_idx.append(-1)
                    row_w.append(weights.new_zeros(()))
            local_idx.append(row_idx)
            local_w.append(torch.stack(row_w) if row_w else weights.new_zeros(0))

        def gather(tensors, rows=sources):
            if not rows:
                return tensors[0].new_empty(0, *tensors[0].shape[1:])
            return torch.stack([tensors[s][t] for s, t in rows])

        out.append(ReferenceDispatch(
            recv_x=gather(xs), recv_scales=gather(scales) if scales is not None else None,
            recv_topk_idx=torch.tensor(local_idx, dtype=torch.int64, device="cpu").reshape(len(sources), num_topk),
            recv_topk_weights=(torch.stack(local_w) if local_w else topk_weights[0].new_zeros(0, num_topk)),
            num_recv_tokens_per_expert=[_round_up(n, expert_alignment) for n in pairs],
            recv_src_rank=torch.tensor([s for s, _ in sources], dtype=torch.int32, device="cpu"),
            recv_src_idx=torch.tensor([t for _, t in sources], dtype=torch.int32, device="cpu"),
            rank_prefix_matrix=torch.tensor(prefix, dtype=torch.int32, device="cpu")))
    return out


def reference_combine(ys: list[torch.Tensor], dispatched: list[ReferenceDispatch], num_tokens: list[int],
                      topk_weights: list[torch.Tensor] | None = None,
                      biases: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
                      topk_idxs: list[torch.Tensor] | None = None, num_experts: int = 0
                      ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Combine of every rank ``r``'s ``ys[r] [N_r, H]`` back to every source rank, cast to ``ys``' dtype once.

    Per token the fp32 sum starts from its biases (``bias[0]``, then ``bias[1]``) and adds the rows in DeepEP V2's
    order: by the last position in the token's top-k list (``topk_idxs[s] [T_s, K]``, ids of ``num_experts``) of
    an expert on the row's rank, ranks without one first, in increasing rank; without ``topk_idxs``, in increasing
    rank. Returns ``(combined, combined_weights)`` per rank."""
    num_ranks = len(ys)
    hidden, dtype = ys[0].shape[1], ys[0].dtype
    acc_dtype = torch.promote_types(dtype, torch.float32)
    results = []
    for s in range(num_ranks):
        acc = torch.zeros(num_tokens[s], hidden, dtype=acc_dtype, device="cpu")
        if biases is not None:
            for b in biases[s]:
                if b is not None:
                    acc = acc + b.to(acc_dtype)
        acc_w = None
        if topk_weights is not None:
            acc_w = torch.zeros(num_tokens[s], topk_weights[0].shape[1], dtype=torch.float32, device="cpu")
        rows_of: list[list[tuple[int, int]]] = [[] for _ in range(num_tokens[s])]  # per token: (rank, row)
        for r in range(num_ranks):
            d = dispatched[r]
            for i in range(d.recv_src_rank.numel()):
                if int(d.recv_src_rank[i]) == s:
                    t = int(d.recv_src_idx[i])
                    rows_of[t].append((r, i))
                    if acc_w is not None:
                        acc_w[t] += topk_weights[r][i]
        for t, rows in enumerate(rows_of):
            last = {}  # rank -> its last top-k position for token t
            if topk_idxs is not None:
                for k, e in enumerate(topk_idxs[s][t].tolist()):
                    if e >= 0:
                        last[e // (num_experts // num_ranks)] = k
            for r, i in sorted(rows, key=lambda row: (last.get(row[0], -1), row[0])):
                acc[t] += ys[r][i].to(acc_dtype)
        results.append((acc.to(dtype), acc_w))
    return results


def reference_expert_groups(topk_idx: torch.Tensor, num_experts: int, alignment: int
                            ) -> tuple[list[int], list[int]]:
    """How a dispatcher lays out the (row, k) pairs of ``topk_idx [N, K]`` (expert ids in ``[0, num_experts)``,
    -1 = none) for a grouped GEMM: expert 0's pairs in increasing (row, k), then padding up to a multiple of
    ``alignment``, then expert 1's, and so on. Returns ``(pair_of_slot, padded_counts)``: the flat index
    ``row * K + k`` of each slot's pair (``N * K`` for a padding slot) and each expert's padded group size."""
    num_rows, num_topk = topk_idx.shape
    ids = topk_idx.tolist()
    pair_of_slot, padded = [], []
    for e in range(num_experts):
        group = [row * num_topk + k for row in range(num_rows) for k in range(num_topk) if ids[row][k] == e]
        size = _round_up(len(group), alignment)
        pair_of_slot += group + [num_rows * num_topk] * (size - len(group))
        padded.append(size)
    return pair_of_slot, padded


# ------------------------------------------------------------------------------------------ expert-major
@dataclass
class ReferenceExpertDispatch:
    """Expected expert-major dispatch outputs on one rank (M slots)."""

    expert_x: torch.Tensor              # [M, H] (FP8 data for an FP8 input)
    expert_scales: torch.Tensor | None  # [M, H/128] for FP8
    expert_weights: torch.Tensor        # [M] fp32, 0 on padding
    num_recv_tokens_per_expert: list[int]    # [L] aligned
    num_recv_pairs_per_expert: list[int]     # [L] unaligned
    pairs: list[tuple[int, int, int]]   # (source rank, token, k) of each used slot, None for padding


def reference_expert_dispatch(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor],
                              topk_weights: list[torch.Tensor], num_experts: int, expert_alignment: int = 1,
                              num_slots: int | None = None, scales: list[torch.Tensor] | None = None
                              ) -> list[ReferenceExpertDispatch]:
    """Expert-major dispatch as seen by every rank ``r``: one slot per pair (s, t, k) with ``topk_idxs[s][t, k] =
    r * L + e``, ordered by e, then s, then t, then k; each expert's group padded with zero slots to a multiple of
    ``expert_alignment``; ``num_slots`` (fixed size) pads the tail with zero slots up to that many."""
    num_ranks = len(xs)
    local = num_experts // num_ranks
    out = []
    for r in range(num_ranks):
        slots: list[tuple[int, int, int] | None] = []
        aligned, unaligned = [], []
        for e in range(local):
            group = [(s, t, k) for s in range(num_ranks) for t in range(xs[s].shape[0])
                     for k in range(topk_idxs[s].shape[1]) if int(topk_idxs[s][t, k]) == r * local + e]
            size = _round_up(len(group), expert_alignment)
            slots += group + [None] * (size - len(group))
            aligned.append(size)
            unaligned.append(len(group))
        if num_slots is not None:
            if num_slots < len(slots):
                raise ValueError(f"reference_expert_dispatch: num_slots {num_slots} < the {len(slots)} needed")
            slots += [None] * (num_slots - len(slots))

        def gather(tensors, slots=slots):
            zero = tensors[0].new_zeros(tensors[0].shape[1:])
            rows = [tensors[p[0]][p[1]] if p is not None else zero for p in slots]
            return torch.stack(rows) if rows else tensors[0].new_empty(0, *tensors[0].shape[1:])

        weights = torch.tensor([float(topk_weights[p[0]][p[1], p[2]]) if p is not None else 0.0 for p in slots],
                               dtype=torch.float32, device="cpu")
        out.append(ReferenceExpertDispatch(
            expert_x=gather(xs), expert_scales=gather(scales) if scales is not None else None,
            expert_weights=weights, num_recv_tokens_per_expert=aligned, num_recv_pairs_per_expert=unaligned,
            pairs=slots))
    return out


def reference_expert_combine(ys: list[torch.Tensor], dispatched: list[ReferenceExpertDispatch],
                             topk_idxs: list[torch.Tensor], num_tokens: list[int],
                             weights: list[torch.Tensor] | None = None, allow_multiple_reduction: bool = True
                             ) -> list[torch.Tensor]:
    """Weighted expert-major combine of every rank ``r``'s ``ys[r] [M_r, H]`` back to every source rank
    (``weights[r] [M_r]`` fp32 per slot; None = plain sums).

    ``allow_multiple_reduction``: rank r sums, per (s, t), ``w * y`` over its slots of that token in top-k order
    (products rounded to fp32, then added), rounds to y's dtype, and the source sums those rows in fp32 in the
    order of each rank's last top-k position and rounds once. Else the source sums ``w * y`` over all of the
    token's pairs in top-k order in fp32 and rounds once. (DeepEP V2's orders.)"""
    num_ranks = len(ys)
    hidden, dtype = ys[0].shape[1], ys[0].dtype
    results = []
    for s in range(num_ranks):
        acc = torch.zeros(num_tokens[s], hidden, dtype=torch.float32, device="cpu")
        for t in range(num_tokens[s]):
            terms = []  # (top-k position, rank, w * y in fp32)
            for r in range(num_ranks):
                for slot, pair in enumerate(dispatched[r].pairs):
                    if pair is not None and pair[0] == s and pair[1] == t:
                        term = ys[r][slot].float()
                        if weights is not None:
                            term = weights[r][slot] * term
                        terms.append((pair[2], r, term))
            terms.sort(key=lambda item: item[0])
            if allow_multiple_reduction:
                last = {r: k for k, r, _ in terms}  # each rank's last top-k position
                for r in sorted(last, key=last.get):
                    partial = torch.zeros(hidden, dtype=torch.float32, device="cpu")
                    for _, rr, term in terms:
                        if rr == r:
                            partial = partial + term
                    acc[t] = acc[t] + partial.to(dtype).float()
            else:
                for _, _, term in terms:
                    acc[t] = acc[t] + term
        results.append(acc.to(dtype))
    return results
