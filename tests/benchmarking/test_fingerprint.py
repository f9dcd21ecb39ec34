"""`ep_moe.benchmarking.fingerprint`: equal outputs agree; a changed, stale, zeroed, reordered, reshaped or
retyped one does not; host items are kept as data."""

from __future__ import annotations

import pytest
import torch

from ep_moe.benchmarking.fingerprint import fingerprint, fingerprint_outputs


def test_equal_outputs_agree_and_every_kind_of_wrong_one_differs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    same = fingerprint(x.clone())
    assert torch.equal(fingerprint(x), same)
    changed = x.clone()
    changed[17, 5] = changed[17, 5] + 1
    stale = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    wrong = {"one element": changed, "another input's output": stale, "zeros": torch.zeros_like(x),
             "rows swapped": x[[1, 0, *range(2, 64)]], "reshaped": x.reshape(48, 64),
             "other dtype, same bytes": x.view(torch.int16), "a prefix": x[:63]}
    for what, other in wrong.items():
        assert not torch.equal(fingerprint(other), same), what
    assert fingerprint(None).tolist() == [0]
    assert not torch.equal(fingerprint(torch.zeros(0, 8)), fingerprint(torch.zeros(0, 4)))  # empty, other shape
    odd = torch.arange(7, dtype=torch.uint8)  # 7 bytes: padded to whole words
    assert not torch.equal(fingerprint(odd), fingerprint(torch.arange(8, dtype=torch.uint8)))


def test_fingerprint_outputs_splits_device_tensors_from_host_data():
    x, idx = torch.randn(4, 8), torch.arange(6).view(2, 3)
    names, host_names, values, host = fingerprint_outputs(
        {"x": x, "idx": idx, "none": None, "counts": [3, 1, 2], "rows": 5}, torch.device("cpu"))
    assert names == ("x", "idx", "none") and host_names == ("counts", "rows")
    assert torch.equal(values, fingerprint(x, idx, None)) and host == ([3, 1, 2], 5)
    # a tensor on another device than the outputs' (host counts next to GPU rows) is host data
    names, host_names, values, host = fingerprint_outputs(
        {"rows": torch.empty(3, 2, device="meta"), "counts": torch.tensor([4, 5])}, torch.device("meta"))
    assert names == ("rows",) and host_names == ("counts",) and host == ([4, 5],) and values.device.type == "meta"
    assert fingerprint_outputs({"n": 1}, torch.device("cpu"))[2].numel() == 0
    with pytest.raises(ValueError, match="one device"):
        fingerprint(x, torch.empty(1, device="meta"))


def test_one_coefficient_table_per_device_whatever_the_sizes():
    """A tensor's fingerprint does not depend on which sizes were fingerprinted before, and the coefficients
    kept are those of the largest size only (a benchmark sees a new row count with every input set)."""
    from ep_moe.benchmarking import fingerprint as module

    small = torch.arange(10, dtype=torch.int32)
    module._coefficients.clear()
    before = fingerprint(small)
    for size in (1000, 37, 5000, 12):
        fingerprint(torch.ones(size, dtype=torch.int32))
    assert torch.equal(fingerprint(small), before)
    assert list(module._coefficients) == [torch.device("cpu")]
    assert module._coefficients[torch.device("cpu")].numel() == 5000
