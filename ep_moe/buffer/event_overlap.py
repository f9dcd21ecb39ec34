"""`EventOverlap`: a handle on communication that may still be running on another stream.

Mirrors DeepEP's class of the same name: code written against DeepEP can call
``event.current_stream_wait()`` or use ``with event:`` to overlap work with communication.
On CPU (gloo) every operation completes before it returns and the event is empty.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class EventOverlap:
    """A CUDA event recorded after some communication, plus tensors to keep alive until it completes.

    Args:
        event: the ``torch.cuda.Event`` recorded on the communication stream, or ``None`` when the
            work has already completed (CPU, or synchronous GPU calls).
        extra_tensors: tensors whose memory must not be reused before the event completes.
    """

    def __init__(self, event: torch.cuda.Event | None = None,
                 extra_tensors: Iterable[torch.Tensor] | None = None) -> None:
        self.event = event
        self.extra_tensors = tuple(extra_tensors) if extra_tensors is not None else ()

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (no-op when there is none)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        # Leaving the block joins the communication with the current stream, like DeepEP's.
        self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap(event={'set' if self.event is not None else None})"
