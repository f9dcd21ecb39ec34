"""The ``torch`` backend: dispatch and combine over torch.distributed collectives.

Works with gloo (CPU) and NCCL (GPU, one or many nodes). Rows travel as raw bytes, so every dtype
(bf16, fp32, FP8) is copied bit for bit. Two exchange modes:

* exact (``num_worst_tokens == 0``): one all-gather of the per-rank row counts and per-expert pair
  counts, then a variable-split all-to-all. The counts are read on the host once (one sync on GPU),
  which also gives the receiver its per-expert counts without waiting for the data.
* fixed (``num_worst_tokens > 0``): every (source, destination) pair gets a slot of
  ``num_worst_tokens`` rows and the all-to-all has equal splits, so nothing waits on the host and the
  calls can be captured in a CUDA graph; received rows are then compacted on the device.

Before any row moves, every call checks that the ranks agree on the values that size its exchanges
(`ep_moe.backends.agreement`): a fresh dispatch's header travels in its count exchange, a cached
dispatch and a combine all-gather theirs (8 int64). A disagreement raises the same ValueError on every
rank instead of a collective of mismatched sizes (which aborts gloo and hangs NCCL).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..buffer.dispatch_handle import DispatchHandle
from ..buffer.routing_layout import aligned_expert_counts, count_values, local_topk, round_up
from . import agreement
from .agreement import HEADER_LEN
from .comm_backend import CommBackend, DispatchResult


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a ``[N, ...]`` tensor as ``[N, bytes]`` uint8 (copying only if it is not contiguous)."""
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    t = t.contiguous()
    if t.dim() > 1 and t.stride(-1) != 1:  # a size-1 last dim counts as contiguous with any stride
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8).reshape(t.shape[0], row_bytes)


def from_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """Inverse of `as_bytes` for a ``[N, bytes]`` uint8 slice: ``[N, cols]`` of ``dtype``."""
    # A slice of 0 or 1 rows counts as contiguous yet keeps the parent's row stride and offset, which
    # view(dtype) rejects: copy those into fresh storage too.
    if b.shape[0] <= 1 or not b.is_contiguous():
        b = b.clone(memory_format=torch.contiguous_format)
    return b.view(dtype).reshape(b.shape[0], cols)


@dataclass
class _Route:
    """Where rows go for one handle, on this rank (see the module docstring for the two modes)."""

    send_idx: torch.Tensor            # [N_send] int64: local token of each sent row, by (dest, t)
    send_counts: list[int] | None     # rows to each destination (exact mode)
    recv_counts: list[int] | None     # rows from each source (exact mode)
    slot_of_token: torch.Tensor | None  # [T, R] int64 row in the fixed send buffer, or the spare row
    slot_of_recv: torch.Tensor | None   # [R * C] int64 row of the output for each received slot row
    digest: torch.Tensor | None = None  # the handle's layout digest (`agreement`), once computed (exact mode)


class TorchBackend(CommBackend):
    name = "torch"
    host_expert_counts = True
    supported_dtypes = (torch.bfloat16, torch.float32, torch.float64)  # fp64 serves gradcheck

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        super().__init__(group, device, timeout_s)
        # Exact-mode routes of live handles, so that combine and cached dispatch read no counts on the
        # host again. Keyed by the identity of the handle's rank_prefix_matrix (made fresh by every
        # dispatch) and is_token_in_rank; an entry goes when its rank_prefix_matrix is freed. A miss
        # (e.g. a handle rebuilt from saved tensors) only costs the host sync.
        self._routes: dict[tuple[int, int], _Route] = {}
        # A fresh dispatch's count exchange carries, after the header and the row counts, `_expert_slots`
        # per-expert pair counts: the most experts an exact-size dispatch on this group has used so far. It
        # changes only after an exchange every rank saw, so it is equal on every rank, and the exchange's
        # size never depends on the call's own num_experts (which the ranks might disagree on).
        self._expert_slots = 0
        self._digest_multipliers = agreement.digest_multipliers(self.num_ranks, device)
        self._device_headers: dict[tuple[int, ...], torch.Tensor] = {}  # GPU: header tensors by value

    # ---------------------------------------------------------------- agreement between ranks
    def _header(self, values: tuple[int, ...], digest: torch.Tensor | None = None) -> torch.Tensor:
        """The ``[HEADER_LEN]`` int64 header on the device: ``values`` (`agreement.header`), then the layout
        digest (0 without one). On a GPU the constant part is made once per value, with no host sync."""
        key = values + (0,)
        if self.device.type == "cpu":
            static = torch.tensor(key, dtype=torch.int64, device="cpu")
        else:
            static = self._device_headers.get(key)
            if static is None:
                if torch.cuda.is_current_stream_capturing():  # fills are captured; a host copy is not
                    static = torch.empty(len(key), dtype=torch.int64, device=self.device)
                    for i, v in enumerate(key):
                        static[i].fill_(v)
                else:
                    static = torch.tensor(key, dtype=torch.int64, device="cpu").pin_memory().to(self.device,
                                                                                                non_blocking=True)
                if len(self._device_headers) < 256:
                    self._device_headers[key] = static
        return static if digest is None else torch.cat([static[:-1], digest.view(1)])

    def _agree(self, op_name: str, gathered: torch.Tensor, host: list[list[int]] | None = None) -> None:
        """Raise the ValueError of `agreement.check_headers` unless every rank's header (the first columns of
        ``gathered [R, *]``, or of its host copy ``host``) is the same. Where the rows are on a GPU and the
        host has no copy (it may not wait there), a device-side assert instead."""
        if host is None and gathered.device.type == "cpu":
            host = gathered[:, :HEADER_LEN].tolist()
        if host is not None:
            agreement.check_headers(op_name, [row[:HEADER_LEN] for row in host])
        else:
            agreement.assert_headers_on_device(gathered[:, :HEADER_LEN])

    def _digest(self, handle: DispatchHandle, route: _Route) -> torch.Tensor:
        """The handle's layout digest (kept in an exact-mode route, which outlives the call)."""
        if route.digest is not None:
            return route.digest
        digest = agreement.layout_digest(handle.rank_prefix_matrix, self._digest_multipliers)
        if route.slot_of_token is None:
            route.digest = digest
        return digest

    def _check_call(self, op: int, op_name: str, x: torch.Tensor, handle: DispatchHandle, route: _Route,
                    scales: int = 0, topk: int = 0) -> None:
        """A cached dispatch's or a combine's header: all-gathered (its own small collective) and checked."""
        values = agreement.header(op, x.shape[1], x.dtype, scales, topk, 0, handle.num_worst_tokens)
        stage = "dispatch/cached/check" if op == agreement.OP_CACHED_DISPATCH else "combine/check"
        self._agree(op_name, self._all_gather_counts(self._header(values, self._digest(handle, route)), stage))

    # ---------------------------------------------------------------- collectives with deadlines
    def _wait(self, work: dist.Work, stage: str) -> None:
        """Wait for ``work``; on CPU with a deadline that turns a missing peer into a TimeoutError."""
        if self.device.type != "cpu":
            # NCCL: enqueue a stream wait; a missing peer is caught by the process group's watchdog
            # (its timeout), since a host-side deadline here would serialize every call.
            work.wait()
            return
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            what = "timed out" if "timed out" in str(exc).lower() else "failed"
            err_type = TimeoutError if what == "timed out" else RuntimeError
            raise err_type(f"ep_moe[torch backend]: rank {self.rank} of {self.num_ranks} {what} in stage "
                           f"'{stage}' after waiting up to {self.timeout_s:g} s for its peers "
                           f"({exc})") from exc

    def _all_gather_counts(self, counts: torch.Tensor, stage: str) -> torch.Tensor:
        """All-gather an ``[R]`` int64 vector into the ``[R, R]`` matrix ``[source, destination]``."""
        out = torch.empty(self.num_ranks * counts.numel(), dtype=counts.dtype, device=counts.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
        self._wait(gather(out, counts, group=self.group, async_op=True), stage)
        return out.view(self.num_ranks, -1)

    def _all_to_all(self, send: torch.Tensor, recv_rows: int, send_counts: list[int] | None,
                    recv_counts: list[int] | None, stage: str) -> torch.Tensor:
        """Variable (counts given) or equal-split all-to-all of ``[rows, bytes]`` uint8 data."""
        recv = torch.empty(recv_rows, send.shape[1], dtype=torch.uint8, device=send.device)
        if send.shape[1] == 0:
            return recv
        work = dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group, async_op=True)
        self._wait(work, stage)
        return recv

    # ---------------------------------------------------------------- routes
    def _route(self, handle: DispatchHandle, count_matrix: torch.Tensor | None = None,
               counts: list[list[int]] | None = None) -> _Route:
        """Where rows go for ``handle``. Exact mode reads the count matrix on the host once (``counts``,
        when the caller already has it, saves that sync too)."""
        r, num_ranks = self.rank, self.num_ranks
        is_token_in_rank = handle.is_token_in_rank
        num_tokens = is_token_in_rank.shape[0]
        if handle.num_worst_tokens == 0:
            key = (id(handle.rank_prefix_matrix), id(is_token_in_rank))
            if key in self._routes:
                return self._routes[key]
            if counts is None:
                counts = (_counts_from_prefix(handle.rank_prefix_matrix) if count_matrix is None
                          else count_matrix).tolist()
            # nonzero over [R, T] yields (destination, token) pairs in that order: rows by (dest, t). Its
            # size is known from the counts, so the static variant adds no host sync.
            send_idx = torch.nonzero_static(is_token_in_rank.t(), size=sum(counts[r]))[:, 1]
            route = _Route(send_idx, counts[r], [row[r] for row in counts], None, None)
            self._routes[key] = route
            weakref.finalize(handle.rank_prefix_matrix, self._routes.pop, key, None)
            return route
        cap = handle.num_worst_tokens
        dest = torch.arange(num_ranks, device=self.device) * cap
        position = torch.cumsum(is_token_in_rank.to(torch.int64), dim=0) - 1
        spare = num_ranks * cap
        slot_of_token = torch.where(is_token_in_rank, dest + position, spare)
        # Received slot (s, j) holds the j-th row from s: it goes to output row prefix[s] + j if j < count[s].
        count_matrix = _counts_from_prefix(handle.rank_prefix_matrix) if count_matrix is None else count_matrix
        from_source = count_matrix[:, r].to(torch.int64)
        prefix = torch.cumsum(from_source, 0) - from_source
        j = torch.arange(cap, device=self.device).expand(num_ranks, cap)
        slot_of_recv = torch.where(j < from_source[:, None], prefix[:, None] + j, cap).flatten()
        send_idx = torch.arange(num_tokens, device=self.device)
        return _Route(send_idx, None, None, slot_of_token, slot_of_recv)

    def _send_rows(self, rows: torch.Tensor, route: _Route, num_recv_rows: int, stage: str) -> torch.Tensor:
        """Dispatch direction: ``rows [T, B]`` uint8 to ``[N, B]`` (by source, then token)."""
        if route.slot_of_token is None:
            send = rows.index_select(0, route.send_idx)
            return self._all_to_all(send, num_recv_rows, route.send_counts, route.recv_counts, stage)
        cap = num_recv_rows
        send = torch.zeros(self.num_ranks * cap + 1, rows.shape[1], dtype=torch.uint8, device=rows.device)
        for dest in range(self.num_ranks):
            send.index_copy_(0, route.slot_of_token[:, dest], rows)
        recv = self._all_to_all(send[:-1], self.num_ranks * cap, None, None, stage)
        out = torch.zeros(cap + 1, rows.shape[1], dtype=torch.uint8, device=rows.device)
        out.index_copy_(0, route.slot_of_recv, recv)
        return out[:cap]

    def _return_rows(self, rows: torch.Tensor, route: _Route, stage: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Combine direction: received ``rows [N, B]`` back to their sources. Returns, per destination
        rank in increasing order, ``(token indices, rows)`` on this (source) rank."""
        num_ranks = self.num_ranks
        if route.slot_of_token is None:
            back = self._all_to_all(rows, route.send_idx.numel(), route.recv_counts, route.send_counts, stage)
            chunks, start = [], 0
            for count in route.send_counts:
                chunks.append((route.send_idx[start:start + count], back[start:start + count]))
                start += count
            return chunks
        cap = rows.shape[0]
        send = torch.zeros(num_ranks * cap + 1, rows.shape[1], dtype=torch.uint8, device=rows.device)
        # The inverse of the dispatch compaction: output row i returns to its slot (s, j).
        inverse = torch.full((cap + 1,), num_ranks * cap, dtype=torch.int64, device=rows.device)
        inverse.index_copy_(0, route.slot_of_recv, torch.arange(num_ranks * cap, device=rows.device))
        send.index_copy_(0, inverse[:cap], rows)
        back = self._all_to_all(send[:-1], num_ranks * cap, None, None, stage).view(num_ranks, cap, -1)
        num_tokens = route.slot_of_token.shape[0]
        chunks = []
        for dest in range(num_ranks):
            slot = route.slot_of_token[:, dest]
            sent = slot < num_ranks * cap
            tokens = torch.where(sent, route.send_idx, num_tokens)  # spare accumulator row for the unsent
            chunks.append((tokens, back[dest].index_select(0, torch.where(sent, slot - dest * cap, 0))))
        return chunks

    # ---------------------------------------------------------------- dispatch / combine
    def dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, handle,
                 num_experts, expert_alignment, num_worst_tokens, config=None) -> DispatchResult:
        num_tokens = x.shape[0]
        num_scales = x_scales.shape[1] if x_scales is not None else 0
        cached = handle is not None
        if cached:
            count_matrix = None
            num_worst_tokens = handle.num_worst_tokens
            route = self._route(handle)
            self._check_call(agreement.OP_CACHED_DISPATCH, "dispatch", x, handle, route, scales=num_scales)
        else:
            # Rows per destination rank and (token, expert) pairs per expert travel together, after the
            # header: the receiver learns its per-expert counts from the same exchange, with no wait for the
            # data. The pairs fill `_expert_slots` slots (zeros where they do not fit: they follow below).
            first_pair, slots = HEADER_LEN + self.num_ranks, self._expert_slots
            in_range = (topk_idx >= 0) & (topk_idx < num_experts)
            pairs = count_values(torch.where(in_range, topk_idx, num_experts), num_experts + 1)[:num_experts]
            sent_pairs = pairs.new_zeros(slots) if num_experts > slots else \
                torch.cat([pairs, pairs.new_zeros(slots - num_experts)])
            head = self._header(agreement.header(agreement.OP_DISPATCH, x.shape[1], x.dtype, num_scales,
                                                 topk_idx.shape[1], num_experts, num_worst_tokens))
            gathered = self._all_gather_counts(torch.cat([head, num_tokens_per_rank.to(torch.int64), sent_pairs]),
                                               "dispatch/notify")  # [R, HEADER_LEN + R + slots]
            table = None if num_worst_tokens else gathered.tolist()  # exact mode: the one host sync
            self._agree("dispatch", gathered, table)  # before anything else uses the counts
            count_matrix = gathered[:, HEADER_LEN:first_pair]
            prefix_matrix = torch.cumsum(count_matrix, dim=0).to(torch.int32)
            counts = expert_table = None
            if table is not None:
                counts = [row[HEADER_LEN:first_pair] for row in table]
                if num_experts > slots:  # every rank has this num_experts (checked), so all grow together
                    expert_table = self._all_gather_counts(pairs, "dispatch/notify/experts").tolist()
                    self._expert_slots = num_experts
                else:
                    expert_table = [row[first_pair:first_pair + num_experts] for row in table]
            num_recv = -1 if num_worst_tokens else sum(row[self.rank] for row in counts)
            none = torch.empty(0, dtype=torch.int32, device=x.device)  # filled below
            handle = DispatchHandle(prefix_matrix, none, none, is_token_in_rank,
                                    num_recv, num_worst_tokens)
            route = self._route(handle, count_matrix, counts)
        num_rows = handle.num_recv_rows
        if num_worst_tokens and not cached:
            # Every rank has the whole count matrix: all raise together rather than leave peers waiting.
            _check_capacity(count_matrix.sum(dim=0).max(), num_worst_tokens)

        # x travels alone (so it lands in place, with no repacking copy); the small per-row metadata
        # -- FP8 scales, and for a fresh dispatch top-k ids, weights and token index -- in a second exchange.
        stage = "dispatch/cached" if cached else "dispatch"
        recv_x = from_bytes(self._send_rows(as_bytes(x), route, num_rows, stage), x.dtype, x.shape[1])
        meta = [as_bytes(x_scales)] if x_scales is not None else []
        if not cached:
            token_index = torch.arange(num_tokens, dtype=torch.int64, device=x.device)[:, None]
            meta += [as_bytes(topk_idx), as_bytes(topk_weights), as_bytes(token_index)]
        recv = self._send_rows(torch.cat(meta, dim=1), route, num_rows, stage + "/meta") if meta else None
        col = 0
        recv_scales = None
        if x_scales is not None:
            col = meta[0].shape[1]
            recv_scales = from_bytes(recv[:, :col], torch.float32, x_scales.shape[1])
        if cached:
            return DispatchResult(recv_x, recv_scales, None, None, None, handle)

        num_topk = topk_idx.shape[1]
        recv_idx = from_bytes(recv[:, col:col + 8 * num_topk], torch.int64, num_topk)
        recv_w = from_bytes(recv[:, col + 8 * num_topk:col + 12 * num_topk], torch.float32, num_topk)
        recv_src = from_bytes(recv[:, col + 12 * num_topk:col + 12 * num_topk + 8], torch.int64, 1)[:, 0]
        src_rank = _source_ranks(count_matrix[:, self.rank], num_rows)
        if num_worst_tokens:  # padding rows: no expert, no weight, no source
            pad = src_rank < 0
            recv_idx = recv_idx.masked_fill(pad[:, None], -1)
            recv_src = recv_src.masked_fill(pad, -1)
        experts_per_rank = num_experts // self.num_ranks
        local_idx, local_w = local_topk(recv_idx, recv_w, self.rank, experts_per_rank)
        handle = handle._replace(recv_src_idx=recv_src.to(torch.int32), recv_src_rank=src_rank)
        counts = aligned_expert_counts(local_idx, experts_per_rank, expert_alignment)
        counts_list = None
        if expert_table is not None:
            first = self.rank * experts_per_rank
            counts_list = [round_up(sum(row[first + e] for row in expert_table), expert_alignment)
                           for e in range(experts_per_rank)]
        return DispatchResult(recv_x, recv_scales, local_idx, local_w, counts, handle, counts_list)

    def combine(self, y, handle, topk_weights, bias, config=None):
        num_tokens, hidden = handle.num_tokens, y.shape[1]
        route = self._route(handle)
        self._check_call(agreement.OP_COMBINE, "combine", y, handle, route,
                         topk=topk_weights.shape[1] if topk_weights is not None else -1)
        chunks = self._return_rows(as_bytes(y), route, "combine")
        w_chunks = self._return_rows(as_bytes(topk_weights), route, "combine/weights") if topk_weights is not None \
            else [None] * len(chunks)
        acc_dtype = torch.promote_types(y.dtype, torch.float32)  # fp32, or fp64 for fp64 input
        acc = torch.zeros(num_tokens, hidden, dtype=acc_dtype, device=y.device)
        for b in bias:  # the biases first, then the rows (DeepEP V2's order)
            if b is not None:
                acc += b.to(acc_dtype)
        # slots[t, r]: token t's row from rank r among the returned rows, every rank's one after the other (past
        # them where there is none; row T takes the unsent rows of a fixed-size layout)
        total = sum(tokens.numel() for tokens, _ in chunks)
        slots = torch.full((num_tokens + 1, self.num_ranks), total, dtype=torch.int64, device=y.device)
        start = 0
        for rank, (tokens, _) in enumerate(chunks):
            slots[:, rank].index_copy_(0, tokens, torch.arange(start, start + tokens.numel(), device=y.device))
            start += tokens.numel()
        slots = slots[:num_tokens]
        rows = torch.cat([from_bytes(r, y.dtype, hidden) for _, r in chunks])
        acc = ordered_sum(acc, rows, slots, handle.summation_order)
        acc_w = None
        if topk_weights is not None:  # one nonzero weight per (token, k): increasing rank
            acc_w = ordered_sum(torch.zeros(num_tokens, topk_weights.shape[1], dtype=torch.float32, device=y.device),
                                torch.cat([from_bytes(w[1], torch.float32, topk_weights.shape[1]) for w in w_chunks]),
                                slots, None)
        return acc.to(y.dtype), acc_w

    def barrier(self) -> None:
        self._wait(dist.barrier(group=self.group, async_op=True), "barrier")


def ordered_sum(acc: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                 order: torch.Tensor | None) -> torch.Tensor:
    """``acc [N, C]`` plus, for each row i, the terms ``values[slots[i, order[i, j]]]`` for j = 0, 1, ... in turn
    (one rounded add each, in ``acc``'s dtype), skipping a slot ``>= len(values)`` (no term).

    Args:
        acc: ``[N, C]`` fp32/fp64, the sums' start.
        values: ``[V, C]`` the terms, converted to ``acc``'s dtype.
        slots: ``[N, P]`` int64 rows of ``values``.
        order: ``[N, P]`` int (each row a permutation of ``0..P-1``), or None: ``0..P-1``.

    Returns:
        ``[N, C]`` in ``acc``'s dtype.
    """
    spare = values.shape[0]
    padded = torch.cat([values, values.new_zeros(1, values.shape[1])]).to(acc.dtype)
    for j in range(slots.shape[1]):
        slot = slots[:, j] if order is None else slots.gather(1, order[:, j:j + 1].to(torch.int64))[:, 0]
        valid = slot < spare
        picked = padded.index_select(0, torch.where(valid, slot, spare))
        acc = torch.where(valid[:, None], acc + picked, acc)
    return acc


def _counts_from_prefix(rank_prefix_matrix: torch.Tensor) -> torch.Tensor:
    """``[R, R]`` rows sent ``[source, destination]`` from the cumulative ``rank_prefix_matrix``."""
    prefix = rank_prefix_matrix.to(torch.int64)
    return torch.diff(prefix, dim=0, prepend=torch.zeros_like(prefix[:1]))


def _source_ranks(from_source: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[N]`` int32 source rank of each received row (rows are grouped by source); -1 past the end."""
    ends = torch.cumsum(from_source.to(torch.int64), 0)
    rows = torch.arange(num_rows, device=from_source.device)
    src = torch.searchsorted(ends, rows, right=True)
    return torch.where(src < from_source.numel(), src, -1).to(torch.int32)


def _check_capacity(most_received: torch.Tensor, num_worst_tokens: int) -> None:
    """The most rows any rank receives must fit in ``num_worst_tokens``; checked on the device on GPU
    (no host sync)."""
    if most_received.device.type == "cpu":
        if int(most_received) > num_worst_tokens:
            raise ValueError(f"ep_moe.dispatch: argument 'num_worst_tokens' must be >= the most rows any rank "
                             f"receives ({int(most_received)}), got {num_worst_tokens}")
    else:
        torch._assert_async(most_received <= num_worst_tokens,
                            "ep_moe.dispatch: more rows received than 'num_worst_tokens'")
