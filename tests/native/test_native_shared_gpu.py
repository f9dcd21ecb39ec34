"""The native backend's multi-rank kernels at 2, 3 and 4 processes sharing ONE GPU (`support.shared_gpu`: gloo,
``cuda:0``, ``EP_MOE_SYMMETRIC_MEMORY=vmm``), against the torch backend on CPU copies of the same inputs over the
same gloo group:

* the VMM symmetric memory itself: every rank sees what every rank wrote, writes into a peer's copy reach it;
* `Buffer(backend="auto")` picks the native backend there; fresh exact-size and fixed-size (``num_worst_tokens``)
  dispatch, combine with weights and biases, cached dispatch, BF16/FP32/FP8, the copy engine forced on and off
  (`test_native_gpu._case_options`), a row width the kernels do not take (the torch fallback on the GPU over
  gloo), and the expert-major `expert_dispatch` / `expert_combine` (both reduction modes) and the dispatch's
  gradients, bit for bit; the expert-major dispatch leaves the received rows in the receive buffer and permutes
  them from there (``handle.rows_in_place``), and its combine sums the expert-major rows as they go out
  (``NativeBackend.expert_row_combines``), wherever the kernels take the rows, also on adversarial routings,
  and the cached `expert_cached_dispatch` with each handle leaves its rows in place too (forward and gradients),
  alignments 1 and 128, fixed size with ``num_worst_tokens`` = R * T (T = N) and above (T < N);
* `ElasticBuffer` (DeepEP V2's API): compact and expanded layouts, exact and fixed size, combine, cached;
* a fixed-size dispatch + combine captured in a CUDA graph and replayed;
* forced timeouts: a rank that does not enter makes rank 0 raise `NativeTimeoutError` naming rank and stage.

Shapes are small: the processes' kernels take turns on the GPU (time slicing, no MPS), so every wait on a
peer may cost a scheduler time slice. Run: ``pytest -m gpu tests/native/test_native_shared_gpu.py``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from support.bits import assert_bits_equal
from support.shared_gpu import DEVICE, check_symmetric_buffer, run_on_one_gpu, skip_unless_shared_gpu_runs
from test_native_gpu import (
    GRAPH_EXPERTS,
    ROUTINGS,
    _case_options,
    _check_case,
    _copy_engine_options,
    _rank0_notify_times_out,
    _rank0_times_out_alone,
    _routed_inputs,
    check_graph_replays,
    check_in_step,
    make_inputs,
    on_device,
    timeout_inputs,
)

pytestmark = pytest.mark.gpu

BUFFER_TIMEOUT_S = 60.0  # a peer's kernel may wait for time slices of every other process on the GPU
NUM_CASES = 10


def small_case(index: int) -> dict:
    """Case ``index`` of `NUM_CASES` (a `test_native_gpu.make_case` dict, small): the three dtypes among the cached
    dispatches (every third index), fixed size on indices 2 and 6, every routing of `ROUTINGS`, biases 0/1/2 in
    turn, experts divisible by 2, 3 and 4 ranks. `_case_options` runs odd indices (all exact size) with the copy
    engine forced on, even ones with it off. Index 9: rows of 520 bytes, which the kernels do not take (the torch
    fallback)."""
    case = dict(hidden=(256, 512, 1024)[index % 3], tokens=(64, 7, 200, 1, 64, 0, 128, 33, 96, 40)[index],
                topk=(2, 4, 1, 8, 6, 2, 4, 8, 3, 2)[index], experts=(24, 48)[index % 2],
                dtype=("bf16", "fp8", "fp32")[(index + index // 3) % 3], routing=ROUTINGS[index % len(ROUTINGS)],
                alignment=(1, 128)[index % 4 == 3], worst=index in (2, 6), bias=index % 3, uneven=index % 4 == 0,
                num_sms=(2, 8, 24)[index % 3])
    if index == NUM_CASES - 1:
        case.update(hidden=260, dtype="bf16")
    return case


def _check_expert_major(rank: int, world: int, index: int, nat, ref, case: dict) -> None:
    """`expert_dispatch` and `expert_combine` (both reduction modes) through ``nat`` equal ``ref``'s on copies of
    the same inputs, bit for bit (FP8: the dispatch only, as DeepEP's)."""
    from ep_moe import expert_combine, expert_dispatch

    device = nat.device
    data, idx, weights = make_inputs(case, rank, world, device, seed=20_000 + index)
    worst = world * max(case["tokens"], 1) + case.get("worst_slack", 5) if case["worst"] else 0
    label = f"expert-major case {index} {case}"
    outs, grads = [], []
    for buf in (nat, ref):
        x, w = on_device(buf.device, data), on_device(buf.device, weights)
        if not isinstance(x, tuple):  # the dispatch's gradients too (FP8: forward only)
            x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = expert_dispatch(buf, x, on_device(buf.device, idx), w, case["experts"], case["alignment"], worst)
        outs.append(out)
        if not isinstance(x, tuple):
            g = torch.Generator().manual_seed(40_000 + 31 * index + rank)
            g_rows = torch.randn(out.expert_x.shape, generator=g).to(out.expert_x.dtype)
            g_w = torch.randn(out.expert_weights.shape, generator=g)
            grads.append(torch.autograd.grad([out.expert_x, out.expert_weights], [x, w],
                                             [on_device(buf.device, g_rows), on_device(buf.device, g_w)]))
    got, want = outs
    row_bytes = case["hidden"] * {"bf16": 2, "fp32": 4, "fp8": 1}[case["dtype"]]
    fused_on = getattr(getattr(nat.backend, "options", None), "expert_major_fused", True)
    assert got.handle.rows_in_place == (fused_on and row_bytes % 16 == 0), \
        f"{label}: rows_in_place {got.handle.rows_in_place}"
    assert not want.handle.rows_in_place, label
    for name, a, b in zip(("grad x", "grad weights"), *grads) if grads else ():
        assert_bits_equal(a, b, f"{label} {name}", on_host=True)
    got = got._replace(expert_weights=got.expert_weights.detach())
    want = want._replace(expert_weights=want.expert_weights.detach())
    if isinstance(got.expert_x, tuple):
        assert_bits_equal(got.expert_x[0], want.expert_x[0], f"{label} expert_x", on_host=True)
        assert_bits_equal(got.expert_x[1], want.expert_x[1], f"{label} expert_scales", on_host=True)
    else:
        assert_bits_equal(got.expert_x, want.expert_x, f"{label} expert_x", on_host=True)
    assert_bits_equal(got.expert_weights, want.expert_weights, f"{label} expert_weights", on_host=True)
    assert_bits_equal(got.tokens_per_expert, want.tokens_per_expert, f"{label} tokens_per_expert", on_host=True)
    assert_bits_equal(got.pairs_per_expert, want.pairs_per_expert, f"{label} pairs_per_expert", on_host=True)
    if got.tokens_per_expert_list is not None and want.tokens_per_expert_list is not None:
        assert got.tokens_per_expert_list == want.tokens_per_expert_list, label
    _check_expert_cached_dispatch(rank, world, index, nat, ref, case, got.handle, want.handle, weights, label)
    y_dtype = torch.float32 if case["dtype"] == "fp32" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(30_000 + 31 * index + rank)
    y = torch.randn(got.expert_weights.shape[0], case["hidden"], generator=g, device=device).to(y_dtype)
    fused = fused_on and case["hidden"] * y.element_size() % 16 == 0  # the kernels take the rows: summed as they go out
    for multiple in (True, False):
        before = nat.backend.expert_row_combines
        combined = expert_combine(nat, y, got.handle, got.expert_weights, allow_multiple_reduction=multiple)
        expected = expert_combine(ref, on_device(ref.device, y), want.handle, want.expert_weights,
                                  allow_multiple_reduction=multiple)
        assert_bits_equal(combined, expected, f"{label} expert_combine (multiple reduction {multiple})", on_host=True)
        assert nat.backend.expert_row_combines - before == int(fused and multiple), label
    # the combine's gradients (multiple reduction): y's and the expert weights'
    g_out = torch.randn(combined.shape, generator=g, device=device).to(y_dtype)
    grads = []
    for buf, out in ((nat, got), (ref, want)):
        y_in = on_device(buf.device, y).clone().requires_grad_(True)
        w_in = out.expert_weights.clone().requires_grad_(True)
        combined = expert_combine(buf, y_in, out.handle, w_in)
        grads.append(torch.autograd.grad(combined, [y_in, w_in], on_device(buf.device, g_out)))
    assert_bits_equal(grads[0][0], grads[1][0], f"{label} expert_combine grad y", on_host=True)
    # grad_w[slot] = <grad_out[t], y[slot]> in fp32: a dot product over H whose summation order the semantics leave
    # to the device (the GPU kernel's warp reduction vs the CPU reference's vectorized sum), so equal to rounding
    # (measured on the H200: 74 of 128 weights differ in the last bits at H = 256)
    torch.testing.assert_close(grads[0][1].cpu(), grads[1][1].cpu(), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{label} expert_combine grad expert weights: {m}")
    # the exact combine's (allow_multiple_reduction=False: one combine of [N, K * H] fp32 rows, one cached dispatch
    # back): y's bit for bit, the weights' to rounding (a sum over H, as above)
    grads = []
    for buf, out in ((nat, got), (ref, want)):
        y_in = on_device(buf.device, y).clone().requires_grad_(True)
        w_in = out.expert_weights.clone().requires_grad_(True)
        combined = expert_combine(buf, y_in, out.handle, w_in, allow_multiple_reduction=False)
        grads.append(torch.autograd.grad(combined, [y_in, w_in], on_device(buf.device, g_out)))
    assert_bits_equal(grads[0][0], grads[1][0], f"{label} exact expert_combine grad y", on_host=True)
    torch.testing.assert_close(grads[0][1].cpu(), grads[1][1].cpu(), rtol=1e-5, atol=1e-4,
                               msg=lambda m: f"{label} exact expert_combine grad expert weights: {m}")


def _check_expert_cached_dispatch(rank: int, world: int, index: int, nat, ref, case: dict, handle_nat, handle_ref,
                                  weights, label: str) -> None:
    """`expert_cached_dispatch` of new rows and the routing weights with each buffer's handle: bit for bit the torch
    backend's, forward and (bf16/fp32) the gradients of x and of the weights; on the native backend the received
    rows are left in place (``in_place_dispatches``) exactly where the fresh dispatch left them."""
    from ep_moe import expert_cached_dispatch

    data2 = make_inputs(case, rank, world, nat.device, seed=21_000 + index)[0]
    results = []
    for buf, handle in ((nat, handle_nat), (ref, handle_ref)):
        x, w = on_device(buf.device, data2), on_device(buf.device, weights)
        if not isinstance(x, tuple):
            x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        before = getattr(buf.backend, "in_place_dispatches", 0)
        rows, rows_w = expert_cached_dispatch(buf, x, handle, w)
        taken = getattr(buf.backend, "in_place_dispatches", 0) - before
        assert taken == int(handle.rows_in_place), f"{label} cached: {taken} in-place dispatches"
        out = [t.detach().cpu() for t in (rows if isinstance(rows, tuple) else (rows,))] + [rows_w.detach().cpu()]
        if not isinstance(x, tuple):
            g = torch.Generator().manual_seed(50_000 + 31 * index + rank)
            g_rows = torch.randn(rows.shape, generator=g).to(rows.dtype)
            g_w = torch.randn(rows_w.shape, generator=g)
            out += [t.cpu() for t in torch.autograd.grad([rows, rows_w], [x, w], [on_device(buf.device, g_rows),
                                                                                 on_device(buf.device, g_w)])]
        results.append(out)
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert_bits_equal(a, b, f"{label} expert_cached_dispatch output {i}", on_host=True)


def _check_small_case(rank: int, world: int, index: int, nat, ref, case: dict) -> None:
    _check_case(rank, world, index, nat, ref, _case_options(index), case)
    if index % 3 != 2:  # expert-major on two cases of three (FP8 and fixed size among them)
        _check_expert_major(rank, world, index, nat, ref, case)


def _check_expert_major_on(buffers: tuple, rank: int, world: int, index: int, ref, case: dict) -> None:
    for buffer in buffers:
        _check_expert_major(rank, world, index, buffer, ref, case)


def _shared_equality_worker(rank: int, world: int, indices: list[int]) -> int:
    from ep_moe import Buffer

    nat = Buffer(backend="auto", timeout_s=BUFFER_TIMEOUT_S)
    ref = Buffer(backend="torch")
    side_group = dist.new_group(backend="gloo")  # apart from the reference's collectives on the world group
    assert nat.backend_name == "native", (nat.backend_name, nat.backend_reason)
    assert nat.device == DEVICE and ref.device == torch.device("cpu"), (nat.device, ref.device)
    # each options value's first use is a collective check: all of them now, so that a case failing on one
    # rank cannot leave the others waiting in one
    for options in dict.fromkeys(_case_options(index) for index in indices):
        nat.backend._env_for(options)
    for index in indices:
        case = small_case(index)
        check_in_step(partial(_check_small_case, rank, world, index, nat, ref, case), side_group, rank,
                      f"case {index} {case}")
    nat.barrier()
    nat.destroy()
    ref.destroy()
    return len(indices)


def expert_major_case(index: int) -> dict:
    """Case ``index`` of `NUM_EXPERT_MAJOR_CASES` for the expert-major path (rows left in place): every routing of
    `ROUTINGS` (every pair to one expert, all -1 rows, a rank without tokens, skewed, gaps), alignments 1 and 128,
    the three dtypes, fixed size with ``num_worst_tokens`` = R * T (T = N) and R * T + 3 (T < N), exact size."""
    return dict(hidden=(256, 512, 1024)[index % 3], tokens=(48, 16, 33, 1, 64, 20, 40)[index % 7],
                topk=(4, 2, 8, 1, 6, 3, 2)[index % 7], experts=(24, 48)[index % 2],
                dtype=("bf16", "fp32", "fp8", "bf16")[index % 4], routing=ROUTINGS[index % len(ROUTINGS)],
                alignment=(1, 128)[index // 2 % 2], worst=index % 3 != 0, worst_slack=(0, 3)[index % 2], bias=0,
                uneven=False, num_sms=(8, 24)[index % 2])


NUM_EXPERT_MAJOR_CASES = 12


def _expert_major_worker(rank: int, world: int) -> int:
    from ep_moe import Buffer
    from ep_moe.config import NativeOptions

    nat = Buffer(backend="native", timeout_s=BUFFER_TIMEOUT_S)
    # the composed path on the same kernels (expert_major_fused=False): every third case
    composed = Buffer(backend="native", timeout_s=BUFFER_TIMEOUT_S,
                      native_options=NativeOptions(expert_major_fused=False))
    ref = Buffer(backend="torch")
    side_group = dist.new_group(backend="gloo")  # apart from the reference's collectives on the world group
    for index in range(NUM_EXPERT_MAJOR_CASES):
        case = expert_major_case(index)
        # the composed path on every third case
        buffers = (nat, composed) if index % 3 == 0 else (nat,)
        check_in_step(partial(_check_expert_major_on, buffers, rank, world, 100 + index, ref, case), side_group,
                      rank, f"expert-major case {index} {case}")
    assert composed.backend.in_place_dispatches == composed.backend.expert_row_combines == 0
    nat.barrier()
    nat.destroy()
    composed.destroy()
    ref.destroy()
    return NUM_EXPERT_MAJOR_CASES


ELASTIC_CASE = dict(hidden=512, tokens=96, topk=4, experts=24, dtype="bf16", routing="random_gaps", alignment=16,
                    uneven=True)  # (the fields `make_inputs` reads)


def _check_elastic(nat, ref, rank: int, world: int) -> int:
    """`ElasticBuffer` ``nat`` equals ``ref`` on copies of the same inputs, bit for bit: compact and expanded
    layouts, exact (``do_cpu_sync=True``) and fixed size, combine with the carried weights (compact) or applied
    expert weights (expanded), and a cached dispatch through each handle. Returns the layouts x modes checked."""
    case = ELASTIC_CASE
    x, idx, w = make_inputs(case, rank, world, nat.buffer.device, seed=40_000)
    x2 = make_inputs(case, rank, world, nat.buffer.device, seed=40_001)[0]
    g = torch.Generator(device=nat.buffer.device).manual_seed(41_000 + rank)
    checked = 0
    # the last: no SM count, so the native buffer asks the tuner for one (after an all-reduce of the token counts)
    for do_expand, sync, num_sms in ((False, True, 8), (False, False, 8), (True, False, 8), (True, True, 0)):
        where = f"ElasticBuffer do_expand={do_expand} do_cpu_sync={sync} num_sms={num_sms}"
        outs = [buf.dispatch(on_device(buf.buffer.device, x), on_device(buf.buffer.device, idx),
                             on_device(buf.buffer.device, w), num_experts=case["experts"],
                             expert_alignment=case["alignment"], num_sms=num_sms, do_expand=do_expand,
                             do_cpu_sync=sync) for buf in (nat, ref)]
        (rx_n, ri_n, rw_n, h_n, _), (rx_r, ri_r, rw_r, h_r, _) = outs
        assert_bits_equal(rx_n, rx_r, f"{where} recv_x", on_host=True)
        assert_bits_equal(ri_n, ri_r, f"{where} recv_topk_idx", on_host=True)
        assert_bits_equal(rw_n, rw_r, f"{where} recv_topk_weights", on_host=True)
        assert_bits_equal(h_n.psum_num_recv_tokens_per_expert, h_r.psum_num_recv_tokens_per_expert, f"{where} psum per expert", on_host=True)
        y = torch.randn(rx_n.shape[0], case["hidden"], generator=g, device=nat.buffer.device).to(torch.bfloat16)
        weighted = dict(expert_weights=rw_n) if do_expand else dict(topk_weights=rw_n * 3)
        weighted_ref = dict(expert_weights=rw_r) if do_expand else dict(topk_weights=rw_r * 3)
        got, want = nat.combine(y, h_n, **weighted), ref.combine(on_device(ref.buffer.device, y), h_r, **weighted_ref)
        assert_bits_equal(got[0], want[0], f"{where} combined", on_host=True)
        assert_bits_equal(got[1], want[1], f"{where} combined weights", on_host=True)
        cached_n = nat.dispatch(x2, topk_weights=w, handle=h_n, do_expand=do_expand)
        cached_r = ref.dispatch(on_device(ref.buffer.device, x2), topk_weights=on_device(ref.buffer.device, w),
                                handle=h_r, do_expand=do_expand)
        assert_bits_equal(cached_n[0], cached_r[0], f"{where} cached recv_x", on_host=True)
        assert_bits_equal(cached_n[2], cached_r[2], f"{where} cached recv_topk_weights", on_host=True)
        checked += 1
    return checked


def _elastic_worker(rank: int, world: int) -> int:
    from ep_moe import ElasticBuffer

    sizes = dict(num_max_tokens_per_rank=ELASTIC_CASE["tokens"], hidden=ELASTIC_CASE["hidden"],
                 num_topk=ELASTIC_CASE["topk"], num_gpu_timeout_secs=BUFFER_TIMEOUT_S)
    nat = ElasticBuffer(dist.group.WORLD, **sizes)
    ref = ElasticBuffer(dist.group.WORLD, backend="torch", **sizes)
    assert nat.buffer.backend_name == "native" and ref.buffer.device == torch.device("cpu"), nat.buffer.backend_reason
    checked = _check_elastic(nat, ref, rank, world)
    nat.destroy()
    ref.destroy()
    return checked


def _vmm_memory_worker(rank: int, world: int) -> int:
    from ep_moe.native.symmetric import SymmetricBuffer, VmmSymmetricBuffer

    buf = SymmetricBuffer(dist.group.WORLD, DEVICE, 3 << 20)  # rounded up to 4 MiB
    assert isinstance(buf, VmmSymmetricBuffer) and buf.nbytes == 4 << 20 and buf.tensor.device == DEVICE
    check_symmetric_buffer(buf, rank, world)
    buf.destroy()
    return world


def _graph_worker(rank: int, world: int) -> int:
    from ep_moe import Buffer

    nat = Buffer(backend="native", timeout_s=BUFFER_TIMEOUT_S)
    ref = Buffer(backend="torch")
    check_graph_replays(nat, ref, rank, world, hidden=512, tokens=64, replays=2)
    nat.barrier()
    nat.destroy()
    ref.destroy()
    return 2


def _expert_major_graph_worker(rank: int, world: int) -> int:
    """A fixed-size `expert_dispatch` (rows left in place) -> trivial expert (``2 * x``) -> weighted
    `expert_combine` (rows summed as they go out) on the native backend, captured in one CUDA graph and replayed on new routings, each equal bit
    for bit to the torch backend on CPU copies."""
    from ep_moe import Buffer, expert_combine, expert_dispatch

    nat = Buffer(backend="native", timeout_s=BUFFER_TIMEOUT_S)
    ref = Buffer(backend="torch")
    tokens, hidden, alignment, worst = 48, 512, 16, world * 48

    def layer(buf, x, idx, w):
        out = expert_dispatch(buf, x, idx, w, GRAPH_EXPERTS, alignment, worst)
        return out, expert_combine(buf, out.expert_x * 2, out.handle, out.expert_weights)

    static = [t.clone() for t in _routed_inputs(0, rank, DEVICE, tokens, hidden)]
    layer(nat, *static)  # warm-up outside the graph (sizes the buffer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_combined = layer(nat, *static)
    assert g_out.handle.rows_in_place and nat.backend.expert_row_combines == 2  # warm-up and capture
    for seed in (1, 2):
        for target, new in zip(static, _routed_inputs(seed, rank, DEVICE, tokens, hidden)):
            target.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        r_out, r_combined = layer(ref, *(on_device(ref.device, t) for t in static))
        assert_bits_equal(g_out.expert_x, r_out.expert_x, f"graph replay {seed} expert_x", on_host=True)
        assert_bits_equal(g_out.expert_weights, r_out.expert_weights, f"graph replay {seed} expert_weights", on_host=True)
        assert_bits_equal(g_out.tokens_per_expert, r_out.tokens_per_expert, f"graph replay {seed} tokens_per_expert", on_host=True)
        assert_bits_equal(g_combined, r_combined, f"graph replay {seed} combined", on_host=True)
    del graph
    nat.barrier()
    nat.destroy()
    ref.destroy()
    return 2


def _shared_timeout_worker(rank: int, world: int) -> str:
    """The count exchange, then a combine with pushers and one with the copy engine, each skipped by the other
    ranks: rank 0 times out in each (the copy engine's stream is released, no hang)."""
    x, idx, w = timeout_inputs()
    messages = [_rank0_notify_times_out(rank, x, idx, w)]
    for forced in (False, True):
        messages.append(_rank0_times_out_alone(
            rank, _copy_engine_options(forced), "combine",
            lambda buf, handle, recv_x, recv_w: buf.combine(recv_x, handle, topk_weights=recv_w), x, idx, w))
    torch.cuda.synchronize()
    return "\n".join(m for m in messages if m)


def test_vmm_symmetric_memory_is_shared():
    skip_unless_shared_gpu_runs()
    assert run_on_one_gpu(_vmm_memory_worker, 3) == [3] * 3


KERNEL_CASES = list(range(NUM_CASES - 1))  # the last case's rows go to the torch fallback (its own test)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_native_on_one_gpu_equals_torch_backend(world):
    skip_unless_shared_gpu_runs()
    counts = run_on_one_gpu(_shared_equality_worker, world, KERNEL_CASES, timeout_s=180, join_timeout_s=900)
    assert counts == [len(KERNEL_CASES)] * world


@pytest.mark.parametrize("world", [2, 3, 4])
def test_expert_major_rows_in_place_on_one_gpu(world):
    """`expert_dispatch` / `expert_combine` and the dispatch's gradients through the native backend, the received
    rows permuted straight from the receive buffer and the own input, bit for bit the torch backend's."""
    skip_unless_shared_gpu_runs()
    counts = run_on_one_gpu(_expert_major_worker, world, timeout_s=180, join_timeout_s=900)
    assert counts == [NUM_EXPERT_MAJOR_CASES] * world


def test_fallback_rows_on_one_gpu():
    """Rows the kernels do not take (520 bytes) go to the torch backend inside the native one: on the GPU, its
    collectives through gloo."""
    skip_unless_shared_gpu_runs()
    assert run_on_one_gpu(_shared_equality_worker, 2, [NUM_CASES - 1], timeout_s=180) == [1, 1]


def test_elastic_buffer_on_one_gpu():
    skip_unless_shared_gpu_runs()
    assert run_on_one_gpu(_elastic_worker, 2, timeout_s=180) == [4, 4]


def test_graph_replay_on_one_gpu():
    skip_unless_shared_gpu_runs()
    assert run_on_one_gpu(_graph_worker, 2, timeout_s=180) == [2, 2]


def test_expert_major_graph_replay_on_one_gpu():
    skip_unless_shared_gpu_runs()
    assert run_on_one_gpu(_expert_major_graph_worker, 2, timeout_s=180) == [2, 2]


def test_forced_timeout_on_one_gpu():
    skip_unless_shared_gpu_runs()
    messages = run_on_one_gpu(_shared_timeout_worker, 2, timeout_s=180)
    lines = messages[0].splitlines()
    assert len(lines) == 3 and all("rank 0" in line for line in lines) and not messages[1], messages
    print(messages[0])
