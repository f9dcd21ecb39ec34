"""Ranks that disagree on a call's shape, dtype, top-k, experts, fixed size or handle: every rank raises the same
ValueError naming the field and the ranks' values, before any row moves (no gloo abort, no hang), and the
group stays usable (docs/semantics.md, Errors). At 2, 3 and 4 ranks (one spawned job of 4 ranks, the smaller
sizes on its first ranks: tests/support/world_sizes.py), the last rank is the odd one out."""

from __future__ import annotations

import time

import pytest
import torch
from support.world_sizes import run_world_sizes
from support_core import Case, check_bits, make_inputs

from ep_moe import Buffer
from ep_moe.reference import reference_combine, reference_dispatch

BUFFER_TIMEOUT_S = 10.0
GROUP_TIMEOUT_S = 30.0
H, K, E_PER_RANK = 128, 2, 2
TOKENS = (6, 9, 4, 7, 5, 8, 3, 6)  # T of ranks 0, 1, 2, ... (the GPU version runs up to 8 ranks)
WORLD_SIZES = (2, 3, 4)


def _scenarios(rank: int, num_ranks: int, buffer: Buffer, x, idx, w, E: int, W: int):
    """(name, call) pairs; the ``odd`` rank (the last) passes the other value. Every call is made on every
    rank. ``W``: a ``num_worst_tokens`` that bounds the rows any rank receives. Tensors are made on ``x``'s
    device (tests/native/test_native_mismatch_gpu.py runs the same scenarios on GPUs)."""
    odd = rank == num_ranks - 1
    T = x.shape[0]
    dev = x.device
    fp8 = torch.float8_e4m3fn

    def disp(**kw):
        args = dict(x=x, topk_idx=idx, topk_weights=w, num_experts=E)
        args.update(kw if odd else {})
        return buffer.dispatch(args.pop("x"), **args)

    def fresh_handle(num_worst_tokens=0, routing=idx):
        return buffer.dispatch(x, topk_idx=routing, topk_weights=w, num_experts=E,
                               num_worst_tokens=num_worst_tokens)[4]

    def other_routing():
        """Every token to expert 0 only: another count matrix (so another layout digest) than ``idx``'s."""
        return torch.zeros(T, K, dtype=torch.int64, device=dev).masked_fill_(torch.arange(K, device=dev) > 0, -1)

    def comb(y_odd=None, weights_odd=None, handle_odd=None):
        handle = fresh_handle()
        other = fresh_handle(routing=other_routing()) if handle_odd else None
        use = other if odd and handle_odd else handle
        y = torch.ones(use.num_recv_rows, H, dtype=torch.bfloat16, device=dev)
        if odd and y_odd is not None:
            y = y_odd(use.num_recv_rows)
        weights = weights_odd(use.num_recv_rows) if odd and weights_odd is not None else None
        return buffer.combine(y, use, topk_weights=weights)

    def cached(x_odd=None, handle_odd=None):
        handle = fresh_handle()
        alt = {"fixed": lambda: fresh_handle(num_worst_tokens=W),
               "other": lambda: fresh_handle(routing=other_routing())}
        other = alt[handle_odd]() if handle_odd else None
        return buffer.dispatch(x_odd if odd and x_odd is not None else x,
                               handle=other if odd and handle_odd else handle)

    return [
        # first, while the count exchange has no expert slots yet (E > slots on every rank)
        ("experts before any exact dispatch", lambda: disp(num_experts=2 * E)),
        ("hidden", lambda: disp(x=x[:, :H // 2].contiguous())),
        ("dtype", lambda: disp(x=x.float())),
        ("fp8 vs bf16", lambda: disp(x=(x.to(fp8), torch.ones(T, H // 128, device=dev)))),
        ("topk", lambda: disp(topk_idx=torch.cat([idx, idx[:, :1]], 1), topk_weights=torch.rand(T, K + 1, device=dev))),
        ("experts", lambda: disp(num_experts=2 * E)),  # now the slots hold E: the odd rank's 2E do not fit
        # one expert per rank: fits the slots (which hold E now); the odd rank's ids are in range of it
        ("experts smaller", lambda: disp(num_experts=num_ranks, topk_idx=torch.where(idx >= 0, idx % num_ranks, -1))),
        ("num_worst_tokens on one rank", lambda: disp(num_worst_tokens=W)),
        ("num_worst_tokens values", lambda: buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                            num_worst_tokens=2 * W if odd else W)),
        ("cached hidden", lambda: cached(x_odd=torch.ones(T, 2 * H, dtype=torch.bfloat16, device=dev))),
        ("cached dtype", lambda: cached(x_odd=x.float())),
        ("cached fixed vs exact handle", lambda: cached(handle_odd="fixed")),
        ("cached other handle", lambda: cached(handle_odd="other")),
        ("combine hidden", lambda: comb(y_odd=lambda n: torch.ones(n, H // 2, dtype=torch.bfloat16, device=dev))),
        ("combine dtype", lambda: comb(y_odd=lambda n: torch.ones(n, H, dtype=torch.float32, device=dev))),
        ("combine weights on one rank", lambda: comb(weights_odd=lambda n: torch.rand(n, K, device=dev))),
        ("combine other handle", lambda: comb(handle_odd=True)),
        ("combine vs cached dispatch",
         lambda: cached() if odd else comb()),
    ]


def _correct_calls(rank: int, buffer: Buffer, inp, E: int) -> str:
    """A fresh dispatch, a cached one and a combine, checked against the reference: '' or what failed."""
    ref = reference_dispatch(inp.xs, inp.idxs, inp.weights, E)
    try:
        out = buffer.dispatch(inp.x(rank), topk_idx=inp.idxs[rank], topk_weights=inp.weights[rank], num_experts=E)
        where = f"rank {rank}"
        check_bits(out[0], ref[rank].recv_x, where, "recv_x")
        again = buffer.dispatch(inp.x(rank), handle=out[4])[0]
        check_bits(again, ref[rank].recv_x, where, "cached recv_x")
        combined = buffer.combine(out[0], out[4])[0]
        want = reference_combine([r.recv_x for r in ref], ref, [x.shape[0] for x in inp.xs],
                                  topk_idxs=inp.idxs, num_experts=E)[rank][0]
        check_bits(combined, want, where, "combined")
    except Exception as exc:  # the outcome is what the test reports
        return f"{type(exc).__name__}: {exc}"
    return ""


def _session(rank: int, num_ranks: int, group) -> dict:
    case = Case("mismatch", TOKENS[:num_ranks], H, K, E_PER_RANK * num_ranks, "random", "bf16")
    inp = make_inputs(case, num_ranks, seed=5)
    E = case.experts
    buffer = Buffer(group, backend="torch", timeout_s=BUFFER_TIMEOUT_S)
    results = {}
    scenarios = _scenarios(rank, num_ranks, buffer, inp.x(rank), inp.idxs[rank], inp.weights[rank], E,
                           sum(case.tokens))
    for name, call in scenarios:
        start = time.monotonic()
        try:
            call()
            outcome = "no error"
        except Exception as exc:  # every outcome is reported
            outcome = f"{type(exc).__name__}: {exc}"
        results[name] = (outcome, time.monotonic() - start, _correct_calls(rank, buffer, inp, E))
    return results


@pytest.fixture(scope="module")
def sessions() -> dict[int, list[dict]]:
    # Were a collective of mismatched sizes still possible, gloo would abort a rank (run_world_sizes then
    # raises naming it) or the ranks would wait for the group timeout.
    return run_world_sizes(_session, WORLD_SIZES, timeout_s=GROUP_TIMEOUT_S, join_timeout_s=300)


@pytest.fixture(params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def session(request, sessions) -> tuple[int, list[dict]]:
    return request.param, sessions[request.param]


def _values(num_ranks: int, common: object, odd: object) -> str:
    """How the message lists the ranks' values when the last rank is the odd one out."""
    if num_ranks == 2:
        return f"rank 0 has {common}, rank 1 has {odd}"
    return f"ranks {', '.join(map(str, range(num_ranks - 1)))} have {common}, rank {num_ranks - 1} has {odd}"


def _expected(num_ranks: int) -> dict[str, tuple[str, ...]]:
    """What every rank's message must contain, per scenario."""
    E, W = E_PER_RANK * num_ranks, sum(TOKENS[:num_ranks])
    v = lambda a, b: _values(num_ranks, a, b)  # noqa: E731
    handle = "the handle (the layout of the dispatch that made it): "
    return {
        "experts before any exact dispatch": ("ep_moe.dispatch: ranks disagree on num_experts: " + v(E, 2 * E),),
        "hidden": ("ep_moe.dispatch: ranks disagree on the hidden size: " + v(H, H // 2),),
        "dtype": ("ep_moe.dispatch: ranks disagree on the dtype: " + v(torch.bfloat16, torch.float32),),
        "fp8 vs bf16": ("the dtype: " + v(torch.bfloat16, torch.float8_e4m3fn), "the FP8 scales' width: " + v("none", 1)),
        "topk": ("ep_moe.dispatch: ranks disagree on top-k (topk_idx.shape[1]): " + v(K, K + 1),),
        "experts": ("ep_moe.dispatch: ranks disagree on num_experts: " + v(E, 2 * E),),
        "experts smaller": ("ep_moe.dispatch: ranks disagree on num_experts: " + v(E, num_ranks),),
        "num_worst_tokens on one rank": ("ep_moe.dispatch: ranks disagree on num_worst_tokens: " + v(0, W),),
        "num_worst_tokens values": ("ep_moe.dispatch: ranks disagree on num_worst_tokens: " + v(W, 2 * W),),
        "cached hidden": ("ep_moe.dispatch: ranks disagree on the hidden size: " + v(H, 2 * H),),
        "cached dtype": ("ep_moe.dispatch: ranks disagree on the dtype: " + v(torch.bfloat16, torch.float32),),
        # the same routing: the same count matrix, so the same layout digest; the fixed size tells them apart
        "cached fixed vs exact handle": ("ep_moe.dispatch: ranks disagree on the handle's num_worst_tokens: "
                                         + v(0, W),),
        "cached other handle": ("ep_moe.dispatch: ranks disagree on " + handle,),
        "combine hidden": ("ep_moe.combine: ranks disagree on the hidden size: " + v(H, H // 2),),
        "combine dtype": ("ep_moe.combine: ranks disagree on the dtype: " + v(torch.bfloat16, torch.float32),),
        "combine weights on one rank": ("ep_moe.combine: ranks disagree on topk_weights (given, and their width): "
                                        + v("none", K),),
        "combine other handle": ("ep_moe.combine: ranks disagree on " + handle,),
        "combine vs cached dispatch": ("ranks disagree on the operation: " + v("combine", "cached dispatch (handle=)"),),
    }


SCENARIOS = list(_expected(2))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rank_raises_naming_field_and_values(session, scenario) -> None:
    num_ranks, results = session
    assert set(results[0]) == set(SCENARIOS)
    for rank, result in enumerate(results):
        outcome, elapsed, _ = result[scenario]
        assert outcome.startswith("ValueError: "), f"rank {rank}: {outcome}"
        for needle in _expected(num_ranks)[scenario]:
            assert needle in outcome, f"rank {rank}: {needle!r} not in {outcome!r}"
        assert elapsed < BUFFER_TIMEOUT_S, f"rank {rank} took {elapsed:.1f} s (waited for a peer)"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_group_still_works_after_the_mismatch(session, scenario) -> None:
    _, results = session
    for rank, result in enumerate(results):
        failure = result[scenario][2]
        assert not failure, f"rank {rank}: the correct calls after '{scenario}': {failure}"
