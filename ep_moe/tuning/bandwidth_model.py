"""The bandwidth model: what one dispatch or combine moves over each link and through the SMs.

Shapes: E experts, K top-k, H hidden, T tokens per rank, R ranks in the EP group, N ranks per NVLink
domain, S scale-out ranks (nodes). Byte counts are per rank and per call; a "row" is one token sent
to one rank (a token goes to a rank once, however many of its experts live there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import NativeOptions
from ..native.policy import num_chunks, push_fraction
from .machine_topology import Topology

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4, "float32": 4,
               "float": 4, "fp8": 1, "e4m3": 1, "float8_e4m3fn": 1}


def dtype_bytes(dtype) -> int:
    """Bytes per element of ``dtype``: a torch dtype, a name ("bf16", "torch.bfloat16", "fp8") or an int."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype not in (1, 2, 4):
            raise ValueError(f"dtype_bytes: argument 'dtype' must be 1, 2 or 4 bytes, got {dtype}")
        return dtype
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and not isinstance(dtype, str):
        return itemsize
    name = str(dtype).lower().removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype_bytes: argument 'dtype' must be one of {sorted(DTYPE_BYTES)} or a torch dtype, "
                         f"got {dtype!r}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer's communication shape.

    Attributes:
        num_experts: E (all experts of the layer). topk: K experts per token.
        hidden: H. tokens: T tokens per rank per call.
        dtype_bytes: bytes per element of dispatched activations (1 = FP8 with fp32 scales per 128).
    """

    num_experts: int
    topk: int
    hidden: int
    tokens: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_experts", "topk", "hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LayerShape: argument '{name}' must be a positive int, got {value!r}")
        if not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"LayerShape: argument 'tokens' must be an int >= 0, got {self.tokens!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"LayerShape: argument 'topk' must be <= num_experts ({self.num_experts}), "
                             f"got {self.topk}")
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"LayerShape: argument 'dtype_bytes' must be 1, 2 or 4, got {self.dtype_bytes!r}")
        if self.dtype_bytes == 1 and self.hidden % 128:
            raise ValueError(f"LayerShape: argument 'hidden' must be a multiple of 128 for FP8, got {self.hidden}")

    @property
    def dispatch_row_bytes(self) -> int:
        """Bytes of one dispatched row: activations, FP8 scales, top-k ids (int64) and weights (fp32)."""
        scales = (self.hidden // 128) * 4 if self.dtype_bytes == 1 else 0
        return self.hidden * self.dtype_bytes + scales + self.topk * 12

    @property
    def combine_row_bytes(self) -> int:
        """Bytes of one combined row (FP8 dispatch combines in BF16)."""
        return self.hidden * max(self.dtype_bytes, 2)

    def key(self) -> str:
        """The cache key of plans for this shape."""
        return f"E{self.num_experts}-K{self.topk}-H{self.hidden}-T{self.tokens}-b{self.dtype_bytes}"

    def label(self) -> str:
        dtype = {1: "fp8", 2: "bf16", 4: "fp32"}[self.dtype_bytes]
        return f"E{self.num_experts} K{self.topk} H{self.hidden} T{self.tokens} {dtype}"


def expected_groups(num_experts: int, topk: int, num_groups: int) -> float:
    """Expected number of distinct groups a token's top-k experts fall in, under a balanced gate.

    Experts are split into ``num_groups`` equal groups (ranks, or nodes); a token picks ``topk``
    distinct experts uniformly. ``P(a group is missed) = C(E - E/g, K) / C(E, K)``, so the expectation is
    ``g * (1 - C(E - E/g, K) / C(E, K))``. Exact: Python's integer division of the two binomials is
    correctly rounded however large they are.
    """
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"expected_groups: argument 'num_groups' must divide num_experts ({num_experts}), "
                         f"got {num_groups}")
    if not 0 <= topk <= num_experts:
        raise ValueError(f"expected_groups: argument 'topk' must be in [0, {num_experts}], got {topk}")
    missed = math.comb(num_experts - num_experts // num_groups, topk) / math.comb(num_experts, topk)
    return num_groups * (1.0 - missed)


# ------------------------------------------------------------------------------------------ routing loads
@dataclass(frozen=True)
class RankLoad:
    """Rows one rank sends and receives in a dispatch (combine moves them back).

    Attributes:
        rank: which rank (-1 for the balanced expectation).
        tokens: T, the rank's tokens.
        sent_rows / sent_remote_rows: rows it sends (to itself included) / to other ranks.
        recv_rows / recv_remote_rows: rows it receives (from itself included) / from other ranks.
    """

    rank: int
    tokens: float
    sent_rows: float
    sent_remote_rows: float
    recv_rows: float
    recv_remote_rows: float


def _as_matrix(routing, num_ranks: int) -> list[list[float]] | list[float]:
    """A [R, R] rows matrix or an [R] per-destination vector, from lists, tuples, numpy or torch."""
    if hasattr(routing, "tolist"):
        routing = routing.tolist()
    if not isinstance(routing, Sequence) or len(routing) != num_ranks:
        raise ValueError(f"routing: argument 'routing' must have {num_ranks} entries (one per rank), got "
                         f"{len(routing) if isinstance(routing, Sequence) else type(routing).__name__}")
    if all(isinstance(row, Sequence) for row in routing):
        if any(len(row) != num_ranks for row in routing):
            raise ValueError(f"routing: argument 'routing' must be [R, R] = [{num_ranks}, {num_ranks}] rows")
        matrix = [[float(v) for v in row] for row in routing]
        if any(v < 0 for row in matrix for v in row):
            raise ValueError("routing: argument 'routing' must hold counts >= 0")
        return matrix
    vector = [float(v) for v in routing]
    if any(v < 0 for v in vector):
        raise ValueError("routing: argument 'routing' must hold counts >= 0")
    return vector


def rank_loads(shape: LayerShape, num_ranks: int, routing=None) -> list[RankLoad]:
    """Per-rank dispatch loads: the balanced expectation, or from a measured routing histogram.

    Args:
        routing: None (balanced gate: every rank receives each token with probability
            ``expected_groups(E, K, R) / R``); an ``[R, R]`` matrix ``rows[src][dst]`` of rows sent from
            ``src`` to ``dst`` (for example ``all_gather`` of each rank's ``num_tokens_per_rank``); or an
            ``[R]`` vector of rows each rank receives (sources assumed uniform).

    Returns:
        one `RankLoad` per rank (a single one with ``rank=-1`` for the balanced case).
    """
    if num_ranks < 1:
        raise ValueError(f"rank_loads: argument 'num_ranks' must be >= 1, got {num_ranks}")
    tokens = float(shape.tokens)
    if routing is None:
        per_pair = tokens * expected_groups(shape.num_experts, shape.topk, num_ranks) / num_ranks
        remote = per_pair * (num_ranks - 1)
        return [RankLoad(-1, tokens, per_pair * num_ranks, remote, per_pair * num_ranks, remote)]
    data = _as_matrix(routing, num_ranks)
    if isinstance(data[0], list):
        m = data
    else:  # per-destination totals, spread evenly over the sources
        m = [[data[d] / num_ranks for d in range(num_ranks)] for _ in range(num_ranks)]
    loads = []
    for r in range(num_ranks):
        sent = sum(m[r])
        recv = sum(m[s][r] for s in range(num_ranks))
        loads.append(RankLoad(r, tokens, sent, sent - m[r][r], recv, recv - m[r][r]))
    return loads


# ------------------------------------------------------------------------------------------ op costs
@dataclass(frozen=True)
class SmPool:
    """SMs doing one job: ``share`` of the call's SMs, moving these bytes.

    ``items``: the work comes in this many equal items that the pool's SMs take in turn (item i to SM
    i mod n; the native pushers' chunks), so that n SMs take ``ceil(items / n)`` rounds; 0: the work
    divides evenly over any number of SMs.
    """

    name: str
    share: float
    read_bytes: float
    write_local_bytes: float
    write_peer_bytes: float
    items: int = 0

    def work_seconds(self, sm_read_gbs: float, sm_write_gbs: float, sm_peer_write_gbs: float) -> float:
        """Time this pool's work takes on one SM (reads overlap writes; local and peer stores add up)."""
        read = self.read_bytes / (sm_read_gbs * 1e9)
        write = self.write_local_bytes / (sm_write_gbs * 1e9) + self.write_peer_bytes / (sm_peer_write_gbs * 1e9)
        return max(read, write)

    def effective_sms(self, num_sms: float) -> float:
        """SMs' worth of throughput ``num_sms`` SMs give this pool: fewer than ``num_sms`` when its items do
        not divide evenly (the busiest SM takes ``ceil(items / n)`` of them); fractional counts (the knee)
        are not rounded."""
        if self.items <= 0 or num_sms != int(num_sms) or num_sms < 1:
            return num_sms
        return self.items / math.ceil(self.items / num_sms)


def split_sms(pools: Sequence[SmPool], num_sms: int) -> list[float]:
    """SMs each pool gets out of ``num_sms``. A leading "push" pool gets ``round(num_sms * share)``, at
    least 1 and leaving 1 for the rest, as the native backend splits its blocks; otherwise shares."""
    if len(pools) == 2 and pools[0].name == "push":
        push = min(num_sms - 1, max(1, round(num_sms * pools[0].share))) if num_sms > 1 else 0.5
        return [float(push), float(num_sms - push)]
    return [num_sms * p.share for p in pools]


@dataclass(frozen=True)
class OpCost:
    """What one dispatch or combine costs on the busiest rank: bytes per link and per SM pool."""

    op: str
    nvlink_bytes: float
    rdma_bytes: float
    pools: tuple[SmPool, ...]
    recv_bytes: float  # rows received x row bytes (DeepEP's "logical" bytes)


SCHEMES = ("push_local", "channel_pairs", "deepep_v2")


def push_items(remote_rows: float, peers: int, op: str, native: NativeOptions) -> int:
    """Chunks the native pushers of one rank take in turn: the chunks of each peer's rows (``remote_rows``
    spread evenly over ``peers``), as the kernels cut them with the options ``native``."""
    if peers < 1 or remote_rows <= 0:
        return 0
    return peers * num_chunks(native, op, remote_rows / peers)


def intranode_cost(shape: LayerShape, load: RankLoad, op: str, scheme: str, peers: int = 1,
                   copy_engine: bool = False, *, native: NativeOptions) -> OpCost:
    """One rank's cost inside one NVLink domain, for native kernels run with the options ``native``.

    ``push_local`` (ep_moe's native kernels): the options' push fraction of the SMs push; in a dispatch they
    read the rows bound for other ranks and store them into the receivers' buffers, while the other SMs copy
    the rank's own rows and drain the received chunks into the output. In a combine the pushers send
    each received row back to its source, and the others reduce a token's rows (the own rank's read in
    place) and write the sum.
    ``channel_pairs`` (DeepEP V1): half the SMs send, half receive. Dispatch senders read the tokens and
    store every row into its destination's buffer; receivers copy their buffer into the output. Combine
    runs it backwards: senders store each received row's result back to its source; receivers read a
    token's rows and write the sum.
    ``deepep_v2``: one pool of SMs reads the tokens once and stores every row (DeepEP V2's accounting,
    which leaves the receiver's copy epilogue out).
    ``peers``: the other ranks of the domain (R - 1); the ``push_local`` pushers' chunks are counted per
    peer (`push_items`).
    ``copy_engine``: a ``push_local`` combine whose rows go back by the copy engine
    (`ep_moe.native.policy`): no SM pushes, all of them reduce, and the link carries the same bytes.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"intranode_cost: argument 'scheme' must be one of {SCHEMES}, got {scheme!r}")
    if op == "dispatch":
        row = shape.dispatch_row_bytes
        out_rows, out_remote, in_rows, in_remote = load.sent_rows, load.sent_remote_rows, load.recv_rows, \
            load.recv_remote_rows
        source_reads, sink_writes = load.tokens * row, in_rows * row
    elif op == "combine":
        row = shape.combine_row_bytes
        out_rows, out_remote, in_rows, in_remote = load.recv_rows, load.recv_remote_rows, load.sent_rows, \
            load.sent_remote_rows
        source_reads, sink_writes = out_rows * row, load.tokens * row
    else:
        raise ValueError(f"intranode_cost: argument 'op' must be 'dispatch' or 'combine', got {op!r}")
    nvlink = max(out_remote, in_remote) * row
    store_local, store_peer = (out_rows - out_remote) * row, out_remote * row
    if scheme == "deepep_v2":
        pools = (SmPool("all", 1.0, source_reads, store_local, store_peer),)
    elif scheme == "channel_pairs":
        pools = (SmPool("send", 0.5, source_reads, store_local, store_peer),
                 SmPool("recv", 0.5, in_rows * row, sink_writes, 0.0))
    elif op == "dispatch":  # push_local: pushers move remote rows; the rest copy own + received rows
        share, chunks = push_fraction(native, op), push_items(out_remote, peers, op, native)
        pools = (SmPool("push", share, store_peer, 0.0, store_peer, chunks),
                 SmPool("local", 1 - share, in_rows * row, sink_writes, 0.0))
    elif copy_engine:  # push_local combine, rows returned by the copy engine: every SM reduces
        pools = (SmPool("reduce", 1.0, in_rows * row, sink_writes, 0.0),)
    else:  # push_local combine: pushers return rows to remote sources; reducers read every row of a token
        share, chunks = push_fraction(native, op), push_items(out_remote, peers, op, native)
        pools = (SmPool("push", share, store_peer, 0.0, store_peer, chunks),
                 SmPool("reduce", 1 - share, in_rows * row, sink_writes, 0.0))
    recv_rows = load.recv_rows if op == "dispatch" else load.sent_rows
    return OpCost(op, nvlink, 0.0, pools, recv_rows * shape.dispatch_row_bytes)


def multinode_cost(shape: LayerShape, topology: Topology, op: str, hybrid: bool, imbalance: float = 1.0) -> OpCost:
    """One rank's cost across NVLink domains, with DeepEP V2's traffic accounting per received byte.

    Hybrid mode: tokens cross the network once per destination node (to the same-index GPU there) and are
    forwarded over NVLink; direct mode: every rank sends to every rank, over RDMA when it is in another node.
    ``imbalance`` scales everything by the busiest rank's received rows over the mean.
    """
    num_ranks, per_node = topology.world_size, topology.nvlink_ranks
    nodes = num_ranks // per_node
    topk_ranks = expected_groups(shape.num_experts, shape.topk, num_ranks)
    row = shape.dispatch_row_bytes if op == "dispatch" else shape.combine_row_bytes
    recv_bytes = shape.tokens * topk_ranks * row * imbalance
    inv = 1.0 / topk_ranks
    if hybrid and nodes > 1:
        topk_nodes = expected_groups(shape.num_experts, shape.topk, nodes)
        read = inv + topk_nodes * inv                                # tokens, then forwarding reads
        write = inv + inv * topk_nodes / nodes + 1.0                 # send buffer, local bypass, NVLink issue
        rdma = inv * topk_nodes * (1.0 - 1.0 / nodes)
        nvlink = 1.0 - 1.0 / per_node
    else:
        read = inv
        write = (inv if nodes > 1 else 0.0) + per_node / num_ranks    # send buffer (RDMA), NVLink issue
        nvlink = per_node / num_ranks * (1.0 - 1.0 / per_node)
        rdma = (num_ranks - per_node) / num_ranks
    pool = SmPool("all", 1.0, read * recv_bytes, write * recv_bytes, 0.0)
    return OpCost(op, nvlink * recv_bytes, rdma * recv_bytes, (pool,), recv_bytes)


__all__ = ["DTYPE_BYTES", "SCHEMES", "LayerShape", "OpCost", "RankLoad", "SmPool", "dtype_bytes", "split_sms",
           "expected_groups", "intranode_cost", "multinode_cost", "push_items", "rank_loads"]
