"""Host time of a JIT kernel launch, without a GPU: `driver.Function.launch` and the expert-major launchers of
`ep_moe.native.jit.expert_major` (argument choice, output allocation, specialization lookup, packing) with
``cuLaunchKernel`` (and ``cuLaunchCooperativeKernel``) replaced by a C function that does nothing (libc's
``isalpha``, through the same ctypes call), on CPU tensors; the layout's ``cuMemsetD32Async`` goes to libc's
``llabs``, as ``--intranode``'s.

    python3 benchmarks/jit_launch_overhead.py [--calls 20000]
    python3 benchmarks/jit_launch_overhead.py --intranode [--calls 20000]
    python3 benchmarks/jit_launch_overhead.py --exchange-ops [--calls 20000]

Prints microseconds per call, the median of 5 rounds (``--intranode``, ``--exchange-ops``: the fastest of 9, in CPU time
of the thread). What it leaves out: the driver's own launch cost, the CUDA queries (``Tensor.is_pinned``) and the
CUDA caching allocator (CPU tensors here); `benchmarks/jit_bench.py` measures the whole host time on a GPU.

``--intranode``: the launchers of `ep_moe.native.jit.intranode` (layout, notify, fresh dispatch with top-k, cached
dispatch, combine with top-k weights) with the arguments the native backend passes (2 ranks; the CUDA checks,
pinned-memory mapping and stream lookup replaced by CPU stand-ins of the same shape that leave out ``is_cuda``),
each kernel a `driver.Function` whose launch is the same no-op C call, and the layout's ``cuMemsetD32Async`` a call of libc's
``llabs`` (its host path through `driver.memset_zero_async` is timed).

``--exchange-ops``: the four generic expert-major ops of `ep_moe.native.jit.expert_major_exchange` (received rows with
values, own rows weighted, routing map to top-k and its backward) on CPU tensors, the device check replaced by a
contiguity check and every kernel a `driver.Function` with the no-op launch; timed as ``--intranode``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import time
import timeit
import types

import torch

from ep_moe.native.jit import driver
from ep_moe.native.jit import expert_major as J
from ep_moe.native.jit.driver import Function


def no_op_launch():
    fn = ctypes.CDLL(None).isalpha  # int isalpha(int): the handle (0) is its argument, it returns 0
    fn.restype = ctypes.c_int
    return fn


def fake_memset_driver() -> None:
    """The layouts' memsets: their host path through `driver.memset_zero_async`, to libc's llabs (arithmetic only:
    an address is safe)."""
    libc = ctypes.CDLL(None)

    class _Driver:
        lib = types.SimpleNamespace(cuMemsetD32Async=libc.llabs)
        memset_d32_async = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t,
                                            ctypes.c_void_p)(("llabs", libc))

        def check(self, status: int, call: str) -> None:  # llabs returns no CUDA status
            pass

    driver._driver, driver._thread.device = _Driver(), 0


def per_call_us(fn, calls: int, best: bool = False) -> float:
    """Microseconds per call: the median of 5 rounds, or with ``best`` the fastest of 9 in this thread's CPU time
    (steadier on a loaded machine)."""
    rounds = timeit.repeat(fn, number=calls, repeat=9 if best else 5, timer=time.thread_time if best else
                           time.perf_counter)
    return (min(rounds) if best else statistics.median(rounds)) / calls * 1e6


def intranode(calls: int, launch) -> None:
    """Host time per call of the intranode launchers on CPU tensors (see the module docstring)."""
    from ep_moe.native.jit import expert_major_exchange
    from ep_moe.native.jit import intranode as I

    expert_major_exchange.kernels = lambda device: None  # what the Env loads for the fused paths (not timed)

    class _Kernels:
        fn = {name: Function(0, name, (), launch_fn=launch) for name in I.KERNELS}
        control_flags_offset = 0

    def check_cuda(t, name):
        if not t.is_contiguous():
            raise I._fail(f"argument '{name}' must be a contiguous CUDA tensor")

    def ptr(t, name):  # `_ptr`'s shape with the CUDA half of its check left out, as check_cuda
        if t is None:
            return 0
        if not t.is_contiguous():
            check_cuda(t, name)
        return t.data_ptr()

    def check_all(names, *tensors):  # likewise `_check_all`'s
        for t in tensors:
            if not t.is_contiguous():
                for u, name in zip(tensors, names):
                    check_cuda(u, name)
                return

    I.kernels, I._check_cuda, I._is_pinned, I._device = (lambda device: _Kernels), check_cuda, (lambda t: True), (
        lambda t: 0)
    if hasattr(I, "_check_all"):  # the launchers' inline checks (since 2026-12-02; before, all through _check_cuda)
        I._ptr, I._check_all = ptr, check_all
    I._raw_stream, I.host_device_pointer = (lambda device: 0), (lambda ptr, device: ptr)

    fake_memset_driver()
    R, T, H, K, L, N = 2, 64, 64, 8, 16, 96
    env = I.Env(0, [0x1000, 0x2000], torch.zeros(8, dtype=torch.int64),
                torch.zeros(I.ERROR_WORDS + I.MISMATCH_WORDS, dtype=torch.int32), 10**10, 8, 8, 4)
    ints = dict(dtype=torch.int32)
    header = [1, H, 2, 0, K, L * R, 0, 12345, 0, 0]
    idx = torch.randint(0, L * R, (T, K))
    notify = dict(is_token_in_rank=torch.zeros(T, R, dtype=torch.bool), num_tokens_per_rank=torch.zeros(R, **ints),
                  rank_prefix_matrix=torch.zeros(R, R, **ints), pos=torch.zeros(T, R, **ints),
                  send_list=torch.zeros(R, T, **ints), host_counts=torch.zeros(I._host_words(R), **ints),
                  num_worst_tokens=0, rows_capacity=R * T, topk_idx=idx, experts_per_rank=L, expert_alignment=16,
                  host_expert_counts=torch.zeros(L, dtype=torch.int64), header=header, test_perturb=None)
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    dispatch = dict(data_ptrs=[0x10000, 0x20000], offsets=[0, 100, 200, 300, 400],
                    rank_prefix_matrix=torch.zeros(R, R, **ints), send_list=torch.zeros(R, T, **ints), x=x,
                    scales=None, topk_idx=idx, topk_weights=torch.rand(T, K), experts_per_rank=L,
                    recv_x=torch.zeros(N, H, dtype=torch.bfloat16), recv_scales=None,
                    recv_topk_idx=torch.zeros(N, K, dtype=torch.int64), recv_topk_weights=torch.zeros(N, K),
                    recv_src_idx=torch.zeros(N, **ints), recv_src_rank=torch.zeros(N, **ints),
                    expert_scratch=torch.zeros(64, **ints), num_recv_per_expert=torch.zeros(L, dtype=torch.int64),
                    expert_alignment=1, rows_capacity=R * T, write_arrival=False, num_blocks=24, num_push_blocks=12,
                    trace=None, copy_engine_streams=[], copy_engine_flag_stream=0, copy_engine_seq=0,
                    copy_engine_go=None, copy_engine_shares=[], copy_engine_tokens=[], host_prefix=[],
                    cached_src_idx=None, header=header, test_perturb=None, rows_in_place=False)
    cached = {**dispatch, **{k: None for k in ("topk_idx", "topk_weights", "recv_topk_idx", "recv_topk_weights",
                                                "recv_src_idx", "recv_src_rank", "expert_scratch",
                                                "num_recv_per_expert")}, "write_arrival": True}
    combine = dict(data_ptrs=[0x10000, 0x20000], off_y=0, off_weights=4096, rows_capacity=R * T,
                   rank_prefix_matrix=torch.zeros(R, R, **ints), is_token_in_rank=torch.zeros(T, R, dtype=torch.bool),
                   pos=torch.zeros(T, R, **ints), y=torch.zeros(N, H, dtype=torch.bfloat16), weights=torch.rand(N, K),
                   bias0=None, bias1=None, out=torch.zeros(T, H, dtype=torch.bfloat16), out_weights=torch.zeros(T, K),
                   num_blocks=24, num_push_blocks=12, trace=None, copy_engine_streams=[], copy_engine_flag_stream=0,
                   copy_engine_seq=0, copy_engine_go=None, copy_engine_shares=[], host_prefix=[], bulk_reduce=False,
                   header=header, test_perturb=None, expert_y=None, expert_weights=None, sorted_slots=None)
    runs = {
        "layout (3 outputs allocated)": lambda: I.layout(idx, L * R, R),
        "notify (with expert counts)": lambda: I.notify(env, **notify),
        "dispatch, fresh with top-k": lambda: I.dispatch(env, **dispatch),
        "dispatch, cached": lambda: I.dispatch(env, **cached),
        "combine with top-k weights": lambda: I.combine(env, **combine),
    }
    for name, fn in runs.items():
        fn()
        print(f"intranode {name + ':':<30}{per_call_us(fn, max(calls // 10, 100), best=True):6.2f} us (CPU tensors)")


def exchange_ops(calls: int, launch) -> None:
    """Host time per call of `expert_major_exchange`'s ops on CPU tensors (see the module docstring)."""
    from ep_moe.native.jit import expert_major_exchange as E
    from ep_moe.native.jit import launch_args

    class _Kernels:
        fn = {fragment: Function(0, fragment, (), launch_fn=launch) for fragment in E.KERNELS.values()}

    def check(t, op, name, device):
        if not t.is_contiguous():
            raise E.fail(f"argument '{name}' must be contiguous", op)

    E.kernels, E.device_index, E.raw_stream = (lambda device: _Kernels), (lambda t: 0), (lambda device: 0)
    E.check_on = launch_args.check_on = check
    T, H, K, L = 64, 64, 8, 32  # small: the host path does not depend on the sizes, CPU allocation would
    N = 2 * T
    prefix = torch.tensor([[T, T], [N, N]], dtype=torch.int32)
    rows, own_x = torch.zeros(N, H, dtype=torch.bfloat16), torch.zeros(T, H, dtype=torch.bfloat16)
    own_tokens = torch.arange(T, dtype=torch.int32)
    pair_of_slot = torch.arange(N * K)
    values = torch.rand(N * K)
    y, w = torch.zeros(N * K, H, dtype=torch.bfloat16), torch.rand(N * K)
    sorted_slots = torch.arange(N * K).view(N, K)
    routing_map = torch.zeros(T, L, dtype=torch.bool)
    probs = torch.zeros(T, L, dtype=torch.bfloat16)
    topk_idx, grad_w = torch.zeros(T, K, dtype=torch.int64), torch.rand(T, K)
    runs = {
        "permute_received_rows": lambda: E.permute_received_rows(rows, N, own_x, own_tokens, prefix, 1, pair_of_slot,
                                                                 K, values),
        "unpermute_own_rows": lambda: E.unpermute_own_rows(y, w, sorted_slots, prefix, 1),
        "routing_map_to_topk": lambda: E.routing_map_to_topk(routing_map, probs, K),
        "routing_map_to_topk_backward": lambda: E.routing_map_to_topk_backward(grad_w, topk_idx, L, torch.bfloat16),
    }
    for name, fn in runs.items():
        fn()
        print(f"exchange {name + ':':<32}{per_call_us(fn, max(calls // 10, 100), best=True):6.2f} us (CPU tensors)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--intranode", action="store_true", help="the intranode launchers instead")
    parser.add_argument("--exchange-ops", action="store_true", help="expert_major_exchange's four ops instead")
    args = parser.parse_args()
    launch = no_op_launch()
    if args.exchange_ops:
        exchange_ops(args.calls, launch)
        return
    if args.intranode:
        intranode(args.calls, launch)
        return
    bare_args = (ctypes.c_void_p(0), 4096, 1, 1, 256, 1, 1, 0, ctypes.c_void_p(0), None, None)
    print(f"bare ctypes call (11 arguments):        {per_call_us(lambda: launch(*bare_args), args.calls):6.2f} us")
    f7 = Function(0, "k7", J._PERMUTE_SIG, launch_fn=launch)
    a7 = (1 << 40, 2 << 40, 3 << 40, 32768, 32768, 4 << 40, 5 << 40)
    print(f"Function.launch, 7 arguments:           {per_call_us(lambda: f7.launch(4096, 256, 0, *a7), args.calls):6.2f} us")
    f15 = Function(0, "k15", J._LAYOUT_SIG, launch_fn=launch, cooperative_fn=launch)
    a15 = tuple(range(1, 16))
    print(f"Function.launch_cooperative, 15 args:   "
          f"{per_call_us(lambda: f15.launch_cooperative(1, 256, 0, *a15), args.calls):6.2f} us")

    functions: dict = {}

    def fake_function(file, defines, name, signature, device):
        key = (file, defines, name)
        if key not in functions:
            functions[key] = Function(0, name, signature, launch_fn=launch, cooperative_fn=launch)
        return functions[key]

    J._function, J._on, J.raw_stream, J.device_index = (fake_function, lambda d: contextlib.nullcontext(),
                                                        lambda d: 0, lambda t: 0)
    if hasattr(J, "_resident_blocks"):  # the cooperative layout (since 2026-12-02): occupancy and memset
        J._resident_blocks = lambda fn, device: 264
        fake_memset_driver()
    T, H, K, L = 64, 64, 8, 32  # small: the host path does not depend on the sizes, CPU allocation would
    x, values = torch.empty(T, H, dtype=torch.bfloat16), torch.rand(T * K)
    pos = torch.arange(T * K)
    y, w = torch.empty(T * K, H, dtype=torch.bfloat16), torch.rand(T * K)
    srt = torch.arange(T * K).view(T, K)
    grad = torch.empty(T, H, dtype=torch.bfloat16)
    idx = torch.randint(0, L, (T, K))
    calls = {
        "expert_layout (fixed size)": lambda: J.expert_layout(idx, L, 16, T * K + L * 15),
        "permute_rows with values": lambda: J.permute_rows(x, pos, K, values),
        "unpermute_sum weighted": lambda: J.unpermute_sum(y, w, srt, None, None),
        "unpermute_sum_backward": lambda: J.unpermute_sum_backward(grad, y, w, pos, K, True, True),
    }
    for name, fn in calls.items():
        fn()
        print(f"{name + ':':<40}{per_call_us(fn, max(args.calls // 10, 100)):6.2f} us (CPU tensors)")


if __name__ == "__main__":
    main()
