"""GPU checks of the tuner. One GPU: the calibration's stream kernel and the local rates it measures. Two GPUs
(NCCL): calibration gives plausible rates, the same on every rank, and the cache file round-trips them; and the
README's claim, measured: on each of the three check workloads the calibrated plan's dispatch + combine time is
within 10 % of the best of a sweep of SM counts (benchmarks/tune_check.py, run here with the native backend)."""

from __future__ import annotations

import json
import subprocess
import sys

import locations
import pytest
import torch

from ep_moe.distributed import run_distributed

pytestmark = pytest.mark.gpu


def _calibrate_worker(rank, world_size, path):
    from ep_moe.tuning.calibration import calibrate, load_rates
    from ep_moe.tuning.machine_topology import detect_topology

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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_plans_are_within_10_percent_of_a_measured_sweep(tmp_path):
    from ep_moe import native

    if not native.kernels_available():
        pytest.skip(f"no native kernels (the torch backend ignores the SM count): {native.kernels_unavailable_reason()}")
    out = tmp_path / "tune_check.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(locations.REPO / "benchmarks" / "tune_check.py"), "--sweep", "8:48:4", "--passes", "2",
           "--iters", "20", "--json", str(out)]
    run = subprocess.run(cmd, cwd=locations.REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["backend"] == "native", result["note"]
    print("\n".join(line for line in run.stdout.splitlines() if line.startswith("|")))
    for row in result["rows"]:
        assert row["within_10pct"], (row["workload"], row["planned_sms"], row["measured_us"], row["best_sms"],
                                     row["best_us"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_stream_kernel_copies_reads_and_writes_and_local_rates_are_plausible():
    """The calibration's JIT stream kernel on one GPU: a copy gives the source, a write gives each index, the read
    mode's per-thread sums add up to the source's sum (n not a multiple of 4: the tail loop runs too); then the
    per-SM local rates it measures lie in a plausible range."""
    from ep_moe.tuning.calibration import STREAM_THREADS, _stream, measure_local_sm_rates

    n, programs = (1 << 20) + 3, 4
    gen = torch.Generator(device="cuda").manual_seed(3)
    src = torch.randint(-1000, 1000, (n,), dtype=torch.int32, device="cuda", generator=gen)
    dst = torch.zeros_like(src)
    _stream(src, dst, programs, 0)
    assert torch.equal(dst, src)
    _stream(src, dst, programs, 2)
    assert torch.equal(dst, torch.arange(n, dtype=torch.int32, device="cuda"))
    sums = torch.zeros(programs * STREAM_THREADS, dtype=torch.int32, device="cuda")
    _stream(src, sums, programs, 1)
    assert int(sums.sum()) == int(src.sum())
    rates = measure_local_sm_rates(torch.device("cuda", torch.cuda.current_device()))
    assert set(rates) == {"copy", "read", "write"}
    assert all(5 < gbs < 2000 for gbs in rates.values()), rates
