"""``ep-moe bench``: the CPU benchmark end to end, backends that cheat (lazy, stale, wrong on one input set) and
honest ones plugged in through `BackendSpec.factory`, the checks of every call, the byte/floor accounting, the
timing helpers and the argument checks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ep_moe.backends.comm_backend import DispatchResult
from ep_moe.benchmarking import results as report
from ep_moe.benchmarking.accounting import floor_fraction, floor_us, gbps, row_payload_bytes, traffic
from ep_moe.benchmarking.checks import check_fixed, compare, round_trip_reference, same_bits
from ep_moe.benchmarking.results import Row, finalize, table
from ep_moe.benchmarking.timing import percentile, slowest_rank_per_run, summarize, time_runs
from ep_moe.benchmarking.verification import CallCheck, CheckedCalls, named_outputs
from ep_moe.benchmarking.workload import num_input_sets, to_fp8_blocks
from ep_moe.buffer.buffer_v1 import Buffer
from ep_moe.cli import bench

TABLE_COLUMNS = ["backend", "dtype", "tokens", "SMs", "op", "median us", "p10-p90 us", "GB/s", "floor us",
                 "of floor", "vs torch", "check", "kernels"]


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


def _png_width(png: bytes) -> int:
    return int.from_bytes(png[16:20], "big")  # the IHDR chunk's width


def _panels_width(panels: int) -> int:
    return round(report.PANEL_WIDTH_IN * panels * report.PLOT_DPI)


def test_plot_has_the_sm_panel_on_gpu_only(tmp_path):
    """The time-vs-SMs panel is drawn only where SMs mean something (GPU runs)."""
    rows = [report.Row(backend, op, "bf16", tokens, sms, median_us=10.0 + tokens / 10 + (sms or 0))
            for backend, sms_list in (("torch", [None]), ("native", [16, 24]))
            for tokens in (64, 128) for sms in sms_list for op in ("dispatch", "combine")]
    for sm_panel, panels in ((True, 2), (False, 1)):
        path = tmp_path / f"plot_{panels}.png"
        assert report.plot(path, rows, "title", num_sms=[16, 24], sm_panel=sm_panel) is None
        assert _png_width(path.read_bytes()) == _panels_width(panels)


def test_cpu_defaults_sweep_token_counts():
    args = bench.build_parser().parse_args(["--device", "cpu"])
    spec, world = bench._resolve(args, bench.build_parser(), ["--device", "cpu"])
    assert world == 2 and spec.tokens == (64, 128, 256)


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
        assert any("combined_x vs backend torch: differs" in p for p in r["problems"])
    for r in good:
        assert r["check"] == ("FAIL" if r in wrong else "ok"), r
        assert r["runs"] == 10 and len(r["rank_median_us"]) == 2
        assert r["kernels"] == "torch", r  # the torch transport; no expert-major op in this run
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
    assert _png_width(png) == _panels_width(1)  # on CPU: time vs tokens only, no time-vs-SMs panel

    lines = printed.rstrip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["backend", "dtype"])
    for col in TABLE_COLUMNS:
        assert col in lines[header]
    assert "wall-clock" in printed and "floor, of floor: n/a" in printed
    assert "problems:" in printed and "combined_x vs backend torch" in printed and "cannot run here" in printed
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


# ------------------------------------------------------------------ backends plugged in by BackendSpec.factory
# The runs below: one token count, WARMUP warm-up calls and RUNS timed runs per operation, and the SETS input sets
# a CPU run rotates (no cache to defeat: the minimum). Timed runs are numbered from 1 after the warm-up calls.
WARMUP, RUNS, SETS = 1, 4, 2
STALE_RUN = 3
LOOP_CALLS = [("warm-up call 1", 0), ("run 1", 1), ("run 2", 0), ("run 3", 1), ("run 4", 0)]  # (label, set)


class _Forwarding:
    """A transport that forwards everything to the torch backend it wraps: bit-equal to it."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Lazy(_Forwarding):
    """After the first cached dispatch and the first combine through each handle, both return zeros without
    communicating (on every rank alike, so no collective is left waiting)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.seen: dict[tuple[str, int], object] = {}  # keeps the handles alive: their ids are not reused

    def _first(self, op, handle) -> bool:
        key = (op, id(handle))
        if key in self.seen:
            return False
        self.seen[key] = handle
        return True

    def dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, handle, *rest):
        if handle is None or self._first("dispatch", handle):
            return self.inner.dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                                       handle, *rest)
        rows = handle.num_recv_rows
        scales = None if x_scales is None else x_scales.new_zeros(rows, x_scales.shape[1])
        return DispatchResult(x.new_zeros(rows, x.shape[1]), scales, None, None, None, handle)

    def combine(self, y, handle, topk_weights, bias, config):
        if self._first("combine", handle):
            return self.inner.combine(y, handle, topk_weights, bias, config)
        weights = None if topk_weights is None else topk_weights.new_zeros(handle.num_tokens, topk_weights.shape[1])
        return y.new_zeros(handle.num_tokens, y.shape[1]), weights


class _Stale(_Forwarding):
    """Cached dispatch returns the previous call's outputs on timed run STALE_RUN of the first loop that times it,
    and only then: its calls before are the checked ones (one per input set) and the warm-up calls."""

    def __init__(self, inner):
        super().__init__(inner)
        self.cached_calls, self.previous = 0, None

    def dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, handle, *rest):
        result = self.inner.dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                                     handle, *rest)
        if handle is None:
            return result
        self.cached_calls += 1
        previous, self.previous = self.previous, result
        return previous if self.cached_calls == SETS + WARMUP + STALE_RUN else result


class _Skewed(_Forwarding):
    """On every input set but the first it sees (set 0; known by its layout), every dispatch flips the lowest bit
    of the first received top-k weight (fresh and fixed-size dispatch) and of the first FP8 scale: the same on
    every call, so only a comparison with torch (or with the quantized BF16 rows) on those sets can see it."""

    def __init__(self, inner):
        super().__init__(inner)
        self.set0 = None

    def dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, handle, *rest):
        result = self.inner.dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                                     handle, *rest)
        if self.set0 is None:
            self.set0 = is_token_in_rank.clone()
        if torch.equal(is_token_in_rank, self.set0):
            return result
        flipped = {name: getattr(result, name).clone() for name in ("recv_topk_weights", "recv_scales")
                   if getattr(result, name) is not None}
        for t in flipped.values():
            t.view(torch.int32)[0, 0] ^= 1
        return result._replace(**flipped)


def _buffer_with(transport, group, **kwargs) -> Buffer:
    buffer = Buffer(group, **kwargs)
    buffer.backend = transport(buffer.backend)
    return buffer


def honest_buffer(group, **kwargs) -> Buffer:
    return _buffer_with(_Forwarding, group, **kwargs)


def lazy_buffer(group, **kwargs) -> Buffer:
    return _buffer_with(_Lazy, group, **kwargs)


def stale_buffer(group, **kwargs) -> Buffer:
    return _buffer_with(_Stale, group, **kwargs)


def skewed_buffer(group, **kwargs) -> Buffer:
    return _buffer_with(_Skewed, group, **kwargs)


def not_a_buffer(group, **kwargs) -> object:
    return object()


def _bench_with(factories: dict[str, str], tmp_path, monkeypatch, extra: tuple[str, ...] = (),
                rows_per_backend: int = 8) -> tuple[int, dict, str]:
    """``ep-moe bench`` on 2 gloo ranks with torch and a backend per ``factories`` entry (name -> factory in this
    module), plus ``extra`` arguments: the exit status, the rows by (backend, op, dtype), and what it printed
    (8 rows per backend: layout and 4 bf16 and 3 fp8 operations by default)."""
    for name, factory in factories.items():
        monkeypatch.setitem(bench.BACKENDS, name, bench.BackendSpec(name, "torch", False, f"{__name__}:{factory}"))
    out_json = tmp_path / "bench.json"
    rc = bench.main(["--device", "cpu", "--ranks", "2", "--backends", "torch", *factories, "--tokens", "24",
                     "--hidden", "128", "--experts", "8", "--topk", "3", "--runs", str(RUNS),
                     "--warmup", str(WARMUP), "--json", str(out_json), *extra])
    data = json.loads(out_json.read_text())
    assert data["meta"]["input_sets"] == {"24": SETS}
    rows = {(r["backend"], r["op"], r["dtype"]): r for r in data["rows"]}
    assert len(rows) == len(data["rows"]) == (1 + len(factories)) * rows_per_backend
    return rc, rows, json.dumps(data["rows"])


def _failed(rows: dict) -> dict:
    failed = {key: r["problems"] for key, r in rows.items() if r["check"] != "ok"}
    assert all(rows[key]["check"] == "FAIL" and rows[key]["runs"] == RUNS for key in failed)
    return failed


@pytest.mark.timeout(300)
def test_honest_backends_pass(tmp_path, monkeypatch):
    """torch and a transport that forwards to it (built by a factory) agree on every call: exit status 0."""
    rc, rows, _ = _bench_with({"honest": "honest_buffer"}, tmp_path, monkeypatch)
    assert rc == 0 and _failed(rows) == {}
    assert all(r["problems"] == [] and r["runs"] == RUNS for r in rows.values())


@pytest.mark.timeout(300)
def test_expert_major_operations_are_timed_and_checked(tmp_path, monkeypatch):
    """``--expert-major`` (bf16 only: layout, 4 rank-major and 3 expert-major operations): a forwarding backend
    passes every check; one whose dispatch differs from torch in one bit of a received weight on input sets
    after the first makes the expert-major dispatches (their slots' weights) FAIL too. (The weighted combine of
    that weight, one fp32 ulp off, rounds to the same bf16 rows: it is checked, not expected to differ.)"""
    rc, rows, _ = _bench_with({"honest": "honest_buffer", "skewed": "skewed_buffer"}, tmp_path, monkeypatch,
                              ("--expert-major", "--dtype", "bf16"))
    assert rc == 1
    failed = _failed(rows)
    assert not [key for key in failed if key[0] != "skewed"]
    for op in ("expert_dispatch", "expert_dispatch_fixed", "expert_combine"):
        assert rows[("honest", op, "bf16")]["check"] == "ok" and rows[("torch", op, "bf16")]["check"] == "ok"
        assert rows[("torch", op, "bf16")]["kernels"] == "torch, permute torch"  # CPU ranks: torch code
    for op in ("expert_dispatch", "expert_dispatch_fixed"):
        assert any("expert_weights vs backend torch: differs" in p for p in failed[("skewed", op, "bf16")]), failed


@pytest.mark.timeout(300)
def test_expert_major_fp8_dispatches_are_timed_and_checked(tmp_path, monkeypatch):
    """``--expert-major --dtype bf16 fp8``: the FP8 pair's expert-major dispatches (rows and scales) are timed
    and checked too (13 rows per backend: layout, bf16 4 + 3, fp8 3 + 2; FP8 has no combine)."""
    rc, rows, _ = _bench_with({"honest": "honest_buffer"}, tmp_path, monkeypatch,
                              ("--expert-major", "--dtype", "bf16", "fp8"), rows_per_backend=13)
    assert rc == 0 and _failed(rows) == {}
    for backend in ("torch", "honest"):
        assert rows[(backend, "expert_dispatch", "fp8")]["check"] == "ok"
        assert rows[(backend, "expert_dispatch_fixed", "fp8")]["check"] == "ok"
        assert (backend, "expert_combine", "fp8") not in rows


@pytest.mark.timeout(300)
def test_a_lazy_backend_fails_every_call_it_skips(tmp_path, monkeypatch):
    """Zeros from every cached dispatch and combine after the first through each handle (the checked call): the
    timed calls are checked, so those rows FAIL and name each call; the exit status is 1."""
    rc, rows, _ = _bench_with({"lazy": "lazy_buffer"}, tmp_path, monkeypatch)
    assert rc == 1
    lines = {name: [f"rank {r}: {label} (set {s}): {name} differs from the checked call"
                    for r in (0, 1) for label, s in LOOP_CALLS] for name in ("recv_x", "recv_scales", "combined_x")}
    capped = {name: lines[name][:6] + ["... and 4 more"] for name in lines}  # 5 calls on each of 2 ranks
    fp8_cached = [line for r in (0, 1) for label, s in LOOP_CALLS
                  for line in (f"rank {r}: {label} (set {s}): recv_x differs from the checked call",
                               f"rank {r}: {label} (set {s}): recv_scales differs from the checked call")]
    assert _failed(rows) == {("lazy", "dispatch_cached", "bf16"): capped["recv_x"],
                             ("lazy", "combine", "bf16"): capped["combined_x"],
                             ("lazy", "dispatch_cached", "fp8"): fp8_cached[:6] + ["... and 14 more"]}


@pytest.mark.timeout(300)
def test_a_stale_read_and_a_difference_on_one_input_set_are_caught(tmp_path, monkeypatch):
    """A cached dispatch that returns the previous call's rows on timed run 3 only: that call is named. A backend
    that differs from torch in one bit on input set 1 (and every later one) but agrees on set 0: caught by the
    comparison of every set with torch, and for FP8 rows also by the comparison with the quantized BF16 rows."""
    rc, rows, _ = _bench_with({"stale": "stale_buffer", "skewed": "skewed_buffer"}, tmp_path, monkeypatch)
    assert rc == 1

    def vs_torch(*names, quantized=()):
        return [f"rank {r}: set 1: {line}" for r in (0, 1) for line in
                [f"{n} vs backend torch: differs (fingerprint)" for n in names]
                + [f"{n} vs backend torch's bf16 recv_x quantized: differs (fingerprint)" for n in quantized]]

    assert _failed(rows) == {
        ("stale", "dispatch_cached", "bf16"): [f"rank {r}: run {STALE_RUN} (set 1): recv_x differs from the checked "
                                               "call" for r in (0, 1)],
        ("skewed", "dispatch", "bf16"): vs_torch("recv_topk_weights"),
        ("skewed", "dispatch_fixed", "bf16"): vs_torch("recv_topk_weights"),
        ("skewed", "dispatch", "fp8"): vs_torch("recv_scales", "recv_topk_weights", quantized=["recv_scales"]),
        ("skewed", "dispatch_cached", "fp8"): vs_torch("recv_scales"),
        ("skewed", "dispatch_fixed", "fp8"): vs_torch("recv_scales", "recv_topk_weights"),
    }


def test_backend_spec_factory():
    assert bench.BACKENDS["torch"].factory == "ep_moe.buffer.buffer_v1:Buffer"
    for bad in ("Buffer", "ep_moe.buffer.buffer_v1:", ":Buffer", None):
        with pytest.raises(ValueError, match="argument 'factory' must be a string 'module:function'"):
            bench.BackendSpec("x", "torch", False, bad)
    with pytest.raises(ValueError, match="argument 'factory' must name an importable callable.*ModuleNotFound"):
        bench.BackendSpec("x", "torch", False, "ep_moe.no_such_module:make").build(None)
    with pytest.raises(ValueError, match="argument 'factory' must name an importable callable.*AttributeError"):
        bench.BackendSpec("x", "torch", False, "ep_moe.buffer.buffer_v1:NoSuchBuffer").build(None)
    with pytest.raises(ValueError, match="argument 'factory' must return an ep_moe.Buffer.*returned object"):
        bench.BackendSpec("x", "torch", False, f"{__name__}:not_a_buffer").build(None)


def test_call_check_names_every_differing_call():
    """`CallCheck` numbers the loop's calls as `time_runs` does (warm-up calls, then runs from 1) and names each
    output that differs from the checked call of its input set."""
    good = [torch.arange(6.0).view(3, 2), torch.ones(3, 2)]  # the checked combine of sets 0 and 1
    checked = CheckedCalls("b", torch.device("cpu"), keep_set0=False)
    for i, y in enumerate(good):
        checked.record("combine", i, {"combined_x": y})
    check = CallCheck("combine", checked.expected("combine"), warmup=2, device=torch.device("cpu"))
    stale = good[0]
    calls = [good[0], good[1], good[0], stale, good[0].clone(), torch.zeros(3, 2)]  # sets 0, 1, 0, 1, 0, 1
    for call, y in enumerate(calls):
        check(call, call % 2, (y, None, None))
    assert check.problems() == ["run 2 (set 1): combined_x differs from the checked call",
                                "run 4 (set 1): combined_x differs from the checked call"]
    with pytest.raises(ValueError, match="argument 'op'"):
        CallCheck("dispatch_slow", [], 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="argument 'op'"):
        named_outputs("dispatch_slow", None)
    with pytest.raises(ValueError, match="argument 'set_index' must be 2"):
        checked.record("combine", 3, {"combined_x": good[0]})


def test_checked_calls_compare_every_set_with_the_first_backend():
    """Set 0 bit for bit in full (the first differing element shown), other sets by fingerprint; every output
    named, host values (the count list) compared by value."""
    def outputs(i, weight=0.5, counts=(3, 1)):
        return {"recv_x": torch.full((2, 4), float(i)), "recv_topk_weights": torch.tensor([[weight, 0.0]] * 2),
                "num_recv_tokens_per_expert_list": list(counts)}

    torch_calls = CheckedCalls("torch", torch.device("cpu"), keep_set0=True)
    other = CheckedCalls("other", torch.device("cpu"), keep_set0=False)
    for i in range(3):
        torch_calls.record("dispatch", i, outputs(i))
    assert torch_calls.differences("dispatch", 0, outputs(0), other.record("dispatch", 0, outputs(0))) == []
    assert torch_calls.differences("dispatch", 1, outputs(1), other.record("dispatch", 1, outputs(1))) == []
    wrong = outputs(2, weight=0.25, counts=(3, 2))
    assert torch_calls.differences("dispatch", 2, wrong, other.record("dispatch", 2, wrong)) == [
        "recv_topk_weights vs backend torch: differs (fingerprint)",
        "num_recv_tokens_per_expert_list vs backend torch: differs ([3, 2] vs expected [3, 1])"]
    wrong0 = outputs(0, weight=0.25)
    assert torch_calls.differences("dispatch", 0, wrong0, {}) == [
        "recv_topk_weights vs backend torch: differs (2 of 4 elements of (2, 2) torch.float32, first at (0, 0): "
        "0.25 vs expected 0.5)"]


def test_check_fixed_reads_every_row_and_the_padding():
    rows = 3
    exact = {"recv_x": torch.arange(12.0).view(3, 4), "recv_topk_idx": torch.tensor([[0, -1], [1, 0], [-1, 1]]),
             "recv_topk_weights": torch.rand(3, 2), "recv_src_idx": torch.tensor([0, 2, 1], dtype=torch.int32),
             "recv_src_rank": torch.tensor([0, 0, 1], dtype=torch.int32),
             "rank_prefix_matrix": torch.tensor([[2, 1], [3, 2]], dtype=torch.int32)}
    padding = {"recv_x": 0.0, "recv_topk_idx": -1, "recv_topk_weights": 0.0, "recv_src_idx": -1, "recv_src_rank": -1}

    def fixed_of(exact):
        fixed = {n: torch.cat([t, torch.full((2, *t.shape[1:]), padding[n], dtype=t.dtype)])
                 for n, t in exact.items() if n in padding}
        return fixed | {"rank_prefix_matrix": exact["rank_prefix_matrix"].clone()}

    assert check_fixed(fixed_of(exact), exact, rows) == []
    bad = fixed_of(exact)
    bad["recv_src_idx"][4] = 0  # a padding row that claims a source token
    bad["recv_topk_weights"][1, 1] += 1  # a received row that differs
    bad["recv_x"][3, 0] = -0.0  # not zero bytes
    bad["rank_prefix_matrix"][1, 1] = 4
    assert check_fixed(bad, exact, rows) == [
        "fixed-size recv_x: padding rows are not 0",
        f"fixed-size recv_topk_weights[:3] vs dispatch: differs (1 of 6 elements of (3, 2) torch.float32, first at "
        f"(1, 1): {bad['recv_topk_weights'][1, 1].item()!r} vs expected {exact['recv_topk_weights'][1, 1].item()!r})",
        "fixed-size recv_src_idx: padding rows are not -1",
        "fixed-size rank_prefix_matrix vs dispatch: differs (1 of 4 elements of (2, 2) torch.int32, first at (1, 1): "
        "4 vs expected 2)"]


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
