"""When things go wrong in ``ep-moe train`` (the tiny recipe on 2 CPU ranks, through the real command line; a
run that stops before any rank starts through the command's ``main`` in the test process, stderr captured at the
file descriptor):

* the launcher killed with SIGKILL takes its ranks with it, and leaves a lock that the next run sees is stale;
* the launcher sent SIGTERM stops its ranks after their step, saves a checkpoint that resumes, and exits 130;
* a run folder is held by one run at a time, and a fresh run does not reuse one that holds an earlier run;
* errors are one line each on stderr (the same error on every rank once), tracebacks in ``error.log``;
* a rank killed by a signal is one line, within seconds, and the other ranks are stopped.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time

import locations
import psutil
import pytest

from ep_moe.distributed import RankFailure, RankFailures, run_distributed
from ep_moe.train.failures import failure_lines, rank_list
from ep_moe.train.metrics import read_records
from ep_moe.train.rundir import LOCK_NAME, RunDirError, RunDirLock, clear_earlier_run, earlier_run

ROOT = str(locations.REPO)
TINY = os.path.join(ROOT, "recipes", "tiny-cpu.yaml")
# The tiny recipe made smaller still: the tests are about starting and stopping, not about learning.
QUICK = ["logger.progress_bar=false", "train.eval_iters=0", "checkpoint.save_interval=0", "model.num_layers=1",
         "model.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2"]
LONG = QUICK + ["train.train_iters=100000"]   # a run that is still training when the test acts on it


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ep_moe.train", TINY, *args]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _start(*args: str) -> subprocess.Popen:
    # A new session, so that whatever is left can be cleaned up as a group.
    return subprocess.Popen(_cmd(*args), cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _cleanup(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _wait_training(proc: subprocess.Popen, folder: str, steps: int = 2, timeout: float = 60) -> None:
    metrics = os.path.join(folder, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while True:
        if os.path.exists(metrics) and sum(r.get("kind") == "train" for r in read_records(metrics)) >= steps:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before training:\n{proc.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail("timed out waiting for the run to train")
        time.sleep(0.1)


def _ranks(launcher_pid: int) -> list[psutil.Process]:
    """The launcher's spawned ranks (its children that run multiprocessing's spawn_main), by pid."""
    children = psutil.Process(launcher_pid).children()
    return sorted((c for c in children if "spawn_main" in " ".join(c.cmdline())), key=lambda c: c.pid)


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # dead, waiting to be reaped by its new parent
    except psutil.NoSuchProcess:
        return True


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _main(capfd, *args: str) -> tuple[int, str]:
    """``ep-moe train TINY ARGS`` in this process (for runs refused before any rank starts: nothing is spawned, so
    a new interpreter would only add its start-up): the exit status and what reached stderr."""
    from ep_moe.train import launch

    capfd.readouterr()
    code = launch.main([TINY, *args])
    return code, capfd.readouterr().err


# ---------------------------------------------------------------------------------------------- the launcher dies
def test_killed_launcher_takes_its_ranks_along_and_leaves_a_stale_lock(tmp_path):
    run = str(tmp_path / "run")
    proc = _start(*LONG, f"checkpoint.save={run}")
    try:
        _wait_training(proc, run)
        ranks = _ranks(proc.pid)
        assert len(ranks) == 2, [r.cmdline() for r in ranks]
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only, as the OOM killer or kill -9 would
        proc.communicate()
        deadline = time.monotonic() + 5
        while not all(_gone(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(r) for r in ranks), "ranks still alive 5 s after their launcher was killed"
    finally:
        _cleanup(proc)
    with open(os.path.join(run, LOCK_NAME), encoding="utf-8") as f:
        assert json.load(f)["pid"] == proc.pid   # the dead launcher's lock is still there

    # The next run sees that the holder is gone, says so in one line, and runs.
    out = _run(*QUICK, f"checkpoint.save={run}", "--overwrite", "train.train_iters=1")
    assert out.returncode == 0, out.stderr
    [line] = _lines(out.stderr)
    assert line.startswith(f"ep-moe train: {run}: took over the lock of pid {proc.pid} (host {socket.gethostname()}) "
                           "since ") and line.endswith(", which no longer runs"), line
    assert not os.path.exists(os.path.join(run, LOCK_NAME))  # released at exit


# ---------------------------------------------------------------------------------------------- the launcher is stopped
def test_sigterm_to_the_launcher_saves_a_checkpoint_that_resumes_and_exits_130(tmp_path):
    """What a process manager's ``kill PID`` does (the launcher alone; it forwards the signal to its ranks), the
    SIGINT of Ctrl-C being checked in test_convergence.py."""
    from ep_moe.train.checkpoint import checkpoint_info, latest_checkpoint

    run = str(tmp_path / "run")
    proc = _start(*LONG, f"checkpoint.save={run}")
    try:
        _wait_training(proc, run)
        ranks = _ranks(proc.pid)
        assert len(ranks) == 2
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        _cleanup(proc)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err, (out, err)
    assert all(_gone(r) for r in ranks)
    checkpoint = latest_checkpoint(run)
    assert checkpoint is not None, os.listdir(run)
    stopped_at = checkpoint_info(checkpoint)["step"]
    trained = [r["step"] for r in read_records(os.path.join(run, "metrics.jsonl")) if r["kind"] == "train"]
    assert stopped_at >= 2 and stopped_at == max(trained), (stopped_at, trained)
    assert f"interrupted (SIGTERM) after step {stopped_at}" in out + err, (out, err)
    assert not os.path.exists(os.path.join(run, LOCK_NAME))

    # The checkpoint loads: a resumed run starts from it and trains one more step.
    resumed = _run(*LONG, f"checkpoint.save={run}", "--resume", f"train.train_iters={stopped_at + 1}")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {checkpoint} at step {stopped_at}" in resumed.stdout + resumed.stderr, resumed.stdout
    trained = [r["step"] for r in read_records(os.path.join(run, "metrics.jsonl")) if r["kind"] == "train"]
    assert trained == list(range(1, stopped_at + 2)), trained


# ---------------------------------------------------------------------------------------------- one run per folder
def test_a_second_run_on_a_held_folder_fails_in_one_line(tmp_path, capfd):
    run = str(tmp_path / "run")
    with RunDirLock(run):  # held by this (live) process; the run's own lock is another taker (flock per open)
        code, err = _main(capfd, *QUICK, f"checkpoint.save={run}", "train.train_iters=1")
    assert code == 2
    [line] = _lines(err)
    assert line.startswith(f"ep-moe train: {run} is in use by pid {os.getpid()} (host {socket.gethostname()}) "
                           "since "), line
    assert not os.path.exists(run)  # nothing left behind: the folder was empty and is gone with the lock


def test_lock_records_decide_where_file_locks_do_not(tmp_path):
    """Without a flock (a filesystem without locks), the record decides: a live pid of this host holds the
    folder, a dead one is stale, another host's cannot be checked and holds it."""
    folder = str(tmp_path / "run")
    os.makedirs(folder)
    lock_file = os.path.join(folder, LOCK_NAME)
    host = socket.gethostname()

    def write(record):
        with open(lock_file, "w", encoding="utf-8") as f:
            json.dump(record, f)

    write({"pid": os.getppid(), "host": host, "since": "then"})   # alive (pytest's parent)
    with pytest.raises(RunDirError, match=rf"is in use by pid {os.getppid()} \(host {re.escape(host)}\) since then$"):
        RunDirLock(folder).acquire()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write({"pid": dead.pid, "host": host, "since": "then"})
    lock = RunDirLock(folder).acquire()
    assert lock.note and f"took over the lock of pid {dead.pid}" in lock.note
    with open(lock_file, encoding="utf-8") as f:
        assert json.load(f)["pid"] == os.getpid()
    with pytest.raises(RunDirError, match="is in use by pid"):  # our own flock holds against a second taker
        RunDirLock(folder).acquire()
    lock.release()
    assert not os.path.exists(lock_file) and os.path.isdir(folder)  # the folder existed before: kept
    write({"pid": 1, "host": "elsewhere", "since": "then"})
    with pytest.raises(RunDirError, match="another host cannot be checked from here: if that run is gone, remove"):
        RunDirLock(folder).acquire()


def test_a_fresh_run_does_not_reuse_a_folder_with_an_earlier_run(tmp_path, capfd):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "run", "step": 0}\n')
    code, err = _main(capfd, *QUICK, f"checkpoint.save={run}", "train.train_iters=1")
    assert code == 2
    [line] = _lines(err)
    assert line == (f"ep-moe train: {run} holds an earlier run (metrics.jsonl): continue it with --resume, or start "
                    "over with --overwrite (or choose another checkpoint.save)")
    assert (run / "metrics.jsonl").read_text() == '{"kind": "run", "step": 0}\n'  # untouched
    assert sorted(os.listdir(run)) == ["metrics.jsonl"]  # and no lock left


def test_overwrite_removes_what_the_trainer_wrote_only(tmp_path):
    from ep_moe.train.recipe_schema import load_recipe

    run = tmp_path / "run"
    (run / "step_0000005").mkdir(parents=True)
    (run / "step_0000005" / "model.pt").write_text("x")
    (run / ".tmp_step_0000006_123").mkdir()
    for name in ("latest", "metrics.jsonl", "metrics_loss.png", "error.log", "notes.txt"):
        (run / name).write_text("x")
    recipe = load_recipe(TINY, [f"checkpoint.save={run}"])
    assert {os.path.basename(p) for p in earlier_run(recipe)} == {
        "step_0000005", ".tmp_step_0000006_123", "latest", "metrics.jsonl", "metrics_loss.png", "notes.txt"}
    with pytest.raises(RunDirError, match="which --overwrite would clear"):  # nothing removed
        clear_earlier_run(load_recipe(TINY, [f"checkpoint.save={run}", f"checkpoint.load={run}/step_0000005"]))
    assert len(os.listdir(run)) == 7
    clear_earlier_run(recipe)
    assert os.listdir(run) == ["notes.txt"]


# ---------------------------------------------------------------------------------------------- errors: one line each
def test_native_backend_without_the_kernels_is_one_line_before_any_rank(tmp_path, capfd):
    from ep_moe import native

    if native.kernels_available():
        pytest.skip("the native kernels can run here")
    code, err = _main(capfd, *QUICK, f"checkpoint.save={tmp_path / 'run'}", "ep_moe.dispatcher_backend=native")
    assert code == 2
    [line] = _lines(err)
    assert line.startswith("ep-moe train: ep_moe.dispatcher_backend: 'native' needs the native kernels (compiled on "
                           "first use, or loaded from the cache that `ep-moe jit warmup` fills), which cannot run "
                           "here ("), line
    assert not os.path.exists(tmp_path / "run")


def test_checkpoint_save_at_a_file_is_one_line_before_any_rank(tmp_path, capfd):
    target = tmp_path / "a-file"
    target.write_text("not a folder")
    code, err = _main(capfd, *QUICK, f"checkpoint.save={target}")
    assert code == 2
    assert _lines(err) == [f"ep-moe train: checkpoint.save: {target} is a file, not a folder"]
    code, err = _main(capfd, *QUICK, f"checkpoint.save={target / 'sub'}")
    assert code == 2
    assert _lines(err) == [f"ep-moe train: checkpoint.save: cannot create the folder {target / 'sub'}: "
                                  f"{target} is a file"]


def _check_log(folder, *expected: str) -> str:
    log = os.path.join(folder, "error.log")
    with open(log, encoding="utf-8") as f:
        text = f.read()
    assert "Traceback (most recent call last)" in text
    for part in expected:
        assert part in text
    return log


def test_nan_loss_is_one_line_for_both_ranks_with_the_tracebacks_in_a_log(tmp_path):
    run = str(tmp_path / "run")
    out = _run(*QUICK, f"checkpoint.save={run}", "train.train_iters=20", "optimizer.lr=1e30",
               "scheduler.lr_warmup_iters=0", "scheduler.min_lr=0")
    assert out.returncode == 1
    [line] = _lines(out.stderr)
    log = _check_log(run, "--- rank 0: FloatingPointError", "--- rank 1: FloatingPointError")
    assert re.fullmatch(r"ep-moe train: ranks 0-1: FloatingPointError: loss is (nan|inf) at step \d+; lower "
                        rf"optimizer.lr or check the data \[log: {re.escape(log)}\]", line), line


def test_resume_with_another_model_is_one_line(tmp_path):
    run = str(tmp_path / "run")
    assert _run(*QUICK, f"checkpoint.save={run}", "train.train_iters=1").returncode == 0
    out = _run(*QUICK, f"checkpoint.save={run}", "train.train_iters=2", "model.hidden_size=32", "--resume")
    assert out.returncode == 1
    [line] = _lines(out.stderr)
    log = _check_log(run, "ValueError")
    assert line == (f"ep-moe train: ranks 0-1: ValueError: checkpoint '{run}/step_0000001': model.hidden_size is "
                    f"64 there, 32 in this recipe [log: {log}]")


def test_an_error_inside_the_ranks_past_the_checks_is_one_line(tmp_path, monkeypatch, capfd):
    """The native backend's own error in the ranks (as when the launcher's check cannot see it): once, not
    once per rank, and no traceback on stderr."""
    from ep_moe import native
    from ep_moe.train import launch

    if native.kernels_available():
        pytest.skip("the native kernels can run here")
    monkeypatch.setattr(launch, "preflight_backend", lambda recipe, device: None)
    run = str(tmp_path / "run")
    code = launch.main([TINY, *QUICK, f"checkpoint.save={run}", "train.train_iters=1",
                        "ep_moe.dispatcher_backend=native"])
    err = capfd.readouterr().err
    assert code == 1
    [line] = _lines(err)
    log = _check_log(run, "--- rank 0: RuntimeError", "--- rank 1: RuntimeError")
    assert line.startswith("ep-moe train: ranks 0-1: RuntimeError: ep_moe.Buffer: backend 'native' cannot run here: ")
    assert line.endswith(f" [log: {log}]")


# ---------------------------------------------------------------------------------------------- a rank dies
def test_a_rank_killed_by_a_signal_is_one_line_and_stops_the_run(tmp_path):
    run = str(tmp_path / "run")
    proc = _start(*LONG, f"checkpoint.save={run}")
    try:
        _wait_training(proc, run)
        ranks = _ranks(proc.pid)
        assert len(ranks) == 2
        # While it trains, a second run on its folder is refused in one line naming it.
        second = _run(*QUICK, f"checkpoint.save={run}", "--resume", timeout=60)
        assert second.returncode == 2
        [line] = _lines(second.stderr)
        assert re.fullmatch(rf"ep-moe train: {re.escape(run)} is in use by pid {proc.pid} "
                            rf"\(host {re.escape(socket.gethostname())}\) since \S+", line), line
        killed_at = time.monotonic()
        os.kill(ranks[1].pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=20)
        took = time.monotonic() - killed_at
    finally:
        _cleanup(proc)
    assert proc.returncode == 1, err
    assert took < 10, took
    [line] = _lines(err)
    assert re.fullmatch(rf"ep-moe train: rank [01] died: signal 9 \(SIGKILL\) \[log: {re.escape(run)}/error.log\]",
                        line), line
    assert all(_gone(r) for r in ranks)
    with open(os.path.join(run, "error.log"), encoding="utf-8") as f:
        assert "died: signal 9 (SIGKILL)" in f.read()


# ---------------------------------------------------------------------------------------------- the launcher's record
def _raise_on_rank_1(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one says no")
    dist.barrier()
    return rank


def _die_on_rank_1(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return rank


def test_run_distributed_keeps_its_message_and_adds_the_facts():
    """`run_distributed`'s RuntimeError still carries every traceback; `RankFailures` adds who failed how."""
    with pytest.raises(RuntimeError, match="distributed run failed") as info:
        run_distributed(_raise_on_rank_1, 2, timeout_s=60)
    exc = info.value
    assert isinstance(exc, RankFailures) and "rank 1: ValueError: rank one says no\nTraceback" in str(exc)
    assert [(f.rank, f.exc_type, f.message) for f in exc.primary_failures()] == [(1, "ValueError", "rank one says no")]
    assert "raise ValueError" in exc.failures[-1].traceback
    started = time.monotonic()
    with pytest.raises(RankFailures) as info:
        run_distributed(_die_on_rank_1, 2, timeout_s=60)
    assert info.value.deaths == {1: signal.SIGKILL} and info.value.primary_failures() == []
    assert "rank 1 died: signal 9 (SIGKILL)" in str(info.value)
    assert time.monotonic() - started < 30  # not the 60 s collective timeout


# ---------------------------------------------------------------------------------------------- formatting
def test_failure_lines_group_ranks_and_leave_out_a_dead_peers_echo():
    tb = "Traceback (most recent call last):\n  ...\n"
    peer = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8113"
    exc = RankFailures([RankFailure(0, "ValueError", "bad\n  value", tb), RankFailure(2, "ValueError", "bad value", tb),
                        RankFailure(1, "RuntimeError", peer, tb), RankFailure(3, "KeyError", "'x'", tb)],
                       deaths={5: 9}, exit_codes={4: 3})
    assert isinstance(exc, RuntimeError) and str(exc).startswith("distributed run failed:\nrank 0: ValueError")
    again = pickle.loads(pickle.dumps(exc))
    assert (again.failures, again.deaths, again.exit_codes, str(again)) == (exc.failures, exc.deaths,
                                                                           exc.exit_codes, str(exc))
    assert failure_lines(exc, "L") == ["ranks 0, 2: ValueError: bad value [log: L]", "rank 3: KeyError: 'x' [log: L]",
                                       "rank 5 died: signal 9 (SIGKILL) [log: L]",
                                       "rank 4 exited with status 3 without a result [log: L]"]
    only_echoes = RankFailures([RankFailure(0, "RuntimeError", peer, tb)])
    assert failure_lines(only_echoes, None) == [f"rank 0: RuntimeError: {peer}"]
    assert rank_list([3, 0, 1, 2, 7]) == "ranks 0-3, 7"


# ---------------------------------------------------------------------------------------------- under torchrun
def test_an_error_under_torchrun_is_one_line_of_ours_with_the_traceback_in_the_log(tmp_path):
    """Under torchrun each rank is its own process: the error is one ``ep-moe train:`` line (printed once for
    the ranks of one torchrun agent), the traceback goes to error.log, the exit status is non-zero."""
    run = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "ep_moe.train", TINY, *QUICK,
           f"checkpoint.save={run}", "train.train_iters=20", "optimizer.lr=1e30", "scheduler.lr_warmup_iters=0",
           "scheduler.min_lr=0"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode != 0
    ours = [line for line in _lines(out.stderr) if line.startswith("ep-moe train:")]
    log = os.path.join(run, "error.log")
    assert len(ours) == 1, out.stderr
    assert re.fullmatch(r"ep-moe train: rank [01]: FloatingPointError: loss is (nan|inf) at step \d+; lower "
                        rf"optimizer.lr or check the data \[log: {re.escape(log)}\]", ours[0]), ours[0]
    text = open(log).read()
    assert "FloatingPointError" in text and "Traceback (most recent call last)" in text
    assert "ep_moe/train/" not in out.stderr  # no frame of a rank's traceback on the terminal


def test_report_rank_error_prints_each_error_once_per_agent(tmp_path):
    from ep_moe.train.failures import report_rank_error

    folder = str(tmp_path / "run")
    log = os.path.join(folder, "error.log")
    first = report_rank_error(folder, 0, ValueError("hidden 64 vs 32"))
    assert first == f"rank 0: ValueError: hidden 64 vs 32 [log: {log}]"
    assert report_rank_error(folder, 1, ValueError("hidden 64 vs 32")) is None        # the same error: once
    assert report_rank_error(folder, 2, RuntimeError("Connection closed by peer")) is None  # an echo of it
    other = report_rank_error(folder, 3, KeyError("x"))
    assert other == f"rank 3: KeyError: 'x' [log: {log}]"
    text = open(log).read()
    assert [line.split(" rank ")[1][0] for line in text.splitlines() if line.startswith("--- agent")] == \
        ["0", "1", "2", "3"]
