"""The expert-major ops of the exchange (`ep_moe.native.jit.expert_major_exchange`) on one GPU: the own rows of an
expert-major combine and Megatron's routing map to top-k and back, each bit for bit the torch definitions (the
permute of received rows left in place is in test_expert_major_kernels.py); the mirrors' check at first use; a first
use inside a CUDA graph capture replays like eager.
Needs one GPU and a CUDA compiler (NVRTC or nvcc):
``pytest -m gpu tests/native/test_jit_expert_major_exchange_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from support.bits import assert_bits_equal
from support_jit import GPU_JIT_MARKS, jit_taken  # noqa: F401 (an autouse fixture)
from test_expert_major_kernels import BF16, FP32, routing, rows

from ep_moe import permute as P
from ep_moe.native.jit import expert_major_exchange as E

pytestmark = GPU_JIT_MARKS


def test_the_mirrors_are_checked_at_first_use():
    loaded = E.kernels(torch.cuda.current_device())
    assert loaded.checked and set(loaded.fn) == set(E.KERNELS.values())


def _own_rows_case(dtype, H, rank):
    N, K, L, A = 40, 4, 6, 16
    idx = routing("random", N, K, L, seed=21 + rank)
    layout = P._expert_layout_torch(idx, L, A, P.max_slots(N, K, L, A))
    y = rows((layout.num_slots, H), dtype, seed=22)
    w = torch.rand(layout.num_slots, generator=torch.Generator().manual_seed(23))
    counts = torch.tensor([[5, 7, 9], [11, 13, 6], [9, 20, 25]])
    prefix = torch.cumsum(counts, 0).to(torch.int32)
    return layout, y, w, prefix


@pytest.mark.parametrize("dtype, H", [(BF16, 264), (FP32, 264), (BF16, 37), (FP32, 7)])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_unpermute_own_rows_equals_unpermute_sum_on_the_own_rows(dtype, H, rank):
    layout, y, w, prefix = _own_rows_case(dtype, H, rank)
    first, end = (int(prefix[rank - 1, rank]) if rank else 0), int(prefix[rank, rank])
    for weights in (w, None):
        want = P.unpermute_sum(y, layout, weights)  # each row's slots summed in top-k order
        # the order the combine passes (`expert_combine`: the layout's slot_of_pair); the fp32 sums show it
        got = E.unpermute_own_rows(y.cuda(), None if weights is None else weights.cuda(), layout.slot_of_pair.cuda(),
                                   prefix.cuda(), rank)
        assert got.shape == want.shape and end > first
        assert_bits_equal(got[first:end], want[first:end], f"own rows (weighted={weights is not None})", on_host=True)


def _routing_case(dtype, shape):
    T, E_, K = shape
    gen = torch.Generator().manual_seed(T + E_)
    scores = torch.rand(T, E_, generator=gen)
    routing_map = torch.zeros(T, E_, dtype=torch.bool).scatter_(1, scores.topk(min(K, E_), dim=1).indices, True)
    routing_map[torch.rand(T, E_, generator=gen) < 0.2] = False
    return routing_map, (scores * routing_map).to(dtype), torch.randn(T, K, generator=gen), K


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("shape", [(300, 16, 4), (64, 3, 4), (0, 8, 2), (1000, 256, 8)])
def test_routing_map_to_topk_equals_the_torch_ops(dtype, shape):
    pytest.importorskip("megatron.core", reason="Megatron's routing map conversion needs megatron-core")
    integ = pytest.importorskip("ep_moe.integrations.megatron")
    routing_map, probs, grad, K = _routing_case(dtype, shape)
    results = []
    for path in ("jit", "torch"):
        p = probs.cuda().requires_grad_()
        if path == "jit":
            idx, w = integ.routing_map_to_topk(routing_map.cuda(), p, K, check=False)
        else:
            idx, w = integ._routing_map_to_topk_torch(routing_map.cuda(), p, K)
        w.backward(grad.cuda())
        results.append((idx.cpu(), w.detach().cpu(), p.grad.cpu()))
    for other in results[1:]:
        for name, a, b in zip(("topk_idx", "topk_weights", "grad probs"), results[0], other):
            assert_bits_equal(a, b, name)


def test_first_use_inside_a_cuda_graph_capture():
    """The module loaded for the first time in this process while a graph is captured (its mirrors' check, a
    read-back, waits for the next use outside the capture) replays like eager."""
    E._kernels.clear()
    layout, y, w, prefix = _own_rows_case(BF16, 128, 1)
    y, w, slots, prefix = y.cuda(), w.cuda(), layout.sorted_slots.cuda(), prefix.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.empty(1, device="cuda")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = E.unpermute_own_rows(y, w, slots, prefix, 1)
    assert not E._kernels[torch.cuda.current_device()].checked
    y.copy_(rows(tuple(y.shape), BF16, seed=77).cuda())
    graph.replay()
    torch.cuda.synchronize()
    first, end = int(prefix[0, 1]), int(prefix[1, 1])
    eager = E.unpermute_own_rows(y, w, slots, prefix, 1)
    assert E._kernels[torch.cuda.current_device()].checked, "checked at the first use outside the capture"
    assert_bits_equal(static_out[first:end], eager[first:end], "replay", on_host=True)
