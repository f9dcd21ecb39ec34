"""Dispatch layout: which rank and expert every token goes to (docs/semantics.md), in plain torch ops.

This is the reference implementation and the one the ``torch`` backend uses; the native backend has
a kernel that must agree with it exactly.
"""

from __future__ import annotations

import torch


def count_values(values: torch.Tensor, num_bins: int) -> torch.Tensor:
    """``[num_bins]`` int64 histogram of ``values`` (ints in ``[0, num_bins)``), like ``torch.bincount``
    but with a fixed output size: no host sync on GPU, so it can run inside a CUDA graph."""
    counts = torch.zeros(num_bins, dtype=torch.int64, device=values.device)
    return counts.scatter_add_(0, values.flatten(), torch.ones_like(values.flatten(), dtype=torch.int64))


def expert_to_rank(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """Map expert ids ``[T, K]`` (int64, -1 = none) to their owner rank, -1 kept."""
    experts_per_rank = num_experts // num_ranks
    return torch.where(topk_idx >= 0, topk_idx // experts_per_rank, torch.full_like(topk_idx, -1))


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compute the dispatch layout of one rank's tokens.

    Args:
        topk_idx: ``[T, K]`` int64 expert ids, -1 meaning "no expert".
        num_experts: E, divisible by ``num_ranks``.
        num_ranks: R, the EP group size.

    Returns:
        ``num_tokens_per_rank`` ``[R]`` int32, ``num_tokens_per_expert`` ``[E]`` int32 and
        ``is_token_in_rank`` ``[T, R]`` bool, all on ``topk_idx``'s device.
    """
    num_tokens = topk_idx.shape[0]
    ranks = expert_to_rank(topk_idx, num_experts, num_ranks)
    is_token_in_rank = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    # Column R collects the -1 entries so that one scatter handles them; it is dropped below.
    is_token_in_rank.scatter_(1, torch.where(ranks >= 0, ranks, num_ranks), True)
    is_token_in_rank = is_token_in_rank[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    # Count -1 entries into an extra bin and drop it: no boolean indexing, no host sync on GPU.
    flat = torch.where(topk_idx >= 0, topk_idx, num_experts).flatten()
    num_tokens_per_expert = count_values(flat, num_experts + 1)[:num_experts].to(torch.int32)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def local_topk(topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, rank: int, experts_per_rank: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The receiver's view of routed rows: local expert ids (-1 elsewhere) and weights (0 elsewhere).

    Args:
        topk_idx: ``[N, K]`` int64 global expert ids of received rows.
        topk_weights: ``[N, K]`` fp32 or None.
    """
    first = rank * experts_per_rank
    is_local = (topk_idx >= first) & (topk_idx < first + experts_per_rank)
    local_idx = torch.where(is_local, topk_idx - first, torch.full_like(topk_idx, -1))
    local_weights = None
    if topk_weights is not None:
        local_weights = torch.where(is_local, topk_weights, torch.zeros_like(topk_weights))
    return local_idx, local_weights


def round_up(counts, alignment: int):
    """``counts`` (an int, or an int tensor elementwise) rounded up to a multiple of ``alignment``."""
    return (counts + alignment - 1) // alignment * alignment


def aligned_expert_counts(local_topk_idx: torch.Tensor, num_local_experts: int, alignment: int) -> torch.Tensor:
    """Received (token, expert) pairs per local expert, rounded up to ``alignment``: ``[L]`` int64."""
    flat = torch.where(local_topk_idx >= 0, local_topk_idx, num_local_experts).flatten()
    return round_up(count_values(flat, num_local_experts + 1)[:num_local_experts], alignment)


def summation_order(topk_idx: torch.Tensor, num_experts: int, num_groups: int) -> torch.Tensor:
    """The order in which a combine adds each token's partial rows, one per group of ranks (DeepEP V2's order).

    A group (a rank, or a node of ranks) holds experts ``[g E / G, (g + 1) E / G)``. A token's partial rows are
    added in the order of each group's last position in the token's top-k list; groups the token has no expert on
    come first, in increasing id (they hold no row of it, or only a row the caller placed there by hand).

    Args:
        topk_idx: ``[T, K]`` int64 expert ids, -1 meaning "no expert".
        num_experts: E, divisible by ``num_groups``.
        num_groups: G.

    Returns:
        ``[T, G]`` int32 on ``topk_idx``'s device: row t is a permutation of ``0..G-1``, the groups in the order
        their rows are added.
    """
    num_tokens, num_topk = topk_idx.shape
    groups = expert_to_rank(topk_idx, num_experts, num_groups)
    position = torch.arange(num_topk, dtype=torch.int64, device=topk_idx.device).expand(num_tokens, num_topk)
    last = torch.full((num_tokens, num_groups + 1), -1, dtype=torch.int64, device=topk_idx.device)
    # Column G collects the -1 entries so that one scatter handles them; it is dropped below.
    last.scatter_reduce_(1, torch.where(groups >= 0, groups, num_groups), position, reduce="amax")
    ids = torch.arange(num_groups, dtype=torch.int64, device=topk_idx.device)
    key = last[:, :num_groups] * num_groups + ids  # absent groups: negative, by id; present: by last position
    return torch.argsort(key, dim=1).to(torch.int32)
