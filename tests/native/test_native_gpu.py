"""GPU tests of the native backend: bit-for-bit equality with the torch (NCCL) backend, cached dispatch,
num_worst_tokens, CUDA-graph capture, long runs without memory growth, the forced timeout, and the check
that every rank holds equal `NativeOptions`. Paths (copy engine, its streams, bulk-copy reducers) are forced
per case through ``Config(native=...)`` or ``Buffer(native_options=...)``.

Run on a machine with >= 2 NVLink-connected GPUs and the extension built: ``pytest -m gpu``; on 4 or 8 GPUs,
``EP_MOE_TEST_WORLD=8 pytest -m gpu tests/native/test_native_gpu.py`` runs every test at that EP size.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from ep_moe import Config, NativeOptions, native
from ep_moe.distributed import run_distributed

pytestmark = pytest.mark.gpu

WORLD = int(os.environ.get("EP_MOE_TEST_WORLD", "2"))  # ranks (GPUs) of every test


def _need_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs")
    if not native.extension_available():
        pytest.skip("the native CUDA extension is not built")


# ------------------------------------------------------------------------------------------ inputs
FP8 = getattr(torch, "float8_e4m3fn", None)
ROUTINGS = ("random", "random_gaps", "one_expert", "one_rank", "none", "rank0_empty", "skewed")


def make_case(index: int) -> dict:
    """The shape of case ``index`` (the same on every rank)."""
    rng = random.Random(1000 + index)
    hidden = rng.choice([2048, 4096, 7168])
    tokens = rng.choice([0, 1, 7, 128, 128, 4096, 8192])
    return dict(
        hidden=hidden, tokens=tokens, topk=rng.choice([1, 2, 6, 8]), experts=rng.choice([8, 64, 256]),
        dtype=rng.choice(["bf16", "bf16", "fp8", "fp32"]), routing=ROUTINGS[index % len(ROUTINGS)],
        alignment=rng.choice([1, 1, 128]), worst=rng.random() < 0.25, bias=rng.choice([0, 1, 2]),
        uneven=rng.random() < 0.3, num_sms=rng.choice([2, 8, 24, 33]))


def make_inputs(case: dict, rank: int, world: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    tokens = case["tokens"]
    if case["uneven"] and tokens > 1:
        tokens = tokens // (rank + 1) + rank
    if case["routing"] == "rank0_empty" and rank == 0:
        tokens = 0
    hidden, topk, experts = case["hidden"], min(case["topk"], case["experts"]), case["experts"]
    scores = torch.rand(tokens, experts, generator=g, device=device)
    idx = scores.topk(topk, dim=1).indices.to(torch.int64)
    routing = case["routing"]
    if routing == "random_gaps":
        idx = idx.masked_fill(torch.rand(idx.shape, generator=g, device=device) < 0.3, -1)
    elif routing == "one_expert":
        idx = torch.full_like(idx, -1)
        idx[:, 0] = experts - 1
    elif routing == "one_rank":
        per_rank = experts // world
        idx = torch.rand(tokens, per_rank, generator=g, device=device).topk(min(topk, per_rank), dim=1).indices
        idx = torch.cat([idx, torch.full((tokens, topk - idx.shape[1]), -1, device=device)], 1).to(torch.int64)
    elif routing == "none":
        idx = torch.full_like(idx, -1)
    elif routing == "skewed":
        idx = torch.where(torch.rand(idx.shape, generator=g, device=device) < 0.7, idx % 4, idx)
        # keep ids distinct per token where the remap made duplicates
        dup = torch.zeros_like(idx, dtype=torch.bool)
        for k in range(1, idx.shape[1]):
            dup[:, k] = (idx[:, k:k + 1] == idx[:, :k]).any(1)
        idx = idx.masked_fill(dup, -1)
    weights = torch.rand(tokens, topk, generator=g, device=device)
    if case["dtype"] == "fp8":
        x = (torch.randn(tokens, hidden, generator=g, device=device) * 4).to(FP8)
        scales = torch.rand(tokens, hidden // 128, generator=g, device=device) + 0.5
        data = (x, scales)
    else:
        dtype = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32
        data = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    return data, idx, weights


def make_combine_inputs(case: dict, rows: int, num_tokens: int, rank: int, device, seed: int):
    """``(y, bias)`` of a combine in ``case``: ``y [rows, hidden]`` random in the dispatch dtype (bf16 for FP8)
    and the biases ``case["bias"]`` asks for (0: None, 1: one ``[num_tokens, hidden]`` of y's dtype, 2: a pair,
    fp32 then y's dtype)."""
    y_dtype = torch.float32 if case["dtype"] == "fp32" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(seed * 31 + rank)
    y = torch.randn(rows, case["hidden"], generator=g, device=device).to(y_dtype)
    bias = None
    if case["bias"] == 1:
        bias = torch.randn(num_tokens, case["hidden"], generator=g, device=device).to(y_dtype)
    elif case["bias"] == 2:
        bias = (torch.randn(num_tokens, case["hidden"], generator=g, device=device).to(torch.float32),
                torch.randn(num_tokens, case["hidden"], generator=g, device=device).to(y_dtype))
    return y, bias


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view whose equality is bit equality (NaN-safe)."""
    if t.dtype in (torch.int32, torch.int64, torch.bool, torch.uint8):
        return t
    return t.contiguous().view(torch.uint8)


def assert_bits_equal(name: str, a, b) -> None:
    if a is None or b is None:
        assert a is None and b is None, f"{name}: one side is None"
        return
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
    if not torch.equal(bits(a), bits(b)):
        diff = (bits(a) != bits(b)).nonzero()
        raise AssertionError(f"{name}: differs at {diff.shape[0]} places, first {diff[:3].tolist()}")


# ------------------------------------------------------------------------------------------ workers
def _all_ok(ok: bool, side_group) -> bool:
    """Whether every rank's case passed (over gloo, so that it never mixes with a pending NCCL call)."""
    flag = torch.tensor([0 if ok else 1])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=side_group)
    return int(flag) == 0


def _copy_engine_options(forced: bool, streams: int = 1, flag_stream: bool = False, bulk: str = "auto"
                         ) -> NativeOptions:
    """Options that force the copy engine on or off for dispatch and combine, with its chunks spread over
    ``streams`` side streams and its flag writes on a stream of their own or not, and the combine's reducers
    on bulk copies (``bulk``: auto, on or off)."""
    mode = "on" if forced else "off"
    return NativeOptions(dispatch_copy_engine=mode, combine_copy_engine=mode, combine_bulk_reduce=bulk,
                         dispatch_copy_engine_streams=streams, combine_copy_engine_streams=streams,
                         dispatch_copy_engine_flag_stream=flag_stream, combine_copy_engine_flag_stream=flag_stream)


def _case_options(index: int) -> NativeOptions:
    """Odd cases force the copy engine for dispatch and combine where the host knows the layout (exact-size
    dispatches and their cached re-dispatches and combines), in turn on one side stream per op, on two, and
    on one with the flag writes on a stream of their own; the combine's reducers on bulk copies where auto
    takes them (with the copy engine), always, or never."""
    variant = (index // 2) % 3
    return _copy_engine_options(index % 2 == 1, 2 if variant == 1 else 1, variant == 2,
                                ("auto", "on", "off")[(index // 6) % 3])


def _equality_worker(rank: int, world: int, num_cases: int) -> int:
    from ep_moe import Buffer

    nat = Buffer(backend="native", timeout_s=20.0)  # a failing peer surfaces in 20 s, not 100
    ref = Buffer(backend="torch")
    assert nat.backend_name == "native", nat.backend_name
    side_group = torch.distributed.new_group(backend="gloo")
    # The first use of each options value is a collective check: make them all now, so that a case failing
    # on one rank cannot leave the others waiting in one.
    for options in dict.fromkeys(_case_options(index) for index in range(num_cases)):
        nat.backend._env_for(options)
    for index in range(num_cases):
        error = None
        options = _case_options(index)
        try:
            _check_case(rank, world, index, nat, ref, options)
        except Exception as exc:  # every rank stops at the same case, with this rank's reason
            error = exc
        if not _all_ok(error is None, side_group):
            raise AssertionError(f"case {index} {make_case(index)} failed on "
                                 f"{'this rank' if error is not None else 'another rank'}") from error
    nat.barrier()
    nat.destroy()
    ref.destroy()
    return num_cases


def _check_case(rank: int, world: int, index: int, nat, ref, options: NativeOptions) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    case = make_case(index)
    data, idx, weights = make_inputs(case, rank, world, device, seed=index)
    x = data[0] if isinstance(data, tuple) else data
    worst = 0
    if case["worst"]:
        worst = world * max(case["tokens"], 1) + 5
    config = Config(num_sms=case["num_sms"], native=options)  # the torch backend ignores the options
    label = f"case {index} {case}"
    # layout kernel equals the torch layout
    from ep_moe.layout import dispatch_layout
    lay_ref = dispatch_layout(idx, case["experts"], world)
    lay_nat = nat.backend.get_dispatch_layout(idx, case["experts"])
    for name, a, b in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"), lay_nat, lay_ref):
        assert_bits_equal(f"{label} layout {name}", a, b)
    per_rank, _, per_expert, in_rank, _ = nat.get_dispatch_layout(idx, case["experts"])
    outs = []
    for buf in (nat, ref):
        outs.append(buf.dispatch(data, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=weights,
                                 expert_alignment=case["alignment"], num_worst_tokens=worst, config=config))
    (rx_n, ri_n, rw_n, cnt_n, h_n, _), (rx_r, ri_r, rw_r, cnt_r, h_r, _) = outs
    if isinstance(rx_n, tuple):
        assert_bits_equal(f"{label} recv_x", rx_n[0], rx_r[0])
        assert_bits_equal(f"{label} recv_scales", rx_n[1], rx_r[1])
    else:
        assert_bits_equal(f"{label} recv_x", rx_n, rx_r)
    assert_bits_equal(f"{label} recv_topk_idx", ri_n, ri_r)
    assert_bits_equal(f"{label} recv_topk_weights", rw_n, rw_r)
    assert cnt_n == cnt_r, f"{label} counts {cnt_n} != {cnt_r}"
    assert_bits_equal(f"{label} rank_prefix_matrix", h_n.rank_prefix_matrix, h_r.rank_prefix_matrix)
    assert_bits_equal(f"{label} recv_src_idx", h_n.recv_src_idx, h_r.recv_src_idx)
    assert_bits_equal(f"{label} recv_src_rank", h_n.recv_src_rank, h_r.recv_src_rank)
    assert h_n.num_recv_tokens == h_r.num_recv_tokens

    # combine: y in the dispatch dtype (bf16 for FP8), weights, optional biases of either dtype
    rows = rx_r[0].shape[0] if isinstance(rx_r, tuple) else rx_r.shape[0]
    y, bias = make_combine_inputs(case, rows, x.shape[0], rank, device, seed=index)
    c_n, cw_n, _ = nat.combine(y, h_n, topk_weights=rw_n, bias=bias, config=config)
    c_r, cw_r, _ = ref.combine(y, h_r, topk_weights=rw_r, bias=bias, config=config)
    assert_bits_equal(f"{label} combined", c_n, c_r)
    assert_bits_equal(f"{label} combined_weights", cw_n, cw_r)

    # cached dispatch of fresh data with the same layout
    if index % 3 == 0:
        data2, _, _ = make_inputs(case, rank, world, device, seed=index + 100_000)
        cx_n = nat.dispatch(data2, handle=h_n, config=config)[0]
        cx_r = ref.dispatch(data2, handle=h_r, config=config)[0]
        if isinstance(cx_n, tuple):
            assert_bits_equal(f"{label} cached recv_x", cx_n[0], cx_r[0])
            assert_bits_equal(f"{label} cached recv_scales", cx_n[1], cx_r[1])
        else:
            assert_bits_equal(f"{label} cached recv_x", cx_n, cx_r)


def _graph_and_soak_worker(rank: int, world: int, iterations: int) -> float:
    from ep_moe import Buffer

    device = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(backend="native")
    ref = Buffer(backend="torch")
    hidden, topk, experts, tokens = 2048, 4, 64, 256
    worst = world * tokens

    def inputs(seed):
        g = torch.Generator(device=device).manual_seed(seed * 13 + rank)
        idx = torch.rand(tokens, experts, generator=g, device=device).topk(topk, 1).indices
        x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
        w = torch.rand(tokens, topk, generator=g, device=device)
        return x, idx, w

    static_x, static_idx, static_w = (t.clone() for t in inputs(0))

    def step():
        per_rank, per_expert, in_rank = buf.backend.get_dispatch_layout(static_idx, experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            static_x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=static_idx, topk_weights=static_w, num_worst_tokens=worst)
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        return recv_x, recv_idx, combined, combined_w

    step()  # warm-up outside the graph (sizes the buffer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_recv_x, g_recv_idx, g_combined, g_combined_w = step()
    for seed in range(1, 4):
        x, idx, w = inputs(seed)
        static_x.copy_(x)
        static_idx.copy_(idx)
        static_w.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        r_x, r_idx, r_w, _, r_h, _ = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=worst,
                                                  num_experts=experts)
        assert_bits_equal(f"graph replay {seed} recv_x", g_recv_x, r_x)
        assert_bits_equal(f"graph replay {seed} recv_topk_idx", g_recv_idx, r_idx)
        r_c, r_cw, _ = ref.combine(r_x, r_h, topk_weights=r_w)
        assert_bits_equal(f"graph replay {seed} combined", g_combined, r_c)
        assert_bits_equal(f"graph replay {seed} combined_weights", g_combined_w, r_cw)
    del graph

    # Long run, exact mode (host sync per dispatch): no growth of allocated GPU memory, with pushers for
    # half the iterations and the copy engine (dispatch and combine) for the other half.
    x, idx, w = inputs(99)
    elapsed = 0.0
    for copy_engine in (False, True):
        # the copy-engine half on two side streams, flags on a third
        config = Config(native=_copy_engine_options(copy_engine, streams=2, flag_stream=True))
        # Warm up holding the same live tensors (rx, rw, h, combined) as the loop leaves behind, so that
        # `before` and `after` count the same things (a first run without `combined` read as 1 MiB of
        # growth: exactly one [256, 2048] bf16 output).
        for _ in range(3):
            rx, _, rw, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts, config=config)
            combined, _, _ = buf.combine(rx, h, topk_weights=rw, config=config)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        for _ in range(iterations // 2):
            rx, _, rw, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts, config=config)
            combined, _, _ = buf.combine(rx, h, topk_weights=rw, config=config)
        torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
        after = torch.cuda.memory_allocated(device)
        assert after <= before, (f"GPU memory grew from {before} to {after} bytes over {iterations // 2} iterations "
                                 f"(copy engine {copy_engine})")
    r_x, _, r_w, _, r_h, _ = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts)
    r_c, _, _ = ref.combine(r_x, r_h, topk_weights=r_w)
    assert_bits_equal("soak combined", combined, r_c)
    buf.destroy()
    ref.destroy()
    return elapsed / iterations


def _rank0_times_out_alone(rank: int, options: NativeOptions, what: str, call, x, idx, w) -> str:
    """On a buffer with ``options``, after a dispatch together, rank 0 makes ``call(buf, handle, recv_x,
    recv_w)``, which rank 1 skips: rank 0 must raise a TimeoutError naming ``what`` and rank 0 by its next
    call, while rank 1 keeps its buffer alive. Returns rank 0's message ('' on rank 1)."""
    from ep_moe import Buffer

    buf = Buffer(backend="native", timeout_s=2.0, native_options=options)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=16)
    text = ""
    if rank == 0:
        with pytest.raises(TimeoutError) as info:
            call(buf, handle, recv_x, recv_w)
            buf.barrier()
        text = str(info.value)
        assert what in text and "rank 0" in text, text
    else:
        time.sleep(5.0)
    buf.destroy()
    return text


def _timeout_worker(rank: int, world: int) -> str:
    from ep_moe import Buffer
    from ep_moe.backends.native_backend import NativeTimeoutError

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(64, 1024, device=device).to(torch.bfloat16)
    idx = torch.rand(64, 16, device=device).topk(2, 1).indices
    w = torch.rand(64, 2, device=device)
    messages = []
    # 1) rank 1 skips a dispatch: rank 0 times out in the count exchange (host waits there). One
    # dispatch together first: the first call sizes the symmetric buffer, collectively.
    buf = Buffer(backend="native", timeout_s=2.0)
    buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=16)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(NativeTimeoutError) as info:
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=16)
        took = time.monotonic() - start
        text = str(info.value)
        assert "rank 0" in text and "notify" in text and "channel" in text, text
        assert 1.5 < took < 30, took
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, TimeoutError)
        with pytest.raises(RuntimeError, match="unusable"):
            buf.barrier()
        messages.append(text)
    else:
        time.sleep(4.0)  # keep this rank's buffer alive while rank 0 writes into it and times out
    buf.destroy()
    # 2) rank 1 skips a cached dispatch whose x goes by the copy engine: rank 0's kernel gives up waiting
    # and still releases its copy stream (no hang); the error surfaces at the next call.
    # On one side stream, on two, and on one with a flag stream (each must be released).
    for streams, flag_stream in ((1, False), (2, False), (1, True)):
        messages.append(_rank0_times_out_alone(rank, _copy_engine_options(True, streams, flag_stream), "dispatch",
                                               lambda buf, handle, *_: buf.dispatch(x, handle=handle), x, idx, w))
    # 3) rank 1 skips a combine: rank 0's combine kernel times out; the error surfaces at the next call.
    # With pushers (register and bulk-copy reducers), then with the copy engine (on one and on two side
    # streams, and with a flag stream; bulk-copy reducers, then register ones), whose streams rank 0's kernel
    # must still release.
    for forced, streams, flag_stream, bulk in ((False, 1, False, "off"), (False, 1, False, "on"),
                                               (True, 1, False, "auto"), (True, 2, False, "off"), (True, 1, True, "auto")):
        messages.append(_rank0_times_out_alone(
            rank, _copy_engine_options(forced, streams, flag_stream, bulk), "combine",
            lambda buf, handle, recv_x, recv_w: buf.combine(recv_x, handle, topk_weights=recv_w), x, idx, w))
    torch.cuda.synchronize()
    return "\n".join(m for m in messages if m)


def _async_counts_worker(rank: int, world: int) -> int:
    """async_finish dispatch: the returned per-expert counts are those of this call, even though the
    caller's stream has not waited for the communication stream yet (a large dispatch keeps it busy)."""
    from ep_moe import Buffer

    device = torch.device("cuda", torch.cuda.current_device())
    experts, hidden, tokens = 64, 7168, 8192
    buf = Buffer(backend="native")
    checked = 0
    for seed in range(4):
        g = torch.Generator(device=device).manual_seed(seed * 31 + rank)
        skew = torch.rand(experts, generator=g, device=device) ** (seed + 1)  # different counts every call
        idx = (torch.rand(tokens, experts, generator=g, device=device) * skew).topk(4, dim=1).indices
        w = torch.rand(tokens, 4, generator=g, device=device)
        x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
        everyone = [torch.empty_like(idx) for _ in range(world)]
        torch.distributed.all_gather(everyone, idx)
        local = experts // world
        mine = torch.cat(everyone).flatten() - rank * local
        want = torch.bincount(mine[(mine >= 0) & (mine < local)], minlength=local).tolist()
        _, _, _, counts, _, event = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts,
                                                 async_finish=True)
        assert counts == want, f"seed {seed}: counts {counts} != {want}"
        event.current_stream_wait()
        checked += 1
    torch.cuda.synchronize()
    buf.destroy()
    return checked


def _options_worker(rank: int, world: int) -> list[str]:
    """Options that differ between ranks are refused, at construction and at a call's first use of a value
    (before any kernel runs: the buffer stays usable), and a first use during graph capture is refused."""
    from ep_moe import Buffer

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(64, 1024, device=device).to(torch.bfloat16)
    idx = torch.rand(64, 16, device=device).topk(2, 1).indices
    w = torch.rand(64, 2, device=device)
    messages = []
    with pytest.raises(ValueError) as info:
        Buffer(backend="native", native_options=NativeOptions(combine_chunks=64 if rank == 1 else 128))
    messages.append(str(info.value))
    buf = Buffer(backend="native", native_options=NativeOptions(combine_chunks=64))
    with pytest.raises(ValueError) as info:
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=16,
                     config=Config(native=NativeOptions(min_chunk_rows=4 if rank == 1 else 8)))
    messages.append(str(info.value))
    same = Config(native=NativeOptions(min_chunk_rows=4))
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=16, config=same)
    combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w, config=same)
    assert torch.equal(combined, buf.combine(recv_x, handle, topk_weights=recv_w)[0])  # the buffer's options
    torch.cuda.synchronize()
    graph, unused = torch.cuda.CUDAGraph(), NativeOptions(min_chunk_rows=2)
    with torch.cuda.graph(graph):
        doubled = x * 2
        with pytest.raises(RuntimeError, match="CUDA-graph capture") as info:
            buf.backend._env_for(unused)
    messages.append(str(info.value))
    graph.replay()
    assert torch.equal(doubled, x * 2) and unused not in buf.backend._envs
    buf.destroy()
    return messages


# ------------------------------------------------------------------------------------------ tests
NUM_CASES = int(os.environ.get("EP_MOE_GPU_CASES", "210"))


def test_native_equals_torch_backend():
    _need_gpus()
    checked = run_distributed(_equality_worker, WORLD, NUM_CASES, backend="nccl", timeout_s=300,
                              join_timeout_s=1200)
    assert checked == [NUM_CASES] * WORLD


def test_graph_capture_and_soak():
    _need_gpus()
    per_iter = run_distributed(_graph_and_soak_worker, WORLD, 10_000, backend="nccl", timeout_s=300,
                               join_timeout_s=900)
    print(f"soak: {max(per_iter) * 1e6:.1f} us per dispatch+combine (exact mode, 256 tokens)")


def test_forced_timeout():
    _need_gpus()
    if WORLD < 2:
        pytest.skip("a peer that never arrives needs two or more ranks (EP_MOE_TEST_WORLD >= 2)")
    messages = run_distributed(_timeout_worker, WORLD, backend="nccl", timeout_s=120, join_timeout_s=300)
    print(messages[0])


def test_async_finish_returns_this_calls_counts():
    _need_gpus()
    assert run_distributed(_async_counts_worker, WORLD, backend="nccl", timeout_s=120, join_timeout_s=300) == [4] * WORLD


def test_options_must_be_equal_on_every_rank():
    _need_gpus()
    if WORLD < 2:
        pytest.skip("options can only differ between two or more ranks (EP_MOE_TEST_WORLD >= 2)")
    messages = run_distributed(_options_worker, WORLD, backend="nccl", timeout_s=120, join_timeout_s=300)
    construction, call, capture = messages[0]
    assert all(m == messages[0] for m in messages)  # every rank raises the same errors
    assert "field 'combine_chunks'" in construction and "64 on rank 1" in construction, construction
    assert "field 'min_chunk_rows'" in call and "4 on rank 1" in call, call
    print(capture)
