"""``benchmarks/host_overhead.py`` end to end on the CPU (one gloo rank in this process, the torch backend, small
sizes), and its checks bite:

* an honest run: every row ``ok`` (the Megatron row too where megatron-core imports), exit status 0, the JSON
  header and one object per row, host microseconds and an index_select floor per row, GPU columns n/a;
* one timed call of ``combine`` corrupted (one row negated, in the middle of a timed round): that row ``DIFF``, the
  others ``ok``, exit status 1, the report naming the operation, the round, the call and the input set;
* only the last timed call of `ep_moe.TokenDispatcher.combine` corrupted: the full comparison names the first
  differing element;
* a layout wrong on every call, the untimed reference call included (so timed calls equal it): the reference's
  check against the one-hot layout fails the row;
* megatron-core not importable: the Megatron row is skipped with the reason, and the run passes;
* bad options are refused, naming the option.

On a GPU (``pytest -m gpu``) the same script runs with the native backend at small sizes.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import locations
import pytest
import torch

import ep_moe

BENCHMARKS = locations.REPO / "benchmarks"
SMALL = ["--tokens", "16", "--hidden", "64", "--experts", "8", "--topk", "2", "--calls", "3", "--rounds", "3",
         "--warmup", "1", "--sets", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # the script's own `_checked`
    try:
        spec = importlib.util.spec_from_file_location("host_overhead", BENCHMARKS / "host_overhead.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("host_overhead", None)
        sys.path.remove(str(BENCHMARKS))


def _run(bench, tmp_path, capsys, *extra: str) -> tuple[int, dict, str, str]:
    path = tmp_path / "rows.json"
    status = bench.main([*SMALL, "--json", str(path), *extra])
    out, err = capsys.readouterr()
    return status, json.loads(path.read_text()), out, err


def _rows(result: dict) -> dict[str, dict]:
    return {r["op"]: r for r in result["rows"]}


def _corrupt_call(monkeypatch, owner, name: str, number, change) -> list[int]:
    """Wrap ``owner.name`` so that its call number ``number(calls so far)`` (counting from 1) returns ``change``d
    output; returns the call counter."""
    original, calls = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        return change(result) if number(len(calls)) else result

    monkeypatch.setattr(owner, name, wrapped)
    return calls


def test_honest_run(bench, tmp_path, capsys):
    status, result, out, err = _run(bench, tmp_path, capsys, "--tokens", "16,24")
    assert status == 0, err
    header = result["header"]
    assert header["device"] == "CPU" and header["buffer_backend"] == "torch" and header["ranks"] == 1
    assert header["torch"] == torch.__version__ and header["ep_moe_commit"]
    assert header["tokens"] == [16, 24] and header["input_sets"] == {"16": 2, "24": 2}
    rows = result["rows"]
    megatron = importlib.util.find_spec("megatron") is not None
    for tokens in (16, 24):
        mine = {r["op"]: r for r in rows if r["tokens"] == tokens}
        expected = set(bench.OPS) - (set() if megatron else {"megatron_dispatcher"})
        assert expected <= set(mine)
        assert {f"index_select[{kind}]" for kind in bench.FLOOR_ROWS} <= set(mine)
        for name in expected:
            row = mine[name]
            assert row["check"] == "ok", row
            assert row["host_us"] > 0 and row["floor_us"] > 0 and row["above_floor"] < 1
            assert row["gpu_us"] is None and row["bound"] is None and row["sync"] is None
            assert row["kernels"].startswith("torch")
        for name in ("expert_dispatch", "expert_combine", "token_dispatcher", "token_dispatcher_fwd_bwd"):
            assert mine[name]["kernels"] == "torch, permute torch"
    assert "dispatch_cached" in out and "n/a" in out and "CHECK FAILED" not in err


def test_one_corrupted_timed_call_fails_its_row(bench, tmp_path, capsys, monkeypatch):
    def negate_row(result):
        combined = result[0].clone()
        combined[3] = -combined[3]
        return (combined, *result[1:])

    # Calls of combine: 2 reference calls (one per input set), a warm-up round of 3, then rounds 1-3 of 3 calls;
    # call 10 is round 2's second call, on input set 1 (calls rotate over the sets: 0, 1, 0, 1, ...).
    calls = _corrupt_call(monkeypatch, ep_moe.Buffer, "combine", lambda n: n == 10, negate_row)
    status, result, _, err = _run(bench, tmp_path, capsys, "--ops", "dispatch,combine,expert_combine")
    assert len(calls) == 14
    assert status == 1
    rows = _rows(result)
    assert rows["combine"]["check"] == "DIFF"
    assert rows["combine"]["problems"] == ["round 2 call 2 (set 1): combined_x differs from the reference call"]
    assert rows["dispatch"]["check"] == rows["expert_combine"]["check"] == "ok"
    assert ("combine at 16 tokens: round 2 call 2 (set 1): combined_x differs from the reference call" in err)


def test_last_timed_call_compared_in_full(bench, tmp_path, capsys, monkeypatch):
    def scale_element(out):
        out = out.clone()
        out[5, 7] *= 2
        return out

    # 2 reference calls, 3 warm-up calls, 9 timed calls: call 14 is the last one timed.
    _corrupt_call(monkeypatch, ep_moe.TokenDispatcher, "combine", lambda n: n == 14, scale_element)
    status, result, _, err = _run(bench, tmp_path, capsys, "--ops", "token_dispatcher")
    assert status == 1
    problems = _rows(result)["token_dispatcher"]["problems"]
    assert problems[0] == "round 3 call 3 (set 1): combined differs from the reference call"
    assert problems[1].startswith("last timed call (set 1): combined: differs (1 of 1024 elements")
    assert "first at (5, 7)" in problems[1]


def test_consistently_wrong_layout_fails_the_reference_check(bench, tmp_path, capsys, monkeypatch):
    def one_more(result):
        per_rank, none, per_expert, in_rank, event = result
        return per_rank, none, per_expert + (torch.arange(per_expert.numel()) == 2), in_rank, event

    _corrupt_call(monkeypatch, ep_moe.Buffer, "get_dispatch_layout", lambda n: True, one_more)
    status, result, _, _ = _run(bench, tmp_path, capsys, "--ops", "layout")
    assert status == 1
    problems = _rows(result)["layout"]["problems"]
    assert len(problems) == 2 and all("num_tokens_per_expert vs the one-hot reference: differs (1 of 8" in p
                                      for p in problems)
    assert problems[0].startswith("reference call (set 0)") and problems[1].startswith("reference call (set 1)")


def test_megatron_row_skipped_with_the_reason(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "MEGATRON_MODULE", "ep_moe.integrations.no_such_module")
    status, result, out, _ = _run(bench, tmp_path, capsys, "--ops", "megatron_dispatcher")
    assert status == 0
    (row,) = result["rows"]
    assert row["check"] == "skip" and row["note"].startswith("megatron-core does not import")
    assert "skip" in out and result["header"]["megatron"].startswith("megatron-core does not import")


@pytest.mark.parametrize("argv, message", [
    (["--ops", "dispatch,nope"], "--ops: unknown ['nope']"),
    (["--topk", "9", "--experts", "8"], "--topk (9) must be at most --experts (8)"),
    (["--tokens", "16,x"], "--tokens: expected comma-separated integers"),
    (["--calls", "0"], "--calls must be >= 1"),
])
def test_bad_options_are_refused(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_one_gpu_native(bench, tmp_path, capsys):
    path = tmp_path / "rows.json"
    status = bench.main(["--tokens", "64", "--hidden", "256", "--experts", "16", "--topk", "4", "--calls", "4",
                         "--rounds", "5", "--warmup", "1", "--ops", ",".join(o for o in bench.OPS
                                                                            if o != "megatron_dispatcher"),
                         "--json", str(path)])
    err = capsys.readouterr().err
    assert status == 0, err
    result = json.loads(path.read_text())
    rows = _rows(result)
    assert result["header"]["device"] != "CPU"
    for row in rows.values():
        assert row["check"] == "ok", row
        assert row["gpu_us"] is not None and row["sync"] is not None and row["gpu_rounds"] > 0, row
    assert rows["dispatch"]["kernels"].startswith(result["header"]["buffer_backend"])
