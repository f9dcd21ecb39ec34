"""Engram on `ep_moe.ElasticBuffer`: per-rank tables in the buffer's host segments, fetched by global entry id
(DeepEP V2's ``engram_write`` / ``engram_fetch``), and the buffer's symmetric memory (`ep_moe.elastic.memory`).

`EngramMixin` is a base class of `ElasticBuffer`; it needs the buffer's ``group``, ``rank``, ``num_ranks``,
``buffer`` (its device and barrier), ``num_cpu_bytes``, ``num_cpu_timeout_secs`` and sets ``memory_type``.

A table is ``[n, H_e]`` per rank (any dtype), optionally with scales ``[n, S]``; global entry ``i`` is row
``i % n`` of rank ``i // n``. A fetch takes one of two paths, chosen per buffer:

* direct: every rank's host segment is mapped here (hybrid memory on one node, or one rank): the rows are gathered
  straight from the mapped segments (on a GPU, a gather kernel whose source is the GPU-mapped host memory; nothing
  is staged through a host copy);
* collectives: otherwise (elastic memory, or a group over several nodes): the requested ids go to their owners and
  the rows come back, two variable all-to-alls of the group after an all-to-all of counts.

Both give ``fetched[t, p] = concat(tables)[indices[t, p]]``, bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..buffer.argument_checks import _fail, check_positive_int
from .memory import SymmetricMemory, memory_type_of_group
from .memory.segment_layout import ALIGNMENT_BYTES
from .peer_wait import wait_work
from .wire_format import round_up

SF_ALIGNMENT_BYTES = 4096
"""The scales start at the first multiple of this after the table in the host segment."""


@dataclass(frozen=True)
class EngramTable:
    """What `EngramMixin.engram_write` stored (the same on every rank)."""

    num_entries: int  # n, rows per rank
    hidden: int  # H_e
    dtype: torch.dtype
    sf_cols: int  # S, 0 without scales
    sf_dtype: torch.dtype | None
    sf_offset: int  # bytes from the start of a host segment

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.dtype.itemsize

    @property
    def sf_row_bytes(self) -> int:
        return self.sf_cols * self.sf_dtype.itemsize if self.sf_dtype is not None else 0


class EngramHook:
    """Returned by `EngramMixin.engram_fetch`: call it to wait for the fetch and get ``(fetched, fetched_sf)``."""

    def __init__(self, fetched: Tensor, fetched_sf: Tensor | None, event: torch.cuda.Event | None) -> None:
        self._result, self._event = (fetched, fetched_sf), event

    def __call__(self) -> tuple[Tensor, Tensor | None]:
        if self._event is not None:  # the gather ran on a side stream: order the caller's stream after it
            stream = torch.cuda.current_stream()
            stream.wait_event(self._event)
            for t in self._result:
                if t is not None:
                    t.record_stream(stream)
            self._event = None
        return self._result


def _word_dtype(*sizes: int) -> torch.dtype:
    """The widest integer type dividing every size (a row gather then moves words, not bytes)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if all(s % dtype.itemsize == 0 for s in sizes):
            return dtype
    return torch.uint8


def _gather_rows(span: Tensor, segment_bytes: int, offset: int, num_entries: int, row_bytes: int, owner: Tensor,
                 row: Tensor) -> Tensor:
    """``[len(owner), row_bytes]`` uint8: row ``row[j]`` of the table at ``offset`` of segment ``owner[j]``, read
    in place from ``span`` (uint8 over the adjacent segments, ``segment_bytes`` each)."""
    word = _word_dtype(segment_bytes, offset, row_bytes, span.storage_offset())
    size = word.itemsize
    words = span.view(word)
    if segment_bytes % row_bytes == 0 and offset % row_bytes == 0:
        # rows tile every segment (e.g. power-of-two rows): one [rows, words] matrix over all segments and a plain
        # row gather by owner * rows_per_segment + row
        rows = words[offset // size:].view(-1)[:(span.numel() - offset) // row_bytes * (row_bytes // size)]
        rows = rows.view(-1, row_bytes // size)
        return rows.index_select(0, owner * (segment_bytes // row_bytes) + row).view(torch.uint8)
    table = words.as_strided((span.numel() // segment_bytes, num_entries, row_bytes // size),
                             (segment_bytes // size, row_bytes // size, 1), words.storage_offset() + offset // size)
    return table[owner, row].view(torch.uint8)


class EngramMixin:
    """Engram and the symmetric memory of `ep_moe.ElasticBuffer` (docs/semantics.md, "ElasticBuffer: memory types
    and Engram")."""

    memory_type: str
    """``"gpu"``, ``"elastic"`` or ``"hybrid"`` (`ep_moe.elastic.memory.choose_memory_type`)."""
    memory: SymmetricMemory | None
    """The elastic or hybrid range (None for the GPU type, whose memory is the `ep_moe.Buffer`'s)."""

    def _setup_memory(self, num_bytes: int, num_cpu_bytes: int, allow_hybrid_mode: bool,
                      memory_type: str | None = None, share_gpu: bool = False) -> None:
        """Collective: choose the memory type (unless given: `ep_moe.elastic.memory.memory_type_of_group`'s) and allocate
        its range (elastic, hybrid); ``share_gpu``: with an exportable GPU segment (`SymmetricMemory`)."""
        if memory_type is None:
            memory_type = memory_type_of_group(self.group, num_cpu_bytes, allow_hybrid_mode)
        self.memory_type = memory_type
        self.memory = None
        self._engram: EngramTable | None = None
        self._engram_stream = None
        if self.memory_type != "gpu":
            self.memory = SymmetricMemory(self.memory_type, self.group, num_bytes, num_cpu_bytes, self.buffer.device,
                                          share_gpu=share_gpu)

    def _release_memory(self) -> None:
        if getattr(self, "memory", None) is not None:
            self.memory.close()
            self.memory = None
        self._engram = None

    # ---------------------------------------------------------------- write
    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
        """The GPU and host bytes for an Engram table of this shape on every rank.

        Args:
            num_entries: rows of the table per rank (int >= 0).
            hidden: elements per row (int >= 0).
            num_max_tokens_per_rank: the most rows one fetch returns (int >= 0).
            dtype: the rows' dtype; a one-byte float dtype also stores per-row fp32 scales.

        Returns:
            ``(num_gpu_bytes, num_cpu_bytes)``, each rounded up to 2 MiB. ``num_cpu_bytes`` holds the table in the
            host segment as `engram_write` lays it out (the rows; for a one-byte float dtype also per-row fp32
            scales of ``ceil(hidden / 128)`` columns at the next 4 KiB); ``num_gpu_bytes`` is V2's receive area of
            ``num_max_tokens_per_rank`` fetched rows of ``round_up(hidden x itemsize, 32)`` bytes (ep_moe returns
            fetched rows as new tensors, so only V2's sum ``num_bytes = gpu + cpu`` reads it).

        Raises:
            ValueError: a count that is not an int >= 0, named.
        """
        op = "ElasticBuffer.get_engram_storage_size_hint"
        for name, value in (("num_entries", num_entries), ("hidden", hidden),
                            ("num_max_tokens_per_rank", num_max_tokens_per_rank)):
            check_positive_int(op, name, value, 0)
        row_bytes = hidden * dtype.itemsize
        need = num_entries * row_bytes
        if dtype.is_floating_point and dtype.itemsize == 1:  # FP8: room for the scales written beside the rows
            need = round_up(need, SF_ALIGNMENT_BYTES) + num_entries * -(-hidden // 128) * 4
        gpu = round_up(round_up(row_bytes, 32) * num_max_tokens_per_rank, ALIGNMENT_BYTES)
        return gpu, round_up(need, ALIGNMENT_BYTES)

    def engram_write(self, storage: Tensor, sf: Tensor | None = None) -> None:
        """Collective: store this rank's table in its host segment, then wait for every rank (a barrier).

        Args:
            storage: ``[n, H_e]`` this rank's entries, any dtype, on any device; ``n``, ``H_e`` and the dtype are
                the same on every rank. Rank ``r`` holds global entries ``r * n .. r * n + n - 1``.
            sf: ``[n, S]`` scales (e.g. FP8 scales) stored beside the rows, or None; the same on every rank.

        Raises ValueError naming the argument (on the rank that passed it; the others raise RuntimeError naming
        that rank) when a table is not 2-D, differs between ranks, or does not fit ``num_cpu_bytes`` (the table,
        then the scales at the next 4 KiB); ValueError naming ``num_cpu_bytes`` for the GPU memory type.
        """
        op = "ElasticBuffer.engram_write"
        self._check_live("engram_write")
        if self.memory is None:
            raise _fail(op, "num_cpu_bytes", "> 0 at construction (Engram tables live in the host segments)", 0)
        error, meta = None, None
        try:
            meta = self._engram_meta(op, storage, sf)
        except ValueError as exc:
            error = exc
        if self.memory.host.device.type == "cuda":
            torch.cuda.synchronize(self.memory.host.device)  # this rank's fetches are done before any rank writes
        metas: list = [None] * self.num_ranks
        dist.all_gather_object(metas, (meta, None if error is None else str(error)), group=self.group)
        if error is not None:
            raise error
        bad = [r for r, (_, e) in enumerate(metas) if e is not None]
        if bad:
            raise RuntimeError(f"ep_moe.{op}: rank(s) {bad} passed a bad table: {metas[bad[0]][1]}")
        if any(m != meta for m, _ in metas):
            shapes = {r: m for r, (m, _) in enumerate(metas)}
            raise _fail(op, "storage", "the same (rows, hidden, dtype, scales) on every rank", shapes)
        table = EngramTable(*meta[:5], sf_offset=meta[5])
        host = self.memory.host
        host[:storage.numel() * storage.element_size()].copy_(storage.detach().contiguous().view(torch.uint8)
                                                              .reshape(-1), non_blocking=False)
        if sf is not None:
            nbytes = sf.numel() * sf.element_size()
            host[table.sf_offset:table.sf_offset + nbytes].copy_(sf.detach().contiguous().view(torch.uint8)
                                                                 .reshape(-1))
        if host.device.type == "cuda":
            torch.cuda.synchronize(host.device)  # the rows are in host memory before any peer may read them
        self._engram = table
        self.buffer.barrier()

    def _engram_meta(self, op: str, storage: Tensor, sf: Tensor | None) -> tuple:
        if not isinstance(storage, Tensor) or storage.dim() != 2:
            raise _fail(op, "storage", "a 2-D [n, H_e] tensor", getattr(storage, "shape", type(storage).__name__))
        n, hidden = storage.shape
        sf_cols, sf_dtype = 0, None
        if sf is not None:
            if not isinstance(sf, Tensor) or sf.dim() != 2 or sf.shape[0] != n:
                raise _fail(op, "sf", f"None or a 2-D [n={n}, S] tensor", getattr(sf, "shape", type(sf).__name__))
            sf_cols, sf_dtype = sf.shape[1], sf.dtype
        table_bytes = storage.numel() * storage.element_size()
        sf_offset = -(-table_bytes // SF_ALIGNMENT_BYTES) * SF_ALIGNMENT_BYTES
        need = sf_offset + (sf.numel() * sf.element_size() if sf is not None else 0)
        capacity = self.memory.host.numel()
        if need > capacity:
            raise _fail(op, "storage", f"at most num_cpu_bytes (rounded to 2 MiB: {capacity}) bytes with its "
                        f"scales", f"{need} bytes")
        return n, hidden, storage.dtype, sf_cols, sf_dtype, sf_offset

    # ---------------------------------------------------------------- fetch
    def engram_fetch(self, indices: Tensor, num_qps: int = 0) -> EngramHook:
        """Gather entries by global id from every rank's table (`engram_write` first).

        Args:
            indices: ``[T, P]`` int32 global entry ids in ``[0, num_ranks * n)``, on the buffer's device.
            num_qps: accepted (no RDMA queue pairs).

        Returns:
            An `EngramHook`; calling it waits and returns ``(fetched [T, P, H_e] in the table's dtype,
            fetched_sf [T, P, S] or None)``, ``fetched[t, p]`` the row of entry ``indices[t, p]``.

        Raises ValueError naming ``indices`` (out-of-range ids: before any row is read) or ``num_qps``;
        RuntimeError before a table was written. Collectives path: a rank whose peer passed bad ids raises
        RuntimeError naming it; a peer that does not come raises TimeoutError after ``num_cpu_timeout_secs``.
        """
        op = "ElasticBuffer.engram_fetch"
        self._check_live("engram_fetch")
        check_positive_int(op, "num_qps", num_qps, 0)
        table = self._engram
        if table is None:
            raise RuntimeError(f"ep_moe.{op}: no table: call engram_write on every rank first")
        device = self.memory.host.device
        if not isinstance(indices, Tensor) or indices.dtype != torch.int32 or indices.dim() != 2:
            raise _fail(op, "indices", "a 2-D [T, P] int32 tensor",
                        f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, Tensor)
                        else type(indices).__name__)
        if indices.device.type != device.type:
            raise _fail(op, "indices", f"on device {device}", indices.device)
        total = self.num_ranks * table.num_entries
        flat = indices.reshape(-1).to(torch.int64)
        bad = None
        if flat.numel():
            low, high = int(flat.min()), int(flat.max())  # a host read: the check precedes every row read
            if low < 0 or high >= total:
                bad = _fail(op, "indices", f"global entry ids in [0, {total}) ({self.num_ranks} ranks x "
                            f"{table.num_entries} entries)", f"ids in [{low}, {high}]")
        T, P = indices.shape
        if self.memory.all_host_segments_mapped():
            if bad is not None:
                raise bad
            return self._fetch_direct(table, flat, T, P)
        return self._fetch_collective(op, table, flat, T, P, bad)

    def _split(self, table: EngramTable, rows: Tensor, T: int, P: int) -> tuple[Tensor, Tensor | None]:
        """``[T * P, row_bytes (+ sf_row_bytes)]`` uint8 -> ``(fetched, fetched_sf)``."""
        fetched = rows[:, :table.row_bytes].contiguous().view(table.dtype).view(T, P, table.hidden)
        if table.sf_dtype is None:
            return fetched, None
        fetched_sf = rows[:, table.row_bytes:].contiguous().view(table.sf_dtype).view(T, P, table.sf_cols)
        return fetched, fetched_sf

    def _fetch_direct(self, table: EngramTable, flat: Tensor, T: int, P: int) -> EngramHook:
        memory = self.memory
        span = memory.host_span()
        segment_bytes = memory.layout.segments[1].size
        event = None
        cuda = span.device.type == "cuda"
        if cuda:
            if self._engram_stream is None:
                self._engram_stream = torch.cuda.Stream(span.device)
            self._engram_stream.wait_stream(torch.cuda.current_stream())
            flat.record_stream(self._engram_stream)
        with torch.cuda.stream(self._engram_stream) if cuda else contextlib.nullcontext():
            owner, row = flat // table.num_entries, flat % table.num_entries
            fetched = _gather_rows(span, segment_bytes, 0, table.num_entries, table.row_bytes, owner, row)
            fetched = fetched.view(table.dtype).view(T, P, table.hidden)
            fetched_sf = None
            if table.sf_dtype is not None:
                fetched_sf = _gather_rows(span, segment_bytes, table.sf_offset, table.num_entries,
                                          table.sf_row_bytes, owner, row)
                fetched_sf = fetched_sf.view(table.sf_dtype).view(T, P, table.sf_cols)
            if cuda:
                event = torch.cuda.Event()
                event.record(self._engram_stream)
        return EngramHook(fetched, fetched_sf, event)

    def _wait_work(self, work, stage: str) -> None:
        wait_work(work, self.memory.host.device, float(self.num_cpu_timeout_secs), TimeoutError, "engram_fetch",
                  self.rank, self.num_ranks, stage)

    def _all_to_all(self, out: Tensor, send: Tensor, out_counts: list[int] | None, send_counts: list[int] | None,
                    stage: str) -> Tensor:
        # every rank joins, even with nothing to send or receive: the peers' exchange is the same collective
        self._wait_work(dist.all_to_all_single(out, send, out_counts, send_counts, group=self.group, async_op=True),
                        stage)
        return out

    def _fetch_collective(self, op: str, table: EngramTable, flat: Tensor, T: int, P: int,
                          bad: ValueError | None) -> EngramHook:
        R, n, device = self.num_ranks, table.num_entries, flat.device
        owner = flat // n
        if bad is None:
            order = torch.argsort(owner, stable=True)
            send_counts = torch.bincount(owner, minlength=R)
        else:  # tell the peers, so they raise too instead of waiting for ids that never come
            send_counts = torch.full((R,), -1, dtype=torch.int64, device=device)
        recv_counts = self._all_to_all(torch.empty(R, dtype=torch.int64, device=device), send_counts, None, None,
                                       "engram_fetch/counts")
        if bad is not None:
            raise bad
        recv_list, send_list = recv_counts.tolist(), send_counts.tolist()
        if min(recv_list) < 0:
            peers = [r for r, c in enumerate(recv_list) if c < 0]
            raise RuntimeError(f"ep_moe.{op}: rank(s) {peers} passed out-of-range indices (rank {self.rank} "
                               f"stops before reading any row)")
        requested = self._all_to_all(torch.empty(sum(recv_list), dtype=torch.int64, device=device),
                                     flat[order] % n, recv_list, send_list, "engram_fetch/ids")
        host = self.memory.host
        rows = host[:n * table.row_bytes].view(n, table.row_bytes)[requested]
        if table.sf_dtype is not None:
            sf_rows = host[table.sf_offset:table.sf_offset + n * table.sf_row_bytes].view(n, table.sf_row_bytes)
            rows = torch.cat([rows, sf_rows[requested]], dim=1)
        width = table.row_bytes + table.sf_row_bytes
        back = torch.empty(flat.numel(), width, dtype=torch.uint8, device=device)
        self._all_to_all(back, rows.contiguous(), send_list, recv_list, "engram_fetch/rows")
        out = torch.empty_like(back)
        out[order] = back
        return EngramHook(*self._split(table, out, T, P), None)


__all__ = ["EngramHook", "EngramMixin", "EngramTable", "SF_ALIGNMENT_BYTES"]
