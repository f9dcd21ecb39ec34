"""`ep-moe tune` on CPU: tables for shapes and for a recipe, JSON output, errors; and the benchmark helper
that `--measure`/`refine` use, on two gloo ranks with the torch backend."""

from __future__ import annotations

import json

import pytest

from ep_moe.cli import main as ep_moe_main
from ep_moe.distributed import run_distributed
from ep_moe.tuning import load_plans


@pytest.fixture(autouse=True)
def _no_tuning_env(monkeypatch, tmp_path):
    for var in ("EP_MOE_NUM_SMS", "EP_MOE_PLAN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EP_MOE_CALIBRATION", str(tmp_path / "calibration.json"))


def test_tune_prints_a_table_for_shapes(capsys, tmp_path):
    out_json = tmp_path / "plans.json"
    rc = ep_moe_main(["tune", "--experts", "256", "--topk", "8", "--hidden", "7168", "--tokens", "4096", "512",
                      "--ranks", "2", "--gpu", "H200", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer"))
    rows = lines[header + 2:header + 4]
    assert "E256 K8 H7168 T4096 bf16" in rows[0] and "E256 K8 H7168 T512 bf16" in rows[1]
    assert "nvlink" in rows[0] and "H200" in out
    plans = load_plans(out_json)
    assert [p.shape.tokens for p in plans] == [4096, 512]
    assert all(p.num_sms % 2 == 0 and 2 <= p.num_sms <= 132 for p in plans)
    assert str(plans[0].num_sms) in rows[0].split()


@pytest.mark.parametrize("links", [0, 18])
def test_tune_says_a_plan_is_the_model_only_without_nvlink(capsys, monkeypatch, links):
    from ep_moe.cli import tune as tune_cli
    from ep_moe.tuning.machine_topology import Topology

    gpu = Topology.preset("H200", 2, 2)
    monkeypatch.setattr(tune_cli, "detect_topology", lambda **_: Topology(**{**gpu.__dict__, "nvlink_links": links}))
    assert ep_moe_main(["tune", "--experts", "16", "--topk", "2", "--hidden", "1024", "--tokens", "128",
                        "--ranks", "2"]) == 0
    note = [line for line in capsys.readouterr().out.splitlines() if "prediction only" in line]
    assert note == ([] if links else [
        "note: no NVLink on this machine: the plan below is the bandwidth model's prediction only, nothing was "
        "measured (the native kernels cannot run here)"])


def test_tune_deepep_rule_multinode(capsys):
    rc = ep_moe_main(["tune", "--experts", "256", "--topk", "8", "--hidden", "7168", "--tokens", "4096",
                      "--ranks", "32", "--ranks-per-node", "8", "--gpu", "H100", "--nic-gbps", "400",
                      "--rule", "deepep_v2"])
    out = capsys.readouterr().out
    assert rc == 0
    row = next(line for line in out.splitlines() if "E256 K8" in line).split()
    # layer, E, K, H, T, dtype, EP, g, bottleneck, SMs, QPs
    assert row[6] == "32" and row[8] == "rdma" and row[9] == "6" and row[10] == "97"


def test_tune_prints_deepep_v2s_theoretical_counts(capsys):
    """One line per (experts, top-k) after the table. EP2 on H200: g = 2 * (1 - C(128, 8) / C(256, 8)) = 1.993;
    per byte received the SMs write 1 and NVLink carries 1/2, so 0.9 x 478.1 GB/s / 0.5 / 50 GB/s = 17.2 SMs,
    x 1.25 = 21.5 -> 22 (`tests/tuning/test_theoretical.py` works V2's counts out in full)."""
    assert ep_moe_main(["tune", "--experts", "256", "--topk", "8", "--hidden", "7168", "--tokens", "4096", "512",
                        "--ranks", "2", "--gpu", "H200"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("theoretical")]
    assert len(lines) == 1 and ": 22 SMs, no QPs (one NVLink domain) for experts 256, top-k 8 on EP2" in lines[0]
    assert ep_moe_main(["tune", "--experts", "256", "--topk", "8", "--hidden", "7168", "--tokens", "4096",
                        "--ranks", "32", "--ranks-per-node", "8", "--gpu", "H100", "--nic-gbps", "400"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("theoretical")]
    assert len(lines) == 1 and ": 6 SMs, 97 QPs for experts 256, top-k 8 on EP32 (rdma-bound" in lines[0]


RECIPE = """
model:
  num_layers: 4
  hidden_size: 1024
  num_moe_experts: 16
  moe_router_topk: 2
  moe_layer_freq: 2
  expert_model_parallel_size: 2
  seq_length: 256
  bf16: true
train:
  micro_batch_size: 4
ep_moe:
  dispatcher_backend: auto
  num_sms: [0, 10]   # MoE layer 0: the model's count; MoE layer 1: 10
"""


def test_tune_reads_a_recipe(capsys, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    trainer_plan = tmp_path / "plan.json"
    rc = ep_moe_main(["tune", str(path), "--gpu", "H200", "--trainer-plan", str(trainer_plan)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "MoE layers: 2 (0=layer 0, 1=layer 2)" in out and "tokens per rank 1024" in out
    rows = [line for line in out.splitlines() if "E16 K2 H1024 T1024 bf16" in line]
    assert len(rows) == 2  # MoE layer 0 follows the model, MoE layer 1 is overridden
    by_layer = {r.split()[0]: r for r in rows}
    assert by_layer["1"].split()[9] == "10" and by_layer["1"].endswith("override:recipe layer 1")
    assert by_layer["*"].endswith("model") and by_layer["*"].split()[6] == "2"
    model_sms = int(by_layer["*"].split()[9])
    assert json.loads(trainer_plan.read_text()) == {"num_sms": [model_sms, 10]}
    # a tuning_plan file with num_sms (what --trainer-plan writes), relative to the recipe's folder
    (tmp_path / "tp.yaml").write_text("num_sms: 14\n")
    path.write_text(RECIPE.replace("  num_sms: [0, 10]   # MoE layer 0: the model's count; MoE layer 1: 10\n",
                                   "  tuning_plan: tp.yaml\n"))
    assert ep_moe_main(["tune", str(path), "--gpu", "H200"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "E16 K2" in line]
    assert len(rows) == 1 and rows[0].split()[9] == "14" and rows[0].endswith("override:file num_sms")


def test_tune_errors_are_clear(capsys, tmp_path):
    assert ep_moe_main(["tune", "--experts", "256"]) == 2
    assert "--topk" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: 8\n")
    assert ep_moe_main(["tune", str(bad)]) == 2
    assert "model.num_moe_experts" in capsys.readouterr().err
    assert ep_moe_main(["tune", "--experts", "6", "--topk", "2", "--hidden", "128", "--tokens", "8",
                        "--ranks", "4", "--gpu", "H200"]) == 2
    assert "divisible" in capsys.readouterr().err


def test_tune_refuses_a_calibration_file_it_cannot_use(capsys, tmp_path):
    """A file named by --calibration is what the user asked for: missing or damaged, the command stops naming
    it (a file the environment points at is only a default, replaced by the datasheet with a warning)."""
    shape = ["--experts", "256", "--topk", "8", "--hidden", "7168", "--tokens", "512", "--ranks", "2", "--gpu", "H200"]
    missing = tmp_path / "missing.json"
    assert ep_moe_main(["tune", *shape, "--calibration", str(missing)]) == 2
    assert f"--calibration: calibration {missing}: does not exist" in capsys.readouterr().err
    damaged = tmp_path / "damaged.json"
    damaged.write_text("{not json")
    assert ep_moe_main(["tune", *shape, "--calibration", str(damaged)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
    assert ep_moe_main(["tune", *shape]) == 0  # $EP_MOE_CALIBRATION names a file that does not exist: defaults


def _bench_worker(rank, world_size):
    """Time dispatch/combine on the torch backend and refine a plan with it (every rank the same answer)."""
    from ep_moe import Buffer
    from ep_moe.tuning import LayerShape, PlanCache, Rates
    from ep_moe.tuning.calibration import DispatchBench, buffer_measure_fn
    from ep_moe.tuning.machine_topology import Topology

    buffer = Buffer(backend="torch")
    shape = LayerShape(8, 2, 256, 24 + rank)  # uneven token counts across ranks on purpose
    bench = DispatchBench(buffer, shape)
    bench.check(8)
    matrix = bench.routing_matrix()
    d_us, c_us = bench.measure(8, iters=3, warmup=1)
    topo = Topology.preset("H200", world_size, world_size)
    cache = PlanCache(topo, Rates.defaults(topo), use_env=False)
    refined = cache.refine(LayerShape(8, 2, 256, 24), buffer_measure_fn(buffer, shape, iters=2, warmup=0), budget=3)
    buffer.destroy()
    return matrix, d_us, c_us, refined.num_sms, refined.source, len(refined.history)


def test_dispatch_bench_and_refine_on_gloo():
    results = run_distributed(_bench_worker, 2, timeout_s=60, join_timeout_s=120)
    (m0, d0, c0, n0, src0, h0), (m1, d1, c1, n1, _, _) = results
    assert m0 == m1 and max(m0[0]) <= 24 and max(m0[1]) <= 25 and 24 <= sum(m0[0]) <= 48 and m0[1][0] > 0
    assert d0 == d1 > 0 and c0 == c1 > 0  # the max over ranks: every rank gets the same numbers
    # Real (noisy) timings decide how many candidates refine tries; the budget bounds them.
    assert n0 == n1 and src0 == "refined" and 1 <= h0 <= 3
