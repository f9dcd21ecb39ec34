"""A `NativeBackend` without a GPU, for the tests of its host-side paths (tests/ is on sys.path).

`fake_native_backend` builds the backend object without its constructor (no symmetric memory, no kernels): every
field its calls read, with CPU tensors for the host words the kernels would write, and `FakeData` for the data
buffer. The test then puts its own fake kernels module in place of ``native_backend._c``.
"""

from __future__ import annotations

import torch

from ep_moe.backends import native_backend as nb
from ep_moe.config import NativeOptions

ERROR_WORDS = 16  # the fake kernels' error record (the real one is native/kernels/kernels.h's)


class FakeData:
    """The data buffer's fields the backend reads: its size, one pointer per rank and a host tensor of its bytes."""

    def __init__(self, nbytes: int, num_ranks: int = 1) -> None:
        self.nbytes, self.ptrs = nbytes, [0] * num_ranks
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)


def fake_native_backend(rank: int, num_ranks: int, fallback, data_bytes: int) -> nb.NativeBackend:
    """A `NativeBackend` of rank ``rank`` of ``num_ranks`` with the default options, ``fallback`` as its torch
    backend and a `FakeData` of ``data_bytes``; its kernels module is the caller's to provide."""
    b = nb.NativeBackend.__new__(nb.NativeBackend)
    b.group, b.rank, b.num_ranks, b.device, b.timeout_s = None, rank, num_ranks, torch.device("cpu"), 10.0
    b.options = NativeOptions()
    b._fallback, b._broken, b._destroyed = fallback, None, False
    b._use_error_words(torch.zeros(ERROR_WORDS + nb.MISMATCH_WORDS, dtype=torch.int32))
    b._host_counts = torch.zeros(8 * 9 + 8 * nb.HEADER_WORDS + nb.HEADER_LEN + 1, dtype=torch.int32)
    b._host_expert_counts = torch.zeros(1024, dtype=torch.int64)
    b._scratch = torch.zeros(64, dtype=torch.int32)
    b._buffer_env, b._envs = "env", {}
    b._envs[b.options] = b._buffer_env
    b._data, b._retired, b._route_layout, b._bound = FakeData(data_bytes, num_ranks), [], {}, {}
    b._bind_next = set()
    b._copy_streams, b._copy_flag_stream, b._copy_seq, b._copy_go = [], None, 0, None
    b._wait_for_stream = lambda: None  # nothing runs: the host wait returns at once
    b.trace_kernels, b.last_trace, b.last_push_blocks, b.last_copy_engine_trace = False, {}, {}, {}
    b.test_header_perturbation = None
    b.in_place_dispatches = b.expert_row_combines = 0
    return b
