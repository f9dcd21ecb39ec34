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
        show_bar = mode is True or (mode == "auto" and sys.stderr.isatty())
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
