"""DeepEP V2's analytic SM and QP counts, beside the calibrated planner (`ep_moe.tuning.plan`).

DeepEP V2 sizes its kernels without measuring anything: under a balanced gate it counts, per byte a rank
receives, what the SMs read and write and what crosses NVLink and RDMA, takes the link that needs the most
time at its nominal rate as the bottleneck, and gives the kernel 1.25 x the SMs whose read or write rate keeps
that link busy. `get_theoretical_num_sms` and `get_theoretical_num_qps` give the same numbers as its
``ElasticBuffer`` methods of those names; the group's shape, which V2 reads from its buffer, is passed in
(``num_ranks``, ``num_nvlink_ranks``, ``hybrid``), so that a buffer's method can forward its own.

Unlike the calibrated planner this model has no kernel overheads, no fitted rates and no notion of token
count or hidden size (every quantity is a fraction of the bytes received, so they cancel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .bandwidth_model import expected_groups
from .machine_topology import FALLBACK_DEVICE_SMS, FALLBACK_GPU, Topology, detect_topology
from .rates import DEEPEP_V2_NVLINK_FACTOR, DEEPEP_V2_SM_READ_GBS, DEEPEP_V2_SM_WRITE_GBS, DEFAULT_RDMA_GBS

# V2's rule: this many times the SMs that keep the bottleneck link busy, at least MIN_SMS, even, and at least
# NO_OVERLAP_MIN_SMS when the caller does not want to leave SMs to concurrent compute.
SM_MARGIN = 1.25
MIN_SMS = 4
NO_OVERLAP_MIN_SMS = 64
DIRECT_MAX_QPS = 9  # direct mode: few QPs (fewer doorbells), 8 channels + 1 for the count exchange


@dataclass(frozen=True)
class TheoreticalEstimate:
    """What `estimate_theoretical_sms` computed (traffic as fractions of the bytes a rank receives).

    Attributes:
        expected_ranks: distinct ranks a token reaches (g over the whole group).
        expected_scaleout_ranks: distinct scale-out domains (nodes) a token reaches; 0 without scale-out.
        sm_read, sm_write: bytes the kernel's SMs read / write per byte received.
        nvlink_traffic, rdma_traffic: bytes over NVLink / RDMA per byte received.
        nvlink_gbs, rdma_gbs: the link rates used (GB/s).
        bottleneck: "nvlink", "rdma" or "none" (nothing crosses a link: every SM of the device).
        exact_sms: SMs that just keep the bottleneck busy, before margin, rounding and bounds (0 for "none").
        num_sms: the answer.
    """

    expected_ranks: float
    expected_scaleout_ranks: float
    sm_read: float
    sm_write: float
    nvlink_traffic: float
    rdma_traffic: float
    nvlink_gbs: float
    rdma_gbs: float
    bottleneck: str
    exact_sms: float
    num_sms: int


def _check_group(num_experts: int, num_topk: int, num_ranks: int, num_nvlink_ranks: int) -> None:
    for name, value in (("num_experts", num_experts), ("num_ranks", num_ranks),
                        ("num_nvlink_ranks", num_nvlink_ranks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"get_theoretical_num_sms: argument '{name}' must be a positive int, got {value!r}")
    if not isinstance(num_topk, int) or not 1 <= num_topk <= num_experts:
        raise ValueError(f"get_theoretical_num_sms: argument 'num_topk' must be an int in [1, {num_experts}], "
                         f"got {num_topk!r}")
    if num_experts % num_ranks:
        raise ValueError(f"get_theoretical_num_sms: num_experts ({num_experts}) must be divisible by num_ranks "
                         f"({num_ranks})")
    if num_ranks % num_nvlink_ranks:
        raise ValueError(f"get_theoretical_num_sms: num_ranks ({num_ranks}) must be a multiple of "
                         f"num_nvlink_ranks ({num_nvlink_ranks})")


def _detected() -> Topology:
    """This machine (one rank's view), else the fallback GPU's datasheet."""
    topology = detect_topology(world_size=1, local_world_size=1)
    if topology.has_gpu and topology.nvlink_links:
        return topology
    fallback = Topology.preset(FALLBACK_GPU, 1, 1)
    return Topology(gpu_name=topology.gpu_name or fallback.gpu_name, num_sms=topology.num_sms or fallback.num_sms,
                    nvlink_links=fallback.nvlink_links, nvlink_link_gbs=fallback.nvlink_link_gbs,
                    nic_gbs=topology.nic_gbs, source=topology.source)


def device_num_sms() -> int:
    """The current CUDA device's SM count, or `FALLBACK_DEVICE_SMS` without one."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    except Exception:  # a broken driver: plan as without a GPU
        pass
    return FALLBACK_DEVICE_SMS


def estimate_theoretical_sms(num_experts: int, num_topk: int, num_scaleout_topk: int = 0, rdma_gbs: float = 0.0,
                             nvlink_gbs: float = 0.0, sm_read_gbs: float = DEEPEP_V2_SM_READ_GBS,
                             sm_write_gbs: float = DEEPEP_V2_SM_WRITE_GBS, *, num_ranks: int,
                             num_nvlink_ranks: int | None = None, hybrid: bool = True,
                             prefer_overlap_with_compute: bool = True,
                             max_sms: int | None = None) -> TheoreticalEstimate:
    """`get_theoretical_num_sms` with its workings (see there for the arguments)."""
    num_nvlink_ranks = num_ranks if num_nvlink_ranks is None else num_nvlink_ranks
    _check_group(num_experts, num_topk, num_ranks, num_nvlink_ranks)
    if num_scaleout_topk != 0:
        raise ValueError("get_theoretical_num_sms: argument 'num_scaleout_topk' must be 0 (a group-limited gate "
                         f"is not modelled, as in DeepEP V2), got {num_scaleout_topk!r}")
    if not (sm_read_gbs > 0 and sm_write_gbs > 0):
        raise ValueError(f"get_theoretical_num_sms: per-SM rates must be > 0 GB/s, got read {sm_read_gbs!r}, "
                         f"write {sm_write_gbs!r}")
    if rdma_gbs < 0 or nvlink_gbs < 0:
        raise ValueError(f"get_theoretical_num_sms: link rates must be >= 0 GB/s (0 = detect), got rdma "
                         f"{rdma_gbs!r}, nvlink {nvlink_gbs!r}")
    if max_sms is not None and (not isinstance(max_sms, int) or max_sms < 1):
        raise ValueError(f"get_theoretical_num_sms: argument 'max_sms' must be a positive int or None, got "
                         f"{max_sms!r}")

    # Domains, as V2's runtime reports them: physically, NVLink domains of num_nvlink_ranks joined by RDMA;
    # logically, hybrid mode scales out across those domains, direct mode treats the group as one scale-up domain.
    num_rdma_ranks = num_ranks // num_nvlink_ranks
    num_scaleout, num_scaleup = (num_rdma_ranks, num_nvlink_ranks) if hybrid else (1, num_ranks)

    if nvlink_gbs == 0 or (rdma_gbs == 0 and num_rdma_ranks > 1):
        machine = _detected()
        nvlink_gbs = nvlink_gbs or machine.nvlink_gbs * DEEPEP_V2_NVLINK_FACTOR
        if num_rdma_ranks > 1:
            rdma_gbs = rdma_gbs or machine.nic_gbs or DEFAULT_RDMA_GBS
    device_sms = device_num_sms() if max_sms is None else max_sms

    g = expected_groups(num_experts, num_topk, num_ranks)
    g_out = expected_groups(num_experts, num_topk, num_scaleout) if num_scaleout > 1 else 0.0
    read = 1 / g  # each token is read once, per g rows it becomes
    if num_scaleout > 1:  # hybrid across domains: to the same-index rank of each node, then forwarded
        write = 1 / g  # the send buffer
        write += g_out / g / num_scaleout  # rows for the own node bypass the network
        rdma = g_out / g * (1 - 1 / num_scaleout)
        read += g_out / g  # the forwarders read what arrived
        write += 1.0  # and store every row into its scale-up destination
        nvlink = 1 - 1 / num_scaleup
    else:  # one scale-up domain (direct mode, or a single node)
        write = 1 / g if num_rdma_ranks > 1 else 0.0  # the RDMA send buffer
        write += num_nvlink_ranks / num_ranks  # rows stored over NVLink (the own rank's included)
        nvlink = num_nvlink_ranks / num_ranks * (1 - 1 / num_nvlink_ranks)
        rdma = (num_ranks - num_nvlink_ranks) / num_ranks

    # V2 weighs RDMA only when the group scales out (hybrid): in direct mode NVLink is the bound.
    if num_scaleout > 1 and rdma / rdma_gbs > nvlink / nvlink_gbs:
        bottleneck, traffic, gbs = "rdma", rdma, rdma_gbs
    else:
        bottleneck, traffic, gbs = "nvlink", nvlink, nvlink_gbs
    if traffic > 0:
        exact = max(gbs / traffic * read / sm_read_gbs, gbs / traffic * write / sm_write_gbs)
    else:  # nothing crosses the bounding link (EP = 1): the whole device
        bottleneck, exact = "none", 0.0
    n = math.ceil(exact * SM_MARGIN) if traffic > 0 else device_sms
    n = max(MIN_SMS, n)
    n += n % 2
    if not prefer_overlap_with_compute:
        n = max(n, NO_OVERLAP_MIN_SMS)
    n = min(n, device_sms)
    return TheoreticalEstimate(g, g_out, read, write, nvlink, rdma, nvlink_gbs, rdma_gbs, bottleneck, exact, n)


def get_theoretical_num_sms(num_experts: int, num_topk: int, num_scaleout_topk: int = 0, rdma_gbs: float = 0.0,
                            nvlink_gbs: float = 0.0, sm_read_gbs: float = DEEPEP_V2_SM_READ_GBS,
                            sm_write_gbs: float = DEEPEP_V2_SM_WRITE_GBS, *, num_ranks: int,
                            num_nvlink_ranks: int | None = None, hybrid: bool = True,
                            prefer_overlap_with_compute: bool = True, max_sms: int | None = None) -> int:
    """DeepEP V2's analytic SM count for dispatch and combine, under a balanced gate.

    A token's top-k experts reach ``g = R * (1 - C(E - E/R, K) / C(E, K))`` distinct ranks on average
    (`expected_groups`). Per byte a rank receives the model counts the SMs' reads and writes and the NVLink
    and RDMA traffic, picks the link that needs the most time (RDMA only where the group scales out in hybrid
    mode), and returns ``1.25 x`` the SMs whose read or write rate keeps that link busy, rounded up, at least
    4, even, at least 64 unless ``prefer_overlap_with_compute``, at most the device's SMs. With nothing to
    send (one rank) it returns the device's SMs.

    Args:
        num_experts, num_topk: E and K. num_scaleout_topk: reserved (0; a group-limited gate is not modelled).
        rdma_gbs: NIC rate per GPU in GB/s (0: detected NIC line rate, else 400 Gb/s; only read when the group
            spans NVLink domains).
        nvlink_gbs: NVLink rate per GPU in GB/s (0: 0.9 x the detected links, else 0.9 x the H200 datasheet).
        sm_read_gbs, sm_write_gbs: what one SM reads / writes per second (V2's defaults, 200 / 50 GB/s).
        num_ranks: the EP group's size. num_nvlink_ranks: ranks per NVLink domain (default: all of them).
        hybrid: V2's ``allow_hybrid_mode`` (across NVLink domains: RDMA to one rank per node, then NVLink).
        prefer_overlap_with_compute: False asks for at least 64 SMs (communication alone on the device).
        max_sms: the device's SM count (default: the current CUDA device's, else 132).
    """
    return estimate_theoretical_sms(num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs,
                                    sm_write_gbs, num_ranks=num_ranks, num_nvlink_ranks=num_nvlink_ranks,
                                    hybrid=hybrid, prefer_overlap_with_compute=prefer_overlap_with_compute,
                                    max_sms=max_sms).num_sms


def get_theoretical_num_qps(num_sms: int, hybrid: bool, num_allocated_qps: int = 0) -> int:
    """DeepEP V2's RDMA queue pairs for a kernel of ``num_sms`` SMs.

    Direct mode keeps them few, ``min(num_sms, 9)`` (fewer doorbells to ring); hybrid mode gives every
    channel of every SM its own, ``16 * num_sms + 1`` (one more for the count exchange). At most
    ``num_allocated_qps`` when it is > 0 (V2 always caps by its allocation: `v2_allocated_qps`).
    """
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1:
        raise ValueError(f"get_theoretical_num_qps: argument 'num_sms' must be a positive int, got {num_sms!r}")
    if not isinstance(num_allocated_qps, int) or num_allocated_qps < 0:
        raise ValueError(f"get_theoretical_num_qps: argument 'num_allocated_qps' must be an int >= 0, got "
                         f"{num_allocated_qps!r}")
    qps = 16 * num_sms + 1 if hybrid else min(num_sms, DIRECT_MAX_QPS)
    return min(qps, num_allocated_qps) if num_allocated_qps > 0 else qps


def v2_allocated_qps(hybrid: bool, fast_rdma_atomics: bool = False) -> int:
    """The QPs a V2 buffer allocates when not told: 17 in direct mode; in hybrid mode 129, or 65 on NICs with
    fast RDMA atomics (ConnectX-8)."""
    if not hybrid:
        return 17
    return 65 if fast_rdma_atomics else 129


__all__ = ["FALLBACK_DEVICE_SMS", "MIN_SMS", "NO_OVERLAP_MIN_SMS", "SM_MARGIN", "TheoreticalEstimate",
           "device_num_sms", "estimate_theoretical_sms", "get_theoretical_num_qps", "get_theoretical_num_sms",
           "v2_allocated_qps"]
