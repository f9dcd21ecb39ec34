"""Bit-for-bit tensor comparison: dtype, shape, device kind and every byte (NaN payloads and the sign of zero
included), with a message that names what differs and the first differing element."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``.

    Args:
        t: any tensor (any dtype, shape, strides or device; 0-dim and empty included).

    Returns:
        ``[t.numel() * t.element_size()]`` uint8 on ``t``'s device: the bytes of ``t``'s elements in row-major order.
    """
    return t.contiguous().reshape(-1).view(torch.uint8)


def bit_difference(got: object, want: torch.Tensor | None, *, on_host: bool = False) -> str | None:
    """What tells ``got`` from ``want``, or None where ``got`` is a tensor of ``want``'s dtype, shape and device
    kind with the very same bytes (or both are None: an output that a mode does not return).

    Args:
        got: the value under test (anything; a non-tensor is a difference).
        want: the expected tensor, or None where ``got`` must be None.
        on_host: compare copies of both on the host, whatever their devices (a device result against a CPU
            reference); the device kind is then not compared.

    Returns:
        None when equal; else one line naming the first of type, dtype, shape, device kind, or bytes that differs
        (for bytes: the count of differing elements, the first one's index and both its values).
    """
    if want is None:
        return None if got is None else f"expected None, got {type(got).__name__}"
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if on_host:
        got, want = got.detach().cpu(), want.detach().cpu()
    if got.device.type != want.device.type:
        return f"device {got.device.type}, expected {want.device.type}"
    a, b = bits(got), bits(want)
    if a.device != b.device:  # same kind, another index
        a, b = a.cpu(), b.cpu()
    differs = (a.view(-1, got.element_size()) != b.view(-1, want.element_size())).any(dim=1).cpu()
    if not differs.any():
        return None
    first = int(differs.nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(got.shape))) if got.dim() else ()
    return (f"{int(differs.sum())} of {got.numel()} elements differ; the first at index {index}: "
            f"{_element(got, index)}, expected {_element(want, index)}")


def bits_equal(got: object, want: torch.Tensor | None, *, on_host: bool = False) -> bool:
    """True where `bit_difference` finds none."""
    return bit_difference(got, want, on_host=on_host) is None


def assert_bits_equal(got: object, want: torch.Tensor | None, what: str = "tensor", *,
                      on_host: bool = False) -> None:
    """Raises AssertionError (``"<what>: <the difference>"``) where `bit_difference` finds one."""
    difference = bit_difference(got, want, on_host=on_host)
    if difference is not None:
        raise AssertionError(f"{what}: {difference}")


def _element(t: torch.Tensor, index: tuple[int, ...]) -> str:
    """One element's value and its bytes in hex (low address first)."""
    one = t[index] if index else t
    raw = bytes(bits(one).cpu().tolist()).hex()
    value = one.float().item() if one.dtype.is_floating_point and one.element_size() == 1 else one.item()
    return f"{value!r} (bytes {raw})"
