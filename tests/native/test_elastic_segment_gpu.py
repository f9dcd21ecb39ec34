"""`ElasticBuffer`'s GPU segment as the native backend's dispatch/combine memory, on ONE GPU shared by 2-4 processes
(`support.shared_gpu`: gloo, ``cuda:0``, ``EP_MOE_SYMMETRIC_MEMORY=vmm``; docs/semantics.md, "ElasticBuffer: memory
types and Engram"):

* elastic (``allow_hybrid_mode=False``) and hybrid memory: the native backend's data buffer is the segment (its
  address is ``memory.gpu``'s, the peers' copies are mapped from their segments, the host bytes follow in the same
  range), and the backend allocated none of its own (``data_allocations == 0``);
* no second allocation: the device memory used outside torch's caching allocator over construction and every
  call is the segments (plus the small control blocks and kernel modules, at most `SLACK` per rank), and it comes
  back after `destroy`; the GPU type, for contrast, allocates its own data buffer on first use;
* compact and expanded layouts, exact and fixed size, combine, cached dispatch equal the torch backend bit for bit
  (`test_native_shared_gpu._check_elastic`), and Engram still reads the host segments;
* a segment too small for a call: a fixed-size call raises ValueError naming ``num_bytes`` before anything is
  sent, an exact-size one after its count exchange (every rank alike), and the next call that fits still equals
  the torch backend.

Run: ``pytest -m gpu tests/native/test_elastic_segment_gpu.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from support.bits import assert_bits_equal
from support.shared_gpu import DEVICE, run_on_one_gpu, skip_unless_shared_gpu_runs
from test_native_gpu import on_device
from test_native_shared_gpu import BUFFER_TIMEOUT_S, ELASTIC_CASE, _check_elastic

from ep_moe.elastic.memory.cuda_vmm import vmm_unavailable_reason

pytestmark = pytest.mark.gpu

SEGMENT_BYTES = 256 << 20  # large beside everything else, so that a second data buffer could not hide
# Per rank, beside the segment: the control block (2 MiB), the kernel modules and what the context reserves when
# the first kernels load. 74 MiB on one H200, the same for the elastic and hybrid types; a second data buffer shows in ``data_allocations`` whatever its size.
SLACK = 96 << 20


def _skip_unless_segments_run() -> None:
    skip_unless_shared_gpu_runs()
    reason = vmm_unavailable_reason(DEVICE, exportable=True, host=True)
    if reason is not None:
        pytest.skip(f"elastic / hybrid memory cannot be mapped here: {reason}")


def _settle() -> tuple[int, int]:
    """(free device bytes, this process's reserved bytes) once every rank got here with its work done."""
    gc.collect()
    torch.cuda.synchronize(DEVICE)
    dist.barrier()
    free, reserved = torch.cuda.mem_get_info(DEVICE)[0], torch.cuda.memory_reserved(DEVICE)
    dist.barrier()
    return free, reserved


def _outside_torch(before: tuple[int, int], after: tuple[int, int]) -> int:
    """Device bytes all ranks took between two `_settle` points, less what torch's caching allocator reserved."""
    reserved = torch.tensor([after[1] - before[1]], dtype=torch.int64)
    dist.all_reduce(reserved)
    return (before[0] - after[0]) - int(reserved)


def _check_peers_see_segments(data, memory, rank: int, world: int) -> None:
    """Every rank's copy of the data buffer, as seen here, holds what its owner wrote into its own segment."""
    memory.gpu[:4096].fill_(rank + 1)
    torch.cuda.synchronize(DEVICE)
    dist.barrier()
    for owner in range(world):
        seen = data.peer_tensor(owner)[:4096]
        assert bool((seen == owner + 1).all()), f"rank {rank} reads rank {owner}'s segment wrong"
    dist.barrier()


def _segment_worker(rank: int, world: int, hybrid: bool) -> int:
    from ep_moe import ElasticBuffer

    torch.zeros(1, device=DEVICE)  # this process's context exists before the first measurement
    sizes = dict(num_max_tokens_per_rank=ELASTIC_CASE["tokens"], hidden=ELASTIC_CASE["hidden"],
                 num_topk=ELASTIC_CASE["topk"], num_gpu_timeout_secs=BUFFER_TIMEOUT_S)
    ref = ElasticBuffer(dist.group.WORLD, backend="torch", **sizes)
    start = _settle()
    nat = ElasticBuffer(dist.group.WORLD, num_bytes=SEGMENT_BYTES, num_cpu_bytes=1, allow_hybrid_mode=hybrid,
                        explicitly_destroy=True, **sizes)
    want_type = "hybrid" if hybrid else "elastic"
    assert nat.memory_type == want_type and nat.buffer.backend_name == "native", (nat.memory_type, nat.buffer)
    assert nat.comm_memory_in_segment
    backend, memory = nat.buffer.backend, nat.memory
    data = backend._data
    gpu_start = memory.gpu.data_ptr()
    assert data.tensor.data_ptr() == data.ptrs[rank] == gpu_start and data.nbytes == memory.gpu.numel()
    assert memory.host_span().data_ptr() == gpu_start + SEGMENT_BYTES  # one range: GPU bytes, then host bytes
    assert memory.gpu_fd == -1  # shared, then closed
    _check_peers_see_segments(data, memory, rank, world)
    built = _settle()
    checked = _check_elastic(nat, ref, rank, world)
    if hybrid:  # the host segments after the GPU one still serve Engram (the direct path)
        table = torch.arange(8 * 64, dtype=torch.float32).view(8, 64) + 1000 * rank
        nat.engram_write(table.to(DEVICE))
        ids = torch.randint(0, 8 * world, (16, 3), dtype=torch.int32)
        fetched = nat.engram_fetch(ids.to(DEVICE))()[0]
        tables = torch.cat([torch.arange(8 * 64, dtype=torch.float32).view(8, 64) + 1000 * r for r in range(world)])
        assert torch.equal(fetched.cpu(), tables[ids.long()])
    used = _settle()
    assert backend._data is data and backend.data_allocations == 0 and backend._retired == []
    construction, calls = _outside_torch(start, built), _outside_torch(built, used)
    assert world * SEGMENT_BYTES <= construction <= world * (SEGMENT_BYTES + SLACK), (construction, world)
    assert calls <= world * SLACK, calls  # no data buffer appeared on first use
    nat.destroy()
    del data, backend, memory
    released = _settle()
    assert _outside_torch(start, released) <= world * SLACK, "the segments were not released"
    ref.destroy()
    return checked


def _gpu_type_worker(rank: int, world: int) -> int:
    """For contrast: the GPU memory type keeps the native backend's own memory, allocated on first use."""
    from ep_moe import ElasticBuffer

    sizes = dict(num_max_tokens_per_rank=ELASTIC_CASE["tokens"], hidden=ELASTIC_CASE["hidden"],
                 num_topk=ELASTIC_CASE["topk"], num_gpu_timeout_secs=BUFFER_TIMEOUT_S)
    nat = ElasticBuffer(dist.group.WORLD, explicitly_destroy=True, **sizes)
    ref = ElasticBuffer(dist.group.WORLD, backend="torch", **sizes)
    assert nat.memory_type == "gpu" and nat.memory is None and not nat.comm_memory_in_segment
    checked = _check_elastic(nat, ref, rank, world)
    assert nat.buffer.backend.data_allocations >= 1 and nat.buffer.backend._fixed_data is None
    nat.destroy()
    ref.destroy()
    return checked


def _routed_to_every_rank(tokens: int, hidden: int, rank: int, world: int, experts: int):
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.arange(world) * (experts // world)] * tokens).to(torch.int64)  # every rank once
    return x, idx, torch.rand(tokens, world, generator=g)


def _too_small_worker(rank: int, world: int) -> int:
    from ep_moe import ElasticBuffer

    experts, hidden = 4 * world, 1024
    nat = ElasticBuffer(dist.group.WORLD, num_bytes=2 << 20, num_cpu_bytes=1, allow_hybrid_mode=False,
                        num_gpu_timeout_secs=BUFFER_TIMEOUT_S, explicitly_destroy=True)
    ref = ElasticBuffer(dist.group.WORLD, backend="torch")
    assert nat.comm_memory_in_segment and nat.buffer.backend._data.nbytes == 2 << 20
    big = _routed_to_every_rank(1024, hidden, rank, world, experts)  # world x 2 MiB of rows for every rank
    on_gpu = [on_device(DEVICE, t) for t in big]
    for kwargs in (dict(do_cpu_sync=False, num_max_tokens_per_rank=1024), dict(do_cpu_sync=True)):
        with pytest.raises(ValueError, match="argument 'num_bytes'"):
            nat.dispatch(*on_gpu, num_experts=experts, num_sms=8, **kwargs)
        small = _routed_to_every_rank(16, hidden, rank, world, experts)
        outs = [b.dispatch(*[on_device(b.buffer.device, t) for t in small], num_experts=experts, num_sms=8,
                           do_cpu_sync=False, num_max_tokens_per_rank=16) for b in (nat, ref)]
        for name, got, want in zip(("recv_x", "recv_topk_idx", "recv_topk_weights"), outs[0][:3], outs[1][:3],
                                   strict=True):
            assert_bits_equal(got, want, f"after {kwargs}: {name}", on_host=True)
        y = outs[1][0]
        assert_bits_equal(nat.combine(on_device(DEVICE, y), outs[0][3])[0], ref.combine(y, outs[1][3])[0], f"after {kwargs}: combined", on_host=True)
    assert nat.buffer.backend.data_allocations == 0
    nat.barrier()
    nat.destroy()
    ref.destroy()
    return 2


@pytest.mark.parametrize("hybrid, world", [(False, 2), (False, 4), (True, 2), (True, 3)])
def test_dispatch_combine_live_in_the_segment(hybrid: bool, world: int) -> None:
    _skip_unless_segments_run()
    assert run_on_one_gpu(_segment_worker, world, hybrid, timeout_s=180, join_timeout_s=900) == [4] * world


def test_gpu_type_keeps_its_own_memory() -> None:
    _skip_unless_segments_run()
    assert run_on_one_gpu(_gpu_type_worker, 2, timeout_s=180) == [4, 4]


def test_a_segment_too_small_raises_before_rows_move() -> None:
    _skip_unless_segments_run()
    assert run_on_one_gpu(_too_small_worker, 2, timeout_s=180) == [2, 2]
