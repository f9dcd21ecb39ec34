"""``ep-moe train RECIPE.yaml [key=value ...]``: parse, check, then run the ranks.

Before any rank starts, the recipe (overrides applied) is parsed by its engine's schema
(`ep_moe.train.recipe_schema`) and checked against this job's world size and device, with what else can be known
there: the dispatcher backend can run, the checkpoint to load exists, the run folder can be written
(`ep_moe.train.rundir`). The run folder is then locked for this run, and a fresh run into a folder that holds an
earlier one is refused unless ``--resume`` or ``--overwrite`` says what to do with it.

Ranks start through `ep_moe.distributed.launch` for every engine: under ``torchrun`` this process is one rank
(the launcher's world size decides; ``--max-restarts`` > 0 resumes each attempt, `elastic_max_restarts`),
otherwise ``train.nproc`` ranks are spawned. ``engine: ep_moe`` runs `ep_moe.train.loop` on each rank;
``engine: megatron`` / ``engine: deepspeed`` run ``ep_moe.train.engines.<engine>_engine.train(recipe, device)``.
Ctrl-C finishes the step, saves a checkpoint and exits with status 130. A failing rank's error is printed once,
on one line with its ranks, its traceback in ``error.log`` (`ep_moe.train.failures`); a lost peer ends each
surviving rank with one line naming the peer and the stage (`ep_moe.train.failures.report_lost_peer`).

What a user sees, exit statuses included: docs/training.md, sections "Train an MoE model" and "When things go
wrong"; torchrun, SLURM, lost nodes and restarts: docs/multinode.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Any

import torch

from ep_moe.distributed import RankFailures, is_peer_lost, launch, torchrun_env

from .failures import failure_lines, report_lost_peer, report_rank_error, write_error_log
from .recipe_schema import AnyRecipe, Recipe, RecipeError, dump_yaml, load_recipe, validate
from .rundir import RunDirError, RunDirLock, check_outputs, clear_earlier_run, refuse_earlier_run, run_dir

EXTRAS = {"megatron": "megatron", "deepspeed": "deepspeed"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ep-moe train",
        description="Train an MoE model from a YAML recipe. Overrides are KEY=VALUE with dotted keys, "
                    "e.g. train.train_iters=50 model.expert_model_parallel_size=2 optimizer.lr=1e-3.",
        epilog="Built-in recipes (ep-moe recipes lists them): tiny-cpu (2 CPU ranks, ~1 minute), shakespeare-char, "
               "small-gpu-ep2 (torchrun --nproc-per-node 2 -m ep_moe.train small-gpu-ep2), megatron-gpt-moe-ep2, "
               "deepspeed-moe-ep2. "
               "A run writes into its run folder (checkpoint.save, else runs/<recipe name>), which it locks "
               "(ep-moe.lock) while it runs; errors in the ranks are one line each, with every traceback in "
               "<run folder>/error.log. Exit status: 0 done (a missed target too, unless "
               "train.fail_on_target_miss), 1 failed, 2 could not start, 130 stopped.")
    p.add_argument("recipe", help="a recipe YAML file, or a built-in recipe's name (e.g. tiny-cpu)")
    # default=[]: without it, argparse names KEY=VALUE as required too when nothing is given
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in checkpoint.save (same as checkpoint.resume=true; "
                        "every engine)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run folder that holds an earlier run: its metrics, loss plot, error log "
                        "and checkpoints are removed first (without this flag or --resume such a run is refused)")
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
    from .loop import result_dict
    from .rank_entry import train_rank

    return result_dict(train_rank(recipe, rank_device(device_type)))


def preflight_ep_moe(recipe: Recipe) -> None:
    """``engine: ep_moe`` only: the model config is valid and the SM counts resolve (fail in the launcher;
    the ranks pick the tuner's counts, which need the backend, with the same checks)."""
    from ep_moe.layers.model_config import ModelConfig

    from .parallel import layer_num_sms

    try:
        ModelConfig(**recipe.model.model_config_kwargs())
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"model: {exc}") from None
    try:
        layer_num_sms(recipe, None)
    except ValueError as exc:
        raise RecipeError(f"ep_moe: {exc}") from None


def preflight_backend(recipe: AnyRecipe, device_type: str) -> None:
    """``ep_moe.dispatcher_backend: native`` can run here: the native kernels can run and the ranks are on
    GPUs (checked where the recipe's model dispatches through ep_moe with more than one EP rank, or, for the
    other engines, through ep_moe at all). `RecipeError` naming the key and what to use instead."""
    if recipe.ep_moe.dispatcher_backend != "native":
        return
    m = recipe.model
    if recipe.engine == "ep_moe":
        used = m.expert_model_parallel_size > 1  # EP 1 builds no Buffer: every expert is local
    elif recipe.engine == "megatron":
        used = m.moe_token_dispatcher == "ep_moe"
    else:
        used = m.moe_layer == "ep_moe"
    if not used:
        return
    from ep_moe import native

    if not native.kernels_available():
        raise RecipeError("ep_moe.dispatcher_backend: 'native' needs the native kernels (compiled on first use, or "
                          "loaded from the cache that `ep-moe jit warmup` fills), which cannot run here "
                          f"({native.kernels_unavailable_reason()}); use "
                          "ep_moe.dispatcher_backend=auto (native where it can run, else torch) or torch")
    if device_type != "cuda":
        raise RecipeError(f"ep_moe.dispatcher_backend: 'native' runs on CUDA GPUs, this job runs on {device_type} "
                          "(use ep_moe.dispatcher_backend=torch or auto)")


def preflight_checkpoint(recipe: Recipe) -> None:
    """``engine: ep_moe``: the checkpoint the ranks would load (``checkpoint.load``, unless ``--resume`` finds
    one in ``checkpoint.save``) is there. `RecipeError` naming the key."""
    from .checkpoint import find_checkpoint_to_load

    try:
        find_checkpoint_to_load(recipe)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def run_ep_moe(recipe: Recipe, device_type: str) -> list[dict[str, Any]]:
    """Train on every rank of the job (SIGINT/SIGTERM forwarded to spawned ranks); every rank's result dict."""
    return launch(_ep_moe_rank, recipe.train.nproc, recipe, device_type, device_type=device_type,
                  timeout_s=recipe.train.timeout_s, forward_signals=True)


# ---------------------------------------------------------------------------------------------- other engines
def engine_module(engine: str):
    """``ep_moe.train.engines.<engine>_engine``; `RecipeError` naming the extra to install when it fails to import."""
    module_name = f"ep_moe.train.engines.{engine}_engine"
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise RecipeError(f"engine: '{engine}' needs {module_name} and its dependencies, which failed to import "
                          f"({exc}); install them with: pip install 'ep_moe[{EXTRAS[engine]}]'") from None


def elastic_max_restarts() -> int:
    """torchrun's ``--max-restarts`` for this job (``TORCHELASTIC_MAX_RESTARTS``; 0 outside torchrun). Above 0,
    ``ep-moe train`` resumes from the latest checkpoint in ``checkpoint.save`` by itself on every attempt (as
    ``--resume``): torchelastic's restart count cannot tell a first attempt from a restart after a node left or
    joined, so the first attempt resumes too (an earlier run in the folder is continued, not refused)."""
    try:
        return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    except ValueError:
        return 0


def _say(line: str) -> None:
    print(f"ep-moe train: {line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``ep-moe train``: 0 ok (a missed target too, unless train.fail_on_target_miss: then 1), 1 a rank failed,
    2 could not start (a bad recipe, or a run folder that is in use or holds an earlier run), 130 stopped (every
    engine)."""
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if args.resume and args.overwrite:
        _say("--resume continues the run in checkpoint.save, --overwrite starts it over: give one of them")
        return 2
    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    lock: RunDirLock | None = None
    recipe = None
    try:
        recipe = load_recipe(args.recipe, overrides)
        if args.print_config:
            print(dump_yaml(recipe), end="")
            return 0
        if elastic_max_restarts() > 0 and recipe.checkpoint.save is not None:
            # torchelastic may restart the group (--max-restarts), also when a node leaves or joins (then
            # TORCHELASTIC_RESTART_COUNT stays 0): every attempt continues from the latest checkpoint, if any
            if args.overwrite:
                raise RecipeError("--overwrite: under torchrun --max-restarts > 0 every attempt resumes from "
                                  "checkpoint.save, and a restart would clear it again; empty the folder first or "
                                  "choose another checkpoint.save")
            recipe.checkpoint.resume = True
        module = None if recipe.engine == "ep_moe" else engine_module(recipe.engine)
        device = prepare(recipe)
        preflight_backend(recipe, device)
        if module is None:
            preflight_ep_moe(recipe)
            preflight_checkpoint(recipe)
        env = torchrun_env()
        if env is None or env.rank == 0:  # the process that writes: the launcher, or torchrun's rank 0
            check_outputs(recipe)
            lock = RunDirLock(run_dir(recipe)).acquire()
            if lock.note:
                _say(lock.note)
            if args.overwrite:
                clear_earlier_run(recipe)
            elif not recipe.checkpoint.resume:
                refuse_earlier_run(recipe)
        if module is not None:
            return int(module.train(recipe, device))
        return max(r["exit_code"] for r in run_ep_moe(recipe, device))
    except (RecipeError, RunDirError) as exc:
        _say(str(exc))
        return 2
    except RankFailures as exc:  # spawned ranks failed: one line per distinct error, the tracebacks in a file
        log = write_error_log(run_dir(recipe), exc)
        for line in failure_lines(exc, log):
            _say(line)
        return 1
    except Exception as exc:
        env = torchrun_env()
        if env is not None and recipe is not None:  # this rank's own error: one line, the traceback in the log
            if is_peer_lost(str(exc)):  # a node (or rank) gone: every surviving rank says which and where
                _say(report_lost_peer(run_dir(recipe), env.rank, exc))
                return 1
            line = report_rank_error(run_dir(recipe), env.rank, exc)
            if line is not None:
                _say(line)
            return 1
        if not isinstance(exc, RuntimeError):
            raise
        _say(str(exc))
        return 1
    finally:
        if lock is not None:
            lock.release()
