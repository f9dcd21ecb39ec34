"""`ElasticBuffer` PP and AGRS over NCCL on real GPUs (the torch transport, which both backends use): at 1 rank
(loopback PP, one-rank sessions) on one GPU, and the ring / all-gather / reduce-scatter at 2 ranks where 2 GPUs
exist. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ep_moe import ElasticBuffer
from ep_moe.distributed import run_distributed

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _pp_and_agrs(rank: int, world: int, backend: str) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    eb = ElasticBuffer(num_bytes=64 * MiB, backend=backend, explicitly_destroy=True, num_gpu_timeout_secs=60)
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    eb.pp_set_config(4 * MiB, 3)
    checked = 0
    for rnd in range(3):
        sent = []
        for k, (dtype, shape) in enumerate([(torch.bfloat16, (512, 1024)), (torch.float32, (7,)),
                                            (torch.int64, (3, 5))]):
            x = (torch.arange(torch.Size(shape).numel(), device=dev) * (rank + 1) + 100 * rnd + k).to(dtype)
            eb.pp_send(x.view(shape), nxt)
            sent.append((dtype, shape))
        for k, (dtype, shape) in enumerate(sent):
            out = torch.empty(shape, dtype=dtype, device=dev)
            eb.pp_recv(out, prev)
            want = (torch.arange(torch.Size(shape).numel(), device=dev) * (prev + 1) + 100 * rnd + k).to(dtype)
            assert torch.equal(out.view(-1), want), (rnd, k)
            checked += 1
    eb.agrs_set_config(16 * MiB, 4)
    for session in range(2):
        eb.create_agrs_session()
        inplace = eb.agrs_get_inplace_tensor((256, 1024), torch.bfloat16)
        inplace.copy_(torch.full((256, 1024), float(rank + session), device=dev))
        plain = torch.randn(33, device=dev, generator=torch.Generator(dev).manual_seed(rank))
        (g_in, g_plain), handle = eb.all_gather([inplace, plain])
        handle()
        ref = [torch.empty_like(plain) for _ in range(world)]
        dist.all_gather(ref, plain)
        assert torch.equal(g_plain, torch.stack(ref))
        assert all(torch.all(g_in[i] == float(i + session)) for i in range(world))
        assert g_in[rank].data_ptr() == inplace.data_ptr()
        x = torch.randn(world, 4096, device=dev, generator=torch.Generator(dev).manual_seed(10 + rank))
        shard, handle = eb.reduce_scatter(x.to(torch.bfloat16))
        handle()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        acc = parts[0][rank].to(torch.bfloat16).float()
        for p in parts[1:]:
            acc = acc + p[rank].to(torch.bfloat16).float()
        assert torch.equal(shard, acc.to(torch.bfloat16))
        eb.destroy_agrs_session()
        checked += 3
    eb.destroy()
    return {"checked": checked}


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_pp_and_agrs_one_gpu(backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert run_distributed(_pp_and_agrs, 1, backend, backend="nccl")[0]["checked"] == 15


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_pp_and_agrs_two_gpus(backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    results = run_distributed(_pp_and_agrs, 2, backend, backend="nccl")
    assert [r["checked"] for r in results] == [15, 15]
