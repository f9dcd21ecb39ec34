"""GPU tests of the native backend's rank-disagreement check (docs/native.md, "Rank agreement"): ranks that
disagree on a call's hidden size, dtype, top-k, experts, fixed size or handle raise the torch backend's
`ValueError` on every rank, never a timeout or an abort, nothing moves, and the buffer stays usable.

* One rank (any GPU): there is no peer to disagree with, so the test-only knob
  `NativeBackend.test_header_perturbation` makes the kernels see this rank's header with one value changed: the
  compare, the skip, the record and the host's ValueError all run for real, for a fresh exact-size dispatch
  (raised by the call), a fixed-size dispatch, a cached dispatch and a combine (raised by the next host wait,
  ``barrier()``), and a fixed-size dispatch + combine captured in a CUDA graph whose replay with the knob on
  writes nothing into the outputs. The next correct call equals the torch backend's bit for bit.
* Two or more ranks: every scenario of tests/core/test_rank_mismatch.py (the last rank passes the other value),
  with the copy engine off and forced on; then the knob on every rank with the copy engine forced on (the
  copy-engine copies of a disagreeing call are waited for before its epoch closes) and a combine that only some
  ranks take by the copy engine. On ``EP_MOE_TEST_WORLD`` GPUs (default 2; NCCL), and on ONE GPU shared by 2 and
  3 processes (`support.shared_gpu`: gloo, ``EP_MOE_SYMMETRIC_MEMORY=vmm``). The session functions take the
  group, the device and the buffer's timeout from their caller.

Run: ``pytest -m gpu tests/native/test_native_mismatch_gpu.py`` (the one-rank and shared-GPU tests on one GPU;
the multi-GPU ones skip without ``EP_MOE_TEST_WORLD`` GPUs).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.bits import bit_difference, bits_equal
from support.shared_gpu import DEVICE, run_on_one_gpu, skip_unless_shared_gpu_runs

from ep_moe import Buffer, native
from ep_moe.config import NativeOptions
from ep_moe.distributed import run_distributed
from ep_moe.reference import reference_combine, reference_dispatch

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))
from support_core import Case, check_bits, make_inputs  # noqa: E402
from test_rank_mismatch import E_PER_RANK, SCENARIOS, TOKENS, H, K, _expected, _scenarios  # noqa: E402

pytestmark = pytest.mark.gpu

WORLD = int(os.environ.get("EP_MOE_TEST_WORLD", "2"))  # ranks (GPUs) of the multi-GPU tests
BUFFER_TIMEOUT_S = 10.0
SHARED_TIMEOUT_S = 60.0  # ranks sharing a GPU: a peer's kernel may wait for time slices of every other process
SLOT = {"hidden": 1, "topk": 4, "experts": 5, "worst": 6, "layout": 7}  # agreement's header slots
OFF = (-1, 0, 0)  # the knob's values that change nothing (no rank is source -1)


def _need_gpus(count: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA GPU{'s' if count > 1 else ''}")
    if not native.kernels_available():
        pytest.skip(f"no native kernels: {native.kernels_unavailable_reason()}")


def _options(copy_engine: bool) -> NativeOptions:
    mode = "on" if copy_engine else "off"
    return NativeOptions(dispatch_copy_engine=mode, combine_copy_engine=mode)


def _outcome(call) -> str:
    try:
        call()
    except Exception as exc:  # the outcome is what the tests check
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _call_then_barrier(buffer: Buffer, call) -> str:
    """The first error of ``call()`` and the ``barrier()`` every rank makes after it (a call that does not wait
    on the host raises its disagreement there; one that exchanges its header before a host-side decision, at
    once)."""
    outcome = _outcome(call)
    after = _outcome(buffer.barrier)
    return after if outcome == "no error" else outcome


def _set(knob: torch.Tensor, values: tuple[int, int, int]) -> None:
    """The knob's values, in place (a captured graph keeps reading this tensor)."""
    knob.copy_(torch.tensor(values, dtype=torch.int32))


# ------------------------------------------------------------------------------------------ one rank
def _one_rank_worker(rank: int, world: int, copy_engine: bool) -> list[str]:
    """Every case at one rank with the knob; returns what went wrong (empty: all good)."""
    device = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(backend="native", timeout_s=BUFFER_TIMEOUT_S, native_options=_options(copy_engine))
    ref = Buffer(backend="torch")
    assert buf.backend_name == "native", buf.backend_name
    knob = torch.tensor(OFF, dtype=torch.int32, device=device)
    buf.backend.test_header_perturbation = knob
    T, hidden, topk, E = 64, 256, 4, 8
    W = T + 3
    g = torch.Generator(device=device).manual_seed(11)
    x = torch.randn(T, hidden, generator=g, device=device).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=g, device=device).topk(topk, 1).indices
    w = torch.rand(T, topk, generator=g, device=device)
    failures: list[str] = []

    def expect(what: str, outcome: str, *needles: str) -> None:
        if not outcome.startswith("ValueError: ") or any(n not in outcome for n in needles):
            failures.append(f"{what}: expected a ValueError with {needles}, got {outcome!r}")

    def same(what: str, got, want) -> None:
        difference = bit_difference(got, want)
        if difference is not None:
            failures.append(f"{what}: differs from the torch backend: {difference}")

    def fresh(worst: int = 0):
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_worst_tokens=worst)

    r_x, _, r_w, _, r_h, _ = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    r_c, r_cw, _ = ref.combine(r_x, r_h, topk_weights=r_w)
    # Warm-up with the knob off, so that no case below grows the buffer (a call about to grow it exchanges its
    # header first and raises at once: the cases are meant to reach the kernels' own checks).
    fresh(W)
    n_x, _, n_w, _, n_h, _ = fresh()
    buf.combine(n_x, n_h, topk_weights=n_w)
    buf.barrier()

    # exact-size fresh dispatch: raised by the call itself (at its one host wait)
    _set(knob, (0, SLOT["hidden"], 1))
    expect("exact dispatch", _outcome(fresh), "ep_moe.dispatch: ranks disagree on the hidden size: ",
           f"rank 0's own call has {hidden}", f"has {hidden + 1}")
    _set(knob, OFF)
    if _outcome(buf.barrier) != "no error":
        failures.append("exact dispatch: something was left for the barrier to raise")
    n_x, _, n_w, _, n_h, _ = fresh()
    same("exact dispatch after the mismatch", n_x, r_x)

    # fixed-size dispatch: no host wait, raised by the next one (barrier)
    _set(knob, (0, SLOT["experts"], 8))
    fresh(W)
    expect("fixed-size dispatch", _outcome(buf.barrier), "ep_moe.dispatch: ranks disagree on num_experts: ",
           f"has {E}", f"has {E + 8}")
    _set(knob, OFF)
    f_x = fresh(W)[0]
    r_f = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_worst_tokens=W)[0]
    same("fixed-size dispatch after the mismatch", f_x, r_f)

    # cached dispatch: the handle's layout digest as the kernel saw it differs
    _set(knob, (0, SLOT["layout"], 1))
    buf.dispatch(x, handle=n_h)
    expect("cached dispatch", _outcome(buf.barrier),
           "ep_moe.dispatch: ranks disagree on the handle (the layout of the dispatch that made it): ")
    _set(knob, OFF)
    same("cached dispatch after the mismatch", buf.dispatch(x, handle=n_h)[0], r_x)

    # combine: the weights' width
    _set(knob, (0, SLOT["topk"], 1))
    buf.combine(n_x, n_h, topk_weights=n_w)
    expect("combine", _outcome(buf.barrier), "ep_moe.combine: ranks disagree on topk_weights (given, and their "
           f"width): rank 0's own call has {topk}", f"has {topk + 1}")
    _set(knob, OFF)
    c, cw, _ = buf.combine(n_x, n_h, topk_weights=n_w)
    same("combine after the mismatch", c, r_c)
    same("combine weights after the mismatch", cw, r_cw)

    failures += _graph_case(buf, ref, knob, x, idx, w, E, W)
    buf.destroy()
    ref.destroy()
    return failures


def _graph_case(buf, ref, knob, x, idx, w, E: int, W: int) -> list[str]:
    """A fixed-size dispatch + combine captured in a CUDA graph: a replay with the knob on leaves the outputs
    as they were and the next host wait raises; replays with it off equal the torch backend."""
    failures = []
    static_x, static_idx, static_w = x.clone(), idx.clone(), w.clone()

    def step():
        # Every output is kept until the capture ends: a tensor freed inside the graph gives its memory to a later
        # allocation of the graph (here the combine's output), whose kernel would then see another kernel's
        # writes in a replay where it moves nothing itself.
        per_rank, per_expert, in_rank = buf.backend.get_dispatch_layout(static_idx, E)
        result, _ = buf.dispatch_result(static_x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                        num_tokens_per_expert=per_expert, topk_idx=static_idx, topk_weights=static_w,
                                        num_worst_tokens=W)
        combined = buf.combine(result.recv_x, result.handle, topk_weights=result.recv_topk_weights)
        return result.recv_x, combined[0], (per_rank, per_expert, in_rank, result, combined)

    step()  # outside the graph first (sizes the buffer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_rx, g_combined, _kept = step()
    r_x, _, r_w, _, r_h, _ = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_worst_tokens=W)
    r_c, _, _ = ref.combine(r_x, r_h, topk_weights=r_w)

    def replay_equals(what: str) -> None:
        graph.replay()
        torch.cuda.synchronize()
        if not (bits_equal(g_rx, r_x) and bits_equal(g_combined, r_c)):
            failures.append(f"graph replay {what}: differs from the torch backend")

    replay_equals("before the mismatch")
    _set(knob, (0, SLOT["hidden"], 1))
    g_rx.fill_(7.0)
    g_combined.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    if not (bool((g_rx == 7.0).all()) and bool((g_combined == 7.0).all())):
        failures.append("graph replay with a disagreement wrote into the outputs")
    outcome = _outcome(buf.barrier)
    if not outcome.startswith("ValueError: ep_moe.dispatch: ranks disagree on the hidden size: "):
        failures.append(f"graph replay with a disagreement: the barrier gave {outcome!r}")
    if _outcome(buf.barrier) != "no error":
        failures.append("the record was raised twice")
    _set(knob, OFF)
    replay_equals("after the mismatch")
    return failures


@pytest.mark.parametrize("copy_engine", [False, True], ids=["pushers", "copy_engine_forced"])
def test_one_rank_with_the_test_knob(copy_engine: bool) -> None:
    """(At one rank the copy engine is never taken, forced or not: there is no peer; the forced case checks
    that forcing it changes nothing. Its mismatch path runs at two ranks below.)"""
    _need_gpus(1)
    failures = run_distributed(_one_rank_worker, 1, copy_engine, backend="nccl", timeout_s=120, join_timeout_s=300)
    assert failures == [[]], failures


# ------------------------------------------------------------------------------------------ two or more ranks
def _correct_calls_on(rank: int, buffer: Buffer, inp, E: int, device: torch.device) -> str:
    """A fresh dispatch, a cached one and a combine on ``device``, checked against the reference, then a
    barrier (which would raise a disagreement these calls recorded), then every rank's epoch counter compared
    (a collective on the buffer's group): '' or what failed."""
    ref = reference_dispatch(inp.xs, inp.idxs, inp.weights, E)
    where = f"rank {rank}"
    failure = ""
    try:
        x = inp.x(rank).to(device)
        out = buffer.dispatch(x, topk_idx=inp.idxs[rank].to(device), topk_weights=inp.weights[rank].to(device),
                              num_experts=E)
        check_bits(out[0].cpu(), ref[rank].recv_x, where, "recv_x")
        check_bits(buffer.dispatch(x, handle=out[4])[0].cpu(), ref[rank].recv_x, where, "cached recv_x")
        combined = buffer.combine(out[0], out[4])[0]
        want = reference_combine([r.recv_x for r in ref], ref, [t.shape[0] for t in inp.xs],
                                  topk_idxs=inp.idxs, num_experts=E)[rank][0]
        check_bits(combined.cpu(), want, where, "combined")
        buffer.barrier()
    except Exception as exc:  # the outcome is what the test reports
        failure = f"{type(exc).__name__}: {exc}"
    return failure or _epochs_out_of_step(buffer)


def _epochs_out_of_step(buffer: Buffer) -> str:
    """'' when every rank of the buffer's group has closed as many epochs (`LocalState.seq`, the first int64 of
    the native backend's device state), else every rank's count: a rank behind or ahead meets its peers' other
    operations from then on."""
    torch.cuda.synchronize()
    epochs: list[int | None] = [None] * buffer.group_size
    dist.all_gather_object(epochs, int(buffer.backend._state[0]), group=buffer.group)
    return "" if len(set(epochs)) == 1 else f"the ranks' epoch counts differ: {epochs}"


def mismatch_session(rank: int, num_ranks: int, group: dist.ProcessGroup, device: torch.device,
                     copy_engine: bool, timeout_s: float = BUFFER_TIMEOUT_S) -> dict[str, tuple[str, float, str]]:
    """Every scenario of tests/core/test_rank_mismatch.py on a native Buffer over ``group`` (``timeout_s``), this
    rank's tensors on ``device``. Every rank makes every call, then ``barrier()`` (where a call that does not wait
    on the host raises its disagreement), then correct calls. Returns, per scenario, (the first error of the
    call or the barrier, seconds, what the correct calls afterwards got wrong)."""
    case = Case("mismatch", TOKENS[:num_ranks], H, K, E_PER_RANK * num_ranks, "random", "bf16")
    inp = make_inputs(case, num_ranks, seed=5)
    E = case.experts
    buffer = Buffer(group, backend="native", timeout_s=timeout_s, native_options=_options(copy_engine))
    assert buffer.backend_name == "native", buffer.backend_name
    x, idx, w = inp.x(rank).to(device), inp.idxs[rank].to(device), inp.weights[rank].to(device)
    results = {}
    for name, call in _scenarios(rank, num_ranks, buffer, x, idx, w, E, sum(case.tokens)):
        start = time.monotonic()
        outcome = _call_then_barrier(buffer, call)
        results[name] = (outcome, time.monotonic() - start, _correct_calls_on(rank, buffer, inp, E, device))
    buffer.destroy()
    return results


def perturbed_copy_engine_session(rank: int, num_ranks: int, group: dist.ProcessGroup, device: torch.device,
                                  timeout_s: float = BUFFER_TIMEOUT_S) -> list[str]:
    """The knob on every rank (so every rank sees the same perturbed header) with the copy engine forced on: a
    cached dispatch and a combine whose copy streams were released before the verdict; then a combine that
    only some ranks take by the copy engine. Every rank raises at the barrier, and the next calls equal the
    reference. Returns this rank's outcomes."""
    case = Case("knob", TOKENS[:num_ranks], H, K, E_PER_RANK * num_ranks, "random", "bf16")
    inp = make_inputs(case, num_ranks, seed=9)
    E = case.experts
    buffer = Buffer(group, backend="native", timeout_s=timeout_s, native_options=_options(True))
    knob = torch.tensor(OFF, dtype=torch.int32, device=device)
    buffer.backend.test_header_perturbation = knob
    x, idx, w = inp.x(rank).to(device), inp.idxs[rank].to(device), inp.weights[rank].to(device)
    out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    outcomes = []
    for what, call in (("cached dispatch", lambda: buffer.dispatch(x, handle=out[4])),
                       ("combine", lambda: buffer.combine(out[0], out[4]))):
        _set(knob, (num_ranks - 1, SLOT["hidden"], 1))
        outcomes.append(f"{what}: {_call_then_barrier(buffer, call)}")
        _set(knob, OFF)
        outcomes.append(f"{what} after: {_correct_calls_on(rank, buffer, inp, E, device) or 'ok'}")
    # The copy-engine choice: the last rank's handle lost its backend state (as one rebuilt from its tensors
    # would), so its host does not know the layout and its combine takes the pushers; the others' take the
    # copy engine. Their headers agree: the choice itself is the disagreement.
    handle = out[4]._replace(backend_state=None) if rank == num_ranks - 1 else out[4]
    outcomes.append(f"choice: {_call_then_barrier(buffer, lambda: buffer.combine(out[0], handle))}")
    outcomes.append(f"choice after: {_correct_calls_on(rank, buffer, inp, E, device) or 'ok'}")
    buffer.destroy()
    return outcomes


def _mismatch_worker(rank: int, world: int, copy_engine: bool, timeout_s: float) -> dict:
    """On the GPU this rank's launcher chose (one per rank, NCCL; or GPU 0 shared, gloo)."""
    device = torch.device("cuda", torch.cuda.current_device())
    return mismatch_session(rank, world, dist.group.WORLD, device, copy_engine, timeout_s)


def _perturbed_worker(rank: int, world: int, timeout_s: float) -> list[str]:
    device = torch.device("cuda", torch.cuda.current_device())
    return perturbed_copy_engine_session(rank, world, dist.group.WORLD, device, timeout_s)


def _run(where: str, world: int, fn, *args) -> tuple[list, float]:
    """``fn(rank, world, *args, timeout_s)`` on ``world`` GPUs (NCCL) or ``world`` processes on one GPU."""
    if where == "gpus":
        if world < 2:
            pytest.skip("ranks can only disagree with two or more (EP_MOE_TEST_WORLD >= 2)")
        _need_gpus(world)
        return run_distributed(fn, world, *args, BUFFER_TIMEOUT_S, backend="nccl", timeout_s=120,
                               join_timeout_s=600), BUFFER_TIMEOUT_S
    skip_unless_shared_gpu_runs()
    assert DEVICE.index == 0
    return run_on_one_gpu(fn, world, *args, SHARED_TIMEOUT_S, timeout_s=240, join_timeout_s=900), SHARED_TIMEOUT_S


# (where, ranks, copy engine forced)
SESSIONS = [("gpus", WORLD, False), ("gpus", WORLD, True), ("shared", 2, False), ("shared", 3, False),
            ("shared", 2, True)]


@pytest.fixture(scope="module", params=SESSIONS,
                ids=[f"{w}-{n}ranks-{'copy_engine' if ce else 'pushers'}" for w, n, ce in SESSIONS])
def session(request) -> tuple[int, list[dict], float]:
    where, world, copy_engine = request.param
    results, timeout_s = _run(where, world, _mismatch_worker, copy_engine)
    return world, results, timeout_s


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rank_raises_naming_field_and_values(session, scenario) -> None:
    num_ranks, results, timeout_s = session
    # every rank's outcome in every message: a rank out of step shows in its peers' outcomes too
    every = "; ".join(f"rank {r}: {result[scenario][0]!r}" for r, result in enumerate(results))
    for rank, result in enumerate(results):
        outcome, elapsed, _ = result[scenario]
        assert outcome.startswith("ValueError: "), f"rank {rank}: {outcome} ({every})"
        for needle in _expected(num_ranks)[scenario]:
            assert needle in outcome, f"rank {rank}: {needle!r} not in {outcome!r} ({every})"
        assert elapsed < timeout_s, f"rank {rank} took {elapsed:.1f} s (waited for a peer)"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_buffer_still_works_after_the_mismatch(session, scenario) -> None:
    _, results, _ = session
    for rank, result in enumerate(results):
        failure = result[scenario][2]
        assert not failure, f"rank {rank}: the correct calls after '{scenario}': {failure}"


@pytest.mark.parametrize("where", ["gpus", "shared"])
def test_copy_engine_calls_with_a_perturbed_header(where: str) -> None:
    results, _ = _run(where, WORLD if where == "gpus" else 2, _perturbed_worker)
    for rank, outcomes in enumerate(results):
        assert outcomes[0].startswith("cached dispatch: ValueError: ep_moe.dispatch: ranks disagree on the hidden "
                                      "size: "), f"rank {rank}: {outcomes}"
        assert outcomes[2].startswith("combine: ValueError: ep_moe.combine: ranks disagree on the hidden size: "), \
            f"rank {rank}: {outcomes}"
        assert outcomes[4].startswith("choice: ValueError: ep_moe.combine: ranks disagree on taking the copy engine"), \
            f"rank {rank}: {outcomes}"
        assert outcomes[1::2] == ["cached dispatch after: ok", "combine after: ok", "choice after: ok"], \
            f"rank {rank}: {outcomes}"
