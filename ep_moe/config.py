"""Per-call performance settings of dispatch and combine."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NUM_SMS = 24
"""SMs of a dispatch or combine when nothing else decides (see `ep_moe.tuning.cache` for the order)."""


@dataclass(frozen=True)
class Config:
    """Performance knobs of one dispatch or combine call (the native backend reads them).

    Args:
        num_sms: streaming multiprocessors the kernels may use (even; 2 per channel).
        chunk_tokens: tokens a channel moves before it signals the receiver (0 = backend default).
    """

    num_sms: int = DEFAULT_NUM_SMS
    chunk_tokens: int = 0
