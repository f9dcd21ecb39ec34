"""Expert-major dispatch and weighted combine (`ep_moe.buffer.expert_major_ops`) against the loop reference
(`ep_moe.reference.reference_expert_dispatch` / `reference_expert_combine`), bit for bit, at 1 to 4 gloo ranks,
on random and adversarial routings, alignments 1/16/128, exact and fixed size (T = N and T < N), both combine
modes, weighted and plain; gradients through autograd against the same expressions; gradcheck of the weights'
gradient; and the errors (docs/semantics.md, "Expert-major layout")."""

from __future__ import annotations

import pytest
import torch
from support.world_sizes import run_world_sizes
from support_core import Case, check, check_bits, check_equal, make_inputs

from ep_moe import Buffer
from ep_moe.buffer.expert_major_ops import expert_combine, expert_dispatch
from ep_moe.permute import max_slots
from ep_moe.reference import reference_expert_combine, reference_expert_dispatch


def _cases(num_ranks: int) -> list[Case]:
    E = 4 * num_ranks
    tokens = tuple(9 + 4 * s for s in range(num_ranks))
    return [
        Case("random", tokens, 256, 3, E, "random", "bf16", 1),
        Case("random fp32 A16", tokens, 128, 4, E, "random", "fp32", 16),
        Case("one expert A128", tokens, 128, 2, E, "one_expert", "bf16", 128),
        Case("all -1", tokens, 128, 2, E, "all_minus_one", "bf16", 16),
        Case("one rank", tokens, 128, 3, E, "one_rank", "bf16", 1),
        Case("sparse (empty experts)", tokens, 128, 2, E, "sparse", "fp32", 16),
        Case("empty rank", (0,) + tokens[1:], 128, 2, E, "random", "bf16", 1),
        Case("fp8 pair A16", tokens, 256, 3, E, "random", "fp8", 16),
    ]


def _ys(refs, hidden: int, dtype: torch.dtype, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Expert outputs of very different magnitudes (sums then depend on their order) and weights per rank."""
    gen = torch.Generator().manual_seed(seed)
    ys = [(torch.randn(ref.expert_x.shape[0], hidden, generator=gen)
           * 10.0 ** torch.randint(-3, 4, (ref.expert_x.shape[0], 1), generator=gen)).to(dtype) for ref in refs]
    return ys, [ref.expert_weights.clone() for ref in refs]


def _run_case(buffer: Buffer, rank: int, num_ranks: int, case: Case, seed: int, fixed: int) -> None:
    where = f"{case.name} R={rank}/{num_ranks} fixed={fixed}"
    inp = make_inputs(case, num_ranks, seed)
    x, idx, w = inp.x(rank), inp.idxs[rank], inp.weights[rank]
    local = case.experts // num_ranks
    num_slots = max_slots(fixed, case.topk, local, case.alignment) if fixed else None
    refs = reference_expert_dispatch(inp.xs, inp.idxs, inp.weights, case.experts, case.alignment, num_slots,
                                     scales=inp.scales)
    out = expert_dispatch(buffer, x, idx, w, case.experts, case.alignment, num_worst_tokens=fixed)
    ref = refs[rank]
    if inp.scales is not None:  # the FP8 pair: rows and scales, each bit for bit
        check(isinstance(out.expert_x, tuple) and len(out.expert_x) == 2, where, "expert_x is a pair")
        check_bits(out.expert_x[1], ref.expert_scales, where, "expert scales")
        check(not out.expert_weights.requires_grad, where, "no autograd through an FP8 dispatch")
        out = out._replace(expert_x=out.expert_x[0])
        x = x[0].new_empty(0, case.hidden, dtype=torch.bfloat16)  # the experts' output dtype below
    check_bits(out.expert_x, ref.expert_x, where, "expert_x")
    check_bits(out.expert_weights, ref.expert_weights, where, "expert_weights")
    check(out.tokens_per_expert.tolist() == ref.num_recv_tokens_per_expert, where, "tokens_per_expert")
    check(out.pairs_per_expert.tolist() == ref.num_recv_pairs_per_expert, where, "pairs_per_expert")
    if not fixed:
        check(out.tokens_per_expert_list == ref.num_recv_tokens_per_expert, where, "tokens_per_expert_list")
    ys, yws = _ys(refs, case.hidden, x.dtype, seed * 7919 + fixed)
    for weighted in (True, False):
        for multiple in (True, False):
            got = expert_combine(buffer, ys[rank], out.handle, yws[rank] if weighted else None, multiple)
            want = reference_expert_combine(ys, refs, inp.idxs, list(case.tokens), yws if weighted else None,
                                            multiple)[rank]
            check_equal(got, want, where, f"combine weighted={weighted} multiple_reduction={multiple}")


def _weight_gradient_case(buffer: Buffer) -> None:
    """One rank: the routing weights' gradient is ``<grad_out[t], y[slot of (t, k)]>`` (fp32), through the
    dispatch's expert weights and the weighted combine."""
    case = Case("grad", (11,), 128, 3, 6, "random", "fp32", 4)
    inp = make_inputs(case, 1, 99)
    w = inp.weights[0].clone().requires_grad_(True)
    out = expert_dispatch(buffer, inp.xs[0], inp.idxs[0], w, case.experts, case.alignment)
    y = out.expert_x * torch.linspace(0.5, 2.0, out.expert_x.shape[0]).unsqueeze(1)
    grad_out = torch.randn(case.tokens[0], case.hidden, generator=torch.Generator().manual_seed(5))
    (expert_combine(buffer, y, out.handle, out.expert_weights) * grad_out).sum().backward()
    want = torch.zeros_like(w)
    for slot, pair in enumerate(reference_expert_dispatch(inp.xs, inp.idxs, inp.weights, case.experts,
                                                          case.alignment)[0].pairs):
        if pair is not None:
            want[pair[1], pair[2]] = (grad_out[pair[1]] * y[slot].detach()).sum()
    torch.testing.assert_close(w.grad, want, rtol=1e-6, atol=1e-6)


def _worker(rank: int, num_ranks: int, group) -> int:
    buffer = Buffer(group, backend="torch", timeout_s=60)
    checked = 0
    for seed, case in enumerate(_cases(num_ranks), start=1):
        most = max(case.tokens) * num_ranks  # a bound on the rows any rank receives
        for fixed in (0, most, most + 5):
            _run_case(buffer, rank, num_ranks, case, seed, fixed)
            checked += 1
    if num_ranks == 1:
        _weight_gradient_case(buffer)
    buffer.destroy()
    return checked


def _all_workers(rank: int, num_ranks: int, group) -> dict:
    """Every multi-rank check of this file at this world size (one spawned job of 4 ranks runs them all)."""
    out = {"equal": _worker(rank, num_ranks, group)}
    if num_ranks <= 3:
        out["gradcheck"] = _gradcheck_worker(rank, num_ranks, group)
    if num_ranks == 2:
        out["empty_rank"] = _empty_rank_backward_worker(rank, num_ranks, group)
    if num_ranks == 3:
        out["exact_combine"] = _exact_combine_worker(rank, num_ranks, group)
    return out


@pytest.fixture(scope="module")
def by_world_size() -> dict[int, list[dict]]:
    """`_all_workers` at 1, 2, 3 and 4 ranks: 4 spawned ranks, the smaller sizes on subgroups of them."""
    return run_world_sizes(_all_workers, (1, 2, 3, 4), join_timeout_s=600)


def _results(by_world_size: dict[int, list[dict]], num_ranks: int, name: str) -> list:
    return [r[name] for r in by_world_size[num_ranks]]


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_expert_major_equals_the_reference(by_world_size, num_ranks: int) -> None:
    checked = _results(by_world_size, num_ranks, "equal")
    assert checked == [3 * len(_cases(num_ranks))] * num_ranks


def _empty_rank_backward_worker(rank: int, num_ranks: int, group) -> list[float]:
    """Every token routes to rank 0's experts, so rank 1 receives no pair (its ``y`` is ``[0, H]``); the backward of
    the exact combine (``allow_multiple_reduction=False``) is a collective that rank 1 must enter all the same."""
    buffer = Buffer(group, backend="torch", timeout_s=20)
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(6, 8, generator=gen, requires_grad=True)
    idx = torch.tensor([[0, 1]] * 6)
    w = torch.rand(6, 2, generator=gen)
    out = expert_dispatch(buffer, x, idx, w, 4)
    y = (out.expert_x * 2).detach().requires_grad_(True)
    expert_combine(buffer, y, out.handle, out.expert_weights.detach(), allow_multiple_reduction=False).sum().backward()
    buffer.destroy()
    return [y.shape[0], float(y.grad.abs().sum()) if y.grad is not None else -1.0]


def test_a_rank_without_pairs_enters_the_exact_combines_backward(by_world_size) -> None:
    got = _results(by_world_size, 2, "empty_rank")
    assert got[1] == [0, 0.0] and got[0][0] == 24 and got[0][1] > 0, got  # 2 sources x 6 tokens x 2 pairs


def _k_combines(buffer: Buffer, y: torch.Tensor, handle, weights: torch.Tensor | None) -> torch.Tensor:
    """The exact combine (``allow_multiple_reduction=False``) as it was composed before one collective carried it:
    per k, a rank-major combine of ``[N, H]`` fp32 rows (pair (i, k)'s ``w * y``, 0 where it has none), then the
    source's sum over k in top-k order, from 0, in fp32, rounded once."""
    from ep_moe.buffer.autograd_ops import combine

    layout = handle.layout
    products = y.float() if weights is None else weights.unsqueeze(1) * y.float()
    columns = []
    for k in range(layout.num_topk):
        slots = layout.slot_of_pair[:, k]
        picked = products.index_select(0, slots.clamp(min=0)) if y.shape[0] else products.new_zeros(
            slots.shape[0], y.shape[1]) + products.sum()
        rows = torch.where((slots >= 0).unsqueeze(1), picked, torch.zeros_like(picked))
        columns.append(combine(buffer, rows, handle.dispatch, num_sms=handle.num_sms)[0])
    acc = torch.zeros(handle.topk_idx.shape[0], y.shape[1])
    for column in columns:
        acc = acc + column
    return acc.to(y.dtype)


def _exact_combine_worker(rank: int, num_ranks: int, group) -> int:
    """``allow_multiple_reduction=False`` is one rank-major combine of ``[N, K * H]`` fp32 rows forward and one
    cached dispatch of ``[T, H]`` back, and gives the K-combine formula's output, ``grad_y`` and ``grad_w`` bit for
    bit (and the reference's output), on random and adversarial routings, exact and fixed size, weighted and
    plain."""
    buffer = Buffer(group, backend="torch", timeout_s=60)
    calls = {"combine": 0, "dispatch": 0}
    widths = {}

    def counting(name: str):
        inner = getattr(buffer.backend, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            widths[name] = args[0].shape[1]  # the rows' width: x (dispatch) or y (combine)
            return inner(*args, **kwargs)
        return counted

    for name in calls:
        setattr(buffer.backend, name, counting(name))
    E = 3 * num_ranks
    tokens = tuple(6 + 3 * s for s in range(num_ranks))
    cases = [Case("random", tokens, 16, 3, E, "random", "bf16", 1),
             Case("random fp32 A4", tokens, 8, 4, E, "random", "fp32", 4),
             Case("one expert (ranks receive nothing)", tokens, 8, 2, E, "one_expert", "bf16", 1),
             Case("all -1", tokens, 8, 2, E, "all_minus_one", "fp32", 2),
             Case("one rank", tokens, 8, 3, E, "one_rank", "bf16", 1),
             Case("empty source", (0,) + tokens[1:], 8, 2, E, "random", "bf16", 1)]
    checked = 0
    for seed, case in enumerate(cases, start=50):
        inp = make_inputs(case, num_ranks, seed)
        fixed = max(case.tokens) * num_ranks if seed % 2 else 0
        out = expert_dispatch(buffer, inp.x(rank), inp.idxs[rank], inp.weights[rank], case.experts, case.alignment,
                              num_worst_tokens=fixed)
        refs = reference_expert_dispatch(inp.xs, inp.idxs, inp.weights, case.experts, case.alignment,
                                         max_slots(fixed, case.topk, case.experts // num_ranks, case.alignment)
                                         if fixed else None)
        ys, yws = _ys(refs, case.hidden, inp.xs[0].dtype, seed)
        gen = torch.Generator().manual_seed(seed + 100 * rank)
        grad_out = torch.randn(case.tokens[rank], case.hidden, generator=gen).to(ys[rank].dtype)
        grad_out[:1, :3] = -0.0  # autograd's sums into zeros take a -0 gradient as +0: so must the custom backward
        for weighted in (True, False):
            where = f"{case.name} R={rank}/{num_ranks} fixed={fixed} weighted={weighted}"
            results = []
            for fn in ("one", "k"):
                y = ys[rank].clone().requires_grad_(True)
                w = yws[rank].clone().requires_grad_(True) if weighted else None
                before = dict(calls)
                got = (expert_combine(buffer, y, out.handle, w, allow_multiple_reduction=False) if fn == "one"
                       else _k_combines(buffer, y, out.handle, w))
                forward = calls["combine"] - before["combine"]
                grads = torch.autograd.grad(got, [t for t in (y, w) if t is not None], grad_out)
                backward = calls["dispatch"] - before["dispatch"]
                results.append((got.detach(), *grads))
                if fn == "one":
                    check((forward, backward) == (1, 1), where, f"one collective each way, got {forward}, {backward}")
                    check((widths["combine"], widths["dispatch"]) == (case.topk * case.hidden, case.hidden), where,
                          f"[N, K * H] rows forward, [T, H] back, got widths {widths}")
            for name, a, b in zip(("output", "grad y", "grad w"), *results):
                check_bits(a, b, where, name)
            want = reference_expert_combine(ys, refs, inp.idxs, list(case.tokens), yws if weighted else None,
                                            False)[rank]
            check_equal(results[0][0], want, where, "output vs the reference")
            checked += 1
    buffer.destroy()
    return checked


def test_exact_combine_is_one_collective_equal_to_k_combines(by_world_size) -> None:
    assert _results(by_world_size, 3, "exact_combine") == [12] * 3


def _gradcheck_worker(rank: int, num_ranks: int, group) -> bool:
    """float64 gradcheck (see tests/core/test_autograd.py on gradcheck across ranks: every rank makes the same
    number of evaluations, and a rank's output may depend on its own inputs only). On every rank: the tokens
    ``x`` and the routing weights, which travel with the tokens and come back. On one rank also the expert side:
    the expert rows' scale and the combine's per-row weights."""
    buffer = Buffer(group, backend="torch", timeout_s=60)
    gen = torch.Generator().manual_seed(3 + rank)
    tokens, hidden, topk, experts = 5, 4, 2, 2 * num_ranks
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    x = torch.randn(tokens, hidden, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(tokens, topk, dtype=torch.float64, generator=gen, requires_grad=True)
    scale = rank + 1.5  # a row-wise "expert" that differs per receiving rank

    def source_side(x, w):
        out = expert_dispatch(buffer, x, idx, w.float(), experts, 2)
        return expert_combine(buffer, out.expert_x * scale + out.expert_x ** 2, out.handle,
                              out.expert_weights.double())

    # the weights reach the op as fp32: a larger step and tolerance (the function is linear in them)
    ok = torch.autograd.gradcheck(source_side, (x, w), eps=1e-3, atol=1e-3, rtol=1e-3)
    if num_ranks == 1:
        slots = expert_dispatch(buffer, x.detach(), idx, w.detach().float(), experts, 2).expert_x.shape[0]
        row_scale = torch.rand(slots, 1, dtype=torch.float64, generator=gen, requires_grad=True)
        row_weights = torch.rand(slots, dtype=torch.float64, generator=gen, requires_grad=True)

        def expert_side(x, row_scale, row_weights):
            out = expert_dispatch(buffer, x, idx, w.detach().float(), experts, 2)
            return expert_combine(buffer, out.expert_x * row_scale, out.handle, row_weights)

        ok = ok and torch.autograd.gradcheck(expert_side, (x, row_scale, row_weights))
    buffer.destroy()
    return ok


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_gradcheck_through_expert_major(by_world_size, num_ranks: int) -> None:
    assert _results(by_world_size, num_ranks, "gradcheck") == [True] * num_ranks


def test_torch_compile_traces_the_local_path() -> None:
    """torch.compile (aot_eager, fullgraph) of a fixed-size local dispatch -> row function -> weighted combine
    gives eager's values and gradients bit for bit (on CUDA the native ops' fakes are traced instead:
    tests/native/test_expert_major_kernels.py)."""
    from ep_moe.buffer.expert_major_ops import local_expert_combine, local_expert_dispatch

    T, H, E, K = 32, 16, 8, 2
    gen = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[::4, 1] = -1
    x0, w0 = torch.randn(T, H, generator=gen), torch.rand(T, K, generator=gen)

    def layer(x, w):
        out = local_expert_dispatch(x, idx, w, E, expert_alignment=4, num_worst_tokens=T, check_values=False)
        return local_expert_combine(torch.relu(out.expert_x) * 2, out.handle, out.expert_weights)

    results = []
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(x, w)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    for name, got, want in zip(("output", "grad x", "grad weights"), results[1], results[0]):
        assert torch.equal(got, want), name
