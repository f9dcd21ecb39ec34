"""The native PP/AGRS transport (`ep_moe.native.stream_transport`: copy engine + stream memory operations) on GPUs.

One GPU (R = 1): the guarded wait (a word nobody writes times out within the deadline with the rank and stage
named, the stream is released and usable, the waiter refuses further work; a word written late after a payload
releases the wait with the payload visible), the batched driver copy, and `ElasticBuffer`'s PP ring to itself and
one-rank AGRS sessions on the native transport, bit for bit equal to the torch transport on the same buffer (many
dtypes and shapes, non-contiguous tensors, several in flight, a side stream, so that the batched copy runs too),
session reuse and every misuse error. The guarded-wait and batched-copy checks run each in a child Python process
(`_isolated`), the others in ranks spawned by `run_distributed`: a process that aborts fails its test only.

Several ranks: the workers `pp_ring_worker`, `agrs_worker` and `timeout_worker` are functions of (rank, world)
that build an `ElasticBuffer` on the default group, so they run on real GPUs with NCCL (``EP_MOE_TEST_WORLD``
ranks, default 2, one GPU each) and under the one-GPU harness of several processes (``EP_MOE_SYMMETRIC_MEMORY=vmm``,
tests/support/shared_gpu.py). Expected values are computed directly (every
rank generates every rank's inputs from seeds); over NCCL they are also compared with the torch transport's.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.bits import assert_bits_equal, bits
from support.shared_gpu import run_on_one_gpu, skip_unless_shared_gpu_runs

from ep_moe import ElasticBuffer, native
from ep_moe.distributed import run_distributed
from ep_moe.elastic.agrs import AGRSCapacityError, AGRSSessionError, AGRSTimeoutError
from ep_moe.elastic.pipeline_comm import PPConfigError, PPMismatchError, PPSlotsFullError, PPTimeoutError

pytestmark = pytest.mark.gpu

WORLD = int(os.environ.get("EP_MOE_TEST_WORLD", "2"))
MiB = 1 << 20

PP_CASES = [  # (dtype, shape, contiguous)
    (torch.bfloat16, (256, 1024), True), (torch.float32, (7,), True), (torch.int64, (3, 5), False),
    (torch.float16, (), True), (torch.uint8, (0,), True), (torch.float64, (33, 3), False),
    (torch.int8, (4099,), True), (torch.bool, (10,), True), (torch.float8_e4m3fn, (6, 16), True),
    (torch.complex64, (5,), True),
]


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _need_native(world: int):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPU(s)")
    if not native.kernels_available():  # the native transport comes with the native backend
        pytest.skip(f"no native kernels: {native.kernels_unavailable_reason()}")


def _values(dtype: torch.dtype, shape: tuple, seed: int, device: torch.device) -> torch.Tensor:
    """Deterministic bytes of ``dtype``/``shape`` (finite FP8, 0/1 bools), the same on every process."""
    n = torch.Size(shape).numel()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(n, 1) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    elif dtype.is_floating_point and dtype.itemsize == 1:
        raw = raw & 0x77
    elif dtype.is_floating_point or dtype.is_complex:  # no NaN/inf bit patterns: compare by bits anyway
        raw = torch.randn(max(n, 1) * dtype.itemsize // (8 if dtype.is_complex else dtype.itemsize),
                          generator=gen).to(torch.complex64 if dtype.is_complex else dtype).view(torch.uint8)
    return raw[: n * dtype.itemsize].view(dtype).reshape(shape).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes on the host (what a worker returns for the transports to be compared)."""
    return bits(t).cpu()


def _strided(t: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """``t`` itself, or a non-contiguous tensor of the same values (a transposed copy viewed back)."""
    if contiguous or t.dim() < 2:
        return t
    return t.t().contiguous().t()


# ------------------------------------------------------------------------------------------ guarded waits (1 GPU)
# Each runs in a child process of its own (`_isolated`): a wrong driver call or a CUDA error inside a destructor
# aborts the process, which then fails one test instead of ending the session. The children report a dict.
def _timeout_child() -> dict:
    from ep_moe.native.stream_ops import SignalWaiter, Word

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    waiter = SignalWaiter(device, rank=0, num_ranks=1, timeout_s=2.0)
    handles = (waiter.stream.cuda_stream, waiter._rescue.cuda_stream)
    word = torch.zeros(1, dtype=torch.int64, device=device)
    start = time.monotonic()
    try:
        waiter.wait([Word(word, 5, "rank 0's test word")], TimeoutError, "pp_recv", "pp_recv header of message #0")
        message = None
    except TimeoutError as exc:
        message = str(exc)
    elapsed = time.monotonic() - start
    x = torch.arange(4096, device=device)
    with torch.cuda.stream(waiter.stream):  # the waiter's stream runs work again
        y = x * 3
    waiter.stream.synchronize()
    torch.cuda.synchronize()
    try:
        waiter.check(TimeoutError, "pp_send")
        refused = None
    except TimeoutError as exc:
        refused = str(exc)
    waiter.destroy()
    del waiter, y  # the rescue's pinned word (it read the word on the rescue stream) is freed now: no abort
    gc.collect()
    torch.cuda.synchronize()
    again = SignalWaiter(device, rank=0, num_ranks=1, timeout_s=2.0)
    reused = (again.stream.cuda_stream, again._rescue.cuda_stream) == handles
    again.destroy()
    return {"message": message, "elapsed": elapsed, "word": int(word.item()), "refused": refused, "reused": reused,
            "stream_ok": True}


def test_guarded_wait_times_out_names_rank_and_stage_and_releases_the_stream():
    _need_cuda()
    r = _isolated("_timeout_child")
    message, elapsed = r["message"], r["elapsed"]
    assert message is not None, "the wait did not time out"
    assert 2.0 <= elapsed < 2.0 + 12.0, elapsed  # the deadline, plus the rescue's grace at most
    assert message.startswith("ep_moe.ElasticBuffer.pp_recv: rank 0 of 1 timed out in stage 'pp_recv header of "
                              "message #0'"), message
    assert "rank 0's test word: word 0 < 5" in message and "the stream was released" in message, message
    assert r["word"] == 5  # the rescue wrote the awaited value
    assert r["refused"] is not None and "stopped after an earlier timeout" in r["refused"], r
    assert r["reused"], "the next waiter did not get the pooled streams back"
    print(f"guarded wait: timed out after {elapsed:.2f} s (deadline 2 s): {message}")


def _late_write_child() -> dict:
    from ep_moe.native.stream_ops import SignalWaiter, Word, stream_ops

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    rounds = []
    for value in (3, 4):  # the second waiter reuses the first one's (pooled) stream
        waiter = SignalWaiter(device, rank=0, num_ranks=1, timeout_s=30.0)
        word = torch.zeros(1, dtype=torch.int64, device=device)
        data = torch.zeros(1 << 20, dtype=torch.int32, device=device)
        source = torch.arange(1 << 20, dtype=torch.int32, device=device) * value
        host = torch.empty(1 << 20, dtype=torch.int32, pin_memory=True)
        writer = torch.cuda.Stream(device)
        writer.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(writer):
            torch.cuda._sleep(200_000_000)  # ~0.1 s: the wait is queued well before the write
            data.copy_(source)              # the payload (a copy), then its flag with a fence
            stream_ops().write(writer.cuda_stream, word.data_ptr(), value)
        waiter.wait([Word(word, value, "late word")], TimeoutError, "all_gather", "test",
                    then=lambda _, host=host, data=data: host.copy_(data, non_blocking=True))
        rounds.append((bool(torch.equal(host, source.cpu())), waiter.stream.cuda_stream))
        waiter.destroy()
        # The abort the lead saw: ``host`` took part in a non_blocking copy on the waiter's stream, so torch records
        # an event on that stream when ``host`` is freed, here after destroy(). The stream must still exist.
        del host
        gc.collect()
        torch.cuda.synchronize()
    return {"equal": [eq for eq, _ in rounds], "same_stream": rounds[0][1] == rounds[1][1]}


def test_guarded_wait_sees_a_late_write_and_the_data_before_it():
    _need_cuda()
    r = _isolated("_late_write_child")
    assert r["equal"] == [True, True] and r["same_stream"], r


def _batched_copy_child() -> dict:
    from ep_moe.native.stream_ops import stream_ops

    ops = stream_ops()
    if not ops.has_batch_copy:
        return {"skip": f"the driver ({ops.driver_version}) has no cuMemcpyBatchAsync_v2 (CUDA 13)"}
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device) for n in (32, 4097, 3 << 20)]
    targets = [torch.zeros_like(s) for s in sources]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    ops.batch_copy(side.cuda_stream, [(t.data_ptr(), s.data_ptr(), s.numel()) for t, s in zip(targets, sources)])
    side.synchronize()
    return {"equal": [bool(torch.equal(t, s)) for t, s in zip(targets, sources)]}


def test_batched_copy_moves_every_piece():
    _need_cuda()
    r = _isolated("_batched_copy_child")
    if "skip" in r:
        pytest.skip(r["skip"])
    assert r["equal"] == [True, True, True], r


_RESULT_PREFIX = "EP_MOE_CHILD_RESULT "


def _isolated(child: str, timeout_s: float = 120.0) -> dict:
    """Run ``child()`` (a function of this module returning a JSON-able dict) in a fresh Python process; its
    dict. Fails the test, with the child's output, when the child dies (a signal, e.g. SIGABRT), exits non-zero
    (also at its exit, after reporting), reports nothing, or runs past ``timeout_s``."""
    tests = Path(__file__).resolve().parents[1]  # the module imports the test-support package from there
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tests.parent), str(tests),
                                                                    os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), child], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{child} ran past {timeout_s:g} s; its output:\n{exc.stdout or ''}{exc.stderr or ''}")
    output = f"{done.stdout}{done.stderr}"
    if done.returncode != 0:
        how = (f"was killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else f"exited with {done.returncode}")
        pytest.fail(f"{child} {how}; its output:\n{output[-8000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT_PREFIX)]
    if not lines:
        pytest.fail(f"{child} reported nothing; its output:\n{output[-8000:]}")
    print(done.stdout, end="")
    return json.loads(lines[-1][len(_RESULT_PREFIX):])


# ------------------------------------------------------------------------------------------ ElasticBuffer, R = 1
def _one_rank_sequence(eb: ElasticBuffer, transport: str, stream: torch.cuda.Stream | None) -> list[torch.Tensor]:
    """PP to itself and one-rank AGRS sessions; every output's bytes (compared across transports)."""
    dev = eb.buffer.device
    out = []
    eb.pp_set_config(1 * MiB, 3, transport=transport)
    eb.agrs_set_config(8 * MiB, 4, transport=transport)
    assert eb._pp.transport == transport and eb._agrs.transport == transport
    with torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream(dev)):
        for rnd in range(3):
            for first in range(0, len(PP_CASES), 3):  # three in flight, then their recvs
                batch = PP_CASES[first: first + 3]
                sent = []
                for k, (dtype, shape, contiguous) in enumerate(batch):
                    x = _strided(_values(dtype, shape, 1000 * rnd + first + k, dev), contiguous)
                    eb.pp_send(x, 0)
                    sent.append(x.clone())
                    x.zero_()  # the sender may change x at once
                for (dtype, shape, contiguous), want in zip(batch, sent):
                    got = _strided(torch.empty(shape, dtype=dtype, device=dev), not contiguous)
                    eb.pp_recv(got, 0)
                    assert_bits_equal(got, want, f"{transport} round {rnd} {dtype}{shape}")
                    out.append(_bits(got))
        for session in range(2):
            eb.create_agrs_session()
            inplace = eb.agrs_get_inplace_tensor((64, 256), torch.bfloat16)
            inplace.copy_(_values(torch.bfloat16, (64, 256), 7 + session, dev))
            plain = _values(torch.float32, (33,), 8 + session, dev)
            odd = _strided(_values(torch.int64, (5, 3), 9, dev), False)
            (g_in, g_plain, g_odd), handle = eb.all_gather([inplace, plain, odd])
            handle()
            assert g_in[0].data_ptr() == inplace.data_ptr()  # gathered without a copy
            assert torch.equal(g_plain[0], plain) and torch.equal(g_odd[0], odd) and torch.equal(g_in[0], inplace)
            x = _values(torch.bfloat16, (1, 4096), 11 + session, dev)
            shard, handle = eb.reduce_scatter(x)
            handle()
            assert torch.equal(shard, x[0].float().to(torch.bfloat16))
            out += [_bits(g_in), _bits(g_plain), _bits(g_odd), _bits(shard)]
            eb.destroy_agrs_session()
    torch.cuda.synchronize(dev)
    return out


def _one_rank_worker(rank: int, world: int) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    eb = ElasticBuffer(num_bytes=32 * MiB, backend="native", explicitly_destroy=True, num_gpu_timeout_secs=30)
    native_default = _one_rank_sequence(eb, "native", None)
    side = _one_rank_sequence(eb, "native", torch.cuda.Stream(dev))  # not the legacy stream: batched copies
    os.environ["EP_MOE_STREAM_BATCH_COPY"] = "0"
    unbatched = _one_rank_sequence(eb, "native", torch.cuda.Stream(dev))
    del os.environ["EP_MOE_STREAM_BATCH_COPY"]
    reference = _one_rank_sequence(eb, "torch", None)
    for name, got in (("native", native_default), ("native, side stream", side), ("native, unbatched", unbatched)):
        assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference)), name
    errors = _one_rank_misuse(eb)
    eb.destroy()
    return {"compared": len(reference), "errors": errors}


def _one_rank_misuse(eb: ElasticBuffer) -> list[str]:
    dev = eb.buffer.device
    caught = []

    def expect(error, call, *words):
        try:
            call()
        except error as exc:
            assert all(w in str(exc) for w in words), (str(exc), words)
            caught.append(type(exc).__name__)
            return
        raise AssertionError(f"no {error.__name__}")

    eb.pp_set_config(4096, 2, transport="native")
    x = torch.ones(8, device=dev)
    expect(PPTimeoutError, lambda: eb.pp_recv(x, 0), "no message to itself is pending")
    eb.pp_send(x, 0)
    eb.pp_send(x * 2, 0)
    expect(PPSlotsFullError, lambda: eb.pp_send(x, 0), "all 2 slots of rank 0 to itself")
    expect(PPConfigError, lambda: eb.pp_set_config(4096, 3, transport="native"), "not received yet")
    expect(PPMismatchError, lambda: eb.pp_recv(torch.empty(8, dtype=torch.bfloat16, device=dev), 0),
           "rank 0 sent torch.float32(8,)", "receives into torch.bfloat16(8,)")
    y = torch.empty(8, device=dev)
    eb.pp_recv(y, 0)  # the mismatched message was dropped: the next one arrives in order
    assert torch.equal(y, x * 2)
    eb.pp_set_config(4096, 3, transport="native")  # reconfigured; message numbers continue
    eb.pp_send(x * 3, 0)
    eb.pp_recv(y, 0)
    assert torch.equal(y, x * 3)
    eb.agrs_set_config(1024, 2, transport="native")
    expect(AGRSSessionError, lambda: eb.all_gather([x]), "no AGRS session is open")
    eb.create_agrs_session()
    expect(AGRSCapacityError, lambda: eb.agrs_get_inplace_tensor((2048,), torch.uint8), "exceed the session's 1024")
    (g,), h = eb.all_gather([x])
    h()
    stale = g
    eb.all_gather([x])[1]()
    expect(AGRSCapacityError, lambda: eb.all_gather([x]), "the session is full on rank 0: operations")
    eb.destroy_agrs_session()
    eb.create_agrs_session()
    expect(AGRSSessionError, lambda: eb.all_gather([stale[0]]), "lies in the AGRS session memory")
    eb.destroy_agrs_session()
    torch.cuda.synchronize(dev)
    return caught


def test_native_transport_one_rank_equals_torch_transport():
    _need_native(1)
    result = run_distributed(_one_rank_worker, 1, backend="nccl", timeout_s=120, join_timeout_s=600)[0]
    assert result["errors"] == ["PPTimeoutError", "PPSlotsFullError", "PPConfigError", "PPMismatchError",
                                "AGRSSessionError", "AGRSCapacityError", "AGRSCapacityError", "AGRSSessionError"]
    print(f"native transport at 1 rank: {result['compared']} outputs bit for bit equal to the torch transport's")


# ------------------------------------------------------------------------------------------ several ranks
def _buffer(timeout_s: int = 60) -> tuple[ElasticBuffer, str | None]:
    eb = ElasticBuffer(num_bytes=64 * MiB, backend="auto", explicitly_destroy=True, num_gpu_timeout_secs=timeout_s)
    if eb.buffer.backend_name != "native":
        return eb, f"the buffer's backend is {eb.buffer.backend_name!r} ({eb.buffer.backend_reason})"
    return eb, None


def _pp_ring(eb: ElasticBuffer, rank: int, world: int, transport: str) -> list[torch.Tensor]:
    dev = eb.buffer.device
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    eb.pp_set_config(2 * MiB, 3, transport=transport)
    assert eb._pp.transport == transport
    received = []
    for rnd in range(4):
        for first in range(0, len(PP_CASES), 3):
            batch = PP_CASES[first: first + 3]
            for k, (dtype, shape, contiguous) in enumerate(batch):  # to next, and (ring both ways) to prev
                eb.pp_send(_strided(_values(dtype, shape, 7919 * rank + 100 * rnd + first + k, dev), contiguous), nxt)
                if world > 2:
                    eb.pp_send(_values(dtype, shape, 31 * rank + 100 * rnd + first + k, dev), prev)
            for k, (dtype, shape, contiguous) in enumerate(batch):
                got = _strided(torch.empty(shape, dtype=dtype, device=dev), not contiguous)
                eb.pp_recv(got, prev)
                want = _values(dtype, shape, 7919 * prev + 100 * rnd + first + k, dev)
                assert_bits_equal(got, want, f"{transport} rank {rank} round {rnd} {dtype}{shape}")
                received.append(_bits(got))
                if world > 2:
                    back = torch.empty(shape, dtype=dtype, device=dev)
                    eb.pp_recv(back, nxt)
                    assert_bits_equal(back, _values(dtype, shape, 31 * nxt + 100 * rnd + first + k, dev),
                                      f"{transport} rank {rank} round {rnd} {dtype}{shape} from the next rank")
                    received.append(_bits(back))
    torch.cuda.synchronize(dev)
    return received


def pp_ring_worker(rank: int, world: int) -> dict:
    """PP both ways around the ring, 3 in flight per neighbour, every case of `PP_CASES`, on the native transport;
    over NCCL also on the torch transport, bit for bit equal."""
    eb, skip = _buffer()
    if skip:
        eb.destroy()
        return {"skip": skip}
    got = _pp_ring(eb, rank, world, "native")
    equal_to_torch = None
    if dist.get_backend() == "nccl":
        reference = _pp_ring(eb, rank, world, "torch")
        equal_to_torch = len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))
    eb.destroy()
    return {"checked": len(got), "equal_to_torch": equal_to_torch}


def _rank_order_sum(parts: list[torch.Tensor], row: int) -> torch.Tensor:
    acc_dtype = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    acc = parts[0][row].to(acc_dtype).clone()
    for p in parts[1:]:
        acc = acc + p[row].to(acc_dtype)
    return acc.to(parts[0].dtype)


def _agrs(eb: ElasticBuffer, rank: int, world: int, transport: str) -> list[torch.Tensor]:
    dev = eb.buffer.device
    eb.agrs_set_config(16 * MiB, 4, transport=transport)
    assert eb._agrs.transport == transport
    out = []
    for session in range(3):  # sessions reuse the memory
        eb.create_agrs_session()
        inplace = eb.agrs_get_inplace_tensor((256, 1024), torch.bfloat16)
        inplace.copy_(_values(torch.bfloat16, (256, 1024), 100 * rank + session, dev))
        plain = _values(torch.float32, (33,), 200 * rank + session, dev)
        odd = _strided(_values(torch.int64, (5, 3), 300 * rank + session, dev), False)
        (g_in, g_plain, g_odd), handle = eb.all_gather([inplace, plain, odd])
        handle()
        assert g_in[rank].data_ptr() == inplace.data_ptr()
        for i in range(world):
            assert torch.equal(g_in[i], _values(torch.bfloat16, (256, 1024), 100 * i + session, dev)), (i, session)
            assert torch.equal(g_plain[i], _values(torch.float32, (33,), 200 * i + session, dev)), (i, session)
            assert torch.equal(g_odd[i], _values(torch.int64, (5, 3), 300 * i + session, dev)), (i, session)
        for dtype in (torch.bfloat16, torch.float32, torch.float64):
            shape = (world, 3000)
            gen = torch.Generator().manual_seed(400 * rank + session)
            x = (torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 4, shape, generator=gen)).to(dtype)
            shard, handle = eb.reduce_scatter(x.to(dev))
            handle()
            parts = []
            for i in range(world):
                gen = torch.Generator().manual_seed(400 * i + session)
                parts.append((torch.randn(shape, generator=gen)
                              * 10.0 ** torch.randint(-3, 4, shape, generator=gen)).to(dtype))
            assert torch.equal(shard.cpu(), _rank_order_sum(parts, rank)), (dtype, session)
            out.append(_bits(shard))
        out += [_bits(g_in), _bits(g_plain), _bits(g_odd)]
        eb.destroy_agrs_session()
    torch.cuda.synchronize(dev)
    return out


def agrs_worker(rank: int, world: int) -> dict:
    """Three AGRS sessions (an in-place, a plain and a non-contiguous tensor gathered; reduce-scatters in bf16,
    fp32, fp64 against the stated rank-order sum) on the native transport; over NCCL also on the torch
    transport, bit for bit equal."""
    eb, skip = _buffer()
    if skip:
        eb.destroy()
        return {"skip": skip}
    got = _agrs(eb, rank, world, "native")
    equal_to_torch = None
    if dist.get_backend() == "nccl":
        reference = _agrs(eb, rank, world, "torch")
        equal_to_torch = len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))
    eb.destroy()
    return {"checked": len(got), "equal_to_torch": equal_to_torch}


def timeout_worker(rank: int, world: int) -> dict:
    """Rank 1 never sends to rank 0 and never joins rank 0's all-gather: rank 0's recv and all-gather raise within
    the deadline (3 s) naming rank 0 and the stage, and rank 0's streams still run afterwards."""
    eb, skip = _buffer(timeout_s=3)
    if skip:
        eb.destroy()
        return {"skip": skip}
    dev = eb.buffer.device
    eb.pp_set_config(4096, 2, transport="native")
    eb.agrs_set_config(4096, 2, transport="native")
    result = {}
    if rank == 0:
        start = time.monotonic()
        try:
            eb.pp_recv(torch.empty(4, device=dev), (rank - 1) % world)
        except PPTimeoutError as exc:
            result["pp"] = (str(exc), time.monotonic() - start)
        x = torch.arange(1 << 16, device=dev)
        result["stream_ok"] = bool(torch.equal((x * 2).cpu(), torch.arange(1 << 16) * 2))
        try:
            eb.create_agrs_session()
            eb.all_gather([x])
        except (AGRSTimeoutError, PPTimeoutError) as exc:
            result["agrs"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()  # the others wait here until rank 0 is done (gloo and NCCL barriers outlast 3 s)
    torch.cuda.synchronize(dev)
    eb.destroy()
    return result


def _run(worker, world: int, backend: str = "nccl") -> list[dict]:
    results = run_distributed(worker, world, backend=backend, timeout_s=120, join_timeout_s=600)
    if any("skip" in r for r in results):
        pytest.skip(results[0].get("skip", "a rank skipped"))
    return results


def test_pp_ring_several_ranks():
    _need_native(WORLD)
    if WORLD < 2:
        pytest.skip("needs EP_MOE_TEST_WORLD >= 2")
    results = _run(pp_ring_worker, WORLD)
    assert all(r["equal_to_torch"] for r in results), results
    print(f"PP ring at {WORLD} ranks: {[r['checked'] for r in results]} messages, equal to the torch transport")


def test_agrs_several_ranks():
    _need_native(WORLD)
    if WORLD < 2:
        pytest.skip("needs EP_MOE_TEST_WORLD >= 2")
    results = _run(agrs_worker, WORLD)
    assert all(r["equal_to_torch"] for r in results), results


def test_a_missing_peer_times_out_with_rank_and_stage():
    _need_native(WORLD)
    if WORLD < 2:
        pytest.skip("needs EP_MOE_TEST_WORLD >= 2")
    result = _run(timeout_worker, WORLD)[0]
    message, elapsed = result["pp"]
    assert f"rank 0 of {WORLD} timed out in stage 'pp_recv header of message #0 from rank {WORLD - 1}'" in message
    assert 3.0 <= elapsed < 3.0 + 12.0 and result["stream_ok"], result
    assert "stopped after an earlier timeout" in result["agrs"], result  # the transport refuses further work
    print(message)


# ------------------------------------------------------------------------------------------ ranks sharing one GPU
def _run_on_one_gpu():
    """The harness of several processes on GPU 0 (``EP_MOE_SYMMETRIC_MEMORY=vmm``)."""
    skip_unless_shared_gpu_runs()
    return run_on_one_gpu


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("worker", [pp_ring_worker, agrs_worker], ids=["pp_ring", "agrs"])
def test_workers_on_one_shared_gpu(worker, world):
    results = _run_on_one_gpu()(worker, world)
    if any("skip" in r for r in results):
        pytest.skip(results[0].get("skip", "a rank skipped"))
    assert all(r["checked"] > 0 for r in results), results


def test_a_missing_peer_times_out_on_one_shared_gpu():
    result = _run_on_one_gpu()(timeout_worker, 2)[0]
    if "skip" in result:
        pytest.skip(result["skip"])
    message, elapsed = result["pp"]
    assert "rank 0 of 2 timed out in stage 'pp_recv header of message #0 from rank 1'" in message, message
    assert 3.0 <= elapsed < 3.0 + 12.0 and result["stream_ok"], result


if __name__ == "__main__":  # a child of `_isolated`: run the named function, report its dict on one line
    print(_RESULT_PREFIX + json.dumps(globals()[sys.argv[1]]()), flush=True)
