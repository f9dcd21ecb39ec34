"""The flat vs hybrid traffic and time model (`ep_moe.tuning.hybrid`) and `ep-moe simulate`: the balanced-gate
expectation against Monte-Carlo over the exact per-hop counts (which tests/hybrid/test_hybrid.py checks against the
backend's counters), predictions, and the command."""

from __future__ import annotations

import math

import pytest
import torch

from ep_moe.tuning.hybrid import exact_hop_rows, expected_traffic, predict
from ep_moe.tuning.model import LayerShape, expected_groups


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
    flat = expected_traffic(shape, num_nodes, per_node, hybrid=False)
    d_row, c_row = shape.dispatch_row_bytes, shape.combine_row_bytes
    for measured, expected in ((sum(r.dispatch_scaleout for r in rows) / R, hybrid.dispatch_nic / d_row),
                               (sum(r.dispatch_scaleup for r in rows) / R, hybrid.dispatch_nvlink / d_row),
                               (sum(r.combine_scaleup for r in rows) / R, hybrid.combine_nvlink / c_row),
                               (sum(r.combine_scaleout for r in rows) / R, hybrid.combine_nic / c_row)):
        assert math.isclose(measured, expected, rel_tol=0.03), (measured, expected)
    # the unreduced combine moves what the flat path moves over the network
    assert math.isclose(hybrid.combine_nic / c_row, flat.combine_nic / c_row)
    # destination nodes per token: g(E, K, S), against the sampled mean
    nodes = sum(len({int(e) // (E // num_nodes) for e in row}) for idx in idxs for row in idx) / (R * T)
    assert math.isclose(nodes, expected_groups(E, K, num_nodes), rel_tol=0.02)


def test_predict_and_simulate(tmp_path, capsys) -> None:
    from ep_moe.tuning.simulate import main

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
    assert "hybrid-node-reduced" in out and png.stat().st_size > 0
    assert main(["--nodes", "3"]) == 2  # 256 experts over 3 nodes: a clear error
