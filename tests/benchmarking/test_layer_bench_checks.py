"""The layer benchmarks check the outputs of the calls they time, and the check bites.

* ``benchmarks/megatron_layer_bench.py`` on the CPU (one gloo rank; Megatron's allgather dispatcher stands in for
  alltoall, whose dispatcher makes CUDA streams): `time_and_check` times the reference dispatcher, ep_moe's
  dispatcher (torch backend) and the ``no dispatcher`` floor; an honest run prints ``ok`` on every row and exits
  0; a dispatcher that flips the sign of one output row on every call after its first (so its untimed first call
  is right, its timed calls wrong) makes that row ``DIFF`` and the run exit 1, naming the variant and the first
  differing element.
* ``benchmarks/deepspeed_layer_bench.py`` end to end on 2 gloo ranks, with ep_moe's dropless layer wrong in the
  same way: that row says ``DIFF`` and the run exits 1 naming it; the honest run is
  tests/integrations/test_deepspeed_layer_bench.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import locations
import pytest
from megatron_cpu_layer import SCRIPT_HEAD

BENCHMARKS = locations.REPO / "benchmarks"

MEGATRON_SCRIPT = SCRIPT_HEAD + r'''
torch.manual_seed(5)
layer = bench._build(spec, config=config)
integ.use_portable_routers(layer)
inputs = [torch.randn(24, 1, 32).requires_grad_(True) for _ in range(3)]
grads = [torch.randn(24, 1, 32) for _ in range(3)]
reference_dispatcher = layer.token_dispatcher
integ.install_ep_moe_dispatcher(layer, backend="torch")
ours = layer.token_dispatcher
layer.token_dispatcher = reference_dispatcher
reference = bench.Expected(bench._untimed(bench.LayerStep(layer), inputs, grads), bench.RTOL[torch.float32],
                           "allgather's untimed call")


def run(mode):
    if mode == "corrupt":  # right on the first call, one row wrong on every later one
        combine_postprocess, calls = ours.combine_postprocess, []

        def corrupted(hidden_states):
            out = combine_postprocess(hidden_states)
            calls.append(1)
            if len(calls) > 1:
                out = out.clone()
                out[3] = -out[3]
            return out
        ours.combine_postprocess = corrupted
    floor = bench.NoDispatcher(layer, inputs)
    runs = [("allgather", bench.LayerStep(layer), reference_dispatcher, reference),
            ("ep_moe[torch]", bench.LayerStep(layer), ours, reference),
            (bench.NO_DISPATCHER, floor, None, bench.Expected(bench._untimed(floor, inputs, grads), None,
                                                               "its untimed call"))]
    measured = bench.time_and_check(runs, layer, inputs, grads, warmup=1, iters=4, rounds=2)
    rows = [bench._row(name, float(torch.tensor(m["times"]).median()),
                       None if name == bench.NO_DISPATCHER else m["max_rel_diff"], m["problems"], m["permute"],
                       "torch" if name.startswith("ep_moe") else None)
            for name, m in measured.items()]
    result = {"rows": rows, "megatron_core": integ.MEGATRON_CORE_VERSION, "world": 1, "gpu": "cpu", "kernels": "",
              "args": {"tokens": 24, "hidden": 32, "experts": 8, "ffn": 16, "topk": 2, "dtype": "fp32", "iters": 4,
                       "rounds": 2}}
    print(f"== {mode}", flush=True)
    print(f"== {mode} exit status", bench.finish(result, None), flush=True)
    print(f"== {mode} stderr end", file=sys.stderr, flush=True)


run("honest")
run("corrupt")
'''


def _env() -> dict[str, str]:
    """The checkout's ep_moe and benchmarks/ (the scripts' own modules) on the path; no GPU."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        filter(None, [str(BENCHMARKS), str(locations.REPO), os.environ.get("PYTHONPATH")])))


def _table_rows(stdout: str) -> dict[str, list[str]]:
    """The markdown table's rows (header and separator left out) by their first cell."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in stdout.splitlines() if line.startswith("| ")]
    return {r[0]: r for r in rows[2:]}


def _part(text: str, start: str, end: str | None) -> str:
    return text[text.index(start):text.index(end) if end else None]


def test_megatron_layer_bench_checks_the_timed_calls() -> None:
    """One process, two runs: honest, then with ep_moe's dispatcher corrupting its timed calls."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    run = subprocess.run([sys.executable, "-c", MEGATRON_SCRIPT], cwd=locations.REPO, env=_env(),
                         capture_output=True, text=True, timeout=240)
    output = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0 and "== corrupt stderr end" in run.stderr, output
    honest, corrupt = _part(run.stdout, "== honest", "== corrupt"), _part(run.stdout, "== corrupt", None)
    for rows in (_table_rows(honest), _table_rows(corrupt)):
        assert sorted(rows) == sorted(["allgather", "ep_moe[torch]", "no dispatcher (router + experts)"]), output
        assert rows["ep_moe[torch]"][-2] == "torch", output  # ep_moe's permute ran as torch code on the CPU
        assert rows["allgather"][-2] == "-" and rows["no dispatcher (router + experts)"][-2] == "-", output

    assert "== honest exit status 0" in honest, output
    assert all(r[-1] == "ok" for r in _table_rows(honest).values()), output
    assert "CHECK FAILED" not in _part(run.stderr, "", "== honest stderr end"), output

    assert "== corrupt exit status 1" in corrupt, output
    rows = _table_rows(corrupt)
    assert rows["ep_moe[torch]"][-1] == "DIFF", output
    assert rows["allgather"][-1] == "ok" and rows["no dispatcher (router + experts)"][-1] == "ok", output
    failures = [line for line in _part(run.stderr, "== honest stderr end", None).splitlines() if "CHECK FAILED" in line]
    # both turns' last timed calls, output and input gradient; token 3's row, from its first element
    assert len(failures) == 4, output
    first = failures[0]
    assert first.startswith("megatron_layer_bench: CHECK FAILED: ep_moe[torch], turn 1's last timed call"), first
    assert "vs allgather's untimed call: output: 32 of 768 elements differ" in first, first
    assert "first at (3, 0, 0): got " in first and ", expected " in first, first
    print(first)


def _deepspeed_with_a_wrong_dropless_layer(rank: int, world: int, raw_args: dict):
    """`deepspeed_layer_bench.bench` where ep_moe's dropless layer flips the sign of one output row on every call
    after its first (spawned ranks import this module)."""
    import deepspeed_layer_bench as bench

    from ep_moe.integrations import deepspeed as integ

    cls = integ.MoE  # ep_moe's layer (DeepSpeed's own layers are not instances)
    forward, calls = cls.forward, {}

    def corrupted(self, *args, **kwargs):
        out, l_aux, counts = forward(self, *args, **kwargs)
        calls[id(self)] = calls.get(id(self), 0) + 1
        if not self.drop_tokens and calls[id(self)] > 1:
            out = out.clone()
            out[5] = -out[5]
        return out, l_aux, counts

    cls.forward = corrupted
    return bench.bench(rank, world, raw_args)


@pytest.mark.timeout(300)
def test_deepspeed_layer_bench_fails_on_a_wrong_timed_call(monkeypatch, capsys) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # spawned ranks get this path too
    for name, value in (("CUDA_VISIBLE_DEVICES", ""), ("DS_ACCELERATOR", "cpu"), ("DS_BUILD_OPS", "0")):
        monkeypatch.setenv(name, value)
    import deepspeed_layer_bench as bench

    monkeypatch.setattr(bench, "_spawned", _deepspeed_with_a_wrong_dropless_layer)
    status = bench.main(["--nproc", "2", "--tokens", "32", "--hidden", "16", "--ffn", "24", "--experts", "4",
                         "--iters", "2", "--warmup", "1"])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in bench.MODES}
    assert sorted(rows) == sorted(bench.MODES), out
    assert "DIFF" in rows["ep_moe-dropless"].split(), rows
    assert all("ok" in rows[m].split() for m in bench.MODES if m != "ep_moe-dropless"), rows
    failures = [line for line in err.splitlines() if "CHECK FAILED" in line]
    assert failures and all("ep_moe-dropless" in line for line in failures), err
    assert "first at (5, 0): got " in failures[0] and ", expected " in failures[0], failures[0]
    print(out + "\n".join(failures))


TUNE_CHECK_WRAPPER = r'''
import runpy, sys
from ep_moe.backends.torch_backend import TorchBackend

original = TorchBackend.combine


def combine(self, y, handle, topk_weights, bias, config=None):
    """One token's row negated in the timed calls (fixed size) at 12 SMs: not in the checked call at the
    planned count (exact size), nor in the reference's calls (no config)."""
    out, weights = original(self, y, handle, topk_weights, bias, config)
    if config is not None and config.num_sms == 12 and handle.num_worst_tokens > 0 and out.shape[0] > 1:
        out = out.clone()
        out[1] = -out[1]
    return out, weights


if sys.argv.pop(1) == "corrupt":
    TorchBackend.combine = combine
sys.argv[0] = sys.argv.pop(1)
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["honest", "corrupt"])
def test_tune_check_checks_every_sm_count_of_the_sweep(mode: str, tmp_path) -> None:
    """benchmarks/tune_check.py's CPU dry run (2 gloo ranks, torch backend) with a sweep of 8 and 12 SMs: every
    workload's row says ``ok``, exit 0; with a combine that is wrong at 12 SMs in the timed calls only, every
    workload's row says ``DIFF (12 SMs)``, the sweep marks 12 SMs, and the run exits 1 naming the workload, the SM
    count and the first differing element."""
    wrapper = tmp_path / "corrupt_tune_check.py"
    wrapper.write_text(TUNE_CHECK_WRAPPER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(wrapper), mode,
           str(BENCHMARKS / "tune_check.py"), "--sweep", "8:12:4", "--passes", "1", "--iters", "2"]
    run = subprocess.run(cmd, cwd=locations.REPO, env=_env(), capture_output=True, text=True, timeout=200)
    output = run.stdout[-4000:] + run.stderr[-4000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in run.stdout.splitlines()
            if line.startswith("| ") and "CPU dry run" in line]
    assert len(rows) == 3, output
    failures = [line for line in run.stderr.splitlines() if "CHECK FAILED" in line]
    if mode == "honest":
        assert run.returncode == 0, output
        assert [r[-1] for r in rows] == ["ok"] * 3 and not failures, output
        return
    assert run.returncode != 0, output
    assert [r[-1] for r in rows] == ["DIFF (12 SMs)"] * 3, output
    assert any(line.split()[:1] == ["12"] and line.count("!") == 3 for line in run.stdout.splitlines()), output
    assert failures and all("12 SMs, last timed call" in line for line in failures), output
    first = next(line for line in failures if "rank 0: E64 K6" in line)
    assert "combined_x vs the reference's combine of the same rows: differs (" in first, first
    assert "first at (1, 0): " in first and " vs expected " in first, first
    print(first)
