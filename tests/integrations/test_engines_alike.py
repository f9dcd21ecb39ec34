"""The three engines of ``ep-moe train`` (``ep_moe``, ``megatron``, ``deepspeed``) behave alike, through the
command line on 2 spawned CPU ranks (gloo): the same checkpoint folders (``step_<NNNNNNN>``, ``latest``,
``checkpoint.keep_last``), ``--resume`` and ``checkpoint.load`` continuing with the same per-step losses as
an uninterrupted run (bit for bit on CPU), the same exit statuses (0 when a target is missed,
1 with ``train.fail_on_target_miss``, 2 for a bad recipe), the same metrics records, the loss plot, and
TensorBoard event files with Megatron's scalar names.

Per engine, two short runs (about 10-25 s each here, mostly imports and process start-up):

1. 6 steps from scratch, saving every 2 steps with ``keep_last=0``, a target it cannot meet, TensorBoard on;
2. ``--resume`` in a fresh save folder holding only a copy of run 1's step-4 checkpoint, to step 6, with
   ``train.fail_on_target_miss=true`` and ``keep_last=1``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys

import locations
import pytest

from ep_moe.train.checkpoint import read_latest
from ep_moe.train.metrics import EVAL_KEYS, RUN_KEYS, TRAIN_KEYS, read_records

RECIPES = {"ep_moe": "tiny-cpu", "megatron": "megatron-gpt-moe-ep2", "deepspeed": "deepspeed-moe-ep2"}
NEEDS = {"megatron": "megatron.core", "deepspeed": "deepspeed"}
# Small and short; a constant learning rate so that a 6-step run and its resumed half follow one schedule.
COMMON = ["train.device=cpu", "train.nproc=2", "train.eval_iters=1", "train.eval_interval=2",
          "scheduler.lr_decay_style=constant", "scheduler.lr_warmup_iters=0", "logger.progress_bar=false",
          "logger.log_interval=1", "checkpoint.save_interval=2", "ep_moe.dispatcher_backend=torch",
          "train.target_loss_gap=0.001", "model.num_layers=1"]
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _available(engine: str) -> bool:
    if engine not in NEEDS:
        return True
    try:
        return importlib.util.find_spec(NEEDS[engine]) is not None
    except ImportError:
        return False


def _train(args: list[str], cwd) -> tuple[int, str, str]:
    """``ep-moe train ARGS`` in a fresh process (from another folder than the repository): status, out, err."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(locations.REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "ep_moe.cli", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module", params=[pytest.param(engine, marks=pytest.mark.slow) for engine in RECIPES])
def runs(request, tmp_path_factory):
    """Run 1 and run 2 of one engine (by the built-in recipe's name, from a temporary folder): their exit
    statuses, outputs and folders."""
    engine = request.param
    if not _available(engine):
        pytest.skip(f"engine {engine} needs {NEEDS[engine]}, which is not installed")
    tmp = tmp_path_factory.mktemp(engine)
    first, second = tmp / "first", tmp / "second"
    extra = [f"logger.tensorboard_dir={first / 'tb'}"] if HAS_TENSORBOARD else []
    out = {"engine": engine, "first": first, "second": second}
    out["code1"], out["out1"], out["err1"] = _train(
        [RECIPES[engine], *COMMON, "train.train_iters=6", f"checkpoint.save={first}", "checkpoint.keep_last=0",
         *extra], tmp)
    assert (first / "step_0000004").is_dir(), out["out1"] + out["err1"]
    second.mkdir()
    shutil.copytree(first / "step_0000004", second / "step_0000004")
    (second / "latest").write_text("step_0000004\n")
    out["code2"], out["out2"], out["err2"] = _train(
        [RECIPES[engine], *COMMON, "train.train_iters=6", f"checkpoint.save={second}", "checkpoint.keep_last=1",
         "train.fail_on_target_miss=true", "--resume"], tmp)
    out["code_bad"], out["err_bad"] = _main_in_process(["train", RECIPES[engine], "train.train_itres=5"], tmp)
    return out


def _main_in_process(args: list[str], cwd) -> tuple[int, str]:
    """``ep-moe ARGS`` in this process, from ``cwd``: status and stderr. For a recipe that cannot start (nothing is
    spawned); ``python -m ep_moe.cli`` passes `main`'s status on as the exit status, as runs 1 and 2 show."""
    from ep_moe.cli import main

    err = io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stderr(err):
        code = main(args)
    return code, err.getvalue()


def _losses(path) -> dict[int, float]:
    records = [r for r in read_records(str(path)) if r["kind"] == "train"]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), "a step was recorded twice"
    return {r["step"]: r["loss"] for r in records}


def test_exit_statuses_are_the_same(runs):
    first, second = runs["out1"] + runs["err1"], runs["out2"] + runs["err2"]
    assert runs["code1"] == 0, first  # a missed target is reported, not a failure
    summary = [line for line in first.splitlines() if line.startswith("done: 6 steps")]
    assert len(summary) == 1 and "target <= 0.00: NOT met" in summary[0], first
    assert runs["code2"] == 1, second  # ... unless train.fail_on_target_miss asks
    assert "train.fail_on_target_miss is set: exit status 1" in second
    assert runs["code_bad"] == 2 and "did you mean 'train.train_iters'" in runs["err_bad"]


def test_checkpoint_folders_are_named_alike(runs):
    first, second = runs["first"], runs["second"]
    assert sorted(p.name for p in first.iterdir() if p.name.startswith("step_")) == [
        "step_0000002", "step_0000004", "step_0000006"]  # keep_last=0: all
    assert read_latest(str(first)) == str(first / "step_0000006")
    assert sorted(p.name for p in second.iterdir() if p.name.startswith("step_")) == ["step_0000006"]  # keep_last=1
    assert read_latest(str(second)) == str(second / "step_0000006")


def test_resume_continues_bit_for_bit(runs):
    out = runs["out2"]
    assert f"resumed from {runs['second'] / 'step_0000004'} at step 4" in out, out
    reference, resumed = _losses(runs["first"] / "metrics.jsonl"), _losses(runs["second"] / "metrics.jsonl")
    assert sorted(reference) == list(range(1, 7)) and sorted(resumed) == [5, 6]
    assert [resumed[s] for s in (5, 6)] == [reference[s] for s in (5, 6)], (resumed, reference)


def test_metrics_records_progress_lines_and_plot_are_the_same(runs):
    records = read_records(str(runs["first"] / "metrics.jsonl"))
    assert records[0]["kind"] == "run" and tuple(records[0]) == RUN_KEYS
    assert records[0]["engine"] == runs["engine"] and records[0]["world_size"] == 2
    for record in records[1:]:
        assert tuple(record) == (TRAIN_KEYS if record["kind"] == "train" else EVAL_KEYS), record
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["loss"] > 0 and r["lr"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in train)
    assert all(r["load_imbalance"] >= 1.0 and len(r["load_imbalance_layers"]) == 1 for r in train)
    assert all(r["aux_loss"] > 0 and r["router_aux_loss_raw"] > 0 for r in train)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4, 6]
    lines = runs["out1"].splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ") and "loss" in line
            and "eval" not in line] == [f"{s}/6" for s in range(1, 7)]
    assert os.path.getsize(runs["first"] / "metrics_loss.png") > 10_000


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (pip install tensorboard)")
def test_tensorboard_scalars_are_written(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs["first"] / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "tokens-per-sec", "load-imbalance", "load_balancing_loss",
            "lm loss validation", "moe/load_imbalance_layer_0"} <= tags, tags
    loss = events.Scalars("lm loss")
    assert [e.step for e in loss] == list(range(1, 7))
    reference = _losses(runs["first"] / "metrics.jsonl")
    assert [e.value for e in loss] == pytest.approx([reference[s] for s in range(1, 7)], rel=1e-6)
    assert [e.step for e in events.Scalars("lm loss validation")] == [2, 4, 6]


def test_print_config_finds_the_builtin_recipe_from_another_folder(tmp_path, monkeypatch, capsys):
    from ep_moe.cli import main

    monkeypatch.chdir(tmp_path)
    assert not os.path.exists("recipes")
    for engine, name in RECIPES.items():
        assert main(["train", name, "train.train_iters=7", "--print-config"]) == 0
        printed = capsys.readouterr().out
        assert f"engine: {engine}" in printed and "train_iters: 7" in printed
    from ep_moe.train.recipes import recipes_dir

    assert recipes_dir() == locations.RECIPES  # a source checkout: the repository's folder is the one copy
