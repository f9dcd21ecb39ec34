"""The wire format PP and AGRS (`ep_moe.elastic.pipeline_comm`, `ep_moe.elastic.agrs`) share on the
torch.distributed transport: stable dtype codes for their headers, the header tensor, byte views of tensors, the
32-byte slot rounding, and the check that a tensor can be carried.

A header is a small int64 tensor sent before the data, so that a receiver (PP) or every rank (AGRS) can check
that both sides agree on what moves before a message of a mismatched size is posted (gloo aborts the process on
one, NCCL hangs or reads past the end).
"""

from __future__ import annotations

import math

import torch

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


__all__ = ["MAX_DIMS", "SLOT_ALIGNMENT", "byte_view", "check_wire_tensor", "dtype_code", "dtype_name", "host_header",
           "nbytes", "round_up"]
