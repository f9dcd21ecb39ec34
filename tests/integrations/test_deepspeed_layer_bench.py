"""benchmarks/deepspeed_layer_bench.py on 2 CPU ranks over gloo (small sizes), with the MLP experts and with
``--trivial-experts``: every mode is built, checked against DeepSpeed's output, timed and printed; the checks
pass (fp32: relative difference <= 1e-5, ``l_aux`` and ``exp_counts`` equal), and the table header and the
JSON say which experts ran."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import locations
import pytest
from support_deepspeed import require_deepspeed

require_deepspeed()

BENCH = locations.REPO / "benchmarks" / "deepspeed_layer_bench.py"
MODES = ("deepspeed-capacity", "ep_moe-capacity", "deepspeed-dropless", "ep_moe-dropless")


@pytest.mark.parametrize("trivial", [False, True], ids=["mlp-experts", "trivial-experts"])
def test_deepspeed_layer_bench_cpu(trivial: bool, tmp_path) -> None:
    out_json = tmp_path / "bench.json"
    cmd = [sys.executable, str(BENCH), "--nproc", "2", "--tokens", "64", "--hidden", "16", "--ffn", "24",
           "--experts", "4", "--k", "2", "--iters", "2", "--warmup", "1", "--json", str(out_json)]
    if trivial:
        cmd.append("--trivial-experts")
    # the checkout's ep_moe (benchmarks/ is the script's own sys.path entry); gloo ranks on the CPU
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(locations.REPO),
                                                                    os.environ.get("PYTHONPATH")])),
               CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(cmd, cwd=locations.REPO, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("MoE layer fwd+bwd"))
    header, rows = lines[start], lines[start + 2:start + 2 + len(MODES)]
    assert ("4 trivial experts (identity, no parameters)" in header) == trivial, header
    assert ("ffn 24" in header) == (not trivial), header
    assert [row.split()[0] for row in rows] == list(MODES), run.stdout
    for row in rows:
        if row.startswith("ep_moe"):
            match = re.search(r"rel diff (\S+), l_aux/counts (\w+)$", row)
            assert match, row
            assert float(match.group(1)) <= 1e-5 and match.group(2) == "equal", row

    result = json.loads(out_json.read_text())
    assert result["config"]["trivial_experts"] is trivial
    assert result["expert_fn"].startswith("trivial") == trivial
    assert sorted(result["checks"]) == ["ep_moe-capacity", "ep_moe-dropless"]
    for check in result["checks"].values():
        assert check["max_rel_diff"] <= 1e-5 and check["l_aux_and_counts_equal"], result["checks"]
    assert sorted(result["timings"]) == sorted(MODES)


def test_deepspeed_layer_bench_floor_at_one_rank(tmp_path) -> None:
    """At one rank the bench adds the dropless floor (gate + experts, no token movement) and each dropless layer's
    own share (its time minus the floor's)."""
    out_json = tmp_path / "bench.json"
    cmd = [sys.executable, str(BENCH), "--nproc", "1", "--tokens", "48", "--hidden", "16", "--ffn", "24",
           "--experts", "4", "--k", "2", "--iters", "2", "--warmup", "1", "--json", str(out_json)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(locations.REPO),
                                                                    os.environ.get("PYTHONPATH")])),
               CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(cmd, cwd=locations.REPO, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out_json.read_text())
    assert sorted(result["timings"]) == sorted(MODES + ("dropless-floor",))
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines()
            if line.split() and line.split()[0] in result["timings"]}
    floor_ms = result["timings"]["dropless-floor"]["fwd_bwd_ms"]
    for mode in ("deepspeed-dropless", "ep_moe-dropless"):
        own = result["timings"][mode]["fwd_bwd_ms"] - floor_ms
        assert f"{own:.3f}" in rows[mode], rows[mode]
