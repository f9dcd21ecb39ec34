"""The trainer's two-stage pipeline (``train.pp_size: 2``, `ep_moe.train.pipeline`, activations and gradients
through an ElasticBuffer's ``pp_send`` / ``pp_recv``) converges like ``pp_size: 1``, and ZeRO-1
(``train.zero_stage: 1``, `ep_moe.train.zero`: gradients reduce-scattered, parameters all-gathered through an
ElasticBuffer's AGRS sessions, the optimizer state sharded) gives the default's losses, on CPU.

Tolerances, and why:

* ``pp_size: 2`` on 2 ranks (one pipeline) against ``pp_size: 1`` on 1 rank (the same micro-batches, the same
  initialisation): the forward is the same arithmetic split in two, but the tied embedding's gradient is the sum
  of the two stages' parts (the lookup's and the output layer's) added in another order than autograd's, and the
  gradient norm is summed in two parts; these fp32 roundings (~1e-7 relative) pass through Adam. With routing
  forced to a fixed balanced assignment (no top-k decisions to flip), the per-step losses stay within
  ``1e-5`` absolute over 30 steps at losses of 2.4-3.4 (measured 2026-12-01: at most 9e-7, the first steps
  equal), and the loss falls by more than 0.5.
* ZeRO-1 against the default with ``train.deterministic`` (2 ranks; EP 1: both buckets sharded; EP 2: the
  non-expert bucket sharded, the experts' group of one rank not): bit for bit. Both sum the ranks' fp32
  gradients in rank order, compute the clip norm from the same per-parameter squared sums in the same order, and
  AdamW's update is elementwise.
"""

from __future__ import annotations

import os

import locations
import pytest
import torch
from support.world_sizes import continue_alone

from ep_moe.distributed import run_distributed

TINY = str(locations.RECIPES / "tiny-cpu.yaml")
STEPS = 30
DP_PER_STAGE_STEPS = 5  # the 4-rank pipeline (2 data-parallel ranks per stage) against 2 ranks without one
EPS = (1, 2)
BASE = ["model.vocab_size=32", "model.seq_length=32", "model.num_layers=4",
        "model.moe_router_load_balancing_type=seq_aux_loss", "model.moe_aux_loss_coeff=0.01",
        "model.moe_router_force_load_balancing=true", "model.expert_model_parallel_size=1",
        "train.global_batch_size=16", "train.micro_batch_size=4", f"train.train_iters={STEPS}", "train.eval_iters=1",
        "train.deterministic=true", "optimizer.lr=1e-2", "scheduler.lr_warmup_iters=5", "logger.progress_bar=false",
        "checkpoint.save=null"]


def _recipe(tmp: str, name: str, world: int, extra: list[str]):
    from ep_moe.train.recipe_schema import load_recipe, validate

    recipe = load_recipe(TINY, BASE + [f"train.nproc={world}", f"logger.metrics_path={tmp}/{name}.jsonl"] + extra)
    validate(recipe, world, "cpu")
    return recipe


def _converge(rank: int, world: int, tmp: str) -> dict:
    from ep_moe.train.rank_entry import train_rank

    cpu = torch.device("cpu")
    pp = train_rank(_recipe(tmp, "pp2", world, ["train.pp_size=2"]), cpu)
    default = train_rank(_recipe(tmp, "dp", world, []), cpu)
    zero = train_rank(_recipe(tmp, "zero", world, ["train.zero_stage=1"]), cpu)
    ep2 = ["model.expert_model_parallel_size=2", "ep_moe.dispatcher_backend=torch"]
    default_ep2 = train_rank(_recipe(tmp, "dp_ep2", world, ep2), cpu)
    zero_ep2 = train_rank(_recipe(tmp, "zero_ep2", world, ep2 + ["train.zero_stage=1"]), cpu)
    return {"pp2": pp.losses, "pp2_eval": pp.eval_loss, "dp": default.losses, "zero": zero.losses,
            "dp_ep2": default_ep2.losses, "zero_ep2": zero_ep2.losses}


def _two_ranks(rank: int, world: int, tmp: str) -> dict:
    """Every 2-rank run of this file, in one spawned group (a spawn costs more than most of these runs): the
    convergence runs, the checkpoint runs (in ``tmp/checkpoints``), and the 2-rank references of the
    data-parallel-per-stage test (EP 1 and 2); then rank 0 alone, in a world of one rank, the one-stage
    reference of the convergence runs."""
    out = {"converge": _converge(rank, world, tmp)}
    os.makedirs(os.path.join(tmp, "checkpoints"), exist_ok=True)
    out["checkpoints"] = _checkpoints(rank, world, os.path.join(tmp, "checkpoints"))
    out["dp_per_stage"] = {ep: _pipeline_with_data_parallel(rank, world, tmp, DP_PER_STAGE_STEPS, ep) for ep in EPS}
    if continue_alone(rank):
        out["one_rank"] = _one_rank(0, 1, tmp)
    return out


def _one_rank(rank: int, world: int, tmp: str) -> dict:
    from ep_moe.train.rank_entry import train_rank

    result = train_rank(_recipe(tmp, "pp1", 1, []), torch.device("cpu"))
    return {"pp1": result.losses, "pp1_eval": result.eval_loss}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str, list[dict]]:
    """The folder and every rank's results of `_two_ranks`."""
    tmp = str(tmp_path_factory.mktemp("two_ranks"))
    return tmp, run_distributed(_two_ranks, 2, tmp, timeout_s=300, join_timeout_s=900)


def test_pipeline_converges_like_one_stage_and_zero1_equals_all_reduce(two_ranks):
    tmp, results = two_ranks
    two = [r["converge"] for r in results]
    one = results[0]["one_rank"]
    pp1, pp2 = one["pp1"], two[0]["pp2"]
    assert two[0]["pp2"] == two[1]["pp2"], "both stages report the same losses"
    assert len(pp1) == len(pp2) == STEPS
    worst = max(abs(a - b) for a, b in zip(pp1, pp2))
    assert worst <= 1e-5, f"pp_size 2 vs 1: max |loss difference| {worst:.3g}\n{pp1}\n{pp2}"
    assert pp1[0] - pp1[-1] > 0.5, f"the run must learn: {pp1[0]:.3f} -> {pp1[-1]:.3f}"
    assert abs(one["pp1_eval"] - two[0]["pp2_eval"]) <= 1e-5
    for rank in range(2):
        assert two[rank]["zero"] == two[rank]["dp"], "ZeRO-1 must equal the rank-order all-reduce (EP 1)"
        assert two[rank]["zero_ep2"] == two[rank]["dp_ep2"], "ZeRO-1 must equal the rank-order all-reduce (EP 2)"
    assert two[0]["dp"][0] - two[0]["dp"][-1] > 0.5


def _pipeline_with_data_parallel(rank: int, world: int, tmp: str, steps: int, ep: int) -> list[float]:
    from ep_moe.train.rank_entry import train_rank

    extra = [f"train.train_iters={steps}", f"model.expert_model_parallel_size={ep}", "ep_moe.dispatcher_backend=torch"]
    extra += ["train.pp_size=2"] if world == 4 else []
    return train_rank(_recipe(tmp, f"w{world}_ep{ep}", world, extra), torch.device("cpu")).losses


def _four_ranks(rank: int, world: int, tmp: str) -> dict[int, list[float]]:
    return {ep: _pipeline_with_data_parallel(rank, world, tmp, DP_PER_STAGE_STEPS, ep) for ep in EPS}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict[int, list[float]]]:
    """Every rank's losses of the 4-rank pipeline runs (EP 1 and 2, one spawned group)."""
    return run_distributed(_four_ranks, 4, str(tmp_path_factory.mktemp("four_ranks")), timeout_s=300,
                           join_timeout_s=900)


@pytest.mark.parametrize("ep", EPS)
def test_pipeline_with_two_data_parallel_ranks_per_stage(two_ranks, four_ranks, ep):
    """4 ranks, ``pp_size: 2``: each stage's 2 ranks sum their gradients (EP 1), or hold half the experts each
    (EP 2 inside the stage: the MoE layers dispatch over the stage's pair of ranks); equal to ``pp_size: 1`` on 2
    ranks at the same EP size (the same micro-batches per data-parallel rank) within the same bound (measured:
    4e-7 over 30 steps at EP 1)."""
    steps = DP_PER_STAGE_STEPS
    four = [r[ep] for r in four_ranks]
    two = [r["dp_per_stage"][ep] for r in two_ranks[1]]
    assert all(losses == four[0] for losses in four) and len(four[0]) == steps
    worst = max(abs(a - b) for a, b in zip(four[0], two[0]))
    assert worst <= 1e-5, f"pp_size 2 x DP 2 (EP {ep}) vs DP 2: max |loss difference| {worst:.3g}"


def test_pipeline_recipe_rules():
    from ep_moe.train.recipe_schema import RecipeError

    with pytest.raises(RecipeError, match="train.pp_size"):
        _recipe("/tmp", "x", 2, ["train.pp_size=3"])
    with pytest.raises(RecipeError, match="model.expert_model_parallel_size"):  # a stage has one rank
        _recipe("/tmp", "x", 2, ["train.pp_size=2", "model.expert_model_parallel_size=2"])
    with pytest.raises(RecipeError, match="train.pp_size"):
        _recipe("/tmp", "x", 3, ["train.pp_size=2", "train.global_batch_size=24"])
    with pytest.raises(RecipeError, match="train.zero_stage"):
        _recipe("/tmp", "x", 2, ["train.zero_stage=2"])


class _StopAtSecondStep:
    """Stands in for `ep_moe.train.loop.StopRequest`: on the rank that builds it with ``ask``, a stop is requested
    from the loop's second look on (after step 1's losses, so the ranks agree to stop after step 2)."""

    def __init__(self, ask: bool) -> None:
        self.looks, self.ask, self.signal_name = 0, ask, "SIGINT"

    @property
    def requested(self) -> bool:
        self.looks += 1
        return self.ask and self.looks >= 2

    def restore(self) -> None:
        pass


def _checkpoints(rank: int, world: int, tmp: str) -> dict:
    from ep_moe.train import loop
    from ep_moe.train.rank_entry import train_rank

    cpu, out = torch.device("cpu"), {}
    six, three = ["train.train_iters=6"], ["train.train_iters=3"]
    for name, layout in (("pp", ["train.pp_size=2"]), ("zero", ["train.zero_stage=1"])):
        save = [f"checkpoint.save={tmp}/{name}", "checkpoint.keep_last=0", "checkpoint.save_interval=0"]
        out[name] = train_rank(_recipe(tmp, f"{name}_all", world, layout + six), cpu).losses
        first = train_rank(_recipe(tmp, f"{name}_a", world, layout + three + save), cpu)
        second = train_rank(_recipe(tmp, f"{name}_b", world, layout + six + save + ["checkpoint.resume=true"]), cpu)
        out[f"{name}_resumed"] = first.losses + second.losses
        # the step-3 checkpoint in the default layout (DP 2, no ZeRO)
        load = [f"checkpoint.load={tmp}/{name}/step_0000003"]
        out[f"{name}_to_default"] = train_rank(_recipe(tmp, f"{name}_c", world, six + load), cpu).losses
    # a stop request (Ctrl-C) on stage 1 only: both stages stop after step 2 and save there
    real = loop.StopRequest
    loop.StopRequest = lambda: _StopAtSecondStep(ask=rank == 1)
    try:
        stopped = train_rank(_recipe(tmp, "pp_stop", world, ["train.pp_size=2"] + six + [
            f"checkpoint.save={tmp}/pp_stop"]), cpu)
    finally:
        loop.StopRequest = real
    out["stop"] = (stopped.exit_code, stopped.last_step, stopped.checkpoint)
    return out


def test_pipeline_and_zero1_checkpoints_resume_exactly_and_load_in_the_default_layout(two_ranks):
    """``pp_size: 2`` and ZeRO-1 save the default trainer's checkpoint format: a run resumed from step 3 gives the
    uninterrupted run's losses bit for bit; the step-3 checkpoint loaded by the default layout (DP 2) continues
    with ZeRO-1's losses bit for bit and the pipeline's within the pipeline-vs-one-stage bound (module
    docstring); a stop request on one stage stops both after the step and saves there."""
    tmp, results = two_ranks
    out = [r["checkpoints"] for r in results]
    for rank in range(2):
        assert out[rank]["pp_resumed"] == out[rank]["pp"], "pp_size 2: resumed from step 3 != uninterrupted"
        assert out[rank]["zero_resumed"] == out[rank]["zero"], "ZeRO-1: resumed from step 3 != uninterrupted"
        assert out[rank]["zero_to_default"] == out[rank]["zero"][3:], "ZeRO-1 checkpoint in the default layout"
        worst = max(abs(a - b) for a, b in zip(out[rank]["pp_to_default"], out[rank]["pp"][3:]))
        assert len(out[rank]["pp_to_default"]) == 3 and worst <= 1e-5, out[rank]
        code, last, folder = out[rank]["stop"]
        assert (code, last) == (130, 2), out[rank]["stop"]
        assert folder is not None and folder.endswith("step_0000002"), folder
    from ep_moe.train.checkpoint import checkpoint_info

    assert checkpoint_info(os.path.join(tmp, "checkpoints", "pp", "step_0000003"))["step"] == 3


@pytest.mark.parametrize("sizes,ranks", [([5, 1, 1, 9, 3], 2), ([4] * 7, 3), ([100, 1, 1], 4), ([], 2), ([7], 3)])
def test_zero_runs_split_the_parameters_in_order(sizes, ranks):
    from ep_moe.train.zero import split_runs

    runs = split_runs(sizes, ranks)
    assert len(runs) == ranks
    assert [i for b, e in runs for i in range(b, e)] == list(range(len(sizes))), runs  # each once, in order
    if len(sizes) >= ranks and len(set(sizes)) == 1:  # equal sizes: every rank owns some
        assert all(e > b for b, e in runs), runs
