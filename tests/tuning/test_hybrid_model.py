"""The flat vs hybrid traffic and time model (`ep_moe.tuning.hybrid_model`) and `ep-moe simulate`: the balanced-gate
expectation against Monte-Carlo over the exact per-hop counts (which tests/hybrid/test_hybrid.py checks against the
backend's counters), predictions, and the command."""

from __future__ import annotations

import math

import pytest
import torch

from ep_moe.tuning.bandwidth_model import LayerShape, expected_groups
from ep_moe.tuning.hybrid_model import exact_hop_rows, expected_traffic, predict


@pytest.mark.parametrize("num_nodes, per_node", [(2, 4), (4, 2), (4, 8)])
def test_expected_traffic_matches_monte_carlo(num_nodes: int, per_node: int) -> None:
    """Uniform top-K routings: the mean exact counts approach the balanced-gate expectation."""
    E, K, T = 64, 6, 1500
    R = num_nodes * per_node
    gen = torch.Generator().manual_seed(R)
    idxs = [torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K] for _ in range(R)]
    rows = exact_hop_rows(idxs, E, num_nodes)
    shape = LayerShape(E, K, 128, T)
    hybrid = expected_traffic(shape, num_nodes, per_node, hybrid=True)
    reduced = expected_traffic(shape, num_nodes, per_node, hybrid=True, node_reduced=True)
    flat = expected_traffic(shape, num_nodes, per_node, hybrid=False)
    d_row, c_row = shape.dispatch_row_bytes, shape.combine_row_bytes
    for measured, expected in ((sum(r.dispatch_scaleout for r in rows) / R, hybrid.dispatch_nic / d_row),
                               (sum(r.dispatch_scaleup for r in rows) / R, hybrid.dispatch_nvlink / d_row),
                               (sum(r.combine_scaleup for r in rows) / R, hybrid.combine_nvlink / c_row),
                               (sum(r.combine_scaleout for r in rows) / R, hybrid.combine_nic / c_row),
                               (sum(r.combine_scaleout_node_reduced for r in rows) / R, reduced.combine_nic / c_row)):
        assert math.isclose(measured, expected, rel_tol=0.03), (measured, expected)
    # the unreduced combine moves what the flat path moves over the network
    assert math.isclose(hybrid.combine_nic / c_row, flat.combine_nic / c_row)
    # destination nodes per token: g(E, K, S), against the sampled mean
    nodes = sum(len({int(e) // (E // num_nodes) for e in row}) for idx in idxs for row in idx) / (R * T)
    assert math.isclose(nodes, expected_groups(E, K, num_nodes), rel_tol=0.02)


def test_predict_and_simulate(tmp_path, capsys) -> None:
    from ep_moe.cli.simulate import main

    shape = LayerShape(256, 8, 7168, 4096)
    flat, hybrid = predict(shape, 4, 8, "flat"), predict(shape, 4, 8, "hybrid")
    assert hybrid.traffic.dispatch_nic < flat.traffic.dispatch_nic and hybrid.dispatch_us < flat.dispatch_us
    assert hybrid.traffic.combine_nic == flat.traffic.combine_nic
    assert predict(shape, 4, 8, "hybrid", nic_gbs=1e6).dispatch_bound == "nvlink"
    with pytest.raises(ValueError, match="argument 'mode'"):
        predict(shape, 4, 8, "other")
    png = tmp_path / "sim.png"
    assert main(["--nodes", "2,4", "--gpus-per-node", "8", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "hybrid-node-reduced*" in out and png.stat().st_size > 0  # the mode ElasticBuffer runs by default
    assert main(["--nodes", "2", "--allow-multiple-reduction", "0"]) == 0
    assert " hybrid* " in capsys.readouterr().out
    assert main(["--nodes", "3"]) == 2  # 256 experts over 3 nodes: a clear error


def test_pipeline_and_plan_hybrid() -> None:
    from types import SimpleNamespace

    from ep_moe.tuning.hybrid_model import apply_hybrid_plan, pipeline_us, plan_hybrid

    assert pipeline_us(100.0, 40.0, 1, 5.0) == 145.0          # one chunk: the hops one after the other
    assert pipeline_us(100.0, 40.0, 4, 5.0) == 100 + 10 + 20  # the slower hop + one piece of the faster + launches
    with pytest.raises(ValueError, match="argument 'num_chunks'"):
        pipeline_us(1.0, 1.0, 0)
    big, small = LayerShape(256, 8, 7168, 4096), LayerShape(256, 8, 7168, 64)
    for shape in (big, small):
        for nodes in (2, 4, 8):
            plan = plan_hybrid(shape, nodes, 8)
            cost = {n: pipeline_us(plan.dispatch_nic_us, plan.dispatch_nvlink_us, n)
                    + pipeline_us(plan.combine_nic_us, plan.combine_nvlink_us, n) for n in range(1, 5)}
            assert plan.num_chunks == min(cost, key=lambda n: (cost[n], n))
            assert plan.dispatch_us + plan.combine_us == pytest.approx(cost[plan.num_chunks])
            assert plan.scaleup_sms % 2 == 0 and 2 <= plan.scaleup_sms <= 132 and plan.scaleout_sms >= 1
            assert plan.traffic == expected_traffic(shape, nodes, 8, hybrid=True, node_reduced=True)
            unreduced = plan_hybrid(shape, nodes, 8, allow_multiple_reduction=False)
            assert unreduced.traffic == expected_traffic(shape, nodes, 8, hybrid=True)
            assert unreduced.combine_nic_us > plan.combine_nic_us and not unreduced.node_reduced
    assert plan_hybrid(big, 2, 8).num_chunks > 1 and plan_hybrid(small, 2, 8).num_chunks == 1
    assert plan_hybrid(big, 2, 8, max_chunks=2).num_chunks <= 2
    assert plan_hybrid(big, 1, 8).num_chunks == 1  # one node (the two-hop code's 1 x G view): nothing to overlap
    # a faster NIC leaves the in-node hop less time: it needs at least as many SMs
    assert plan_hybrid(big, 2, 8, nic_gbs=400.0).scaleup_sms >= plan_hybrid(big, 2, 8).scaleup_sms
    for kwargs, name in (({"num_nodes": 0, "per_node": 8}, "num_nodes"), ({"num_nodes": 2, "per_node": 8,
                                                                            "max_chunks": 0}, "max_chunks"),
                         ({"num_nodes": 2, "per_node": 8, "nic_gbs": 0.0}, "nic_gbs")):
        with pytest.raises(ValueError, match=name):
            plan_hybrid(big, **kwargs)
    # the backend's chunk count follows the plan unless the buffer fixed one
    calls = []
    backend = SimpleNamespace(num_nodes=2, per_node=8, max_chunks=4, chunks_fixed=False,
                              allow_multiple_reduction=True, set_num_chunks=calls.append)
    plan = apply_hybrid_plan(backend, 256, 8, 7168, 4096, 2)
    assert calls == [plan.num_chunks] and plan == plan_hybrid(big, 2, 8, max_chunks=4)
    backend.chunks_fixed = True
    apply_hybrid_plan(backend, 256, 8, 7168, 64, 2)
    assert calls == [plan.num_chunks]


def test_tune_prints_the_hybrid_plan(capsys) -> None:
    from ep_moe.cli import main
    from ep_moe.tuning.hybrid_model import plan_hybrid

    assert main(["tune", "--experts", "256", "--topk", "8", "--hidden", "7168", "--tokens", "4096", "--ranks", "32",
                 "--ranks-per-node", "8", "--gpu", "H200", "--nic-gbps", "400"]) == 0
    out = capsys.readouterr().out
    plan = plan_hybrid(LayerShape(256, 8, 7168, 4096), 4, 8, nic_gbs=50.0)
    line = next(line for line in out.splitlines() if "hybrid plan E256 K8 H7168 T4096" in line)
    assert f"hybrid 4 x 8: {plan.num_chunks} chunks, {plan.scaleup_sms} SMs in the node" in line, line
    assert "hybrid view 4 x 8" in out
    assert main(["tune", "--experts", "256", "--topk", "8", "--hidden", "7168", "--tokens", "4096", "--ranks", "8",
                 "--gpu", "H200"]) == 0
    assert "hybrid plan" not in capsys.readouterr().out  # one node: no hybrid view
