"""GroupedExperts (loop and grouped-mm paths), LocalTokenDispatcher and the single-process MoELayer
against dense per-token references."""

import pytest
import torch
import torch.nn.functional as F

from ep_moe.layers import GroupedExperts, LocalTokenDispatcher, ModelConfig, MoELayer
from ep_moe.layers.experts import GROUPED_MM_ALIGNMENT

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _experts(num_experts=4, ep_rank=0, ep_size=1, impl="loop", dtype=torch.float32, seed=3):
    experts = GroupedExperts(num_experts, 16, 24, ep_rank, ep_size, dtype=dtype, init_method_std=0.3, impl=impl)
    experts.reset_parameters(seed)
    return experts


def _swiglu(x, w1, w3, w2):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def _dense_reference(experts, x, counts, probs):
    """Row by row: find the row's expert from the group sizes and run that expert alone."""
    rows = []
    bounds = torch.cumsum(torch.tensor(counts), 0).tolist()
    for i in range(x.shape[0]):
        e = next((j for j, b in enumerate(bounds) if i < b), None)
        if e is None:
            rows.append(x[i] * 0.0 * probs[i])  # zero, but keeps the graph connected
            continue
        rows.append(_swiglu(x[i:i + 1], experts.w1[e], experts.w3[e], experts.w2[e])[0] * probs[i])
    return torch.stack(rows)


@pytest.mark.parametrize("counts,extra", [([3, 0, 5, 2], 0), ([0, 0, 0, 7], 3), ([0, 0, 0, 0], 2), ([16, 16, 0, 32], 0)])
def test_loop_matches_dense_reference_forward_and_grad(counts, extra):
    experts = _experts()
    gen = torch.Generator().manual_seed(sum(counts) + extra)
    rows = sum(counts) + extra  # rows past the groups: fixed-size dispatch padding, must give zeros
    x = torch.randn(rows, 16, generator=gen, requires_grad=True)
    probs = torch.rand(rows, generator=gen, requires_grad=True)
    y = experts(x, torch.tensor(counts), probs)
    ref_experts = _experts()
    xr = x.detach().clone().requires_grad_()
    pr = probs.detach().clone().requires_grad_()
    ref = _dense_reference(ref_experts, xr, counts, pr)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn(y.shape, generator=gen)
    y.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.grad, pr.grad, rtol=1e-5, atol=1e-6)
    for name in ("w1", "w2", "w3"):
        got, want = getattr(experts, name).grad, getattr(ref_experts, name).grad
        assert got is not None  # every expert gets a gradient, zero when it received nothing
        torch.testing.assert_close(got, want if want is not None else torch.zeros_like(got), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no torch._grouped_mm")
def test_grouped_mm_matches_loop_on_cpu():
    """torch >= 2.8 also runs torch._grouped_mm on CPU (fp32), so its wiring is checked here too."""
    counts = torch.tensor([16, 0, 32, 16])
    x = torch.randn(64 + 5, 16, generator=torch.Generator().manual_seed(0))
    probs = torch.rand(69, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for impl in ("loop", "grouped_mm"):
        experts = _experts(impl=impl)
        xi = x.clone().requires_grad_()
        y = experts(xi, counts, probs)
        y.backward(torch.ones_like(y) + y.detach())
        outs.append(y)
        grads.append([xi.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _experts(impl="grouped_mm").expert_alignment(x) == GROUPED_MM_ALIGNMENT
    assert _experts(impl="auto").expert_alignment(x) == 1  # CPU: the loop, no padding needed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_mm_matches_loop_on_gpu_bf16():
    experts_auto = _experts(num_experts=8, dtype=torch.bfloat16, impl="auto").cuda()
    experts_loop = _experts(num_experts=8, dtype=torch.bfloat16, impl="loop").cuda()
    x = torch.randn(16 * 20, 16, device="cuda", dtype=torch.bfloat16)
    if not experts_auto.uses_grouped_mm(x):
        pytest.skip("torch._grouped_mm has no fast path on this GPU (needs compute capability >= 9.0)")
    counts = torch.tensor([32, 0, 64, 16, 16, 48, 0, 144], device="cuda")
    probs = torch.rand(x.shape[0], device="cuda")
    outs, grads = [], []
    for experts in (experts_auto, experts_loop):
        xi = x.clone().requires_grad_()
        y = experts(xi, counts, probs)
        y.float().square().sum().backward()
        outs.append(y.float())
        grads.append([xi.grad.float(), experts.w1.grad.float()])
    # bf16 inputs, fp32 accumulation in both; outputs rounded to bf16 (relative step 2^-8)
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


def test_expert_init_is_independent_of_ep_size():
    full = _experts(num_experts=8)
    for ep_size in (2, 4):
        for rank in range(ep_size):
            part = _experts(num_experts=8, ep_rank=rank, ep_size=ep_size)
            sl = slice(rank * 8 // ep_size, (rank + 1) * 8 // ep_size)
            for name in ("w1", "w2", "w3"):
                assert torch.equal(getattr(part, name), getattr(full, name)[sl])
                assert getattr(part, name).is_expert


def _topk(tokens, experts, topk, seed, with_none=True):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    if with_none:
        idx[0] = -1          # a token with no expert
        idx[1, 1:] = -1      # a token with one
        idx[2:6] = torch.arange(topk)  # several tokens on the same experts
    return idx, torch.rand(tokens, topk, generator=gen)


@pytest.mark.parametrize("alignment", [1, 16])
def test_local_dispatcher_round_trip_matches_dense(alignment):
    num_experts, tokens, topk = 6, 19, 3
    idx, weights = _topk(tokens, num_experts, topk, seed=alignment)
    x = torch.randint(-8, 9, (tokens, 16)).float()  # small integers: the sums below are exact
    d = LocalTokenDispatcher(num_experts, alignment)
    expert_input, probs, counts, ctx = d.dispatch(x, idx, weights)
    assert counts.dtype == torch.int64 and counts.shape == (num_experts,)
    assert torch.all(counts % alignment == 0) and expert_input.shape[0] == int(counts.sum())
    # every row of an expert's group is a token routed to it (or a zero padding row with prob 0)
    start = 0
    for e, c in enumerate(counts.tolist()):
        routed = [(t, k) for t in range(tokens) for k in range(topk) if idx[t, k] == e]
        for j in range(c):
            if j < len(routed):
                t, k = routed[j]
                assert torch.equal(expert_input[start + j], x[t]) and probs[start + j] == weights[t, k]
            else:
                assert not expert_input[start + j].any() and probs[start + j] == 0
        start += c
    # combine sums each token's rows: slot s carries x[t] * (s + 1), so token t gets x[t] * (sum of its slots + 1)
    scale = torch.arange(1, expert_input.shape[0] + 1, dtype=torch.float32).unsqueeze(1)
    out = d.combine(expert_input * scale, ctx)
    slot_sum = torch.zeros(tokens)
    start = 0
    for e, c in enumerate(counts.tolist()):
        routed = [t for t in range(tokens) for k in range(topk) if idx[t, k] == e]
        for j, t in enumerate(routed):
            slot_sum[t] += start + j + 1
        start += c
    want = x * slot_sum.unsqueeze(1)
    assert out.shape == x.shape and not out[0].any()  # token 0 has no expert
    assert torch.equal(out, want)


def _layer(config, **kw):
    layer = MoELayer(config, **kw)
    gen = torch.Generator().manual_seed(7)
    layer.router.reset_parameters(gen)
    layer.experts.reset_parameters(11)
    if layer.shared_expert is not None:
        layer.shared_expert.reset_parameters(gen)
        layer.reset_parameters(gen)
    return layer


@pytest.mark.parametrize("kw", [
    dict(),
    dict(moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
         moe_router_topk_scaling_factor=2.0, moe_router_enable_expert_bias=True),
    dict(moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True, moe_router_topk=3),
])
def test_moe_layer_matches_per_token_dense_reference(kw):
    config = ModelConfig(hidden_size=16, moe_ffn_hidden_size=24, num_moe_experts=8, **kw)
    layer = _layer(config)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    out = layer(x)
    flat = x.reshape(-1, 16)
    idx, w = layer.router(flat)
    e = layer.experts
    ref = torch.stack([sum(w[t, k] * _swiglu(flat[t:t + 1], e.w1[i], e.w3[i], e.w2[i])[0]
                           for k, i in enumerate(idx[t].tolist())) for t in range(flat.shape[0])])
    if layer.shared_expert is not None:
        ref = ref + layer.shared_expert(flat) * torch.sigmoid(flat @ layer.shared_expert_gate.T)
    torch.testing.assert_close(out.reshape(-1, 16), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no torch._grouped_mm")
def test_moe_layer_grouped_mm_with_padding_matches_loop():
    config = ModelConfig(hidden_size=16, moe_ffn_hidden_size=24, num_moe_experts=8)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(0))
    outs = []
    for impl in ("loop", "grouped_mm"):
        layer = _layer(config, expert_impl=impl)
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.square().sum().backward()
        outs.append((out, xi.grad, layer.router.weight.grad, layer.experts.w2.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
