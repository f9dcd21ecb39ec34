"""`ElasticBuffer.pp_set_config` / `pp_send` / `pp_recv` (`ep_moe.elastic.pipeline_comm`) at 1 to 4 gloo ranks: ring
transfers of many sizes, dtypes and shapes with 1 and several messages in flight, both directions, order kept and
every byte equal; non-contiguous tensors; every misuse raises its named error (a mismatch names both sides and
leaves later messages in order); a peer that never receives ends in a timeout naming rank and stage
(docs/semantics.md, "ElasticBuffer: PP and AGRS")."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from support.bits import assert_bits_equal
from support.world_sizes import run_world_sizes
from support_core import expect_raises

from ep_moe import ElasticBuffer
from ep_moe.distributed import run_distributed
from ep_moe.elastic.pipeline_comm import (
    PPConfigError,
    PPError,
    PPMismatchError,
    PPPeerError,
    PPSlotsFullError,
    PPTensorError,
    PPTimeoutError,
)

MiB = 1 << 20
SLOT = 4096

# (dtype, shape): odd byte counts, empty, scalars, up to 8 dims, a full slot.
CASES = [
    (torch.float32, (SLOT // 4,)), (torch.bfloat16, (3, 5)), (torch.float16, (7,)), (torch.float64, (2, 3, 4)),
    (torch.int64, (0,)), (torch.int32, (1,)), (torch.int8, (33,)), (torch.uint8, (SLOT,)), (torch.bool, (5, 1)),
    (torch.complex64, (4,)), (torch.float8_e4m3fn, (9, 2)), (torch.float32, ()), (torch.bfloat16, (1,) * 8),
    (torch.float32, (0, 4)),
]


def _payload(dtype: torch.dtype, shape: tuple, src: int, seq: int) -> torch.Tensor:
    """The tensor rank ``src`` sends as its ``seq``-th message of a case (every rank can rebuild it)."""
    gen = torch.Generator().manual_seed(1000 * src + seq)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8,
                        generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape).clone()


def _ring(rank: int, num_ranks: int, group) -> dict:
    eb = ElasticBuffer(group, num_bytes=2 * MiB, explicitly_destroy=True, num_gpu_timeout_secs=30)
    prev, nxt = (rank - 1) % num_ranks, (rank + 1) % num_ranks
    checked = 0
    seq = {"next": 0, "prev": 0}  # messages this rank has sent each way

    def send(x, dst, way):
        eb.pp_send(x, dst)
        seq[way] += 1

    # One in flight: every case once around the ring (send to next, receive from prev).
    eb.pp_set_config(SLOT, 1)
    for i, (dtype, shape) in enumerate(CASES):
        send(_payload(dtype, shape, rank, i), nxt, "next")
        out = torch.empty(shape, dtype=dtype)
        eb.pp_recv(out, prev)
        assert_bits_equal(out, _payload(dtype, shape, prev, i), f"rank {rank}: case {i} {dtype}{shape}")
        checked += 1

    # Several in flight, both directions: 4 to next and 3 to prev before any receive; order must hold (at R = 2
    # both go to the one peer, through one set of slots: 8 of them).
    eb.pp_set_config(SLOT, 8)
    forward = [CASES[(k * 3) % len(CASES)] for k in range(4)]
    backward = [CASES[(k * 5 + 1) % len(CASES)] for k in range(3)] if num_ranks > 1 else []
    for k, (dtype, shape) in enumerate(forward):
        src_view = _payload(dtype, shape, rank, 100 + k)
        if src_view.dim() >= 2:  # a non-contiguous source
            src_view = src_view.transpose(0, 1).contiguous().transpose(0, 1)
        send(src_view, nxt, "next")
    for k, (dtype, shape) in enumerate(backward):
        send(_payload(dtype, shape, rank, 200 + k), prev, "prev")
    # At R = 2 prev and next are the same peer: its messages arrive in the order it sent them (forward first).
    order = [("fwd", prev, k) for k in range(4)]
    order += [("bwd", nxt, k) for k in range(len(backward))]
    for kind, src, k in order:
        dtype, shape = (forward if kind == "fwd" else backward)[k]
        if len(shape) == 2 and kind == "fwd":  # a non-contiguous destination
            out = torch.empty(shape[::-1], dtype=dtype).t()
        else:
            out = torch.empty(shape, dtype=dtype)
        eb.pp_recv(out, src)
        want = _payload(dtype, shape, src, (100 if kind == "fwd" else 200) + k)
        assert_bits_equal(out, want, f"rank {rank}: {kind} message {k} from rank {src}")
        checked += 1

    # Many rounds through 2 slots: the sender waits for slots as the receiver drains them.
    eb.pp_set_config(256, 2)
    for rnd in range(10):
        for k in range(2):
            send(torch.full((8,), float(1000 * rank + 10 * rnd + k)), nxt, "next")
        for k in range(2):
            out = torch.empty(8)
            eb.pp_recv(out, prev)
            assert torch.equal(out, torch.full((8,), float(1000 * prev + 10 * rnd + k))), (rank, rnd, k)
            checked += 1
    eb.barrier()
    eb.destroy()
    return {"checked": checked}


def _all_workers(rank: int, num_ranks: int, group) -> dict:
    """The ring and, at 1, 2 and 4 ranks, the misuse checks at this world size (one spawned job of 4 ranks)."""
    out = {"ring": _ring(rank, num_ranks, group)}
    if num_ranks != 3:
        out["misuse"] = _misuse(rank, num_ranks, group)
    return out


@pytest.fixture(scope="module")
def by_world_size() -> dict[int, list[dict]]:
    """`_all_workers` at 1, 2, 3 and 4 ranks: 4 spawned ranks, the smaller sizes on subgroups of them."""
    return run_world_sizes(_all_workers, (1, 2, 3, 4))


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_ring_send_recv(by_world_size, num_ranks):
    results = [r["ring"] for r in by_world_size[num_ranks]]
    expected = len(CASES) + (7 if num_ranks > 1 else 4) + 20
    assert [r["checked"] for r in results] == [expected] * num_ranks


def _misuse(rank: int, num_ranks: int, group) -> list[str]:
    eb = ElasticBuffer(group, num_bytes=2 * MiB, explicitly_destroy=True, num_gpu_timeout_secs=30)
    prev, nxt = (rank - 1) % num_ranks, (rank + 1) % num_ranks
    seen = []

    expect = functools.partial(expect_raises, seen, rank, PPError)

    x = torch.zeros(4)
    expect(PPConfigError, lambda: eb.pp_send(x, nxt), "pp_set_config")
    expect(PPConfigError, lambda: eb.pp_recv(x, prev), "pp_set_config")
    expect(PPConfigError, lambda: eb.pp_set_config(0, 1), "num_max_tensor_bytes")
    expect(PPConfigError, lambda: eb.pp_set_config(64, 0), "num_max_inflight_tensors")
    expect(PPConfigError, lambda: eb.pp_set_config(MiB // 8 + 1, 4), "exceeds", "num_bytes")
    eb.pp_set_config(MiB // 8, 4)  # exactly the buffer: 128 KiB x 4 x 2 x 2 = 2 MiB
    eb.pp_set_config(64, 2)
    if num_ranks >= 4:
        expect(PPPeerError, lambda: eb.pp_send(x, (rank + 2) % num_ranks), "dst_rank_idx", "neighbour")
        expect(PPPeerError, lambda: eb.pp_recv(x, (rank + 2) % num_ranks), "src_rank_idx", "neighbour")
    expect(PPPeerError, lambda: eb.pp_send(x, num_ranks), "dst_rank_idx")
    expect(PPPeerError, lambda: eb.pp_send(x, -1), "dst_rank_idx")
    expect(PPTensorError, lambda: eb.pp_send(torch.zeros(17), nxt), "'x'", "64 bytes", "68")
    expect(PPTensorError, lambda: eb.pp_send([1.0], nxt), "torch.Tensor")
    expect(PPTensorError, lambda: eb.pp_send(torch.zeros((1,) * 9), nxt), "8 dims")
    expect(PPConfigError, lambda: eb.pp_send(x, nxt, num_sms=-1), "num_sms")

    if num_ranks == 1:
        eb.pp_send(x, 0)
        eb.pp_send(x + 1, 0)
        expect(PPSlotsFullError, lambda: eb.pp_send(x, 0), "slots")
        expect(PPMismatchError, lambda: eb.pp_recv(torch.zeros(5), 0), "float32(4,)", "float32(5,)")
        out = torch.zeros(4)
        eb.pp_recv(out, 0)  # the next message in order
        assert torch.equal(out, x + 1)
        expect(PPTimeoutError, lambda: eb.pp_recv(out, 0), "rank 0", "stage")
    else:
        # A receiver with the wrong dtype / shape gets a named error naming both sides; order holds after it.
        eb.pp_set_config(64, 4)
        eb.pp_send(torch.arange(4, dtype=torch.float32), nxt)
        eb.pp_send(torch.arange(6, dtype=torch.int32).view(2, 3), nxt)
        eb.pp_send(torch.full((3,), 7.0), nxt)
        expect(PPMismatchError, lambda: eb.pp_recv(torch.zeros(4, dtype=torch.float64), prev),
               f"rank {prev} sent torch.float32(4,)", f"rank {rank} receives into torch.float64(4,)")
        expect(PPMismatchError, lambda: eb.pp_recv(torch.zeros(3, 2, dtype=torch.int32), prev),
               "torch.int32(2, 3)", "torch.int32(3, 2)")
        out = torch.zeros(3)
        eb.pp_recv(out, prev)
        assert torch.equal(out, torch.full((3,), 7.0)), f"rank {rank}: order after mismatches"
        # Different slot configs on the two sides: refused by the receiver, naming both.
        eb.pp_set_config(64 if rank % 2 == 0 else 96, 2)
        if num_ranks % 2 == 0:  # every receiver's prev has the other config
            eb.pp_send(torch.zeros(2), nxt)
            expect(PPMismatchError, lambda: eb.pp_recv(torch.zeros(2), prev), "pp_set_config",
                   f"rank {prev} has", f"rank {rank} has")
    eb.barrier()
    eb.destroy()
    return seen


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_misuse_raises_named_errors(by_world_size, num_ranks):
    results = [r["misuse"] for r in by_world_size[num_ranks]]
    for seen in results:
        assert {"PPConfigError", "PPPeerError", "PPTensorError", "PPMismatchError"} <= set(seen)


def _peer_never_receives(rank: int, num_ranks: int, timeout_s: float) -> str:
    eb = ElasticBuffer(num_bytes=2 * MiB, explicitly_destroy=True, num_gpu_timeout_secs=timeout_s)
    eb.pp_set_config(64, 1)
    if rank == 0:
        eb.pp_send(torch.zeros(4), 1)  # takes the one slot
        try:
            eb.pp_send(torch.zeros(4), 1)  # must wait for rank 1's recv, which never comes
        except PPTimeoutError as exc:
            return str(exc)
        return "no timeout"
    time.sleep(timeout_s + 3)  # stays alive (and never receives) until rank 0 has timed out
    return ""


def test_peer_that_never_receives_times_out():
    message = run_distributed(_peer_never_receives, 2, 2.0)[0]
    assert "rank 0 of 2 timed out" in message, message
    assert "stage 'pp_send to rank 1: waiting for rank 1 to pp_recv message #0" in message, message


def _peer_never_sends(rank: int, num_ranks: int, timeout_s: float) -> str:
    eb = ElasticBuffer(num_bytes=2 * MiB, explicitly_destroy=True, num_gpu_timeout_secs=timeout_s)
    eb.pp_set_config(64, 1)
    if rank == 1:
        try:
            eb.pp_recv(torch.zeros(4), 0)  # rank 0 never sends
        except PPTimeoutError as exc:
            return str(exc)
        return "no timeout"
    time.sleep(timeout_s + 3)
    return ""


def test_recv_from_a_peer_that_never_sends_times_out():
    message = run_distributed(_peer_never_sends, 2, 2.0)[1]
    assert "rank 1 of 2 timed out in stage 'pp_recv header of message #0 from rank 0'" in message, message
