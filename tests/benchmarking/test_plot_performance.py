"""benchmarks/plot_performance.py on small synthetic JSON files in the benchmarks' own formats (CPU).

The ``ep-moe bench`` file is written by `ep_moe.benchmarking.results.write_json` from `Row` objects, the Megatron
layer benchmark's by its own ``finish``; the DeepSpeed layer benchmark's has the structure its ``bench`` returns.
Times are chosen so that every ratio is exact.
"""

from __future__ import annotations

import json
import sys

import locations
import pytest

from ep_moe.benchmarking.results import Row, write_json

sys.path.insert(0, str(locations.REPO / "benchmarks"))
import plot_performance as plot  # noqa: E402

META = {"command": "ep-moe bench --tokens 128 4096 --num-sms 24 32 --json bench.json", "ranks": 2,
        "device": "NVIDIA H200", "device_type": "cuda", "timer": "CUDA events", "hidden": 7168, "experts": 256,
        "topk": 8, "tokens": [128, 4096], "dtypes": ["bf16", "fp8"], "num_sms": [24, 32], "plan_sms": False,
        "backends": ["torch", "native"], "runs": 30, "warmup": 10, "link_gbps": 394.0}


def _bench_rows(check: str = "ok") -> list[Row]:
    rows = []
    for tokens in (128, 4096):
        scale = tokens / 4096
        for op, dtype, torch_us, native_us in (("layout", None, 60.0, 12.0), ("dispatch_cached", "bf16", 280.0, 200.0),
                                               ("combine", "bf16", 840.0, 210.0), ("dispatch_cached", "fp8", 180.0,
                                                                                       120.0)):
            rows.append(Row("torch", op, dtype, tokens, None, median_us=torch_us * scale, kernels="torch"))
            for sms, factor in ((24, 1.0), (32, 0.5)):
                rows.append(Row("native", op, dtype, tokens, sms, median_us=native_us * scale * factor,
                                kernels="native (jit)"))
    rows[-1].check = check
    return rows


def _megatron(tmp_path, check: str = "ok"):
    import megatron_layer_bench as bench

    rows = [bench._row("alltoall", 6.0, 0.0, [], set(), None),
            bench._row("ep_moe[native]", 4.0, 1e-3, [] if check == "ok" else ["rank 0: out differs"], {"jit"},
                       "native"),
            bench._row("ep_moe[torch]", 5.0, 1e-3, [], {"jit"}, "torch"),
            bench._row(bench.NO_DISPATCHER, 3.0, None, [], set(), None)]
    result = {"rows": rows, "megatron_core": "0.16.1", "world": 1, "gpu": "NVIDIA H100", "kernels":
              "native kernels: jit", "args": {"tokens": 4096, "hidden": 4096, "ffn": 1024, "experts": 16, "topk": 4,
                                              "dtype": "bf16", "iters": 30, "rounds": 3, "trivial_experts": False}}
    path = tmp_path / "megatron.json"
    bench.finish(result, str(path))
    return path


def _deepspeed(tmp_path):
    checks = {m: {"check": "ok", "problems": [], "max_rel_diff": 0.0 if m.startswith("ep_moe") else None,
                  "l_aux_and_counts_equal": True, "permute": "jit" if m.startswith("ep_moe") else "-"}
              for m in ("deepspeed-capacity", "ep_moe-capacity", "deepspeed-dropless", "ep_moe-dropless")}
    ms = {"deepspeed-capacity": 9.0, "ep_moe-capacity": 6.0, "deepspeed-dropless": 8.0, "ep_moe-dropless": 10.0}
    data = {"config": {"tokens": 4096, "hidden": 4096, "ffn": 2048, "experts": 16, "k": 2, "dtype": "bf16",
                       "trivial_experts": False}, "world": 1, "device": "NVIDIA H100", "deepspeed": "0.19.8",
            "torch": "2.11.0+cu130", "ep_moe_backend": "local",
            "checks": {m: {"max_rel_diff": 0.0, "l_aux_and_counts_equal": True} for m in ms if m.startswith("ep_moe")},
            "timed_checks": checks,
            "timings": {m: {"fwd_ms": v / 3, "fwd_bwd_ms": v, "fwd_bwd_p25_ms": v, "fwd_bwd_p75_ms": v}
                        for m, v in ms.items()}}
    path = tmp_path / "deepspeed.json"
    path.write_text(json.dumps(data))
    return path


def test_ratios_titles_and_png(tmp_path, capsys):
    bench_path = tmp_path / "bench.json"
    write_json(bench_path, META, _bench_rows())
    out = tmp_path / "perf.png"
    files = [str(bench_path), str(_megatron(tmp_path)), str(_deepspeed(tmp_path))]
    capsys.readouterr()  # the Megatron benchmark's finish prints its table
    assert plot.main([*files, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ", 1)[1] for line in lines[:-1]] == [
        "layout: 5.00x vs torch", "dispatch_cached bf16: 1.40x vs torch", "combine bf16: 4.00x vs torch",
        "dispatch_cached fp8: 1.50x vs torch",
        "ep_moe[native]: 1.50x vs alltoall", "ep_moe[torch]: 1.20x vs alltoall",
        "capacity: 1.50x vs DeepSpeed", "dropless: 0.80x vs DeepSpeed"]
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600

    panels = plot.panels([str(bench_path)], tokens=128, num_sms=32)
    assert panels[0].bars[:2] == [("layout", pytest.approx(10.0)), ("dispatch_cached bf16", pytest.approx(2.8))]
    assert "2 x NVIDIA H200: 128 tokens/rank" in panels[0].title and "native at 32 SMs" in panels[0].title
    assert "kernels: native (jit)" in panels[0].title
    megatron = plot.panels([str(_megatron(tmp_path))])[0]
    assert "1 x NVIDIA H100\n4096 tokens/rank" in megatron.title and "native kernels: jit" in megatron.title
    assert "ep_moe backend local" in plot.panels([str(_deepspeed(tmp_path))])[0].title


def test_refuses_failed_checks_and_unknown_files(tmp_path, capsys):
    bench_path = tmp_path / "bench.json"
    write_json(bench_path, META, _bench_rows(check="FAIL"))
    assert plot.main([str(bench_path), "--out", str(tmp_path / "x.png")]) == 1
    assert "native dispatch_cached fp8 T=4096 SMs=32: check 'FAIL', not ok" in capsys.readouterr().err
    assert plot.main([str(bench_path), "--tokens", "128", "--out", str(tmp_path / "x.png")]) == 0  # other T: ok

    failed = _megatron(tmp_path, check="DIFF")
    capsys.readouterr()
    assert plot.main([str(failed), "--out", str(tmp_path / "x.png")]) == 1
    assert "ep_moe[native]: check 'DIFF', not ok" in capsys.readouterr().err

    cpu_only = tmp_path / "cpu.json"
    write_json(cpu_only, META, [r for r in _bench_rows() if r.backend == "torch"])
    assert plot.main([str(cpu_only), "--out", str(tmp_path / "x.png")]) == 1
    assert "needs torch and another backend at T=4096" in capsys.readouterr().err

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": [{"op": "x"}]}))
    assert plot.main([str(other), "--out", str(tmp_path / "x.png")]) == 1
    assert f"{other}: not the JSON of ep-moe bench" in capsys.readouterr().err
    assert plot.main([str(bench_path), "--tokens", "77", "--out", str(tmp_path / "x.png")]) == 1
    assert "no rows at tokens 77 (measured: [128, 4096])" in capsys.readouterr().err
