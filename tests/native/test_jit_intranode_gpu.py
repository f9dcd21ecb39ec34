"""The intranode kernels through the JIT layer (`ep_moe.native.jit.intranode`) on one GPU: the struct-layout probe
(the ctypes mirrors of kernels.h and the launchers' constants equal what the compiler sees on the device), the layout
kernel bit for bit the torch layout, and one-rank dispatch / cached dispatch / combine through a
``Buffer(backend="native")`` that runs on the JIT module (checked by its launch counters), bit for bit the torch
backend. The full native suite on one GPU:
``EP_MOE_TEST_WORLD=1 python3 -m pytest -m gpu tests/native/test_native_gpu.py``.

Needs one GPU and a CUDA compiler (NVRTC or nvcc): ``pytest -m gpu tests/native/test_jit_intranode_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from support.bits import assert_bits_equal

from ep_moe import native
from ep_moe.distributed import run_distributed
from ep_moe.native import jit
from ep_moe.native.jit import intranode as I
from ep_moe.native.jit import params as P
from ep_moe.native.jit.driver import PTR
from ep_moe.native.jit.layout_probe import read_back

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and not jit.available(),
                                 reason=f"JIT kernels cannot run here ({jit.unavailable_reason()})")]


def test_struct_layout_probe_equals_the_mirrors():
    """The probe kernel's sizeof/offsetof of every mirrored field and the constants kernel's values, read back from
    the device, equal ctypes' layout and `CONSTANTS` (the first use checks the same and would have raised)."""
    loaded = I.kernels(0)  # compiles, loads, and checks once
    assert set(loaded.fn) == set(I.KERNELS)
    probe = jit.module(jit.KernelSource.of(I.probe_file()), 0).function("ep_params_layout", (PTR,))
    layout = read_back(probe, len(P.layout_of()), 0)
    assert layout == [value for _, value in P.layout_of()], P.layout_mismatches(layout)
    constants = read_back(jit.module(I.SOURCE, 0).function("ep_intranode_constants", (PTR,)),
                         len(P.CONSTANTS), 0)
    assert P.constant_mismatches(constants) == []
    print("compiled or loaded:", [(e.label, e.how, round(e.seconds, 3)) for e in jit.history()
                                  if "intranode" in e.label or "params_layout" in e.label])


@pytest.mark.parametrize("tokens, topk, experts, ranks", [(0, 8, 64, 8), (1, 1, 8, 1), (4097, 8, 256, 8),
                                                          (300, 6, 9000, 2), (129, 2, 8, 4)])
def test_layout_kernel_equals_torch(tokens, topk, experts, ranks):
    from ep_moe.buffer.routing_layout import dispatch_layout

    g = torch.Generator(device="cuda").manual_seed(tokens + experts)
    idx = torch.rand(tokens, experts, generator=g, device="cuda").topk(topk, dim=1).indices
    idx = idx.masked_fill(torch.rand(idx.shape, generator=g, device="cuda") < 0.2, -1).to(torch.int64)
    got = I.layout(idx, experts, ranks)
    want = dispatch_layout(idx, experts, ranks)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _one_rank_worker(rank: int, world: int) -> dict:
    from ep_moe import Buffer, Config
    from ep_moe.config import NativeOptions

    assert native.kernels_available(), native.kernels_unavailable_reason()
    before = dict(I.LAUNCHES)
    nat = Buffer(backend="native", timeout_s=20.0)
    ref = Buffer(backend="torch")
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed(7)
    checked = 0
    for tokens, hidden, topk, experts, dtype, worst, bulk in (
            (128, 7168, 8, 64, torch.bfloat16, 0, "auto"), (4096, 2048, 6, 256, torch.bfloat16, 0, "on"),
            (7, 4096, 2, 8, torch.float32, 0, "off"), (513, 2048, 8, 32, torch.float32, 600, "on"),
            (0, 2048, 4, 8, torch.bfloat16, 0, "auto")):
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        idx = torch.rand(tokens, experts, generator=g, device=device).topk(topk, dim=1).indices.to(torch.int64)
        weights = torch.rand(tokens, topk, generator=g, device=device)
        config = Config(num_sms=24, native=NativeOptions(combine_bulk_reduce=bulk))
        outs = []
        for buf in (nat, ref):
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
            recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=weights, num_worst_tokens=worst, config=config)
            cached = buf.dispatch(x * 2, handle=handle, config=config)[0]
            y = (recv_x.float() * 0.5).to(dtype)
            bias = torch.ones(tokens, hidden, device=device, dtype=torch.float32)
            combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w, bias=bias, config=config)
            outs.append((recv_x, recv_idx, recv_w, cached, combined, combined_w, handle.rank_prefix_matrix))
        for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights", "cached recv_x", "combined",
                               "combined weights", "rank_prefix_matrix"), *outs):
            assert_bits_equal(a, b, f"{name} (tokens {tokens})")
        checked += 1
    nat.barrier()
    nat.destroy()
    ref.destroy()
    return {"checked": checked, **{k: I.LAUNCHES[k] - before[k] for k in I.LAUNCHES}}


def test_one_rank_buffer_runs_on_the_jit_module():
    result, = run_distributed(_one_rank_worker, 1, backend="nccl", timeout_s=120, join_timeout_s=600)
    assert result["checked"] == 5
    # the calls went through the JIT module (the layout kernel is not launched for 0 tokens)
    assert result["layout"] >= 4 and result["notify"] >= 5 and result["dispatch"] >= 10, result
    assert result["combine_bf16"] >= 3 and result["combine_fp32"] >= 2 and result["barrier"] == 1, result
