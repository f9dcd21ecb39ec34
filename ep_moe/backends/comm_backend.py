"""The interface every communication backend implements. `ep_moe.Buffer` validates arguments, handles
streams and events, then calls one of these; backends never see unchecked input."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..buffer.argument_checks import HIDDEN_DTYPES
from ..buffer.dispatch_handle import DispatchHandle
from ..buffer.routing_layout import dispatch_layout
from ..config import Config


class DispatchResult(NamedTuple):
    """What a backend's dispatch returns (N = received rows, L = local experts, K = top-k)."""

    recv_x: torch.Tensor                      # [N, H], x's dtype
    recv_scales: torch.Tensor | None          # [N, H/128] fp32 for FP8 input, else None
    recv_topk_idx: torch.Tensor | None        # [N, K] int64, local expert ids, -1 elsewhere
    recv_topk_weights: torch.Tensor | None    # [N, K] fp32, 0 where not local
    num_recv_tokens_per_expert: torch.Tensor | None  # [L] int64, aligned counts
    handle: DispatchHandle
    # The same aligned counts on the host, when the backend knows them without waiting for the GPU (both
    # backends exchange them with the row counts); None: read `num_recv_tokens_per_expert`.
    num_recv_tokens_per_expert_list: list[int] | None = None
    # A dispatch with ``consume`` (rows left in place; recv_x and recv_scales are None): what it returned
    consumed: object = None


class ReceivedRows(NamedTuple):
    """Where the received rows of a dispatch that left them in place are (rank-major row i, N rows): this
    rank's own rows (``rank_prefix_matrix[rank - 1, rank] <= i < [rank, rank]``, read on the device) are
    ``own_x[own_tokens[i - first]]``, every other row is ``rows[i]`` (a view of the receive buffer). Valid only
    until the next collective call of the same buffer on the dispatch's stream (peers write the buffer again
    then): read them in ``consume``."""

    rows: torch.Tensor                 # [>= N, H] x's dtype: the receive buffer's rows
    scales: torch.Tensor | None        # [>= N, S] fp32 (FP8 rows), else None
    num_rows: int                      # N (``num_worst_tokens`` in fixed size: rows past the total are padding)
    own_x: torch.Tensor                # [T, H] this rank's input
    own_scales: torch.Tensor | None    # [T, S]
    own_tokens: torch.Tensor           # [T] int32: the token of each own row, in order
    rank_prefix_matrix: torch.Tensor   # [R, R] int32
    rank: int


class CommBackend(ABC):
    """One EP group's transport. ``rank``/``num_ranks`` are positions inside ``group``."""

    name: str = "?"
    supported_dtypes: tuple[torch.dtype, ...] = HIDDEN_DTYPES  # of x in dispatch and combine (FP8 aside)
    # True: an exact-size fresh dispatch always fills `DispatchResult.num_recv_tokens_per_expert_list`.
    host_expert_counts: bool = False

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = device
        self.timeout_s = timeout_s

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)``;
        torch ops by default, a kernel where a backend has one (it must give the same values)."""
        return dispatch_layout(topk_idx, num_experts, self.num_ranks)

    @abstractmethod
    def dispatch(self, x: torch.Tensor, x_scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                 topk_weights: torch.Tensor | None, is_token_in_rank: torch.Tensor,
                 num_tokens_per_rank: torch.Tensor | None, handle: DispatchHandle | None,
                 num_experts: int, expert_alignment: int, num_worst_tokens: int, config: Config) -> DispatchResult:
        """Send each row of ``x`` (and its scales and top-k rows) to every rank marked in
        ``is_token_in_rank``; with ``handle``, repeat that handle's layout (cached dispatch, no top-k)."""

    def receives_in_place(self, row_bytes: int, num_experts: int) -> bool:
        """Whether a fresh dispatch of rows of ``row_bytes`` bytes to ``num_experts`` experts (0: a cached
        dispatch, with a handle) can leave its received rows in place (``dispatch(..., consume=fn)``:
        ``fn(result, ReceivedRows)`` runs on the dispatch's stream before it returns; a cached dispatch's
        ``result`` has no top-k). Decided from shapes alone, the same on every rank. None do by default."""
        return False

    def combines_expert_rows(self, row_bytes: int) -> bool:
        """Whether a combine can take expert-major rows of ``row_bytes`` bytes and form each rank-major row as it
        goes out (``combine(y [M, H], ..., expert_rows=(sorted_slots [N, K], weights [M] or None))``: row i is
        the fp32 sum over its slots, in order, of ``weights[s] * y[s]``, rounded once). None do by default."""
        return False

    @abstractmethod
    def combine(self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
                bias: tuple[torch.Tensor | None, torch.Tensor | None], config: Config
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Send each received row back to its source and sum per token in fp32: the biases first, then the rows
        in ``handle.summation_order`` (increasing rank where it is None); one rounding."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group arrives (with the backend's timeout)."""

    def destroy(self) -> None:
        """Release backend resources; the default holds none."""
