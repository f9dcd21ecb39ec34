"""`ElasticBuffer`'s memory types and Engram on CPU ranks (gloo), at 1 to 4 ranks (docs/semantics.md,
"ElasticBuffer: memory types and Engram"):

* the choice of type and the layout (2 MiB segments, GPU first, host segments adjacent in rank order);
* hybrid memory for real: ``memfd`` segments shared by ``(pid, fd)`` and ``pidfd_getfd``; every rank reads what
  every other rank wrote into its own segment, and a write into a peer's segment is seen by its owner; the
  socket route (``SCM_RIGHTS``) where ``pidfd_getfd`` is denied; failures raise on every rank;
* ``engram_fetch`` equal, bit for bit, to indexing the concatenated tables (random ids, repeated ids, every id on
  one rank, empty ``T``; with and without scales), on the direct path (hybrid) and the collectives path (elastic);
* bad tables and ids raise errors naming the argument, on every rank, with nothing left waiting.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from support.bits import assert_bits_equal
from support.world_sizes import run_world_sizes

from ep_moe import ElasticBuffer
from ep_moe.elastic.memory import (
    ALIGNMENT_BYTES,
    PeerFdError,
    align_up,
    choose_memory_type,
    fdshare,
    memory_layout,
)
from ep_moe.elastic.memory.fdshare import exchange_fds, pidfd_getfd
from ep_moe.elastic.memory.host_mapping import create_shared_segment

N, H, S = 7, 12, 3  # entries per rank, hidden, scales per row


def test_choice_and_layout() -> None:
    assert choose_memory_type(0, True, 8) == "gpu"
    assert choose_memory_type(1, True, 8) == "hybrid"
    assert choose_memory_type(1, True, 1) == "elastic"
    assert choose_memory_type(1, False, 8) == "elastic"
    assert align_up(0) == 0 and align_up(1) == ALIGNMENT_BYTES and align_up(ALIGNMENT_BYTES) == ALIGNMENT_BYTES
    hybrid = memory_layout("hybrid", 5, [7, 5, 6], 3 << 20, 1)
    assert [(s.kind, s.owner, s.offset, s.size) for s in hybrid.segments] == [
        ("gpu", 5, 0, 4 << 20), ("host", 5, 4 << 20, 2 << 20), ("host", 6, 6 << 20, 2 << 20),
        ("host", 7, 8 << 20, 2 << 20)]
    assert hybrid.local_ranks == (5, 6, 7) and hybrid.total_bytes == 10 << 20 and hybrid.host_segment(4) is None
    elastic = memory_layout("elastic", 1, [0, 1], 2 << 20, 5 << 20)
    assert [(s.kind, s.owner, s.offset, s.size) for s in elastic.segments] == [
        ("gpu", 1, 0, 2 << 20), ("host", 1, 2 << 20, 6 << 20)]
    with pytest.raises(ValueError):
        memory_layout("gpu", 0, [0], 0, 0)
    with pytest.raises(ValueError):
        memory_layout("hybrid", 3, [0, 1], 0, 1)


def _tables(num_ranks: int, dtype: torch.dtype, seed: int, hidden: int = H
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tables, scales = [], []
    for _ in range(num_ranks):
        raw = torch.randn(N, hidden, generator=gen) * 10.0 ** torch.randint(-3, 4, (N, 1), generator=gen)
        tables.append(raw.to(dtype))
        scales.append(torch.rand(N, S, generator=gen, dtype=torch.float32))
    return tables, scales


def _index_cases(num_ranks: int, rank: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 100 * rank)
    total = num_ranks * N
    return [
        ("random", torch.randint(0, total, (9 + rank, 4), generator=gen, dtype=torch.int32)),
        ("repeated", torch.full((5, 3), total - 1 - rank % total, dtype=torch.int32)),
        ("one rank", (N * (num_ranks - 1) + torch.randint(0, N, (6, 2), generator=gen)).to(torch.int32)),
        ("every id", torch.arange(total, dtype=torch.int32).flip(0).view(-1, 1).repeat(1, 2)),
        ("empty T", torch.empty(0, 4, dtype=torch.int32)),
        ("empty T on rank 0", torch.empty(0, 4, dtype=torch.int32) if rank == 0
         else torch.randint(0, total, (3, 4), generator=gen, dtype=torch.int32)),
        ("empty T but on rank 0", torch.randint(0, total, (3, 4), generator=gen, dtype=torch.int32) if rank == 0
         else torch.empty(0, 4, dtype=torch.int32)),
    ]


def _check_memory(eb: ElasticBuffer, rank: int, num_ranks: int) -> None:
    memory = eb.memory
    gpu, host = memory.layout.segments[0], memory.layout.segments[1]
    assert gpu.offset == 0 and all(s.offset % ALIGNMENT_BYTES == 0 and s.size % ALIGNMENT_BYTES == 0
                                   for s in memory.layout.segments)
    assert memory.host.numel() == align_up(eb.num_cpu_bytes)
    base = memory.gpu.data_ptr()
    for segment in memory.layout.segments[1:]:  # one virtual range, segments at their layout offsets
        assert memory.host_segments[segment.owner].data_ptr() == base + segment.offset, segment
    if eb.memory_type == "elastic":
        assert [s.owner for s in memory.layout.segments] == [rank, rank] and host.offset == gpu.size
        assert sum(s is not None for s in memory.host_segments) == 1
        return
    assert [s.owner for s in memory.layout.segments[1:]] == list(range(num_ranks))
    size = memory.host.numel()
    # every rank fills its own segment (start, middle, end), then reads everyone's
    for where in (0, size // 2, size - 64):
        memory.host[where:where + 64] = torch.arange(64, dtype=torch.uint8) + 3 * rank + where % 251
    eb.barrier()
    for owner in range(num_ranks):
        seg = memory.host_segments[owner]
        for where in (0, size // 2, size - 64):
            want = torch.arange(64, dtype=torch.uint8) + 3 * owner + where % 251
            assert torch.equal(seg[where:where + 64], want), (rank, owner, where)
    # and a write into a peer's segment reaches its owner
    peer = (rank + 1) % num_ranks
    memory.host_segments[peer][1000:1008] = 200 + rank
    eb.barrier()
    writer = (rank - 1) % num_ranks
    assert torch.equal(memory.host[1000:1008], torch.full((8,), 200 + writer, dtype=torch.uint8))
    eb.barrier()


def _check_engram(eb: ElasticBuffer, rank: int, num_ranks: int) -> int:
    checked = 0
    # rows of 24, 48, 12, 12 bytes (gathered through a strided view of the segments) and 64 bytes (rows tile the
    # 2 MiB segments: one row gather)
    for seed, (dtype, with_sf, hidden) in enumerate([(torch.bfloat16, False, H), (torch.float32, True, H),
                                                     (torch.float8_e4m3fn, True, H), (torch.uint8, False, H),
                                                     (torch.float32, True, 16)]):
        tables, scales = _tables(num_ranks, torch.float32 if dtype == torch.uint8 else dtype, seed, hidden)
        if dtype == torch.uint8:
            tables = [t.to(torch.int32).to(torch.uint8) for t in tables]
        eb.engram_write(tables[rank], scales[rank] if with_sf else None)
        everything, every_sf = torch.cat(tables), torch.cat(scales)
        for name, indices in _index_cases(num_ranks, rank, seed):
            hook = eb.engram_fetch(indices)
            fetched, fetched_sf = hook()
            assert fetched.shape == (*indices.shape, hidden) and fetched.dtype == dtype, (name, fetched.shape)
            assert_bits_equal(fetched, everything[indices.long()], f"{name} {dtype}")
            if with_sf:
                assert_bits_equal(fetched_sf, every_sf[indices.long()], f"{name} sf")
            else:
                assert fetched_sf is None
            checked += 1
    return checked


def _raises(fn, error: type, text: str) -> None:
    try:
        fn()
    except error as exc:
        assert text in str(exc), str(exc)
    else:
        raise AssertionError(f"no {error.__name__} with {text!r}")


def _check_errors(eb: ElasticBuffer, rank: int, num_ranks: int) -> None:
    direct = eb.memory.all_host_segments_mapped()
    tables, scales = _tables(num_ranks, torch.float32, 7)
    eb.engram_write(tables[rank], scales[rank])
    good = torch.zeros(2, 2, dtype=torch.int32)
    for bad_ids in (torch.tensor([[0, num_ranks * N]], dtype=torch.int32), torch.tensor([[-1, 0]], dtype=torch.int32)):
        if direct:  # no collective: only the rank with bad ids raises
            if rank == 0:
                _raises(lambda bad_ids=bad_ids: eb.engram_fetch(bad_ids), ValueError, "argument 'indices'")
            else:
                eb.engram_fetch(good)()
        elif rank == 0:  # the peers learn of it in the counts exchange and stop too
            _raises(lambda bad_ids=bad_ids: eb.engram_fetch(bad_ids), ValueError, "argument 'indices'")
        else:
            _raises(lambda: eb.engram_fetch(good), RuntimeError, "rank(s) [0]")
    _raises(lambda: eb.engram_fetch(good.long()), ValueError, "argument 'indices'")
    _raises(lambda: eb.engram_fetch(good[0]), ValueError, "argument 'indices'")
    _raises(lambda: eb.engram_fetch(good, num_qps=-1), ValueError, "argument 'num_qps'")
    # a table too large for the host segment, on every rank
    rows = eb.memory.host.numel() // (4 * H) + 1
    _raises(lambda: eb.engram_write(torch.zeros(rows, H)), ValueError, "argument 'storage'")
    # different shapes on different ranks
    if num_ranks > 1:
        _raises(lambda: eb.engram_write(torch.zeros(N + (rank == 0), H)), ValueError, "argument 'storage'")
    # a bad argument on one rank: it names the argument, the others name the rank
    if rank == 0:
        _raises(lambda: eb.engram_write(tables[rank], scales[rank][:-1]), ValueError, "argument 'sf'")
    else:
        _raises(lambda: eb.engram_write(tables[rank], scales[rank]), RuntimeError, "rank(s) [0]")
    # the table written before the failed writes is still served
    fetched, fetched_sf = eb.engram_fetch(good + 1)()
    assert torch.equal(fetched, torch.cat(tables)[(good + 1).long()])


def _check_exchange_failures(rank: int, num_ranks: int, group) -> None:
    """A rank that could not make its segment, or a descriptor that cannot be taken: every rank raises."""
    _raises(lambda: exchange_fds(group, -1, "no memory here" if rank == 0 else None), PeerFdError,
            "rank 0: no memory here")
    if num_ranks > 1:
        fd = create_shared_segment(4096)
        try:  # rank 0 announces a descriptor it does not have: its peers' pidfd_getfd fails (EBADF)
            _raises(lambda: exchange_fds(group, 1 << 20 if rank == 0 else fd), PeerFdError,
                    "importing rank 0's segment")
        finally:
            os.close(fd)


def _check_socket_exchange(rank: int, num_ranks: int, group) -> None:
    """The route where pidfd_getfd is denied: descriptors over Unix sockets reach every rank of the node."""
    fd = create_shared_segment(4096)
    os.pwrite(fd, bytes([rank + 1]) * 8, 0)

    def denied(pid: int, fd: int) -> int:
        raise fdshare.PeerFdError("pidfd_getfd: Operation not permitted (simulated)", denied=True)

    real = fdshare.pidfd_getfd
    try:
        for method in ("socket", "auto"):  # auto: pidfd_getfd denied on every rank, then the sockets
            fdshare.pidfd_getfd = denied if method == "auto" else real
            local_ranks, fds = exchange_fds(group, fd, method=method)
            assert local_ranks == list(range(num_ranks)) and fds[rank] == fd
            for owner in range(num_ranks):
                assert os.pread(fds[owner], 8, 0) == bytes([owner + 1]) * 8, (method, rank, owner)
            for owner in range(num_ranks):
                if owner != rank:
                    os.close(fds[owner])
            dist.barrier(group)
        if num_ranks > 1:
            _raises(lambda: exchange_fds(group, fd, method="pidfd"), PeerFdError, "simulated")
    finally:
        fdshare.pidfd_getfd = real
        os.close(fd)


def test_pidfd_getfd_errors() -> None:
    with pytest.raises(PeerFdError, match="Bad file descriptor"):
        pidfd_getfd(os.getpid(), 1 << 20)
    with pytest.raises(PeerFdError, match="pidfd_open"):
        pidfd_getfd(1 << 30, 0)


def _worker(rank: int, num_ranks: int, group) -> int:
    _check_exchange_failures(rank, num_ranks, group)
    _check_socket_exchange(rank, num_ranks, group)
    gpu = ElasticBuffer(group, backend="torch", explicitly_destroy=True)
    assert gpu.memory_type == "gpu" and gpu.memory is None
    _raises(lambda: gpu.engram_write(torch.zeros(2, 2)), ValueError, "argument 'num_cpu_bytes'")
    gpu.destroy()
    checked = 0
    for hybrid in (True, False):
        eb = ElasticBuffer(group, num_bytes=2 << 20, num_cpu_bytes=(2 << 20) + 1, allow_hybrid_mode=hybrid,
                           backend="torch", explicitly_destroy=True, num_cpu_timeout_secs=60)
        want = "hybrid" if hybrid and num_ranks > 1 else "elastic"
        assert eb.memory_type == want and want in repr(eb), (eb.memory_type, want)
        _raises(lambda eb=eb: eb.engram_fetch(torch.zeros(1, 1, dtype=torch.int32)), RuntimeError, "engram_write")
        _check_memory(eb, rank, num_ranks)
        checked += _check_engram(eb, rank, num_ranks)
        _check_errors(eb, rank, num_ranks)
        eb.destroy()
        _raises(lambda eb=eb: eb.engram_fetch(torch.zeros(1, 1, dtype=torch.int32)), RuntimeError, "destroyed")
    return checked


@pytest.fixture(scope="module")
def checked_by_world_size() -> dict[int, list[int]]:
    """`_worker` at 1, 2, 3 and 4 ranks: 4 spawned ranks, the smaller sizes on subgroups of them."""
    return run_world_sizes(_worker, (1, 2, 3, 4), timeout_s=60, join_timeout_s=600)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_memory_types_and_engram(checked_by_world_size, num_ranks: int) -> None:
    assert checked_by_world_size[num_ranks] == [2 * 5 * 7] * num_ranks
