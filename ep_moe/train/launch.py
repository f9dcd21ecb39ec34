"""``ep-moe train RECIPE.yaml [key=value ...]``: parse, check, then run the ranks.

* Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set): this process is one rank; NCCL on
  ``cuda:LOCAL_RANK`` (gloo when the device is the CPU).
* Otherwise: spawn ``train.nproc`` ranks (gloo on the CPU, NCCL on ``cuda:<rank>`` when the device is CUDA)
  with `ep_moe.distributed.run_distributed`. Ctrl-C reaches every rank (and is forwarded to them), each
  finishes its step, a checkpoint is saved, and the command exits with status 130.
* ``engine: megatron`` / ``engine: deepspeed``: the overrides are applied to the raw recipe and
  ``ep_moe.train.engines.<engine>.train(recipe)`` runs it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import multiprocessing
import os
import signal
import sys
from typing import Any

import torch

from .config import RecipeError, apply_overrides, engine_of, read_yaml, recipe_from_dict

EXTRAS = {"megatron": "megatron", "deepspeed": "deepspeed"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ep-moe train",
        description="Train an MoE model from a YAML recipe. Overrides are KEY=VALUE with dotted keys, "
                    "e.g. train.train_iters=50 model.expert_model_parallel_size=2 optimizer.lr=1e-3.",
        epilog="Recipes: recipes/tiny-cpu.yaml (2 CPU ranks, ~1 minute), recipes/shakespeare-char.yaml, "
               "recipes/small-gpu-ep2.yaml (torchrun --nproc-per-node 2 -m ep_moe.train ...).")
    p.add_argument("recipe", help="the recipe YAML file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in checkpoint.save (same as checkpoint.resume=true)")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    return p


def _torchrun_env() -> tuple[int, int, int] | None:
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    return None


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


def _spawned_rank(rank: int, world_size: int, recipe_data: dict, source_dir: str, name: str, device: str
                  ) -> dict[str, Any]:
    """One spawned rank (module level so that spawn can import it)."""
    from .loop import result_dict, train_rank

    recipe = recipe_from_dict(recipe_data, source_dir, name)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return result_dict(train_rank(recipe, dev))


def _forward_signals() -> dict:
    """In the launcher: pass SIGINT/SIGTERM on to the spawned ranks (they stop cleanly), don't die."""
    previous = {}

    def forward(signum, frame):
        for child in multiprocessing.active_children():
            try:
                os.kill(child.pid, signum)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, forward)
    return previous


def run_spawned(recipe, device: str) -> list[dict[str, Any]]:
    """Spawn ``train.nproc`` ranks and train; returns every rank's result dict."""
    from ep_moe.distributed import run_distributed

    backend = "nccl" if device == "cuda" else "gloo"
    previous = _forward_signals()
    try:
        return run_distributed(_spawned_rank, recipe.train.nproc, recipe.to_dict(), recipe.source_dir, recipe.name,
                               device, backend=backend, timeout_s=recipe.train.timeout_s,
                               join_timeout_s=7 * 24 * 3600.0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_torchrun(recipe, device: str, env: tuple[int, int, int]) -> dict[str, Any]:
    """This process is rank ``RANK`` of a torchrun job."""
    import torch.distributed as dist

    from .loop import result_dict, train_rank

    rank, world, local_rank = env
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev,
                                timeout=datetime.timedelta(seconds=recipe.train.timeout_s))
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=recipe.train.timeout_s))
    try:
        return result_dict(train_rank(recipe, dev))
    finally:
        dist.destroy_process_group()


def run_engine(engine: str, data: dict) -> int:
    """Hand the raw recipe (overrides applied) to ``ep_moe.train.engines.<engine>.train``."""
    module_name = f"ep_moe.train.engines.{engine}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RecipeError(f"engine: '{engine}' needs {module_name} and its dependencies, which failed to import "
                          f"({exc}); install them with: pip install 'ep_moe[{EXTRAS[engine]}]'") from None
    return int(module.train(data) or 0)


def preflight(recipe, world_size: int) -> None:
    """Fail fast in the launcher with a clear message: the dataset opens, the model config is valid."""
    from ep_moe.layers.model import ModelConfig

    from .config import per_layer_num_sms, validate
    from .data import build_dataset

    validate(recipe, world_size)
    try:
        ModelConfig(**recipe.model.model_config_kwargs())
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"model: {exc}") from None
    per_layer_num_sms(recipe)
    try:
        build_dataset(recipe)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        raw = read_yaml(args.recipe)
        overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
        data = apply_overrides(raw, overrides)
        engine = engine_of(data)
        if engine != "ep_moe":
            if args.print_config:  # another engine's schema: print the raw recipe with the overrides
                import yaml

                print(yaml.safe_dump(data, sort_keys=False), end="")
                return 0
            return run_engine(engine, data)
        recipe = recipe_from_dict(data, os.path.dirname(os.path.abspath(args.recipe)),
                                  os.path.splitext(os.path.basename(args.recipe))[0])
        if args.print_config:
            from .config import dump_yaml

            print(dump_yaml(recipe), end="")
            return 0
        env = _torchrun_env()
        world = env[1] if env else recipe.train.nproc
        device = resolve_device(recipe.train.device, world, env is not None)
        preflight(recipe, world)
    except RecipeError as exc:
        print(f"ep-moe train: {exc}", file=sys.stderr)
        return 2
    if env is not None:
        result = run_torchrun(recipe, device, env)
        return result["exit_code"]
    try:
        results = run_spawned(recipe, device)
    except RuntimeError as exc:
        print(f"ep-moe train: {exc}", file=sys.stderr)
        return 1
    return max(r["exit_code"] for r in results)
