"""``engine: deepspeed`` recipes: the schema checks (no processes), and one short run end to end through
the trainer's CLI (``ep-moe train recipes/deepspeed-moe-ep2.yaml key=value ...``, 2 spawned CPU ranks)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import yaml
from support_deepspeed import REPO, require_deepspeed

require_deepspeed()

from ep_moe.train.engines.deepspeed import (  # noqa: E402
    DEFAULTS,
    RecipeError,
    _check_world,
    deepspeed_config,
    resolve_recipe,
    train,
)

RECIPE_FILE = REPO / "recipes" / "deepspeed-moe-ep2.yaml"


def _recipe() -> dict:
    return yaml.safe_load(RECIPE_FILE.read_text())


def test_shipped_recipe_resolves():
    r = resolve_recipe(_recipe())
    assert r["engine"] == "deepspeed"
    assert r["model"]["moe_layer"] == "ep_moe" and r["model"]["moe_drop_tokens"] is False
    assert r["deepspeed"]["zero_stage"] == 2
    _check_world(r, r["train"]["nproc"])


def test_defaults_fill_missing_sections():
    r = resolve_recipe({"engine": "deepspeed"})
    assert r["model"] == DEFAULTS["model"] and r["train"] == DEFAULTS["train"]


@pytest.mark.parametrize("patch, message", [
    ({"model": {"num_moe_expert": 4}}, "unknown key 'model.num_moe_expert'; did you mean 'model.num_moe_experts'?"),
    ({"trian": {}}, "unknown key 'trian'; did you mean 'train'?"),
    ({"model": {"moe_layer": "deepspeedd"}}, "model.moe_layer: expected one of 'ep_moe', 'deepspeed'"),
    ({"model": {"hidden_size": "32"}}, "model.hidden_size: expected int, got str '32'"),
    ({"model": {"moe_drop_tokens": 1}}, "model.moe_drop_tokens: expected bool, got int 1"),
    ({"model": {"num_moe_experts": 6, "expert_model_parallel_size": 4}},
     "model.expert_model_parallel_size: must divide model.num_moe_experts=6, got 4"),
    ({"model": {"moe_router_topk": 5, "num_moe_experts": 4}}, "model.moe_router_topk: at most"),
    ({"train": {"precision": "fp16"}}, "train.precision: expected one of 'fp32', 'bf16'"),
    ({"deepspeed": {"zero_stage": 3}}, "deepspeed.zero_stage: expected one of 0, 1, 2"),
    ({"engine": "megatron"}, "engine: this runner trains 'deepspeed' recipes, got 'megatron'"),
])
def test_bad_recipes_name_the_key(patch, message):
    data = _recipe()
    for section, value in patch.items():
        if isinstance(value, dict) and isinstance(data.get(section), dict):
            data[section].update(value)
        else:
            data[section] = value
    with pytest.raises(RecipeError) as info:
        resolve_recipe(data)
    assert message in str(info.value)


def test_batch_arithmetic_is_checked_against_the_world():
    r = resolve_recipe(_recipe())
    with pytest.raises(RecipeError, match="model.expert_model_parallel_size: must divide the world size 3"):
        _check_world(r, 3)
    with pytest.raises(RecipeError, match="train.global_batch_size: must be a multiple of .* = 32, got 16"):
        _check_world(r, 4)
    r2 = copy.deepcopy(r)
    r2["train"]["global_batch_size"] = 32
    _check_world(r2, 2)
    assert deepspeed_config(r2, 2)["gradient_accumulation_steps"] == 2


def test_deepspeed_config_uses_torch_adam_and_merges_extra_keys():
    data = _recipe()
    data["deepspeed"] = {"zero_stage": 1, "config": {"zero_optimization": {"reduce_bucket_size": 1000},
                                                     "wall_clock_breakdown": True}}
    config = deepspeed_config(resolve_recipe(data), 2)
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert config["wall_clock_breakdown"] is True
    assert config["train_batch_size"] == 16 and config["train_micro_batch_size_per_gpu"] == 8


def test_train_returns_2_on_a_bad_recipe(capsys):
    assert train({"engine": "deepspeed", "model": {"num_moe_experts": 0}}) == 2
    assert "model.num_moe_experts: must be >= 1" in capsys.readouterr().err


def test_cli_runs_a_deepspeed_recipe(tmp_path: Path, capsys):
    """``ep-moe train`` hands the recipe (overrides applied) to ``deepspeed_recipe.train``; a short run
    trains, writes metrics and a DeepSpeed MoE checkpoint with one file per expert."""
    pytest.importorskip("ep_moe.train.launch", reason="the trainer (ep_moe.train) is not installed")
    from ep_moe.cli import main

    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    code = main(["train", str(RECIPE_FILE), "train.train_iters=6", "train.device=cpu", "train.eval_iters=1",
                 "train.target_loss_gap=null", "logger.log_interval=3", f"checkpoint.save={save}",
                 f"logger.metrics_path={metrics}", "model.num_layers=1", "ep_moe.dispatcher_backend=torch"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "deepspeed recipe (ep_moe MoE layer): 6 steps" in out and "entropy floor" in out, out
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert lines[0]["recipe"]["model"]["moe_layer"] == "ep_moe"
    assert [line["step"] for line in lines[1:]] == [3, 6]
    assert all(line["loss"] > 0 for line in lines[1:])
    files = sorted(os.listdir(save / "step6"))
    assert [f for f in files if f.startswith("layer_")] == [
        f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)]
