"""The loss curve PNG (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from typing import Any


def plot_loss(records: list[dict[str, Any]], path: str, floor: float | None = None, title: str = "") -> str:
    """Train loss per step, eval loss, and the entropy floor (when known) into ``path``; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), lw=1.2, label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", ms=4, lw=1.2, label="eval loss")
    if floor is not None:
        ax.axhline(floor, color="k", ls="--", lw=1, label=f"entropy floor {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
