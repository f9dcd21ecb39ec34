"""Turning a layer shape and a topology into a `CommPlan`: SMs, QPs, predicted times."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from ..config import NativeOptions
from .bandwidth_model import (
    SCHEMES,
    LayerShape,
    OpCost,
    expected_groups,
    intranode_cost,
    multinode_cost,
    rank_loads,
    split_sms,
)
from .machine_topology import FALLBACK_DEVICE_SMS, FALLBACK_GPU, Topology
from .rates import DEFAULT_RDMA_EFFICIENCY, DEFAULT_RDMA_GBS, Rates, smooth_max
from .theoretical import get_theoretical_num_sms


@dataclass(frozen=True)
class PlanPolicy:
    """How the planner turns predicted times into an SM count.

    Attributes:
        scheme: kernel structure for intranode groups: "push_local" (ep_moe's native kernels),
            "channel_pairs" (DeepEP V1) or "deepep_v2"; multi-node groups use DeepEP V2's accounting.
        native: the native kernels' settings the "push_local" scheme models (the share of SMs that push,
            the pushers' chunks); None: `NativeOptions.from_env`, read when a plan is made (what a `Buffer`
            made without ``native_options`` runs with).
        combine_copy_engine: model a "push_local" combine that returns its rows by the copy engine (every SM
            reduces), as the native backend does after an exact-size dispatch with large pairs on 2 ranks
            (`ep_moe.native.policy.wanted`). Off by default: combines after a fixed-size dispatch
            (``num_worst_tokens``, what the calibration probes and ``benchmarks/tune_check.py`` time) use
            pushers, and the pusher model asks for at least as many SMs as the copy engine needs.
        margin: if set, SMs = ``margin`` x the SMs whose throughput matches the bottleneck link (the knee;
            DeepEP V2 uses 1.25). If None, the fewest SMs whose predicted dispatch + combine time is within
            ``time_tolerance`` of the time at the reference count: ``knee_cap`` x the knee (``max_sms`` when
            ``knee_cap`` is None or nothing crosses a link).
        time_tolerance, knee_cap: see ``margin``. Past the knee a kernel gains only SM-side latency, which the
            fitted curve extrapolates poorly, so the reference stays near the knee; 1.6 x reaches the next drop
            in the pushers' chunk rounds (16 pushers take 64 chunks in 4 rounds). The sweeps that chose these
            values are in CHANGELOG.md.
        min_sms: lower bound (even). max_sms: upper bound (default: the device's SMs).
        hybrid: multi-node mode: hybrid (RDMA to the same-index GPU, then NVLink) or direct.
        num_allocated_qps: cap on QPs (None = no cap).
    """

    scheme: str = "push_local"
    native: NativeOptions | None = None
    combine_copy_engine: bool = False
    margin: float | None = None
    time_tolerance: float = 0.05
    knee_cap: float | None = 1.6
    min_sms: int = 2
    max_sms: int | None = None
    hybrid: bool = True
    num_allocated_qps: int | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"PlanPolicy: argument 'scheme' must be one of {SCHEMES}, got {self.scheme!r}")
        if self.native is not None and not isinstance(self.native, NativeOptions):
            raise ValueError(f"PlanPolicy: argument 'native' must be an ep_moe.NativeOptions or None, got "
                             f"{type(self.native).__name__}")
        if self.margin is not None and not self.margin > 0:
            raise ValueError(f"PlanPolicy: argument 'margin' must be > 0 or None, got {self.margin!r}")
        if self.knee_cap is not None and not self.knee_cap >= 1:
            raise ValueError(f"PlanPolicy: argument 'knee_cap' must be >= 1 or None, got {self.knee_cap!r}")
        if not 0 <= self.time_tolerance < 1:
            raise ValueError(f"PlanPolicy: argument 'time_tolerance' must be in [0, 1), got {self.time_tolerance!r}")
        if not isinstance(self.min_sms, int) or self.min_sms < 2 or self.min_sms % 2:
            raise ValueError(f"PlanPolicy: argument 'min_sms' must be an even int >= 2, got {self.min_sms!r}")
        if self.max_sms is not None and (not isinstance(self.max_sms, int) or self.max_sms < self.min_sms):
            raise ValueError(f"PlanPolicy: argument 'max_sms' must be an int >= min_sms ({self.min_sms}), "
                             f"got {self.max_sms!r}")

    def native_options(self) -> NativeOptions:
        """The native kernels' settings to model: ``native``, else `NativeOptions.from_env` (read now)."""
        return self.native if self.native is not None else NativeOptions.from_env()

    def copy_engine(self) -> bool:
        """Whether the combine is modelled as returning its rows by the copy engine."""
        return self.scheme == "push_local" and self.combine_copy_engine


# DeepEP V2's rule: 1.25 x the SMs that keep the bottleneck link busy, even, at least 4.
DEEPEP_V2_POLICY = PlanPolicy(scheme="deepep_v2", margin=1.25, min_sms=4)


@dataclass
class CommPlan:
    """The communication plan of one layer shape (times in microseconds).

    Attributes:
        key: the shape's cache key. layer: the layer it was asked for (None = any layer of the shape).
        num_sms: SMs for dispatch and combine (even). num_qps: RDMA queue pairs (0 intranode).
        bottleneck: "nvlink", "rdma" or "none" (nothing crosses a link). sm_bound: the plan's SMs, not the
            link, limit the predicted time.
        mode: "intranode", "hybrid" or "direct". expected_ranks: distinct ranks per token (g).
        predicted_dispatch_us, predicted_combine_us: the model's times at ``num_sms``.
        measured_dispatch_us, measured_combine_us: measured at ``num_sms`` (None until measured).
        measured_us: measured dispatch + combine (set also when only the total was measured).
        deepep_v2_sms: DeepEP V2's rule for the same shape and topology, for comparison.
        source: "model", "override:<where>", "file" or "refined".
        history: (SMs, measured dispatch + combine us) pairs tried by `refine`.
    """

    key: str
    shape: LayerShape
    num_sms: int
    num_qps: int
    bottleneck: str
    sm_bound: bool
    mode: str
    num_ranks: int
    expected_ranks: float
    predicted_dispatch_us: float
    predicted_combine_us: float
    measured_dispatch_us: float | None = None
    measured_combine_us: float | None = None
    measured_us: float | None = None
    deepep_v2_sms: int | None = None
    source: str = "model"
    layer: str | None = None
    history: list[tuple[int, float]] = field(default_factory=list)

    @property
    def predicted_us(self) -> float:
        return self.predicted_dispatch_us + self.predicted_combine_us

    def record(self, dispatch_us: float | None, combine_us: float | None, total_us: float | None = None) -> None:
        """Store measured times at ``num_sms`` (the total defaults to dispatch + combine)."""
        self.measured_dispatch_us, self.measured_combine_us = dispatch_us, combine_us
        if total_us is None and dispatch_us is not None and combine_us is not None:
            total_us = dispatch_us + combine_us
        self.measured_us = total_us

    def to_dict(self) -> dict:
        data = asdict(self)
        data["history"] = [list(h) for h in self.history]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CommPlan:
        """The plan ``to_dict`` wrote; keys it no longer has (``chunk_tokens`` of older files) are ignored."""
        values = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        values["shape"] = LayerShape(**values["shape"]) if isinstance(values.get("shape"), dict) else values["shape"]
        values["history"] = [(int(n), float(t)) for n, t in values.get("history", [])]
        plan = cls(**values)
        check_num_sms("CommPlan.from_dict", "num_sms", plan.num_sms)
        return plan


def check_num_sms(where: str, name: str, value) -> int:
    """``value`` as an even SM count >= 2, else a ValueError naming ``name``."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} must be an even integer >= 2, got {value!r}") from None
    if n != value and not (isinstance(value, str) and value.strip().isdigit()):
        raise ValueError(f"{where}: {name} must be an even integer >= 2, got {value!r}")
    if n < 2 or n % 2:
        raise ValueError(f"{where}: {name} must be an even integer >= 2, got {value!r}")
    return n


def num_qps(num_sms: int, topology: Topology, hybrid: bool = True, cap: int | None = None) -> int:
    """RDMA queue pairs, with DeepEP V2's conventions: none inside one NVLink domain; direct mode
    ``min(SMs, 9)`` (few QPs, fewer doorbells); hybrid ``16 * SMs + 1`` (one per channel and peer, plus
    one for the count exchange)."""
    if topology.intranode:
        return 0
    qps = 16 * num_sms + 1 if hybrid else min(num_sms, 9)
    return qps if cap is None else min(qps, cap)


def device_sms(topology: Topology, policy: PlanPolicy) -> int:
    """The upper bound on SMs: the policy's, else the device's (even)."""
    limit = topology.num_sms or FALLBACK_DEVICE_SMS
    if policy.max_sms is not None:
        limit = min(limit, policy.max_sms)
    return max(policy.min_sms, limit - limit % 2)


def op_costs(shape: LayerShape, topology: Topology, policy: PlanPolicy, routing=None) -> list[tuple[OpCost, OpCost]]:
    """(dispatch, combine) costs for each rank worth looking at (the balanced rank, or every rank)."""
    if topology.intranode:
        loads = rank_loads(shape, topology.world_size, routing)
        peers = topology.world_size - 1
        native = policy.native_options()
        return [tuple(intranode_cost(shape, load, op, policy.scheme, peers,
                                     copy_engine=policy.copy_engine() and op == "combine", native=native)
                      for op in ("dispatch", "combine")) for load in loads]
    imbalance = 1.0
    if routing is not None:
        loads = rank_loads(shape, topology.world_size, routing)
        balanced = rank_loads(shape, topology.world_size)[0]
        busiest = max(load.recv_rows for load in loads)
        imbalance = busiest / balanced.recv_rows if balanced.recv_rows else 1.0
    return [(multinode_cost(shape, topology, "dispatch", policy.hybrid, imbalance),
             multinode_cost(shape, topology, "combine", policy.hybrid, imbalance))]


def link_seconds(cost: OpCost, rates: Rates) -> dict[str, float]:
    """Seconds each link needs for ``cost`` at the calibrated rates (a link with no rate but traffic: inf)."""
    out = {}
    for name, nbytes, gbs in (("nvlink", cost.nvlink_bytes, rates.nvlink_gbs), ("rdma", cost.rdma_bytes, rates.rdma_gbs)):
        if nbytes > 0:
            out[name] = nbytes / (gbs * 1e9) if gbs > 0 else math.inf
    return out


def sm_seconds(cost: OpCost, rates: Rates, num_sms: float) -> float:
    """Seconds the slowest SM pool needs when the call has ``num_sms`` SMs (the ideal, unfitted rates).
    An int ``num_sms`` is split as the native backend splits its blocks, and a pool whose work comes in
    items (the pushers' chunks) counts the rounds its busiest SM takes; a fractional ``num_sms`` splits
    the pools by their shares (for the knee, where SMs are continuous)."""
    if isinstance(num_sms, int):
        counts = [p.effective_sms(k) for p, k in zip(cost.pools, split_sms(cost.pools, num_sms))]
    else:
        counts = [num_sms * p.share for p in cost.pools]
    return max((p.work_seconds(rates.sm_read_gbs, rates.sm_write_gbs, rates.sm_peer_write_gbs) / k
                for p, k in zip(cost.pools, counts)), default=0.0)


def predict_us(cost: OpCost, rates: Rates, num_sms: int) -> float:
    """Predicted time of one op at ``num_sms`` SMs, in us (the kernel fit's overhead included)."""
    fit = rates.fit(cost.op)
    link = max(link_seconds(cost, rates).values(), default=0.0) / fit.link_scale
    sm = sm_seconds(cost, rates, num_sms) / fit.sm_scale
    return fit.overhead_us + 1e6 * smooth_max((link, sm), fit.sharpness)


def _knee_sms(costs: list[tuple[OpCost, OpCost]], rates: Rates) -> float:
    """SMs at which SM throughput matches the bottleneck link, over both ops and all ranks."""
    knee = 0.0
    for pair in costs:
        for cost in pair:
            fit = rates.fit(cost.op)
            link = max(link_seconds(cost, rates).values(), default=0.0) / fit.link_scale
            if link > 0 and math.isfinite(link):
                knee = max(knee, sm_seconds(cost, rates, 1.0) / fit.sm_scale / link)
    return knee


def _times(costs, rates: Rates, n: int) -> tuple[float, float]:
    """(dispatch, combine) us of the rank whose dispatch + combine is slowest."""
    return max(((predict_us(d, rates, n), predict_us(c, rates, n)) for d, c in costs), key=sum)


def _even_up(x: float) -> int:
    n = math.ceil(x)
    return n + n % 2


def choose_num_sms(costs: list[tuple[OpCost, OpCost]], rates: Rates, policy: PlanPolicy, upper: int) -> int:
    """The SM count the policy asks for (even, within [policy.min_sms, upper])."""
    if policy.margin is not None:
        knee = _knee_sms(costs, rates)
        if knee <= 0:  # nothing crosses a link (EP = 1): DeepEP V2 hands the whole device over
            return upper
        return min(upper, max(policy.min_sms, _even_up(knee * policy.margin)))
    reference = upper
    if policy.knee_cap is not None:
        knee = _knee_sms(costs, rates)
        if knee > 0:
            reference = min(upper, max(policy.min_sms, _even_up(knee * policy.knee_cap)))
    target = sum(_times(costs, rates, reference)) * (1.0 + policy.time_tolerance)
    for n in range(policy.min_sms, reference + 1, 2):
        if sum(_times(costs, rates, n)) <= target:
            return n
    return reference


def plan_layer(shape: LayerShape, topology: Topology, rates: Rates | None = None, policy: PlanPolicy | None = None,
               routing=None, layer: str | None = None, num_sms: int | None = None) -> CommPlan:
    """The plan for one layer shape on ``topology``.

    Args:
        shape: the layer's (E, K, H, T, dtype). topology: the EP group (``topology.world_size`` ranks).
        rates: calibrated rates (default: `Rates.defaults`). policy: default `PlanPolicy()`.
        routing: a measured routing histogram (see `rank_loads`); the plan is then made for the busiest
            rank instead of a balanced gate.
        layer: recorded in the plan.
        num_sms: plan at this SM count instead of choosing one (overrides; predicted times still filled).
    """
    policy = policy or PlanPolicy()
    topology, rates, fallback = planning_target(topology, rates)
    if shape.num_experts % topology.world_size:
        raise ValueError(f"plan_layer: num_experts ({shape.num_experts}) must be divisible by the EP size "
                         f"{topology.world_size}")
    costs = op_costs(shape, topology, policy, routing)
    if num_sms is None:
        n = choose_num_sms(costs, rates, policy, device_sms(topology, policy))
    else:
        n = check_num_sms("plan_layer", "num_sms", num_sms)
    dispatch_us, combine_us = _times(costs, rates, n)
    dispatch = max((d for d, _ in costs), key=lambda c: predict_us(c, rates, n))
    links = link_seconds(dispatch, rates)
    bottleneck = max(links, key=links.get) if links else "none"
    fit = rates.dispatch
    link_s = max(links.values(), default=0.0) / fit.link_scale
    sm_bound = sm_seconds(dispatch, rates, n) / fit.sm_scale > link_s
    mode = "intranode" if topology.intranode else ("hybrid" if policy.hybrid else "direct")
    return CommPlan(key=shape.key(), shape=shape, num_sms=n,
                    num_qps=num_qps(n, topology, policy.hybrid, policy.num_allocated_qps),
                    bottleneck=bottleneck, sm_bound=sm_bound, mode=mode, num_ranks=topology.world_size,
                    expected_ranks=expected_groups(shape.num_experts, shape.topk, topology.world_size),
                    predicted_dispatch_us=dispatch_us, predicted_combine_us=combine_us,
                    deepep_v2_sms=deepep_v2_num_sms(shape, topology), layer=layer,
                    source=f"model ({FALLBACK_GPU} datasheet: no GPU here)" if fallback else "model")


def planning_target(topology: Topology, rates: Rates | None) -> tuple[Topology, Rates, bool]:
    """The topology and rates to plan with: ``topology`` itself, or a `FALLBACK_GPU` node of the same group
    shape when it has no GPU (a CPU machine planning for GPUs). The flag says which."""
    if topology.has_gpu:
        target, rates, fallback = topology, rates or Rates.defaults(topology), False
    else:
        target, fallback = Topology.preset(FALLBACK_GPU, topology.world_size, topology.ranks_per_domain,
                                           nic_gbps=topology.nic_gbs * 8 if topology.nic_gbs else None), True
        if rates is None or not rates.measured:
            rates = Rates.defaults(target) if rates is None else replace(
                rates, nvlink_gbs=rates.nvlink_gbs or Rates.defaults(target).nvlink_gbs,
                rdma_gbs=rates.rdma_gbs or Rates.defaults(target).rdma_gbs)
    if not target.intranode and rates.rdma_gbs <= 0:  # across nodes, and no NIC was found here
        rates = replace(rates, rdma_gbs=DEFAULT_RDMA_GBS * DEFAULT_RDMA_EFFICIENCY,
                        notes=rates.notes + (f"no NIC found: {DEFAULT_RDMA_GBS:g} GB/s per GPU assumed",))
    return target, rates, fallback


def deepep_v2_num_sms(shape: LayerShape, topology: Topology, nvlink_gbs: float | None = None,
                      rdma_gbs: float | None = None) -> int:
    """DeepEP V2's analytical SM count for this shape on ``topology`` (`theoretical.get_theoretical_num_sms`, with
    V2's rate assumptions for the topology's links unless rates are given)."""
    rates = Rates.deepep_v2(topology)
    return get_theoretical_num_sms(
        shape.num_experts, shape.topk, rdma_gbs=rates.rdma_gbs if rdma_gbs is None else rdma_gbs,
        nvlink_gbs=rates.nvlink_gbs if nvlink_gbs is None else nvlink_gbs, num_ranks=topology.world_size,
        num_nvlink_ranks=topology.ranks_per_domain, max_sms=topology.num_sms or FALLBACK_DEVICE_SMS)


__all__ = ["DEEPEP_V2_POLICY", "CommPlan", "PlanPolicy", "check_num_sms", "choose_num_sms",
           "deepep_v2_num_sms", "device_sms", "num_qps", "op_costs", "plan_layer", "predict_us"]
