"""The expert-major kernels behind `ep_moe.permute` on CUDA (`ep_moe.native.jit.expert_major`, and the permute of
received rows of `ep_moe.native.jit.expert_major_exchange`) against the torch definitions of `ep_moe.permute` run on
the CPU, bit for bit: the layout (exact size, and bounds equal to, above and below the total), the permute of rows and values, the (weighted) reduce, and their gradients (the
weights' gradient, a dot product in the kernel's own order, within a tolerance of float64 and repeatable). Random
and adversarial routings (every pair to one expert, no pairs, ids out of range, thousands of pairs per block),
1 to 1024 experts, alignments 1/16/128, row widths that take 16-, 4-, 2- and 1-byte words, misaligned rows.
Then the whole one-GPU path: a fixed-size `MoELayer` captured in a CUDA graph and replayed on new routings,
equal to eager. Needs one GPU and a CUDA compiler (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch
from support.bits import assert_bits_equal
from support_jit import GPU_JIT_MARKS, jit_taken  # noqa: F401 (an autouse fixture)

from ep_moe import permute as P

pytestmark = GPU_JIT_MARKS

BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


def routing(kind: str, N: int, K: int, L: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return torch.full((N, K), -1, dtype=torch.int64)
    if kind == "one_expert":  # every pair to one expert, repeated within a row
        return torch.full((N, K), L - 1, dtype=torch.int64)
    if kind == "out_of_range":  # ids past L and below -1 are not pairs (both implementations)
        idx = torch.randint(-3, L + 3, (N, K), generator=gen)
        return idx
    if kind == "skewed":  # most pairs to expert 0
        idx = torch.randint(0, L, (N, K), generator=gen)
        idx[torch.rand(N, K, generator=gen) < 0.8] = 0
        return idx
    idx = torch.stack([torch.randperm(max(L, K), generator=gen)[:K] % L for _ in range(N)]) if N else \
        torch.empty(0, K, dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=gen) < 0.25] = -1
    return idx


def rows(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == FP8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(FP8)
    scale = torch.exp2(torch.randint(-6, 7, shape, generator=gen).float())
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


LAYOUTS = [  # (routing, N, K, L, A)
    ("random", 37, 4, 16, 1), ("random", 300, 8, 3, 16), ("random", 5, 1, 1, 1), ("random", 2000, 8, 256, 128),
    ("random", 4096, 4, 16, 1), ("random", 70000, 8, 32, 1),  # ~560k pairs: many sub-tiles per block
    ("random", 600, 6, 1024, 16), ("one_expert", 500, 8, 8, 16), ("none", 40, 4, 4, 4), ("none", 0, 4, 4, 1),
    ("out_of_range", 257, 3, 5, 2), ("skewed", 3000, 2, 64, 1),
]
LAYOUT_IDS = [f"{c[0]}-N{c[1]}-K{c[2]}-L{c[3]}-A{c[4]}" for c in LAYOUTS]


@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("bound", ["exact", "total", "max", "below"])
def test_layout_equals_the_torch_definition(case, bound):
    kind, N, K, L, A = case
    idx = routing(kind, N, K, L, seed=N + K + L)
    exact = P._expert_layout_torch(idx, L, A, None)
    num_slots = {"exact": None, "total": exact.num_slots, "max": P.max_slots(N, K, L, A),
                 "below": max(exact.num_slots - 2 * A - 1, 0)}[bound]
    want = exact if num_slots is None else P._expert_layout_torch(idx, L, A, num_slots)
    got = P.expert_layout(idx.cuda(), L, A, num_slots)
    for name in ("pair_of_slot", "slot_of_pair", "sorted_slots", "tokens_per_expert", "pairs_per_expert"):
        assert_bits_equal(getattr(got, name), getattr(want, name), f"{name} ({bound})", on_host=True)
    if num_slots is None:
        assert torch.equal(got.tokens_per_expert_host, want.tokens_per_expert_host)
        assert not got.tokens_per_expert_host.is_cuda
    else:
        assert got.tokens_per_expert_host is None


@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("capacity", ["one", "below", "above"])
def test_layout_with_a_capacity_equals_the_torch_definition(case, capacity):
    kind, N, K, L, _ = case
    idx = routing(kind, N, K, L, seed=N + K + L)
    most = int(P._expert_layout_torch(idx, L, 1, None).pairs_per_expert.max()) if idx.numel() else 0
    C = {"one": 1, "below": max(most // 2, 1), "above": most + 3}[capacity]
    want = P._expert_layout_torch(idx, L, 1, None, C)
    got = P.expert_layout(idx.cuda(), L, capacity=C)
    for name in ("pair_of_slot", "slot_of_pair", "sorted_slots", "tokens_per_expert", "pairs_per_expert"):
        assert_bits_equal(getattr(got, name), getattr(want, name), f"{name} (capacity {C})", on_host=True)
    assert got.tokens_per_expert_host.tolist() == [C] * L and not got.tokens_per_expert_host.is_cuda


def test_layout_of_more_experts_than_the_kernels_hold_uses_torch():
    idx = routing("random", 50, 4, 3000, seed=1)
    got = P.expert_layout(idx.cuda(), 3000, 1)
    assert_bits_equal(got.pair_of_slot, P._expert_layout_torch(idx, 3000, 1, None).pair_of_slot, "pair_of_slot", on_host=True)


ROWS = [  # (N, K, L, A, H, dtype, misaligned): H chosen so rows take 16-, 4-, 2- and 1-byte words
    (64, 4, 8, 1, 4096, BF16, False), (33, 3, 5, 16, 40, FP32, False), (20, 2, 4, 1, 7, BF16, False),
    (20, 2, 4, 1, 6, BF16, True), (17, 8, 4, 4, 13, FP8, False), (17, 8, 4, 4, 64, FP8, True),
    (9, 1, 2, 1, 37, FP32, True), (0, 4, 4, 4, 8, BF16, False),
]
ROW_IDS = [f"N{c[0]}-K{c[1]}-H{c[4]}-{str(c[5]).split('.')[-1]}{'-misaligned' if c[6] else ''}" for c in ROWS]


def _on_gpu(t: torch.Tensor, misaligned: bool) -> torch.Tensor:
    """``t`` on the GPU, contiguous, starting one element past an aligned address when ``misaligned``."""
    if not misaligned:
        return t.cuda()
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
    view = flat[1:].view(t.shape)
    view.copy_(t.cuda())
    return view


@pytest.mark.parametrize("case", ROWS, ids=ROW_IDS)
def test_permute_and_reduce_equal_the_torch_definitions(case):
    N, K, L, A, H, dtype, misaligned = case
    idx = routing("random", N, K, L, seed=7 + N)
    layout = P._expert_layout_torch(idx, L, A, P.max_slots(N, K, L, A))  # with trailing padding
    gpu_layout = P.ExpertLayout(*(t.cuda() for t in layout[:5]))
    x = rows((N, H), dtype, seed=1)
    values = torch.rand(N, K, generator=torch.Generator().manual_seed(2))
    got_rows, got_values = P.permute_rows_and_values(_on_gpu(x, misaligned), values.cuda(), gpu_layout)
    want_rows, want_values = P.permute_rows_and_values(x, values, layout)
    assert_bits_equal(got_rows, want_rows, "rows", on_host=True)
    assert_bits_equal(got_values, want_values, "slot values", on_host=True)
    assert_bits_equal(P.permute_rows(_on_gpu(x, misaligned), gpu_layout), want_rows, "rows without values", on_host=True)
    if dtype == FP8:
        return
    y = rows((layout.num_slots, H), dtype, seed=3)
    w = torch.rand(layout.num_slots, generator=torch.Generator().manual_seed(4))
    for weights in (w, None):
        got = P.unpermute_sum(_on_gpu(y, misaligned), gpu_layout, None if weights is None else weights.cuda())
        assert_bits_equal(got, P.unpermute_sum(y, layout, weights), f"unpermute_sum (weighted={weights is not None})", on_host=True)


@pytest.mark.parametrize("case", ROWS, ids=ROW_IDS)
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_permute_received_rows_equals_the_torch_definition(case, rank):
    """`permute_received_rows` on CUDA (the expert-major dispatch's permute from the receive buffer and
    the own input) against `permute_received_rows`' torch definition on the CPU: 3 ranks, this rank first, in the
    middle or last; a buffer larger than the N rows, garbage in the own range and past the total; the own input
    misaligned where the case says (narrower words)."""
    N, K, L, A, H, dtype, misaligned = case
    gen = torch.Generator().manual_seed(11 + N + rank)
    T = N // 2 + 1
    own = min(T, N // 3)  # this rank's own rows, then the other two sources' between and around them
    others = [r for r in range(3) if r != rank]
    counts = torch.randint(0, 4, (3, 3), generator=gen)  # only column `rank` matters here
    counts[rank, rank], counts[others[0], rank] = own, (N - own) // 2
    counts[others[1], rank] = N - own - (N - own) // 2
    prefix = torch.cumsum(counts, 0).to(torch.int32)
    idx = routing("random", N, K, L, seed=5 + N)
    layout = P._expert_layout_torch(idx, L, A, P.max_slots(N, K, L, A))
    gpu_layout = P.ExpertLayout(*(t.cuda() for t in layout[:5]))
    buffer = rows((N + 3, H), dtype, seed=6)
    own_x = rows((T, H), dtype, seed=8)
    own_tokens = torch.randperm(T, generator=gen).to(torch.int32)
    values = torch.rand(N, K, generator=gen)
    args = (N, own_x, own_tokens, prefix, rank, layout, values)
    want_rows, want_values = P.permute_received_rows(buffer, *args)
    got_rows, got_values = P.permute_received_rows(
        buffer.cuda(), N, _on_gpu(own_x, misaligned), own_tokens.cuda(), prefix.cuda(), rank, gpu_layout,
        values.cuda())
    assert_bits_equal(got_rows, want_rows, "rows", on_host=True)
    assert_bits_equal(got_values, want_values, "slot values", on_host=True)
    alone, none = P.permute_received_rows(buffer.cuda(), N, own_x.cuda(), own_tokens.cuda(), prefix.cuda(), rank,
                                          gpu_layout)
    assert_bits_equal(alone, want_rows, "rows without values", on_host=True)
    assert none is None


def test_permute_received_rows_stays_in_range_on_garbage_routes():
    """After a dispatch that moved nothing (an error raised at the next host wait) the prefix matrix and the send
    list may hold anything: the kernel then reads only inside the buffer, own_x and own_tokens, as its torch
    definition says (an own range longer than T, tokens below 0 and past T)."""
    N, K, L, H, T = 30, 2, 4, 64, 5
    idx = routing("random", N, K, L, seed=31)
    layout = P._expert_layout_torch(idx, L, 1, None)
    gpu_layout = P.ExpertLayout(*(t.cuda() for t in layout[:5]))
    buffer, own_x = rows((N, H), BF16, seed=32), rows((T, H), BF16, seed=33)
    own_tokens = torch.tensor([3, -7, 4, 1_000_000, 0], dtype=torch.int32)
    prefix = torch.tensor([[2, 9], [2, 29]], dtype=torch.int32)  # rank 1's own range [9, 29): longer than T
    want, _ = P.permute_received_rows(buffer, N, own_x, own_tokens, prefix, 1, layout)
    got, _ = P.permute_received_rows(buffer.cuda(), N, own_x.cuda(), own_tokens.cuda(), prefix.cuda(), 1, gpu_layout)
    torch.cuda.synchronize()
    assert_bits_equal(got, want, "rows", on_host=True)


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("H", [4096, 37])
def test_gradients_equal_the_torch_definitions(dtype, H):
    N, K, L, A = 300, 4, 16, 16
    idx = routing("random", N, K, L, seed=11)
    layout = P._expert_layout_torch(idx, L, A, P.max_slots(N, K, L, A))
    gpu_layout = P.ExpertLayout(*(t.cuda() for t in layout[:5]))
    x, y = rows((N, H), dtype, seed=5), rows((layout.num_slots, H), dtype, seed=6)
    values = torch.rand(N, K, generator=torch.Generator().manual_seed(7))
    g_rows, g_values = rows((layout.num_slots, H), dtype, seed=8), torch.randn(layout.num_slots)
    g_out = rows((N, H), dtype, seed=9)

    def run(device_layout, device):
        xi, vi = x.to(device).clone().requires_grad_(), values.to(device).clone().requires_grad_()
        r, sv = P.permute_rows_and_values(xi, vi, device_layout)
        torch.autograd.backward((r, sv), (g_rows.to(device), g_values.to(device)))
        yi = y.to(device).clone().requires_grad_()
        wi = torch.rand(layout.num_slots, generator=torch.Generator().manual_seed(10)).to(device).requires_grad_()
        P.unpermute_sum(yi, device_layout, wi).backward(g_out.to(device))
        return xi.grad, vi.grad, yi.grad, wi.grad

    got, want = run(gpu_layout, "cuda"), run(layout, "cpu")
    for name, a, b in zip(("grad x", "grad values", "grad y"), got[:3], want[:3]):
        assert_bits_equal(a, b, name, on_host=True)
    # the weights' gradient: within float64's answer by the sum of |terms|, and the same on a second run
    rows_of = (layout.pair_of_slot.clamp(max=N * K - 1) // K)
    valid = layout.pair_of_slot < N * K
    exact = torch.where(valid, (g_out.double()[rows_of] * y.double()).sum(1), 0.0)
    scale = torch.where(valid, (g_out.double()[rows_of].abs() * y.double().abs()).sum(1), 0.0)
    assert torch.all((got[3].double().cpu() - exact).abs() <= 1e-5 * scale + 1e-30)
    assert torch.equal(run(gpu_layout, "cuda")[3], got[3])


def test_layer_path_captured_in_a_cuda_graph_replays_new_routings():
    """Fixed size end to end on one GPU: an `MoELayer` (router, expert-major dispatch, grouped experts, weighted
    combine) forward + backward captured by `torch.cuda.make_graphed_callables`, replayed on new inputs (so new
    routings): output and input gradient equal eager's on the same inputs."""
    from ep_moe.layers.model_config import ModelConfig
    from ep_moe.layers.moe import MoELayer

    torch.manual_seed(0)
    config = ModelConfig(hidden_size=256, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
                         num_layers=1, params_dtype="bfloat16")
    T = 512
    layer = MoELayer(config, num_worst_tokens=T).cuda()
    inputs = [torch.randn(T, 256, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3)]
    grads = [torch.randn(T, 256, device="cuda", dtype=BF16) for _ in range(3)]

    def eager(i):
        x = inputs[i].detach().clone().requires_grad_()
        out = layer(x)
        out.backward(grads[i])
        return out.detach(), x.grad

    want = [eager(i) for i in range(3)]
    layer.zero_grad(set_to_none=True)
    # the sample input becomes the graph's static input (each replay copies into it): not one of the inputs
    sample = inputs[0].detach().clone().requires_grad_()
    graphed = torch.cuda.make_graphed_callables(layer, (sample,), allow_unused_input=True)
    for i in (1, 2, 0, 2):
        x = inputs[i].detach().clone().requires_grad_()
        out = graphed(x)
        out.backward(grads[i])
        torch.cuda.synchronize()
        assert torch.equal(out.detach(), want[i][0]), f"replay on input {i}: output differs from eager"
        assert torch.equal(x.grad, want[i][1]), f"replay on input {i}: input gradient differs from eager"


def test_torch_compile_gives_eagers_values_and_gradients():
    """torch.compile (aot_eager, fullgraph) of a fixed-size local dispatch -> row function -> weighted combine traces
    the torch definitions and gives eager's (the kernels') values and gradients: bit for bit, the weights' gradient
    (a dot product in each implementation's own order) to fp32 rounding."""
    from ep_moe.buffer.expert_major_ops import local_expert_combine, local_expert_dispatch

    T, H, E, K = 96, 64, 8, 2
    idx = routing("random", T, K, E, seed=21).cuda()
    x0 = rows((T, H), BF16, seed=22).cuda()
    w0 = torch.rand(T, K, generator=torch.Generator().manual_seed(23)).cuda()

    def layer(x, w):
        out = local_expert_dispatch(x, idx, w, E, num_worst_tokens=T, check_values=False)
        y = torch.relu(out.expert_x) * 2
        return local_expert_combine(y, out.handle, out.expert_weights)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (layer, compiled):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(x, w)
        out.float().square().sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    for name, got, want in zip(("output", "grad x"), results[1], results[0]):
        assert_bits_equal(got, want, f"compiled {name}", on_host=True)
    torch.testing.assert_close(results[1][2], results[0][2], rtol=1e-5, atol=1e-6)
