"""Per-call performance settings of dispatch and combine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    """Performance knobs of one dispatch or combine call (the native backend reads them).

    Args:
        num_sms: streaming multiprocessors the kernels may use (even; 2 per channel).
        chunk_tokens: tokens a channel moves before it signals the receiver (0 = backend default).
    """

    num_sms: int = 24
    chunk_tokens: int = 0
