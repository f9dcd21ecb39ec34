"""Host time of a JIT kernel launch, without a GPU: `driver.Function.launch` and the expert-major launchers of
`ep_moe.native.jit.expert_major` (argument choice, output allocation, specialization lookup, packing) with
``cuLaunchKernel`` replaced by a C function that does nothing (libc's ``isalpha``, through the same ctypes call),
on CPU tensors.

    python3 benchmarks/jit_launch_overhead.py [--calls 20000]

Prints microseconds per call, the median of 5 rounds. What it leaves out: the driver's own launch cost and the
CUDA caching allocator (CPU tensors here); `benchmarks/jit_bench.py` measures the whole host time on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import timeit

import torch

from ep_moe.native.jit import expert_major as J
from ep_moe.native.jit.driver import Function


def no_op_launch():
    fn = ctypes.CDLL(None).isalpha  # int isalpha(int): the handle (0) is its argument, it returns 0
    fn.restype = ctypes.c_int
    return fn


def per_call_us(fn, calls: int) -> float:
    return statistics.median(timeit.repeat(fn, number=calls, repeat=5)) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    launch = no_op_launch()
    bare_args = (ctypes.c_void_p(0), 4096, 1, 1, 256, 1, 1, 0, ctypes.c_void_p(0), None, None)
    print(f"bare ctypes call (11 arguments):        {per_call_us(lambda: launch(*bare_args), args.calls):6.2f} us")
    f7 = Function(0, "k7", J._PERMUTE_SIG, launch_fn=launch)
    a7 = (1 << 40, 2 << 40, 3 << 40, 32768, 32768, 4 << 40, 5 << 40)
    print(f"Function.launch, 7 arguments:           {per_call_us(lambda: f7.launch(4096, 256, 0, *a7), args.calls):6.2f} us")
    f13 = Function(0, "k13", J._LAYOUT_SIG, launch_fn=launch)
    a13 = tuple(range(1, 14))
    print(f"Function.launch, 13 arguments:          {per_call_us(lambda: f13.launch(1, 256, 0, *a13), args.calls):6.2f} us")

    functions: dict = {}

    def fake_function(file, defines, name, signature, device):
        key = (file, defines, name)
        if key not in functions:
            functions[key] = Function(0, name, signature, launch_fn=launch)
        return functions[key]

    J._function, J._on, J._stream, J._device_of = (fake_function, lambda d: contextlib.nullcontext(),
                                                   lambda d: 0, lambda t: 0)
    T, H, K, L = 64, 64, 8, 32  # small: the host path does not depend on the sizes, CPU allocation would
    x, values = torch.empty(T, H, dtype=torch.bfloat16), torch.rand(T * K)
    pos = torch.arange(T * K)
    y, w = torch.empty(T * K, H, dtype=torch.bfloat16), torch.rand(T * K)
    srt = torch.arange(T * K).view(T, K)
    grad = torch.empty(T, H, dtype=torch.bfloat16)
    idx = torch.randint(0, L, (T, K))
    calls = {
        "expert_layout (4 launches)": lambda: J.expert_layout(idx, L, 16, T * K + L * 15),
        "permute_rows with values": lambda: J.permute_rows(x, pos, K, values),
        "unpermute_sum weighted": lambda: J.unpermute_sum(y, w, srt, None, None),
        "unpermute_sum_backward": lambda: J.unpermute_sum_backward(grad, y, w, pos, K, True, True),
    }
    for name, fn in calls.items():
        fn()
        print(f"{name + ':':<40}{per_call_us(fn, max(args.calls // 10, 100)):6.2f} us (CPU tensors)")


if __name__ == "__main__":
    main()
