"""The JIT expert-major kernels (`ep_moe.native.jit.expert_major`, taken by `ep_moe.permute` on CUDA) on one GPU,
beyond test_expert_major_kernels.py's cases: rows routed nowhere, inside a CUDA graph (captured,
replayed on new routings; a kernel first used during the capture too), the layout's cooperative kernel against its
four plain kernels bit for bit, with a grid below the tile count, on two streams at once and with a capacity
under capture (a cooperative launch captured and replayed), and the disk cache: a second process loads every
kernel from it, in under 1 s in all.
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
from support.bits import assert_bits_equal
from support_jit import GPU_JIT_MARKS, jit_taken  # noqa: F401 (an autouse fixture)
from test_expert_major_kernels import BF16, routing, rows

from ep_moe import permute as P
from ep_moe.native.jit import expert_major as J

pytestmark = GPU_JIT_MARKS


def test_rows_routed_nowhere():
    """K = 0: the layout is all padding, the permute gives zeros, the reduce gives zeros (as torch's)."""
    idx = torch.empty(5, 0, dtype=torch.int64)
    want = P._expert_layout_torch(idx, 4, 4, 12)
    got = P.expert_layout(idx.cuda(), 4, 4, 12)
    for name in ("pair_of_slot", "slot_of_pair", "sorted_slots", "tokens_per_expert", "pairs_per_expert"):
        assert_bits_equal(getattr(got, name), getattr(want, name), name, on_host=True)
    x = rows((5, 8), BF16, seed=1)
    assert_bits_equal(P.permute_rows(x.cuda(), got), P.permute_rows(x, want), "rows", on_host=True)
    y = rows((12, 8), BF16, seed=2)
    assert_bits_equal(P.unpermute_sum(y.cuda(), got), P.unpermute_sum(y, want), "reduce", on_host=True)


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
        assert_bits_equal(static_out, step(), f"replay {seed}", on_host=True)


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
    assert_bits_equal(static_out, P.permute_rows(static_x, layout), "replay", on_host=True)


# ------------------------------------------------------------------------------------------ the layout's launches
LAUNCH_SIZES = [(1, 1, 1), (7, 3, 100), (32, 8, 512), (256, 8, 4096), (1024, 8, 4096), (7, 4, 8192),
                (32, 8, 4096), (1024, 2, 16384), (256, 6, 5000)]  # (L, K, N): up to 32768 pairs


def _layout_outputs(idx, L, A, num_slots, capacity):
    return J.expert_layout(idx, L, A, num_slots, capacity)


@pytest.mark.parametrize("L, K, N", LAUNCH_SIZES, ids=[f"L{c[0]}-K{c[1]}-N{c[2]}" for c in LAUNCH_SIZES])
@pytest.mark.parametrize("size", ["exact", "fixed", "capacity"])
def test_the_cooperative_layout_equals_the_four_kernels_bit_for_bit(monkeypatch, L, K, N, size):
    """The cooperative kernel (one launch; two at the exact size) against the four plain kernels (the same phase
    functions without the grid barrier), every output bit for bit, on random routings (a quarter of the
    entries -1) from 1 to 32768 pairs and 1 to 1024 experts; the grid is what the device holds at most."""
    idx = routing("random", N, K, L, seed=L * 7 + K + N).cuda()
    A = 1 if size == "capacity" else 16
    capacity = max(N * K // (2 * L), 1) if size == "capacity" else 0
    num_slots = P.max_slots(N, K, L, A) if size == "fixed" else -1
    fused = _layout_outputs(idx, L, A, num_slots, capacity)
    monkeypatch.setattr(J._LayoutKernels, "cooperative", J._LayoutKernels.separately)
    plain = _layout_outputs(idx, L, A, num_slots, capacity)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert_bits_equal(a, b, f"output {i}", on_host=True)
    want = P._expert_layout_torch(idx.cpu(), L, A, None if num_slots < 0 else num_slots, capacity)
    assert_bits_equal(fused[0], want.pair_of_slot, "pair_of_slot against the torch definition", on_host=True)


@pytest.mark.parametrize("blocks", [1, 2, 5])
@pytest.mark.parametrize("case", [("random", 4096, 4, 16, 1), ("random", 2000, 8, 256, 128),
                                  ("skewed", 3000, 2, 64, 1), ("one_expert", 500, 8, 8, 16), ("random", 37, 4, 16, 1)],
                         ids=lambda c: f"{c[0]}-N{c[1]}-K{c[2]}-L{c[3]}-A{c[4]}")
def test_a_grid_below_the_tile_count_gives_the_same_layout(monkeypatch, blocks, case):
    """LAYOUT_MAX_BLOCKS lowered to 1, 2 or 5: each block takes several 256-pair sub-tiles (and the scan's groups
    change with the block count) in every phase; exact, fixed and capacity layouts equal the torch definition
    bit for bit, by the cooperative and by the plain kernels."""
    kind, N, K, L, A = case
    monkeypatch.setattr(J, "LAYOUT_MAX_BLOCKS", blocks)
    idx = routing(kind, N, K, L, seed=N + K + L + blocks)
    exact = P._expert_layout_torch(idx, L, A, None)
    most = int(exact.pairs_per_expert.max()) if idx.numel() else 0
    cases = [(None, 0, exact), (exact.num_slots + A, 0, P._expert_layout_torch(idx, L, A, exact.num_slots + A)),
             (None, max(most // 2, 1), P._expert_layout_torch(idx, L, 1, None, max(most // 2, 1)))]
    for plain in (False, True):
        if plain:
            monkeypatch.setattr(J._LayoutKernels, "cooperative", J._LayoutKernels.separately)
        for num_slots, capacity, want in cases:
            got = P.expert_layout(idx.cuda(), L, 1 if capacity else A, num_slots, capacity)
            for name in ("pair_of_slot", "slot_of_pair", "sorted_slots", "tokens_per_expert", "pairs_per_expert"):
                assert_bits_equal(getattr(got, name), getattr(want, name),
                            f"{name} ({blocks} blocks, num_slots {num_slots}, capacity {capacity}, plain {plain})", on_host=True)


def test_layouts_on_two_streams_at_once():
    """Two streams running cooperative layouts at the same time (each call's barrier words are its own): every
    result equals the same layout made alone. Prints the resident block limit the grid is capped by."""
    L, K, N, A = 256, 8, 4096, 16
    routings = [routing("random", N, K, L, seed=70 + i).cuda() for i in range(8)]
    alone = [J.expert_layout(idx, L, A, P.max_slots(N, K, L, A), 0) for idx in routings]
    torch.cuda.synchronize()
    kernels = J._layout[(L, K, torch.cuda.current_device())]
    print(f"ep_expert_layout (L={L}): at most {kernels.resident} resident blocks of 256 threads")
    assert kernels.resident >= torch.cuda.get_device_properties(0).multi_processor_count
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    together = []
    for _round in range(4):
        for i, idx in enumerate(routings):
            with torch.cuda.stream(streams[i % 2]):
                together.append((i, J.expert_layout(idx, L, A, P.max_slots(N, K, L, A), 0)))
    torch.cuda.synchronize()
    for i, got in together:
        for j, (a, b) in enumerate(zip(got[:5], alone[i][:5])):
            assert_bits_equal(a, b, f"routing {i} output {j}", on_host=True)


def test_a_capacity_layout_captured_and_replayed():
    """A capacity layout (the capacity a kernel argument) captured in a CUDA graph (its cooperative launch) and
    replayed on new routings: equal to the eager layout on the same routing, bit for bit; a second
    capacity compiles nothing new."""
    N, K, L, C = 512, 4, 16, 40
    static_idx = routing("random", N, K, L, seed=81).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        P.expert_layout(static_idx, L, capacity=C)  # compiles and loads outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = P.expert_layout(static_idx, L, capacity=C)
    for seed in (82, 83):
        static_idx.copy_(routing("random", N, K, L, seed=seed).cuda())
        graph.replay()
        torch.cuda.synchronize()
        eager = P.expert_layout(static_idx, L, capacity=C)
        for name in ("pair_of_slot", "slot_of_pair", "sorted_slots", "tokens_per_expert", "pairs_per_expert"):
            assert_bits_equal(getattr(static, name), getattr(eager, name), f"{name} (replay {seed})", on_host=True)
    from ep_moe.native import jit

    before = len(jit.history())
    P.expert_layout(static_idx, L, capacity=C + 7)
    assert len(jit.history()) == before, "a new capacity compiled a kernel"


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
    env = dict(os.environ, EP_MOE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=path)
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
