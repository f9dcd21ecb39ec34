"""Traffic and time of dispatch/combine across nodes: flat (one hop) vs hybrid (two hops, `ep_moe.backends.hybrid`).

A group of R = S x G ranks (S nodes of G GPUs, ranks of a node consecutive), E experts, top-K, T tokens per
rank, H hidden. Counts are rows a rank sends to *other* ranks per call, per hop; bytes = rows x row bytes.

* Flat: a token goes to each destination rank once; rows to ranks of other nodes cross the network (NIC), the
  others NVLink.
* Hybrid dispatch: a token crosses the network once per destination node (deduplicated), to the same-index GPU,
  which forwards it over NVLink to the node's destination ranks.
* Hybrid combine: rows return over NVLink to the forwarder. With ``allow_multiple_reduction=True`` (DeepEP V2's
  and `ep_moe.ElasticBuffer`'s default; ``node_reduced``) the forwarder sums them per token and sends one row per
  (token, node) over the network, as many as the dispatch; with False it relays every (token, rank) row
  unreduced (the flat combine's bits): as many network rows as flat.

`exact_hop_rows` counts a given routing (what `ep_moe.backends.hybrid.HopTraffic` measures); `expected_traffic` is
the balanced-gate expectation with ``g(E, K, n) = n (1 - C(E - E/n, K) / C(E, K))`` distinct destination
groups per token (`expected_groups`); `predict` turns bytes into time with the NIC and NVLink rates (the hops
overlapped: the busier link bounds the call) and adds DeepEP V2's SM and QP counts (`ep_moe.tuning.theoretical`).
`plan_hybrid` is the tuner's plan of a hybrid group (what `ep_moe.ElasticBuffer` runs with, in the buffer's combine
mode): the chunk count that minimizes the predicted two-hop pipeline (`pipeline_us`) and the SMs of each hop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bandwidth_model import LayerShape, expected_groups
from .machine_topology import Topology
from .rates import Rates
from .theoretical import estimate_theoretical_sms, get_theoretical_num_qps, v2_allocated_qps

DEFAULT_NIC_GBS = 50.0
"""NIC bandwidth per GPU, GB/s (400 Gb/s)."""
DEFAULT_GPU = "H200"


def hybrid_row_bytes(hidden: int, dtype_bytes: int, topk: int) -> dict[str, int]:
    """Bytes of one row on the wire of `ep_moe.backends.hybrid.HybridBackend`, per operation: a dispatch row carries the
    activations, the top-k ids (int64) and weights (fp32), the token index and the source rank (int64 each); a
    cached dispatch the activations; a combine the activations (plus ``4 K`` with weights carried back)."""
    act = hidden * dtype_bytes
    return {"dispatch": act + 12 * topk + 16, "cached_dispatch": act, "combine": act,
            "combine_with_weights": act + 4 * topk}


@dataclass(frozen=True)
class HopRows:
    """Rows one rank sends to other ranks in one call, per operation and hop."""

    dispatch_scaleout: int
    dispatch_scaleup: int
    combine_scaleup: int
    combine_scaleout: int              # allow_multiple_reduction=False: one row per (token, rank)
    combine_scaleout_node_reduced: int  # allow_multiple_reduction=True: one row per (token, node)


def exact_hop_rows(topk_idxs: list[torch.Tensor], num_experts: int, num_nodes: int) -> list[HopRows]:
    """Per rank, the rows the hybrid path sends per hop for this routing (``topk_idxs[s] [T_s, K]`` global expert
    ids of rank s, -1 = none), ranks ``n * G .. n * G + G - 1`` forming node n. Plain loops from the definitions
    in the module docstring (independent of the backend)."""
    num_ranks = len(topk_idxs)
    if num_nodes < 1 or num_ranks % num_nodes or num_experts % num_ranks:
        raise ValueError(f"exact_hop_rows: argument 'num_nodes' must divide the {num_ranks} ranks (and the ranks "
                         f"the {num_experts} experts), got {num_nodes}")
    per_node, per_rank = num_ranks // num_nodes, num_experts // num_ranks
    d_out, d_up, c_up, c_out, c_out_reduced = ([0] * num_ranks for _ in range(5))
    for s, idx in enumerate(topk_idxs):
        node_s, local_s = divmod(s, per_node)
        for row in idx.tolist():
            ranks = sorted({e // per_rank for e in row if e >= 0})
            nodes = sorted({q // per_node for q in ranks})
            d_out[s] += sum(1 for n in nodes if n != node_s)
            for n in nodes:
                forwarder = n * per_node + local_s
                here = [q for q in ranks if q // per_node == n]
                d_up[forwarder] += sum(1 for q in here if q != forwarder)
                for q in here:
                    c_up[q] += q != forwarder
                if n != node_s:
                    c_out[forwarder] += len(here)
                    c_out_reduced[forwarder] += 1
    return [HopRows(*v) for v in zip(d_out, d_up, c_up, c_out, c_out_reduced)]


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends per call (balanced gate): over the network (NIC) and over NVLink, per operation."""

    dispatch_nic: float
    dispatch_nvlink: float
    combine_nic: float
    combine_nvlink: float


def expected_traffic(shape: LayerShape, num_nodes: int, per_node: int, hybrid: bool,
                     node_reduced: bool = False) -> Traffic:
    """Expected bytes per GPU and call under a balanced gate (rows as in the module docstring; dispatch rows
    ``shape.dispatch_row_bytes``, combine rows ``shape.combine_row_bytes``). ``node_reduced``: the hybrid
    combine that sums inside the node first (``allow_multiple_reduction=True``); else the unreduced one."""
    if num_nodes < 1 or per_node < 1:
        raise ValueError(f"expected_traffic: arguments 'num_nodes' and 'per_node' must be >= 1, got {num_nodes}, "
                         f"{per_node}")
    R, S, G, T = num_nodes * per_node, num_nodes, per_node, shape.tokens
    g_ranks = expected_groups(shape.num_experts, shape.topk, R)
    d_row, c_row = shape.dispatch_row_bytes, shape.combine_row_bytes
    remote_rank_rows = T * g_ranks * (R - G) / R   # (token, rank) pairs in other nodes
    local_rank_rows = T * g_ranks * (G - 1) / R    # (token, rank) pairs in the own node, other ranks
    if not hybrid or S == 1:
        return Traffic(remote_rank_rows * d_row, local_rank_rows * d_row, remote_rank_rows * c_row,
                       local_rank_rows * c_row)
    g_nodes = expected_groups(shape.num_experts, shape.topk, S)
    node_rows = T * g_nodes * (S - 1) / S          # (token, node) pairs in other nodes
    forward_rows = T * g_ranks * (G - 1) / G       # rows a forwarder hands to the other ranks of its node
    combine_nic = node_rows if node_reduced else remote_rank_rows
    return Traffic(node_rows * d_row, forward_rows * d_row, combine_nic * c_row, forward_rows * c_row)


@dataclass(frozen=True)
class Prediction:
    """One configuration's predicted traffic and time per call."""

    mode: str             # one of `MODES`
    num_nodes: int
    per_node: int
    traffic: Traffic
    dispatch_us: float
    combine_us: float
    dispatch_bound: str   # "nic" or "nvlink"
    combine_bound: str
    num_sms: int          # DeepEP V2's analytic SM count for this mode
    num_qps: int          # and its queue pairs (capped by what V2 allocates)


MODES = ("flat", "hybrid", "hybrid-node-reduced")
"""`predict`'s modes: the flat path; the hybrid path with its combine unreduced (``allow_multiple_reduction=False``)
or reduced inside the node (True, `ep_moe.ElasticBuffer`'s default)."""


def hybrid_mode(allow_multiple_reduction: bool) -> str:
    """The `MODES` entry of a hybrid buffer with this ``allow_multiple_reduction``."""
    return "hybrid-node-reduced" if allow_multiple_reduction else "hybrid"


def default_nvlink_gbs(gpu: str = DEFAULT_GPU) -> float:
    """NVLink bandwidth per GPU and direction that ep_moe's model assumes without calibration
    (`Rates.defaults` of the GPU's datasheet)."""
    return Rates.defaults(Topology.preset(gpu, 8, 8)).nvlink_gbs


def predict(shape: LayerShape, num_nodes: int, per_node: int, mode: str, nic_gbs: float = DEFAULT_NIC_GBS,
            nvlink_gbs: float | None = None, max_sms: int = 132) -> Prediction:
    """Predicted time of one dispatch and one combine: the larger of NIC bytes / ``nic_gbs`` and NVLink bytes /
    ``nvlink_gbs`` (GB/s per GPU; None: `default_nvlink_gbs`), the two hops overlapped chunk by chunk.
    ``mode``: one of `MODES` ("flat"; "hybrid", the combine unreduced; "hybrid-node-reduced", reduced in the node)."""
    if mode not in MODES:
        raise ValueError(f"predict: argument 'mode' must be 'flat', 'hybrid' or 'hybrid-node-reduced', got {mode!r}")
    if nic_gbs <= 0:
        raise ValueError(f"predict: argument 'nic_gbs' must be > 0, got {nic_gbs!r}")
    nvlink = default_nvlink_gbs() if nvlink_gbs is None else nvlink_gbs
    if nvlink <= 0:
        raise ValueError(f"predict: argument 'nvlink_gbs' must be > 0, got {nvlink_gbs!r}")
    hybrid = mode != "flat"
    traffic = expected_traffic(shape, num_nodes, per_node, hybrid, mode == "hybrid-node-reduced")

    def time(nic_bytes: float, nvl_bytes: float) -> tuple[float, str]:
        nic_s, nvl_s = nic_bytes / (nic_gbs * 1e9), nvl_bytes / (nvlink * 1e9)
        return max(nic_s, nvl_s) * 1e6, "nic" if nic_s >= nvl_s else "nvlink"

    d_us, d_bound = time(traffic.dispatch_nic, traffic.dispatch_nvlink)
    c_us, c_bound = time(traffic.combine_nic, traffic.combine_nvlink)
    R = num_nodes * per_node
    sms = estimate_theoretical_sms(shape.num_experts, shape.topk, rdma_gbs=nic_gbs, nvlink_gbs=nvlink,
                                   num_ranks=R, num_nvlink_ranks=per_node, hybrid=hybrid, max_sms=max_sms).num_sms
    scaleout = hybrid and num_nodes > 1
    qps = get_theoretical_num_qps(sms, scaleout, v2_allocated_qps(scaleout))
    return Prediction(mode, num_nodes, per_node, traffic, d_us, c_us, d_bound, c_bound, sms, qps)


DEFAULT_CHUNK_OVERHEAD_US = 15.0
"""Fixed cost of one more chunk, per hop: launching one more collective (or native dispatch) and its slot
bookkeeping. An assumption (not calibrated), of the order of one small NCCL all-to-all's latency."""
MAX_PLANNED_CHUNKS = 4


def pipeline_us(nic_us: float, nvlink_us: float, num_chunks: int,
                chunk_overhead_us: float = DEFAULT_CHUNK_OVERHEAD_US) -> float:
    """Predicted time of two hops cut into ``num_chunks`` pieces, chunk k's second hop running while chunk k+1
    crosses the first: the slower hop's time, plus one piece of the faster one (the pipeline's fill or drain),
    plus ``num_chunks`` x ``chunk_overhead_us`` (each chunk's launch, on both hops)."""
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"pipeline_us: argument 'num_chunks' must be an int >= 1, got {num_chunks!r}")
    return max(nic_us, nvlink_us) + min(nic_us, nvlink_us) / num_chunks + num_chunks * chunk_overhead_us


@dataclass(frozen=True)
class HybridPlan:
    """The tuner's plan of a hybrid group (S nodes x G GPUs) for one layer shape.

    Attributes:
        num_chunks: the scale-out hop's chunk count (`ep_moe.backends.hybrid.HybridBackend.set_num_chunks`).
        scaleup_sms: SMs of the in-node hop's native kernels (``Config.num_sms`` of the calls): the fewest (even)
            whose peer stores carry the busier operation's NVLink bytes within the call's predicted time.
        scaleout_sms: DeepEP V2's analytic SM count of the hybrid mode (reported: ep_moe's network hop is NCCL,
            which picks its own channels).
        dispatch_us, combine_us: predicted with the chunk pipeline; ``*_nic_us`` / ``*_nvlink_us``: each hop alone.
        traffic: the bytes per GPU (`expected_traffic`).
        node_reduced: the combine mode planned for (``allow_multiple_reduction``).
    """

    num_nodes: int
    per_node: int
    num_chunks: int
    scaleup_sms: int
    scaleout_sms: int
    dispatch_us: float
    combine_us: float
    dispatch_nic_us: float
    dispatch_nvlink_us: float
    combine_nic_us: float
    combine_nvlink_us: float
    traffic: Traffic
    node_reduced: bool = True

    def describe(self) -> str:
        chunks = f"{self.num_chunks} chunk" + ("s" if self.num_chunks > 1 else "")
        return (f"hybrid {self.num_nodes} x {self.per_node}: {chunks}, {self.scaleup_sms} SMs in "
                f"the node (native), {self.scaleout_sms} SMs by DeepEP V2's rule for the network hop (NCCL here); "
                f"dispatch {self.dispatch_us:.0f} us (NIC {self.dispatch_nic_us:.0f}, NVLink "
                f"{self.dispatch_nvlink_us:.0f}), combine {'reduced in the node' if self.node_reduced else 'unreduced'} "
                f"{self.combine_us:.0f} us (NIC {self.combine_nic_us:.0f}, NVLink {self.combine_nvlink_us:.0f})")


def plan_hybrid(shape: LayerShape, num_nodes: int, per_node: int, nic_gbs: float = DEFAULT_NIC_GBS,
                nvlink_gbs: float | None = None, sm_peer_write_gbs: float | None = None,
                max_chunks: int = MAX_PLANNED_CHUNKS, chunk_overhead_us: float = DEFAULT_CHUNK_OVERHEAD_US,
                min_sms: int = 2, max_sms: int = 132, allow_multiple_reduction: bool = True) -> HybridPlan:
    """The plan of a hybrid group from the model (`expected_traffic` of the hybrid path in the buffer's combine
    mode, ``allow_multiple_reduction``: True, reduced in the node, as `ep_moe.ElasticBuffer` by default; NIC at
    ``nic_gbs``, NVLink at ``nvlink_gbs``, None: `default_nvlink_gbs`; one SM's peer stores at
    ``sm_peer_write_gbs``, None: `Rates`' default). Chunks: the count in ``1..max_chunks`` with the least
    predicted dispatch + combine (`pipeline_us`; ties: fewer). ValueError naming a bad argument."""
    if num_nodes < 1 or per_node < 1:  # one node (the 1 x G view of the two-hop code): no network bytes
        raise ValueError(f"plan_hybrid: arguments 'num_nodes' and 'per_node' must be >= 1, got {num_nodes}, "
                         f"{per_node}")
    if not isinstance(max_chunks, int) or max_chunks < 1:
        raise ValueError(f"plan_hybrid: argument 'max_chunks' must be an int >= 1, got {max_chunks!r}")
    if nic_gbs <= 0:
        raise ValueError(f"plan_hybrid: argument 'nic_gbs' must be > 0, got {nic_gbs!r}")
    nvlink = default_nvlink_gbs() if nvlink_gbs is None else nvlink_gbs
    if nvlink <= 0:
        raise ValueError(f"plan_hybrid: argument 'nvlink_gbs' must be > 0, got {nvlink_gbs!r}")
    per_sm = Rates(nvlink_gbs=nvlink).sm_peer_write_gbs if sm_peer_write_gbs is None else sm_peer_write_gbs
    traffic = expected_traffic(shape, num_nodes, per_node, hybrid=True, node_reduced=allow_multiple_reduction)
    d_nic, d_nvl = traffic.dispatch_nic / nic_gbs / 1e3, traffic.dispatch_nvlink / nvlink / 1e3
    c_nic, c_nvl = traffic.combine_nic / nic_gbs / 1e3, traffic.combine_nvlink / nvlink / 1e3
    chunks = min(range(1, max_chunks + 1), key=lambda n: (pipeline_us(d_nic, d_nvl, n, chunk_overhead_us)
                                                          + pipeline_us(c_nic, c_nvl, n, chunk_overhead_us), n))
    # the in-node hop need not beat the network: its bytes within the op's time, at the SMs' peer-store rate
    need = 0.0
    for nvl_bytes, nic_us, nvl_us in ((traffic.dispatch_nvlink, d_nic, d_nvl), (traffic.combine_nvlink, c_nic, c_nvl)):
        budget_s = max(nic_us, nvl_us) * 1e-6
        if nvl_bytes and budget_s:
            need = max(need, nvl_bytes / (budget_s * per_sm * 1e9))
    sms = max(min_sms, min(max_sms, 2 * math.ceil(need / 2)))
    scaleout = estimate_theoretical_sms(shape.num_experts, shape.topk, rdma_gbs=nic_gbs, nvlink_gbs=nvlink,
                                        num_ranks=num_nodes * per_node, num_nvlink_ranks=per_node, hybrid=True,
                                        max_sms=max_sms).num_sms
    return HybridPlan(num_nodes, per_node, chunks, sms, scaleout,
                      pipeline_us(d_nic, d_nvl, chunks, chunk_overhead_us),
                      pipeline_us(c_nic, c_nvl, chunks, chunk_overhead_us), d_nic, d_nvl, c_nic, c_nvl, traffic,
                      allow_multiple_reduction)


def apply_hybrid_plan(backend, num_experts: int, topk: int, hidden: int, tokens: int, dtype_bytes: int
                      ) -> HybridPlan:
    """The plan of this shape for a `ep_moe.backends.hybrid.HybridBackend` (its S x G view, most chunks and combine mode,
    ``backend.allow_multiple_reduction``), whose chunk count it then sets unless the buffer fixed one (``backend.chunks_fixed``). ``tokens``: the most any rank
    holds (every rank must pass the same arguments, so that all cut the same chunks). Returns the plan (its
    ``scaleup_sms`` is the in-node hop's SM count)."""
    plan = plan_hybrid(LayerShape(num_experts, topk, hidden, tokens, min(dtype_bytes, 4)), backend.num_nodes,
                       backend.per_node, max_chunks=backend.max_chunks,
                       allow_multiple_reduction=backend.allow_multiple_reduction)
    if not backend.chunks_fixed:
        backend.set_num_chunks(plan.num_chunks)
    return plan


__all__ = ["DEFAULT_CHUNK_OVERHEAD_US", "DEFAULT_NIC_GBS", "MAX_PLANNED_CHUNKS", "MODES", "HopRows", "HybridPlan",
           "Prediction", "Traffic", "apply_hybrid_plan", "hybrid_mode", "default_nvlink_gbs", "exact_hop_rows", "expected_traffic", "hybrid_row_bytes",
           "pipeline_us", "plan_hybrid", "predict"]
