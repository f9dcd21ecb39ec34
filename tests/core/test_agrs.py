"""AGRS sessions of `ElasticBuffer` (`ep_moe.elastic.agrs`) at 1 to 4 gloo ranks: ``all_gather`` equal to
torch.distributed's ``all_gather`` bit for bit (many dtypes and shapes, several tensors per call); in-place tensors
gathered without a copy; ``reduce_scatter`` bit for bit equal to the stated order (fp32 sum in increasing rank
order, rounded once; a case where another order rounds differently) and equal to torch.distributed's
``reduce_scatter_tensor`` on exactly representable data; a session reused after ``destroy_agrs_session``; every
misuse raises its named error (on every rank where ranks must agree); a peer that never joins ends in a timeout
naming rank and stage (docs/semantics.md, "ElasticBuffer: PP and AGRS")."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
from support.bits import assert_bits_equal, bits, bits_equal
from support.world_sizes import run_world_sizes
from support_core import expect_raises

from ep_moe import ElasticBuffer
from ep_moe.distributed import run_distributed
from ep_moe.elastic.agrs import (
    AGRSCapacityError,
    AGRSConfigError,
    AGRSError,
    AGRSMismatchError,
    AGRSSessionError,
    AGRSTensorError,
    AGRSTimeoutError,
)

MiB = 1 << 20

GATHER_CASES = [
    (torch.float32, (5, 3)), (torch.bfloat16, (7,)), (torch.float16, (2, 2, 2)), (torch.float64, ()),
    (torch.int64, (3,)), (torch.int8, (13,)), (torch.bool, (4,)), (torch.uint8, (0,)), (torch.float8_e4m3fn, (6,)),
]


def _tensor(dtype: torch.dtype, shape: tuple, rank: int, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * rank + salt)
    n = torch.Size(shape).numel()
    raw = torch.randint(0, 256, (max(n, 1) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    elif dtype.is_floating_point and dtype.itemsize == 1:
        raw = raw & 0x77  # finite FP8 values only (no NaN patterns: comparisons are by bits anyway)
    return raw[: n * dtype.itemsize].view(dtype).reshape(shape).clone()


def _torch_all_gather(t: torch.Tensor, num_ranks: int, group) -> torch.Tensor:
    """torch.distributed's all-gather of ``t`` as bytes (so every dtype goes through gloo)."""
    parts = [torch.empty_like(bits(t)) for _ in range(num_ranks)]
    dist.all_gather(parts, bits(t).clone(), group=group)
    return torch.stack(parts)


def _rank_order_sum(parts: list[torch.Tensor], rank: int) -> torch.Tensor:
    """The stated reduce-scatter: rank ``rank``'s row of every rank, summed in fp32 in rank order, rounded once."""
    acc_dtype = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    acc = parts[0][rank].to(acc_dtype).clone()
    for p in parts[1:]:
        acc = acc + p[rank].to(acc_dtype)
    return acc.to(parts[0].dtype)


def _adversarial(dtype: torch.dtype, num_ranks: int, shape: tuple, rank: int, salt: int) -> torch.Tensor:
    """Values of very different magnitudes and signs (another summation order rounds differently)."""
    gen = torch.Generator().manual_seed(31 * rank + salt)
    mags = 10.0 ** torch.randint(-3, 4, (num_ranks, *shape), generator=gen)
    return (torch.randn((num_ranks, *shape), generator=gen) * mags).to(dtype)


def _sessions(rank: int, num_ranks: int, group) -> dict:
    eb = ElasticBuffer(group, num_bytes=2 * MiB, explicitly_destroy=True, num_gpu_timeout_secs=30)
    eb.agrs_set_config(64 * 1024 * num_ranks, 10)
    checked, order_sensitive, inplace_ptrs = 0, 0, []
    for session in range(3):  # the later sessions reuse the memory of the first
        if session == 2:  # the context manager: create on entry, destroy on exit
            with eb.agrs_new_session() as number:
                assert number == 3
                (g,), handle = eb.all_gather([torch.full((2,), float(rank))])
                handle()
                assert torch.equal(g[:, 0], torch.arange(num_ranks, dtype=torch.float32))
            with eb.agrs_new_session(enabled=False):
                pass
            break
        assert eb.create_agrs_session() == session + 1
        # Several tensors in one call, every dtype; then one tensor per call.
        tensors = [_tensor(d, s, rank, 10 * session + j) for j, (d, s) in enumerate(GATHER_CASES)]
        gathered, handle = eb.all_gather(tensors)
        handle()
        handle()  # idempotent
        for t, g in zip(tensors, gathered):
            assert g.shape == (num_ranks, *t.shape) and g.dtype == t.dtype, (g.shape, t.shape)
            want = _torch_all_gather(t, num_ranks, group)
            assert all(torch.equal(bits(g[i]), want[i]) for i in range(num_ranks)), f"{t.dtype}{tuple(t.shape)}"
            checked += 1
        # In-place: written in this rank's slot, gathered with no copy.
        a = eb.agrs_get_inplace_tensor((4, 5), torch.bfloat16)
        b = eb.agrs_get_inplace_tensor([3], torch.int32)
        inplace_ptrs.append(a.data_ptr())
        a.copy_(_tensor(torch.bfloat16, (4, 5), rank, 100 + session))
        b.copy_(torch.tensor([rank, session, 7], dtype=torch.int32))
        plain = _tensor(torch.float32, (6,), rank, 200 + session)
        (ga, gplain, gb), handle = eb.all_gather([a, plain, b])
        assert ga[rank].data_ptr() == a.data_ptr() and gb[rank].data_ptr() == b.data_ptr(), "in-place slot"
        handle.wait()
        for i in range(num_ranks):
            assert_bits_equal(ga[i], _tensor(torch.bfloat16, (4, 5), i, 100 + session), f"in-place slot {i}")
            assert torch.equal(gb[i], torch.tensor([i, session, 7], dtype=torch.int32))
            assert torch.equal(gplain[i], _tensor(torch.float32, (6,), i, 200 + session))
        checked += 3
        # DeepEP V2's forms: one tensor in, one out; a batch of in-place tensors.
        c, d = eb.agrs_get_inplace_tensor([(3,), [2, 2]], torch.float32)
        c.fill_(rank)
        d.fill_(-rank)
        gc, handle = eb.all_gather(c)
        handle()
        (gd,), handle = eb.all_gather([d])
        handle()
        assert gc.shape == (num_ranks, 3) and gc[rank].data_ptr() == c.data_ptr() and gd.shape == (num_ranks, 2, 2)
        assert all(torch.all(gc[i] == i) and torch.all(gd[i] == -i) for i in range(num_ranks))
        checked += 2
        # Reduce-scatter: the stated order bit for bit, on adversarial values.
        for dtype, shape in ((torch.float32, (33,)), (torch.bfloat16, (4, 8)), (torch.float16, (5,)),
                             (torch.float64, (3,))):
            x = _adversarial(dtype, num_ranks, shape, rank, session)
            shard, handle = eb.reduce_scatter(x)
            handle()
            parts = [_adversarial(dtype, num_ranks, shape, i, session) for i in range(num_ranks)]
            want = _rank_order_sum(parts, rank)
            assert shard.dtype == dtype and shard.shape == shape
            assert_bits_equal(shard, want, f"reduce_scatter {dtype}{shape}")
            backwards = _rank_order_sum(parts[::-1], rank)
            order_sensitive += int(not bits_equal(backwards, want))
            checked += 1
        # Reduce-scatter of exactly representable values equals torch.distributed's reduce_scatter_tensor.
        x = torch.randint(-1000, 1000, (num_ranks, 6), generator=torch.Generator().manual_seed(rank)).float()
        shard, handle = eb.reduce_scatter(x)
        handle()
        ref = torch.empty(6)
        dist.reduce_scatter_tensor(ref, x.reshape(-1).clone(), group=group)
        assert torch.equal(shard, ref)
        checked += 1
        eb.destroy_agrs_session()
    assert inplace_ptrs[0] == inplace_ptrs[1], "a later AGRS session reuses the first one's memory"
    eb.barrier()
    eb.destroy()
    return {"checked": checked, "order_sensitive": order_sensitive}


def _all_workers(rank: int, num_ranks: int, group) -> dict:
    """The sessions and, at up to 3 ranks, the misuse checks at this world size (one spawned job of 4 ranks)."""
    out = {"sessions": _sessions(rank, num_ranks, group)}
    if num_ranks <= 3:
        out["misuse"] = _misuse(rank, num_ranks, group)
    return out


@pytest.fixture(scope="module")
def by_world_size() -> dict[int, list[dict]]:
    """`_all_workers` at 1, 2, 3 and 4 ranks: 4 spawned ranks, the smaller sizes on subgroups of them."""
    return run_world_sizes(_all_workers, (1, 2, 3, 4))


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_all_gather_reduce_scatter_sessions(by_world_size, num_ranks):
    results = [r["sessions"] for r in by_world_size[num_ranks]]
    per_session = len(GATHER_CASES) + 3 + 2 + 4 + 1
    assert [r["checked"] for r in results] == [2 * per_session] * num_ranks
    if num_ranks >= 3:  # the reduce-scatter check is meaningful: some shard rounds differently in reverse order
        assert sum(r["order_sensitive"] for r in results) > 0


def _misuse(rank: int, num_ranks: int, group) -> list[str]:
    eb = ElasticBuffer(group, num_bytes=2 * MiB, explicitly_destroy=True, num_gpu_timeout_secs=30)
    seen = []

    expect = functools.partial(expect_raises, seen, rank, AGRSError)

    x = torch.zeros(4)
    expect(AGRSConfigError, lambda: eb.create_agrs_session(), "agrs_set_config")
    expect(AGRSConfigError, lambda: eb.all_gather([x]), "agrs_set_config")
    expect(AGRSConfigError, lambda: eb.agrs_set_config(0, 1), "num_max_session_bytes")
    expect(AGRSConfigError, lambda: eb.agrs_set_config(64, 0), "num_max_all_gathers_per_session")
    expect(AGRSConfigError, lambda: eb.agrs_set_config(2 * MiB + 32, 1), "exceeds", "num_bytes")
    eb.agrs_set_config(256 * num_ranks, 3)  # a session's gathered bytes (V2's count): R x 256
    expect(AGRSSessionError, lambda: eb.all_gather([x]), "create_agrs_session")
    expect(AGRSSessionError, lambda: eb.reduce_scatter(x), "create_agrs_session")
    expect(AGRSSessionError, lambda: eb.agrs_get_inplace_tensor((2,), torch.float32), "create_agrs_session")
    expect(AGRSSessionError, lambda: eb.destroy_agrs_session(), "create_agrs_session")
    eb.create_agrs_session()
    expect(AGRSSessionError, lambda: eb.create_agrs_session(), "still open")
    expect(AGRSSessionError, lambda: eb.agrs_set_config(256, 3), "open")
    # Local argument errors (raised before anything is sent).
    expect(AGRSTensorError, lambda: eb.all_gather([]), "'tensors'")
    expect(AGRSTensorError, lambda: eb.all_gather([x, "y"]), "'tensors[1]'")
    expect(AGRSTensorError, lambda: eb.all_gather([torch.zeros((1,) * 9)]), "8 dims")
    expect(AGRSTensorError, lambda: eb.reduce_scatter(torch.zeros(num_ranks + 1, 2)), f"[R={num_ranks}")
    expect(AGRSTensorError, lambda: eb.reduce_scatter(torch.zeros(num_ranks, 2, dtype=torch.int32)), "'tensor'")
    expect(AGRSTensorError, lambda: eb.agrs_get_inplace_tensor((2, -1), torch.float32), "'shape'")
    expect(AGRSTensorError, lambda: eb.agrs_get_inplace_tensor((2,), "float"), "'dtype'")
    expect(AGRSCapacityError, lambda: eb.agrs_get_inplace_tensor((65,), torch.float32), "num_max_session_bytes")
    # An in-place tensor gathers once; a gathered view is not an input.
    t = eb.agrs_get_inplace_tensor((2,), torch.float32)
    t.fill_(rank)
    expect(AGRSSessionError, lambda: eb.all_gather([t, t]), "in-place")
    (g,), h = eb.all_gather([t])
    h()
    assert torch.equal(g[:, 0], torch.arange(num_ranks, dtype=torch.float32))
    expect(AGRSSessionError, lambda: eb.all_gather([t]), "in-place")
    expect(AGRSSessionError, lambda: eb.all_gather([g[0]]), "in-place")
    # Ranks that disagree raise the same error on every rank, and the session goes on.
    if num_ranks > 1:
        expect(AGRSMismatchError, lambda: eb.all_gather([torch.zeros(3 if rank == 0 else 4)]),
               "different tensors", "rank 0: 1 tensor(s), 12 bytes", "rank 1: 1 tensor(s), 16 bytes")
        expect(AGRSMismatchError, lambda: eb.all_gather([x.to(torch.int32 if rank == 0 else torch.float32)]),
               "different tensors", "torch.int32")
        if rank == 0:
            expect(AGRSMismatchError, lambda: eb.all_gather([torch.zeros(num_ranks)]), "different operations",
                   "rank 0: all_gather", "rank 1: reduce_scatter")
        else:
            expect(AGRSMismatchError, lambda: eb.reduce_scatter(torch.zeros(num_ranks)), "different operations")
        # Full on one rank only (rank 0 holds an extra in-place tensor): every rank refuses, naming rank 0.
        if rank == 0:
            eb.agrs_get_inplace_tensor((48,), torch.float32)  # R x 192 of the R x 256 bytes
        expect(AGRSCapacityError, lambda: eb.all_gather([torch.zeros(20)]), "full on rank 0: bytes")
    (g,), h = eb.all_gather([x + rank])  # operation 2 of 3
    h()
    assert torch.equal(g[:, 0], torch.arange(num_ranks, dtype=torch.float32))
    shard, h = eb.reduce_scatter(torch.ones(num_ranks, 2))  # operation 3 of 3
    h()
    assert torch.equal(shard, torch.full((2,), float(num_ranks)))
    expect(AGRSCapacityError, lambda: eb.all_gather([x]), "operations", "num_max_all_gathers_per_session")
    eb.destroy_agrs_session()
    expect(AGRSSessionError, lambda: eb.all_gather([x]), "create_agrs_session")
    eb.create_agrs_session()
    expect(AGRSSessionError, lambda: eb.all_gather([t]), "in-place")  # an in-place tensor of session 1
    eb.destroy_agrs_session()
    eb.barrier()
    eb.destroy()
    return seen


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_misuse_raises_named_errors(by_world_size, num_ranks):
    results = [r["misuse"] for r in by_world_size[num_ranks]]
    names = {"AGRSConfigError", "AGRSSessionError", "AGRSTensorError", "AGRSCapacityError"}
    if num_ranks > 1:
        names.add("AGRSMismatchError")
    for seen in results:
        assert names <= set(seen)


def _peer_never_joins(rank: int, num_ranks: int, timeout_s: float) -> str:
    eb = ElasticBuffer(num_bytes=2 * MiB, explicitly_destroy=True, num_gpu_timeout_secs=timeout_s)
    eb.agrs_set_config(1024, 2)
    eb.create_agrs_session()
    if rank == 0:
        try:
            eb.all_gather([torch.zeros(4)])
        except AGRSTimeoutError as exc:
            return str(exc)
        return "no timeout"
    time.sleep(timeout_s + 3)  # alive, but never joins the all-gather
    return ""


def test_peer_that_never_joins_times_out():
    message = run_distributed(_peer_never_joins, 2, 2.0)[0]
    assert "rank 0 of 2 timed out" in message, message
    assert "stage 'all_gather #1 of session 1: header exchange'" in message, message
