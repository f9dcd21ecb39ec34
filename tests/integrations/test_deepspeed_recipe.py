"""``engine: deepspeed`` recipes: the DeepSpeed config a recipe makes, and one short run end to end through
the trainer's CLI (``ep-moe train recipes/deepspeed-moe-ep2.yaml key=value ...``, 2 spawned CPU ranks). The
recipe schema and its errors are tested with the other engines' in ``tests/train/test_config.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from support_deepspeed import REPO, require_deepspeed

require_deepspeed()

from ep_moe.train.engines.deepspeed_engine import deepspeed_config, lr_scheduler  # noqa: E402
from ep_moe.train.recipe_schema import apply_overrides, recipe_from_dict  # noqa: E402
from ep_moe.train.schedule import recipe_lr  # noqa: E402

RECIPE_FILE = REPO / "recipes" / "deepspeed-moe-ep2.yaml"


def _recipe(overrides: list[str] | None = None):
    return recipe_from_dict(apply_overrides(yaml.safe_load(RECIPE_FILE.read_text()), overrides or []))


def test_gradient_accumulation_follows_the_world():
    assert deepspeed_config(_recipe(), 2)["gradient_accumulation_steps"] == 1
    assert deepspeed_config(_recipe(["train.global_batch_size=32"]), 2)["gradient_accumulation_steps"] == 2


def test_deepspeed_config_uses_torch_adam_and_merges_extra_keys():
    recipe = _recipe(["deepspeed.zero_stage=1", "deepspeed.config={zero_optimization: {reduce_bucket_size: 1000}, "
                      "wall_clock_breakdown: true}"])
    config = deepspeed_config(recipe, 2)
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert config["wall_clock_breakdown"] is True
    assert config["train_batch_size"] == 16 and config["train_micro_batch_size_per_gpu"] == 8


def test_learning_rate_is_the_trainers_schedule():
    import torch

    recipe = _recipe(["scheduler.lr_decay_style=linear", "scheduler.lr_decay_iters=200"])
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=recipe.optimizer.lr)
    scheduler = lr_scheduler(optimizer, recipe)
    seen = []
    for _ in range(250):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [recipe_lr(recipe, step) for step in range(250)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=0.0)
    assert seen[0] < seen[19] == pytest.approx(recipe.optimizer.lr) and seen[-1] == pytest.approx(1e-3)


def test_cli_runs_a_deepspeed_recipe(tmp_path: Path, capfd):
    """``ep-moe train`` hands the parsed recipe (overrides applied) to ``ep_moe.train.engines.deepspeed_engine.train``;
    a short run trains, writes the trainer's metrics records and a DeepSpeed MoE checkpoint with one file per
    expert in the trainer's ``step_<NNNNNNN>`` folder."""
    pytest.importorskip("ep_moe.train.launch", reason="the trainer (ep_moe.train) is not installed")
    from ep_moe.cli import main

    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    code = main(["train", str(RECIPE_FILE), "train.train_iters=6", "train.device=cpu", "train.eval_iters=1",
                 "train.target_loss_gap=null", "logger.log_interval=3", f"checkpoint.save={save}",
                 f"logger.metrics_path={metrics}", "model.num_layers=1", "ep_moe.dispatcher_backend=torch"])
    out = capfd.readouterr().out  # rank 0, a spawned process, prints
    assert code == 0, out
    assert "engine deepspeed): ep_moe MoE layer" in out and "done: 6 steps" in out and "entropy floor" in out, out
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert lines[0]["kind"] == "run" and lines[0]["recipe"]["model"]["moe_layer"] == "ep_moe"
    assert [line["step"] for line in lines[1:] if line["kind"] == "train"] == [3, 6]
    assert all(line["loss"] > 0 for line in lines[1:] if line["kind"] == "train")
    files = sorted(os.listdir(save / "step_0000006"))
    assert [f for f in files if f.startswith("layer_")] == [
        f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)]
    assert (save / "latest").read_text().strip() == "step_0000006"
