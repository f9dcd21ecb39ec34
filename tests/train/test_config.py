"""Recipe schema, overrides and error messages of ``ep-moe train`` (no processes spawned)."""

from __future__ import annotations

import math
import os
import sys

import locations
import pytest
import yaml

from ep_moe.train import main
from ep_moe.train.config import (
    RecipeError,
    apply_overrides,
    engine_of,
    load_recipe,
    parse_override,
    per_layer_num_sms,
    recipe_from_dict,
)
from ep_moe.train.schedule import lr_at

ROOT = str(locations.REPO)
RECIPES = os.path.join(ROOT, "recipes")
OWN_RECIPES = ["tiny-cpu.yaml", "shakespeare-char.yaml", "small-gpu-ep2.yaml"]


def _error(data: dict, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(apply_overrides(data, overrides or []))
    return str(info.value)


@pytest.mark.parametrize("name", OWN_RECIPES)
def test_recipes_load_and_have_a_comment_header(name):
    path = os.path.join(RECIPES, name)
    recipe = load_recipe(path)
    assert recipe.engine == "ep_moe" and recipe.name == name[:-5]
    with open(path, encoding="utf-8") as f:
        assert f.readline().startswith(f"# {name[:-5]}:")


def test_tiny_recipe_is_the_two_rank_cpu_job():
    recipe = load_recipe(os.path.join(RECIPES, "tiny-cpu.yaml"))
    assert (recipe.train.nproc, recipe.train.device, recipe.model.expert_model_parallel_size) == (2, "cpu", 2)
    assert recipe.dataset.type == "synthetic" and recipe.train.target_loss_gap is not None


def test_unknown_key_names_its_path_and_the_closest_key():
    msg = _error({"train": {"globl_batch_size": 8}})
    assert "unknown key 'train.globl_batch_size'" in msg and "did you mean 'train.global_batch_size'" in msg
    msg = _error({}, ["model.num_moe_expert=4"])
    assert "'model.num_moe_expert'" in msg and "'model.num_moe_experts'" in msg
    msg = _error({"optimiser": {"lr": 1.0}})
    assert "unknown key 'optimiser'" in msg and "did you mean 'optimizer'" in msg
    msg = _error({"train": {"zzzz": 1}})  # no close match: list the section's keys
    assert "unknown key 'train.zzzz'" in msg and "global_batch_size" in msg


def test_bad_types_are_rejected_with_the_path():
    assert "train.train_iters: expected int, got str 'many'" in _error({}, ["train.train_iters=many"])
    assert "train.deterministic: expected bool" in _error({}, ["train.deterministic=1"])
    assert "train.micro_batch_size: expected int, got float 2.5" in _error({}, ["train.micro_batch_size=2.5"])
    msg = _error({}, ["train.device=gpu"])
    assert "train.device: expected one of 'auto', 'cpu', 'cuda'" in msg
    assert "optimizer.betas[1]: expected float" in _error({"optimizer": {"betas": [0.9, "x"]}})
    assert "model: expected a mapping" in _error({"model": 3})
    assert "ep_moe.num_sms" in _error({}, ["ep_moe.num_sms=[8, x]"])


def test_values_are_converted_where_yaml_is_ambiguous():
    # PyYAML reads 3e-4 (no dot) as a string; a float field accepts it. Ints are accepted for floats.
    recipe = recipe_from_dict(apply_overrides({}, ["optimizer.lr=3e-4", "optimizer.eps=1", "logger.progress_bar=off"]))
    assert recipe.optimizer.lr == pytest.approx(3e-4) and isinstance(recipe.optimizer.eps, float)
    assert recipe.logger.progress_bar is False
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a=") == ("a", None)
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        parse_override("train.train_iters")
    with pytest.raises(RecipeError, match="not a section"):
        apply_overrides({"train": {"nproc": 2}}, ["train.nproc.x=1"])


def test_cross_field_rules():
    msg = _error({}, ["train.global_batch_size=10", "train.micro_batch_size=4", "train.nproc=2"])
    assert "train.global_batch_size: must be a multiple of train.micro_batch_size x ranks = 4 x 2 = 8" in msg
    assert "must divide model.num_moe_experts=8" in _error({}, ["model.expert_model_parallel_size=3", "train.nproc=3",
                                                               "train.global_batch_size=12"])
    assert "must divide the number of ranks (2)" in _error({}, ["model.expert_model_parallel_size=4"])
    assert "dataset.path: required" in _error({}, ["dataset.type=text"])
    assert "scheduler.min_lr" in _error({}, ["scheduler.min_lr=1.0"])
    assert "checkpoint.resume: needs checkpoint.save" in _error({}, ["checkpoint.resume=true"])
    assert "ep_moe.num_sms: must be even" in _error({}, ["ep_moe.num_sms=3"])
    assert "one 0/1 flag per layer (2)" in _error({}, ["model.moe_layer_freq=[1, 0, 1]"])
    assert "ep_moe.expert_alignment: the ep_moe engine's experts" in _error({}, ["ep_moe.expert_alignment=16"])
    assert "ep_moe.num_worst_tokens" in _error({}, ["ep_moe.num_worst_tokens=-1"])
    assert recipe_from_dict(apply_overrides({}, ["ep_moe.num_worst_tokens=64"])).ep_moe.num_worst_tokens == 64


def test_per_layer_num_sms_from_the_recipe_or_a_plan_file(tmp_path):
    base = {"model": {"num_layers": 4, "moe_layer_freq": 2}}  # MoE layers 0 and 2
    assert per_layer_num_sms(recipe_from_dict(apply_overrides(base, ["ep_moe.num_sms=8"]))) == [8, 8]
    assert per_layer_num_sms(recipe_from_dict(apply_overrides(base, ["ep_moe.num_sms=[8, 16]"]))) == [8, 16]
    flags = apply_overrides(base, ["model.moe_layer_freq=[0, 1, 1, 1]", "ep_moe.num_sms=[2, 4, 6]"])
    assert per_layer_num_sms(recipe_from_dict(flags)) == [2, 4, 6]
    with pytest.raises(RecipeError, match="one entry per MoE layer"):
        per_layer_num_sms(recipe_from_dict(apply_overrides(base, ["ep_moe.num_sms=[8, 16, 4]"])))
    plan = tmp_path / "plan.json"
    plan.write_text('{"num_sms": [12, 20]}')
    recipe = recipe_from_dict(apply_overrides(base, [f"ep_moe.tuning_plan={plan}"]))
    assert per_layer_num_sms(recipe) == [12, 20]
    plan.write_text('{"sms": 4}')
    with pytest.raises(RecipeError, match="exactly one key 'num_sms'"):
        per_layer_num_sms(recipe)


def test_schedule():
    kw = dict(lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110)
    assert lr_at(0, style="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(9, style="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(60, style="cosine", **kw) == pytest.approx(0.55)
    assert lr_at(110, style="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(500, style="linear", **kw) == pytest.approx(0.1)
    assert lr_at(60, style="linear", **kw) == pytest.approx(0.55)
    assert lr_at(60, style="constant", **kw) == 1.0
    assert all(math.isfinite(lr_at(s, style="cosine", **kw)) for s in range(200))


def test_cli_reports_recipe_errors_without_a_traceback(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"train": {"nproc": 1}}))
    assert main([str(recipe), "train.train_itres=5"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'train.train_itres'; did you mean 'train.train_iters'?" in err
    assert "Traceback" not in err
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main([str(recipe), "dataset.type=text", "dataset.path=/nonexistent.txt"]) == 2
    assert "dataset.path: no such file" in capsys.readouterr().err


def test_print_config_applies_overrides(capsys):
    assert main([os.path.join(RECIPES, "tiny-cpu.yaml"), "train.train_iters=7", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["train_iters"] == 7 and printed["engine"] == "ep_moe"


def test_other_engine_import_failure_names_the_engine_and_the_extra(tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("engine: megatron\nmodel: {anything: 1}\n")
    monkeypatch.setitem(sys.modules, "ep_moe.train.engines.megatron", None)  # import fails
    assert main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "engine: 'megatron'" in err and "pip install 'ep_moe[megatron]'" in err
    with pytest.raises(RecipeError, match="did you mean 'megatron'"):
        engine_of({"engine": "megatorn"})


def test_other_engine_gets_the_raw_recipe_with_overrides(tmp_path, monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("ep_moe.train.engines.deepspeed")

    def train(recipe: dict) -> int:
        seen["recipe"] = recipe
        return 0

    fake.train = train
    monkeypatch.setitem(sys.modules, "ep_moe.train.engines.deepspeed", fake)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("engine: deepspeed\nmodel: {custom_key: 1}\n")
    assert main([str(recipe), "model.custom_key=5", "zero.stage=2"]) == 0
    assert seen["recipe"] == {"engine": "deepspeed", "model": {"custom_key": 5}, "zero": {"stage": 2}}
