"""GPU checks of calibration (2 GPUs, NCCL): the copy benchmarks give plausible rates, every rank gets the
same ones, and the cache file round-trips them. The planner-vs-sweep check is benchmarks/tune_check.py."""

from __future__ import annotations

import pytest
import torch

from ep_moe.distributed import run_distributed

pytestmark = pytest.mark.gpu


def _calibrate_worker(rank, world_size, path):
    from ep_moe.tuning.calibration import calibrate, load_rates
    from ep_moe.tuning.topology import detect_topology

    topo = detect_topology(world_size=world_size, local_world_size=world_size)
    rates = calibrate(topology=topo, path=path, force=True, say=lambda line: None)
    return rates.to_dict(), load_rates(topo, "native", path).to_dict(), topo.to_dict()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_calibration_measures_plausible_rates(tmp_path):
    path = str(tmp_path / "calibration.json")
    (r0, cached, topo), (r1, _, _) = run_distributed(_calibrate_worker, 2, path, backend="nccl", timeout_s=300,
                                                    join_timeout_s=600)
    assert r0 == r1  # every rank plans with the same numbers
    assert r0["measured"] and not [n for n in r0["notes"] if "not measured" in n], r0["notes"]
    assert 10 < r0["sm_write_gbs"] < 500 and 10 < r0["sm_read_gbs"] < 2000 and 10 < r0["sm_peer_write_gbs"] < 500
    assert 50 < r0["nvlink_gbs"] <= 1.05 * topo["nvlink_links"] * topo["nvlink_link_gbs"] or not topo["nvlink_links"]
    assert cached["nvlink_gbs"] == r0["nvlink_gbs"] and "cached" in cached["source"]
