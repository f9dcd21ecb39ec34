"""The dispatch handle: what combine and a cached re-dispatch need to know about a dispatch."""

from __future__ import annotations

from typing import NamedTuple

import torch


class DispatchHandle(NamedTuple):
    """The layout of one dispatch, from `Buffer.dispatch`: pass it to `Buffer.combine` or a cached dispatch.

    As in DeepEP the first element is ``rank_prefix_matrix``, so code that reads ``handle[0]`` keeps working.
    R is the group size, T the sender's token count, N the received row count (``num_worst_tokens`` when that
    was given, padding rows included).

    Args:
        rank_prefix_matrix: ``[R, R]`` int32, ``[s, r]`` the rows that ranks ``0..s`` send to rank ``r``.
        recv_src_idx: ``[N]`` int32, each received row's token index on its source rank (-1 for padding).
        recv_src_rank: ``[N]`` int32, each received row's source rank (-1 for padding).
        is_token_in_rank: ``[T, R]`` bool, the sender's layout: which rows went where.
        num_recv_tokens: the received rows, or -1 when the host does not know them (``num_worst_tokens`` mode).
        num_worst_tokens: 0, or the fixed row count of the received tensors.
        backend_state: backend-specific device data (e.g. where each token landed in a peer's buffer), or None.
        summation_order: ``[T, R]`` int32, per token the ranks in the order a combine adds their rows, or None
            for increasing rank (one rank, or a dispatch without top-k).
    """

    rank_prefix_matrix: torch.Tensor
    """[R, R] int32: ``rank_prefix_matrix[s, r]`` = rows that ranks ``0..s`` send to rank ``r``."""
    recv_src_idx: torch.Tensor
    """[N] int32: for each received row, the token index on its source rank (-1 for padding)."""
    recv_src_rank: torch.Tensor
    """[N] int32: for each received row, its source rank (-1 for padding)."""
    is_token_in_rank: torch.Tensor
    """[T, R] bool: the sender's layout, which rows went where."""
    num_recv_tokens: int
    """Received rows, or -1 when they are not known on the host (``num_worst_tokens`` mode)."""
    num_worst_tokens: int
    """0, or the fixed row count of the received tensors."""
    backend_state: torch.Tensor | None = None
    """Backend-specific device data (e.g. where each token landed in a peer's buffer), or None."""
    summation_order: torch.Tensor | None = None
    """[T, R] int32: per token, the ranks in the order a combine adds their rows
    (`ep_moe.buffer.routing_layout.summation_order`), or None: increasing rank (one rank, or a dispatch without top-k)."""

    @property
    def num_tokens(self) -> int:
        """T: the token count of the dispatch that made this handle, on this rank."""
        return self.is_token_in_rank.shape[0]

    @property
    def num_ranks(self) -> int:
        """R: the group size of the dispatch that made this handle."""
        return self.rank_prefix_matrix.shape[0]

    @property
    def num_recv_rows(self) -> int:
        """Rows of the received tensors (N): ``num_worst_tokens`` if set, else the received count."""
        return self.num_worst_tokens if self.num_worst_tokens > 0 else self.num_recv_tokens
