"""The elastic and hybrid memory types on a CUDA GPU (the CUDA driver's VMM mapping) and Engram's direct fetch
from GPU-mapped host memory, on one GPU (docs/semantics.md, "ElasticBuffer: memory types and Engram"):

* elastic, one process: the GPU segment, then the host-NUMA segment, in one virtual range; written and read back
  by the device;
* hybrid, 2 to 4 processes sharing the one GPU (gloo for the ``(pid, fd)`` exchange): every rank reads on the device
  what every other rank wrote into its host segment, and writes into a peer's segment reach their owner; also
  with the descriptors passed over Unix sockets (the route where ``pidfd_getfd`` is denied);
* Engram over that hybrid memory (the direct path: a gather kernel reading the mapped host segments), over elastic
  memory at 2 and 3 processes (the collectives path: ids and rows through the group's all-to-alls, here gloo's
  CUDA all-to-all), and through `ElasticBuffer` on a one-rank NCCL group, equal bit for bit to indexing the
  concatenated tables.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ep_moe import ElasticBuffer
from ep_moe.distributed import run_distributed
from ep_moe.elastic.engram import EngramMixin
from ep_moe.elastic.memory import ALIGNMENT_BYTES, SymmetricMemory, fdshare

pytestmark = pytest.mark.gpu
N, H, S = 1000, 512, 4  # 1 KiB bf16 rows


def _pattern(owner: int, size: int, device: torch.device) -> torch.Tensor:
    return ((torch.arange(size, device=device, dtype=torch.int64) * 7 + 13 * owner + 1) % 251).to(torch.uint8)


def test_elastic_memory_on_one_gpu(solo_group) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    memory = SymmetricMemory("elastic", solo_group, 3 << 20, (4 << 20) + 5, device)
    assert memory.gpu.device == device and memory.host.device == device
    assert memory.gpu.numel() == 4 << 20 and memory.host.numel() == 6 << 20
    assert memory.host.data_ptr() == memory.gpu.data_ptr() + (4 << 20)  # one range: GPU bytes, then host bytes
    assert memory.gpu.data_ptr() % ALIGNMENT_BYTES == 0
    whole = memory.gpu.numel() + memory.host.numel()
    memory.gpu.copy_(_pattern(1, memory.gpu.numel(), device))
    memory.host.copy_(_pattern(2, memory.host.numel(), device))
    host_copy = memory.host.cpu()  # device to host through the mapping
    torch.cuda.synchronize()
    assert torch.equal(memory.gpu.cpu(), _pattern(1, memory.gpu.numel(), torch.device("cpu")))
    assert torch.equal(host_copy, _pattern(2, memory.host.numel(), torch.device("cpu")))
    span = memory.host_span()
    assert span.numel() == memory.host.numel() and whole == 10 << 20
    # the host segment is host memory: a kernel that sums it must see the pattern
    assert int(memory.host.to(torch.int64).sum()) == int(_pattern(2, memory.host.numel(), device).to(torch.int64).sum())
    memory.close()


class _GpuEngram(EngramMixin):
    """The mixin over a gloo group with every rank on one GPU (what a test on one GPU can run)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_cpu_bytes: int,
                 allow_hybrid_mode: bool = True) -> None:
        self.group, self.rank, self.num_ranks = group, dist.get_rank(group), dist.get_world_size(group)
        self.buffer = SimpleNamespace(device=device, barrier=lambda: dist.barrier(group))
        self.num_cpu_timeout_secs = 60
        self._setup_memory(2 << 20, num_cpu_bytes, allow_hybrid_mode)

    def _check_live(self, op: str) -> None:
        pass


def _write_and_fetch(engram, rank: int, num_ranks: int, gen: torch.Generator, cases) -> int:
    """Write every rank's random table (bf16 rows, fp32 scales from ``gen``, the same on every rank), fetch each of
    ``cases`` (int32 ``[T, P]`` global ids) and compare with indexing the concatenated tables; returns the count."""
    device = engram.buffer.device
    tables = [torch.randn(N, H, generator=gen).to(torch.bfloat16) for _ in range(num_ranks)]
    scales = [torch.rand(N, S, generator=gen) for _ in range(num_ranks)]
    engram.engram_write(tables[rank].to(device), scales[rank])
    everything, every_sf = torch.cat(tables), torch.cat(scales)
    for indices in cases:
        fetched, fetched_sf = engram.engram_fetch(indices.to(device))()
        assert fetched.device == device
        assert torch.equal(fetched.cpu().view(torch.int16), everything[indices.long()].view(torch.int16))
        assert torch.equal(fetched_sf.cpu(), every_sf[indices.long()])
    return len(cases)


def _denied(pid: int, fd: int) -> int:
    raise fdshare.PeerFdError("pidfd_getfd: Operation not permitted (simulated)", denied=True)


def _hybrid_worker(rank: int, num_ranks: int, route: str) -> int:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = dist.group.WORLD
    if route == "socket":  # the CUDA descriptors over Unix sockets, as where pidfd_getfd is denied
        fdshare.pidfd_getfd = _denied
    engram = _GpuEngram(group, device, N * H * 2 + (1 << 20))
    memory = engram.memory
    assert engram.memory_type == "hybrid" and memory.all_host_segments_mapped()
    assert [s.owner for s in memory.layout.segments[1:]] == list(range(num_ranks))
    size = memory.host.numel()
    memory.host.copy_(_pattern(rank, size, device))
    torch.cuda.synchronize()
    dist.barrier(group)
    for owner in range(num_ranks):
        seg = memory.host_segments[owner]
        assert seg.data_ptr() == memory.gpu.data_ptr() + memory.layout.host_segment(owner).offset
        assert torch.equal(seg, _pattern(owner, size, device)), (rank, owner)
    dist.barrier(group)
    peer = (rank + 1) % num_ranks
    memory.host_segments[peer][4096:4104].fill_(100 + rank)
    torch.cuda.synchronize()
    dist.barrier(group)
    writer = (rank - 1) % num_ranks
    assert torch.equal(memory.host[4096:4104].cpu(), torch.full((8,), 100 + writer, dtype=torch.uint8))
    dist.barrier(group)
    # Engram's direct path on the device
    gen = torch.Generator().manual_seed(5)
    checked = _write_and_fetch(engram, rank, num_ranks, gen, (
        torch.randint(0, num_ranks * N, (257, 8), generator=gen, dtype=torch.int32),
        torch.full((3, 2), num_ranks * N - 1, dtype=torch.int32),
        torch.empty(0, 8, dtype=torch.int32)))
    try:
        engram.engram_fetch(torch.tensor([[num_ranks * N]], dtype=torch.int32, device=device))
    except ValueError as exc:
        assert "argument 'indices'" in str(exc)
        checked += 1
    dist.barrier(group)
    engram._release_memory()
    return checked


@pytest.mark.parametrize("num_ranks, route", [(2, "pidfd"), (3, "pidfd"), (4, "pidfd"), (2, "socket")])
def test_hybrid_memory_and_engram_on_one_gpu(num_ranks: int, route: str) -> None:
    assert run_distributed(_hybrid_worker, num_ranks, route, backend="gloo", join_timeout_s=300) == [4] * num_ranks


def _elastic_buffer_worker(rank: int, num_ranks: int) -> bool:
    eb = ElasticBuffer(None, num_cpu_bytes=N * H * 2 + (1 << 20), explicitly_destroy=True)
    assert eb.memory_type == "elastic" and eb.memory.host.device.type == "cuda"
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(N, H, generator=gen).to(torch.bfloat16)
    eb.engram_write(table)
    indices = torch.randint(0, N, (4096, 8), generator=gen, dtype=torch.int32)
    fetched, fetched_sf = eb.engram_fetch(indices.cuda())()
    assert fetched_sf is None and torch.equal(fetched.cpu().view(torch.int16), table[indices.long()].view(torch.int16))
    eb.destroy()
    return True


def test_elastic_buffer_engram_one_rank_nccl() -> None:
    assert run_distributed(_elastic_buffer_worker, 1, backend="nccl", join_timeout_s=300) == [True]


def _elastic_collectives_worker(rank: int, num_ranks: int) -> int:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    engram = _GpuEngram(dist.group.WORLD, device, N * H * 2 + (1 << 20), allow_hybrid_mode=False)
    assert engram.memory_type == "elastic" and engram.memory.host_segments[(rank + 1) % num_ranks] is None
    per_rank = torch.Generator().manual_seed(100 + rank)  # every rank asks for different ids
    checked = _write_and_fetch(engram, rank, num_ranks, torch.Generator().manual_seed(11), (
        torch.randint(0, num_ranks * N, (513, 8), generator=per_rank, dtype=torch.int32),
        torch.full((5, 3), rank * N + 7, dtype=torch.int32),  # repeated ids, all on this rank
        torch.full((4, 2), ((rank + 1) % num_ranks) * N, dtype=torch.int32),  # all on one peer
        torch.empty(0, 8, dtype=torch.int32)))
    dist.barrier()
    engram._release_memory()
    return checked


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_elastic_memory_engram_collectives_on_one_gpu(num_ranks: int) -> None:
    assert run_distributed(_elastic_collectives_worker, num_ranks, backend="gloo", join_timeout_s=300) == [4] * num_ranks
