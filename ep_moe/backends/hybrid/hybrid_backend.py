"""The ``hybrid`` backend: dispatch and combine in two hops over torch.distributed.

A group of R = S x G ranks (S nodes of G ranks, `LogicalTopology`); rank (n, l) is node n's rank of local index l.
Dispatch: a token crosses the network once per node it has an expert on, to the rank of its local index there
(scale-out hop), which forwards it to the node's ranks owning its experts (scale-up hop); the receiver orders the
rows as the flat `TorchBackend` does, so every output and the handle are the flat path's, bit for bit. Combine:
the way back, either reduced inside the node first (``allow_multiple_reduction=True``, DeepEP V2's hybrid order,
one network row per (token, node)) or relayed unreduced and summed as the flat backend does (False, its bits).
The network hop runs in ``num_chunks`` chunks overlapped with the scale-up hop (results bit-equal for any count);
the scale-up transport is an all-to-all, the native kernels, or their torch twin (``scaleup``); `HopTraffic`
counts the bytes of each hop. The contract, the rounding bound, the chunking and the transports:
docs/hybrid.md."""

from __future__ import annotations

import inspect
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ... import native
from ...buffer.dispatch_handle import DispatchHandle
from ...buffer.routing_layout import aligned_expert_counts, local_topk, summation_order
from ...config import Config, NativeOptions
from .. import agreement
from ..agreement import HEADER_LEN
from ..comm_backend import CommBackend, DispatchResult
from ..torch_backend import (
    TorchBackend,
    _counts_from_prefix,
    _source_ranks,
    as_bytes,
    from_bytes,
    ordered_sum,
)
from .node_topology import LogicalTopology

log = logging.getLogger("ep_moe")

HOPS = ("scaleout", "scaleup")
OPS = ("dispatch", "cached_dispatch", "combine")
SCALEUP_MODES = ("auto", "native", "torch", "all_to_all")
ENV_CHUNKS = "EP_MOE_HYBRID_CHUNKS"
"""Environment default of the scale-out hop's chunk count (`HybridBackend`'s ``num_chunks``)."""
ENV_SCALEUP = "EP_MOE_HYBRID_SCALEUP"
"""Environment default of the scale-up transport (one of `SCALEUP_MODES`)."""
DEFAULT_CHUNKS = 4
MAX_CHUNKS = 64
_INT64_MAX = torch.iinfo(torch.int64).max
_ROW_ALIGN = 16  # the native kernels move rows of a multiple of 16 bytes


@dataclass
class HopCount:
    """What one rank sent to other ranks over one hop (its own slot excluded), summed over calls."""

    rows: int = 0        # payload rows (-1 once a call could not count them without a host sync)
    bytes: int = 0       # payload bytes (rows x row bytes; -1 likewise)
    wire_bytes: int = 0  # bytes the exchanges carried (or, native scale-up in fixed mode, may carry) to other ranks
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


class _Tally:
    """One call's counts per hop, summed over its chunks and added to `HopTraffic` once (one call each)."""

    def __init__(self) -> None:
        self.hops: dict[str, list] = {}

    def add(self, hop: str, payload: int | None, wire_rows: int, row_bytes: int) -> None:
        rows, wire, _ = self.hops.get(hop, [0, 0, row_bytes])
        self.hops[hop] = [None if rows is None or payload is None else rows + payload, wire + wire_rows, row_bytes]

    def commit(self, traffic: HopTraffic, op: str) -> None:
        for hop, (rows, wire, row_bytes) in self.hops.items():
            traffic.add(op, hop, rows, row_bytes, wire * row_bytes)


class _Pending:
    """An exchange in flight: `result` waits for it (once) and returns the received ``[rows, B]`` slots."""

    def __init__(self, finish: Callable[[], torch.Tensor]) -> None:
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._out: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        if self._finish is not None:
            self._out, self._finish = self._finish(), None
        return self._out


@dataclass(frozen=True)
class _ChunkNet:
    """Exact mode: the rows in use of one chunk's exchanges on this rank (n0, l0), per peer block.

    out_sent/out_recv [S]: dispatch scale-out rows to / from each node; up_sent/up_recv [G]: dispatch scale-up rows
    to / from each rank of the node; back_sent [S*G]: combine relay rows to source (n', l0) of rank (n0, l');
    back_recv [S*G]: combine relay rows from node n for rank (n, l') (this rank's own tokens)."""

    out_sent: list[int]
    out_recv: list[int]
    up_sent: list[int]
    up_recv: list[int]
    back_sent: list[int]
    back_recv: list[int]

    def flat(self) -> list[int]:
        return self.out_sent + self.out_recv + self.up_sent + self.up_recv + self.back_sent + self.back_recv

    @staticmethod
    def size(S: int, G: int) -> int:
        return 2 * S + 2 * G + 2 * S * G

    @staticmethod
    def from_flat(values: list[int], S: int, G: int) -> _ChunkNet:
        cuts = [0, S, 2 * S, 2 * S + G, 2 * S + 2 * G, 2 * S + 2 * G + S * G, _ChunkNet.size(S, G)]
        return _ChunkNet(*(list(values[a:b]) for a, b in zip(cuts, cuts[1:])))


@dataclass
class _Plan:
    """Where rows go for one handle on this rank (device tensors int64; "spare" = one past the slots).

    nc chunks; cs: rows per (node, chunk) block of the scale-out hop; c2[k]: rows per (peer, chunk) block of the
    scale-up hop. slot1 [T, S]: token t's row for node n in the chunks' concatenated scale-out send buffers
    (chunk k, node n, piece position p: ``k*S*cs + n*cs + p``), spare ``nc*S*cs``. slot2 [nc*S*cs, G]: each
    forwarded row's slot in its chunk's scale-up send buffer (``l' * c2[k] + j``), spare ``G*c2[k]``. perm [N]:
    each output row's place in the chunks' concatenated scale-up receive buffers, spare past them (padding).
    net: exact mode, per chunk (`_ChunkNet`); None in fixed mode (every slot row crosses). The reduced combine's
    orders (`ep_moe.buffer.routing_layout.summation_order` of the groups' last top-k positions): order1 [T, S], each token's
    nodes; order2 [nc*S*cs, G], each forwarded row's ranks of this node (columns of slot2)."""

    nc: int
    cs: int
    c2: list[int]
    slot1: torch.Tensor
    slot2: torch.Tensor
    perm: torch.Tensor
    net: list[_ChunkNet] | None = None
    order1: torch.Tensor | None = None
    order2: torch.Tensor | None = None

    def offsets2(self, G: int) -> list[int]:
        """Start of each chunk in the concatenated scale-up buffers (and their total, last)."""
        out = [0]
        for c in self.c2:
            out.append(out[-1] + G * c)
        return out


def _choose_int(name: str, value: int | None, env: str, default: int, low: int, high: int) -> int:
    if value is None:
        raw = os.environ.get(env, "").strip()
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"ep_moe: environment variable {env} must be an int in [{low}, {high}], "
                             f"got {raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"HybridBackend: argument '{name}' must be an int in [{low}, {high}], got {value!r}")
    return value


class HybridBackend(TorchBackend):
    """Two-hop dispatch/combine (module docstring) on ``group`` viewed as ``topology``.

    Args:
        group, device, timeout_s: as every backend (``timeout_s`` bounds every wait; its error names the hop and
            chunk).
        topology: the S x G view (`LogicalTopology`) of ``group``.
        num_chunks: the most chunks the scale-out hop is cut into, and the count of a call until `set_num_chunks`
            lowers it (1 to `MAX_CHUNKS`; None: ``EP_MOE_HYBRID_CHUNKS``, else `DEFAULT_CHUNKS`, which the tuner's
            plan may lower per shape: ``chunks_fixed`` is False only then). Equal on every rank (checked here, a
            `ValueError` naming it).
        scaleup: the in-node transport, one of `SCALEUP_MODES` (None: ``EP_MOE_HYBRID_SCALEUP``, else "auto").
            "native" raises a RuntimeError where the node's subgroup cannot run the native kernels.
        native_options: the native scale-up's `NativeOptions` (None: from the environment).
        allow_multiple_reduction: the combine's mode (module docstring): True, reduced inside the node first
            (DeepEP V2's hybrid combine); False, the flat combine's bits. Equal on every rank (checked here, a
            `ValueError` naming it).

    Uses two subgroups made with ``dist.new_group`` (only their members take part; made once per process,
    `_subgroup`): the scale-out group of this rank's local index and the scale-up group of its node.
    ``traffic``: this rank's `HopTraffic`; ``scaleup_transport``: "native", "torch" or "all_to_all" (what
    runs), ``scaleup_reason``: why."""

    name = "hybrid"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                 topology: LogicalTopology, *, num_chunks: int | None = None, scaleup: str | None = None,
                 native_options: NativeOptions | None = None, allow_multiple_reduction: bool = True) -> None:
        super().__init__(group, device, timeout_s)
        if not isinstance(allow_multiple_reduction, bool):
            raise ValueError(f"HybridBackend: argument 'allow_multiple_reduction' must be a bool, got "
                             f"{allow_multiple_reduction!r}")
        self.allow_multiple_reduction = allow_multiple_reduction
        if topology.num_ranks != self.num_ranks:
            raise ValueError(f"HybridBackend: argument 'topology' must have {self.num_ranks} ranks (the group's), "
                             f"got {topology.num_ranks}")
        self.max_chunks = _choose_int("num_chunks", num_chunks, ENV_CHUNKS, DEFAULT_CHUNKS, 1, MAX_CHUNKS)
        self.num_chunks = self.max_chunks
        # fixed by the caller (argument or environment): the tuner's plan leaves it alone
        self.chunks_fixed = num_chunks is not None or bool(os.environ.get(ENV_CHUNKS, "").strip())
        mode = scaleup if scaleup is not None else (os.environ.get(ENV_SCALEUP, "").strip() or "auto")
        if mode not in SCALEUP_MODES:
            where = "argument 'scaleup'" if scaleup is not None else f"environment variable {ENV_SCALEUP}"
            raise ValueError(f"HybridBackend: {where} must be one of {SCALEUP_MODES}, got {mode!r}")
        self.topology = topology
        self.num_nodes, self.per_node = topology.num_scaleout_ranks, topology.num_scaleup_ranks
        self.node, self.local = topology.node_of[self.rank], topology.local_of[self.rank]
        self.scaleout_members = topology.scaleout_members(self.local)  # group ranks, by node
        self.scaleup_members = topology.scaleup_members(self.node)     # group ranks, by local index
        global_ranks = dist.get_process_group_ranks(group)
        timeout = timedelta(seconds=timeout_s)
        self._align_process_group_counts(global_ranks[self.rank])
        self.scaleout_group = _subgroup([global_ranks[r] for r in self.scaleout_members], timeout,
                                        f"ep_moe_scaleout_l{self.local}")
        self.scaleup_group = _subgroup([global_ranks[r] for r in self.scaleup_members], timeout,
                                       f"ep_moe_scaleup_n{self.node}")
        grid = [topology.scaleup_members(n) for n in range(self.num_nodes)]
        self._grid = torch.tensor(grid, dtype=torch.int64, device=device)  # [S, G] group ranks
        self._node_of = torch.tensor(topology.node_of, dtype=torch.int64, device=device)  # [R]
        self._count_payload = device.type == "cpu"  # counting payload rows reads the device
        self._plans: dict[int, tuple] = {}  # state.data_ptr() -> (numel, nc, cs, c2, net) while the state lives
        self._side: torch.cuda.Stream | None = None  # the scale-out hop's stream (CUDA), made on first use
        self.traffic = HopTraffic()
        # Every rank must cut the same chunks (the count exchange's width depends on the most, and a planned count
        # must be planned everywhere): checked once, here.
        mine = torch.tensor([self.max_chunks, int(self.chunks_fixed), int(allow_multiple_reduction)],
                            dtype=torch.int64, device=device)
        agreed = [tuple(row) for row in self._all_gather_counts(mine, "init/chunks").tolist()]
        if len({row[2] for row in agreed}) > 1:
            raise ValueError(f"HybridBackend: argument 'allow_multiple_reduction' (ElasticBuffer's) must be equal on "
                             f"every rank, got {[bool(row[2]) for row in agreed]} by rank")
        if len(set(agreed)) > 1:
            raise ValueError(f"HybridBackend: argument 'num_chunks' (ElasticBuffer's num_hybrid_chunks, or "
                             f"{ENV_CHUNKS}) must be equal on every rank (given, or left to the plan, everywhere), "
                             f"got (chunks, given) {[row[:2] for row in agreed]} by rank")
        self._inner: CommBackend | None = None
        self.scaleup_transport, self.scaleup_reason = self._make_scaleup(mode, native_options)

    def _align_process_group_counts(self, global_rank: int) -> None:
        """Every rank of the group holds as many process groups before the hop groups are made: torch names a group
        made with ``use_local_synchronization`` by its ranks and the number of groups the calling process holds
        (``distributed_c10d._hash_ranks_to_str``), and its members meet under that name, so members holding
        different numbers (after groups that only some of them joined, e.g. a framework's) would wait for each other
        under different names until the timeout. A rank holding fewer makes one-rank gloo groups of its own (no
        peer takes part) up to the largest count. Collective over the group."""
        names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
        if names is None:  # a torch without that registry names its groups otherwise: nothing to align
            return
        held = torch.tensor([len(names)], dtype=torch.int64, device=self.device)
        counts = self._all_gather_counts(held, "init/process group counts").view(-1).tolist()
        for _ in range(max(counts) - counts[self.rank]):
            dist.new_group([global_rank], backend="gloo", use_local_synchronization=True, group_desc="ep_moe_align")

    # ---------------------------------------------------------------- the scale-up transport
    def _make_scaleup(self, mode: str, native_options: NativeOptions | None) -> tuple[str, str]:
        """Build the in-node transport (collective over the node's subgroup for "auto" and "native")."""
        if mode == "all_to_all":
            return "all_to_all", "asked for by name"
        if mode == "torch":
            self._inner = TorchBackend(self.scaleup_group, self.device, self.timeout_s)
            return "torch", "asked for by name"
        reason = native.unavailable_reason(self.scaleup_group, self.device)
        # every rank of the node must take the same transport: native only where it qualifies on all of them
        ok = torch.tensor([0 if reason is None else 1], dtype=torch.int64, device=self.device)
        gathered = torch.empty(self.per_node, dtype=torch.int64, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._wait(gather(gathered, ok, group=self.scaleup_group, async_op=True), "init/scaleup")
        if reason is None and int(gathered.sum()) > 0:
            reason = "another rank of the node cannot run the native kernels"
        if reason is None:
            from ..native_backend import NativeBackend

            options = NativeOptions.from_env() if native_options is None else native_options
            self._inner = NativeBackend(self.scaleup_group, self.device, self.timeout_s, 0, options=options)
            return "native", "the node's ranks are NVLink peers" if mode == "auto" else "asked for by name"
        if mode == "native":
            raise RuntimeError(f"ep_moe hybrid backend: scale-up transport 'native' cannot run on node "
                               f"{self.node}: {reason}")
        return "all_to_all", f"native unavailable: {reason}"

    def set_num_chunks(self, num_chunks: int) -> None:
        """The chunk count of the next fresh dispatches (1 to ``max_chunks``; equal on every rank, as the tuner's
        plan is: a count that differs between ranks raises in the dispatch)."""
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or not 1 <= num_chunks <= self.max_chunks:
            raise ValueError(f"HybridBackend.set_num_chunks: argument 'num_chunks' must be an int in "
                             f"[1, {self.max_chunks}], got {num_chunks!r}")
        self.num_chunks = num_chunks

    # ---------------------------------------------------------------- one exchange
    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _stage(self, op: str, hop: str, chunk: int, num_chunks: int) -> str:
        members = self.scaleout_members if hop == "scaleout" else self.scaleup_members
        what = ("scale-out hop (network, among the same-index ranks of the nodes)" if hop == "scaleout"
                else "scale-up hop (inside the node)")
        part = f" chunk {chunk + 1} of {num_chunks}" if num_chunks > 1 else ""
        return f"{op}/{hop}: the {what}{part}, group ranks {members}"

    def _post(self, op: str, hop: str, send: torch.Tensor, num_peers: int, capacity: int, payload_fn,
              counts: tuple[list[int], list[int]] | None, tally: _Tally, chunk: int = 0, num_chunks: int = 1,
              side: bool = False) -> _Pending:
        """Start an all-to-all of ``send [num_peers * capacity, B]`` (chunk p to peer p) over the hop's subgroup;
        its result is ``[num_peers * capacity, B]`` (chunk p from peer p). ``counts``: ``(sent, received)`` per
        peer and block (a chunk is ``len(sent) / num_peers`` equal blocks), the rows in use at the start of each
        block: only those cross (variable splits; exact mode); None: every slot row crosses (equal splits).
        ``side``: CUDA: on the side stream, the current stream waiting only when the result is asked for."""
        others = [p for p in range(num_peers) if p != (self.node if hop == "scaleout" else self.local)]
        row_bytes = send.shape[1]
        if counts is None:
            wire_rows = len(others) * capacity
        else:
            per_peer = len(counts[0]) // num_peers
            wire_rows = sum(sum(counts[0][p * per_peer:(p + 1) * per_peer]) for p in others)
        if self._count_payload:  # CPU: from the slots in use (a device read elsewhere)
            payload = int(payload_fn())
        else:  # GPU: known on the host where only the rows in use cross (exact mode)
            payload = wire_rows if counts is not None else None
        tally.add(hop, payload, wire_rows, row_bytes)
        # nothing to exchange (sizes are equal on every peer); one peer: a copy, except on the side stream, where
        # the collective runs anyway so that one GPU (the 1 x 1 view) exercises the overlapped path
        if (num_peers == 1 and not side) or send.shape[0] == 0 or send.shape[1] == 0:
            out = send.clone()
            return _Pending(lambda: out)
        group = self.scaleout_group if hop == "scaleout" else self.scaleup_group
        stage = self._stage(op, hop, chunk, num_chunks)
        if counts is None:
            send_rows, recv_rows, splits, recv_idx = send, torch.empty_like(send), (None, None), None
        else:
            sent_idx, recv_idx = (self._used_rows(c, send.shape[0], send.device) for c in counts)
            per_peer = len(counts[0]) // num_peers
            splits = [[sum(c[p * per_peer:(p + 1) * per_peer]) for p in range(num_peers)] for c in counts]
            send_rows = send.index_select(0, sent_idx)
            recv_rows = torch.empty(recv_idx.numel(), row_bytes, dtype=send.dtype, device=send.device)
            splits = (splits[1], splits[0])

        def launch():
            return dist.all_to_all_single(recv_rows, send_rows, splits[0], splits[1], group=group, async_op=True)

        event = None
        if side and self.device.type == "cuda":
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                work = launch()
                work.wait()  # the side stream waits for the collective
                event = torch.cuda.Event()
                event.record(stream)
            for t in (send_rows, recv_rows):  # freed by the current stream only after the side stream used them
                t.record_stream(stream)
        else:
            work = launch()

        def finish() -> torch.Tensor:
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            else:
                self._wait(work, stage)
            if recv_idx is None:
                return recv_rows
            recv = torch.zeros_like(send)
            recv.index_copy_(0, recv_idx, recv_rows)
            return recv

        return _Pending(finish)

    def _hop(self, op: str, hop: str, send: torch.Tensor, num_peers: int, capacity: int, payload_fn,
             counts: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
        """One whole all-to-all (`_post`, waited for), counted in `traffic` as one call."""
        tally = _Tally()
        out = self._post(op, hop, send, num_peers, capacity, payload_fn, counts, tally).result()
        tally.commit(self.traffic, op)
        return out

    def _scaleup(self, op: str, send: torch.Tensor, capacity: int, used: torch.Tensor, payload_fn,
                 counts: tuple[list[int], list[int]] | None, tally: _Tally, chunk: int, num_chunks: int,
                 config: Config | None) -> torch.Tensor:
        """The scale-up hop of one chunk: ``send [G * capacity, B]``, block p's first ``used[p]`` rows (``used``
        [G] int64 on the device; ``counts``: the same on the host in exact mode) to the node's rank p; returns
        ``[G * capacity, B]``, block p from rank p (zeros past its rows)."""
        G = self.per_node
        if self._inner is None:
            return self._post(op, "scaleup", send, G, capacity, payload_fn, counts, tally, chunk, num_chunks).result()
        row_bytes = send.shape[1]
        others = [p for p in range(G) if p != self.local]
        wire_rows = sum(counts[0][p] for p in others) if counts is not None else len(others) * capacity
        payload = int(payload_fn()) if self._count_payload else (wire_rows if counts is not None else None)
        tally.add("scaleup", payload, wire_rows, row_bytes)
        bound = G * capacity  # the most rows one rank receives in this chunk (capacity from each of G ranks)
        if bound == 0 or row_bytes == 0:  # equal on every rank of the node
            return send.clone()
        # Rows as bf16 values (the kernels copy their bits), padded to a multiple of 16 bytes; each row's one
        # "expert" is the rank it goes to (G experts, one per rank), -1 = not sent.
        pad = -row_bytes % _ROW_ALIGN
        rows = send if not pad else torch.cat([send, send.new_zeros(send.shape[0], pad)], dim=1)
        rows = rows.contiguous().view(torch.bfloat16)
        position = torch.arange(bound, device=send.device)
        block = position // capacity
        dest = torch.where(position % capacity < used.index_select(0, block), block, -1)
        in_rank = dest[:, None] == torch.arange(G, device=send.device)[None, :]
        weights = torch.zeros(bound, 1, dtype=torch.float32, device=send.device)
        try:
            result = self._inner.dispatch(rows, None, dest[:, None], weights, in_rank, used, None, G, 1, bound,
                                          config or Config())
        except TimeoutError as exc:  # name the hop and the chunk, not only the inner backend's stage
            raise TimeoutError(f"ep_moe[hybrid backend]: rank {self.rank} of {self.num_ranks} timed out in stage "
                               f"'{self._stage(op, 'scaleup', chunk, num_chunks)}' ({exc})") from exc
        received = as_bytes(result.recv_x)[:, :row_bytes]  # [bound, B]: by source rank, then row
        from_rank = _counts_from_prefix(result.handle.rank_prefix_matrix)[:, self.local]  # [G]
        start = torch.cumsum(from_rank, 0) - from_rank
        j = torch.arange(capacity, device=send.device)
        where = torch.where(j[None, :] < from_rank[:, None], start[:, None] + j[None, :], bound).flatten()
        return torch.cat([received, received.new_zeros(1, row_bytes)]).index_select(0, where)

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

    def _forward(self, op: str, rows: torch.Tensor, plan: _Plan, slot2_of, tally: _Tally,
                 config: Config | None) -> list[torch.Tensor]:
        """Both hops of a dispatch for ``rows [T, B]`` uint8, chunk by chunk: every chunk's network exchange is
        posted first (side stream), then chunk k's scale-up hop runs once chunk k has arrived. ``slot2_of(k,
        recv1)``: chunk k's ``[S*cs, G]`` scale-up slots. Returns each chunk's scale-up receive buffer."""
        S, G, nc, cs = self.num_nodes, self.per_node, plan.nc, plan.cs
        others = [n for n in range(S) if n != self.node]
        send1 = self._scatter(rows, plan.slot1, nc * S * cs)
        spare1 = nc * S * cs
        pending = []
        for k in range(nc):
            def payload(k=k):
                s = plan.slot1[:, others]
                return ((s < spare1) & (s // max(S * cs, 1) == k)).sum()

            pending.append(self._post(op, "scaleout", send1[k * S * cs:(k + 1) * S * cs], S, cs, payload,
                                      None if plan.net is None else (plan.net[k].out_sent, plan.net[k].out_recv),
                                      tally, k, nc, side=True))
        peers = [lo for lo in range(G) if lo != self.local]
        out = []
        for k in range(nc):
            recv1 = pending[k].result()
            slot2 = slot2_of(k, recv1)
            c2 = plan.c2[k]
            inside = slot2 < G * c2
            out.append(self._scaleup(op, self._scatter(recv1, slot2, G * c2), c2, inside.sum(dim=0),
                                     lambda s=slot2, c=c2: (s[:, peers] < G * c).sum(),
                                     None if plan.net is None else (plan.net[k].up_sent, plan.net[k].up_recv),
                                     tally, k, nc, config))
        return out

    # ---------------------------------------------------------------- plans kept in the handle
    def _fixed_sizes(self, W: int, nc: int) -> tuple[int, list[int]]:
        """Fixed mode: ``(cs, c2)`` from the handle's ``num_worst_tokens`` and the chunk count alone."""
        cs = -(-W // nc)
        return cs, [min(W, self.num_nodes * cs)] * nc

    def _exact_sizes(self, nodes: torch.Tensor, chunks: torch.Tensor) -> tuple[int, list[int], list[_ChunkNet]]:
        """Exact mode: ``(cs, c2, net)`` from every source's tokens per node ``nodes [R, S]`` and rows per (chunk,
        destination rank) ``chunks [R, nc, R]`` (the count exchange, on the host; torch ops, so that large groups
        cost no Python loops over ranks)."""
        S, G, me, n0, l0 = self.num_nodes, self.per_node, self.rank, self.node, self.local
        nc = chunks.shape[1]
        grid = self._grid.cpu()  # [S, G] group ranks
        cs = -(-int(nodes.max()) // nc)
        # forwarded[l, k, n, l2]: rows forwarder (n, l) hands rank (n, l2) in chunk k (from the sources of index l)
        forwarded = chunks.index_select(0, grid.flatten()).view(S, G, nc, -1).sum(dim=0)[:, :, grid]  # [G,nc,S,G]
        c2 = forwarded.amax(dim=(0, 2, 3)).tolist()
        k = torch.arange(nc, device=nodes.device)[:, None]
        pieces = ((k + 1) * nodes[:, None, :] // nc - k * nodes[:, None, :] // nc)  # [R, nc, S] tokens per piece
        out_sent = pieces[me].tolist()                                              # [nc][S]
        out_recv = pieces[grid[:, l0], :, n0].t().tolist()                          # [nc][S]
        up_sent = forwarded[l0, :, n0, :].tolist()                                  # [nc][G]
        up_recv = forwarded[:, :, n0, l0].t().tolist()                              # [nc][G]
        back_sent = chunks[grid[:, l0]][:, :, grid[n0]].permute(1, 0, 2).reshape(nc, -1).tolist()  # [nc][S*G]
        back_recv = chunks[me][:, grid.flatten()].tolist()                          # [nc][S*G]
        net = [_ChunkNet(out_sent[k], out_recv[k], up_sent[k], up_recv[k], back_sent[k], back_recv[k])
               for k in range(nc)]
        return cs, c2, net

    def _state(self, plan: _Plan) -> torch.Tensor:
        if plan.net is None:  # fixed mode: a fill, not a host copy (graph-capturable)
            head = torch.empty(1, dtype=torch.int64, device=self.device)
            head[0].fill_(plan.nc)
        else:
            values = [plan.nc, plan.cs] + plan.c2 + [v for chunk in plan.net for v in chunk.flat()]
            head = torch.tensor(values, dtype=torch.int64, device=self.device)
        return torch.cat([head, plan.slot1.flatten(), plan.slot2.flatten(), plan.perm, plan.order1.flatten(),
                          plan.order2.flatten()])

    def _plan_of(self, handle: DispatchHandle) -> _Plan:
        """The plan packed into ``handle.backend_state`` (by `dispatch`). Its sizes are known on the host for a
        state this backend made (remembered by its storage while the tensor lives) and, in fixed mode, from
        ``num_worst_tokens`` and this backend's chunk count; else (an exact-mode handle rebuilt from its tensors)
        read from the state's head (a host read)."""
        state = handle.backend_state
        if state is None or state.dtype != torch.int64 or state.dim() != 1 or state.numel() == 0:
            raise ValueError("ep_moe.backends.hybrid: argument 'handle' must come from a dispatch on the hybrid backend "
                             "(its backend_state holds the two-hop plan)")
        S, G = self.num_nodes, self.per_node
        known = self._plans.get(state.data_ptr())
        if known is not None and known[0] == state.numel():
            _, nc, cs, c2, net = known
        elif handle.num_worst_tokens:
            nc = self.num_chunks
            cs, c2 = self._fixed_sizes(handle.num_worst_tokens, nc)
            net = None
        else:
            nc = int(state[0])
            head_len = 2 + nc + nc * _ChunkNet.size(S, G)
            if not 0 < nc <= MAX_CHUNKS or state.numel() < head_len:
                raise ValueError("ep_moe.backends.hybrid: argument 'handle' does not match this group's topology "
                                 f"({S} x {G}) or its own sizes")
            head = state[:head_len].tolist()
            cs, c2, size = head[1], head[2:2 + nc], _ChunkNet.size(S, G)
            net = [_ChunkNet.from_flat(head[2 + nc + k * size:2 + nc + (k + 1) * size], S, G) for k in range(nc)]
        return self._views(state, handle, nc, cs, c2, net)

    def _views(self, state: torch.Tensor, handle: DispatchHandle, nc: int, cs: int, c2: list[int],
               net: list[_ChunkNet] | None) -> _Plan:
        """The plan whose tensors are views of ``state`` (its layout: `_state`)."""
        T, S, G, N = handle.num_tokens, self.num_nodes, self.per_node, handle.num_recv_rows
        head_len = 1 if net is None else 2 + nc + nc * _ChunkNet.size(S, G)
        rows2 = nc * S * cs
        if state.numel() != head_len + 2 * (T * S + rows2 * G) + N:
            raise ValueError("ep_moe.backends.hybrid: argument 'handle' does not match this group's topology "
                             f"({S} x {G}) or its own sizes")
        parts = torch.split(state[head_len:], [T * S, rows2 * G, N, T * S, rows2 * G])
        slot1, slot2, perm, order1, order2 = parts[0].view(T, S), parts[1].view(rows2, G), parts[2], \
            parts[3].view(T, S), parts[4].view(rows2, G)
        return _Plan(nc, cs, c2, slot1, slot2, perm, net, order1, order2)

    def _remember(self, state: torch.Tensor, plan: _Plan) -> None:
        """Keep the plan's host values by the state's storage while the state lives (no reference to it)."""
        key = state.data_ptr()
        self._plans[key] = (state.numel(), plan.nc, plan.cs, plan.c2, plan.net)
        weakref.finalize(state, self._plans.pop, key, None)

    def _check_handle_call(self, op: int, op_name: str, x: torch.Tensor, handle: DispatchHandle, topk: int,
                           scales: int = 0) -> None:
        values = agreement.header(op, x.shape[1], x.dtype, scales, topk, 0, handle.num_worst_tokens)
        digest = agreement.layout_digest(handle.rank_prefix_matrix, self._digest_multipliers)
        stage = "dispatch/cached/check" if op == agreement.OP_CACHED_DISPATCH else "combine/check"
        self._agree(op_name, self._all_gather_counts(self._header(values, digest), stage))

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, handle,
                 num_experts, expert_alignment, num_worst_tokens, config=None) -> DispatchResult:
        if handle is not None:
            return self._cached_dispatch(x, x_scales, handle, config)
        S, G, R, me, nc, MC = self.num_nodes, self.per_node, self.num_ranks, self.rank, self.num_chunks, \
            self.max_chunks
        T, K, W = x.shape[0], topk_idx.shape[1], num_worst_tokens
        num_scales = x_scales.shape[1] if x_scales is not None else 0
        in_node = is_token_in_rank[:, self._grid.flatten()].view(T, S, G).any(dim=2)  # [T, S]
        per_node = in_node.sum(dim=0)                                                # [S] tokens to each node
        # each token's chunk per node: its position j among the tokens to that node, cut into nc pieces
        position = torch.cumsum(in_node.to(torch.int64), dim=0) - 1
        chunk = torch.where(in_node, ((position + 1) * nc - 1) // per_node.clamp(min=1), 0)  # [T, S]
        chunk_of_rank = chunk.index_select(1, self._node_of)                              # [T, R]
        rows_per_chunk = torch.zeros(MC, R, dtype=torch.int64, device=x.device)          # [MC, R]
        for k in range(nc):
            rows_per_chunk[k] = ((chunk_of_rank == k) & is_token_in_rank).sum(dim=0)
        head = self._header(agreement.header(agreement.OP_DISPATCH, x.shape[1], x.dtype, num_scales, K,
                                             num_experts, W))
        nc_column = torch.full((1,), nc, dtype=torch.int64, device=x.device)
        gathered = self._all_gather_counts(torch.cat([head, num_tokens_per_rank.to(torch.int64), per_node, nc_column,
                                                      rows_per_chunk.flatten()]), "dispatch/notify")
        host = None if W else gathered.cpu()  # exact mode: the one host read
        table = None if W else host.tolist()
        self._agree("dispatch", gathered, table)
        first_chunk = HEADER_LEN + R + S + 1
        count_matrix = gathered[:, HEADER_LEN:HEADER_LEN + R]               # rows [source, destination rank]
        node_matrix = gathered[:, HEADER_LEN + R:HEADER_LEN + R + S]        # tokens [source, destination node]
        chunk_table = gathered[:, first_chunk:].view(R, MC, R)              # rows [source, chunk, destination]
        if table is not None:
            chunks_seen = [row[first_chunk - 1] for row in table]
            if len(set(chunks_seen)) > 1:
                raise ValueError(f"ep_moe.dispatch: ranks disagree on the hybrid chunk count (set_num_chunks or "
                                 f"the tuner's plan): {chunks_seen} by rank")
        else:
            torch._assert_async((gathered[:, first_chunk - 1] == nc).all(),
                                 "ep_moe.dispatch (hybrid): ranks disagree on the chunk count")
        if W:
            cs, c2 = self._fixed_sizes(W, nc)
            num_rows, net = W, None
            _check_fixed(count_matrix.sum(dim=0).max(), node_matrix.max(), W)
        else:
            cs, c2, net = self._exact_sizes(host[:, HEADER_LEN + R:HEADER_LEN + R + S],
                                            host[:, first_chunk:].view(R, MC, R)[:, :nc])
            num_rows = sum(row[HEADER_LEN + me] for row in table)

        piece_start = chunk * per_node // nc
        base = torch.arange(S, device=x.device) * cs
        slot1 = torch.where(in_node, chunk * (S * cs) + base + position - piece_start, nc * S * cs)

        token_index = torch.arange(T, dtype=torch.int64, device=x.device)[:, None]
        source = torch.full((T, 1), me, dtype=torch.int64, device=x.device)
        x_bytes = as_bytes(x)
        parts = [x_bytes] + ([as_bytes(x_scales)] if x_scales is not None else [])
        col_idx = sum(p.shape[1] for p in parts)
        rows = torch.cat(parts + [as_bytes(topk_idx), as_bytes(topk_weights), as_bytes(token_index),
                                  as_bytes(source)], dim=1)
        col_w = col_idx + 8 * K
        col_tok, col_src = col_w + 4 * K, col_w + 4 * K + 8

        # the forwarder's view of chunk k: the rows of the sources of local index l, by node then token
        experts_per_rank = num_experts // R
        from_source_node = node_matrix[self._grid[:, self.local], self.node]  # [S] tokens each node's source sends
        # the reduced combine's order of each token's nodes (by each node's last top-k position)
        owner_node = torch.where(topk_idx >= 0, self._node_of[topk_idx.clamp(min=0) // experts_per_rank], -1)
        order1 = summation_order(owner_node, S, S).to(torch.int64)                         # [T, S]
        plan = _Plan(nc, cs, c2, slot1, slot1.new_empty(0), slot1.new_empty(0), net, order1)
        local_of = torch.full((R,), -1, dtype=torch.int64, device=x.device)
        local_of[self._grid[self.node]] = torch.arange(G, device=x.device)  # -1 outside this node

        def slot2_of(k: int, recv1: torch.Tensor) -> torch.Tensor:
            piece = (k + 1) * from_source_node // nc - k * from_source_node // nc
            valid1 = (torch.arange(cs, device=x.device)[None, :] < piece[:, None]).flatten()
            idx1 = from_bytes(recv1[:, col_idx:col_w], torch.int64, K).masked_fill(~valid1[:, None], -1)
            owner = torch.where(idx1 >= 0, idx1 // experts_per_rank, -1)  # [S*cs, K] destination rank of each pair
            in_peer = (owner[:, :, None] == self._grid[self.node][None, None, :]).any(dim=1)  # [S*cs, G]
            # the reduced combine's order of the row's ranks in this node (by each rank's last top-k position)
            owner_local = torch.where(owner >= 0, local_of[owner.clamp(min=0)], -1)
            order2_parts.append(summation_order(owner_local, G, G).to(torch.int64))
            return self._slots(in_peer, c2[k])

        tally = _Tally()
        slot2_parts: list[torch.Tensor] = []
        order2_parts: list[torch.Tensor] = []
        recv2 = self._forward("dispatch", rows, plan, lambda k, r: slot2_parts.append(slot2_of(k, r)) or
                              slot2_parts[-1], tally, config)
        tally.commit(self.traffic, "dispatch")
        plan.slot2 = torch.cat(slot2_parts) if slot2_parts else torch.empty(0, G, dtype=torch.int64, device=x.device)
        plan.order2 = torch.cat(order2_parts) if order2_parts else plan.slot2.clone()

        # the flat order: by source rank, then token (valid rows: the first of each forwarder's block per chunk)
        from_forwarder = chunk_table[:, :, me].index_select(0, self._grid.flatten()).view(S, G, MC).sum(dim=0)
        valid2 = torch.cat([(torch.arange(c2[k], device=x.device)[None, :] < from_forwarder[:, k][:, None]).flatten()
                            for k in range(nc)])
        recv2 = torch.cat(recv2)
        total2 = recv2.shape[0]
        src2 = from_bytes(recv2[:, col_src:col_src + 8], torch.int64, 1)[:, 0]
        tok2 = from_bytes(recv2[:, col_tok:col_src], torch.int64, 1)[:, 0]
        key = torch.where(valid2, src2 * (1 << 32) + tok2, _INT64_MAX)
        order = torch.argsort(key, stable=True)[:num_rows]
        if order.numel() < num_rows:  # fewer slots than fixed rows: the rest is padding
            order = torch.cat([order, order.new_full((num_rows - order.numel(),), total2)])
        valid = torch.cat([valid2, valid2.new_zeros(1)]).index_select(0, order)
        plan.perm = torch.where(valid, order, total2)
        out = torch.cat([recv2, recv2.new_zeros(1, recv2.shape[1])]).index_select(0, plan.perm)

        recv_x = from_bytes(out[:, :x_bytes.shape[1]], x.dtype, x.shape[1])
        recv_scales = from_bytes(out[:, x_bytes.shape[1]:col_idx], torch.float32, num_scales) if num_scales else None
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
        return DispatchResult(recv_x, recv_scales, local_idx, local_w, counts, new, None if W else counts.tolist())

    def _cached_dispatch(self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle,
                         config: Config | None) -> DispatchResult:
        plan = self._plan_of(handle)
        num_scales = x_scales.shape[1] if x_scales is not None else 0
        self._check_handle_call(agreement.OP_CACHED_DISPATCH, "dispatch", x, handle, 0, num_scales)
        x_bytes = as_bytes(x)
        rows = x_bytes if x_scales is None else torch.cat([x_bytes, as_bytes(x_scales)], dim=1)
        S, cs = self.num_nodes, plan.cs
        tally = _Tally()
        recv2 = torch.cat(self._forward("cached_dispatch", rows, plan,
                                        lambda k, _: plan.slot2[k * S * cs:(k + 1) * S * cs], tally, config))
        tally.commit(self.traffic, "cached_dispatch")
        out = torch.cat([recv2, recv2.new_zeros(1, recv2.shape[1])]).index_select(0, plan.perm)
        recv_x = from_bytes(out[:, :x_bytes.shape[1]], x.dtype, x.shape[1])
        recv_scales = from_bytes(out[:, x_bytes.shape[1]:], torch.float32, num_scales) if num_scales else None
        return DispatchResult(recv_x, recv_scales, None, None, None, handle)

    # ---------------------------------------------------------------- combine
    def combine(self, y, handle, topk_weights, bias, config=None):
        plan = self._plan_of(handle)
        self._check_handle_call(agreement.OP_COMBINE, "combine", y, handle,
                                topk_weights.shape[1] if topk_weights is not None else -1)
        S, G, nc, cs = self.num_nodes, self.per_node, plan.nc, plan.cs
        T, hidden = handle.num_tokens, y.shape[1]
        reduce = self.allow_multiple_reduction
        y_bytes = as_bytes(y)
        rows = y_bytes if topk_weights is None else torch.cat([y_bytes, as_bytes(topk_weights)], dim=1)
        row_bytes = rows.shape[1]
        acc_dtype = torch.promote_types(y.dtype, torch.float32)  # fp32, or fp64 for fp64 input
        offsets = plan.offsets2(G)
        send2_all = torch.zeros(offsets[-1] + 1, row_bytes, dtype=torch.uint8, device=y.device)
        send2_all.index_copy_(0, plan.perm, rows)
        others = [n for n in range(S) if n != self.node]
        block = (torch.arange(S, device=y.device)[:, None, None] * G + torch.arange(G, device=y.device)) * cs
        tally = _Tally()
        pending = []
        for k in range(nc):
            c2, lo, hi = plan.c2[k], offsets[k], offsets[k + 1]
            # scale-up hop back: each row to the forwarder it came from, at the slot it was sent from
            in_chunk = (plan.perm >= lo) & (plan.perm < hi)
            from_peer = torch.where(in_chunk, (plan.perm - lo) // max(c2, 1), G)
            used = (from_peer[:, None] == torch.arange(G, device=y.device)[None, :]).sum(dim=0)  # [G]
            back2 = self._scaleup("combine", send2_all[lo:hi], c2, used,
                                  lambda f=from_peer: ((f < G) & (f != self.local)).sum(),
                                  None if plan.net is None else (plan.net[k].up_recv, plan.net[k].up_sent),
                                  tally, k, nc, config)
            # scale-out hop back, on the side stream while the next chunk goes through the node
            slot2 = plan.slot2[k * S * cs:(k + 1) * S * cs]
            if reduce:
                # one partial row per forwarded row (token, node), in the dispatch's scale-out slots: block n of cs
                # rows goes back to source (n, l)
                order2 = plan.order2[k * S * cs:(k + 1) * S * cs]
                send1 = self._node_partials(back2, slot2, order2, y.dtype, hidden, acc_dtype)
                in_use = (slot2 < G * c2).any(dim=1).view(S, cs)
                pending.append(self._post("combine", "scaleout", send1, S, cs, lambda u=in_use: u[others].sum(),
                                          None if plan.net is None else (plan.net[k].out_recv, plan.net[k].out_sent),
                                          tally, k, nc, side=True))
                continue
            # flat: the forwarder relays every (token, rank) row, unreduced; block (n', l') of cs rows holds, in
            # token order, the rows of rank (n, l') for source (n', l)
            sent = (slot2 < G * c2).view(S, cs, G)
            place = torch.cumsum(sent.to(torch.int64), dim=1) - 1
            dest = torch.where(sent, block + place, S * G * cs).flatten()
            src = torch.where(sent.flatten(), slot2.flatten(), 0)
            send1 = torch.zeros(S * G * cs + 1, row_bytes, dtype=torch.uint8, device=y.device)
            picked = back2.index_select(0, src) if back2.shape[0] else back2.new_zeros(src.shape[0], row_bytes)
            send1.index_copy_(0, dest, picked)
            pending.append(self._post("combine", "scaleout", send1[:S * G * cs], S, G * cs,
                                      lambda s=sent: s[others].sum(),
                                      None if plan.net is None else (plan.net[k].back_sent, plan.net[k].back_recv),
                                      tally, k, nc, side=True))
        back1 = torch.cat([p.result() for p in pending]) if pending else \
            torch.zeros(0, row_bytes, dtype=torch.uint8, device=y.device)
        tally.commit(self.traffic, "combine")

        # the source: reduced, the node partials (slot1: token t's row from node n in back1) in order1; flat, the
        # rank rows in the flat backend's order
        slots, order = (plan.slot1, plan.order1) if reduce else (self._rank_rows(plan, handle),
                                                                  handle.summation_order)
        # the biases first: reduced, DeepEP V2's start (their fp32 sum); flat, the flat backend's (0, then each)
        biases = [b.to(acc_dtype) for b in bias if b is not None]
        if reduce and biases:
            acc, biases = biases[0], biases[1:]
        else:
            acc = torch.zeros(T, hidden, dtype=acc_dtype, device=y.device)
        for b in biases:
            acc = acc + b
        acc = ordered_sum(acc, from_bytes(back1[:, :y_bytes.shape[1]], y.dtype, hidden), slots, order)
        acc_w = None
        if topk_weights is not None:  # flat: in increasing rank, as the flat backend
            acc_w = ordered_sum(torch.zeros(T, topk_weights.shape[1], dtype=torch.float32, device=y.device),
                                 from_bytes(back1[:, y_bytes.shape[1]:], torch.float32, topk_weights.shape[1]),
                                 slots, order if reduce else None)
        return acc.to(y.dtype), acc_w

    @staticmethod
    def _node_partials(back2: torch.Tensor, slot2: torch.Tensor, order2: torch.Tensor, dtype: torch.dtype,
                       hidden: int, acc_dtype: torch.dtype) -> torch.Tensor:
        """The reduced combine's in-node sum of one chunk, on the forwarder: for each forwarded row i, its ranks'
        rows ``back2[slot2[i, g]]`` (``[G * c2, B]`` bytes: values of ``dtype``, then fp32 weights) summed in
        ``order2[i]`` in ``acc_dtype`` and rounded once to ``dtype`` (the weights stay fp32); ``[S * cs, B]``
        bytes, zeros for a row without any."""
        num_w = (back2.shape[1] - hidden * dtype.itemsize) // 4
        values = ordered_sum(torch.zeros(slot2.shape[0], hidden, dtype=acc_dtype, device=back2.device),
                              from_bytes(back2[:, :hidden * dtype.itemsize], dtype, hidden), slot2, order2)
        parts = [as_bytes(values.to(dtype))]
        if num_w:
            weights = ordered_sum(torch.zeros(slot2.shape[0], num_w, dtype=torch.float32, device=back2.device),
                                   from_bytes(back2[:, hidden * dtype.itemsize:], torch.float32, num_w), slot2,
                                   order2)
            parts.append(as_bytes(weights))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def _rank_rows(self, plan: _Plan, handle: DispatchHandle) -> torch.Tensor:
        """The flat combine's ``[T, R]`` place of token t's row from rank q in the relayed rows (the chunks'
        concatenated ``[S * G * cs]`` receive buffers), ``nc * S * G * cs`` (past them) where it has none."""
        S, G, nc, cs = self.num_nodes, self.per_node, plan.nc, plan.cs
        spare1, total = nc * S * cs, nc * S * G * cs
        chunk_of = torch.where(plan.slot1 < spare1, plan.slot1 // max(S * cs, 1), 0)  # [T, S]
        chunk_ids = torch.arange(nc, device=plan.slot1.device)[None, :]
        columns = []
        for q in range(self.num_ranks):
            n, lo = self.topology.node_of[q], self.topology.local_of[q]
            in_q = handle.is_token_in_rank[:, q]
            chunk_q = chunk_of[:, n]
            in_chunk = (chunk_q[:, None] == chunk_ids) & in_q[:, None]                    # [T, nc]
            place = torch.cumsum(in_chunk.to(torch.int64), dim=0).gather(1, chunk_q[:, None])[:, 0] - 1
            columns.append(torch.where(in_q, chunk_q * (S * G * cs) + (n * G + lo) * cs + place, total))
        return torch.stack(columns, dim=1)

    def destroy(self) -> None:
        """Destroy the native scale-up backend, if any; the subgroups stay (shared by every buffer on the same
        ranks, `_subgroup`)."""
        if self._inner is not None:
            self._inner.destroy()
            self._inner = None
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


__all__ = ["DEFAULT_CHUNKS", "ENV_CHUNKS", "ENV_SCALEUP", "HOPS", "MAX_CHUNKS", "OPS", "SCALEUP_MODES", "HopCount", "HopTraffic",
           "HybridBackend"]
