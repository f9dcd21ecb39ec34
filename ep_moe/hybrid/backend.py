"""The ``hybrid`` backend: dispatch and combine in two hops over torch.distributed (docs/hybrid.md).

A group of R = S x G ranks (S nodes of G ranks, `LogicalTopology`). Rank (n, l) is node n's rank of local index l.

* Dispatch. Scale-out hop: a token of rank (n_s, l) crosses to each node n it has an expert on, once, to the
  forwarder (n, l) (an all-to-all among the S ranks of local index l). Scale-up hop: the forwarder sends each row
  it holds to the ranks of its node that own one of the row's experts (an all-to-all among the node's G ranks).
  The receiver puts the rows in the flat order (source rank, then token), so the outputs and the handle are those
  of the flat `TorchBackend`, bit for bit, and everything above (`ep_moe.ops`, `ep_moe.expert_major`,
  `ep_moe.ElasticBuffer`) works unchanged.
* Combine, the way back. Scale-up hop: every row returns to the forwarder it came from. Scale-out hop: the
  forwarder relays each (token, destination rank) row to the source, unreduced, and the source sums them in fp32
  in increasing rank and rounds once: the flat combine's order, hence its bits. Reducing inside the node first
  would halve the network rows but change the rounding (an fp32 sum is not associative), so it is not done.

Both hops use equal-split all-to-alls of fixed slots: ``num_worst_tokens`` rows per peer in fixed mode (no host
read anywhere, CUDA-graph capturable), the largest exchanged count in exact mode (one host read, in the count
exchange, as the flat backend). Every wait has the backend's deadline and its error names the hop. The
scale-up hop uses torch.distributed collectives too (NCCL on GPU): the native NVLink kernels are not used here.

`HopTraffic` counts what each rank sends to other ranks per operation and hop (payload rows and bytes on CPU,
where counting costs no host sync; the collectives' wire bytes everywhere).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..backends import agreement
from ..backends.agreement import HEADER_LEN
from ..backends.base import DispatchResult
from ..backends.torch_backend import TorchBackend, _source_ranks, as_bytes, from_bytes
from ..handle import DispatchHandle
from ..layout import aligned_expert_counts, local_topk
from .topology import LogicalTopology

HOPS = ("scaleout", "scaleup")
OPS = ("dispatch", "cached_dispatch", "combine")
_INT64_MAX = torch.iinfo(torch.int64).max


@dataclass
class HopCount:
    """What one rank sent to other ranks over one hop (its own slot excluded), summed over calls."""

    rows: int = 0        # payload rows (-1 once a call could not count them without a host sync)
    bytes: int = 0       # payload bytes (rows x row bytes; -1 likewise)
    wire_bytes: int = 0  # bytes the all-to-alls carried to other ranks, empty slot rows included
    calls: int = 0


@dataclass
class HopTraffic:
    """Per-(operation, hop) counters of one rank: ``traffic.get("dispatch", "scaleout").rows``."""

    counts: dict[tuple[str, str], HopCount] = field(default_factory=dict)

    def get(self, op: str, hop: str) -> HopCount:
        if op not in OPS or hop not in HOPS:
            raise ValueError(f"HopTraffic.get: arguments must be one of {OPS} and {HOPS}, got {op!r}, {hop!r}")
        return self.counts.setdefault((op, hop), HopCount())

    def add(self, op: str, hop: str, rows: int | None, row_bytes: int, wire_bytes: int) -> None:
        count = self.get(op, hop)
        if rows is None or count.rows < 0:
            count.rows = count.bytes = -1
        else:
            count.rows += rows
            count.bytes += rows * row_bytes
        count.wire_bytes += wire_bytes
        count.calls += 1

    def reset(self) -> None:
        self.counts.clear()


@dataclass
class _Plan:
    """Where rows go for one handle on this rank (all int64 on the device; "spare" = one past the slots).

    slot1 [T, S]: each token's slot in the scale-out send buffer (node n's chunk n*C1...), spare S*C1 if none.
    slot2 [S*C1, G]: each forwarded row's slot in the scale-up send buffer (l' * C2 + j), spare G*C2.
    perm [N]: each output row's place among the G*C2 rows received by the scale-up hop; spare G*C2 for padding.
    """

    c1: int
    c2: int
    slot1: torch.Tensor
    slot2: torch.Tensor
    perm: torch.Tensor


class HybridBackend(TorchBackend):
    """Two-hop dispatch/combine (module docstring) on ``group`` viewed as ``topology``.

    Uses two subgroups made with ``dist.new_group`` (only their members take part; made once per process, `_subgroup`):
    the scale-out group of this rank's local index and the scale-up group of its node. ``traffic``: this rank's `HopTraffic`."""

    name = "hybrid"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                 topology: LogicalTopology) -> None:
        super().__init__(group, device, timeout_s)
        if topology.num_ranks != self.num_ranks:
            raise ValueError(f"HybridBackend: argument 'topology' must have {self.num_ranks} ranks (the group's), "
                             f"got {topology.num_ranks}")
        self.topology = topology
        self.num_nodes, self.per_node = topology.num_scaleout_ranks, topology.num_scaleup_ranks
        self.node, self.local = topology.node_of[self.rank], topology.local_of[self.rank]
        self.scaleout_members = topology.scaleout_members(self.local)  # group ranks, by node
        self.scaleup_members = topology.scaleup_members(self.node)     # group ranks, by local index
        global_ranks = dist.get_process_group_ranks(group)
        timeout = timedelta(seconds=timeout_s)
        self.scaleout_group = _subgroup([global_ranks[r] for r in self.scaleout_members], timeout,
                                        f"ep_moe_scaleout_l{self.local}")
        self.scaleup_group = _subgroup([global_ranks[r] for r in self.scaleup_members], timeout,
                                       f"ep_moe_scaleup_n{self.node}")
        grid = [topology.scaleup_members(n) for n in range(self.num_nodes)]
        self._grid = torch.tensor(grid, dtype=torch.int64, device=device)  # [S, G] group ranks
        self._count_payload = device.type == "cpu"  # counting payload rows reads the device
        self._plans: dict[int, tuple[torch.Tensor, int, int]] = {}  # id(backend_state) -> (state, C1, C2)
        self.traffic = HopTraffic()

    # ---------------------------------------------------------------- one hop
    def _hop(self, hop: str, send: torch.Tensor, num_peers: int, capacity: int, op: str) -> torch.Tensor:
        """Equal-split all-to-all of ``send [num_peers * capacity, B]`` (chunk p to peer p of the hop) over the
        hop's subgroup; returns ``[num_peers * capacity, B]`` (chunk p from peer p)."""
        if num_peers == 1 or send.shape[0] == 0 or send.shape[1] == 0:  # the sizes are equal on every peer
            return send.clone()
        group = self.scaleout_group if hop == "scaleout" else self.scaleup_group
        members = self.scaleout_members if hop == "scaleout" else self.scaleup_members
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        what = ("scale-out hop (network, among the same-index ranks of the nodes)" if hop == "scaleout"
                else "scale-up hop (inside the node)")
        self._wait(work, f"{op}/{hop}: the {what}, group ranks {members}")
        return recv

    @staticmethod
    def _slots(mask: torch.Tensor, capacity: int) -> torch.Tensor:
        """``[N, P]`` slot of row i for peer p: ``p * capacity`` + its place among the rows for p (in row order),
        or the spare ``P * capacity`` where ``mask`` is False."""
        position = torch.cumsum(mask.to(torch.int64), dim=0) - 1
        base = torch.arange(mask.shape[1], device=mask.device) * capacity
        return torch.where(mask, base + position, mask.shape[1] * capacity)

    @staticmethod
    def _scatter(rows: torch.Tensor, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
        """``[num_slots, B]`` zeros with ``rows[i]`` copied to each ``slots[i, p]`` below ``num_slots``."""
        send = torch.zeros(num_slots + 1, rows.shape[1], dtype=rows.dtype, device=rows.device)
        for p in range(slots.shape[1]):
            send.index_copy_(0, slots[:, p], rows)
        return send[:num_slots]

    def _count(self, op: str, hop: str, rows_fn, row_bytes: int, others: int, capacity: int) -> None:
        """Record a hop: payload rows from ``rows_fn()`` (on CPU only) and the wire bytes to ``others`` peers."""
        rows = int(rows_fn()) if self._count_payload else None
        self.traffic.add(op, hop, rows, row_bytes, others * capacity * row_bytes)

    def _forward(self, op: str, rows: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Both hops of a dispatch for ``rows [T, B]`` uint8: ``(recv1 [S*C1, B], recv2 [G*C2, B])``."""
        S, G, c1, c2, row_bytes = self.num_nodes, self.per_node, plan.c1, plan.c2, rows.shape[1]
        recv1 = self._hop("scaleout", self._scatter(rows, plan.slot1, S * c1), S, c1, op)
        others = [n for n in range(S) if n != self.node]
        self._count(op, "scaleout", lambda: (plan.slot1[:, others] < S * c1).sum(), row_bytes, S - 1, c1)
        recv2 = self._hop("scaleup", self._scatter(recv1, plan.slot2, G * c2), G, c2, op)
        peers = [lo for lo in range(G) if lo != self.local]
        self._count(op, "scaleup", lambda: (plan.slot2[:, peers] < G * c2).sum(), row_bytes, G - 1, c2)
        return recv1, recv2

    # ---------------------------------------------------------------- plans kept in the handle
    def _state(self, plan: _Plan) -> torch.Tensor:
        head = torch.empty(2, dtype=torch.int64, device=self.device)  # fills, not a host copy: graph-capturable
        head[0].fill_(plan.c1)
        head[1].fill_(plan.c2)
        return torch.cat([head, plan.slot1.flatten(), plan.slot2.flatten(), plan.perm])

    def _plan_of(self, handle: DispatchHandle) -> _Plan:
        """The plan packed into ``handle.backend_state`` (by `dispatch`). Its two sizes are known without a
        host read in fixed mode (both ``num_worst_tokens``) and for a handle this backend made; else read."""
        state = handle.backend_state
        if state is None or state.dtype != torch.int64 or state.dim() != 1:
            raise ValueError("ep_moe.hybrid: argument 'handle' must come from a dispatch on the hybrid backend "
                             "(its backend_state holds the two-hop plan)")
        known = self._plans.get(id(state))
        if known is not None and known[0] is state:
            c1, c2 = known[1], known[2]
        elif handle.num_worst_tokens:
            c1 = c2 = handle.num_worst_tokens
        else:
            c1, c2 = (int(v) for v in state[:2].tolist())
        T, S, G, N = handle.num_tokens, self.num_nodes, self.per_node, handle.num_recv_rows
        if state.numel() != 2 + T * S + S * c1 * G + N:
            raise ValueError("ep_moe.hybrid: argument 'handle' does not match this group's topology "
                             f"({S} x {G}) or its own sizes")
        body = state[2:]
        slot1, body = body[:T * S].view(T, S), body[T * S:]
        slot2, perm = body[:S * c1 * G].view(S * c1, G), body[S * c1 * G:]
        return _Plan(c1, c2, slot1, slot2, perm)

    def _remember(self, state: torch.Tensor, plan: _Plan) -> None:
        key = id(state)
        self._plans[key] = (state, plan.c1, plan.c2)
        weakref.finalize(state, self._plans.pop, key, None)

    def _check_handle_call(self, op: int, op_name: str, x: torch.Tensor, handle: DispatchHandle, topk: int) -> None:
        values = agreement.header(op, x.shape[1], x.dtype, 0, topk, 0, handle.num_worst_tokens)
        digest = agreement.layout_digest(handle.rank_prefix_matrix, self._digest_multipliers)
        stage = "dispatch/cached/check" if op == agreement.OP_CACHED_DISPATCH else "combine/check"
        self._agree(op_name, self._all_gather_counts(self._header(values, digest), stage))

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, handle,
                 num_experts, expert_alignment, num_worst_tokens, config=None) -> DispatchResult:
        if x_scales is not None:
            raise ValueError("ep_moe.dispatch: argument 'x' must be a bf16/fp32 tensor on the hybrid backend "
                             "(FP8 dispatch is not provided in hybrid mode), got an FP8 pair")
        if handle is not None:
            return self._cached_dispatch(x, handle)
        S, G, R, me = self.num_nodes, self.per_node, self.num_ranks, self.rank
        T, K, W = x.shape[0], topk_idx.shape[1], num_worst_tokens
        in_node = is_token_in_rank[:, self._grid.flatten()].view(T, S, G).any(dim=2)  # [T, S]
        head = self._header(agreement.header(agreement.OP_DISPATCH, x.shape[1], x.dtype, 0, K, num_experts, W))
        gathered = self._all_gather_counts(torch.cat([head, num_tokens_per_rank.to(torch.int64),
                                                      in_node.sum(dim=0)]), "dispatch/notify")  # [R, HL + R + S]
        table = None if W else gathered.tolist()  # exact mode: the one host read
        self._agree("dispatch", gathered, table)
        count_matrix = gathered[:, HEADER_LEN:HEADER_LEN + R]         # rows [source, destination rank]
        node_matrix = gathered[:, HEADER_LEN + R:]                    # tokens [source, destination node]
        # rows forwarder (n, l'') sends to rank q of node n: from the sources of local index l'', [G, R]
        from_forwarder = count_matrix[self._grid].sum(dim=0)
        if W:
            c1 = c2 = num_rows = W
            _check_fixed(count_matrix.sum(dim=0).max(), node_matrix.max(), W)
        else:
            counts = [row[HEADER_LEN:HEADER_LEN + R] for row in table]
            c1 = max(max(row[HEADER_LEN + R:]) for row in table)
            c2 = max(sum(counts[s][q] for s in self.topology.scaleout_members(lo)) for lo in range(G)
                     for q in range(R))
            num_rows = sum(row[me] for row in counts)

        token_index = torch.arange(T, dtype=torch.int64, device=x.device)[:, None]
        source = torch.full((T, 1), me, dtype=torch.int64, device=x.device)
        x_bytes = as_bytes(x)
        rows = torch.cat([x_bytes, as_bytes(topk_idx), as_bytes(topk_weights), as_bytes(token_index),
                          as_bytes(source)], dim=1)
        col_idx, col_w = x_bytes.shape[1], x_bytes.shape[1] + 8 * K
        col_tok, col_src = col_w + 4 * K, col_w + 4 * K + 8

        # scale-out hop, then the forwarder's view: the rows of the sources of local index l, by node then token
        plan = _Plan(c1, c2, self._slots(in_node, c1), torch.empty(0), torch.empty(0))
        S_c1 = S * c1
        recv1 = self._hop("scaleout", self._scatter(rows, plan.slot1, S_c1), S, c1, "dispatch")
        others = [n for n in range(S) if n != self.node]
        self._count("dispatch", "scaleout", lambda: (plan.slot1[:, others] < S_c1).sum(), rows.shape[1], S - 1, c1)
        sent_here = node_matrix[self._grid[:, self.local], self.node]  # [S] rows from each node's forwarder
        valid1 = (torch.arange(c1, device=x.device)[None, :] < sent_here[:, None]).flatten()
        idx1 = from_bytes(recv1[:, col_idx:col_w], torch.int64, K).masked_fill(~valid1[:, None], -1)
        experts_per_rank = num_experts // R
        owner = torch.where(idx1 >= 0, idx1 // experts_per_rank, -1)  # [S*C1, K] destination rank of each pair
        in_peer = (owner[:, :, None] == self._grid[self.node][None, None, :]).any(dim=1)  # [S*C1, G]
        plan.slot2 = self._slots(in_peer, c2)

        # scale-up hop; then the flat order: by source rank, then token
        recv2 = self._hop("scaleup", self._scatter(recv1, plan.slot2, G * c2), G, c2, "dispatch")
        peers = [lo for lo in range(G) if lo != self.local]
        self._count("dispatch", "scaleup", lambda: (plan.slot2[:, peers] < G * c2).sum(), rows.shape[1], G - 1, c2)
        valid2 = (torch.arange(c2, device=x.device)[None, :] < from_forwarder[:, me][:, None]).flatten()
        src2 = from_bytes(recv2[:, col_src:col_src + 8], torch.int64, 1)[:, 0]
        tok2 = from_bytes(recv2[:, col_tok:col_src], torch.int64, 1)[:, 0]
        key = torch.where(valid2, src2 * (1 << 32) + tok2, _INT64_MAX)
        order = torch.argsort(key, stable=True)[:num_rows]
        valid = valid2.index_select(0, order)
        plan.perm = torch.where(valid, order, G * c2)
        out = torch.cat([recv2, recv2.new_zeros(1, recv2.shape[1])]).index_select(0, plan.perm)

        recv_x = from_bytes(out[:, :col_idx], x.dtype, x.shape[1])
        recv_idx = from_bytes(out[:, col_idx:col_w], torch.int64, K).masked_fill(~valid[:, None], -1)
        recv_w = from_bytes(out[:, col_w:col_tok], torch.float32, K)
        recv_src = from_bytes(out[:, col_tok:col_src], torch.int64, 1)[:, 0].masked_fill(~valid, -1)
        src_rank = _source_ranks(count_matrix[:, me], num_rows)
        state = self._state(plan)
        self._remember(state, plan)
        new = DispatchHandle(torch.cumsum(count_matrix, dim=0).to(torch.int32), recv_src.to(torch.int32), src_rank,
                             is_token_in_rank, -1 if W else num_rows, W, state)
        local_idx, local_w = local_topk(recv_idx, recv_w, me, experts_per_rank)
        counts = aligned_expert_counts(local_idx, experts_per_rank, expert_alignment)
        return DispatchResult(recv_x, None, local_idx, local_w, counts, new, None if W else counts.tolist())

    def _cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle) -> DispatchResult:
        plan = self._plan_of(handle)
        self._check_handle_call(agreement.OP_CACHED_DISPATCH, "dispatch", x, handle, 0)
        _, recv2 = self._forward("cached_dispatch", as_bytes(x), plan)
        out = torch.cat([recv2, recv2.new_zeros(1, recv2.shape[1])]).index_select(0, plan.perm)
        return DispatchResult(from_bytes(out, x.dtype, x.shape[1]), None, None, None, None, handle)

    # ---------------------------------------------------------------- combine
    def combine(self, y, handle, topk_weights, bias, config=None):
        plan = self._plan_of(handle)
        self._check_handle_call(agreement.OP_COMBINE, "combine", y, handle,
                                topk_weights.shape[1] if topk_weights is not None else -1)
        S, G, c1, c2 = self.num_nodes, self.per_node, plan.c1, plan.c2
        T, hidden = handle.num_tokens, y.shape[1]
        y_bytes = as_bytes(y)
        rows = y_bytes if topk_weights is None else torch.cat([y_bytes, as_bytes(topk_weights)], dim=1)
        row_bytes = rows.shape[1]

        # scale-up hop back: each row to the forwarder it came from, at the slot it was sent from
        send2 = torch.zeros(G * c2 + 1, row_bytes, dtype=torch.uint8, device=y.device)
        send2.index_copy_(0, plan.perm, rows)
        back2 = self._hop("scaleup", send2[:G * c2], G, c2, "combine")
        self._count("combine", "scaleup", lambda: ((plan.perm < G * c2) & (plan.perm // c2 != self.local)).sum(),
                    row_bytes, G - 1, c2)

        # scale-out hop back: the forwarder relays every (token, rank) row, unreduced, to the token's source node;
        # block (n', l') of C1 rows holds, in token order, the rows of rank (n, l') for source (n', l)
        sent = (plan.slot2 < G * c2).view(S, c1, G)
        position = torch.cumsum(sent.to(torch.int64), dim=1) - 1
        block = (torch.arange(S, device=y.device)[:, None, None] * G + torch.arange(G, device=y.device)) * c1
        dest = torch.where(sent, block + position, S * G * c1).flatten()
        src = torch.where(sent.flatten(), plan.slot2.flatten(), 0)
        send1 = torch.zeros(S * G * c1 + 1, row_bytes, dtype=torch.uint8, device=y.device)
        send1.index_copy_(0, dest, back2.index_select(0, src) if back2.shape[0] else back2.new_zeros(src.shape[0],
                                                                                                   row_bytes))
        back1 = self._hop("scaleout", send1[:S * G * c1], S, G * c1, "combine")
        others = [n for n in range(S) if n != self.node]
        self._count("combine", "scaleout", lambda: sent[others].sum(), row_bytes, S - 1, G * c1)

        # the source: sum over ranks in increasing order, in fp32 (fp64 for fp64), round once (the flat order)
        acc_dtype = torch.promote_types(y.dtype, torch.float32)
        acc = torch.zeros(T + 1, hidden, dtype=acc_dtype, device=y.device)
        acc_w = None
        if topk_weights is not None:
            acc_w = torch.zeros(T + 1, topk_weights.shape[1], dtype=torch.float32, device=y.device)
        tokens = torch.arange(T, device=y.device)
        for q in range(self.num_ranks):
            in_q = handle.is_token_in_rank[:, q]
            where = (self.topology.node_of[q] * G + self.topology.local_of[q]) * c1 + torch.cumsum(in_q.long(), 0) - 1
            picked = back1.index_select(0, torch.where(in_q, where, 0)) if back1.shape[0] else \
                back1.new_zeros(T, row_bytes)
            target = torch.where(in_q, tokens, T)
            acc.index_add_(0, target, from_bytes(picked[:, :y_bytes.shape[1]], y.dtype, hidden).to(acc_dtype))
            if acc_w is not None:
                acc_w.index_add_(0, target, from_bytes(picked[:, y_bytes.shape[1]:], torch.float32, acc_w.shape[1]))
        acc = acc[:T]
        for b in bias:
            if b is not None:
                acc = acc + b.to(acc_dtype)
        return acc.to(y.dtype), (acc_w[:T] if acc_w is not None else None)

    def destroy(self) -> None:
        """The subgroups stay (shared by every buffer on the same ranks, `_subgroup`)."""
        self.scaleout_group = self.scaleup_group = None


_SUBGROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _subgroup(global_members: list[int], timeout: timedelta, desc: str) -> dist.ProcessGroup:
    """The process group of ``global_members`` (in that order: its rank k is member k), made once per process and
    reused by every later buffer: a group made with ``use_local_synchronization`` (only its members take part) is
    named by its ranks, so making it again, even after destroying it, would meet the old one's rendezvous keys."""
    key = tuple(global_members)
    group = _SUBGROUPS.get(key)
    if group is not None:
        try:
            dist.get_world_size(group)  # still registered (not destroyed with the default group)
            return group
        except (RuntimeError, ValueError):
            pass
    # sort_ranks=False: a subgroup's rank k is member k, so all-to-all chunk k is node k / local index k.
    group = dist.new_group(list(global_members), timeout=timeout, use_local_synchronization=True,
                           sort_ranks=False, group_desc=desc)
    _SUBGROUPS[key] = group
    return group


def _check_fixed(most_received: torch.Tensor, most_per_node: torch.Tensor, num_worst_tokens: int) -> None:
    """Fixed mode: every rank receives at most ``num_worst_tokens`` rows and every (source, node) pair moves at
    most that many tokens; on the device on GPU (no host sync)."""
    if most_received.device.type == "cpu":
        for what, value in (("the most rows any rank receives", int(most_received)),
                            ("the most tokens one rank sends to one node", int(most_per_node))):
            if value > num_worst_tokens:
                raise ValueError(f"ep_moe.dispatch: argument 'num_worst_tokens' must be >= {what} ({value}) on "
                                 f"the hybrid backend, got {num_worst_tokens}")
    else:
        torch._assert_async(torch.maximum(most_received, most_per_node) <= num_worst_tokens,
                            "ep_moe.dispatch (hybrid): more rows than 'num_worst_tokens'")


__all__ = ["HOPS", "OPS", "HopCount", "HopTraffic", "HybridBackend"]
