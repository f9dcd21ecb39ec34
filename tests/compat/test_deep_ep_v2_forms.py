"""V2's call forms on ``deep_ep.ElasticBuffer`` as DeepEP's own programs write them (``*gathered, handle =
all_gather([...])``, ``agrs_get_inplace_tensor(shapes=...)``, ``pp_send(t=...)``), the module-level domain sizes, and
the legacy ``Buffer``'s low-latency calls refused by name, at 1 and 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.world_sizes import run_world_sizes

import ep_moe.compat.deep_ep as deep_ep


def _worker(rank: int, num_ranks: int, group) -> int:
    assert deep_ep.get_physical_domain_size(group) == (1, num_ranks)  # one host
    assert deep_ep.get_logical_domain_size(group) == (1, num_ranks)
    assert deep_ep.get_logical_domain_size(group, allow_hybrid_mode=False) == (1, num_ranks)
    shapes = [(4, 3), (5,)]
    session = deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(group, shapes * 2 + [(2,)], torch.bfloat16)
    eb = deep_ep.ElasticBuffer(group, num_bytes=deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(group, session),
                               explicitly_destroy=True, backend="torch")
    eb.agrs_set_config(session, 4)
    with eb.agrs_new_session():
        mine = [torch.full(s, float(rank + j), dtype=torch.bfloat16) for j, s in enumerate(shapes)]
        *gathered, handle = eb.all_gather(mine)  # a list in: the tensors out, then the handle
        handle()
        assert len(gathered) == 2
        inplace = eb.agrs_get_inplace_tensor(shapes=tuple(torch.Size(s) for s in shapes), dtype=torch.bfloat16)
        for t, m in zip(inplace, mine):
            t.copy_(m)
        *again, handle = eb.all_gather(inplace)
        handle()
        for out in (gathered, again):
            for j, g in enumerate(out):
                assert torch.equal(g, torch.stack([torch.full(shapes[j], float(r + j), dtype=torch.bfloat16)
                                                   for r in range(num_ranks)]))
        one, handle = eb.all_gather(torch.ones(2, dtype=torch.bfloat16))  # one tensor in: one out
        handle()
        assert one.shape == (num_ranks, 2)
    eb.destroy()
    if num_ranks > 1:
        eb = deep_ep.ElasticBuffer(group, num_bytes=deep_ep.ElasticBuffer.get_pp_buffer_size_hint(64, 2),
                                   explicitly_destroy=True, backend="torch", allow_hybrid_mode=False)
        eb.pp_set_config(64, 2)
        x = torch.arange(8, dtype=torch.float32) + rank
        got = torch.empty_like(x)
        if rank == 0:
            eb.pp_send(t=x, dst_rank_idx=1)
            eb.pp_recv(t=got, src_rank_idx=1)
        else:
            eb.pp_recv(t=got, src_rank_idx=0)
            eb.pp_send(t=x, dst_rank_idx=0)
        assert torch.equal(got, torch.arange(8, dtype=torch.float32) + (1 - rank))
        eb.barrier()  # the last send has been received before the buffer goes
        eb.destroy()
    return 1


@pytest.mark.timeout(300)
def test_v2_call_forms():
    assert run_world_sizes(_worker, [1, 2]) == {1: [1], 2: [1, 1]}


@pytest.mark.parametrize("name", ["low_latency_update_mask_buffer", "low_latency_query_mask_buffer",
                                  "low_latency_clean_mask_buffer", "get_next_low_latency_combine_buffer",
                                  "get_local_buffer_tensor", "low_latency_dispatch", "clean_low_latency_buffer"])
def test_legacy_buffer_refuses_what_it_does_not_provide_by_name(name):
    # the refusal comes before the buffer is touched: an unconstructed instance is enough
    buffer = deep_ep.Buffer.__new__(deep_ep.Buffer)
    with pytest.raises(NotImplementedError, match="not provided"):
        getattr(buffer, name)(0)


def test_event_overlap_hooks_and_release():
    ran = []
    event = deep_ep.EventOverlap(None)
    event.register_hook_after_wait(lambda: ran.append("hook"))
    with pytest.raises(RuntimeError, match="already registered"):
        event.register_hook_after_wait(lambda: None)
    event.current_stream_wait()
    event.current_stream_wait()  # the hook runs once
    assert ran == ["hook"]
    with event(release_handle=True):
        pass
    assert event.event is None and event._release_handle_by_call is False


def test_module_level_helpers():
    deep_ep.check_nccl_so()  # nothing to check: torch's NCCL is the only one
    deep_ep.init_jit()
    assert deep_ep.find_cuda_home() is None or Path(deep_ep.find_cuda_home()).is_dir()
    with pytest.raises(NotImplementedError, match="find_nccl_root"):
        deep_ep.find_nccl_root()
