"""Rank 0's run log: the W&B sink (with a stand-in ``wandb`` module: the real one needs an account or writes
an offline run folder) gets the same scalars as TensorBoard, and ``--resume`` continues the same W&B run."""

from __future__ import annotations

import os
import sys
import types

import pytest

from ep_moe.train.metrics import RunLog, TensorBoardLog
from ep_moe.train.recipe_schema import RecipeError, apply_overrides, recipe_from_dict, validate


class FakeRun:
    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.id = kwargs.get("id") or "run-abc"
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, scalars, step):
        self.logged.append((scalars, step))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    runs: list[FakeRun] = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: runs.append(FakeRun(kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def _recipe(tmp_path, *overrides):
    return recipe_from_dict(apply_overrides({}, [f"checkpoint.save={tmp_path / 'run'}",
                                                 "logger.wandb_project=moe", *overrides]))


def test_wandb_gets_the_tensorboard_scalars_and_resume_continues_the_run(tmp_path, fake_wandb):
    recipe = _recipe(tmp_path)
    log = RunLog(recipe)
    log.write({"kind": "run", "step": 0})
    log.write({"kind": "train", "step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": float("nan"),
               "load_imbalance_layers": [1.5, 2.0]})
    log.write({"kind": "eval", "step": 3, "eval_loss": 2.25})
    log.close()
    [run] = fake_wandb
    assert run.kwargs["project"] == "moe" and run.kwargs["name"] == "run" and run.kwargs["id"] is None
    assert run.kwargs["config"]["logger"]["wandb_project"] == "moe"
    assert run.logged == [({"lm loss": 2.5, "learning-rate": 1e-3, "moe/load_imbalance_layer_0": 1.5,
                            "moe/load_imbalance_layer_1": 2.0}, 3), ({"lm loss validation": 2.25}, 3)]
    assert run.finished and set(TensorBoardLog.SCALARS.values()) >= {"lm loss", "learning-rate"}
    assert open(os.path.join(recipe.output_dir(), "wandb-run-id")).read() == "run-abc"

    RunLog(_recipe(tmp_path, "logger.wandb_run_name=again"), resume_step=3).close()
    assert fake_wandb[1].kwargs["id"] == "run-abc" and fake_wandb[1].kwargs["resume"] == "allow"
    assert fake_wandb[1].kwargs["name"] == "again"
    RunLog(_recipe(tmp_path)).close()  # a fresh run (not a resume) starts a new W&B run
    assert fake_wandb[2].kwargs["id"] is None


def test_wandb_project_without_wandb_is_a_recipe_error_at_launch(tmp_path, monkeypatch):
    from ep_moe.train import recipe_schema as config

    recipe = _recipe(tmp_path)  # parsing does not need the package
    monkeypatch.setattr(config, "_importable", lambda package: package != "wandb")
    with pytest.raises(RecipeError, match=r"logger.wandb_project: needs the wandb package, which is not installed"):
        validate(recipe, 2, "cpu")
