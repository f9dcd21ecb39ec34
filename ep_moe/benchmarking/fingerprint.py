"""Order-sensitive fingerprints of tensors, computed on their device with no host sync.

A fingerprint lets a benchmark or a soak test check every call it makes without keeping every output:
after a call, ``fingerprint(*outputs)`` queues a few reductions on the current stream and returns a small
int64 tensor; the host compares the collected fingerprints with the expected ones once, at the end.

Each tensor's bytes are read as 32-bit words ``w_i`` (zero-padded to a multiple of 4 bytes) and summed as
``sum_i w_i * c_i`` in int64, where ``c_i`` is odd and pseudo-random in the position ``i``; integer sums wrap
modulo 2**64 whatever the order of the reduction, so the value is deterministic on every device; the shape
and dtype are added in (a CRC of their text). Any single changed word changes it (``c_i`` is odd), and so
does swapping two different words (``c_i != c_j``). Equal fingerprints are not a proof of equal bits, but a
stale, zeroed, reordered or partly written output changes them except with probability about 2**-64.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch

_MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (Knuth's golden-ratio hash)
# Per device, the coefficients of positions 0..n-1 for the largest n used so far: a smaller tensor takes a prefix,
# so the memory kept is that of the largest tensor, not the sum over every size seen (received row counts differ
# with every input set: one table per size would grow to gigabytes over a benchmark's token sweep).
_coefficients: dict[torch.device, torch.Tensor] = {}


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as int64 values of its 32-bit words (little-endian, zero-padded)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    return data.view(torch.int32).to(torch.int64)


def _coefficients_for(count: int, device: torch.device) -> torch.Tensor:
    table = _coefficients.get(device)
    if table is None or table.numel() < count:
        position = torch.arange(count, dtype=torch.int64, device=device)
        table = _coefficients[device] = (position * _MULTIPLIER) | 1  # odd, different for every position
    return table[:count]


def fingerprint(*tensors: torch.Tensor | None) -> torch.Tensor:
    """``[len(tensors)]`` int64 on the tensors' device (all on one device): one order-sensitive fingerprint per
    tensor (0 for None; an empty tensor's depends on its shape and dtype only). Queued on the current stream;
    nothing waits for the device."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"fingerprint: argument 'tensors' must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    values = []
    for t in tensors:
        if t is None:
            values.append(torch.zeros((), dtype=torch.int64, device=device))
            continue
        layout = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode())  # empty tensors of other shapes differ too
        if t.numel() == 0:
            values.append(torch.full((), layout, dtype=torch.int64, device=device))
            continue
        words = _words(t)
        values.append((words * _coefficients_for(words.numel(), device)).sum() + layout)
    return torch.stack(values)


def fingerprint_outputs(outputs: Mapping[str, object], device: torch.device
                        ) -> tuple[tuple[str, ...], tuple[str, ...], torch.Tensor, tuple]:
    """A call's named outputs, for a later comparison, without waiting for ``device``: ``(the names of the
    tensors on device and of the None outputs, the names of the others, the former's fingerprints [n] int64
    on device, the others as plain host data)``. Host data: ints, lists of ints, and tensors elsewhere (host
    counts) as lists."""
    device_names = tuple(n for n, v in outputs.items() if v is None or (isinstance(v, torch.Tensor)
                                                                        and v.device == device))
    host_names = tuple(n for n in outputs if n not in device_names)
    values = (fingerprint(*(outputs[n] for n in device_names)) if device_names
              else torch.zeros(0, dtype=torch.int64, device=device))
    host = tuple(outputs[n].tolist() if isinstance(outputs[n], torch.Tensor) else outputs[n] for n in host_names)
    return device_names, host_names, values, host
