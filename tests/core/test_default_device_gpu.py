"""On one GPU, with CUDA inputs, ep_moe's native path gives the same outputs whatever the caller's defaults: under
``torch.set_default_device("cuda")`` (DeepEP's ``init_dist`` sets it; a pinned host tensor made without a device
then fails), ``"meta"`` (an implicit tensor fails the computation that reads it) and the default dtype float64:
`ep_moe.Buffer` (layout, dispatch fresh, fixed-size and cached, combine), `ep_moe.ElasticBuffer` (compact and
expanded, exact and fixed size, cached, combine) and `ep_moe.TokenDispatcher` (forward and backward), each equal bit
for bit (same device, dtype, shape and bytes) to the run without. The CPU counterpart is test_default_device.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.bits import assert_bits_equal
from test_default_device import _defaults, _leaves

from ep_moe import Buffer, ElasticBuffer, TokenDispatcher
from ep_moe.distributed import free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

T, H, K, E = 64, 256, 4, 8


def _inputs(device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(3)
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    idx[::5, 2] = -1
    x = torch.randn(T, H, generator=gen)
    return {"x": x.to(torch.bfloat16).to(device), "idx": idx.to(device),
            "w": torch.rand(T, K, generator=gen).to(device)}


def _run(inp: dict) -> list:
    out = []
    buffer = Buffer(None, backend="auto", timeout_s=30)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["idx"], E)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        inp["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=inp["idx"], topk_weights=inp["w"], expert_alignment=4)
    out += [buffer.backend_name, per_rank, per_expert, in_rank, recv_x, recv_idx, recv_w, counts,
            buffer.dispatch(inp["x"] * 2, handle=handle)[0], buffer.combine(recv_x, handle, topk_weights=recv_w)[:2],
            buffer.dispatch(inp["x"], topk_idx=inp["idx"], topk_weights=inp["w"], num_experts=E,
                            num_worst_tokens=T)[:4]]
    buffer.destroy()
    eb = ElasticBuffer(None, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)
    for expand in (False, True):
        for sync in (True, False):
            rx, ridx, rw, h, _ = eb.dispatch(inp["x"], inp["idx"], inp["w"], num_experts=E, expert_alignment=8,
                                             do_cpu_sync=sync, do_expand=expand)
            cached = eb.dispatch(inp["x"], handle=h)[0]
            out += [rx, ridx, rw, cached, h.recv_src_metadata, h.dst_buffer_slot_idx,
                    eb.combine(rx.float().to(rx.dtype), h, bias=(inp["x"], inp["x"]))[:2]]
    eb.destroy()
    buffer = Buffer(None, backend="auto", timeout_s=30)
    dispatcher = TokenDispatcher(buffer, E, expert_alignment=8)
    x, w = inp["x"].float().requires_grad_(), inp["w"].clone().requires_grad_()
    expert_x, probs, counts, ctx = dispatcher.dispatch(x, inp["idx"], w)
    y = dispatcher.combine(expert_x * 3, ctx, probs)
    y.square().sum().backward()
    out += [expert_x, probs, counts, ctx.tokens_per_expert_host, y, x.grad, w.grad]
    buffer.destroy()
    return out


def _check_same(got: list, want: list, variant: str) -> None:
    a, b = _leaves(got), _leaves(want)
    assert len(a) == len(b), (variant, len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(y, torch.Tensor):
            assert_bits_equal(x, y, f"under {variant}: output {i}")
            assert x.device == y.device, f"under {variant}: output {i} is on {x.device}, expected {y.device}"
        else:
            assert x == y, (variant, i, x, y)


def test_native_path_ignores_the_callers_defaults():
    device = torch.device("cuda", torch.cuda.current_device())
    # NCCL, as DeepEP's programs: a gloo group runs ep_moe on the CPU (unless EP_MOE_SYMMETRIC_MEMORY=vmm)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=device)
    try:
        inp = _inputs(device)
        want = _run(inp)
        for variant in ("cuda", "meta", "float64"):
            with _defaults(variant):
                got = _run(inp)
            _check_same(got, want, variant)
    finally:
        dist.destroy_process_group()
