"""CPU side of the native backend's rank-disagreement check (docs/native.md, "Rank agreement"): the records
its kernels write are turned into the torch backend's `ValueError` wording, and the Python mirrors of the
record layout match kernels/kernels.h. The kernels themselves run in tests/native/test_native_mismatch_gpu.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ep_moe.backends import agreement
from ep_moe.backends.native_backend import (
    HEADER_WORDS,
    MAX_RANKS,
    MISMATCH_WORDS,
    mismatch_error,
    parse_header_check,
    parse_mismatch_record,
)

KERNELS = Path(__file__).parents[2] / "ep_moe" / "native" / "kernels"


def _header(op=agreement.OP_DISPATCH, hidden=128, dtype=torch.bfloat16, scales=0, topk=2, experts=8, worst=0,
            layout=0) -> list[int]:
    return [*agreement.header(op, hidden, dtype, scales, topk, experts, worst), layout]


def _record(rank: int, own: list[int], seen: list[list[int]]) -> list[int]:
    """A mismatch record as the kernels write it (kernels/kernels.h, MismatchWord)."""
    words = [0] * MISMATCH_WORDS
    words[0], words[1], words[2] = own[0], rank, len(seen)
    words[3:3 + 8] = own
    for r, h in enumerate(seen):
        words[11 + 8 * r:11 + 8 * (r + 1)] = h
    return words


def _torch_message(op_name: str, headers: list[list[int]]) -> str:
    with pytest.raises(ValueError) as info:
        agreement.check_headers(op_name, headers)
    return str(info.value)


@pytest.mark.parametrize("num_ranks", [2, 3, 8])
def test_record_raises_the_torch_backends_message(num_ranks: int) -> None:
    headers = [_header() for _ in range(num_ranks - 1)] + [_header(hidden=64, dtype=torch.float32)]
    for rank in range(num_ranks):  # every rank's record holds the same headers: the same message
        error = parse_mismatch_record(_record(rank, headers[rank], headers))
        assert isinstance(error, ValueError)
        assert str(error) == _torch_message("dispatch", headers)
    assert "the hidden size" in str(error) and "the dtype" in str(error)


@pytest.mark.parametrize("op, name", [(agreement.OP_CACHED_DISPATCH, "dispatch"), (agreement.OP_COMBINE, "combine"),
                                      (agreement.OP_BARRIER, "barrier")])
def test_operation_names(op: int, name: str) -> None:
    a, b = _header(op=op, layout=17), _header(op=op, layout=99)
    message = str(parse_mismatch_record(_record(0, a, [a, b])))
    assert message == _torch_message(name, [a, b])
    if op != agreement.OP_BARRIER:
        assert "the handle (the layout of the dispatch that made it): rank 0 has layout 0x00000011" in message


def test_operations_that_differ_name_the_barrier() -> None:
    combine, barrier = _header(op=agreement.OP_COMBINE), [agreement.OP_BARRIER] + [0] * 7
    message = str(parse_mismatch_record(_record(1, barrier, [combine, barrier])))
    assert message == "ep_moe.barrier: ranks disagree on the operation: rank 0 has combine, rank 1 has barrier"


def test_equal_headers_mean_the_copy_engine_choice() -> None:
    a = _header(op=agreement.OP_COMBINE, layout=5)
    message = str(parse_mismatch_record(_record(0, a, [a, a])))
    assert message.startswith("ep_moe.combine: ranks disagree on taking the copy engine for this call")


def test_empty_record_is_none() -> None:
    assert parse_mismatch_record([0] * MISMATCH_WORDS) is None


def test_test_perturbation_names_the_call_and_what_the_kernel_saw() -> None:
    """One rank, its own header seen with the hidden size + 1 (NativeBackend.test_header_perturbation)."""
    own = _header()
    seen = [_header(hidden=129)]
    message = str(mismatch_error(0, own, seen))
    assert message == ("ep_moe.dispatch: ranks disagree on the hidden size: rank 0's own call has 128, "
                       "rank 0 as seen by rank 0's kernel has 129")


def test_header_check_words() -> None:
    """What a notify or a header exchange writes after the counts: every header as seen (with the copy-engine
    words), this rank's own, the verdict."""
    num_ranks = 3
    seen = [_header() + [0, 5], _header() + [0, 7], _header(topk=3) + [0, 2]]
    words = [w for h in seen for w in h] + _header() + [1]
    disagree, own, got = parse_header_check(words, num_ranks)
    assert disagree and own == _header() and got == seen
    assert len(seen[0]) == HEADER_WORDS


def test_labels_group_like_ranks() -> None:
    a, b = _header(op=agreement.OP_COMBINE, hidden=1), _header(op=agreement.OP_COMBINE, hidden=2)
    assert agreement.mismatch_message("combine", [a, b, a], ["x", "y", "z"]) == \
        "ep_moe.combine: ranks disagree on the hidden size: x, z have 1, y has 2"
    assert agreement.mismatch_message("combine", [a, a]) is None


def test_mirrors_match_kernels_h() -> None:
    """HEADER_WORDS, MAX_RANKS, MISMATCH_WORDS and the operation codes are those of kernels/kernels.h (the
    backend also compares them with the kernels' constants)."""
    text = (KERNELS / "kernels.h").read_text()
    assert int(re.search(r"constexpr int kHeaderLen = (\d+);", text).group(1)) == agreement.HEADER_LEN
    assert int(re.search(r"constexpr int kHeaderWords = (\d+);", text).group(1)) == HEADER_WORDS
    assert int(re.search(r"constexpr int kMaxRanks = (\d+);", text).group(1)) == MAX_RANKS
    ops = re.search(r"enum HeaderOp \{ kOpDispatch = (\d+), kOpCachedDispatch = (\d+), kOpCombine = (\d+), "
                    r"kOpBarrier = (\d+) \};", text)
    assert tuple(map(int, ops.groups())) == (agreement.OP_DISPATCH, agreement.OP_CACHED_DISPATCH,
                                             agreement.OP_COMBINE, agreement.OP_BARRIER)
    words = re.search(r"enum MismatchWord \{ kMismatchFound = 0, kMismatchRank, kMismatchRanks, kMismatchOwn,\s*"
                      r"kMismatchSeen = kMismatchOwn \+ kHeaderLen,\s*"
                      r"kMismatchWords = kMismatchSeen \+ kMaxRanks \* kHeaderLen \};", text)
    assert words is not None and MISMATCH_WORDS == 3 + agreement.HEADER_LEN + MAX_RANKS * agreement.HEADER_LEN
