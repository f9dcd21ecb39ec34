"""DeepEP V2's analytic SM and QP counts (`ep_moe.tuning.theoretical`): the expected-groups formula against
enumeration, monotonicity, the bounds, the QP rules, and V2's published counts worked out by hand."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from ep_moe.tuning import (
    LayerShape,
    deepep_v2_num_sms,
    get_theoretical_num_qps,
    get_theoretical_num_sms,
    theoretical,
)
from ep_moe.tuning.machine_topology import Topology
from ep_moe.tuning.theoretical import estimate_theoretical_sms, v2_allocated_qps

H100_NVLINK = 18 * 26.5625 * 0.9  # V2's NVLink rate: 0.9 x the links `nvidia-smi nvlink -s` lists (430.3 GB/s)
B200_NVLINK = 18 * 50.0 * 0.9  # 810 GB/s
CX7 = 400 / 8  # V2's RDMA rate: the NIC's `ibstat` rate in Gb/s over 8 (50 GB/s)


def sms(experts=256, topk=8, ranks=8, per_node=None, nvlink=H100_NVLINK, rdma=CX7, **kw):
    kw.setdefault("max_sms", 132)
    return get_theoretical_num_sms(experts, topk, 0, rdma, nvlink, num_ranks=ranks, num_nvlink_ranks=per_node, **kw)


# ------------------------------------------------------------------------------------------ expected groups
def _enumerated_groups(experts: int, topk: int, groups: int) -> Fraction:
    per_group = experts // groups
    combos = list(itertools.combinations(range(experts), topk))
    return Fraction(sum(len({e // per_group for e in c}) for c in combos), len(combos))


@pytest.mark.parametrize("experts,topk,ranks", [(8, 2, 2), (8, 2, 4), (8, 3, 8), (12, 3, 3), (12, 4, 6),
                                                (12, 12, 4), (16, 1, 4), (16, 5, 8)])
def test_expected_ranks_equal_enumeration(experts, topk, ranks):
    est = estimate_theoretical_sms(experts, topk, 0, 0, 100.0, num_ranks=ranks, max_sms=132)
    assert est.expected_ranks == pytest.approx(float(_enumerated_groups(experts, topk, ranks)), rel=1e-12)


def test_expected_scaleout_domains_equal_enumeration_and_monte_carlo():
    # 12 experts over 2 domains of 3 ranks, top-3: the domains a token reaches, by enumeration
    est = estimate_theoretical_sms(12, 3, 0, 10.0, 100.0, num_ranks=6, num_nvlink_ranks=3, max_sms=132)
    assert est.expected_scaleout_ranks == pytest.approx(float(_enumerated_groups(12, 3, 2)), rel=1e-12)
    # 256 experts, top-8 over 4 nodes of 8: sampled tokens
    est = estimate_theoretical_sms(256, 8, 0, CX7, H100_NVLINK, num_ranks=32, num_nvlink_ranks=8, max_sms=132)
    rng = random.Random(0)
    trials = 20000
    nodes = sum(len({e // 64 for e in rng.sample(range(256), 8)}) for _ in range(trials)) / trials
    ranks = sum(len({e // 8 for e in rng.sample(range(256), 8)}) for _ in range(trials)) / trials
    assert abs(nodes - est.expected_scaleout_ranks) < 0.02 and abs(ranks - est.expected_ranks) < 0.03
    # direct mode has no scale-out domain
    assert estimate_theoretical_sms(256, 8, 0, CX7, H100_NVLINK, num_ranks=32, num_nvlink_ranks=8, hybrid=False,
                                    max_sms=132).expected_scaleout_ranks == 0.0


# ------------------------------------------------------------------------------------------ V2's numbers
def test_v2_intranode_counts():
    """E256 K8 on one NVLink domain of 8 ranks (hidden size and tokens do not enter V2's model).

    g = 8 * (1 - C(224, 8) / C(256, 8)) = 8 * (1 - 0.338168) = 5.29465. Per byte received the SMs read
    1/g = 0.18887 (each token once) and write 8/8 = 1 (every row, the own rank's included), NVLink carries
    1 - 1/8 = 0.875. The write side binds: SMs = nvlink / 0.875 * 1 / 50.
    - H100 (18 x 26.5625 GB/s x 0.9 = 430.31 GB/s): 9.836 SMs, x 1.25 = 12.29 -> 13 -> even 14.
    - B200 (18 x 50 x 0.9 = 810 GB/s): 18.514, x 1.25 = 23.14 -> 24, V2's README "SM100, EP 8: 24 (Min #SM)";
      without overlap preference at least 64, its "64 (Max perf)".
    - 18 x 25 GB/s (405 GB/s): 9.257, x 1.25 = 11.57 -> 12.
    """
    est = estimate_theoretical_sms(256, 8, 0, 0.0, H100_NVLINK, num_ranks=8, max_sms=132)
    assert est.expected_ranks == pytest.approx(5.294652, abs=1e-6)
    assert (est.sm_read, est.sm_write, est.nvlink_traffic, est.rdma_traffic) == pytest.approx(
        (0.188870, 1.0, 0.875, 0.0), abs=1e-6)
    assert est.bottleneck == "nvlink" and est.exact_sms == pytest.approx(9.8357, abs=1e-4) and est.num_sms == 14
    assert sms(nvlink=B200_NVLINK, max_sms=148) == 24
    assert sms(nvlink=B200_NVLINK, max_sms=148, prefer_overlap_with_compute=False) == 64
    assert sms(nvlink=18 * 25.0 * 0.9) == 12


def test_v2_hybrid_counts():
    """E256 K8, 8 ranks per node, hybrid mode, 400 Gb/s NICs (50 GB/s), H100 NVLink (430.31 GB/s).

    EP 8 x 2: g = 6.52328 (16 ranks), nodes reached g_out = 2 * (1 - C(128, 8) / C(256, 8)) = 1.99302.
    Per byte received: read = (1 + g_out) / g = 0.45882; write = 1/g (send buffer) + g_out / (2 g) (own node's
    rows) + 1 (NVLink forward) = 1.30606; RDMA = g_out / g * (1 - 1/2) = 0.15276; NVLink = 0.875. RDMA binds
    (0.15276 / 50 > 0.875 / 430.31): SMs = 50 / 0.15276 * 1.30606 / 50 = 8.550, x 1.25 = 10.69 -> 11 -> 12.
    EP 8 x 4: g = 7.26680, g_out = 4 * (1 - C(192, 8) / C(256, 8)) = 3.61421; write = 1.26195, RDMA = 0.37302:
    SMs = 3.383, x 1.25 = 4.23 -> 5 -> 6. Both are V2's README table ("SM90, CX7, EP 8 x 2: 12; EP 8 x 4: 6").
    QPs (hybrid): 16 x SMs + 1 = 193 and 97, under V2's default allocation of 129 QPs: 129 and 97.
    """
    two = estimate_theoretical_sms(256, 8, 0, CX7, H100_NVLINK, num_ranks=16, num_nvlink_ranks=8, max_sms=132)
    assert (two.expected_ranks, two.expected_scaleout_ranks) == pytest.approx((6.523280, 1.993020), abs=1e-6)
    assert (two.sm_read, two.sm_write, two.rdma_traffic, two.nvlink_traffic) == pytest.approx(
        (0.458821, 1.306059, 0.152762, 0.875), abs=1e-6)
    assert two.bottleneck == "rdma" and two.exact_sms == pytest.approx(8.5496, abs=1e-4) and two.num_sms == 12
    four = estimate_theoretical_sms(256, 8, 0, CX7, H100_NVLINK, num_ranks=32, num_nvlink_ranks=8, max_sms=132)
    assert four.expected_scaleout_ranks == pytest.approx(3.614214, abs=1e-6)
    assert (four.sm_write, four.rdma_traffic) == pytest.approx((1.261952, 0.373020), abs=1e-6)
    assert four.bottleneck == "rdma" and four.exact_sms == pytest.approx(3.3831, abs=1e-4) and four.num_sms == 6
    cap = v2_allocated_qps(hybrid=True)
    assert [get_theoretical_num_qps(n, True, cap) for n in (12, 6)] == [129, 97]


def test_v2_direct_mode_bounds_by_nvlink_only():
    """Direct mode across 2 nodes: V2 counts RDMA traffic (half the rows) but sizes by NVLink alone.

    g = 6.52328; read = 1/g = 0.15330; write = 1/g (RDMA send buffer) + 8/16 (NVLink stores) = 0.65330;
    NVLink = 8/16 * (1 - 1/8) = 0.4375: SMs = 430.31 / 0.4375 * 0.65330 / 50 = 12.851, x 1.25 = 16.06 -> 17 -> 18.
    """
    est = estimate_theoretical_sms(256, 8, 0, CX7, H100_NVLINK, num_ranks=16, num_nvlink_ranks=8, hybrid=False,
                                   max_sms=132)
    assert est.rdma_traffic == pytest.approx(0.5) and est.nvlink_traffic == pytest.approx(0.4375)
    assert est.bottleneck == "nvlink" and est.exact_sms == pytest.approx(12.851, abs=1e-3) and est.num_sms == 18
    assert get_theoretical_num_qps(18, False, v2_allocated_qps(hybrid=False)) == 9


@pytest.mark.parametrize("world,per_node", [(2, 2), (8, 8), (16, 8), (32, 8), (64, 8)])
def test_agrees_with_the_planners_deepep_v2_rule(world, per_node):
    """`deepep_v2_num_sms` reaches V2's count through the planner's byte costs; both agree (hybrid mode)."""
    for link_gbs in (25.0, 26.5625, 50.0):
        topo = Topology.preset("H100", world, per_node, nic_gbps=400, nvlink_link_gbs=link_gbs)
        for experts, topk in ((256, 8), (64, 6), (128, 2)):
            assert sms(experts, topk, world, per_node, nvlink=topo.nvlink_gbs * 0.9) == deepep_v2_num_sms(
                LayerShape(experts, topk, 1024, 64), topo)


# ------------------------------------------------------------------------------------------ behaviour
def test_monotonic():
    # faster links need more SMs to keep them busy; faster SMs need fewer
    by_nvlink = [sms(nvlink=gbs, max_sms=1000) for gbs in (100, 200, 400, 800, 1600, 3200)]
    assert by_nvlink == sorted(by_nvlink) and by_nvlink[-1] > by_nvlink[0]
    by_write = [sms(nvlink=1600, sm_write_gbs=gbs, max_sms=1000) for gbs in (25, 50, 100, 200)]
    assert by_write == sorted(by_write, reverse=True) and by_write[0] > by_write[-1]
    by_rdma = [sms(ranks=32, per_node=8, rdma=gbs, max_sms=1000) for gbs in (12.5, 25, 50, 100, 200)]
    assert by_rdma == sorted(by_rdma)
    # a token reaches more ranks with more experts picked and with more (smaller) groups
    reach = [estimate_theoretical_sms(256, k, 0, 0, 400.0, num_ranks=8, max_sms=132).expected_ranks
             for k in (1, 2, 4, 8, 16, 32)]
    assert reach == sorted(reach) and reach[0] == 1.0 and reach[-1] < 8
    spread = [estimate_theoretical_sms(256, 8, 0, 0, 400.0, num_ranks=r, max_sms=132).expected_ranks
              for r in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert spread == sorted(spread) and spread[0] == 1.0 and spread[-1] == pytest.approx(8.0)


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_bounds(hybrid, overlap):
    for (world, per_node), (experts, topk), nvlink, rdma, max_sms in itertools.product(
            ((1, 1), (2, 2), (8, 8), (16, 8), (32, 8), (16, 4), (8, 1)), ((256, 8), (64, 6), (32, 1), (16, 16)),
            (50.0, 430.0, 3000.0), (12.5, 50.0, 400.0), (16, 78, 132, 148)):
        if experts % world:
            continue
        n = sms(experts, topk, world, per_node, nvlink=nvlink, rdma=rdma, hybrid=hybrid,
                prefer_overlap_with_compute=overlap, max_sms=max_sms)
        assert 4 <= n <= max_sms and n % 2 == 0
        if not overlap:
            assert n >= min(64, max_sms)
        if world == 1:  # nothing to send: V2 hands over the whole device
            assert n == max_sms
    # below the floor the device's count wins, odd or not (V2 caps last)
    assert sms(nvlink=10.0, max_sms=3) == 3 and sms(nvlink=1e6, max_sms=77) == 77
    assert sms(nvlink=10.0) == 4  # the floor


def test_qps():
    assert [get_theoretical_num_qps(n, hybrid=False) for n in (1, 2, 8, 9, 10, 64)] == [1, 2, 8, 9, 9, 9]
    assert [get_theoretical_num_qps(n, hybrid=True) for n in (1, 4, 12)] == [17, 65, 193]
    assert get_theoretical_num_qps(12, True, 65) == 65 and get_theoretical_num_qps(2, True, 65) == 33
    assert get_theoretical_num_qps(12, False, 4) == 4 and get_theoretical_num_qps(12, False, 0) == 9
    assert (v2_allocated_qps(False), v2_allocated_qps(True), v2_allocated_qps(True, fast_rdma_atomics=True)) == (
        17, 129, 65)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_sms"):
            get_theoretical_num_qps(bad, True)
    with pytest.raises(ValueError, match="num_allocated_qps"):
        get_theoretical_num_qps(4, True, -1)


def test_argument_errors():
    with pytest.raises(ValueError, match="divisible"):
        sms(experts=6, topk=2, ranks=4)
    with pytest.raises(ValueError, match="multiple of num_nvlink_ranks"):
        sms(ranks=16, per_node=6)
    with pytest.raises(ValueError, match="num_scaleout_topk"):
        get_theoretical_num_sms(256, 8, 2, 50.0, 400.0, num_ranks=16, num_nvlink_ranks=8, max_sms=132)
    with pytest.raises(ValueError, match="num_topk"):
        sms(topk=0)
    with pytest.raises(ValueError, match="per-SM"):
        sms(sm_read_gbs=0)
    with pytest.raises(ValueError, match="max_sms"):
        sms(max_sms=0)


def test_defaults_without_a_gpu(monkeypatch):
    """No GPU and no rates given: the H200 datasheet's NVLink x 0.9 (430.31 GB/s, 14 SMs as above), a 400 Gb/s
    NIC across nodes, and 132 SMs as the device's."""
    monkeypatch.setattr(theoretical, "detect_topology", lambda **_: Topology())
    monkeypatch.setattr(theoretical, "device_num_sms", lambda: theoretical.FALLBACK_DEVICE_SMS)
    assert get_theoretical_num_sms(256, 8, num_ranks=8) == 14
    assert get_theoretical_num_sms(256, 8, num_ranks=32, num_nvlink_ranks=8) == 6
    assert get_theoretical_num_sms(256, 8, num_ranks=1) == 132
