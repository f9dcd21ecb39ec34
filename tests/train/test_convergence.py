"""The tiny recipe through the real command line: it reaches its target, and a run that is killed
(``kill -9``), resumed, stopped with Ctrl-C (SIGINT), and resumed again gives the same per-step losses
as an uninterrupted run, bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import locations
import pytest

from ep_moe.train.checkpoint import checkpoint_info, latest_checkpoint
from ep_moe.train.metrics import read_records

ROOT = str(locations.REPO)
TINY = os.path.join(ROOT, "recipes", "tiny-cpu.yaml")
STEPS = 150          # the shortened tiny recipe: half the steps, the same target (within 0.10 of the floor)
RESUMED_STEPS = 30   # the interrupted run's length (its schedule is the 150-step one)
# Dropout makes every step draw from the RNG, so a resume that did not restore the RNG state would not
# reproduce the losses.
COMMON = [f"train.train_iters={STEPS}", f"scheduler.lr_decay_iters={STEPS}", "logger.progress_bar=false",
          "checkpoint.save_interval=5", "train.eval_interval=0", "model.hidden_dropout=0.05",
          "model.attention_dropout=0.05"]


def _start(args: list[str]) -> subprocess.Popen:
    # A new session, so that the whole run (launcher and ranks) can be signalled as a terminal would.
    return subprocess.Popen([sys.executable, "-m", "ep_moe.train", TINY, *args], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"ep-moe train did not finish in {timeout} s:\n{out}")
    return proc.returncode, out


def _wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}:\n{proc.communicate()[0]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _train_losses(metrics_path: str) -> dict[int, float]:
    records = [r for r in read_records(metrics_path) if r["kind"] == "train"]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), "a step was recorded twice"
    return {r["step"]: r["loss"] for r in records}


def _last_train_step(metrics_path: str) -> int:
    if not os.path.exists(metrics_path):
        return 0
    steps = [r["step"] for r in read_records(metrics_path) if r.get("kind") == "train"]
    return max(steps, default=0)


def test_tiny_recipe_reaches_target_and_resumes_bit_for_bit(tmp_path):
    # 1. Uninterrupted (the reference), through the command line.
    ref = str(tmp_path / "ref")
    code, out = _finish(_start(COMMON + [f"checkpoint.save={ref}"]))
    assert code == 0, out
    summary = [line for line in out.splitlines() if line.startswith("done:")]
    assert len(summary) == 1 and "target <= 0.10: met" in summary[0], out
    records = read_records(os.path.join(ref, "metrics.jsonl"))
    floor = records[0]["entropy_floor"]
    final_eval = [r["eval_loss"] for r in records if r["kind"] == "eval"][-1]
    assert floor > 0.5 and 0 < final_eval - floor <= 0.10, (final_eval, floor)
    assert os.path.getsize(os.path.join(ref, "metrics_loss.png")) > 10_000
    reference = _train_losses(os.path.join(ref, "metrics.jsonl"))
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS] < reference[1] - 2.0

    # 2. The same run, killed with SIGKILL (whole process group) once a checkpoint exists.
    run = str(tmp_path / "run")
    metrics = os.path.join(run, "metrics.jsonl")
    proc = _start(COMMON + [f"checkpoint.save={run}"])
    _wait_for(lambda: latest_checkpoint(run) is not None and checkpoint_info(latest_checkpoint(run))["step"] >= 10,
              proc, "the step-10 checkpoint")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    killed_at = checkpoint_info(latest_checkpoint(run))["step"]

    # 3. Resumed, then stopped with SIGINT to the whole process group (what Ctrl-C in a terminal does).
    proc = _start(COMMON + [f"checkpoint.save={run}", "--resume"])
    _wait_for(lambda: _last_train_step(metrics) >= killed_at + 3, proc, "steps after the resume")
    os.killpg(proc.pid, signal.SIGINT)
    code, out = _finish(proc)
    assert code == 130, out
    assert "interrupted (SIGINT)" in out and "Traceback" not in out, out
    stopped_at = checkpoint_info(latest_checkpoint(run))["step"]
    assert killed_at + 3 <= stopped_at < RESUMED_STEPS, (killed_at, stopped_at)
    assert f"resumed from {os.path.join(run, f'step_{killed_at:07d}')} at step {killed_at}" in out

    # 4. Resumed again to the end of the shortened run.
    code, out = _finish(_start(COMMON + [f"checkpoint.save={run}", "--resume",
                                         f"train.train_iters={RESUMED_STEPS}"]))
    assert code == 0, out
    resumed = _train_losses(metrics)
    assert sorted(resumed) == list(range(1, RESUMED_STEPS + 1))
    assert all(resumed[s] == reference[s] for s in resumed), \
        [(s, resumed[s], reference[s]) for s in resumed if resumed[s] != reference[s]]
