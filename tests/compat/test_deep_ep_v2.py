"""`ep_moe.compat.deep_ep.ElasticBuffer` driven the way a DeepEP V2 client drives it (the sequence of calls of
torchtitan's ``torchtitan/distributed/deepep/deepep.py``, written anew here): size hint, buffer, SM count, then a
training step (compact layout with a host sync, autograd through custom backward functions that call combine for
the dispatch's backward and a cached dispatch for the combine's) and an inference step (expanded layout, no host
sync, per-expert counts from the device prefix sum), each checked against a dense single-process MoE. 2 ranks,
gloo, CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ep_moe.distributed import run_distributed

H, K, E, N_MAX = 32, 3, 8, 12  # hidden, top-k, experts, tokens per rank bound


def _inputs(rank: int):
    gen = torch.Generator().manual_seed(40 + rank)
    tokens = N_MAX - 3 * rank  # ranks hold different counts, all <= N_MAX
    x = torch.randn(tokens, H, generator=gen)
    scores = torch.rand(tokens, K, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    scores[::4, -1] = 0.0  # zero-score picks become -1, as the client masks them
    return x, idx, scores


def _experts() -> torch.Tensor:
    return torch.randn(E, H, H, generator=torch.Generator().manual_seed(7)) / H ** 0.5


def _dense(x, idx, scores, weights):
    out = torch.zeros_like(x)
    for k in range(K):
        picked = torch.einsum("th,thg->tg", x, weights[idx[:, k]])
        out = out + scores[:, k:k + 1] * picked * (idx[:, k] >= 0).unsqueeze(1)
    return out


def _driver(rank: int, world: int) -> bool:
    import ep_moe.compat.deep_ep as compat

    compat.install()
    import deep_ep
    from deep_ep import ElasticBuffer

    assert deep_ep.__version__.startswith("2.") and ElasticBuffer is compat.ElasticBuffer
    group = dist.new_group(list(range(world)))
    local = E // world
    weights = _experts()

    needed = ElasticBuffer.get_buffer_size_hint(group, N_MAX, H, num_topk=K, use_fp8_dispatch=False)
    buffer = ElasticBuffer(group, num_bytes=needed, num_max_tokens_per_rank=N_MAX, hidden=H, num_topk=K,
                           use_fp8_dispatch=False, deterministic=torch.are_deterministic_algorithms_enabled(),
                           explicitly_destroy=True, backend="torch")
    assert buffer.group == group and buffer.num_bytes >= needed and buffer.num_max_tokens_per_rank == N_MAX
    num_sms = buffer.get_theoretical_num_sms(E, K)

    x0, idx0, scores0 = _inputs(rank)
    idx = idx0.masked_fill(scores0 == 0, -1)
    mine = weights[rank * local:(rank + 1) * local]

    # ---- training: compact layout, host sync, custom backward (dispatch <-> combine duality)
    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scores):
            recv_x, recv_idx, recv_scores, handle, _ = buffer.dispatch(
                x, topk_idx=idx, topk_weights=scores, num_experts=E, num_max_tokens_per_rank=N_MAX,
                num_sms=num_sms, do_expand=False, do_cpu_sync=True)
            ctx.handle = handle
            ctx.mark_non_differentiable(recv_idx)
            return recv_x, recv_idx, recv_scores, handle

        @staticmethod
        def backward(ctx, grad_x, _grad_idx, grad_scores, _grad_handle):
            grad, grad_w, _ = buffer.combine(grad_x, handle=ctx.handle, topk_weights=grad_scores)
            return grad, grad_w

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, handle):
            ctx.handle = handle
            out, _, event = buffer.combine(rows, handle=handle, topk_weights=None, async_with_compute_stream=True)
            event.current_stream_wait()
            return out

        @staticmethod
        def backward(ctx, grad):
            recv, _, _, _, _ = buffer.dispatch(grad.contiguous(), handle=ctx.handle, num_sms=ctx.handle.num_sms,
                                               do_cpu_sync=False)
            return recv, None

    x = x0.clone().requires_grad_()
    scores = scores0.clone().requires_grad_()
    recv_x, recv_idx, recv_scores, handle = Dispatch.apply(x, scores)
    counts = handle.num_recv_tokens_per_expert_list
    assert counts == [int((recv_idx == e).sum()) for e in range(local)], counts
    # expert-major gather of the compact rows (one row per (row, local expert)), experts, weighting, scatter back
    rows_of, slots_of = (recv_idx >= 0).nonzero(as_tuple=True)
    order = torch.argsort(recv_idx[rows_of, slots_of], stable=True)
    rows_of, slots_of = rows_of[order], slots_of[order]
    experts_of = recv_idx[rows_of, slots_of]
    assert torch.equal(torch.bincount(experts_of, minlength=local), torch.tensor(counts))
    outputs = torch.einsum("nh,nhg->ng", recv_x[rows_of], mine[experts_of])
    outputs = outputs * recv_scores[rows_of, slots_of].unsqueeze(1)
    per_row = torch.zeros_like(recv_x).index_add(0, rows_of, outputs)
    out = Combine.apply(per_row, handle)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(90 + rank))
    (out * grad_out).sum().backward()

    xd, sd = x0.clone().requires_grad_(), scores0.clone().requires_grad_()
    want = _dense(xd, idx, sd, weights)
    (want * grad_out).sum().backward()
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-5, atol=1e-5)
    masked = torch.where(idx >= 0, sd.grad, torch.zeros_like(sd.grad))  # -1 picks carry no weight
    torch.testing.assert_close(scores.grad, masked, rtol=1e-5, atol=1e-5)

    # ---- inference: expanded layout, no host sync, counts from the device prefix sum
    with torch.no_grad():
        recv_x, recv_idx, recv_scores, handle, _ = buffer.dispatch(
            x0, topk_idx=idx, topk_weights=scores0, num_experts=E, num_max_tokens_per_rank=N_MAX,
            num_sms=num_sms, do_expand=True, do_cpu_sync=False)
        assert recv_idx is None and recv_scores.shape == (recv_x.shape[0],)
        psum = handle.psum_num_recv_tokens_per_expert
        counts = torch.diff(psum, prepend=psum.new_zeros(1))
        ends = torch.cumsum(counts, 0)
        outputs = torch.zeros_like(recv_x)
        for e in range(local):  # a grouped GEMM over the expert groups [0 : sum(counts)); the tail is unused
            start, end = int(ends[e] - counts[e]), int(ends[e])
            outputs[start:end] = recv_x[start:end] @ mine[e]
        outputs = outputs * recv_scores.reshape(outputs.shape[0], -1).sum(-1, keepdim=True)
        out, _, event = buffer.combine(outputs, handle=handle, topk_weights=None, async_with_compute_stream=True)
        event.current_stream_wait()
        torch.testing.assert_close(out, _dense(x0, idx, scores0, weights), rtol=1e-5, atol=1e-5)
    buffer.destroy()
    return True


def test_torchtitan_style_v2_driver_matches_a_dense_moe() -> None:
    assert run_distributed(_driver, 2, join_timeout_s=120) == [True, True]
