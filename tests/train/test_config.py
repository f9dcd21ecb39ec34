"""The recipe schema of every engine (ep_moe, megatron, deepspeed), overrides and error messages of
``ep-moe train`` (no processes spawned; neither Megatron nor DeepSpeed is needed)."""

from __future__ import annotations

import math
import os
import sys

import locations
import pytest
import yaml

from ep_moe.config import DEFAULT_NUM_SMS
from ep_moe.train import main
from ep_moe.train.parallel import layer_num_sms
from ep_moe.train.recipe_schema import (
    DeepSpeedModelSection,
    DeepSpeedRecipe,
    MegatronRecipe,
    Recipe,
    RecipeError,
    TrainSection,
    apply_overrides,
    engine_of,
    load_recipe,
    parse_override,
    recipe_from_dict,
    validate,
)
from ep_moe.train.schedule import lr_at

ROOT = str(locations.REPO)
RECIPES = os.path.join(ROOT, "recipes")
SHIPPED = {"tiny-cpu.yaml": Recipe, "shakespeare-char.yaml": Recipe, "small-gpu-ep2.yaml": Recipe,
           "megatron-gpt-moe-ep2.yaml": MegatronRecipe, "deepspeed-moe-ep2.yaml": DeepSpeedRecipe}


def _error(data: dict, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(apply_overrides(data, overrides or []))
    return str(info.value)


def _shipped(name: str) -> dict:
    with open(os.path.join(RECIPES, name), encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_recipes_load_and_have_a_comment_header(name):
    path = os.path.join(RECIPES, name)
    recipe = load_recipe(path)
    assert type(recipe) is SHIPPED[name] and recipe.name == name[:-5]
    assert recipe.engine == _shipped(name).get("engine", "ep_moe")
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


def test_layer_num_sms_from_the_recipe_or_a_plan_file(tmp_path):
    """The trainer's SM counts come from the tuner's one parser (`PlanCache.from_recipe`); without a backend
    that takes SMs, a layer left at 0 gets the default."""
    base = {"model": {"num_layers": 4, "moe_layer_freq": 2}}  # MoE layers 0 and 2
    assert layer_num_sms(recipe_from_dict(apply_overrides(base, ["ep_moe.num_sms=8"])), None) == [8, 8]
    assert layer_num_sms(recipe_from_dict(apply_overrides(base, ["ep_moe.num_sms=[8, 16]"])), None) == [8, 16]
    assert layer_num_sms(recipe_from_dict(apply_overrides(base, ["ep_moe.num_sms=[8, 0]"])), None) == [8, DEFAULT_NUM_SMS]
    flags = apply_overrides(base, ["model.moe_layer_freq=[0, 1, 1, 1]", "ep_moe.num_sms=[2, 4, 6]"])
    assert layer_num_sms(recipe_from_dict(flags), None) == [2, 4, 6]
    with pytest.raises(ValueError, match=r"one entry per MoE layer \(2\), got 3"):
        layer_num_sms(recipe_from_dict(apply_overrides(base, ["ep_moe.num_sms=[8, 16, 4]"])), None)
    plan = tmp_path / "plan.json"
    plan.write_text('{"num_sms": [12, 20]}')
    recipe = recipe_from_dict(apply_overrides(base, [f"ep_moe.tuning_plan={plan}"]))
    assert layer_num_sms(recipe, None) == [12, 20]
    plan.write_text('{"sms": 4}')
    with pytest.raises(ValueError, match="'num_sms: N | \\[one per MoE layer\\]'"):
        layer_num_sms(recipe, None)
    knee = recipe_from_dict(apply_overrides(base, ["ep_moe.knee_cap=0.5"]))  # the tuner's policy is checked too
    with pytest.raises(ValueError, match="knee_cap"):
        layer_num_sms(knee, None)


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
    recipe.write_text("engine: megatron\ntrain: {device: cpu}\n")
    monkeypatch.setitem(sys.modules, "ep_moe.train.engines.megatron_engine", None)  # import fails
    assert main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "engine: 'megatron'" in err and "pip install 'ep_moe[megatron]'" in err
    with pytest.raises(RecipeError, match="did you mean 'megatron'"):
        engine_of({"engine": "megatorn"})


def test_other_engine_gets_the_parsed_recipe_with_overrides(tmp_path, monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("ep_moe.train.engines.deepspeed_engine")

    def train(recipe, device_type: str) -> int:
        seen["recipe"], seen["device"] = recipe, device_type
        return 0

    fake.train = train
    monkeypatch.setitem(sys.modules, "ep_moe.train.engines.deepspeed_engine", fake)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("engine: deepspeed\nmodel: {moe_min_capacity: 1}\ntrain: {device: cpu}\n")
    assert main([str(recipe), "model.moe_min_capacity=5", "deepspeed.zero_stage=1"]) == 0
    parsed = seen["recipe"]
    assert isinstance(parsed, DeepSpeedRecipe) and seen["device"] == "cpu" and parsed.name == "r"
    assert (parsed.model.moe_min_capacity, parsed.deepspeed.zero_stage) == (5, 1)


# ---------------------------------------------------------------------------------------------- every engine
# A minimal valid recipe of each engine, and a key of its own model section.
ENGINE_BASES = {"ep_moe": ({}, "ffn_hidden_size"), "megatron": ({"engine": "megatron"}, "moe_token_dispatcher"),
                "deepspeed": ({"engine": "deepspeed"}, "moe_layer")}


@pytest.mark.parametrize("engine", ENGINE_BASES)
def test_shared_rules_hold_for_every_engine(engine):
    base, own_key = ENGINE_BASES[engine]
    assert recipe_from_dict(base).engine == engine
    msg = _error(base, ["train.globl_batch_size=8"])
    assert "unknown key 'train.globl_batch_size'; did you mean 'train.global_batch_size'?" in msg
    msg = _error(base, [f"model.{own_key[:-1]}=1"])
    assert f"unknown key 'model.{own_key[:-1]}'; did you mean 'model.{own_key}'?" in msg
    assert "unknown key 'trian'; did you mean 'train'?" in _error({**base, "trian": {}})
    assert "model.hidden_size: expected int, got str '32'" in _error(base, ["model.hidden_size='32'"])
    assert "train.precision: expected one of 'fp32', 'bf16'" in _error(base, ["train.precision=fp16"])
    assert "optimizer.betas[1]: expected float" in _error({**base, "optimizer": {"betas": [0.9, "x"]}})
    assert "model.num_moe_experts: must be >= 1, got 0" in _error(base, ["model.num_moe_experts=0"])
    assert "model.moe_router_topk: must be <= model.num_moe_experts=4" in _error(
        base, ["model.num_moe_experts=4", "model.moe_router_topk=5"])
    assert "model.expert_model_parallel_size: must divide model.num_moe_experts=6, got 4" in _error(
        base, ["model.num_moe_experts=6", "model.expert_model_parallel_size=4", "train.nproc=4"])
    assert "train.global_batch_size: must be a multiple of train.micro_batch_size x ranks = 4 x 2 = 8" in _error(
        base, ["train.global_batch_size=10", "train.micro_batch_size=4", "train.nproc=2"])
    assert "scheduler.min_lr" in _error(base, ["scheduler.min_lr=1.0"])
    assert "dataset.path: required" in _error(base, ["dataset.type=text"])
    assert "ep_moe.dispatcher_backend: expected one of 'auto', 'torch', 'native'" in _error(
        base, ["ep_moe.dispatcher_backend=nvlink"])


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
@pytest.mark.parametrize("override", ["ep_moe.num_worst_tokens=64", "ep_moe.tuning_plan=plan.yaml",
                                      "ep_moe.expert_alignment=16"])
def test_a_key_the_engine_does_not_use_is_rejected_unless_left_at_its_default(engine, override):
    key, value = override.split("=")
    msg = _error(ENGINE_BASES[engine][0], [override])
    assert msg.startswith(f"{key}: engine {engine} does not support it") and f"got {value}" in msg.replace('"', "")


@pytest.mark.parametrize("engine", ENGINE_BASES)
def test_every_engine_takes_the_trainers_checkpoint_and_logging_keys(engine):
    """--resume (checkpoint.resume), checkpoint.load / save_interval / keep_last, the plot, the progress bar,
    TensorBoard and the target options are the same for all three engines."""
    recipe = recipe_from_dict(apply_overrides(ENGINE_BASES[engine][0], [
        "checkpoint.save=out", "checkpoint.resume=true", "checkpoint.load=elsewhere", "checkpoint.save_interval=5",
        "checkpoint.keep_last=0", "logger.plot_path=x.png", "logger.progress_bar=false",
        "logger.tensorboard_dir=tb", "train.target_loss_gap=0.1", "train.fail_on_target_miss=true",
        "train.eval_interval=5"]))
    assert recipe.checkpoint.resume and recipe.logger.tensorboard_dir == "tb" and recipe.train.fail_on_target_miss
    assert TrainSection().fail_on_target_miss is False  # a missed target is reported, not a failure, by default
    assert "checkpoint.resume: needs checkpoint.save" in _error(ENGINE_BASES[engine][0], ["checkpoint.resume=true"])


def test_tensorboard_dir_without_tensorboard_is_a_recipe_error_at_launch(monkeypatch):
    from ep_moe.train import recipe_schema as config

    recipe = recipe_from_dict(apply_overrides({}, ["logger.tensorboard_dir=tb"]))  # parsing does not need it
    monkeypatch.setattr(config, "_importable", lambda package: package != "tensorboard")
    with pytest.raises(RecipeError, match=r"logger.tensorboard_dir: needs the tensorboard package, which is not "
                                          r"installed; install it with: pip install tensorboard"):
        validate(recipe, 2, "cpu")


def test_the_ep_moe_engine_uses_every_shared_key():
    recipe = recipe_from_dict(apply_overrides({}, ["checkpoint.save=out", "checkpoint.resume=true",
                                                   "checkpoint.keep_last=0", "train.eval_interval=5",
                                                   "train.deterministic=true", "logger.progress_bar=false"]))
    assert recipe.checkpoint.keep_last == 0 and recipe.train.deterministic is True


def test_print_config_works_for_every_engine(capsys):
    for name, cls in SHIPPED.items():
        assert main([os.path.join(RECIPES, name), "train.train_iters=7", "--print-config"]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["train"]["train_iters"] == 7 and printed["engine"] == cls.__dataclass_fields__[
            "engine"].default
        assert recipe_from_dict(printed).to_dict() == printed  # the printed recipe is a complete recipe


# ---------------------------------------------------------------------------------------------- megatron
def test_megatron_recipe_file_and_errors():
    recipe = load_recipe(os.path.join(RECIPES, "megatron-gpt-moe-ep2.yaml"))
    assert recipe.model.moe_token_dispatcher == "ep_moe" and recipe.model.expert_model_parallel_size == 2
    megatron = {"engine": "megatron"}
    assert "model.moe_router_topk" in _error({**megatron, "model": {"moe_router_topk": 9}})
    assert "unknown key 'model.moe_dispatcher'" in _error({**megatron, "model": {"moe_dispatcher": "ep_moe"}})
    assert "model.moe_token_dispatcher: expected one of 'ep_moe', 'alltoall', 'flex_deepep'" in _error(
        {**megatron, "model": {"moe_token_dispatcher": "allgather"}})
    assert "unknown key 'deepspeed'" in _error({**megatron, "deepspeed": {"zero_stage": 2}})
    assert "ep_moe.num_sms: engine megatron takes one SM count for all layers" in _error(
        megatron, ["ep_moe.num_sms=[8, 8]"])
    assert recipe_from_dict(apply_overrides(megatron, ["ep_moe.num_sms=8"])).ep_moe.num_sms == 8


def test_megatron_device_rules():
    recipe = recipe_from_dict(apply_overrides({"engine": "megatron"}, ["model.moe_token_dispatcher=alltoall"]))
    validate(recipe, 2, "cuda")
    with pytest.raises(RecipeError, match="model.moe_token_dispatcher: Megatron's alltoall dispatcher needs CUDA"):
        validate(recipe, 2, "cpu")
    recipe = recipe_from_dict(apply_overrides({"engine": "megatron"}, ["model.position_embedding_type=rope"]))
    with pytest.raises(RecipeError, match="model.position_embedding_type: Megatron's rope needs CUDA"):
        validate(recipe, 2, "cpu")


# ---------------------------------------------------------------------------------------------- deepspeed
def test_deepspeed_recipe_file_and_defaults():
    recipe = load_recipe(os.path.join(RECIPES, "deepspeed-moe-ep2.yaml"))
    assert recipe.model.moe_layer == "ep_moe" and recipe.model.moe_drop_tokens is False
    assert recipe.deepspeed.zero_stage == 2 and recipe.deepspeed.config == {}
    validate(recipe, recipe.train.nproc)
    bare = recipe_from_dict({"engine": "deepspeed"})
    assert bare.model == DeepSpeedModelSection() and bare.train == TrainSection()


@pytest.mark.parametrize("patch, message", [
    ({"model": {"moe_layer": "deepspeedd"}}, "model.moe_layer: expected one of 'ep_moe', 'deepspeed'"),
    ({"model": {"moe_drop_tokens": 1}}, "model.moe_drop_tokens: expected bool (true/false), got int 1"),
    ({"model": {"moe_noisy_gate_policy": "jitter"}},
     "model.moe_noisy_gate_policy: expected one of 'None', 'Jitter', 'RSample' or null"),
    ({"model": {"moe_capacity_factor": 0}}, "model.moe_capacity_factor: must be > 0"),
    ({"deepspeed": {"zero_stage": 3}}, "deepspeed.zero_stage: expected one of 0, 1, 2"),
    ({"deepspeed": {"config": [1]}}, "deepspeed.config: expected a mapping"),
    ({"train": {"deterministic": True}}, "train.deterministic: engine deepspeed does not support it"),
    ({"ep_moe": {"num_sms": 8}}, "ep_moe.num_sms: engine deepspeed does not support it"),
])
def test_deepspeed_recipe_errors_name_the_key(patch, message):
    data = _shipped("deepspeed-moe-ep2.yaml")
    for section, value in patch.items():
        data[section] = {**data.get(section, {}), **value}
    assert message in _error(data)


def test_world_size_rules_use_the_job_world():
    recipe = load_recipe(os.path.join(RECIPES, "deepspeed-moe-ep2.yaml"))  # EP 2, 16 = 8 x 2
    with pytest.raises(RecipeError, match=r"model.expert_model_parallel_size: must divide the number of ranks \(3\)"):
        validate(recipe, 3)
    with pytest.raises(RecipeError, match=r"train.global_batch_size: must be a multiple of .* = 32, got 16"):
        validate(recipe, 4)


def test_cli_rejects_a_bad_recipe_of_another_engine_before_importing_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ep_moe.train.engines.deepspeed_engine", None)  # never imported
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"engine": "deepspeed", "model": {"num_moe_experts": 0}}))
    assert main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "model.num_moe_experts: must be >= 1" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- the command
def test_train_without_arguments_names_only_the_recipe(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "ep-moe train: error: the following arguments are required: recipe"


def test_recipes_command_lists_the_builtin_recipes(capsys):
    from ep_moe.cli import main as ep_moe_main

    assert ep_moe_main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line.split()[1] for line in lines[:-1]}
    assert listed == {name[:-5]: cls.__dataclass_fields__["engine"].default for name, cls in SHIPPED.items()}
    assert all(len(line) <= 130 for line in lines[:-1])
    assert "ep-moe train NAME" in lines[-1]


def test_version(capsys):
    import ep_moe
    from ep_moe.cli import main as ep_moe_main

    assert ep_moe_main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"ep-moe {ep_moe.__version__}")


def test_a_builtin_recipe_by_name_from_another_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["tiny-cpu", "train.train_iters=7", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["train_iters"] == 7 and printed["model"]["num_moe_experts"] == 8
    assert load_recipe("tiny-cpu.yaml").name == "tiny-cpu"
    assert main(["tiny-cpuu"]) == 2
    assert "nor a built-in recipe's name" in capsys.readouterr().err


def test_progress_lines_on_a_terminal_of_size_0x0(monkeypatch, capsys):
    """A terminal that reports 0 columns would get an empty tqdm bar: plain lines are printed instead."""
    from ep_moe.train import metrics

    class Terminal:
        def isatty(self):
            return True

        def write(self, text):
            return len(text)

        def flush(self):
            pass

    monkeypatch.setattr(metrics.sys, "stderr", Terminal())
    monkeypatch.setattr(metrics, "_terminal_columns", lambda: 0)
    progress = metrics.Progress("auto", 10, 0, enabled=True)
    assert not progress.use_bar
    progress.update(1, 2.0, 0.01, 1000.0, 1.5)
    progress.close()
    assert capsys.readouterr().out == "step 1/10  loss 2.0000  aux 0.0100  tokens/s 1,000  load imbalance 1.50\n"
    monkeypatch.setattr(metrics, "_terminal_columns", lambda: 80)
    assert metrics.Progress("auto", 10, 0, enabled=True).use_bar


def test_target_and_exit_status():
    from ep_moe.train.metrics import target_missed

    assert not target_missed(2.0, 1.05, 1.0, 0.1) and target_missed(2.0, 1.2, 1.0, 0.1)
    assert target_missed(1.2, None, 1.0, 0.1) and not target_missed(1.05, None, 1.0, 0.1)  # no eval: train loss
    assert not target_missed(9.0, 9.0, None, 0.1) and not target_missed(9.0, 9.0, 1.0, None)  # nothing to miss
