"""Which transport PP and AGRS (`ep_moe.elastic.pipeline_comm`, `ep_moe.elastic.agrs`) use on a buffer:
torch.distributed, or the native copy-engine transport (`ep_moe.native.stream_transport`)."""

from __future__ import annotations

import os

TRANSPORT_ENV = "EP_MOE_PPAGRS_TRANSPORT"
"""Default of ``pp_set_config`` / ``agrs_set_config``'s ``transport``: ``auto`` (the default), ``torch``, ``native``."""
TRANSPORTS = ("auto", "torch", "native")


def choose_transport(backend_name: str, requested: str | None, where: str) -> str:
    """The transport PP or AGRS uses on a buffer whose backend is ``backend_name``: ``"native"`` (copy engine and
    stream memory operations, `ep_moe.native.stream_transport`) or ``"torch"`` (torch.distributed).
    ``requested`` (None: ``$EP_MOE_PPAGRS_TRANSPORT``, else ``"auto"``): ``"auto"`` takes the native transport
    exactly when the backend is ``"native"`` (one NVLink node, symmetric memory); ``"native"`` insists on it.
    Raises ValueError naming ``transport`` (``where``: the calling method) for another value, or ``"native"`` on
    another backend."""
    source = "argument 'transport'"
    if requested is None:
        requested, source = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto", TRANSPORT_ENV
    if requested not in TRANSPORTS:
        raise ValueError(f"ep_moe.ElasticBuffer.{where}: {source} must be one of {TRANSPORTS}, got {requested!r}")
    if requested == "native" and backend_name != "native":
        raise ValueError(f"ep_moe.ElasticBuffer.{where}: {source} is 'native', which needs the buffer's native "
                         f"backend (one NVLink node, the extension built), but the backend is {backend_name!r}")
    if requested == "auto":
        return "native" if backend_name == "native" else "torch"
    return requested


__all__ = ["TRANSPORTS", "TRANSPORT_ENV", "choose_transport"]
