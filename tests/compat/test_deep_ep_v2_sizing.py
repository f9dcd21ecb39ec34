"""The V2 sizing helpers of ``deep_ep.ElasticBuffer`` (`get_pp_buffer_size_hint`, `get_agrs_num_max_session_bytes`,
`get_agrs_buffer_size_hint`, `get_engram_storage_size_hint`) used as DeepEP's programs use them, and V2's Engram
forms (``num_bytes`` counting the CPU bytes, replicated FP8 scales, ``[T, P * H]`` rows, the TMA scale layout), at
1 and 2 gloo ranks (`tests/support/world_sizes.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.bits import assert_bits_equal
from support.world_sizes import run_world_sizes

from ep_moe.compat.deep_ep import ElasticBuffer

MiB = 1 << 20


def _round(n: int, a: int) -> int:
    return -(-n // a) * a


def test_hints_follow_v2s_formulas():
    # V2's own formulas (deep_ep/buffers/elastic.py), written out
    assert ElasticBuffer.get_pp_buffer_size_hint(1000, 3) == _round(_round(1000, 32) * 3 * 2 * 2, 2 * MiB)
    assert ElasticBuffer.get_pp_buffer_size_hint(3 * MiB, 2) == 24 * MiB
    assert ElasticBuffer.get_agrs_buffer_size_hint(None, 1) == 2 * MiB
    assert ElasticBuffer.get_agrs_buffer_size_hint(None, 4 * MiB + 1) == 6 * MiB
    gpu, cpu = ElasticBuffer.get_engram_storage_size_hint(1000, 100, 64, torch.bfloat16)
    assert (gpu, cpu) == (_round(_round(200, 32) * 64, 2 * MiB), 2 * MiB)
    # FP8 tables also hold their per-row scales (ceil(H / 128) fp32 at the next 4 KiB) in the host segment
    _, cpu8 = ElasticBuffer.get_engram_storage_size_hint(2 * MiB // 256, 256, 1, torch.float8_e4m3fn)
    assert cpu8 == 4 * MiB
    with pytest.raises(ValueError, match="num_max_tensor_bytes"):
        ElasticBuffer.get_pp_buffer_size_hint(0, 1)
    with pytest.raises(ValueError, match="num_entries"):
        ElasticBuffer.get_engram_storage_size_hint(-1, 8, 1)


def _worker(rank: int, num_ranks: int, group) -> int:
    checked = 0
    # PP: a buffer of the hint takes the config; one 2 MiB smaller does not (V2's test_pp sizing)
    hint = ElasticBuffer.get_pp_buffer_size_hint(1 << 20, 2)
    eb = ElasticBuffer(group, num_bytes=hint, backend="torch", explicitly_destroy=True, allow_hybrid_mode=False)
    eb.pp_set_config(1 << 20, 2)
    eb.destroy()
    small = ElasticBuffer(group, num_bytes=hint - 2 * MiB, backend="torch", explicitly_destroy=True)
    with pytest.raises(ValueError, match="num_bytes"):
        small.pp_set_config(1 << 20, 2)
    small.destroy()
    checked += 1

    # AGRS as V2's test_agrs sizes it: the session bytes of every shape, a buffer of the hint, the hint as the
    # session bytes; every shape gathered in one session fits
    shapes = [(3, 5), (1000,), (7,)]
    session = ElasticBuffer.get_agrs_num_max_session_bytes(group, shapes, torch.bfloat16)
    assert session == sum(_round(num_ranks * elements * 2, 32) for elements in (15, 1000, 7))
    assert ElasticBuffer.get_agrs_num_max_session_bytes(group, (3, 5), torch.bfloat16) == _round(num_ranks * 30, 32)
    hint = ElasticBuffer.get_agrs_buffer_size_hint(group, session)
    eb = ElasticBuffer(group, num_bytes=hint, backend="torch", explicitly_destroy=True)
    eb.agrs_set_config(session, len(shapes))
    with eb.agrs_new_session():
        for j, shape in enumerate(shapes):
            mine = torch.full(shape, float(rank * 10 + j), dtype=torch.bfloat16)
            gathered, handle = eb.all_gather(mine)
            handle()
            for r in range(num_ranks):
                assert torch.equal(gathered[r], torch.full(shape, float(r * 10 + j), dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="full"):  # nothing more fits: the session is exactly V2's size
            eb.all_gather(torch.zeros(1, dtype=torch.bfloat16))
    eb.destroy()
    checked += 1

    # Engram as V2's test_engram: num_bytes = gpu + cpu, FP8 rows with every rank's scales replicated
    num_entries, hidden, T, P = 40, 256, 6, 3
    gpu, cpu = ElasticBuffer.get_engram_storage_size_hint(num_entries, hidden, T * P, torch.float8_e4m3fn)
    eb = ElasticBuffer(group, num_bytes=gpu + cpu, num_cpu_bytes=cpu, backend="torch", explicitly_destroy=True,
                       allow_multiple_reduction=False)
    gen = torch.Generator().manual_seed(rank)
    local = torch.randn(num_entries, hidden, generator=gen).to(torch.float8_e4m3fn)
    local_sf = torch.rand(num_entries, hidden // 128, generator=gen) + 0.5
    every = [torch.empty_like(local_sf) for _ in range(num_ranks)]
    dist.all_gather(every, local_sf, group=group)
    sf = torch.cat(every)
    eb.engram_write(local, sf=sf)
    tables = [torch.empty_like(local.view(torch.uint8)) for _ in range(num_ranks)]
    dist.all_gather(tables, local.view(torch.uint8), group=group)
    table = torch.cat(tables).view(torch.float8_e4m3fn)
    indices = torch.randint(0, num_ranks * num_entries, (T, P), generator=gen, dtype=torch.int32)
    for tma in (False, True):
        data, fetched_sf = eb.engram_fetch(indices, use_tma_aligned_col_major_sf=tma)()
        want = table[indices.view(-1).long()].view(T, -1)
        assert_bits_equal(data, want, f"engram_fetch (use_tma_aligned_col_major_sf={tma})")
        assert torch.equal(fetched_sf, sf[indices.view(-1).long()].view(T, -1))
        if tma:  # column-major, each column starting 16 bytes apart
            assert fetched_sf.stride() == (1, _round(T, 4))
    eb.destroy()
    with pytest.raises(ValueError, match="num_bytes"):
        ElasticBuffer(group, num_bytes=cpu, num_cpu_bytes=cpu, backend="torch")
    return checked + 1


@pytest.mark.timeout(300)
def test_sizing_and_engram_as_deep_ep_programs_use_them():
    results = run_world_sizes(_worker, [1, 2])
    assert results == {1: [3], 2: [3, 3]}
