"""`support.bits`: equal means same dtype, shape, device kind and bytes (the sign of zero and NaN payloads count);
the message names what differs and the first differing element."""

from __future__ import annotations

import pytest
import torch

from support.bits import assert_bits_equal, bit_difference, bits, bits_equal


def _nan(payload: int) -> torch.Tensor:
    return torch.tensor([0x7FC00000 | payload], dtype=torch.int32).view(torch.float32)


def test_equal_tensors_have_no_difference():
    x = torch.randn(4, 6)
    assert bit_difference(x.clone(), x) is None
    assert bit_difference(x.t().contiguous().t(), x) is None  # strides do not matter
    assert bit_difference(torch.empty(0, 3), torch.empty(0, 3)) is None
    assert bit_difference(torch.tensor(2.5), torch.tensor(2.5)) is None
    assert bit_difference(None, None) is None
    assert bits(torch.tensor([1.0, -0.0])).tolist() == [0, 0, 128, 63, 0, 0, 0, 128]


@pytest.mark.parametrize("got, want, words", [
    (torch.tensor([1.0, 0.0]), torch.tensor([1.0, -0.0]), ["1 of 2 elements", "index (1,)", "00000000", "00000080"]),
    (_nan(1), _nan(2), ["index (0,)", "0100c07f", "0200c07f"]),
    (torch.zeros(2, 3).index_fill_(1, torch.tensor([2]), 7.0), torch.zeros(2, 3), ["2 of 6", "index (0, 2)", "7.0"]),
    (torch.zeros(3), torch.zeros(3, dtype=torch.int32), ["dtype torch.float32", "expected torch.int32"]),
    (torch.zeros(3), torch.zeros(1, 3), ["shape (3,)", "expected (1, 3)"]),
    (torch.zeros(3, device="meta"), torch.zeros(3), ["device meta", "expected cpu"]),
    ([0.0], torch.zeros(1), ["expected a tensor, got list"]),
    (None, torch.zeros(1), ["expected a tensor, got NoneType"]),
    (torch.zeros(1), None, ["expected None, got Tensor"]),
    (torch.ones(2, dtype=torch.float8_e4m3fn), torch.zeros(2, dtype=torch.float8_e4m3fn), ["2 of 2", "bytes 38"]),
])
def test_a_difference_is_named(got, want, words):
    difference = bit_difference(got, want)
    assert difference is not None and all(w in difference for w in words), difference
    assert not bits_equal(got, want)
    with pytest.raises(AssertionError, match="^recv_x: "):
        assert_bits_equal(got, want, "recv_x")


def test_on_host_compares_the_bytes_whatever_the_devices():
    x = torch.randn(5)
    assert bits_equal(x.to("meta"), x) is False  # the device kind counts by default
    assert bits_equal(x.clone(), x, on_host=True)
    assert not bits_equal(x + 1, x, on_host=True)
