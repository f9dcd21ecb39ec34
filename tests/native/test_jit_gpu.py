"""The JIT expert-major kernels (`ep_moe.native.jit.expert_major`, taken by `ep_moe.permute` with
``EP_MOE_JIT=1``) on one GPU: bit for bit the torch definitions on the cases of test_expert_major_kernels.py (the
layout at exact size and at bounds equal to, above and below the total; the permute of rows and values; the
(weighted) reduce; the gradients, the weights' one within a tolerance of float64 and repeatable), bit for bit the
ahead-of-time extension where it is built (the weights' gradient too: same order), inside a CUDA graph (captured,
replayed on new routings; a kernel first used during the capture too), and the disk cache: a second process loads every kernel from it, in under 1 s in all.
Needs one GPU and a CUDA compiler (NVRTC from the nvidia-cuda-nvrtc wheel, or nvcc): ``pytest -m gpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import locations
import pytest
import torch
from support_jit import GPU_JIT_MARKS, jit_forced  # noqa: F401 (an autouse fixture)

# The extension's cases, collected here again and run with this module's fixture (EP_MOE_JIT=1): the same
# assertions against the torch definitions, through the JIT kernels.
from test_expert_major_kernels import (
    BF16,
    FP32,
    assert_bits,
    routing,
    rows,
    test_gradients_equal_the_torch_definitions,  # noqa: F401
    test_layout_equals_the_torch_definition,  # noqa: F401
    test_layout_with_a_capacity_equals_the_torch_definition,  # noqa: F401
    test_permute_and_reduce_equal_the_torch_definitions,  # noqa: F401
)

from ep_moe import native
from ep_moe import permute as P

pytestmark = GPU_JIT_MARKS


def test_rows_routed_nowhere():
    """K = 0: the layout is all padding, the permute gives zeros, the reduce gives zeros (as torch's)."""
    idx = torch.empty(5, 0, dtype=torch.int64)
    want = P._expert_layout_torch(idx, 4, 4, 12)
    got = P.expert_layout(idx.cuda(), 4, 4, 12)
    for name in ("pair_of_slot", "slot_of_pair", "sorted_slots", "tokens_per_expert", "pairs_per_expert"):
        assert_bits(getattr(got, name), getattr(want, name), name)
    x = rows((5, 8), BF16, seed=1)
    assert_bits(P.permute_rows(x.cuda(), got), P.permute_rows(x, want), "rows")
    y = rows((12, 8), BF16, seed=2)
    assert_bits(P.unpermute_sum(y.cuda(), got), P.unpermute_sum(y, want), "reduce")


def _gradients(device_layout, device, x, values, y, g_rows, g_values, g_out, seed_w):
    xi, vi = x.to(device).clone().requires_grad_(), values.to(device).clone().requires_grad_()
    r, sv = P.permute_rows_and_values(xi, vi, device_layout)
    torch.autograd.backward((r, sv), (g_rows.to(device), g_values.to(device)))
    yi = y.to(device).clone().requires_grad_()
    wi = torch.rand(y.shape[0], generator=torch.Generator().manual_seed(seed_w)).to(device).requires_grad_()
    P.unpermute_sum(yi, device_layout, wi).backward(g_out.to(device))
    return xi.grad, vi.grad, yi.grad, wi.grad


@pytest.mark.skipif(not native.extension_available(), reason="the ahead-of-time extension is not built")
@pytest.mark.parametrize("dtype, H", [(BF16, 7168), (FP32, 37), (BF16, 6)])
def test_jit_equals_the_extension_bit_for_bit(monkeypatch, dtype, H):
    N, K, L, A = 512, 8, 32, 16
    idx = routing("random", N, K, L, seed=31).cuda()
    x, y = rows((N, H), dtype, seed=32), None
    values = torch.rand(N, K, generator=torch.Generator().manual_seed(33))
    results = {}
    for how in ("1", "0"):  # JIT, then the extension
        monkeypatch.setenv("EP_MOE_JIT", how)
        layout = P.expert_layout(idx, L, A, P.max_slots(N, K, L, A))
        y = rows((layout.num_slots, H), dtype, seed=34)
        g_rows = rows((layout.num_slots, H), dtype, seed=35)
        g_values = torch.randn(layout.num_slots, generator=torch.Generator().manual_seed(38))  # the same both times
        results[how] = (*layout[:5], *_gradients(layout, "cuda", x, values, y, g_rows, g_values,
                                                 rows((N, H), dtype, seed=36), 37))
    for i, (a, b) in enumerate(zip(results["1"], results["0"])):
        assert_bits(a, b, f"output {i} (layout fields, then grad x, values, y, weights)")


def test_captured_in_a_cuda_graph_and_replayed_on_new_routings():
    """A fixed-size layout -> permute -> weighted reduce captured once (after a warm-up that compiles), replayed
    after new routings and rows are copied into the static inputs: equal to eager on the same inputs."""
    N, K, L, A, H = 256, 4, 8, 16, 512
    M = P.max_slots(N, K, L, A)
    static_idx = routing("random", N, K, L, seed=41).cuda()
    static_x = rows((N, H), BF16, seed=42).cuda()
    static_w = torch.rand(M, device="cuda")

    def step():
        layout = P.expert_layout(static_idx, L, A, M)
        return P.unpermute_sum(P.permute_rows(static_x, layout) * 2, layout, static_w)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles and loads every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (43, 44):
        static_idx.copy_(routing("random", N, K, L, seed=seed).cuda())
        static_x.copy_(rows((N, H), BF16, seed=seed + 10).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert_bits(static_out, step(), f"replay {seed}")


def test_first_use_inside_a_cuda_graph_capture():
    """A specialization used for the first time while a graph is captured (compiled and loaded then) is captured
    and replays like eager (the hidden size 1000 is used by no other test of this process)."""
    N, K, L, A, H = 64, 2, 4, 1, 1000
    M = P.max_slots(N, K, L, A)
    layout = P._expert_layout_torch(routing("random", N, K, L, seed=51), L, A, M)
    layout = P.ExpertLayout(*(t.cuda() for t in layout[:5]))
    static_x = rows((N, H), BF16, seed=52).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.empty(1, device="cuda")  # torch's own lazy state, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = P.permute_rows(static_x, layout)
    static_x.copy_(rows((N, H), BF16, seed=53).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert_bits(static_out, P.permute_rows(static_x, layout), "replay")


_CHILD = textwrap.dedent("""
    import json, time, torch
    start = time.perf_counter()
    from ep_moe import permute as P
    from ep_moe.native import jit
    idx = torch.randint(0, 8, (64, 2), device="cuda")
    layout = P.expert_layout(idx, 8, 16, P.max_slots(64, 2, 8, 16))
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(layout.num_slots, device="cuda", requires_grad=True)
    P.unpermute_sum(P.permute_rows(x, layout), layout, w).sum().backward()
    torch.cuda.synchronize()
    print(json.dumps([list(e) for e in jit.history()]))
""")


def test_a_second_process_loads_every_kernel_from_the_disk_cache(tmp_path):
    path = os.pathsep.join(p for p in (str(locations.REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, EP_MOE_JIT="1", EP_MOE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=path)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first and {how for _, how, _ in first} == {"compiled"}, first
    for label, _, seconds in first:
        print(f"compiled {label} in {seconds:.2f} s")
    assert [label for label, _, _ in second] == [label for label, _, _ in first]
    assert {how for _, how, _ in second} == {"disk"}, second
    loads = sum(seconds for _, _, seconds in second)
    print(f"second process: {len(second)} kernels from disk in {loads * 1e3:.1f} ms")
    assert loads < 1.0
