"""What PP and AGRS (`ep_moe.pipeline_comm`, `ep_moe.agrs`) share on the torch.distributed transport: stable
dtype codes for their headers, byte views of tensors, the 32-byte slot rounding, and waits with a deadline whose
error names the rank and the stage.

A header is a small int64 tensor sent before the data, so that a receiver (PP) or every rank (AGRS) can check
that both sides agree on what moves before a message of a mismatched size is posted (gloo aborts the process on
one, NCCL hangs or reads past the end).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

SLOT_ALIGNMENT = 32
"""Slots and session chunks start on 32-byte boundaries (every dtype's alignment, and DeepEP V2's rounding)."""

MAX_DIMS = 8
"""The most dimensions a header carries (a PP tensor or an AGRS tensor may have at most this many)."""

# Stable codes (index + 1); never reorder, only append. 0 in a header: unknown.
_DTYPES = tuple(d for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
    getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
    getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
) if d is not None)


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


def dtype_code(dtype: torch.dtype) -> int:
    """The header code of ``dtype`` (0 for a dtype without one: such tensors are refused by the callers)."""
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]) if 0 < code <= len(_DTYPES) else f"dtype code {code}"


def round_up(num_bytes: int, alignment: int = SLOT_ALIGNMENT) -> int:
    return -(-num_bytes // alignment) * alignment


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def host_header(values: list[int], length: int, device: torch.device) -> torch.Tensor:
    """``values`` padded with zeros to ``length`` int64, on ``device`` (the transport's: CPU for gloo)."""
    if len(values) > length:
        raise AssertionError(f"header of {len(values)} values > {length}")
    header = torch.zeros(length, dtype=torch.int64, device="cpu")
    header[: len(values)] = torch.tensor(values, dtype=torch.int64, device="cpu")
    return header if device.type == "cpu" else header.to(device)


def check_wire_tensor(error: type[Exception], service: str, op: str, arg: str, t: object,
                      device: torch.device) -> None:
    """Raise ``error`` naming ``arg`` unless ``t`` is a tensor on ``device`` of a dtype the headers carry
    (`dtype_code`) with at most `MAX_DIMS` dims. ``service``: ``"PP"`` or ``"AGRS"``, for the message."""
    if not isinstance(t, torch.Tensor):
        raise error(f"ep_moe.ElasticBuffer.{op}: argument '{arg}' must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
        raise error(f"ep_moe.ElasticBuffer.{op}: argument '{arg}' must be on device {device}, got {t.device}")
    if dtype_code(t.dtype) == 0:
        raise error(f"ep_moe.ElasticBuffer.{op}: argument '{arg}' has dtype {t.dtype}, which {service} does not "
                    "carry")
    if t.dim() > MAX_DIMS:
        raise error(f"ep_moe.ElasticBuffer.{op}: argument '{arg}' must have at most {MAX_DIMS} dims, got {t.dim()}")


def wait_work(work: dist.Work | None, device: torch.device, timeout_s: float, error: type[Exception], op: str,
              rank: int, num_ranks: int, stage: str) -> None:
    """Wait for ``work``. On CPU (gloo) with a deadline: a peer that never posts its side raises ``error``
    naming this rank and ``stage`` (another failure, e.g. a peer that died: a RuntimeError of the same
    wording; gloo then closes the pair: the group is unusable afterwards). On a GPU
    the current stream waits on the work; a missing peer is caught by the process group's watchdog."""
    if work is None:
        return
    if device.type != "cpu":
        work.wait()
        return
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        timed_out = "timeout" in str(exc).lower() or "timed out" in str(exc).lower()
        what = "timed out" if timed_out else "failed"
        raise (error if timed_out else RuntimeError)(f"ep_moe.ElasticBuffer.{op}: rank {rank} of {num_ranks} {what} in stage '{stage}' after "
                    f"waiting up to {timeout_s:g} s for its peer(s) ({exc})") from exc


__all__ = ["MAX_DIMS", "SLOT_ALIGNMENT", "TRANSPORTS", "TRANSPORT_ENV", "byte_view", "choose_transport",
           "dtype_code", "dtype_name", "host_header", "nbytes", "round_up", "wait_work"]
