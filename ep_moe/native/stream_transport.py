"""The native transport of `ElasticBuffer`'s PP send/recv and AGRS sessions on one NVLink node: copies by the copy
engine into the peers' copies of a symmetric buffer, signals by stream memory operations, no kernel on the SMs
(docs/native.md, "PP and AGRS on the native backend"). `ep_moe.elastic.pipeline_comm` and `ep_moe.elastic.agrs` keep the protocol
(message numbers, headers and their checks, sessions); this module owns the memory layout and what moves.

Memory: one `ep_moe.native.symmetric.SymmetricBuffer` per configuration (``pp_set_config``, ``agrs_set_config``,
collective), its signal words zeroed before any rank writes (a barrier of the group), every value waited for >= 1
and monotonic, so nothing is ever reset.

PP (`PPLayout`, `PPStreamTransport`): per ring neighbour (channel) ``inflight`` receive slots, each a 128-byte
header (the int64 header of `ep_moe.elastic.pipeline_comm`) followed by ``slot_bytes`` of payload, and two words per slot:
"landed" (written by the sender: message number + 1, after its header and payload copies) and "freed" (in the
sender's memory, written by the receiver: message number + 1, after it copied the payload out). Message ``seq``
uses slot ``(seq - base) % inflight``, ``base`` being the channel's message count when the configuration was made.

AGRS (`AGRSLayout`, `AGRSStreamTransport`): ``R x session_bytes`` of data (the chunks of ``ep_moe.elastic.agrs``); two rows
of headers per source rank (by the parity of the operation counter: a rank is at most one operation ahead of any
peer), a header word per (parity, source), and a data word per (operation of the session, source) holding the
session number: an all-gather or reduce-scatter writes its rows into the peers' chunks, then its data words.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .stream_ops import SignalWaiter, Word, stream_ops

WAITER_ATTRIBUTE = "_stream_waiter"

WORD_BYTES = 8
PP_HEADER_BYTES = 128
"""The PP header (16 int64) in a slot's first bytes; the payload follows."""
ROW_ALIGNMENT = 128

BATCH_COPY_ENV = "EP_MOE_STREAM_BATCH_COPY"
"""``0`` turns off ``cuMemcpyBatchAsync`` (then one ``cudaMemcpyAsync`` per peer, as on drivers before CUDA 13)."""


def _round(n: int, alignment: int = ROW_ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def ring_neighbours(rank: int, num_ranks: int) -> list[int]:
    """Rank ``rank``'s distinct ring neighbours in increasing order: ``[0]`` at R = 1, the other rank at R = 2, prev
    and next sorted from R = 3 on. A neighbour's index in this list is its channel."""
    return sorted({(rank - 1) % num_ranks, (rank + 1) % num_ranks})


@dataclass(frozen=True)
class PPLayout:
    """Byte offsets of one rank's PP memory (the same on every rank)."""

    num_ranks: int
    slot_bytes: int   # payload bytes of a slot (a multiple of 32)
    inflight: int

    @property
    def channels(self) -> int:
        return len(ring_neighbours(0, self.num_ranks))

    @property
    def words_bytes(self) -> int:
        return _round(self.channels * 2 * self.inflight * WORD_BYTES)

    @property
    def slot_stride(self) -> int:
        return PP_HEADER_BYTES + self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.words_bytes + self.channels * self.inflight * self.slot_stride

    def channel(self, owner: int, peer: int) -> int:
        """The channel of ``peer`` in ``owner``'s memory. Raises ValueError when they are not ring neighbours."""
        neighbours = ring_neighbours(owner, self.num_ranks)
        if peer not in neighbours:
            raise ValueError(f"ep_moe.native.stream_transport: rank {peer} is not a ring neighbour of rank {owner} "
                             f"of {self.num_ranks}")
        return neighbours.index(peer)

    def slot(self, seq: int, base: int) -> int:
        """The slot message ``seq`` uses on a channel whose configuration began at message ``base``."""
        if seq < base:
            raise ValueError(f"ep_moe.native.stream_transport: message #{seq} precedes this configuration (#{base})")
        return (seq - base) % self.inflight

    def landed_word(self, channel: int, slot: int) -> int:
        self._check(channel, slot)
        return (channel * 2 * self.inflight + slot) * WORD_BYTES

    def freed_word(self, channel: int, slot: int) -> int:
        self._check(channel, slot)
        return (channel * 2 * self.inflight + self.inflight + slot) * WORD_BYTES

    def header_offset(self, channel: int, slot: int) -> int:
        self._check(channel, slot)
        return self.words_bytes + (channel * self.inflight + slot) * self.slot_stride

    def payload_offset(self, channel: int, slot: int) -> int:
        return self.header_offset(channel, slot) + PP_HEADER_BYTES

    def _check(self, channel: int, slot: int) -> None:
        if not (0 <= channel < self.channels and 0 <= slot < self.inflight):
            raise ValueError(f"ep_moe.native.stream_transport: channel {channel} / slot {slot} outside "
                             f"{self.channels} x {self.inflight}")


@dataclass(frozen=True)
class AGRSLayout:
    """Byte offsets of one rank's AGRS memory (the same on every rank): header rows, header words, data words,
    then the data (``R x session_bytes``, 128-byte aligned)."""

    num_ranks: int
    session_bytes: int   # per rank (the largest of the ranks' configurations, a multiple of 32)
    max_ops: int         # data words per source (the largest of the ranks' operation counts)
    header_len: int      # int64 values of a header

    @property
    def row_bytes(self) -> int:
        return _round(self.header_len * WORD_BYTES, 32)

    def header_row(self, counter: int, src: int) -> int:
        """Where ``src``'s header of operation ``counter`` (1, 2, ...: every exchange of the buffer) lands."""
        self._check_src(src)
        return ((counter % 2) * self.num_ranks + src) * self.row_bytes

    @property
    def _header_words(self) -> int:
        return _round(2 * self.num_ranks * self.row_bytes)

    def header_word(self, counter: int, src: int) -> int:
        self._check_src(src)
        return self._header_words + ((counter % 2) * self.num_ranks + src) * WORD_BYTES

    @property
    def _data_words(self) -> int:
        return self._header_words + _round(2 * self.num_ranks * WORD_BYTES)

    def data_word(self, op_index: int, src: int) -> int:
        """The word ``src`` writes (the session number) once its rows of operation ``op_index`` (1-based, within
        a session) landed here."""
        self._check_src(src)
        if not 1 <= op_index <= self.max_ops:
            raise ValueError(f"ep_moe.native.stream_transport: operation {op_index} outside 1..{self.max_ops}")
        return self._data_words + ((op_index - 1) * self.num_ranks + src) * WORD_BYTES

    @property
    def words_end(self) -> int:
        return self._data_words + self.max_ops * self.num_ranks * WORD_BYTES

    @property
    def data_offset(self) -> int:
        return _round(self.words_end)

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.num_ranks * self.session_bytes

    def _check_src(self, src: int) -> None:
        if not 0 <= src < self.num_ranks:
            raise ValueError(f"ep_moe.native.stream_transport: rank {src} outside 0..{self.num_ranks - 1}")


def batch_copy_enabled() -> bool:
    """Whether copies to several peers go as one ``cuMemcpyBatchAsync`` (``EP_MOE_STREAM_BATCH_COPY``, default
    on; it also needs a CUDA 13 driver and a stream other than the legacy default one)."""
    value = os.environ.get(BATCH_COPY_ENV, "1").strip().lower()
    if value not in ("0", "1", "off", "on", "false", "true"):
        raise ValueError(f"ep_moe: {BATCH_COPY_ENV} must be 0 or 1, got {value!r}")
    return value in ("1", "on", "true")


def shared_waiter(owner: object, device: torch.device, rank: int, num_ranks: int, timeout_s: float) -> SignalWaiter:
    """The one `SignalWaiter` of ``owner`` (an ``ElasticBuffer``: its PP and AGRS transports share it, and a timeout
    in either stops both), made on first use."""
    waiter = getattr(owner, WAITER_ATTRIBUTE, None)
    if waiter is None:
        waiter = SignalWaiter(device, rank, num_ranks, timeout_s)
        setattr(owner, WAITER_ATTRIBUTE, waiter)
    return waiter


def release_waiter(owner: object) -> None:
    """Release ``owner``'s `SignalWaiter` (its streams), if it has one."""
    waiter = getattr(owner, WAITER_ATTRIBUTE, None)
    if waiter is not None:
        waiter.destroy()
        setattr(owner, WAITER_ATTRIBUTE, None)


def destroy_transports(owner: object, transports: list) -> None:
    """Free the symmetric buffers of ``transports`` (None entries: the torch transport, nothing to free), then
    ``owner``'s waiter when there was any transport (`ElasticBuffer.destroy` through the PP and AGRS mixins)."""
    for transport in transports:
        if transport is not None:
            transport.destroy()
    if transports:
        release_waiter(owner)


class _SymmetricWords:
    """A `SymmetricBuffer` with its signal words zeroed on every rank before any rank writes one."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, nbytes: int, words_end: int) -> None:
        from .symmetric import SymmetricBuffer

        self.memory = SymmetricBuffer(group, device, nbytes)
        with torch.cuda.device(device):
            self.memory.tensor[:words_end].zero_()
            torch.cuda.synchronize(device)
        dist.barrier(group=group)
        self.device = device
        self.ops = stream_ops()
        self._peers: dict[int, torch.Tensor] = {}

    def own(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.memory.tensor[offset: offset + nbytes]

    def own_word(self, offset: int) -> torch.Tensor:
        return self.own(offset, WORD_BYTES).view(torch.int64)

    def peer(self, rank: int, offset: int, nbytes: int) -> torch.Tensor:
        if rank not in self._peers:
            self._peers[rank] = self.memory.peer_tensor(rank)
        return self._peers[rank][offset: offset + nbytes]

    def write_word(self, rank: int, offset: int, value: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue on ``stream`` (the current one) the write of ``value`` into ``rank``'s word at ``offset``, after
        the copies queued before it there."""
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        self.ops.write(stream.cuda_stream, self.memory.ptrs[rank] + offset, value)

    def copy(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue ``dst.copy_(src)`` for each (dst, src) pair of uint8 contiguous tensors on the current stream: one
        batched driver call where available, else one ``cudaMemcpyAsync`` each (torch's ``copy_`` of contiguous
        bytes)."""
        copies = [(d, s) for d, s in copies if s.numel()]
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if len(copies) > 1 and stream != 0 and self.ops.has_batch_copy and batch_copy_enabled():
            self.ops.batch_copy(stream, [(d.data_ptr(), s.data_ptr(), s.numel()) for d, s in copies])
            return
        for dst, src in copies:
            dst.copy_(src)

    def destroy(self) -> None:
        self.memory.destroy()


def _host_int64(*shape: int) -> torch.Tensor:
    """A host int64 buffer, pinned where CUDA is (so that copies to and from the device are asynchronous)."""
    return torch.empty(shape, dtype=torch.int64, device="cpu", pin_memory=torch.cuda.is_available())


def _pinned_int64(values: Sequence[int], length: int) -> torch.Tensor:
    header = _host_int64(length).zero_()
    header[: len(values)] = torch.tensor(list(values), dtype=torch.int64, device="cpu")
    return header


class PPStreamTransport:
    """One rank's PP memory and its copies and signals (see the module's docstring). ``bases[peer] = (first message
    number sent to peer, first received from peer)`` under this configuration; every sent message of an earlier
    configuration must have been received (`ep_moe.elastic.pipeline_comm` drains the channels first)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, rank: int, num_ranks: int, slot_bytes: int,
                 inflight: int, bases: dict[int, tuple[int, int]], waiter: SignalWaiter) -> None:
        self.layout = PPLayout(num_ranks, slot_bytes, inflight)
        self.rank, self.waiter = rank, waiter
        self.memory = _SymmetricWords(group, device, self.layout.total_bytes, self.layout.words_bytes)
        self.bases = dict(bases)
        self.freed_upto = {peer: send_base for peer, (send_base, _) in bases.items()}  # messages known freed
        self._header_host = _host_int64(PP_HEADER_BYTES // WORD_BYTES)

    def wait_free(self, dst: int, seq: int, error: type[Exception], op: str, stage: str) -> None:
        """Return when message ``seq`` to ``dst`` has a free slot: the message ``inflight`` before it on the same
        slot was received (a guarded host wait on this rank's freed word, unless already seen)."""
        needed = seq - self.layout.inflight + 1  # messages that must be freed: up to #(seq - inflight)
        if needed <= self.freed_upto[dst]:
            return
        slot = self.layout.slot(seq, self.bases[dst][0])
        offset = self.layout.freed_word(self.layout.channel(self.rank, dst), slot)
        word = Word(self.memory.own_word(offset), needed, f"rank {dst}'s release of message #{needed - 1}")
        event = self.waiter.wait([word], error, op, stage)
        torch.cuda.current_stream(self.memory.device).wait_event(event)
        self.freed_upto[dst] = needed

    def post(self, dst: int, seq: int, header: Sequence[int], payload: torch.Tensor) -> None:
        """Queue on the current stream the header and ``payload`` (uint8, contiguous) copies into ``dst``'s slot of
        message ``seq``, then its landed word (``seq + 1``). `wait_free` first."""
        layout = self.layout
        channel = layout.channel(dst, self.rank)
        slot = layout.slot(seq, self.bases[dst][0])
        device = self.memory.device
        staged = _pinned_int64(header, PP_HEADER_BYTES // WORD_BYTES).to(device, non_blocking=True)
        copies = [(self.memory.peer(dst, layout.header_offset(channel, slot), PP_HEADER_BYTES),
                   staged.view(torch.uint8))]
        if payload.numel():
            copies.append((self.memory.peer(dst, layout.payload_offset(channel, slot), payload.numel()), payload))
        self.memory.copy(copies)
        self.memory.write_word(dst, layout.landed_word(channel, slot), seq + 1)

    def take_header(self, src: int, seq: int, error: type[Exception], op: str, stage: str) -> list[int]:
        """Wait (guarded, on the host) until message ``seq`` from ``src`` landed; its header values. The current
        stream is ordered after the landing."""
        layout = self.layout
        channel = layout.channel(self.rank, src)
        slot = layout.slot(seq, self.bases[src][1])
        word = Word(self.memory.own_word(layout.landed_word(channel, slot)), seq + 1, f"rank {src}'s message #{seq}")
        header = self.memory.own(layout.header_offset(channel, slot), PP_HEADER_BYTES).view(torch.int64)
        event = self.waiter.wait([word], error, op, stage,
                                 then=lambda _: self._header_host.copy_(header, non_blocking=True))
        torch.cuda.current_stream(self.memory.device).wait_event(event)
        return self._header_host.tolist()

    def payload(self, src: int, seq: int, nbytes: int) -> torch.Tensor:
        """This rank's slot bytes of message ``seq`` from ``src`` (valid until `release`)."""
        layout = self.layout
        slot = layout.slot(seq, self.bases[src][1])
        return self.memory.own(layout.payload_offset(layout.channel(self.rank, src), slot), nbytes)

    def release(self, src: int, seq: int) -> None:
        """Queue on the current stream (after the copy out of the slot) the write of ``seq + 1`` into ``src``'s freed
        word of that slot."""
        layout = self.layout
        slot = layout.slot(seq, self.bases[src][1])
        self.memory.write_word(src, layout.freed_word(layout.channel(src, self.rank), slot), seq + 1)

    def drain(self, dst: int, next_seq: int, error: type[Exception], op: str, stage: str) -> None:
        """Wait until every message sent to ``dst`` (up to ``next_seq - 1``) was received (each slot's freed word:
        the receiver's releases may run on different streams, so out of order)."""
        first = max(self.freed_upto[dst], next_seq - self.layout.inflight)
        channel = self.layout.channel(self.rank, dst)
        words = [Word(self.memory.own_word(self.layout.freed_word(channel, self.layout.slot(seq, self.bases[dst][0]))),
                      seq + 1, f"rank {dst}'s release of message #{seq}") for seq in range(first, next_seq)]
        if words:
            self.waiter.wait(words, error, op, stage)
        self.freed_upto[dst] = max(self.freed_upto[dst], next_seq)

    def destroy(self) -> None:
        self.memory.destroy()


class AGRSStreamTransport:
    """One rank's AGRS memory, header exchange, row copies and arrival waits (see the module's docstring).

    ``data`` is this rank's ``R x session_bytes`` (uint8), the session memory of ``ep_moe.elastic.agrs``: a chunk offset
    into it is the same offset into every peer's."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, rank: int, num_ranks: int, session_bytes: int,
                 max_ops: int, header_len: int, waiter: SignalWaiter) -> None:
        self.layout = AGRSLayout(num_ranks, session_bytes, max_ops, header_len)
        self.rank, self.num_ranks, self.waiter = rank, num_ranks, waiter
        self.memory = _SymmetricWords(group, device, self.layout.total_bytes, self.layout.words_end)
        self.data = self.memory.own(self.layout.data_offset, num_ranks * session_bytes)
        self.counter = 0  # header exchanges so far (operations and session ends), the same on every rank
        self._rows_host = _host_int64(num_ranks, self.layout.row_bytes // WORD_BYTES)

    @property
    def peers(self) -> list[int]:
        return [j for j in range(self.num_ranks) if j != self.rank]

    def exchange(self, values: Sequence[int], error: type[Exception], op: str, stage: str,
                 on_current_stream: bool) -> list[list[int]]:
        """Every rank's header (``header_len`` int64, this rank's ``values``), by row: written into each peer's row
        for this rank, then its header word; a guarded host wait for the peers' words, then one copy of the rows
        to the host. ``on_current_stream``: the writes go on the current stream (a session's end, so that a peer
        learns of it only after this rank's earlier work on its memory), else on the waiter's stream (an operation:
        the agreement does not wait for the compute queued before it)."""
        self.counter += 1
        counter, layout = self.counter, self.layout
        length = layout.row_bytes // WORD_BYTES
        device = self.memory.device
        stream = torch.cuda.current_stream(device) if on_current_stream else self.waiter.stream
        if self.peers:
            with torch.cuda.stream(stream):
                staged = _pinned_int64(values, length).to(device, non_blocking=True).view(torch.uint8)
                self.memory.copy([(self.memory.peer(j, layout.header_row(counter, self.rank), layout.row_bytes),
                                   staged) for j in self.peers])
                for j in self.peers:
                    self.memory.write_word(j, layout.header_word(counter, self.rank), counter, stream)
            rows = self.memory.own(layout.header_row(counter, 0), self.num_ranks * layout.row_bytes).view(torch.int64)
            words = [Word(self.memory.own_word(layout.header_word(counter, j)), counter, f"rank {j}'s header")
                     for j in self.peers]
            self.waiter.wait(words, error, op, stage,
                             then=lambda _: self._rows_host.view(-1).copy_(rows, non_blocking=True))
            table = self._rows_host.tolist()
        else:
            table = [[0] * length]
        table[self.rank] = [*values, *([0] * (length - len(values)))]
        return [row[: layout.header_len] for row in table]

    def put(self, copies: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Queue on the current stream the copies ``(peer, data offset, src uint8 bytes)`` into the peers' data
        (this rank's own data: a local copy)."""
        self.memory.copy([(self.memory.peer(j, self.layout.data_offset + offset, src.numel()), src)
                          for j, offset, src in copies])

    def signal(self, op_index: int, session: int) -> None:
        """Queue on the current stream, after the copies, ``session`` into every peer's data word of this rank for
        operation ``op_index``."""
        for j in self.peers:
            self.memory.write_word(j, self.layout.data_word(op_index, self.rank), session)

    def arrival(self, op_index: int, session: int, error: type[Exception], op: str, stage: str) -> _Arrival:
        """A waitable (``.wait()``) for every peer's rows of operation ``op_index`` of ``session``."""
        words = [Word(self.memory.own_word(self.layout.data_word(op_index, j)), session, f"rank {j}'s rows")
                 for j in self.peers]
        return _Arrival(self, words, error, op, stage)

    def destroy(self) -> None:
        self.memory.destroy()


class _Arrival:
    """What an AGRS handle waits on: a guarded host wait for the peers' data words, then the current stream waits
    for it (the peers' rows are then visible to the work queued after)."""

    def __init__(self, transport: AGRSStreamTransport, words: list[Word], error: type[Exception], op: str,
                 stage: str) -> None:
        self._transport, self._words, self._error, self._op, self._stage = transport, words, error, op, stage

    def wait(self, timeout=None) -> None:  # noqa: ARG002  (the deadline is the buffer's)
        if not self._words:
            return
        event = self._transport.waiter.wait(self._words, self._error, self._op, self._stage)
        torch.cuda.current_stream(self._transport.memory.device).wait_event(event)
        self._words = []


__all__ = ["AGRSLayout", "AGRSStreamTransport", "batch_copy_enabled", "BATCH_COPY_ENV", "destroy_transports",
           "PP_HEADER_BYTES", "PPLayout", "PPStreamTransport", "release_waiter", "ring_neighbours", "shared_waiter"]
