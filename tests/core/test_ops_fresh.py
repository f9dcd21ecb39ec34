"""The custom ops copy an output only where it shares memory with an input (torch refuses such outputs): a view
(which under inference mode carries no ``_base``) or the input itself, as a one-rank backend may hand back."""

from __future__ import annotations

import torch

from ep_moe.ops import _fresh


def test_an_output_sharing_an_inputs_memory_is_copied():
    x = torch.randn(4, 3)
    assert _fresh(x, (x,)) is not x and torch.equal(_fresh(x, (x,)), x)
    assert _fresh(x[1:], (torch.ones(1), x)) is not x  # a view with _base
    with torch.inference_mode():
        y = torch.randn(4, 3)
        view = y[:2]
        assert view._base is None  # why the storages are compared
        copied = _fresh(view, (y,))
        assert copied.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
        assert torch.equal(copied, view)


def test_an_output_of_its_own_is_returned_as_is():
    z, x = torch.randn(2), torch.randn(4, 3)
    assert _fresh(z, (x, None, torch.empty(0))) is z
    empty = torch.empty(0, 3)
    assert _fresh(empty, (torch.empty(0, 3),)) is empty
