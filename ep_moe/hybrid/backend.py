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

Rows sit in fixed slots per peer: ``num_worst_tokens`` rows in fixed mode, where every slot row crosses (equal
splits: no host read anywhere, CUDA-graph capturable); in exact mode (one host read, in the count exchange, as the
flat backend) the slots hold the largest exchanged count and the scale-out hop sends only the rows in use
(variable splits), while the scale-up hop exchanges whole slots. Every wait has the backend's deadline and its error names the hop. The
scale-up hop uses torch.distributed collectives too (NCCL on GPU): the native NVLink kernels are not used here.

`HopTraffic` counts what each rank sends to other ranks per operation and hop: the collectives' wire bytes
everywhere, the payload rows and bytes on CPU (and on GPU for the exact-mode scale-out hop, where they are known on
the host; elsewhere counting them would read the device, so they are -1 there).
"""

from __future__ import annotations

import inspect
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
    net (exact mode only, else None): the rows in use of each scale-out chunk, so that only they cross the network:
    ``(dispatch sent [S], dispatch received [S], combine sent [S*G], combine received [S*G])`` (combine chunks are
    G blocks of C1 rows, one per rank of the relaying node).
    """

    c1: int
    c2: int
    slot1: torch.Tensor
    slot2: torch.Tensor
    perm: torch.Tensor
    net: tuple[list[int], list[int], list[int], list[int]] | None = None


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
        self._plans: dict[int, tuple] = {}  # id(backend_state) -> (state, C1, C2, net)
        self.traffic = HopTraffic()

    # ---------------------------------------------------------------- one hop
    def _hop(self, op: str, hop: str, send: torch.Tensor, num_peers: int, capacity: int, payload_fn,
             counts: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
        """All-to-all of ``send [num_peers * capacity, B]`` (chunk p to peer p) over the hop's subgroup; returns
        ``[num_peers * capacity, B]`` (chunk p from peer p), and records the hop in `traffic` (payload rows from
        ``payload_fn()``, on CPU only). ``counts``: ``(sent, received)``, per peer and block (a chunk is
        ``len(sent) / num_peers`` equal blocks), the rows in use at the start of each block: only those cross
        (variable splits; exact mode); None: every slot row crosses (equal splits; fixed mode, no host read)."""
        others = [p for p in range(num_peers) if p != (self.node if hop == "scaleout" else self.local)]
        row_bytes = send.shape[1]
        if counts is None:
            wire_rows = len(others) * capacity
        else:
            per_peer = len(counts[0]) // num_peers
            wire_rows = sum(sum(counts[0][p * per_peer:(p + 1) * per_peer]) for p in others)
        if self._count_payload:  # CPU: from the slots in use (a device read elsewhere)
            payload = int(payload_fn())
        else:  # GPU: known on the host where only the rows in use cross (exact mode, scale-out hop)
            payload = wire_rows if counts is not None else None
        self.traffic.add(op, hop, payload, row_bytes, wire_rows * row_bytes)
        if num_peers == 1 or send.shape[0] == 0 or send.shape[1] == 0:  # the sizes are equal on every peer
            return send.clone()
        group = self.scaleout_group if hop == "scaleout" else self.scaleup_group
        members = self.scaleout_members if hop == "scaleout" else self.scaleup_members
        what = ("scale-out hop (network, among the same-index ranks of the nodes)" if hop == "scaleout"
                else "scale-up hop (inside the node)")
        stage = f"{op}/{hop}: the {what}, group ranks {members}"
        if counts is None:
            recv = torch.empty_like(send)
            self._wait(dist.all_to_all_single(recv, send, group=group, async_op=True), stage)
            return recv
        sent_idx, recv_idx = (self._used_rows(c, send.shape[0], send.device) for c in counts)
        per_peer = len(counts[0]) // num_peers
        splits = [[sum(c[p * per_peer:(p + 1) * per_peer]) for p in range(num_peers)] for c in counts]
        packed = torch.empty(recv_idx.numel(), row_bytes, dtype=send.dtype, device=send.device)
        self._wait(dist.all_to_all_single(packed, send.index_select(0, sent_idx), splits[1], splits[0], group=group,
                                          async_op=True), stage)
        recv = torch.zeros_like(send)
        recv.index_copy_(0, recv_idx, packed)
        return recv

    @staticmethod
    def _used_rows(counts: list[int], num_rows: int, device: torch.device) -> torch.Tensor:
        """Indices of the rows in use of ``len(counts)`` equal blocks of ``num_rows`` rows: the first
        ``counts[b]`` of block b."""
        block = num_rows // len(counts)
        used = torch.arange(block, device=device)[None, :] < torch.tensor(counts, device=device)[:, None]
        return torch.nonzero(used.flatten()).flatten()

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

    def _forward(self, op: str, rows: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Both hops of a dispatch for ``rows [T, B]`` uint8: ``(recv1 [S*C1, B], recv2 [G*C2, B])``."""
        S, G, c1, c2 = self.num_nodes, self.per_node, plan.c1, plan.c2
        others = [n for n in range(S) if n != self.node]
        peers = [lo for lo in range(G) if lo != self.local]
        recv1 = self._hop(op, "scaleout", self._scatter(rows, plan.slot1, S * c1), S, c1,
                          lambda: (plan.slot1[:, others] < S * c1).sum(),
                          None if plan.net is None else (plan.net[0], plan.net[1]))
        recv2 = self._hop(op, "scaleup", self._scatter(recv1, plan.slot2, G * c2), G, c2,
                          lambda: (plan.slot2[:, peers] < G * c2).sum())
        return recv1, recv2

    # ---------------------------------------------------------------- plans kept in the handle
    def _state(self, plan: _Plan) -> torch.Tensor:
        if plan.net is None:  # fixed mode: fills, not a host copy (graph-capturable)
            head = torch.empty(2, dtype=torch.int64, device=self.device)
            head[0].fill_(plan.c1)
            head[1].fill_(plan.c2)
        else:
            head = torch.tensor([plan.c1, plan.c2] + [v for part in plan.net for v in part], dtype=torch.int64,
                                device=self.device)
        return torch.cat([head, plan.slot1.flatten(), plan.slot2.flatten(), plan.perm])

    def _plan_of(self, handle: DispatchHandle) -> _Plan:
        """The plan packed into ``handle.backend_state`` (by `dispatch`). Its two sizes are known without a
        host read in fixed mode (both ``num_worst_tokens``) and for a handle this backend made; else read."""
        state = handle.backend_state
        if state is None or state.dtype != torch.int64 or state.dim() != 1:
            raise ValueError("ep_moe.hybrid: argument 'handle' must come from a dispatch on the hybrid backend "
                             "(its backend_state holds the two-hop plan)")
        T, S, G, N = handle.num_tokens, self.num_nodes, self.per_node, handle.num_recv_rows
        head_len = 2 if handle.num_worst_tokens else 2 + 2 * S + 2 * S * G
        known = self._plans.get(id(state))
        net = None
        if known is not None and known[0] is state:
            _, c1, c2, net = known
        elif handle.num_worst_tokens:
            c1 = c2 = handle.num_worst_tokens
        else:  # exact mode, a handle rebuilt from its tensors: one host read
            head = state[:head_len].tolist() if state.numel() >= head_len else [0] * head_len
            c1, c2, flat = head[0], head[1], head[2:]
            net = (flat[:S], flat[S:2 * S], flat[2 * S:2 * S + S * G], flat[2 * S + S * G:])
        if state.numel() != head_len + T * S + S * c1 * G + N:
            raise ValueError("ep_moe.hybrid: argument 'handle' does not match this group's topology "
                             f"({S} x {G}) or its own sizes")
        body = state[head_len:]
        slot1, body = body[:T * S].view(T, S), body[T * S:]
        slot2, perm = body[:S * c1 * G].view(S * c1, G), body[S * c1 * G:]
        return _Plan(c1, c2, slot1, slot2, perm, net)

    def _remember(self, state: torch.Tensor, plan: _Plan) -> None:
        key = id(state)
        self._plans[key] = (state, plan.c1, plan.c2, plan.net)
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
        net = None
        if W:
            c1 = c2 = num_rows = W
            _check_fixed(count_matrix.sum(dim=0).max(), node_matrix.max(), W)
        else:
            counts = [row[HEADER_LEN:HEADER_LEN + R] for row in table]
            c1 = max(max(row[HEADER_LEN + R:]) for row in table)
            c2 = max(sum(counts[s][q] for s in self.topology.scaleout_members(lo)) for lo in range(G)
                     for q in range(R))
            num_rows = sum(row[me] for row in counts)
            nodes = [row[HEADER_LEN + R:] for row in table]
            at = self.topology.rank_at
            n0, l0 = self.node, self.local
            net = ([nodes[me][n] for n in range(S)], [nodes[at(n, l0)][n0] for n in range(S)],
                   [counts[at(n, l0)][at(n0, lo)] for n in range(S) for lo in range(G)],
                   [counts[me][at(n, lo)] for n in range(S) for lo in range(G)])

        token_index = torch.arange(T, dtype=torch.int64, device=x.device)[:, None]
        source = torch.full((T, 1), me, dtype=torch.int64, device=x.device)
        x_bytes = as_bytes(x)
        rows = torch.cat([x_bytes, as_bytes(topk_idx), as_bytes(topk_weights), as_bytes(token_index),
                          as_bytes(source)], dim=1)
        col_idx, col_w = x_bytes.shape[1], x_bytes.shape[1] + 8 * K
        col_tok, col_src = col_w + 4 * K, col_w + 4 * K + 8

        # scale-out hop, then the forwarder's view: the rows of the sources of local index l, by node then token
        plan = _Plan(c1, c2, self._slots(in_node, c1), torch.empty(0), torch.empty(0), net)
        others = [n for n in range(S) if n != self.node]
        recv1 = self._hop("dispatch", "scaleout", self._scatter(rows, plan.slot1, S * c1), S, c1,
                          lambda: (plan.slot1[:, others] < S * c1).sum(), None if net is None else net[:2])
        sent_here = node_matrix[self._grid[:, self.local], self.node]  # [S] rows from each node's forwarder
        valid1 = (torch.arange(c1, device=x.device)[None, :] < sent_here[:, None]).flatten()
        idx1 = from_bytes(recv1[:, col_idx:col_w], torch.int64, K).masked_fill(~valid1[:, None], -1)
        experts_per_rank = num_experts // R
        owner = torch.where(idx1 >= 0, idx1 // experts_per_rank, -1)  # [S*C1, K] destination rank of each pair
        in_peer = (owner[:, :, None] == self._grid[self.node][None, None, :]).any(dim=1)  # [S*C1, G]
        plan.slot2 = self._slots(in_peer, c2)

        # scale-up hop; then the flat order: by source rank, then token
        peers = [lo for lo in range(G) if lo != self.local]
        recv2 = self._hop("dispatch", "scaleup", self._scatter(recv1, plan.slot2, G * c2), G, c2,
                          lambda: (plan.slot2[:, peers] < G * c2).sum())
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
        back2 = self._hop("combine", "scaleup", send2[:G * c2], G, c2,
                          lambda: ((plan.perm < G * c2) & (plan.perm // c2 != self.local)).sum())

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
        others = [n for n in range(S) if n != self.node]
        back1 = self._hop("combine", "scaleout", send1[:S * G * c1], S, G * c1, lambda: sent[others].sum(),
                          None if plan.net is None else plan.net[2:])

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
    # A subgroup's rank k must be member k (all-to-all chunk k is node k / local index k): sort_ranks=False where
    # this torch has it; older ones sort the ranks, which is the same only for members in increasing order.
    extra = {}
    if "sort_ranks" in inspect.signature(dist.new_group).parameters:
        extra["sort_ranks"] = False
    elif list(global_members) != sorted(global_members):
        raise RuntimeError(f"ep_moe hybrid backend: the {desc} group's members {list(global_members)} are not in "
                           "increasing rank order and this torch's dist.new_group sorts them (no sort_ranks); "
                           "number the ranks node by node (torchrun does) or use a newer torch")
    group = dist.new_group(list(global_members), timeout=timeout, use_local_synchronization=True,
                           group_desc=desc, **extra)
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
