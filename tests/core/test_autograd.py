"""Autograd through the differentiable ops (`ep_moe.dispatch` / `combine` / `cached_dispatch`) and
`TokenDispatcher`: float64 gradcheck, gradients equal to a dense single-process model, the
dispatcher's grouped layout, and torch.compile tracing through the custom ops.

About gradcheck on several ranks: gradcheck perturbs its inputs one element at a time and evaluates
the function for each perturbation, and runs one backward per output element. Every evaluation is a
collective, so every rank must make the same number of them: every rank uses the same T, H and K (the
routing may differ). And since every rank perturbs *its own* element j at the same moment, the
numerical derivative on rank s is only right if rank s's output depends on rank s's inputs alone (the
other ranks' simultaneous perturbations must not leak in). That holds for dispatch followed by a
row-wise function and a combine: each token comes back to the rank it came from. The same argument
covers the analytical side, where every rank back-propagates a one-hot cotangent on its own output.
"""

from __future__ import annotations

import torch
from support_core import Case, check, check_bits, check_equal, make_inputs, small_ints

import ep_moe
from ep_moe import Buffer, TokenDispatcher
from ep_moe.distributed import run_distributed
from ep_moe.reference import reference_dispatch


# ------------------------------------------------------------------------------ gradcheck
def _gradchecks(buffer: Buffer, rank: int, num_ranks: int) -> int:
    # Same T, H, K on every rank (see the module docstring); E = 2R, token 3 has no expert at all.
    case = Case("gradcheck", (4,) * num_ranks, 3, 2, 2 * num_ranks, "random", "fp64")
    inp = make_inputs(case, num_ranks, seed=21)
    E, idx, w32 = case.experts, inp.idxs[rank], inp.weights[rank]
    x = inp.xs[rank].clone().requires_grad_()
    w = w32.double().requires_grad_()  # fp64 leaf for gradcheck; the op itself takes fp32 weights
    scale = rank + 1.0  # the row-wise "experts" differ per receiving rank

    def dispatch_combine(x, num_worst_tokens=0):
        out = ep_moe.dispatch(buffer, x, idx, w32, E, num_worst_tokens=num_worst_tokens)
        y = out.recv_x * scale + 0.5 * out.recv_x ** 2 * out.recv_topk_weights.sum(1, keepdim=True).double()
        return ep_moe.combine(buffer, y, out.handle)[0]

    def weights_path(x, w):
        out = ep_moe.dispatch(buffer, x, idx, w.float(), E)
        local_w = out.recv_topk_weights
        y = out.recv_x * (1 + scale * local_w.sum(1, keepdim=True).double())
        combined, combined_w = ep_moe.combine(buffer, y, out.handle, topk_weights=local_w * local_w)
        return combined, combined_w.double()

    handle = ep_moe.dispatch(buffer, x.detach(), idx, w32, E).handle
    worst = sum(case.tokens)
    worst_handle = ep_moe.dispatch(buffer, x.detach(), idx, w32, E, num_worst_tokens=worst).handle

    def cached_with_bias(x, b0, b1, handle=handle):
        recv = ep_moe.cached_dispatch(buffer, x, handle)
        return ep_moe.combine(buffer, torch.sin(recv) * scale, handle, bias=(b0, b1))[0]

    b0 = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    def gc(fn, inputs, **tolerances) -> bool:
        # Fast mode compares J u with a random u (one evaluation pair per input) instead of every
        # column of J: each evaluation is a round of collectives, so this keeps the suite quick.
        return torch.autograd.gradcheck(fn, inputs, fast_mode=True, **tolerances)

    where = f"gradcheck R={num_ranks} rank={rank}"
    # One full (column by column) Jacobian check, then the fast ones.
    check(torch.autograd.gradcheck(dispatch_combine, (x,)), where, "x -> combine(f(dispatch(x))), full")
    check(gc(lambda x: dispatch_combine(x, worst), (x,)), where, "the same with num_worst_tokens")
    # The weights reach the op as fp32: a larger step and tolerance (the function is bilinear, so
    # central differences are exact up to that rounding).
    check(gc(weights_path, (x, w), eps=1e-3, atol=1e-3, rtol=1e-3), where, "(x, topk_weights) path")
    check(gc(cached_with_bias, (x, b0, b1)), where, "cached_dispatch + combine with two biases")
    check(gc(lambda x, b0, b1: cached_with_bias(x, b0, b1, worst_handle), (x, b0, b1)), where,
          "cached_dispatch + combine through a padded handle")
    return 5


# ------------------------------------------------------------------------------ dense reference
def _dense_model(xs, idxs, ws, experts, cotangents):
    """The same MoE computation in one process: y_s[t] = sum_k w[t,k] * tanh(x_s[t] @ W[idx[t,k]])."""
    total = 0.0
    outputs = []
    for x, idx, w, g in zip(xs, idxs, ws, cotangents):
        y = torch.zeros_like(x)
        for k in range(idx.shape[1]):
            valid = (idx[:, k] >= 0)[:, None]
            h = torch.tanh(torch.einsum("th,thg->tg", x, experts[idx[:, k].clamp(min=0)]))
            y = y + torch.where(valid, w[:, k:k + 1].double() * h, 0.0)
        outputs.append(y)
        total = total + (y * g).sum()
    return outputs, total


def _pipelines(buffer: Buffer, rank: int, num_ranks: int) -> int:
    """dispatch -> per-rank experts -> combine (ops, and TokenDispatcher) has the dense model's
    forward and gradients, for x, topk_weights and the expert weights."""
    R = num_ranks
    case = Case("dense", (6, 3, 0, 5)[:R], 8, 2, 2 * R, "random", "fp64")
    inp = make_inputs(case, R, seed=31)
    E, L, H = case.experts, case.experts // R, case.hidden
    gen = torch.Generator().manual_seed(77)
    experts = torch.randn(E, H, H, generator=gen, dtype=torch.float64) / H ** 0.5
    cotangents = [torch.randn(t, H, generator=gen, dtype=torch.float64) for t in case.tokens]

    xd = [x.clone().requires_grad_() for x in inp.xs]
    wd = [w.clone().requires_grad_() for w in inp.weights]
    ed = experts.clone().requires_grad_()
    dense_out, dense_loss = _dense_model(xd, inp.idxs, wd, ed, cotangents)
    dense_loss.backward()

    def run(kind: str, alignment: int, num_worst_tokens: int) -> None:
        where = f"pipeline[{kind} align={alignment} worst={num_worst_tokens}] R={R} rank={rank}"
        x = inp.xs[rank].clone().requires_grad_()
        w = inp.weights[rank].clone().requires_grad_()
        local = experts[rank * L:(rank + 1) * L].clone().requires_grad_()
        if kind == "ops":
            out = ep_moe.dispatch(buffer, x, inp.idxs[rank], w, E, alignment, num_worst_tokens)
            y = torch.zeros_like(out.recv_x)
            for k in range(case.topk):
                for e in range(L):
                    hit = (out.recv_topk_idx[:, k] == e)[:, None]
                    h = torch.tanh(out.recv_x @ local[e])
                    y = y + torch.where(hit, out.recv_topk_weights[:, k:k + 1].double() * h, 0.0)
            combined = ep_moe.combine(buffer, y, out.handle)[0]
        else:
            dispatcher = TokenDispatcher(buffer, E, alignment, num_worst_tokens)
            expert_input, probs, tokens_per_expert, ctx = dispatcher.dispatch(x, inp.idxs[rank], w)
            sizes = tokens_per_expert.tolist()
            groups = expert_input.split(sizes + [expert_input.shape[0] - sum(sizes)])
            outs = [torch.tanh(g @ local[e]) for e, g in enumerate(groups[:L])] + [groups[L]]
            combined = dispatcher.combine(torch.cat(outs) * probs[:, None].double(), ctx)
        torch.testing.assert_close(combined, dense_out[rank].detach(), msg=lambda m: f"{where} forward: {m}")
        (combined * cotangents[rank]).sum().backward()
        torch.testing.assert_close(x.grad, xd[rank].grad, msg=lambda m: f"{where} grad x: {m}")
        torch.testing.assert_close(w.grad, wd[rank].grad, msg=lambda m: f"{where} grad topk_weights: {m}")
        torch.testing.assert_close(local.grad, ed.grad[rank * L:(rank + 1) * L],
                                   msg=lambda m: f"{where} grad experts: {m}")

    worst = sum(case.tokens)
    runs = [("ops", 1, 0), ("ops", 4, worst), ("dispatcher", 1, 0), ("dispatcher", 4, 0), ("dispatcher", 4, worst)]
    for kind, alignment, num_worst_tokens in runs:
        run(kind, alignment, num_worst_tokens)
    return len(runs)


# ------------------------------------------------------------------------------ TokenDispatcher layout
def _dispatcher_layout(buffer: Buffer, rank: int, num_ranks: int) -> int:
    """expert_input is grouped by local expert in received-row order, each group padded with zero
    rows of prob 0 to the alignment; combine of identity experts is x * (experts per token)."""
    R = num_ranks
    checked = 0
    for seed, case in enumerate([Case("td-random", (13, 4, 0, 9)[:R], 128, 3, 3 * R, "random", "bf16"),
                                 Case("td-one-expert", (5, 8, 2, 1)[:R], 64, 2, 2 * R, "one_expert", "bf16"),
                                 Case("td-idle", (7, 7, 7, 7)[:R], 64, 2, 4 * R, "sparse", "fp32")], start=40):
        inp = make_inputs(case, R, seed)
        E, L, K = case.experts, case.experts // R, case.topk
        x, idx, w = inp.xs[rank], inp.idxs[rank], inp.weights[rank]
        T, H = x.shape
        for alignment in (1, 4):
            ref = reference_dispatch(inp.xs, inp.idxs, inp.weights, E, alignment)[rank]
            rows, probs = [], []
            for e in range(L):
                pairs = [(i, k) for i in range(ref.recv_x.shape[0]) for k in range(K)
                         if int(ref.recv_topk_idx[i, k]) == e]
                rows += [ref.recv_x[i] for i, _ in pairs]
                probs += [ref.recv_topk_weights[i, k] for i, k in pairs]
                pad = ref.num_recv_tokens_per_expert[e] - len(pairs)
                rows += [torch.zeros(H, dtype=x.dtype)] * pad
                probs += [torch.zeros(())] * pad
            want_x = torch.stack(rows) if rows else x.new_zeros(0, H)
            want_p = torch.stack(probs) if probs else torch.zeros(0)
            want_counts = torch.tensor(ref.num_recv_tokens_per_expert, dtype=torch.int64)
            selected = (idx >= 0).sum(1, keepdim=True)
            xi = small_ints(T, H, x.dtype, torch.Generator().manual_seed(seed * 5 + rank))
            for worst in (0, sum(case.tokens) + 2):
                where = f"{case.name} align={alignment} worst={worst} R={R} rank={rank}"
                # The differentiable op's forward is the Buffer's dispatch (padding rows aside).
                out = ep_moe.dispatch(buffer, x, idx, w, E, alignment, worst)
                n = ref.recv_x.shape[0]
                check(out.recv_x.shape[0] == (worst or n), where, "ep_moe.dispatch rows")
                check_bits(out.recv_x[:n], ref.recv_x, where, "ep_moe.dispatch recv_x")
                check_bits(out.recv_topk_idx[:n], ref.recv_topk_idx, where, "ep_moe.dispatch recv_topk_idx")
                check_bits(out.recv_topk_weights[:n], ref.recv_topk_weights, where, "ep_moe.dispatch weights")
                check_bits(out.num_recv_tokens_per_expert, want_counts, where, "ep_moe.dispatch counts")
                check_bits(out.handle.recv_src_idx[:n], ref.recv_src_idx, where, "ep_moe.dispatch handle")
                # Exact mode on the torch backend: the counts also come on the host, from the count exchange.
                want_host = want_counts if not worst else torch.zeros(0, dtype=torch.int64)
                check_bits(out.num_recv_tokens_per_expert_host, want_host, where, "ep_moe.dispatch host counts")
                dispatcher = TokenDispatcher(buffer, E, alignment, worst)
                expert_input, expert_probs, tokens_per_expert, ctx = dispatcher.dispatch(x, idx, w)
                m = want_x.shape[0]
                check_bits(tokens_per_expert, want_counts, where, "tokens_per_expert")
                if worst:
                    check(ctx.tokens_per_expert_host is None, where, "no host counts with num_worst_tokens")
                else:
                    check_bits(ctx.tokens_per_expert_host, want_counts, where, "tokens_per_expert on the host")
                check_bits(expert_input[:m], want_x, where, "expert_input (grouped, padded)")
                check_bits(expert_probs[:m], want_p, where, "expert_probs")
                if worst:
                    check(expert_input.shape[0] == expert_probs.shape[0], where, "fixed rows")
                    check(not expert_input[m:].any() and not expert_probs[m:].any(), where,
                          "rows past the groups are zero with prob 0")
                else:
                    check(expert_input.shape[0] == m, where, f"{expert_input.shape[0]} rows, expected {m}")
                # identity experts: every token comes back once per selected expert
                expert_input, _, _, ctx = dispatcher.dispatch(xi, idx, w)
                combined = dispatcher.combine(expert_input, ctx)
                check_equal(combined, (xi.float() * selected).to(x.dtype), where, "combine(dispatch(x))")
                checked += 1
    return checked


# ------------------------------------------------------------------------------ torch.compile
def _compile_checks(buffer: Buffer, rank: int, num_ranks: int) -> int:
    """torch.compile (aot_eager) traces dispatch + combine through the fake implementations and
    gives eager's values and gradients."""
    case = Case("compile", (5,) * num_ranks, 16, 2, 2 * num_ranks, "random", "fp32")
    inp = make_inputs(case, num_ranks, seed=51)
    idx, E = inp.idxs[rank], case.experts

    def layer(x, w):
        out = ep_moe.dispatch(buffer, x, idx, w, E)
        y = torch.relu(out.recv_x) * out.recv_topk_weights.sum(1, keepdim=True)
        return ep_moe.combine(buffer, y, out.handle)[0]

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (layer, compiled):
        x = inp.xs[rank].clone().requires_grad_()
        w = inp.weights[rank].clone().requires_grad_()
        out = fn(x, w)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    where = f"compile R={num_ranks} rank={rank}"
    for got, want, name in zip(results[1], results[0], ("output", "grad x", "grad topk_weights")):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, name=name: f"{where} {name}: {m}")
    return 1


def _autograd_worker(rank: int, num_ranks: int) -> dict[str, int]:
    buffer = Buffer(backend="torch", timeout_s=60)
    return {"gradcheck": _gradchecks(buffer, rank, num_ranks),
            "pipelines": _pipelines(buffer, rank, num_ranks),
            "dispatcher": _dispatcher_layout(buffer, rank, num_ranks)}


def test_autograd_and_dispatcher() -> None:
    num_ranks = 3  # one spawn (process start-up dominates this suite's time); R = 3: not a power of 2
    results = run_distributed(_autograd_worker, num_ranks, join_timeout_s=170)
    assert results == [results[0]] * num_ranks and all(v > 0 for v in results[0].values()), results


def test_torch_compile_and_opcheck(solo_group) -> None:
    """Tracing does not depend on the group size, so this runs in the test process on a group of
    one (the ops still go through the torch backend's exchanges, with itself)."""
    buffer = Buffer(solo_group, backend="torch")
    assert _compile_checks(buffer, 0, 1) == 1
    x, w = torch.randn(5, 16, requires_grad=True), torch.rand(5, 2, requires_grad=True)
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [0, -1], [1, 0]])
    dispatch_args = (x, idx, w, buffer.buffer_id, 2, 1, 0, 0)
    torch.library.opcheck(torch.ops.ep_moe.dispatch.default, dispatch_args)
    handle = ep_moe.dispatch(buffer, x.detach(), idx, w.detach(), 2).handle
    handle_args = (*ep_moe.buffer.autograd_ops._handle_args(handle), buffer.buffer_id, 0)
    y = torch.randn(handle.num_recv_tokens, 16, requires_grad=True)
    yw = torch.rand(handle.num_recv_tokens, 2, requires_grad=True)
    bias = torch.randn(5, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.ep_moe.combine.default, (y, yw, bias, None, *handle_args))
    torch.library.opcheck(torch.ops.ep_moe.cached_dispatch.default, (x, *handle_args))
    buffer.destroy()


def test_dispatcher_host_counts_at_one_rank(solo_group) -> None:
    """At one rank `TokenDispatcher` takes the local path, whose layout has the counts on the host already: the
    context carries them (the same values as the device counts, on the CPU), and none with a fixed size."""
    buffer = Buffer(solo_group, backend="torch")
    idx = torch.tensor([[0, 3], [3, -1], [-1, -1], [2, 0], [1, 3]])
    x, w = torch.randn(5, 8), torch.rand(5, 2)
    for worst in (0, 7):
        _, _, tokens_per_expert, ctx = TokenDispatcher(buffer, 4, 2, worst).dispatch(x, idx, w)
        if worst:
            assert ctx.tokens_per_expert_host is None
        else:
            assert ctx.tokens_per_expert_host.device.type == "cpu"
            assert ctx.tokens_per_expert_host.tolist() == tokens_per_expert.tolist() == [2, 2, 2, 4]
    buffer.destroy()
