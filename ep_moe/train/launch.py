"""``ep-moe train RECIPE.yaml [key=value ...]``: parse, check, then run the ranks.

The recipe (overrides applied) is parsed by its engine's schema (`ep_moe.train.config`) and checked against
this job's world size and device before any rank starts. Ranks start through `ep_moe.distributed.launch`,
for every engine:

* under ``torchrun``: this process is one rank; NCCL on ``cuda:LOCAL_RANK`` (gloo when the device is the
  CPU);
* otherwise ``train.nproc`` ranks are spawned (gloo on the CPU, NCCL on ``cuda:<rank>`` when the device is
  CUDA).

``engine: ep_moe`` runs `ep_moe.train.loop` on each rank: Ctrl-C reaches every rank (and is forwarded to
them), each finishes its step, a checkpoint is saved, and the command exits with status 130.
``engine: megatron`` / ``engine: deepspeed``: ``ep_moe.train.engines.<engine>.train(recipe, device)`` runs it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Any

import torch

from ep_moe.distributed import launch, torchrun_env

from .config import AnyRecipe, Recipe, RecipeError, dump_yaml, load_recipe, validate

EXTRAS = {"megatron": "megatron", "deepspeed": "deepspeed"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ep-moe train",
        description="Train an MoE model from a YAML recipe. Overrides are KEY=VALUE with dotted keys, "
                    "e.g. train.train_iters=50 model.expert_model_parallel_size=2 optimizer.lr=1e-3.",
        epilog="Built-in recipes (ep-moe recipes lists them): tiny-cpu (2 CPU ranks, ~1 minute), shakespeare-char, "
               "small-gpu-ep2 (torchrun --nproc-per-node 2 -m ep_moe.train small-gpu-ep2), megatron-gpt-moe-ep2, "
               "deepspeed-moe-ep2.")
    p.add_argument("recipe", help="a recipe YAML file, or a built-in recipe's name (e.g. tiny-cpu)")
    # default=[]: without it, argparse names KEY=VALUE as required too when nothing is given
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in checkpoint.save (same as checkpoint.resume=true; "
                        "every engine)")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    return p


# ---------------------------------------------------------------------------------------------- device
def resolve_device(requested: str, nproc: int, under_torchrun: bool) -> str:
    """``auto``: CUDA when there are GPUs enough for the ranks (one per rank), else the CPU."""
    if requested == "cpu":
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda":
        if gpus == 0:
            raise RecipeError("train.device: 'cuda' but torch sees no GPU (use train.device=cpu)")
        if not under_torchrun and gpus < nproc:
            raise RecipeError(f"train.nproc: {nproc} ranks need {nproc} GPUs, torch sees {gpus}")
        return "cuda"
    return "cuda" if gpus >= 1 and (under_torchrun or gpus >= nproc) else "cpu"


def prepare(recipe: AnyRecipe) -> str:
    """The device type of this job (``cpu``/``cuda``), after checking the recipe against the job's world
    size (torchrun's, else ``train.nproc``) and that device: every engine's rules, and the dataset opens.
    Raises `RecipeError` naming the key."""
    from .data import build_dataset

    env = torchrun_env()
    world = env.world_size if env is not None else recipe.train.nproc
    device = resolve_device(recipe.train.device, world, env is not None)
    validate(recipe, world, device)
    try:
        build_dataset(recipe)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    return device


def rank_device(device_type: str) -> torch.device:
    """This rank's device inside a `launch`-ed job: the GPU its group was joined on, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def require_package(engine: str, package: str, install: str) -> None:
    """`RecipeError` naming the engine and how to install ``package`` when it cannot be imported."""
    try:
        found = importlib.util.find_spec(package) is not None
    except ImportError:  # a missing parent package
        found = False
    if not found:
        raise RecipeError(f"engine: '{engine}' needs {package}, which is not installed; install it with: {install}")


# ---------------------------------------------------------------------------------------------- engine ep_moe
def _ep_moe_rank(rank: int, world_size: int, recipe: Recipe, device_type: str) -> dict[str, Any]:
    """One rank of ``engine: ep_moe`` (module level so that spawn can import it)."""
    from .loop import result_dict, train_rank

    return result_dict(train_rank(recipe, rank_device(device_type)))


def preflight_ep_moe(recipe: Recipe) -> None:
    """``engine: ep_moe`` only: the model config is valid and the SM counts resolve (fail in the launcher;
    the ranks pick the tuner's counts, which need the backend, with the same checks)."""
    from ep_moe.layers.model import ModelConfig

    from .parallel import layer_num_sms

    try:
        ModelConfig(**recipe.model.model_config_kwargs())
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"model: {exc}") from None
    try:
        layer_num_sms(recipe, None)
    except ValueError as exc:
        raise RecipeError(f"ep_moe: {exc}") from None


def run_ep_moe(recipe: Recipe, device_type: str) -> list[dict[str, Any]]:
    """Train on every rank of the job (SIGINT/SIGTERM forwarded to spawned ranks); every rank's result dict."""
    return launch(_ep_moe_rank, recipe.train.nproc, recipe, device_type, device_type=device_type,
                  timeout_s=recipe.train.timeout_s, forward_signals=True)


# ---------------------------------------------------------------------------------------------- other engines
def engine_module(engine: str):
    """``ep_moe.train.engines.<engine>``; `RecipeError` naming the extra to install when it fails to import."""
    module_name = f"ep_moe.train.engines.{engine}"
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise RecipeError(f"engine: '{engine}' needs {module_name} and its dependencies, which failed to import "
                          f"({exc}); install them with: pip install 'ep_moe[{EXTRAS[engine]}]'") from None


def main(argv: list[str] | None = None) -> int:
    """``ep-moe train``: 0 ok, 1 a rank failed (or missed its target with train.fail_on_target_miss), 2 bad
    recipe, 130 stopped (every engine)."""
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    try:
        recipe = load_recipe(args.recipe, overrides)
        if args.print_config:
            print(dump_yaml(recipe), end="")
            return 0
        module = None if recipe.engine == "ep_moe" else engine_module(recipe.engine)
        device = prepare(recipe)
        if module is not None:
            return int(module.train(recipe, device))
        preflight_ep_moe(recipe)
        return max(r["exit_code"] for r in run_ep_moe(recipe, device))
    except RecipeError as exc:
        print(f"ep-moe train: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # spawned ranks failed: their tracebacks are in the message
        if torchrun_env() is not None:
            raise  # this rank's own error, with its traceback
        print(f"ep-moe train: {exc}", file=sys.stderr)
        return 1
