"""Learning-rate schedule: a pure function of the step, so a resumed run needs only the step."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int, style: str) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Linear warm-up ``lr * (step + 1) / warmup_iters`` for ``step < warmup_iters``; then ``constant``
    (``lr``), or ``cosine``/``linear`` decay from ``lr`` to ``min_lr`` over steps ``warmup_iters ..
    decay_iters``, and ``min_lr`` after that.
    """
    if step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if style == "constant":
        return lr
    span = max(1, decay_iters - warmup_iters)
    progress = min(1.0, (step - warmup_iters) / span)
    if style == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif style == "linear":
        factor = 1.0 - progress
    else:
        raise ValueError(f"scheduler.lr_decay_style: expected 'cosine', 'linear' or 'constant', got {style!r}")
    return min_lr + (lr - min_lr) * factor


def recipe_lr(recipe, step: int) -> float:
    s, o = recipe.scheduler, recipe.optimizer
    decay = s.lr_decay_iters if s.lr_decay_iters is not None else recipe.train.train_iters
    return lr_at(step, o.lr, s.min_lr, s.lr_warmup_iters, decay, s.lr_decay_style)


def begin_step(recipe, optimizer, dataset, step: int):
    """The start of a training step in every trainer: the step's learning rate into every parameter group,
    gradients cleared, and the step's global batch (``dataset.batch("train", step, global_batch_size)``)."""
    lr = recipe_lr(recipe, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    return lr, dataset.batch("train", step, recipe.train.global_batch_size)
