"""The CPU-visible parts of the native PP/AGRS transport (`ep_moe.native.stream_transport`): the choice of transport
(`ep_moe.elastic.transport_choice.choose_transport`, ``pp_transport`` / ``agrs_transport``), the PP and AGRS memory layouts (offsets
disjoint, aligned, inside the buffer, the same on every rank; a message's slot cycles with the configuration's
base), a simulation of the PP protocol over those offsets at 1..5 ranks (every sender writes exactly where its
receiver reads and frees exactly what the sender waits on), and the config errors a CPU buffer raises for the
``transport`` argument. The copies and stream waits themselves run on a GPU only
(tests/native/test_stream_transport_gpu.py)."""

from __future__ import annotations

import itertools

import pytest

from ep_moe.distributed import run_distributed
from ep_moe.elastic.agrs import HEADER_LEN as AGRS_HEADER_LEN
from ep_moe.elastic.agrs import AGRSConfigError, agrs_transport
from ep_moe.elastic.pipeline_comm import HEADER_LEN as PP_HEADER_LEN
from ep_moe.elastic.pipeline_comm import PPConfigError, pp_transport
from ep_moe.elastic.transport_choice import TRANSPORT_ENV, choose_transport
from ep_moe.native.stream_transport import (
    PP_HEADER_BYTES,
    AGRSLayout,
    PPLayout,
    batch_copy_enabled,
    ring_neighbours,
)


# ------------------------------------------------------------------------------------------ transport choice
@pytest.mark.parametrize("backend", ["native", "torch", "hybrid"])
def test_auto_takes_native_exactly_on_the_native_backend(backend, monkeypatch):
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    want = "native" if backend == "native" else "torch"
    assert choose_transport(backend, None, "pp_set_config") == want
    assert choose_transport(backend, "auto", "pp_set_config") == want
    assert pp_transport(backend) == want and agrs_transport(backend) == want


def test_torch_can_be_forced_by_argument_or_environment(monkeypatch):
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    assert pp_transport("native", "torch") == "torch"
    assert agrs_transport("native", "torch") == "torch"
    monkeypatch.setenv(TRANSPORT_ENV, "torch")
    assert pp_transport("native") == "torch" and agrs_transport("native") == "torch"
    assert pp_transport("native", "native") == "native"  # the argument wins over the environment
    monkeypatch.setenv(TRANSPORT_ENV, " Native ")
    assert pp_transport("native") == "native"


def test_bad_transport_values_name_their_source(monkeypatch):
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    with pytest.raises(PPConfigError, match="argument 'transport' must be one of"):
        pp_transport("native", "nccl")
    with pytest.raises(AGRSConfigError, match="argument 'transport' is 'native', which needs the buffer's native"):
        agrs_transport("torch", "native")
    monkeypatch.setenv(TRANSPORT_ENV, "copy-engine")
    with pytest.raises(PPConfigError, match=f"{TRANSPORT_ENV} must be one of"):
        pp_transport("native")
    with pytest.raises(ValueError, match=r"ElasticBuffer\.agrs_set_config: EP_MOE_PPAGRS_TRANSPORT"):
        choose_transport("native", None, "agrs_set_config")


def test_batch_copy_switch(monkeypatch):
    monkeypatch.delenv("EP_MOE_STREAM_BATCH_COPY", raising=False)
    assert batch_copy_enabled()
    monkeypatch.setenv("EP_MOE_STREAM_BATCH_COPY", "0")
    assert not batch_copy_enabled()
    monkeypatch.setenv("EP_MOE_STREAM_BATCH_COPY", "maybe")
    with pytest.raises(ValueError, match="EP_MOE_STREAM_BATCH_COPY must be 0 or 1"):
        batch_copy_enabled()


# ------------------------------------------------------------------------------------------ PP layout
def test_ring_neighbours():
    assert ring_neighbours(0, 1) == [0]
    assert ring_neighbours(0, 2) == [1] and ring_neighbours(1, 2) == [0]
    assert ring_neighbours(0, 3) == [1, 2] and ring_neighbours(2, 5) == [1, 3] and ring_neighbours(4, 5) == [0, 3]


def _pp_regions(layout: PPLayout) -> list[tuple[int, int, str]]:
    regions = []
    for c, k in itertools.product(range(layout.channels), range(layout.inflight)):
        regions += [(layout.landed_word(c, k), 8, f"landed {c}/{k}"), (layout.freed_word(c, k), 8, f"freed {c}/{k}"),
                    (layout.header_offset(c, k), PP_HEADER_BYTES, f"header {c}/{k}"),
                    (layout.payload_offset(c, k), layout.slot_bytes, f"payload {c}/{k}")]
    return regions


def _assert_disjoint_inside(regions: list[tuple[int, int, str]], total: int) -> None:
    regions = sorted(regions)
    for (a, n, name), (b, _, other) in itertools.pairwise(regions):
        assert a + n <= b, f"{name} [{a}, {a + n}) overlaps {other} at {b}"
    last, n, name = regions[-1]
    assert regions[0][0] >= 0 and last + n <= total, f"{name} ends past {total}"


@pytest.mark.parametrize("num_ranks,slot_bytes,inflight", [(1, 32, 1), (2, 96, 3), (3, 4096, 2), (5, 64, 4)])
def test_pp_layout_is_disjoint_aligned_and_inside(num_ranks, slot_bytes, inflight):
    layout = PPLayout(num_ranks, slot_bytes, inflight)
    assert layout.channels == len(ring_neighbours(0, num_ranks))
    assert PP_HEADER_BYTES == PP_HEADER_LEN * 8  # the header of ep_moe.elastic.pipeline_comm fills the slot's first bytes
    regions = _pp_regions(layout)
    _assert_disjoint_inside(regions, layout.total_bytes)
    for offset, size, name in regions:
        assert offset % (8 if size == 8 else 32) == 0, name  # words 8-aligned; headers, payloads 32 (every dtype)


def test_pp_layout_rejects_what_is_not_there():
    layout = PPLayout(4, 64, 2)
    with pytest.raises(ValueError, match="rank 2 is not a ring neighbour of rank 0 of 4"):
        layout.channel(0, 2)
    with pytest.raises(ValueError, match="message #3 precedes this configuration"):
        layout.slot(3, 5)
    with pytest.raises(ValueError, match="outside 2 x 2"):
        layout.landed_word(2, 0)


def test_pp_slots_cycle_from_the_configurations_base():
    layout = PPLayout(2, 32, 3)
    assert [layout.slot(s, 0) for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [layout.slot(s, 5) for s in range(5, 9)] == [0, 1, 2, 0]


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 5])
def test_pp_protocol_over_the_layout(num_ranks):
    """Every rank sends many messages to each neighbour; a simulated memory per rank (offset -> value) records the
    sender's writes at the receiver's offsets (`PPStreamTransport.post`) and the receiver's frees at the sender's
    (`release`); each receiver finds its message where it looks (`take_header`), and a sender that waits for a
    slot (`wait_free`) finds the free of exactly the message that used it."""
    inflight = 3
    layout = PPLayout(num_ranks, 64, inflight)
    memory = [dict() for _ in range(num_ranks)]
    base = 2  # the channels' message counts when this configuration began (pp_set_config drained the earlier)
    for seq in range(base, base + 10):
        for src in range(num_ranks):
            for dst in ring_neighbours(src, num_ranks):
                slot = layout.slot(seq, base)
                channel = layout.channel(dst, src)  # post: the sender writes into the receiver's channel of it
                if seq - base >= inflight:  # wait_free: the sender's own freed word of that slot
                    own = layout.freed_word(layout.channel(src, dst), slot)
                    assert memory[src].get(own, 0) >= seq - inflight + 1, (src, dst, seq)
                for offset in (layout.header_offset(channel, slot), layout.payload_offset(channel, slot)):
                    assert memory[dst].get(offset, (None, None, -1))[2] < seq, "overwrote an unreceived message"
                    memory[dst][offset] = (src, dst, seq)
                memory[dst][layout.landed_word(channel, slot)] = seq + 1
        for dst in range(num_ranks):  # every rank receives this round's messages, in order per neighbour
            for src in ring_neighbours(dst, num_ranks):
                slot = layout.slot(seq, base)
                channel = layout.channel(dst, src)  # take_header: this rank's channel of the sender
                assert memory[dst][layout.landed_word(channel, slot)] >= seq + 1
                assert memory[dst][layout.header_offset(channel, slot)] == (src, dst, seq)
                assert memory[dst][layout.payload_offset(channel, slot)] == (src, dst, seq)
                memory[src][layout.freed_word(layout.channel(src, dst), slot)] = seq + 1  # release


# ------------------------------------------------------------------------------------------ AGRS layout
@pytest.mark.parametrize("num_ranks,session_bytes,max_ops", [(1, 32, 1), (2, 4096, 3), (4, 96, 10), (8, 1 << 20, 2)])
def test_agrs_layout_is_disjoint_aligned_and_inside(num_ranks, session_bytes, max_ops):
    layout = AGRSLayout(num_ranks, session_bytes, max_ops, AGRS_HEADER_LEN)
    assert layout.row_bytes >= AGRS_HEADER_LEN * 8
    regions = [(layout.data_offset, num_ranks * session_bytes, "data")]
    for counter, src in itertools.product((1, 2), range(num_ranks)):
        regions += [(layout.header_row(counter, src), layout.row_bytes, f"header row {counter % 2}/{src}"),
                    (layout.header_word(counter, src), 8, f"header word {counter % 2}/{src}")]
    for op_index, src in itertools.product(range(1, max_ops + 1), range(num_ranks)):
        regions.append((layout.data_word(op_index, src), 8, f"data word {op_index}/{src}"))
    _assert_disjoint_inside(regions, layout.total_bytes)
    assert layout.words_end <= layout.data_offset and layout.data_offset % 128 == 0
    assert all(offset % 8 == 0 for offset, _, _ in regions)
    # Header rows and words alternate with the parity of the exchange counter (a rank is at most one ahead).
    assert layout.header_row(3, 0) == layout.header_row(1, 0) != layout.header_row(2, 0)
    assert layout.header_word(4, num_ranks - 1) == layout.header_word(2, num_ranks - 1)


def test_agrs_layout_rejects_what_is_not_there():
    layout = AGRSLayout(2, 64, 3, AGRS_HEADER_LEN)
    with pytest.raises(ValueError, match="operation 4 outside 1..3"):
        layout.data_word(4, 0)
    with pytest.raises(ValueError, match="rank 2 outside 0..1"):
        layout.header_row(1, 2)


# ------------------------------------------------------------------------------------------ on a CPU buffer
def _transport_errors(rank: int, num_ranks: int) -> list[str]:
    from ep_moe import ElasticBuffer

    eb = ElasticBuffer(num_bytes=2 << 20, explicitly_destroy=True)
    messages = []
    for call in (lambda: eb.pp_set_config(64, 2, transport="native"),
                 lambda: eb.agrs_set_config(64, 2, transport="native"),
                 lambda: eb.pp_set_config(64, 2, transport="rdma")):
        try:
            call()
        except (PPConfigError, AGRSConfigError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    eb.pp_set_config(64, 2, transport="torch")  # the torch transport still works
    eb.agrs_set_config(64, 2, transport="auto")
    assert eb._pp.transport == "torch" and eb._agrs.transport == "torch"
    eb.destroy()
    return messages


def test_a_cpu_buffer_refuses_the_native_transport():
    messages = run_distributed(_transport_errors, 1)[0]
    assert len(messages) == 3, messages
    assert messages[0].startswith("PPConfigError: ep_moe.ElasticBuffer.pp_set_config: argument 'transport' is "
                                  "'native'"), messages[0]
    assert "backend is 'torch'" in messages[0]
    assert messages[1].startswith("AGRSConfigError: ep_moe.ElasticBuffer.agrs_set_config: argument 'transport'")
    assert "must be one of ('auto', 'torch', 'native'), got 'rdma'" in messages[2]


def test_batched_copy_attributes_have_cuda_h_layout():
    """``CUmemcpyAttributes`` as cuda.h (CUDA 12.8 to 13.0) lays it out: int, two CUmemLocation, unsigned int."""
    import ctypes

    from ep_moe.native.stream_ops import MemcpyAttributes

    assert ctypes.sizeof(MemcpyAttributes) == 24
    assert [getattr(MemcpyAttributes, f).offset for f in ("srcAccessOrder", "srcLocHint", "dstLocHint", "flags")] == \
        [0, 4, 12, 20]
