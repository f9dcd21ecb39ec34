"""`ElasticBuffer`'s GPU segment as the dispatch/combine memory (docs/semantics.md, "ElasticBuffer: memory types and
Engram"), what CPU ranks (gloo, torch backend) can check:

* sizes: an elastic or hybrid buffer whose ``num_bytes`` is below `get_buffer_size_hint` of its stated settings
  raises a ValueError naming ``num_bytes`` on every rank at construction; the GPU type takes the same size as
  before (its native backend grows);
* a fixed-size call (``do_cpu_sync=False``) whose bound does not fit the segment raises a ValueError naming
  ``num_bytes`` on every rank before anything is sent, and the next call that fits equals the GPU type's result
  bit for bit (every rank stayed in step);
* the torch backend keeps its own memory (nothing is placed in the segment, ``comm_memory_in_segment`` False, the
  `Buffer` records 0 bytes), and on the CPU ``share_gpu`` exports nothing;
* `destroy` releases the backend first, then the memory it may live in, each once.

The GPU side (the native backend's memory inside the segment, no second allocation, bit-for-bit results) is
tests/native/test_elastic_segment_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.world_sizes import run_world_sizes

from ep_moe import ElasticBuffer
from ep_moe.elastic.memory import ALIGNMENT_BYTES, SymmetricMemory

SIZES = dict(num_max_tokens_per_rank=1024, hidden=1024, num_topk=4)  # a hint of a few 2 MiB granules
T, H, K, E = 8, 256, 2, 12  # the calls' shapes


def _raises(fn, text: str) -> None:
    try:
        fn()
    except ValueError as exc:
        assert text in str(exc), str(exc)
    else:
        raise AssertionError(f"no ValueError with {text!r}")


def _inputs(rank: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    idx[0] = -1  # a token that goes nowhere
    return x, idx, torch.rand(T, K, generator=g)


def _check_sizes(num_ranks: int, group) -> int:
    hint = ElasticBuffer.get_buffer_size_hint(group, **SIZES)
    small = hint - ALIGNMENT_BYTES
    assert small >= ALIGNMENT_BYTES
    for hybrid in (True, False):
        _raises(lambda hybrid=hybrid: ElasticBuffer(group, num_bytes=small, num_cpu_bytes=1, allow_hybrid_mode=hybrid,
                                                    backend="torch", **SIZES), "argument 'num_bytes'")
    gpu = ElasticBuffer(group, num_bytes=small, backend="torch", explicitly_destroy=True, **SIZES)  # unchanged
    assert gpu.memory_type == "gpu" and gpu.memory is None and not gpu.comm_memory_in_segment
    assert gpu.buffer.num_nvl_bytes == small
    gpu.destroy()
    for hybrid in (True, False):
        eb = ElasticBuffer(group, num_cpu_bytes=1, allow_hybrid_mode=hybrid, backend="torch", explicitly_destroy=True,
                           **SIZES)  # num_bytes=None: the hint
        assert eb.memory_type == ("hybrid" if hybrid and num_ranks > 1 else "elastic")
        assert eb.num_bytes == hint and eb.memory.gpu.numel() == hint
        assert not eb.comm_memory_in_segment and eb.buffer.num_nvl_bytes == 0  # the torch backend's own memory
        assert eb.memory.gpu_fd == -1
        eb.destroy()
    return 2


def _check_fixed_size_call(rank: int, num_ranks: int, group) -> int:
    eb = ElasticBuffer(group, num_bytes=ALIGNMENT_BYTES, num_cpu_bytes=1, backend="torch", explicitly_destroy=True)
    gpu = ElasticBuffer(group, backend="torch", explicitly_destroy=True)
    x, idx, w = _inputs(rank, num_ranks)
    for do_expand in (False, True):
        _raises(lambda do_expand=do_expand: eb.dispatch(x, idx, w, num_experts=E, num_max_tokens_per_rank=4096,
                                                        do_cpu_sync=False, do_expand=do_expand),
                "argument 'num_bytes'")
        outs = [b.dispatch(x, idx, w, num_experts=E, num_max_tokens_per_rank=T, do_cpu_sync=False,
                           do_expand=do_expand) for b in (eb, gpu)]
        for got, want in zip(outs[0][:3], outs[1][:3], strict=True):  # (expanded: recv_topk_idx is None)
            assert (got is None and want is None) or torch.equal(got, want)
        y = outs[0][0].detach() * 2
        assert torch.equal(eb.combine(y, outs[0][3])[0], gpu.combine(y, outs[1][3])[0])
    eb.destroy()
    gpu.destroy()
    return 2


def _check_destroy_order(num_ranks: int, group) -> int:
    eb = ElasticBuffer(group, num_cpu_bytes=1, backend="torch", explicitly_destroy=True, **SIZES)
    order: list[str] = []
    buffer_destroy, memory_close = eb.buffer.destroy, eb.memory.close
    eb.buffer.destroy = lambda: (order.append("backend"), buffer_destroy())[1]
    eb.memory.close = lambda: (order.append("memory"), memory_close())[1]
    eb.destroy()
    eb.destroy()  # idempotent: nothing is released twice
    assert order == ["backend", "memory"] and eb.memory is None, order
    return 1


def _cpu_share_exports_nothing(group: dist.ProcessGroup) -> int:
    memory = SymmetricMemory("elastic", group, ALIGNMENT_BYTES, 1, torch.device("cpu"), share_gpu=True)
    assert memory.gpu_fd == -1 and memory.gpu.numel() == ALIGNMENT_BYTES
    memory.close()
    return 1


def _worker(rank: int, num_ranks: int, group) -> int:
    return (_check_sizes(num_ranks, group) + _check_fixed_size_call(rank, num_ranks, group)
            + _check_destroy_order(num_ranks, group) + _cpu_share_exports_nothing(group or dist.group.WORLD))


@pytest.fixture(scope="module")
def checked_by_world_size() -> dict[int, list[int]]:
    """`_worker` at 1 and 3 ranks: 3 spawned ranks, 1 on a subgroup of them."""
    return run_world_sizes(_worker, (1, 3), timeout_s=60, join_timeout_s=300)


@pytest.mark.parametrize("num_ranks", [1, 3])
def test_segment_sizes_fixed_calls_and_destroy_order(checked_by_world_size, num_ranks: int) -> None:
    assert checked_by_world_size[num_ranks] == [6] * num_ranks
