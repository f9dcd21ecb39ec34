"""What rank 0 shows and records: a tqdm progress bar (or plain lines when it is off), metrics as JSON
lines, and the one-line summary at the end."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from typing import Any

from tqdm import tqdm

from .rundir import WANDB_RUN_ID


class MetricsFile:
    """Append-only JSON lines, one object per record (``{"kind": "train" | "eval" | "run", ...}``).

    On resume the file is cut back to the records of steps up to the checkpoint's step, so that the records
    a killed run wrote after its last checkpoint do not appear twice.
    """

    def __init__(self, path: str, resume_step: int | None = None):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if resume_step is None:
            open(path, "w").close()
        elif os.path.exists(path):
            kept = [line for line in read_records(path) if line.get("step", 0) <= resume_step]
            with open(path, "w", encoding="utf-8") as f:
                for record in kept:
                    f.write(json.dumps(record) + "\n")

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of a metrics file (a torn last line, from a killed run, is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _terminal_columns() -> int:
    """The width stderr's terminal reports (0 when it reports none)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def _thread_lock_only() -> None:
    """Give tqdm a thread lock, unless it has a lock already: its default one holds a multiprocessing
    semaphore, which a rank shares with no one, and which a rank killed by a signal leaves behind for the
    resource tracker to warn about when the launcher exits."""
    if "_lock" not in vars(tqdm):
        tqdm.set_lock(threading.RLock())


class Progress:
    """The progress bar on rank 0: ``step, loss, aux, tokens/s, expert-load imbalance``.

    ``mode``: True, False or ``"auto"`` (on when stderr is a terminal). With the bar off, a plain line is
    printed every ``max(1, total // 10)`` steps, so logs stay short.
    """

    def __init__(self, mode: bool | str, total: int, initial: int, enabled: bool):
        self.enabled = enabled
        # A terminal that reports no size (0x0: some containers, pseudo-terminals of CI runners) would get an
        # empty bar from tqdm: print plain lines there.
        show_bar = mode is True or (mode == "auto" and sys.stderr.isatty() and _terminal_columns() > 0)
        _thread_lock_only()
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                        disable=not (enabled and show_bar))
        self.use_bar = enabled and show_bar
        self.total = total
        self.every = max(1, total // 10)

    def update(self, step: int, loss: float, aux: float, tokens_per_s: float, imbalance: float | None) -> None:
        if not self.enabled:
            return
        imb = "n/a" if imbalance is None else f"{imbalance:.2f}"
        if self.use_bar:
            self.bar.set_postfix_str(f"loss {loss:.4f} aux {aux:.4f} tok/s {tokens_per_s:,.0f} imb {imb}",
                                     refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            print(f"step {step}/{self.total}  loss {loss:.4f}  aux {aux:.4f}  tokens/s {tokens_per_s:,.0f}  "
                  f"load imbalance {imb}", flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.use_bar:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        self.bar.close()


def format_summary(final_loss: float, floor: float | None, eval_loss: float | None, tokens_per_s: float,
                   train_time_s: float, total_time_s: float, steps: int, margin: float | None = None) -> str:
    """The one-line summary: final loss against the floor, throughput and time."""
    parts = [f"done: {steps} steps, final train loss {final_loss:.4f}"]
    if eval_loss is not None and math.isfinite(eval_loss):
        parts.append(f"eval loss {eval_loss:.4f}")
    if floor is not None:
        gap = (eval_loss if eval_loss is not None else final_loss) - floor
        text = f"entropy floor {floor:.4f} (gap {gap:+.4f} nats/token"
        if margin is not None:
            text += f", target <= {margin:.2f}: {'met' if gap <= margin else 'NOT met'}"
        parts.append(text + ")")
    parts.append(f"{tokens_per_s:,.0f} tokens/s")
    parts.append(f"train {train_time_s:.1f} s, total {total_time_s:.1f} s")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------- every engine
# The keys of a metrics record, the same for every engine (None where an engine does not know a value).
TRAIN_KEYS = ("kind", "step", "loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "load_imbalance",
              "load_imbalance_max", "load_imbalance_layers", "router_aux_loss_raw", "z_loss_raw", "time_s")
EVAL_KEYS = ("kind", "step", "eval_loss", "time_s")
RUN_KEYS = ("kind", "step", "engine", "world_size", "ep_size", "entropy_floor", "resumed_from", "recipe")


def train_record(step: int, loss: float, aux_loss: float | None, lr: float, grad_norm: float | None,
                 tokens_per_s: float, time_s: float, stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``train`` record. ``stats``: routing statistics (``load_imbalance``: max / mean tokens per expert,
    mean over MoE layers; ``load_imbalance_max``; ``load_imbalance_layers``: one per MoE layer;
    ``aux_loss`` / ``z_loss``: raw router losses, mean over MoE layers)."""
    stats = stats or {}
    return {"kind": "train", "step": step, "loss": loss, "aux_loss": aux_loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s, "load_imbalance": stats.get("load_imbalance"),
            "load_imbalance_max": stats.get("load_imbalance_max"),
            "load_imbalance_layers": stats.get("load_imbalance_layers"),
            "router_aux_loss_raw": stats.get("aux_loss"), "z_loss_raw": stats.get("z_loss"), "time_s": time_s}


def eval_record(step: int, eval_loss: float, time_s: float) -> dict[str, Any]:
    return {"kind": "eval", "step": step, "eval_loss": eval_loss, "time_s": time_s}


def run_record(recipe, step: int, world_size: int, ep_size: int, entropy_floor: float | None,
               resumed_from: str | None) -> dict[str, Any]:
    """The ``run`` record a run (or a resumed segment) starts with."""
    return {"kind": "run", "step": step, "engine": recipe.engine, "world_size": world_size, "ep_size": ep_size,
            "entropy_floor": entropy_floor, "resumed_from": resumed_from, "recipe": recipe.to_dict()}


def imbalance_stats(counts) -> dict[str, Any]:
    """Routing statistics from tokens per expert (``counts [MoE layers, experts]``, any numbers)."""
    import torch

    counts = torch.as_tensor(counts, dtype=torch.float64, device="cpu")
    if counts.numel() == 0:
        return {}
    per_layer = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)
    return {"load_imbalance": float(per_layer.mean()), "load_imbalance_max": float(per_layer.max()),
            "load_imbalance_layers": [float(v) for v in per_layer]}


class TensorBoardLog:
    """TensorBoard event files of rank 0 (``torch.utils.tensorboard.SummaryWriter``) under Megatron's scalar
    names: ``lm loss``, ``learning-rate``, ``grad-norm``, ``load_balancing_loss`` (raw, mean over MoE layers),
    ``z_loss``, ``lm loss validation``; and ``aux-loss`` (the term added to the loss), ``tokens-per-sec``,
    ``load-imbalance``, ``load-imbalance-max`` and ``moe/load_imbalance_layer_<i>`` per MoE layer."""

    SCALARS = {"loss": "lm loss", "aux_loss": "aux-loss", "lr": "learning-rate", "grad_norm": "grad-norm",
               "tokens_per_s": "tokens-per-sec", "load_imbalance": "load-imbalance",
               "load_imbalance_max": "load-imbalance-max", "router_aux_loss_raw": "load_balancing_loss",
               "z_loss_raw": "z_loss", "eval_loss": "lm loss validation"}

    def __init__(self, log_dir: str, recipe_text: str | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)
        if recipe_text:
            self.writer.add_text("recipe", "```\n" + recipe_text + "\n```", 0)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars_of(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """A train or eval record's scalars under the logged names (`TensorBoardLog.SCALARS`, and
    ``moe/load_imbalance_layer_<i>``); ``{}`` for other records. Non-finite values are left out."""
    if record.get("kind") not in ("train", "eval"):
        return {}
    out = {}
    for key, tag in TensorBoardLog.SCALARS.items():
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[tag] = float(value)
    for i, value in enumerate(record.get("load_imbalance_layers") or []):
        out[f"moe/load_imbalance_layer_{i}"] = float(value)
    return out


class WandbLog:
    """A Weights & Biases run of rank 0 with the scalars of `TensorBoardLog`. The run's id is kept in
    ``<run folder>/wandb-run-id``, so that ``--resume`` continues the same W&B run."""

    def __init__(self, project: str, name: str, folder: str, config: dict[str, Any], resume: bool):
        import wandb

        id_path = os.path.join(folder, WANDB_RUN_ID)
        run_id = None
        if resume and os.path.exists(id_path):
            with open(id_path, encoding="utf-8") as f:
                run_id = f.read().strip() or None
        self.run = wandb.init(project=project, name=name, config=config, dir=folder, id=run_id,
                              resume="allow" if run_id else None)
        os.makedirs(folder, exist_ok=True)
        with open(id_path, "w", encoding="utf-8") as f:
            f.write(str(self.run.id))

    def write(self, record: dict[str, Any]) -> None:
        scalars = scalars_of(record)
        if scalars:
            self.run.log(scalars, step=record["step"])

    def close(self) -> None:
        self.run.finish()


class RunLog:
    """What rank 0 records, for every engine: the metrics file (`MetricsFile`); with
    ``logger.tensorboard_dir``, TensorBoard event files (`TensorBoardLog`); with ``logger.wandb_project``, a
    W&B run (`WandbLog`)."""

    def __init__(self, recipe, resume_step: int | None = None):
        self.metrics = MetricsFile(recipe.metrics_path(), resume_step=resume_step)
        self.sinks: list[TensorBoardLog | WandbLog] = []
        if recipe.logger.tensorboard_dir:
            import yaml

            self.sinks.append(TensorBoardLog(recipe.logger.tensorboard_dir,
                                             yaml.safe_dump(recipe.to_dict(), sort_keys=False)))
        if recipe.logger.wandb_project:
            folder = recipe.output_dir()
            name = recipe.logger.wandb_run_name or os.path.basename(os.path.normpath(folder))
            self.sinks.append(WandbLog(recipe.logger.wandb_project, name, folder, recipe.to_dict(),
                                       resume=resume_step is not None))

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def target_missed(final_loss: float, eval_loss: float | None, floor: float | None, target: float | None) -> bool:
    """Whether a synthetic run missed ``train.target_loss_gap`` (the final eval loss, else the final train loss,
    more than ``target`` above the entropy floor). False when there is no floor or no target."""
    if floor is None or target is None:
        return False
    loss = eval_loss if eval_loss is not None and math.isfinite(eval_loss) else final_loss
    return not loss - floor <= target


def finish(recipe, records_path: str, *, steps: int, final_loss: float, eval_loss: float | None,
           floor: float | None, tokens_per_s: float, train_time_s: float, total_time_s: float,
           title: str) -> tuple[str, int]:
    """The end of a run on rank 0, for every engine: the summary line (printed), the loss plot, and the exit
    status: 0, or 1 when the target was missed and ``train.fail_on_target_miss`` is set."""
    t = recipe.train
    target = t.target_loss_gap if floor is not None else None
    summary = format_summary(final_loss, floor, eval_loss, tokens_per_s, train_time_s, total_time_s, steps, target)
    try:
        from .plot import plot_loss

        path = plot_loss(read_records(records_path), recipe.plot_path(), floor, title=title)
        plot_note = f"; loss curve {path}"
    except Exception as exc:  # a plot must never fail a finished run
        plot_note = f"; no loss plot ({type(exc).__name__}: {exc})"
    print(summary + f"; metrics {records_path}{plot_note}", flush=True)
    code = 0
    if target_missed(final_loss, eval_loss, floor, target):
        if t.fail_on_target_miss:
            print(f"ep-moe train: the target train.target_loss_gap={target} was missed and "
                  "train.fail_on_target_miss is set: exit status 1", file=sys.stderr, flush=True)
            code = 1
    return summary, code


def report_step(recipe, progress: Progress, log: RunLog | None, step: int, loss: float, aux: float | None,
                lr: float, grad_norm: float | None, tokens_per_s: float, elapsed_s: float,
                stats: dict[str, Any]) -> None:
    """What every engine does after a training step: a loss that is not finite stops the run (FloatingPointError
    naming the step), the progress line, and the train record on rank 0 (``log``; None elsewhere) every
    ``logger.log_interval`` steps and at the last one."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} at step {step}; lower optimizer.lr or check the data")
    progress.update(step, loss, aux if aux is not None else float("nan"), tokens_per_s, stats.get("load_imbalance"))
    if log is not None and (step % recipe.logger.log_interval == 0 or step == recipe.train.train_iters):
        log.write(train_record(step, loss, aux, lr, grad_norm, tokens_per_s, elapsed_s, stats))


def report_eval(progress: Progress, log: RunLog | None, step: int, eval_loss: float, floor: float | None,
                elapsed_s: float) -> None:
    """What every engine does after an evaluation: on rank 0 (``log``) the eval record and a progress line with
    the gap to the entropy floor."""
    if log is None:
        return
    log.write(eval_record(step, eval_loss, elapsed_s))
    gap = f" (floor {floor:.4f}, gap {eval_loss - floor:+.4f})" if floor is not None else ""
    progress.message(f"step {step}: eval loss {eval_loss:.4f}{gap}")


class Throughput:
    """Tokens per second over the last ``window`` steps (what the progress line and the records show)."""

    def __init__(self, tokens_per_step: int, window: int = 20):
        self.tokens_per_step = tokens_per_step
        self.window = window
        self.times: list[float] = []

    def add(self, step_time_s: float) -> float:
        self.times = (self.times + [step_time_s])[-self.window:]
        return self.tokens_per_step * len(self.times) / max(1e-9, sum(self.times))
