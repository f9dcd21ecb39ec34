"""``ep-moe bench``: the CPU benchmark end to end, the byte/floor accounting, the timing helpers and
the argument checks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ep_moe.benchmarking import cli as bench
from ep_moe.benchmarking.accounting import floor_fraction, floor_us, gbps, row_payload_bytes, traffic
from ep_moe.benchmarking.checks import compare, round_trip_reference, same_bits
from ep_moe.benchmarking.report import Row, finalize, table
from ep_moe.benchmarking.timing import percentile, slowest_rank_per_run, summarize, time_runs
from ep_moe.benchmarking.workload import num_input_sets, to_fp8_blocks

TABLE_COLUMNS = ["backend", "dtype", "tokens", "SMs", "op", "median us", "p10-p90 us", "GB/s", "floor us",
                 "of floor", "vs torch", "check"]


def _rank_with_a_wrong_combine(rank: int, world_size: int, spec) -> dict | None:
    """`bench.run_rank` where combine flips the sign of a row when called with ``Config(num_sms=16)``:
    a kernel bug that the benchmark's checks must report (spawned ranks import this module)."""
    from ep_moe.backends.torch_backend import TorchBackend

    original = TorchBackend.combine

    def combine(self, y, handle, topk_weights, bias, config=None):
        out, weights = original(self, y, handle, topk_weights, bias, config)
        if config is not None and config.num_sms == 16 and out.shape[0]:
            out = out.clone()
            out[0] = -out[0]
        return out, weights

    TorchBackend.combine = combine
    return bench.run_rank(rank, world_size, spec)


@pytest.mark.timeout(300)
def test_cpu_bench_end_to_end(tmp_path, capsys, monkeypatch):
    """One spawned 2-rank run through the command line: torch, a torch backend that takes an SM budget
    (the code path of the native backend: SM sweep, bit-for-bit comparison with torch, speedups; its
    combine is wrong at 16 SMs) and a backend that cannot be built here. The wrong results and the
    error are reported, everything else still runs, and the exit status is 1."""
    monkeypatch.setitem(bench.BACKENDS, "torch-sms", bench.BackendSpec("torch-sms", "torch", True))
    monkeypatch.setitem(bench.BACKENDS, "broken", bench.BackendSpec("broken", "native", True))
    monkeypatch.setattr(bench, "run_rank", _rank_with_a_wrong_combine)
    out_json, out_png = tmp_path / "out" / "bench.json", tmp_path / "bench.png"
    rc = bench.main(["--device", "cpu", "--ranks", "2", "--backends", "torch", "torch-sms", "broken",
                     "--tokens", "24", "40", "--hidden", "128", "--experts", "8", "--topk", "3",
                     "--num-sms", "8", "16", "--runs", "10", "--warmup", "1",
                     "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert rc == 1  # the broken backend's error and the wrong combine

    data = json.loads(out_json.read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["ranks"] == 2 and meta["timer"].startswith("wall-clock") and meta["link_gbps"] is None
    broken = [r for r in rows if r["backend"] == "broken"]
    assert len(broken) == 1 and broken[0]["op"] == "setup" and broken[0]["check"] == "error"
    assert "cannot run here" in broken[0]["problems"][0]

    good = [r for r in rows if r["backend"] != "broken"]
    keys = {(r["backend"], r["op"], r["dtype"], r["tokens"], r["num_sms"]) for r in good}
    expected = set()
    for tokens in (24, 40):
        for backend, sms_list in (("torch", [None]), ("torch-sms", [8, 16])):
            expected.add((backend, "layout", None, tokens, None))
            for sms in sms_list:
                expected |= {(backend, op, "bf16", tokens, sms)
                             for op in ("dispatch", "dispatch_cached", "dispatch_fixed", "combine")}
                expected |= {(backend, op, "fp8", tokens, sms)
                             for op in ("dispatch", "dispatch_cached", "dispatch_fixed")}
    assert keys == expected and len(good) == len(expected)
    wrong = [r for r in good if r["check"] != "ok"]
    assert [(r["backend"], r["op"], r["num_sms"], r["check"]) for r in wrong] == \
        [("torch-sms", "combine", 16, "FAIL")] * 2  # both token counts
    for r in wrong:
        assert any("combine(dispatch(x)): differs" in p for p in r["problems"])
        assert any("combined vs backend torch: differs" in p for p in r["problems"])
    for r in good:
        assert r["check"] == ("FAIL" if r in wrong else "ok"), r
        assert r["runs"] == 10 and len(r["rank_median_us"]) == 2
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"]
        assert r["speedup_vs_torch"] > 0
        assert r["floor_us"] is None and r["floor_fraction"] is None  # no NVLink on CPU
        if r["op"] == "layout":
            assert r["gbps"] is None
        else:
            row_bytes = 128 + 4 if r["dtype"] == "fp8" else 256  # hidden 128: fp8 data + one scale; bf16
            assert 0 < r["recv_bytes"] / row_bytes <= 2 * r["tokens"]  # at most every token of both ranks
            assert r["gbps"] == pytest.approx(r["recv_bytes"] / (r["median_us"] * 1e-6) / 1e9)
    torch_rows = [r for r in good if r["backend"] == "torch"]
    assert all(r["speedup_vs_torch"] == pytest.approx(1.0) for r in torch_rows)

    png = out_png.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    lines = printed.rstrip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["backend", "dtype"])
    for col in TABLE_COLUMNS:
        assert col in lines[header]
    assert "wall-clock" in printed and "floor, of floor: n/a" in printed
    assert "problems:" in printed and "combined vs backend torch" in printed and "cannot run here" in printed
    assert len(lines) - header - 1 >= len(rows)  # every row printed, problems listed after


@pytest.mark.timeout(300)
def test_cpu_bench_times_the_tuners_plan(tmp_path, capsys, monkeypatch):
    """--plan-sms adds the tuner's SM count for each shape to the sweep (here forced by EP_MOE_NUM_SMS, which
    the spawned ranks inherit) and marks those rows; a count already in the sweep is timed once."""
    monkeypatch.setitem(bench.BACKENDS, "torch-sms", bench.BackendSpec("torch-sms", "torch", True))
    monkeypatch.setenv("EP_MOE_NUM_SMS", "14")
    out_json = tmp_path / "bench.json"
    rc = bench.main(["--device", "cpu", "--ranks", "2", "--backends", "torch", "torch-sms", "--tokens", "16",
                     "--hidden", "128", "--experts", "8", "--topk", "2", "--dtype", "bf16", "--num-sms", "8", "14",
                     "--plan-sms", "--runs", "3", "--warmup", "0", "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert data["meta"]["plan_sms"] is True
    timed = {(r["num_sms"], r["planned"]) for r in data["rows"] if r["backend"] == "torch-sms" and r["op"] != "layout"}
    assert timed == {(8, False), (14, True)}
    assert "SMs marked *" in printed
    assert any(line.split()[:4] == ["torch-sms", "bf16", "16", "14*"] for line in printed.splitlines())


def test_accounting_hand_example():
    # Rows sent [source][destination]: rank 0 keeps 3, sends 5 to rank 1; rank 1 sends 2 to 0, keeps 4.
    t = traffic([[3, 5], [2, 4]], row_bytes=10)
    assert t.recv_bytes == (50, 90)  # (3 + 2) and (5 + 4) rows, own rows included (DeepEP's count)
    assert t.sent_to_peers == (50, 20)
    assert t.received_from_peers == (20, 50)
    assert t.mean_recv_bytes == 70
    assert t.link_bytes == 50  # rank 0 out / rank 1 in
    assert floor_us(t.link_bytes, link_gbps=1.0) == pytest.approx(0.05)  # 50 B at 1e9 B/s
    assert gbps(70, 0.07) == pytest.approx(1.0)
    assert floor_fraction(0.05, 0.1) == pytest.approx(0.5)
    assert floor_fraction(0.0, 0.1) is None and floor_fraction(None, 1.0) is None

    # DeepEP's workload on 2 H200s (docs/native.md): ~4080 of 4096 tokens reach each rank.
    bf16_row = row_payload_bytes(7168, "bf16")
    assert bf16_row == 14336 and row_payload_bytes(7168, "fp8") == 7392 == bf16_row * (1 + 4 / 128) / 2
    deepep = traffic([[4080, 4080], [4080, 4080]], bf16_row)
    assert deepep.link_bytes == pytest.approx(58.5e6, rel=1e-3)
    assert floor_us(deepep.link_bytes, 394) == pytest.approx(148.5, abs=0.1)
    assert gbps(deepep.mean_recv_bytes, 264) == pytest.approx(443, abs=1)  # DeepEP V1 at 32 SMs: 442 GB/s

    three = traffic([[1, 2, 3], [4, 5, 6], [7, 8, 9]], 1)
    assert three.sent_to_peers == (5, 10, 15) and three.received_from_peers == (11, 10, 9)
    assert three.link_bytes == 15
    with pytest.raises(ValueError, match="count_matrix"):
        traffic([[1, 2]], 1)
    with pytest.raises(ValueError, match="dtype"):
        row_payload_bytes(128, "fp16")
    with pytest.raises(ValueError, match="link_gbps"):
        floor_us(1, 0)


def test_report_derived_columns_and_table():
    rows = [Row("torch", "dispatch", "bf16", 4096, None, median_us=600.0, p10_us=590.0, p90_us=610.0,
                recv_bytes=117e6, link_bytes=58.5e6),
            Row("native", "dispatch", "bf16", 4096, 24, median_us=200.0, p10_us=190.0, p90_us=210.0,
                recv_bytes=117e6, link_bytes=58.5e6),
            Row("native", "combine", "bf16", 4096, 24, check="error", problems=["rank 1: RuntimeError: boom"])]
    finalize(rows, link_gbps=390.0)
    assert rows[1].speedup_vs_torch == pytest.approx(3.0)
    assert rows[1].floor_us == pytest.approx(150.0)
    assert rows[1].floor_fraction == pytest.approx(0.75)
    assert rows[1].gbps == pytest.approx(585.0)
    assert rows[2].speedup_vs_torch is None and rows[2].gbps is None
    text = table(rows, ["header line"])
    lines = text.splitlines()
    assert lines[0] == "header line" and lines[1].split()[:2] == ["backend", "dtype"]
    assert "3.00x" in lines[3] and "0.75" in lines[3] and "150.0" in lines[3]
    assert "error" in lines[4] and "boom" in text


def test_timing_loop_with_a_fake_clock():
    clock = iter(range(1000))

    class Ticks:  # every mark is one tick later: each run lasts 1 "second"
        description = "fake"

        def mark(self):
            return next(clock)

        def sync(self):
            pass

        def elapsed_us(self, a, b):
            return (b - a) * 1e6

    seen, gates = [], []
    samples = time_runs(seen.append, runs=5, warmup=2, num_sets=3, timer=Ticks(), gate=lambda: gates.append(1))
    assert seen == [0, 1, 2, 0, 1, 2, 0]  # warm-up included, sets rotate
    assert len(gates) == 7 and samples == [1e6] * 5

    # The check sees every call's result after the call's end mark, warm-up calls included; times are unchanged.
    events = []

    class Marks(Ticks):
        def mark(self):
            events.append("mark")
            return super().mark()

    def call(set_index):
        events.append(f"call {set_index}")
        return set_index * 10

    samples = time_runs(call, runs=2, warmup=1, num_sets=2, timer=Marks(), gate=lambda: events.append("gate"),
                        check=lambda i, s, result: events.append(f"check {i} {s} {result}"))
    assert samples == [1e6] * 2
    assert events == [e for i in range(3) for e in ("gate", "mark", f"call {i % 2}", "mark", f"check {i} {i % 2} "
                                                                                               f"{i % 2 * 10}")]
    with pytest.raises(ValueError):
        time_runs(seen.append, runs=0, warmup=0, num_sets=1, timer=Ticks(), gate=lambda: None)

    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 90) == 5
    assert percentile(list(range(11)), 10) == pytest.approx(1.0)
    s = summarize([3.0, 1.0, 2.0])
    assert (s.median_us, s.runs) == (2.0, 3)
    assert slowest_rank_per_run([[1, 5, 2], [3, 1, 2]]) == [3, 5, 2]
    with pytest.raises(ValueError):
        slowest_rank_per_run([[1], [1, 2]])

    assert num_input_sets(5 << 20, 60 << 20) == 24  # small sets: enough to be twice the L2
    assert num_input_sets(200 << 20, 60 << 20) == 2  # large sets: two
    assert num_input_sets(1, 60 << 20, max_sets=32) == 32
    assert num_input_sets(1000, 0) == 2  # CPU: no cache to defeat


def test_result_checks():
    x = torch.randn(6, 256).to(torch.bfloat16)
    in_rank = torch.tensor([[1, 1, 0], [0, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1], [0, 0, 1]], dtype=torch.bool)
    copies = in_rank.sum(1, keepdim=True).float()
    assert torch.equal(round_trip_reference(x, in_rank), (x.float() * copies).to(torch.bfloat16))

    data, scales = to_fp8_blocks(x)
    assert data.dtype == torch.float8_e4m3fn and scales.shape == (6, 2)
    dequant = (data.float().view(6, 2, 128) * scales[..., None]).view(6, 256)
    assert torch.allclose(dequant, x.float(), rtol=0.07, atol=1e-3)
    # Row-wise: quantizing a subset of rows gives the same bits as taking the subset of quantized rows.
    part = to_fp8_blocks(x[[4, 1]])
    assert same_bits(part[0], data[[4, 1]]) and same_bits(part[1], scales[[4, 1]])

    nan = torch.tensor([math.nan, 1.0])
    assert same_bits(nan, nan.clone()) and not same_bits(nan, torch.tensor([math.nan, 2.0]))
    assert not same_bits(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert compare("pair", (data, scales), (data.clone(), scales.clone())) == []
    off = scales.clone()
    off[4, 1] = 2.5
    assert compare("pair", (data, scales), (data, off)) == [
        f"pair[1]: differs (1 of 12 elements of (6, 2) torch.float32, first at (4, 1): {scales[4, 1].item()!r} "
        "vs expected 2.5)"]
    assert compare("rows", torch.zeros(2, 3), torch.zeros(3, 3)) == [
        "rows: differs ((2, 3) torch.float32 vs expected (3, 3) torch.float32)"]
    assert compare("counts", [1, 2], [1, 3]) == ["counts: [1, 2] != expected [1, 3]"]


@pytest.mark.parametrize("args, message", [
    (["--experts", "7"], "--experts"),
    (["--tokens", "0"], "--tokens"),
    (["--num-sms", "7"], "--num-sms"),
    (["--num-sms", "0"], "--num-sms"),
    (["--hidden", "100"], "--hidden"),  # fp8 needs a multiple of 128
    (["--topk", "17"], "--topk"),
    (["--runs", "0"], "--runs"),
    (["--warmup", "-1"], "--warmup"),
    (["--link-gbps", "0"], "--link-gbps"),
    (["--ranks", "0"], "--ranks"),
    (["--backends", "native"], "native"),
    (["--dtype", "fp16"], "--dtype"),
    (["--tokens", "many"], "--tokens"),
])
def test_argument_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cpu", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--backends", "--tokens", "--num-sms", "--hidden", "--experts", "--topk", "--dtype", "--runs",
                   "--link-gbps", "--measure-link", "--json", "--plot", "torchrun"):
        assert option in text
