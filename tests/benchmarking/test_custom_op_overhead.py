"""`benchmarks/custom_op_overhead.py` end to end on CPU (short rounds): every row printed, exit 0; with the eager
path's combine planted to return other values, the row says DIFF and the run exits 1."""

from __future__ import annotations

import os
import subprocess
import sys

import locations

SCRIPT = locations.REPO / "benchmarks" / "custom_op_overhead.py"
ROWS = ("dispatch", "combine", "cached_dispatch", "dispatch + combine, fwd+bwd")
PLANTED = """
import runpy, sys
from ep_moe.buffer import autograd_ops
combine = autograd_ops._COMBINE  # its eager path only: the dispatcher's keeps the registered implementation
forward = combine.function.forward
combine.function = type("Planted", (combine.function,), {
    "forward": staticmethod(lambda ctx, *args: tuple(t + 1 for t in forward(ctx, *args)))})
sys.argv = ["custom_op_overhead.py", "--calls", "2", "--rounds", "1"]
runpy.run_path(SCRIPT_PATH, run_name="__main__")
"""


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(locations.REPO),
                                                                    os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


def test_every_row_checked_and_printed():
    done = _run([str(SCRIPT), "--calls", "3", "--rounds", "2"])
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for row in ROWS:
        assert any(line.startswith(row) and "DIFF" not in line for line in lines), done.stdout


def test_a_planted_difference_fails_the_run():
    done = _run(["-c", PLANTED.replace("SCRIPT_PATH", repr(str(SCRIPT)))])
    assert done.returncode == 1, done.stdout + done.stderr
    assert any(line.startswith("combine") and line.endswith("DIFF") for line in done.stdout.splitlines()), done.stdout
    assert "differ" in done.stderr
