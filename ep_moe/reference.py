"""Single-process reference of dispatch and combine over all ranks' inputs at once (DESIGN §2).

Plain loops over ranks and tokens: slow, obviously right, and what every backend is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import aligned_expert_counts, dispatch_layout, local_topk


@dataclass
class ReferenceDispatch:
    """Expected dispatch outputs on one rank."""

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
    """Dispatch of every rank ``s``'s ``xs[s] [T_s, H]`` as seen by every rank ``r``."""
    num_ranks = len(xs)
    per_rank = num_experts // num_ranks
    layouts = [dispatch_layout(idx, num_experts, num_ranks)[2] for idx in topk_idxs]
    counts = torch.stack([lay.sum(0, dtype=torch.int64) for lay in layouts])  # [source, dest]
    prefix = torch.cumsum(counts, 0).to(torch.int32)
    out = []
    for r in range(num_ranks):
        rows, src_rank, src_idx = [], [], []
        for s in range(num_ranks):
            for t in range(xs[s].shape[0]):
                if layouts[s][t, r]:
                    rows.append((s, t))
                    src_rank.append(s)
                    src_idx.append(t)
        def gather(tensors, rows=rows):
            if not rows:
                return tensors[0].new_empty(0, *tensors[0].shape[1:])
            return torch.stack([tensors[s][t] for s, t in rows])
        recv_idx = gather(topk_idxs)
        local_idx, local_w = local_topk(recv_idx, gather(topk_weights), r, per_rank)
        out.append(ReferenceDispatch(
            recv_x=gather(xs), recv_scales=gather(scales) if scales is not None else None,
            recv_topk_idx=local_idx, recv_topk_weights=local_w,
            num_recv_tokens_per_expert=aligned_expert_counts(local_idx, per_rank, expert_alignment).tolist(),
            recv_src_rank=torch.tensor(src_rank, dtype=torch.int32),
            recv_src_idx=torch.tensor(src_idx, dtype=torch.int32), rank_prefix_matrix=prefix))
    return out


def reference_combine(ys: list[torch.Tensor], dispatched: list[ReferenceDispatch], num_tokens: list[int],
                      topk_weights: list[torch.Tensor] | None = None,
                      biases: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None
                      ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Combine of every rank ``r``'s ``ys[r] [N_r, H]`` back to every source rank, summed in fp32 in
    increasing ``r``, plus biases, cast to ``ys``' dtype. Returns ``(combined, combined_weights)`` per rank."""
    num_ranks = len(ys)
    hidden, dtype = ys[0].shape[1], ys[0].dtype
    results = []
    for s in range(num_ranks):
        acc_dtype = torch.promote_types(dtype, torch.float32)
        acc = torch.zeros(num_tokens[s], hidden, dtype=acc_dtype)
        acc_w = None
        if topk_weights is not None:
            acc_w = torch.zeros(num_tokens[s], topk_weights[0].shape[1], dtype=torch.float32)
        for r in range(num_ranks):
            d = dispatched[r]
            for i in range(d.recv_src_rank.numel()):
                if int(d.recv_src_rank[i]) == s:
                    t = int(d.recv_src_idx[i])
                    acc[t] += ys[r][i].to(acc_dtype)
                    if acc_w is not None:
                        acc_w[t] += topk_weights[r][i]
        if biases is not None:
            for b in biases[s]:
                if b is not None:
                    acc = acc + b.to(acc_dtype)
        results.append((acc.to(dtype), acc_w))
    return results
