"""A short, bounded search around the predicted SM count, run during warm-up on the real kernels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from .plan import CommPlan

MeasureFn = Callable[[int], "float | tuple[float, float]"]


def _measure(measure_fn: MeasureFn, num_sms: int) -> tuple[float, float | None, float | None]:
    """(objective us, dispatch us or None, combine us or None) of one call of ``measure_fn``."""
    value = measure_fn(num_sms)
    if isinstance(value, tuple | list):
        if len(value) != 2:
            raise ValueError(f"refine: measure_fn must return us or (dispatch_us, combine_us), got {value!r}")
        dispatch, combine = float(value[0]), float(value[1])
        total = dispatch + combine
    else:
        dispatch = combine = None
        total = float(value)
    if not total > 0:
        raise ValueError(f"refine: measure_fn({num_sms}) must return a positive time, got {value!r}")
    return total, dispatch, combine


def refine(plan: CommPlan, measure_fn: MeasureFn, budget: int = 5, steps: Sequence[int] = (2, 4),
           tolerance: float = 0.02, min_sms: int = 2, max_sms: int | None = None) -> CommPlan:
    """Measure SM counts around ``plan.num_sms`` and return the plan with the best one.

    Tries the planned count, then ``-s`` and ``+s`` for each step ``s`` in ``steps`` (smaller steps first),
    at most ``budget`` measurements in all. A larger step in one direction is skipped when the smaller one
    did not pay: more SMs that were not faster by more than ``tolerance``, or fewer SMs that were slower
    by more than ``tolerance``. The winner is the fewest SMs measured within ``tolerance`` of the fastest.

    Args:
        measure_fn: ``measure_fn(num_sms)`` -> time in us, or ``(dispatch_us, combine_us)``. In a process
            group every rank must get the same answers (reduce with MAX across ranks), so that every rank
            picks the same count.
        budget: measurements allowed (>= 1).
        min_sms, max_sms: bounds on the counts tried (even).

    Returns:
        a new plan: ``num_sms`` the winner, measured times of the winner, ``source="refined"``, and
        ``history`` every (SMs, us) tried.
    """
    if budget < 1:
        raise ValueError(f"refine: argument 'budget' must be >= 1, got {budget}")
    if any(s <= 0 or s % 2 for s in steps):
        raise ValueError(f"refine: argument 'steps' must hold positive even ints, got {list(steps)}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"refine: argument 'tolerance' must be in [0, 1), got {tolerance}")
    upper = max_sms if max_sms is not None else 1 << 30
    results: dict[int, tuple[float, float | None, float | None]] = {}

    def try_count(n: int) -> None:
        if len(results) < budget and n not in results and min_sms <= n <= upper:
            results[n] = _measure(measure_fn, n)

    center = plan.num_sms
    try_count(center)
    down_ok = up_ok = True
    for step in sorted(steps):
        best_t = min(r[0] for r in results.values())
        if down_ok:
            try_count(center - step)
            down = results.get(center - step)
            down_ok = down is not None and down[0] <= best_t * (1 + tolerance)
        if up_ok:
            try_count(center + step)
            up = results.get(center + step)
            up_ok = up is not None and up[0] < best_t * (1 - tolerance)
    fastest = min(r[0] for r in results.values())
    winner = min(n for n, r in results.items() if r[0] <= fastest * (1 + tolerance))
    total, dispatch, combine = results[winner]
    history = list(plan.history) + [(n, r[0]) for n, r in results.items()]
    refined = replace(plan, num_sms=winner, source="refined", history=history)
    refined.record(dispatch, combine, total)
    return refined


__all__ = ["MeasureFn", "refine"]
