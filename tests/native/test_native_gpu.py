"""GPU tests of the native backend: bit-for-bit equality with the torch (NCCL) backend, cached dispatch,
num_worst_tokens, CUDA-graph capture, long runs without memory growth, a back-to-back soak, the forced
timeout, and the check that every rank holds equal `NativeOptions`. Paths (copy engine, its streams,
bulk-copy reducers) are forced per case through ``Config(native=...)`` or ``Buffer(native_options=...)``.

The back-to-back soak checks the regime ``ep-moe bench`` times and training runs: thousands of calls of
each op (exact-size, cached and fixed-size dispatch, combine) queued with no host sync between them but the
one an exact-size dispatch makes by design (it reads the counts that size its outputs), each call on the
next of ten input sets, its outputs fingerprinted on the device (`ep_moe.benchmarking.fingerprint`) and
compared at the end with the torch backend's on that set; with pushers, then with the copy engine.

Run on a machine with >= 2 NVLink-connected GPUs and a CUDA compiler (or a cache that ``ep-moe jit warmup``
filled): ``pytest -m gpu``. The kernels are `ep_moe.native.jit.intranode`'s (the copy engine in Python over the
driver API; the equality workers check that calls went through it).
``EP_MOE_TEST_WORLD`` sets the ranks (GPUs) of every test: 1 runs on one GPU (tests that need a peer skip,
saying why), 4 or 8 on more, e.g. ``EP_MOE_TEST_WORLD=8 pytest -m gpu tests/native/test_native_gpu.py``.
"""

from __future__ import annotations

import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import pytest
import torch
from support.bits import assert_bits_equal

from ep_moe import Config, native
from ep_moe.benchmarking.fingerprint import fingerprint_outputs
from ep_moe.config import NativeOptions
from ep_moe.distributed import run_distributed

pytestmark = pytest.mark.gpu

WORLD = int(os.environ.get("EP_MOE_TEST_WORLD", "2"))  # ranks (GPUs) of every test


def _need_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs")
    if not native.kernels_available():
        pytest.skip(f"no native kernels ({native.kernels_unavailable_reason()})")


def _check_kernels_used(before: dict | None = None) -> dict:
    """The JIT module's launch counters (compare two readings to see that calls went through it)."""
    from ep_moe.native.jit import intranode

    now = dict(intranode.LAUNCHES)
    if before is not None:
        assert now["notify"] > before["notify"] and now["dispatch"] > before["dispatch"], (before, now)
    return now


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


def on_device(device: torch.device, value):
    """``value`` (a tensor, a tuple of them, or anything else, returned as it is) with its tensors on ``device``:
    the same inputs for a reference `Buffer` on another device (the torch backend over gloo on the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(on_device(device, v) for v in value)
    return value


# ------------------------------------------------------------------------------------------ workers
def check_in_step(check: Callable[[], object], side_group, rank: int, label: str) -> None:
    """Run ``check()`` on every rank, which then all stop at the same case: raises on every rank when it failed on
    any, with this rank's reason. The verdict travels over ``side_group`` (gloo, apart from the buffers' own
    collectives, so that it never pairs with a call a failing rank skipped); a failure goes to stderr at once, since
    a peer left waiting in a collective that the failing rank skipped only gives up at its timeout."""
    error = None
    try:
        check()
    except Exception as exc:
        error = exc
        print(f"[rank {rank}] {label}:\n{''.join(traceback.format_exception(exc))}", file=sys.stderr, flush=True)
    flag = torch.tensor([0 if error is None else 1])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=side_group)
    if int(flag):
        raise AssertionError(f"{label} failed on {'this rank' if error is not None else 'another rank'}") from error


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
    launches = _check_kernels_used()
    side_group = torch.distributed.new_group(backend="gloo")
    # The first use of each options value is a collective check: make them all now, so that a case failing
    # on one rank cannot leave the others waiting in one.
    for options in dict.fromkeys(_case_options(index) for index in range(num_cases)):
        nat.backend._env_for(options)
    for index in range(num_cases):
        options = _case_options(index)
        check_in_step(partial(_check_case, rank, world, index, nat, ref, options), side_group, rank,
                      f"case {index} {make_case(index)}")
    _check_kernels_used(launches)
    nat.barrier()
    nat.destroy()
    ref.destroy()
    return num_cases


def _check_case(rank: int, world: int, index: int, nat, ref, options: NativeOptions, case: dict | None = None
                ) -> None:
    """Case ``index`` (``case``, default `make_case`) on ``nat`` equals ``ref`` bit for bit: layout, fresh
    dispatch, combine and (every third index) cached dispatch. ``ref`` may live on another device (the CPU): it
    gets copies of the inputs."""
    device = nat.device
    case = make_case(index) if case is None else case
    data, idx, weights = make_inputs(case, rank, world, device, seed=index)
    x = data[0] if isinstance(data, tuple) else data
    worst = 0
    if case["worst"]:
        worst = world * max(case["tokens"], 1) + 5
    config = Config(num_sms=case["num_sms"], native=options)  # the torch backend ignores the options
    label = f"case {index} {case}"
    # layout kernel equals the torch layout
    from ep_moe.buffer.routing_layout import dispatch_layout
    lay_ref = dispatch_layout(idx, case["experts"], world)
    lay_nat = nat.backend.get_dispatch_layout(idx, case["experts"])
    for name, a, b in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"), lay_nat, lay_ref):
        assert_bits_equal(a, b, f"{label} layout {name}", on_host=True)
    per_rank, _, per_expert, in_rank, _ = nat.get_dispatch_layout(idx, case["experts"])
    outs = []
    for buf in (nat, ref):
        on = buf.device
        outs.append(buf.dispatch(on_device(on, data), num_tokens_per_rank=on_device(on, per_rank),
                                 is_token_in_rank=on_device(on, in_rank), num_tokens_per_expert=on_device(on, per_expert),
                                 topk_idx=on_device(on, idx), topk_weights=on_device(on, weights),
                                 expert_alignment=case["alignment"], num_worst_tokens=worst, config=config))
    (rx_n, ri_n, rw_n, cnt_n, h_n, _), (rx_r, ri_r, rw_r, cnt_r, h_r, _) = outs
    if isinstance(rx_n, tuple):
        assert_bits_equal(rx_n[0], rx_r[0], f"{label} recv_x", on_host=True)
        assert_bits_equal(rx_n[1], rx_r[1], f"{label} recv_scales", on_host=True)
    else:
        assert_bits_equal(rx_n, rx_r, f"{label} recv_x", on_host=True)
    assert_bits_equal(ri_n, ri_r, f"{label} recv_topk_idx", on_host=True)
    assert_bits_equal(rw_n, rw_r, f"{label} recv_topk_weights", on_host=True)
    assert cnt_n == cnt_r, f"{label} counts {cnt_n} != {cnt_r}"
    assert_bits_equal(h_n.rank_prefix_matrix, h_r.rank_prefix_matrix, f"{label} rank_prefix_matrix", on_host=True)
    assert_bits_equal(h_n.recv_src_idx, h_r.recv_src_idx, f"{label} recv_src_idx", on_host=True)
    assert_bits_equal(h_n.recv_src_rank, h_r.recv_src_rank, f"{label} recv_src_rank", on_host=True)
    assert h_n.num_recv_tokens == h_r.num_recv_tokens

    # combine: y in the dispatch dtype (bf16 for FP8), weights, optional biases of either dtype
    rows = rx_r[0].shape[0] if isinstance(rx_r, tuple) else rx_r.shape[0]
    y, bias = make_combine_inputs(case, rows, x.shape[0], rank, device, seed=index)
    c_n, cw_n, _ = nat.combine(y, h_n, topk_weights=rw_n, bias=bias, config=config)
    c_r, cw_r, _ = ref.combine(on_device(ref.device, y), h_r, topk_weights=rw_r, bias=on_device(ref.device, bias),
                               config=config)
    assert_bits_equal(c_n, c_r, f"{label} combined", on_host=True)
    assert_bits_equal(cw_n, cw_r, f"{label} combined_weights", on_host=True)

    # cached dispatch of fresh data with the same layout
    if index % 3 == 0:
        data2, _, _ = make_inputs(case, rank, world, device, seed=index + 100_000)
        cx_n = nat.dispatch(data2, handle=h_n, config=config)[0]
        cx_r = ref.dispatch(on_device(ref.device, data2), handle=h_r, config=config)[0]
        if isinstance(cx_n, tuple):
            assert_bits_equal(cx_n[0], cx_r[0], f"{label} cached recv_x", on_host=True)
            assert_bits_equal(cx_n[1], cx_r[1], f"{label} cached recv_scales", on_host=True)
        else:
            assert_bits_equal(cx_n, cx_r, f"{label} cached recv_x", on_host=True)


GRAPH_EXPERTS, GRAPH_TOPK = 64, 4


def _routed_inputs(seed: int, rank: int, device: torch.device, tokens: int, hidden: int):
    """``(x [tokens, hidden] bf16, topk_idx, topk_weights)``, top-`GRAPH_TOPK` of `GRAPH_EXPERTS`, from ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed * 13 + rank)
    idx = torch.rand(tokens, GRAPH_EXPERTS, generator=g, device=device).topk(GRAPH_TOPK, 1).indices
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    w = torch.rand(tokens, GRAPH_TOPK, generator=g, device=device)
    return x, idx, w


def check_graph_replays(buf, ref, rank: int, world: int, hidden: int = 2048, tokens: int = 256,
                        replays: int = 3) -> None:
    """A fixed-size dispatch + combine on ``buf`` captured in one CUDA graph, replayed on ``replays`` new input
    sets, each equal bit for bit to ``ref`` (the torch backend, on this GPU or the CPU) on the same inputs."""
    device = torch.device("cuda", torch.cuda.current_device())
    experts = GRAPH_EXPERTS
    worst = world * tokens

    def inputs(seed):
        return _routed_inputs(seed, rank, device, tokens, hidden)

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
    for seed in range(1, replays + 1):
        x, idx, w = inputs(seed)
        static_x.copy_(x)
        static_idx.copy_(idx)
        static_w.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        r_x, r_idx, r_w, _, r_h, _ = ref.dispatch(on_device(ref.device, x), topk_idx=on_device(ref.device, idx),
                                                  topk_weights=on_device(ref.device, w), num_worst_tokens=worst,
                                                  num_experts=experts)
        assert_bits_equal(g_recv_x, r_x, f"graph replay {seed} recv_x", on_host=True)
        assert_bits_equal(g_recv_idx, r_idx, f"graph replay {seed} recv_topk_idx", on_host=True)
        r_c, r_cw, _ = ref.combine(r_x, r_h, topk_weights=r_w)
        assert_bits_equal(g_combined, r_c, f"graph replay {seed} combined", on_host=True)
        assert_bits_equal(g_combined_w, r_cw, f"graph replay {seed} combined_weights", on_host=True)
    del graph


def _graph_and_soak_worker(rank: int, world: int, iterations: int) -> float:
    from ep_moe import Buffer

    device = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(backend="native")
    ref = Buffer(backend="torch")
    experts, tokens = GRAPH_EXPERTS, 256
    check_graph_replays(buf, ref, rank, world, 2048, tokens)

    # Long run, exact mode (host sync per dispatch): no growth of allocated GPU memory, with pushers for
    # half the iterations and the copy engine (dispatch and combine) for the other half.
    x, idx, w = _routed_inputs(99, rank, device, tokens, 2048)
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
    assert_bits_equal(combined, r_c, "soak combined", on_host=True)
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


def _rank0_notify_times_out(rank: int, x, idx, w) -> str:
    """After a dispatch together, the other ranks skip a dispatch: rank 0 must time out in the count exchange
    (the host waits there) with a `NativeTimeoutError` naming rank 0, the stage and the channel, and refuse
    further work. Returns rank 0's message ('' on the others)."""
    from ep_moe import Buffer
    from ep_moe.backends.native_backend import NativeTimeoutError

    # One dispatch together first: the first call sizes the symmetric buffer, collectively.
    buf = Buffer(backend="native", timeout_s=2.0)
    buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=16)
    text = ""
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
    else:
        time.sleep(4.0)  # keep this rank's buffer alive while rank 0 writes into it and times out
    buf.destroy()
    return text


def timeout_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [64, 1024] bf16, topk_idx (top-2 of 16), topk_weights)`` of the forced-timeout checks."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(64, 1024, device=device).to(torch.bfloat16)
    idx = torch.rand(64, 16, device=device).topk(2, 1).indices
    w = torch.rand(64, 2, device=device)
    return x, idx, w


def _timeout_worker(rank: int, world: int) -> str:
    x, idx, w = timeout_inputs()
    # 1) rank 1 skips a dispatch: rank 0 times out in the count exchange.
    messages = [_rank0_notify_times_out(rank, x, idx, w)]
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


# ------------------------------------------------------------------------------------------ back-to-back soak
# The soak's input sets: random routings and adversarial ones (no expert at all, one expert, one rank's
# experts so that the others receive nothing, a rank without tokens)
SOAK_ROUTINGS = ("random", "random", "random_gaps", "none", "one_expert", "one_rank", "rank0_empty", "skewed",
                 "random", "random_gaps")


def make_soak_case(index: int) -> dict:
    """The shape of the soak's set ``index`` (the same on every rank): routing ``SOAK_ROUTINGS[index]``, BF16
    rows and FP8 pairs in turn, hidden a multiple of 128 (the FP8 scales' block), 256-1024 tokens per rank,
    and its own top-k, experts, alignment, biases and SM count."""
    rng = random.Random(1000 + index)
    return dict(
        routing=SOAK_ROUTINGS[index], dtype=("bf16", "fp8")[index % 2], hidden=rng.choice([1024, 1152, 1536, 2048]),
        tokens=rng.choice([256, 384, 777, 1000, 1024]), topk=rng.choice([1, 2, 4, 6, 8]),
        experts=rng.choice([8, 16, 64, 256]), alignment=rng.choice([1, 1, 8, 128]), bias=rng.choice([0, 1, 2]),
        uneven=rng.random() < 0.5, num_sms=rng.choice([2, 8, 16, 24, 33]))


# "dispatch": exact-size fresh dispatch (layout tensors given); "fixed": fresh dispatch with num_worst_tokens
# (layout computed in the call); "cached"/"cached_fixed": cached dispatch of other rows through the set's
# latest exact/fixed handle; "combine"/"combine_fixed": combine (weights, the set's biases) through that
# handle, whose padding rows (fixed) hold random rows that must be ignored.
SOAK_OPS = ("dispatch", "cached", "combine", "fixed", "cached_fixed", "combine_fixed")
SOAK_ITERATIONS = 2000  # calls of each op in its own phase, and rounds of the interleaved phase
# In a sync-free phase the device sleeps before every SOAK_BURST calls, for about half the time the host took
# to queue the previous ones (1e9 cycles per second: the H200 runs at ~2 GHz; at most 0.05 s), so that the
# calls queued meanwhile run back to back, and it catches up within the burst (the queue stays short).
SOAK_BURST = 32


class _Outputs(NamedTuple):
    """What one call returned, as compared: the names of its device outputs and of its host values, the
    device outputs' fingerprints (a device tensor in the loop, a list once read) and the host values."""

    device_names: tuple[str, ...]
    host_names: tuple[str, ...]
    device: torch.Tensor | list[int] | None
    host: tuple


def _soak_options(copy_engine: bool, index: int) -> NativeOptions:
    """Set ``index``'s options: pushers or the copy engine, in turn on one side stream or two, with the flag
    writes on a stream of their own or not, and the combine's reducers on bulk copies or in registers."""
    return _copy_engine_options(copy_engine, 1 + index % 2, (index // 2) % 2 == 1, ("on", "off")[(index // 4) % 2])


def _soak_call(buf, op: str, soak: dict, handles: dict):
    """``op`` (one of `SOAK_OPS`) on ``buf`` with the inputs of set ``soak``; ``handles``: the set's latest
    "dispatch" and "fixed" handles on ``buf``."""
    config = soak["config"]
    if op in ("dispatch", "fixed"):
        return buf.dispatch(soak["data"], **soak[op], config=config)
    handle = handles["fixed" if op.endswith("fixed") else "dispatch"]
    if op.startswith("cached"):
        return buf.dispatch(soak["cached_data"], handle=handle, config=config)
    y, weights, bias = soak[op]
    return buf.combine(y, handle, topk_weights=weights, bias=bias, config=config)


def _soak_outputs(op: str, result, device: torch.device) -> _Outputs:
    """The outputs of ``op``'s ``result`` by name, fingerprinted on ``device`` (queued, no host read). The
    handle is compared by the fields both backends fill alike (not the native backend's route)."""
    if op.startswith("combine"):
        named = [("combined_x", result[0]), ("combined_topk_weights", result[1])]
    else:
        recv_x = result[0]
        named = ([("recv_x", recv_x[0]), ("recv_scales", recv_x[1])] if isinstance(recv_x, tuple)
                 else [("recv_x", recv_x)])
        if not op.startswith("cached"):
            _, recv_idx, recv_w, counts, handle, _ = result
            named += [("recv_topk_idx", recv_idx), ("recv_topk_weights", recv_w),
                      ("num_recv_tokens_per_expert_list", counts),
                      ("rank_prefix_matrix", handle.rank_prefix_matrix), ("recv_src_idx", handle.recv_src_idx),
                      ("recv_src_rank", handle.recv_src_rank), ("num_recv_tokens", handle.num_recv_tokens),
                      ("num_worst_tokens", handle.num_worst_tokens)]
    return _Outputs(*fingerprint_outputs(dict(named), device))


def _prepare_soak_set(index: int, rank: int, world: int, ref, copy_engine: bool) -> tuple[dict, dict]:
    """Set ``index`` on this rank: ``(the inputs of every op, {op: the outputs of ``ref``, the torch backend,
    on them, fingerprints read})``. Each combine takes the torch backend's received weights of its handle."""
    device = ref.device
    case = make_soak_case(index)
    data, idx, weights = make_inputs(case, rank, world, device, seed=50_000 + index)
    per_rank, _, per_expert, in_rank, _ = ref.get_dispatch_layout(idx, case["experts"])
    soak = dict(
        case=case, data=data, cached_data=make_inputs(case, rank, world, device, seed=150_000 + index)[0],
        config=Config(num_sms=case["num_sms"], native=_soak_options(copy_engine, index)),
        dispatch=dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=idx, topk_weights=weights, expert_alignment=case["alignment"]),
        fixed=dict(topk_idx=idx, topk_weights=weights, num_experts=case["experts"],
                   expert_alignment=case["alignment"], num_worst_tokens=world * case["tokens"] + 5))
    handles, expected = {}, {}
    for op in SOAK_OPS:
        result = _soak_call(ref, op, soak, handles)
        if op in ("dispatch", "fixed"):
            handles[op] = result[4]
            y, bias = make_combine_inputs(case, result[4].num_recv_rows, idx.shape[0], rank, device,
                                          seed=60_000 + 2 * index + (op == "fixed"))
            soak["combine" if op == "dispatch" else "combine_fixed"] = (y, result[2], bias)
        outputs = _soak_outputs(op, result, device)
        expected[op] = outputs._replace(device=outputs.device.tolist())
    return soak, expected


def _soak_phases(num_sets: int, iterations: int) -> list[tuple[str, bool, list[tuple[str, int, int]]]]:
    """The soak's phases, ``(name, sync_free, [(op, iteration, set)])``: one phase per op alone (the regime
    ``ep-moe bench`` times), then every op in turn per iteration (a training step's order), each rotating
    over the sets. ``sync_free``: no exact-size dispatch, so no call may wait for the device."""
    phases = [(op, op != "dispatch", [(op, i, i % num_sets) for i in range(iterations)]) for op in SOAK_OPS]
    phases.append(("interleaved", False, [(op, i, i % num_sets) for i in range(iterations) for op in SOAK_OPS]))
    return phases


def _run_soak(buf, sets: list[dict], phases, expected: dict, handles: list[dict]) -> tuple[torch.Tensor, list]:
    """Make every call of ``phases`` on ``buf``, queued back to back: after each call its fingerprints go into
    one preallocated device tensor (row ``i``: call ``i``), and nothing is read on the host (an exact-size
    dispatch reads its counts there by design: they size its outputs). In a sync-free phase on a GPU the
    device sleeps before every `SOAK_BURST` calls, so that the host queues calls ahead of it, and torch raises
    on any synchronizing call it sees (its sync debug mode; not every sync is covered). A dispatch's handle
    replaces its set's handle of that kind in ``handles``, for the set's later cached dispatches and
    combines. Returns the tensor and each call's `_Outputs` without fingerprints."""
    device = buf.device
    cuda = device.type == "cuda"
    width = max(len(outputs.device_names) for outputs in expected.values())
    store = torch.zeros(sum(len(calls) for _, _, calls in phases), width, dtype=torch.int64, device=device)
    recorded = []
    burst_start = time.perf_counter()
    for _, sync_free, calls in phases:
        if sync_free and cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            for op, iteration, index in calls:
                if sync_free and cuda and iteration % SOAK_BURST == 0:
                    now = time.perf_counter()
                    torch.cuda._sleep(int(min(now - burst_start, 0.05) * 1e9))
                    burst_start = now
                result = _soak_call(buf, op, sets[index], handles[index])
                if op in ("dispatch", "fixed"):
                    handles[index][op] = result[4]
                outputs = _soak_outputs(op, result, device)
                fingerprints = outputs.device[:width]
                store[len(recorded), :fingerprints.numel()].copy_(fingerprints)
                recorded.append(outputs._replace(device=None))
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return store, recorded


def _soak_mismatches(phases, recorded: list[_Outputs], fingerprints: list[list[int]], expected: dict) -> list[str]:
    """One line per phase, op, set and set of differing outputs, with every iteration where they differ."""
    groups: dict[tuple, list[int]] = {}
    calls = [call for _, _, phase_calls in phases for call in phase_calls]
    phase_of = [name for name, _, phase_calls in phases for _ in phase_calls]
    for phase, (op, iteration, index), got, row in zip(phase_of, calls, recorded, fingerprints, strict=True):
        want = expected[(op, index)]
        if (got.device_names, got.host_names) != (want.device_names, want.host_names):
            differing = (f"outputs {got.device_names + got.host_names} instead of "
                         f"{want.device_names + want.host_names}",)
        else:
            differing = tuple(name for name, a, b in zip(want.device_names, row, want.device) if a != b)
            differing += tuple(name for name, a, b in zip(want.host_names, got.host, want.host) if a != b)
        if differing:
            groups.setdefault((phase, op, index, differing), []).append(iteration)
    lines = []
    for (phase, op, index, differing), iterations in groups.items():
        case = make_soak_case(index)
        lines.append(f"phase {phase}: {op} on set {index} ({case['routing']} {case['dtype']} H{case['hidden']}): "
                     f"{', '.join(differing)} at iteration{'s' if len(iterations) > 1 else ''} "
                     f"{', '.join(map(str, iterations))}")
    return lines


def _soak(nat, ref, rank: int, world: int, copy_engine: bool, iterations: int
          ) -> tuple[dict[str, int], float, list[str]]:
    """The back-to-back soak of ``nat`` on this rank, every call compared with the fingerprints of ``ref``
    (the torch backend on the same group) for the same set: ``(calls checked per op, seconds after the
    warm-up, the mismatches)``. The warm-up (every op once per set, host syncs allowed) sizes the symmetric
    buffer and makes each set's handles."""
    sets, expected = [], {}
    for index in range(len(SOAK_ROUTINGS)):
        soak, outputs = _prepare_soak_set(index, rank, world, ref, copy_engine)
        sets.append(soak)
        expected.update({(op, index): value for op, value in outputs.items()})
    handles = [{} for _ in sets]
    warm_up = [("warm-up", False, [(op, index, index) for index in range(len(sets)) for op in SOAK_OPS])]
    store, recorded = _run_soak(nat, sets, warm_up, expected, handles)
    mismatches = _soak_mismatches(warm_up, recorded, store.tolist(), expected)
    phases = _soak_phases(len(sets), iterations)
    start = time.perf_counter()
    store, recorded = _run_soak(nat, sets, phases, expected, handles)
    fingerprints = store.tolist()  # the one host read
    seconds = time.perf_counter() - start
    mismatches += _soak_mismatches(phases, recorded, fingerprints, expected)
    checked = {op: sum(call[0] == op for _, _, calls in warm_up + phases for call in calls) for op in SOAK_OPS}
    return checked, seconds, mismatches


def _soak_worker(rank: int, world: int, copy_engine: bool, iterations: int) -> tuple[dict[str, int], float]:
    from ep_moe import Buffer

    # check_inputs=False: the expert-id range check reads two numbers on the host, a sync per call
    nat = Buffer(backend="native", timeout_s=20.0, check_inputs=False)
    ref = Buffer(backend="torch")
    assert nat.backend_name == "native", nat.backend_name
    for index in range(len(SOAK_ROUTINGS)):  # each options value's first use is a collective check: all now
        nat.backend._env_for(_soak_options(copy_engine, index))
    checked, seconds, mismatches = _soak(nat, ref, rank, world, copy_engine, iterations)
    nat.barrier()
    nat.destroy()
    ref.destroy()
    assert not mismatches, (f"rank {rank}: calls whose outputs differ from the torch backend's on the same set "
                            f"({'copy engine' if copy_engine else 'pushers'}):\n" + "\n".join(mismatches))
    return checked, seconds


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


@pytest.mark.parametrize("path", ["pushers", "copy_engine"])
def test_back_to_back_soak_checks_every_call(path):
    _need_gpus()
    if path == "copy_engine" and WORLD < 2:
        pytest.skip("the copy engine carries rows between ranks, so it needs two or more ranks "
                    "(EP_MOE_TEST_WORLD >= 2); on one rank every call copies locally, as the 'pushers' case soaks")
    results = run_distributed(_soak_worker, WORLD, path == "copy_engine", SOAK_ITERATIONS, backend="nccl",
                              timeout_s=300, join_timeout_s=900)
    checked, _ = results[0]
    print(f"back-to-back soak ({path}, {WORLD} rank{'s' if WORLD > 1 else ''}): calls checked per op "
          f"{', '.join(f'{op} {count}' for op, count in checked.items())}; "
          f"{max(seconds for _, seconds in results):.1f} s after the warm-up")
