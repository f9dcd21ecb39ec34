"""The training loop of one rank: model, optimizer, data, gradient accumulation, evaluation, checkpoints,
metrics, and a clean stop on SIGINT/SIGTERM.

Step ``s`` (0-based) trains on global batch ``s`` of the dataset; rank ``r`` runs micro-batches
``i = 0 .. accum-1`` (rows ``[(i * W + r) * m, ... + m)``), back-propagating ``(ce + aux) / (accum * W)``
each; then gradients are summed (non-expert over the world, expert over the expert-data-parallel group),
clipped by the global norm, AdamW steps, and the routers' expert bias is updated once. The logged loss
is the mean of the per-micro-batch mean cross-entropies over the whole global batch, summed in float64
in row order, so it does not depend on how the batch was split over ranks.
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .data import build_dataset, rank_slice
from .failures import set_stage
from .metrics import Progress, RunLog, Throughput, finish, report_eval, report_step, run_record
from .parallel import (
    ParallelState,
    build_ep_buffer,
    build_parallel_state,
    clip_grad_norm,
    layer_num_sms,
    sync_gradients,
)
from .recipe_schema import Recipe
from .schedule import begin_step
from .zero import ZeroOne

INTERRUPTED_EXIT_CODE = 130


class StopRequest:
    """SIGINT/SIGTERM -> stop after the current step (all ranks agree at the step boundary).

    A second signal within ``grace_s`` of the first is taken as the same request (a Ctrl-C reaches the
    ranks both from the terminal and through the launcher); a later one raises KeyboardInterrupt.
    """

    def __init__(self, grace_s: float = 2.0):
        self.requested_at: float | None = None
        self.signal_name = ""
        self.grace_s = grace_s
        self._previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.requested_at is None:
            self.requested_at = now
            self.signal_name = signal.Signals(signum).name
        elif now - self.requested_at > self.grace_s:
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class RunResult:
    """What a rank returns to the launcher (rank 0's is the one printed)."""

    rank: int
    exit_code: int = 0
    last_step: int = 0
    losses: list[float] = field(default_factory=list)        # per step of this run segment, in order
    final_loss: float = math.nan
    eval_loss: float | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss) of this run segment
    entropy_floor: float | None = None
    tokens_per_s: float = 0.0
    train_time_s: float = 0.0
    total_time_s: float = 0.0
    checkpoint: str | None = None
    summary: str = ""


def build_model(recipe: Recipe, ps: ParallelState) -> torch.nn.Module:
    """`MoETransformer` of the recipe on this rank's device: its EP `Buffer` and every MoE layer's SM count are
    decided first (`build_ep_buffer`, `layer_num_sms`) and passed in."""
    from ep_moe.layers.model import MoETransformer
    from ep_moe.layers.model_config import ModelConfig

    config = ModelConfig(**recipe.model.model_config_kwargs())
    e = recipe.ep_moe
    buffer = build_ep_buffer(ps, e.dispatcher_backend, e.hybrid_mode, e.num_scaleout_ranks)
    num_sms = layer_num_sms(recipe, buffer)
    # Built on the CPU (the init draws from CPU generators), then moved.
    model = MoETransformer(config, buffer=buffer, expert_dp_group=ps.expert_dp_group,
                           dp_group=ps.dp_group if ps.world_size > 1 else None, num_sms=num_sms,
                           seed=recipe.rng.seed, num_worst_tokens=recipe.ep_moe.num_worst_tokens)
    return model.to(ps.device)


def build_optimizer(model: torch.nn.Module, recipe: Recipe, device: torch.device,
                    params: list[torch.nn.Parameter] | None = None) -> torch.optim.Optimizer:
    """AdamW over ``params`` (None: every parameter of ``model``); weight decay on matrices (ndim >= 2) only, not
    on norms or other vectors."""
    o = recipe.optimizer
    params = list(model.parameters()) if params is None else params
    decay = [p for p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in params if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach on GPU (fast), the plain per-tensor loop on CPU (simple and deterministic).
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                             foreach=device.type == "cuda", fused=False)


def _autocast(recipe: Recipe, device: torch.device):
    if recipe.train.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def _global_mean(per_micro: torch.Tensor, ps: ParallelState, accum: int, extra: torch.Tensor) -> torch.Tensor:
    """All ranks' ``per_micro [accum, C]`` values as one ``[accum, W, C]`` float64 table, plus ``extra``
    summed over ranks, in one collective. Each rank fills only its own slot, so the sum is exact."""
    c = per_micro.shape[1]
    table = torch.zeros(accum, ps.world_size, c, dtype=torch.float64, device="cpu")
    table[:, ps.rank] = per_micro.double().cpu()
    flat = torch.cat([table.flatten(), extra.double().cpu().flatten()]).to(ps.device)
    if ps.world_size > 1:
        dist.all_reduce(flat, group=ps.dp_group)
    return flat.cpu()


def row_order_mean(values: torch.Tensor) -> float:
    """Mean in float64, added one by one in row order (independent of the rank count)."""
    total = 0.0
    for v in values.flatten().tolist():
        total += v
    return total / values.numel()


@torch.no_grad()
def evaluate(model, dataset, recipe: Recipe, ps: ParallelState, accum: int) -> float:
    """Mean cross-entropy over ``eval_iters`` validation global batches (the same batches every time)."""
    t = recipe.train
    model.eval()
    per_micro = torch.zeros(t.eval_iters * accum, 1, dtype=torch.float64, device="cpu")
    for j in range(t.eval_iters):
        batch = dataset.batch("valid", j, t.global_batch_size)
        for i in range(accum):
            mb = rank_slice(batch, ps.rank, ps.world_size, t.micro_batch_size, i).to(ps.device)
            with _autocast(recipe, ps.device):
                out = model(mb[:, :-1], mb[:, 1:])
            per_micro[j * accum + i, 0] = out.loss.double().item()
    model.train()
    model.moe_stats()  # drop the routing statistics of the evaluation forwards (collective, all ranks)
    table = _global_mean(per_micro, ps, t.eval_iters * accum, torch.zeros(0, dtype=torch.float64, device="cpu"))
    return row_order_mean(table[: t.eval_iters * accum * ps.world_size])


@dataclass
class StepOutcome:
    """One optimizer step as the shared loop reports it (every rank holds the same values)."""

    loss: float                 # mean cross-entropy over the global batch
    aux_loss: float | None      # the auxiliary loss term as the metrics show it (None: the layer has none)
    grad_norm: float | None     # before clipping (None where the engine does not say)
    stats: dict[str, Any]       # routing statistics of the progress line and metrics (may be empty)
    stop: bool                  # a rank asked to stop (SIGINT/SIGTERM): stop after this step


def batch_line(recipe, accum: int, dataset) -> str:
    """The part of a run's opening line every engine shares: the global batch, its split, the steps, the data."""
    t = recipe.train
    return (f"global batch {t.global_batch_size} x {recipe.model.seq_length} tokens (micro {t.micro_batch_size}, "
            f"accumulation {accum}), {t.train_iters} steps; {dataset.describe()}")


class TrainSteps(Protocol):
    """What the shared loop (`run_training`) needs from one way of training: the ep_moe engine's layouts
    (`DataParallelSteps`; the two-stage pipeline in `ep_moe.train.pipeline`) and the Megatron and DeepSpeed
    engines (`ep_moe.train.engines`). Built collectively, one object per rank; every method marked collective is
    called by every rank in the same order."""

    rank: int
    world_size: int
    ep_size: int
    device: torch.device
    dataset: Any

    def find_checkpoint(self) -> str | None:
        """The checkpoint this run starts from (``--resume`` / ``checkpoint.load``), or None."""

    def load(self, path: str) -> int:
        """Collective: load ``path``; its step."""

    def opening_lines(self) -> list[str]:
        """What rank 0 prints before the first step (the layout of the ranks, the model, where metrics go)."""

    def title(self) -> str:
        """The plot's and the summary's title."""

    def begin(self, step: int) -> tuple[float, torch.Tensor]:
        """Start optimizer step ``step`` (0-based): its learning rate set, gradients cleared; ``(lr, the step's
        global batch)``."""

    def step(self, batch: torch.Tensor, stop_requested: bool) -> StepOutcome:
        """Collective: forward and backward of this rank's micro-batches of ``batch``, gradient reduction and
        clipping, the optimizer step, and the agreed losses and stop request."""

    def evaluate(self) -> float:
        """Collective: the mean validation cross-entropy."""

    def save(self, step: int) -> str:
        """Collective: a checkpoint of step ``step`` in ``checkpoint.save``; its folder."""

    def close(self) -> None:
        """Release what the steps hold (communication buffers, hooks)."""


class DataParallelSteps:
    """The default trainer: expert parallelism inside data parallelism (optionally ZeRO-1), see the module
    docstring."""

    def __init__(self, recipe: Recipe, device: torch.device) -> None:
        t = recipe.train
        self.recipe, self.device = recipe, device
        self.ps = ps = build_parallel_state(recipe.model.expert_model_parallel_size, device, t.deterministic)
        self.rank, self.world_size, self.ep_size = ps.rank, ps.world_size, ps.ep_size
        self.accum = recipe.grad_accum_steps(ps.world_size)
        self.dataset = build_dataset(recipe)
        self.model = model = build_model(recipe, ps)
        self.optimizer = build_optimizer(model, recipe, device)
        self.non_expert = [p for p in model.non_expert_parameters() if p.requires_grad]
        self.expert = [p for p in model.expert_parameters() if p.requires_grad]
        self.zero = ZeroOne(self.non_expert, self.expert, ps, t.timeout_s) if t.zero_stage == 1 else None
        if self.zero is not None:  # this rank's optimizer holds state for its shard of the parameters only
            self.optimizer = build_optimizer(model, recipe, device, self.zero.owned_parameters())
        self.scale = 1.0 / (self.accum * ps.world_size)
        model.train()

    def opening_lines(self) -> list[str]:
        ps, model = self.ps, self.model
        backend = (f"{model.buffer.backend_name} ({model.buffer.backend_reason})" if model.buffer is not None
                   else "none (EP 1: all experts local)")
        return [f"ep-moe train: {ps.world_size} rank(s) on {self.device.type}, EP {ps.ep_size} x DP "
                f"{ps.expert_dp_size}, {model.num_parameters(global_experts=True):,} parameters, "
                f"{batch_line(self.recipe, self.accum, self.dataset)}",
                f"dispatcher backend: {backend}; metrics: {self.recipe.metrics_path()}"]

    def title(self) -> str:
        return f"{self.recipe.name}: EP {self.ps.ep_size} x DP {self.ps.expert_dp_size}"

    def find_checkpoint(self) -> str | None:
        return ckpt.find_checkpoint_to_load(self.recipe)

    def begin(self, step: int) -> tuple[float, torch.Tensor]:
        return begin_step(self.recipe, self.optimizer, self.dataset, step)

    def step(self, batch: torch.Tensor, stop_requested: bool) -> StepOutcome:
        per_micro, grad_norm, stats = self._train_step(batch)
        loss, aux, stop = self._step_losses(per_micro, stop_requested)
        return StepOutcome(loss, aux, grad_norm, stats, stop)

    def _train_step(self, batch: torch.Tensor) -> tuple[torch.Tensor, float, dict[str, Any]]:
        t, ps, model, zero = self.recipe.train, self.ps, self.model, self.zero
        per_micro = torch.zeros(self.accum, 2, dtype=torch.float64, device="cpu")
        for i in range(self.accum):
            mb = rank_slice(batch, ps.rank, ps.world_size, t.micro_batch_size, i).to(self.device)
            with _autocast(self.recipe, self.device):
                out = model(mb[:, :-1], mb[:, 1:])
            ((out.loss + out.aux_loss) * self.scale).backward()
            per_micro[i, 0] = out.loss.detach().double().item()
            per_micro[i, 1] = out.aux_loss.detach().double().item()
        if zero is None:
            sync_gradients(self.non_expert, self.expert, ps)
            grad_norm = clip_grad_norm(self.non_expert, self.expert, self.recipe.optimizer.clip_grad, ps)
            self.optimizer.step()
        else:
            grad_norm = zero.reduce_and_clip(self.recipe.optimizer.clip_grad)
            self.optimizer.step()
            zero.gather_parameters()
        model.update_expert_bias()  # once per optimizer step, after all micro-batches
        return per_micro, grad_norm, model.moe_stats()

    def _step_losses(self, per_micro: torch.Tensor, stop: bool) -> tuple[float, float, bool]:
        table = _global_mean(per_micro, self.ps, self.accum,
                             torch.tensor([1.0 if stop else 0.0], dtype=torch.float64, device="cpu"))
        n = self.accum * self.ps.world_size * 2
        by_micro = table[:n].view(self.accum * self.ps.world_size, 2)
        return row_order_mean(by_micro[:, 0]), row_order_mean(by_micro[:, 1]), bool(table[n] > 0)

    def evaluate(self) -> float:
        return evaluate(self.model, self.dataset, self.recipe, self.ps, self.accum)

    def save(self, step: int) -> str:
        state = self.optimizer.state if self.zero is None else self.zero.full_optimizer_state(self.optimizer)
        return ckpt.save_checkpoint(self.recipe, self.model, state, self.ps, step)

    def load(self, path: str) -> int:
        return ckpt.load_checkpoint(path, self.model, self.optimizer, self.ps)

    def close(self) -> None:
        if self.zero is not None:
            self.zero.close()


def run_training(recipe, steps: TrainSteps, t0: float) -> RunResult:
    """The loop every engine and layout shares: resume, per step the layout's step with the agreed losses and
    stop request, progress and metrics, evaluation, checkpoints, the summary and the exit status. Collective."""
    t = recipe.train
    is_main = steps.rank == 0
    device = steps.device
    floor = getattr(steps.dataset, "entropy_floor", None)
    start_step = 0
    resumed_from = steps.find_checkpoint()
    if resumed_from is not None:
        set_stage(f"checkpoint load ({resumed_from})")
        start_step = steps.load(resumed_from)
    result = RunResult(rank=steps.rank, entropy_floor=floor, last_step=start_step)

    metrics = RunLog(recipe, resume_step=start_step if resumed_from else None) if is_main else None
    progress = Progress(recipe.logger.progress_bar, t.train_iters, start_step, enabled=is_main)
    if is_main:
        for line in steps.opening_lines():
            progress.message(line)
        if resumed_from:
            progress.message(f"resumed from {resumed_from} at step {start_step}")
        elif recipe.checkpoint.resume:
            progress.message(f"no checkpoint in {recipe.checkpoint.save} yet: starting at step 0")
        metrics.write(run_record(recipe, start_step, steps.world_size, steps.ep_size, floor, resumed_from))

    if start_step >= t.train_iters:
        progress.close()
        if metrics is not None:
            metrics.close()
        result.summary = (f"nothing to train: the checkpoint is at step {start_step} >= train.train_iters="
                          f"{t.train_iters} (raise train.train_iters to continue)")
        if is_main:
            print(result.summary, flush=True)
        return result

    stop = StopRequest()
    train_time = 0.0
    throughput = Throughput(recipe.tokens_per_step)
    eval_loss: float | None = None
    step = start_step
    last_saved: int | None = None
    interrupted = False
    try:
        while step < t.train_iters:
            step_start = time.monotonic()
            set_stage(f"training step {step + 1}")
            lr, batch = steps.begin(step)
            outcome = steps.step(batch, stop.requested)
            step += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.monotonic() - step_start
            train_time += step_time
            tokens_per_s = throughput.add(step_time)
            result.losses.append(outcome.loss)
            report_step(recipe, progress, metrics, step, outcome.loss, outcome.aux_loss, lr, outcome.grad_norm,
                        tokens_per_s, time.monotonic() - t0, outcome.stats)
            last = step == t.train_iters
            if t.eval_iters > 0 and ((t.eval_interval and step % t.eval_interval == 0) or last) and not outcome.stop:
                set_stage(f"evaluation after step {step}")
                eval_loss = steps.evaluate()
                result.evals.append((step, eval_loss))
                report_eval(progress, metrics, step, eval_loss, floor, time.monotonic() - t0)
            if ckpt.save_due(recipe.checkpoint, step, last, outcome.stop):
                set_stage(f"checkpoint save at step {step}")
                result.checkpoint = steps.save(step)
                last_saved = step
            if outcome.stop:
                interrupted = True
                break
    finally:
        progress.close()
        stop.restore()
        if metrics is not None:
            metrics.close()

    result.last_step = step
    result.final_loss = result.losses[-1] if result.losses else math.nan
    result.eval_loss = eval_loss
    result.train_time_s = train_time
    result.tokens_per_s = recipe.tokens_per_step * len(result.losses) / max(train_time, 1e-9)
    result.total_time_s = time.monotonic() - t0
    if interrupted:
        result.exit_code = INTERRUPTED_EXIT_CODE
        if is_main:
            where = (f"checkpoint {result.checkpoint}; continue with --resume" if last_saved == step
                     else "no checkpoint (set checkpoint.save to keep one)")
            result.summary = f"interrupted ({stop.signal_name}) after step {step}: {where}"
            print(result.summary, flush=True)
        return result
    if is_main:
        result.summary, result.exit_code = finish(
            recipe, recipe.metrics_path(), steps=step, final_loss=result.final_loss, eval_loss=eval_loss, floor=floor,
            tokens_per_s=result.tokens_per_s, train_time_s=train_time, total_time_s=result.total_time_s,
            title=steps.title())
    return result


def result_dict(result: RunResult) -> dict[str, Any]:
    return dict(result.__dict__)
