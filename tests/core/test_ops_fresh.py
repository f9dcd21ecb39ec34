"""The custom ops copy an output only where it shares memory with an input or an earlier output (torch refuses such
outputs): a view (which under inference mode carries no ``_base``), the input itself (a one-rank backend may hand
it back) or two outputs cut from one allocation."""

from __future__ import annotations

import torch

from ep_moe.buffer.autograd_ops import _fresh


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_an_output_sharing_memory_is_copied():
    x = torch.randn(4, 3)
    (same,) = _fresh((x,), (x,))
    assert same is not x and torch.equal(same, x)
    (view,) = _fresh((x[1:],), (torch.ones(1), x))  # a view with _base
    assert _storage(view) != _storage(x)
    with torch.inference_mode():
        y = torch.randn(4, 3)
        head, tail = y[:2], y[2:]
        assert head._base is None  # why the storages are compared
        (copied,) = _fresh((head,), (y,))
        assert _storage(copied) != _storage(y) and torch.equal(copied, head)
        both = torch.randn(2, 5)
        first, second = _fresh((both[0], both[1]), (y,))  # two outputs of one allocation
        assert first is both[0] or _storage(first) == _storage(both)
        assert _storage(second) != _storage(first) and torch.equal(second, both[1])
        assert _fresh((head, tail), ())[0] is head  # the first of two is kept


def test_an_output_of_its_own_is_returned_as_is():
    z, x, empty = torch.randn(2), torch.randn(4, 3), torch.empty(0, 3)
    assert _fresh((z, empty), (x, None, torch.empty(0)))[0] is z
    assert _fresh((z, empty), (x,))[1] is empty


@torch.library.custom_op("ep_moe_test::hand_back", mutates_args=())
def _hand_back(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fresh(_HANDED_BACK[0], (x,))


_HANDED_BACK: list[tuple] = []


def test_empty_outputs_of_one_allocation_pass_torchs_own_check():
    """A rank that receives no rows returns empty views of one allocation: torch's alias check compares storages,
    not addresses, so they must be copied as well (the op itself is the judge)."""
    x = torch.randn(3)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            pool, nothing = torch.empty(64), torch.empty(0)
            cases = [(pool[:0], pool[8:8].view(0, 4), torch.empty(2)),  # two empty views of one allocation
                     (nothing, nothing.view(0, 2)),                      # an empty tensor and its view
                     (torch.empty(0), x[:0])]                            # an empty view of the input
            for outputs in cases:
                _HANDED_BACK[:] = [outputs]
                returned = _hand_back(x)
                assert [tuple(t.shape) for t in returned] == [tuple(t.shape) for t in outputs]
