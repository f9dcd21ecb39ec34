"""Bad input raises a ValueError naming the argument before any communication; a missing peer ends in
a TimeoutError naming the stage and the rank; backend selection (docs/semantics.md)."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support_core import Case, check, check_bits, make_inputs

import ep_moe
from ep_moe import Buffer, TokenDispatcher
from ep_moe.distributed import run_distributed
from ep_moe.reference import reference_dispatch

META = torch.device("meta")


def _bad_calls(buffer: Buffer, solo: Buffer, x, idx, w, handle, solo_handle, worst_handle, E: int):
    """(label, call, expected error type, text the message must contain) for one rank's inputs."""
    T, H = x.shape
    K = idx.shape[1]
    N = handle.num_recv_tokens
    y = torch.zeros(N, H, dtype=x.dtype)
    fp8 = torch.float8_e4m3fn

    def disp(**kw):
        args = dict(x=x, topk_idx=idx, topk_weights=w, num_experts=E)
        args.update(kw)
        return lambda: buffer.dispatch(args.pop("x"), **args)

    def comb(**kw):
        args = dict(x=y, handle=handle)
        args.update(kw)
        return lambda: buffer.combine(args.pop("x"), **args)

    bad_idx_hi, bad_idx_lo = idx.clone(), idx.clone()
    bad_idx_hi[T // 2, 0] = E
    bad_idx_lo[T // 2, 1] = -2
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    V = ValueError
    return [
        ("x int32", disp(x=x.to(torch.int32)), V, "'x'"),
        ("x float16", disp(x=x.half()), V, "'x'"),
        ("x 3-D", disp(x=x[None]), V, "'x'"),
        ("x 1-D", disp(x=x[0]), V, "'x'"),
        ("x not a tensor", disp(x=x.tolist()), V, "'x'"),
        ("x on meta", disp(x=torch.empty(T, H, dtype=x.dtype, device=META)), V, "'x'"),
        ("fp8 pair of three", disp(x=(x.to(fp8), torch.ones(T, H // 128), None)), V, "'x'"),
        ("fp8 data bf16", disp(x=(x, torch.ones(T, H // 128))), V, "'x[0]'"),
        ("fp8 hidden not /128", disp(x=(x[:, :100].to(fp8), torch.ones(T, 1))), V, "'x[0]'"),
        ("fp8 scales shape", disp(x=(x.to(fp8), torch.ones(T, H // 64))), V, "'x[1]'"),
        ("fp8 scales bf16", disp(x=(x.to(fp8), torch.ones(T, H // 128, dtype=torch.bfloat16))), V, "'x[1]'"),
        ("topk_idx int32", disp(topk_idx=idx.int()), V, "'topk_idx'"),
        ("topk_idx 1-D", disp(topk_idx=idx[:, 0]), V, "'topk_idx'"),
        ("topk_idx T+1 rows", disp(topk_idx=torch.cat([idx, idx[:1]])), V, "'topk_idx'"),
        ("topk_idx on meta", disp(topk_idx=idx.to(META)), V, "'topk_idx'"),
        ("topk_idx None", disp(topk_idx=None), V, "'topk_idx'"),
        ("expert id == E", disp(topk_idx=bad_idx_hi), V, "'topk_idx'"),
        ("expert id -2", disp(topk_idx=bad_idx_lo), V, "'topk_idx'"),
        ("topk_weights bf16", disp(topk_weights=w.bfloat16()), V, "'topk_weights'"),
        ("topk_weights fp64", disp(topk_weights=w.double()), V, "'topk_weights'"),
        ("topk_weights [T, K+1]", disp(topk_weights=torch.rand(T, K + 1)), V, "'topk_weights'"),
        ("topk_weights on meta", disp(topk_weights=w.to(META)), V, "'topk_weights'"),
        ("topk_weights None", disp(topk_weights=None), V, "'topk_weights'"),
        ("E % R != 0", disp(num_experts=E + 1), V, "'num_experts'"),
        ("E = 0", disp(num_experts=0), V, "'num_experts'"),
        ("E missing", disp(num_experts=None), V, "num_tokens_per_expert"),
        ("E vs num_tokens_per_expert", disp(num_tokens_per_expert=per_expert, num_experts=2 * E), V,
         "'num_experts'"),
        ("num_tokens_per_rank alone", disp(num_tokens_per_rank=per_rank), V, "'is_token_in_rank'"),
        ("is_token_in_rank shape", disp(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank[1:]), V,
         "'is_token_in_rank'"),
        ("is_token_in_rank dtype", disp(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank.int()), V,
         "'is_token_in_rank'"),
        ("num_tokens_per_rank shape", disp(num_tokens_per_rank=per_rank[:1], is_token_in_rank=in_rank), V,
         "'num_tokens_per_rank'"),
        ("num_tokens_per_rdma_rank", disp(num_tokens_per_rdma_rank=per_rank), V, "'num_tokens_per_rdma_rank'"),
        ("expert_alignment 0", disp(expert_alignment=0), V, "'expert_alignment'"),
        ("num_worst_tokens -1", disp(num_worst_tokens=-1), V, "'num_worst_tokens'"),
        # cached dispatch with a handle that does not fit
        ("handle from another T", lambda: buffer.dispatch(x[:-1], handle=handle), V, "'handle'"),
        ("handle from a group of 1", lambda: buffer.dispatch(x, handle=solo_handle), V, "'handle'"),
        ("handle not a handle", lambda: buffer.dispatch(x, handle=tuple(handle)[:3]), V, "'handle'"),
        ("handle plus topk_idx", lambda: buffer.dispatch(x, handle=handle, topk_idx=idx), V, "'topk_idx'"),
        ("handle vs num_worst_tokens", lambda: buffer.dispatch(x, handle=worst_handle, num_worst_tokens=N + 7), V,
         "'num_worst_tokens'"),
        ("bigger group's handle on a group of 1", lambda: solo.dispatch(x, handle=handle), V, "'handle'"),
        # combine
        ("combine x rows N+1", comb(x=torch.zeros(N + 1, H, dtype=x.dtype)), V, "'x'"),
        ("combine x int64", comb(x=y.long()), V, "'x'"),
        ("combine x 1-D", comb(x=y[:, 0]), V, "'x'"),
        ("combine x on meta", comb(x=y.to(META)), V, "'x'"),
        ("combine padded x rows", comb(x=y, handle=worst_handle), V, "'x'"),
        ("combine topk_weights rows", comb(topk_weights=torch.rand(N + 1, K)), V, "'topk_weights'"),
        ("combine topk_weights bf16", comb(topk_weights=torch.rand(N, K).bfloat16()), V, "'topk_weights'"),
        ("combine bias shape", comb(bias=torch.zeros(T + 1, H, dtype=x.dtype)), V, "'bias[0]'"),
        ("combine bias[1] meta", comb(bias=(None, torch.zeros(T, H, dtype=x.dtype, device=META))), V,
         "'bias[1]'"),
        ("combine three biases", comb(bias=(None, None, None)), V, "'bias'"),
        ("combine handle of a group of 1", comb(handle=solo_handle), V, "'handle'"),
        ("combine handle None", comb(handle=None), V, "'handle'"),
        ("combine handle on meta", comb(handle=handle._replace(is_token_in_rank=handle.is_token_in_rank.to(META))), V,
         "'handle'"),
        # layout
        ("layout E % R", lambda: buffer.get_dispatch_layout(idx, E + 1), V, "'num_experts'"),
        ("layout topk_idx float", lambda: buffer.get_dispatch_layout(idx.float(), E), V, "'topk_idx'"),
        ("layout expert id == E", lambda: buffer.get_dispatch_layout(bad_idx_hi, E), V, "'topk_idx'"),
        # the differentiable ops and the dispatcher check the same way
        ("ep_moe.dispatch x int32", lambda: ep_moe.dispatch(buffer, x.int(), idx, w, E), V, "'x'"),
        ("ep_moe.dispatch E % R", lambda: ep_moe.dispatch(buffer, x, idx, w, E + 1), V, "'num_experts'"),
        ("ep_moe.dispatch expert id", lambda: ep_moe.dispatch(buffer, x, bad_idx_hi, w, E), V, "'topk_idx'"),
        ("ep_moe.combine rows", lambda: ep_moe.combine(buffer, torch.zeros(N + 1, H, dtype=x.dtype), handle), V,
         "'x'"),
        ("ep_moe.cached_dispatch T", lambda: ep_moe.cached_dispatch(buffer, x[:-1], handle), V, "'handle'"),
        ("TokenDispatcher E % R", lambda: TokenDispatcher(buffer, E + 1), V, "'num_experts'"),
        # buffer construction
        ("Buffer backend name", lambda: Buffer(backend="nccl"), V, "'backend'"),
        ("Buffer low_latency_mode", lambda: Buffer(low_latency_mode=True), V, "'low_latency_mode'"),
        ("set_num_sms odd", lambda: Buffer.set_num_sms(3), V, "'new_num_sms'"),
    ]


def _bad_input_checks(rank: int, num_ranks: int, sync_group: dist.ProcessGroup) -> list[str]:
    """Rank 0 alone makes every bad call while rank 1 waits at a barrier of another group; had any
    bad call communicated, rank 0 would wait there for the 3 s deadline (a TimeoutError, reported)
    and the group would be out of step for the valid dispatch that follows (reported too)."""
    case = Case("errors", (6, 9, 4, 5)[:num_ranks], 256, 2, 2 * num_ranks, "random", "bf16")
    inp = make_inputs(case, num_ranks, seed=11)
    x, idx, w, E = inp.x(rank), inp.idxs[rank], inp.weights[rank], case.experts
    subgroups = [dist.new_group([r]) for r in range(num_ranks)]  # every rank creates every group
    buffer = Buffer(backend="torch", timeout_s=3)
    solo = Buffer(subgroups[rank], backend="torch", timeout_s=3)
    handle = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)[4]
    worst_handle = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                   num_worst_tokens=sum(case.tokens))[4]
    solo_handle = solo.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)[4]
    failures = []
    if rank == 0:
        for label, call, exc_type, needle in _bad_calls(buffer, solo, x, idx, w, handle, solo_handle,
                                                        worst_handle, E):
            try:
                call()
            except exc_type as exc:
                if needle not in str(exc):
                    failures.append(f"{label}: message does not name {needle}: {exc}")
            except Exception as exc:  # report every wrong outcome, keep going
                failures.append(f"{label}: {type(exc).__name__} instead of {exc_type.__name__}: {exc}")
            else:
                failures.append(f"{label}: no error")
    # Rank 1 waits here, on a group of its own: a stray collective of rank 0 cannot match it.
    Buffer(sync_group, backend="torch", timeout_s=60).barrier()
    # The group is still in step: a real dispatch equals the reference on both ranks.
    ref = reference_dispatch(inp.xs, inp.idxs, inp.weights, E)[rank]
    try:
        out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        check_bits(out[0], ref.recv_x, f"rank {rank}", "recv_x after the bad calls")
        check_bits(out[4].recv_src_idx, ref.recv_src_idx, f"rank {rank}", "recv_src_idx after the bad calls")
    except Exception as exc:  # out of step: report it with the bad calls' outcomes
        failures.append(f"rank {rank}: the valid dispatch after the bad calls: {type(exc).__name__}: {exc}")
    return failures


def _outcome(call) -> str:
    try:
        call()
    except Exception as exc:  # the outcome is what the tests compare
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _capacity_check(rank: int, num_ranks: int, group: dist.ProcessGroup) -> str:
    """Rank 0 receives 12 rows, rank 1 only 3; ``num_worst_tokens=6`` is too small for rank 0 only.
    Every rank knows every rank's count after the notify all-gather, so every rank should raise the
    ValueError (not only rank 0 while rank 1 waits for it in the next exchange)."""
    E, tokens = 2 * num_ranks, 6
    idx = torch.full((tokens, 2), -1, dtype=torch.int64)
    idx[:, 0] = 0  # every token to rank 0
    if rank == 0:
        idx[:3, 1] = E - 1  # three also to rank 1
    buffer = Buffer(group, backend="torch", timeout_s=3)
    x = torch.randn(tokens, 128).bfloat16()
    return _outcome(lambda: buffer.dispatch(x, topk_idx=idx, topk_weights=torch.rand(tokens, 2), num_experts=E,
                                            num_worst_tokens=6))


TIMEOUT_S = 2.0


def _timeout_check(rank: int, num_ranks: int, group: dist.ProcessGroup, done) -> tuple[str, float] | None:
    """Rank 1 never dispatches (it stays alive, so the wait really times out rather than seeing a
    closed connection); rank 0 must get a TimeoutError naming the stage and itself."""
    buffer = Buffer(group, backend="torch", timeout_s=TIMEOUT_S)
    if rank != 0:
        done.wait(timeout=30)
        return None
    x, idx = torch.randn(4, 128).bfloat16(), torch.tensor([[0, 3]] * 4)
    start = time.monotonic()
    try:
        outcome = _outcome(lambda: buffer.dispatch(x, topk_idx=idx, topk_weights=torch.rand(4, 2), num_experts=4))
    finally:
        done.set()
    return outcome, time.monotonic() - start


def _errors_session(rank: int, num_ranks: int, done) -> dict:
    """One spawn for the three scenarios. The last two abandon collectives, so each runs on its own
    group whose short timeout (6 s) frees the ranks' exit from those collectives."""
    short = timedelta(seconds=6)
    sync_group = dist.new_group(list(range(num_ranks)), timeout=timedelta(seconds=60))
    capacity_group = dist.new_group(list(range(num_ranks)), timeout=short)
    timeout_group = dist.new_group(list(range(num_ranks)), timeout=short)
    return {"bad_inputs": _bad_input_checks(rank, num_ranks, sync_group),
            "capacity": _capacity_check(rank, num_ranks, capacity_group),
            "timeout": _timeout_check(rank, num_ranks, timeout_group, done)}


@pytest.fixture(scope="module")
def errors_session() -> tuple[list[dict], float]:
    done = mp.get_context("spawn").Event()
    start = time.monotonic()
    # timeout_s (the world group's) also bounds how long a stray collective of a bad call that
    # failed to raise could hold up the ranks' exit.
    results = run_distributed(_errors_session, 2, done, timeout_s=20, join_timeout_s=90)
    return results, time.monotonic() - start


def test_bad_inputs_raise_before_communicating(errors_session) -> None:
    results, _ = errors_session
    failures = results[0]["bad_inputs"] + results[1]["bad_inputs"]
    assert not failures, "\n".join(failures)


def test_too_small_num_worst_tokens_raises_on_every_rank(errors_session) -> None:
    results, _ = errors_session
    for rank, result in enumerate(results):
        outcome = result["capacity"]
        assert outcome.startswith("ValueError") and "num_worst_tokens" in outcome, f"rank {rank}: {outcome}"


def test_missing_peer_times_out_naming_stage_and_rank(errors_session) -> None:
    results, elapsed = errors_session
    outcome, waited = results[0]["timeout"]
    assert outcome.startswith("TimeoutError"), outcome
    assert "rank 0" in outcome and "'dispatch/notify'" in outcome, outcome
    assert TIMEOUT_S * 0.9 <= waited <= TIMEOUT_S + 5, waited
    assert elapsed < 85  # the run returned (nothing waited for the join deadline)


# ------------------------------------------------------------------------------ backend selection (in process)
def test_backend_selection(solo_group, caplog) -> None:
    with pytest.raises(ValueError, match="'backend'"):
        Buffer(solo_group, backend="gloo")
    with pytest.raises(RuntimeError, match="backend 'native' cannot run here: .+"):
        Buffer(solo_group, backend="native")
    with caplog.at_level(logging.INFO, logger="ep_moe"):
        buffer = Buffer(solo_group, backend="auto")
    assert buffer.backend_name == "torch"
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ep_moe")]
    assert len(lines) == 1, lines
    assert "torch" in lines[0] and "(" in lines[0], lines[0]  # the choice and, in brackets, why
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ep_moe"):
        explicit = Buffer(solo_group, backend="torch")
    assert explicit.backend_name == "torch"
    assert not [r for r in caplog.records if r.name.startswith("ep_moe")], "an explicit backend logs nothing"
    for b in (buffer, explicit):
        b.destroy()


def test_buffer_needs_initialized_distributed() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this test process")
    with pytest.raises(RuntimeError, match="not initialized"):
        Buffer(backend="torch")


def test_destroyed_buffer_is_reported(solo_group) -> None:
    buffer = Buffer(solo_group, backend="torch")
    x, idx = torch.randn(3, 8), torch.tensor([[0], [1], [-1]])
    out = ep_moe.dispatch(buffer, x, idx, torch.rand(3, 1), 2)
    check(out.recv_x.shape == (2, 8), "solo", "a group of one receives its own routed tokens")
    buffer.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        ep_moe.dispatch(buffer, x, idx, torch.rand(3, 1), 2)
