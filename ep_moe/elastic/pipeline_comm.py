"""Pipeline-parallel send/recv between ring neighbours: the ``pp_*`` methods of `ep_moe.ElasticBuffer`
(DeepEP V2's API), as the mixin `PipelineCommMixin`.

Rank ``r`` of a group of ``R`` talks to its two neighbours only: prev ``(r - 1) % R`` and next ``(r + 1) % R``
(one peer at ``R = 2``, itself at ``R = 1``). `PipelineCommMixin.pp_set_config` reserves, per direction (send,
recv) and per neighbour, ``num_max_inflight_tensors`` slots of ``num_max_tensor_bytes`` rounded up to 32 bytes.
Messages between two ranks arrive in the order they were sent; a send copies its tensor into a free send slot and
returns (the caller may reuse the tensor at once); when every slot to that peer holds a message the peer has not
received yet, the next send waits (up to the buffer's timeout) for the peer's matching recv to free the oldest.

Transports (`pp_transport`): ``"torch"``, torch.distributed point-to-point over the buffer's group; ``"native"``
(the native backend's default), the copy engine writes header and payload into the peer's slot of a symmetric
buffer and a stream memory operation raises the slot's flag, no kernel on the SMs
(`ep_moe.native.stream_transport`, docs/native.md). A message is a header of `HEADER_LEN` int64 (sender, sequence
number, dtype, shape, slot config) and then the payload; the receiver checks the header against its own tensor
before it takes the payload, so a disagreement raises `PPMismatchError` naming both sides instead of a transfer of
mismatched size. The header is read on the host: on a GPU a recv waits on the host once, for the message's
arrival (native: not for the work queued before on its stream; torch: for its stream).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..buffer.argument_checks import check_positive_int
from .memory.segment_layout import ALIGNMENT_BYTES
from .peer_wait import wait_work
from .transport_choice import choose_transport
from .wire_format import (
    byte_view,
    check_wire_tensor,
    dtype_code,
    dtype_name,
    host_header,
    round_up,
)

HEADER_LEN = 16
_MAGIC = 0x5050_4550  # "PPEP": a message of this module
# Header slots.
_H_MAGIC, _H_SRC, _H_SEQ, _H_DTYPE, _H_NBYTES, _H_SLOT, _H_INFLIGHT, _H_NDIM, _H_DIMS = range(9)


class PPError(RuntimeError):
    """Base of the pipeline send/recv errors."""


class PPConfigError(PPError, ValueError):
    """``pp_set_config`` arguments out of range or over the buffer, or a send/recv before ``pp_set_config``."""


class PPPeerError(PPError, ValueError):
    """A send to or recv from a rank that is not one of the two ring neighbours."""


class PPTensorError(PPError, ValueError):
    """A tensor that cannot travel: not a tensor, another device, over the slot size, too many dims."""


class PPMismatchError(PPError, ValueError):
    """The sender's tensor (or slot config, or message order) differs from what the receiver expects."""


class PPSlotsFullError(PPError):
    """One rank (``R = 1``): every slot to itself holds a message, and only its own recv can free one."""


class PPTimeoutError(PPError, TimeoutError):
    """A peer did not post its side within the buffer's timeout (the message names rank and stage)."""


def pp_transport(backend_name: str, requested: str | None = None) -> str:
    """The transport PP uses on a buffer of ``backend_name`` (`ep_moe.elastic.transport_choice.choose_transport`): ``"native"`` (copy
    engine + stream memory operations) on the native backend, ``"torch"`` elsewhere or when ``requested`` (else
    ``$EP_MOE_PPAGRS_TRANSPORT``) is ``"torch"``. Raises `PPConfigError` for a bad ``requested``."""
    try:
        return choose_transport(backend_name, requested, "pp_set_config")
    except ValueError as exc:
        raise PPConfigError(str(exc)) from None


@dataclass
class _Outgoing:
    """A message in flight to one peer: its slot and the works (and header tensor) that must finish before the
    slot is free."""

    seq: int
    slot: int
    works: list
    header: torch.Tensor


@dataclass
class _Channel:
    """One neighbour: our send slots to it, our recv slots from it, and the counters that keep order."""

    send_slots: torch.Tensor            # [inflight, slot_bytes] uint8
    recv_slots: torch.Tensor            # [inflight, slot_bytes] uint8 (landing area of a non-contiguous x)
    in_flight: deque = field(default_factory=deque)  # _Outgoing, oldest first
    next_send_seq: int = 0
    next_recv_seq: int = 0
    loopback: deque = field(default_factory=deque)   # R = 1: (header values, slot) sent to itself


@dataclass
class _PPState:
    transport: str
    slot_bytes: int
    inflight: int
    channels: dict[int, _Channel]
    native: object = None  # ep_moe.native.stream_transport.PPStreamTransport on the native transport


def _pp_slot_bytes(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
    """Bytes of the PP slots: per direction (send, recv) and per neighbour (prev, next), the in-flight slots of
    ``num_max_tensor_bytes`` rounded up to 32."""
    for name, value in (("num_max_tensor_bytes", num_max_tensor_bytes),
                        ("num_max_inflight_tensors", num_max_inflight_tensors)):
        check_positive_int("ElasticBuffer.get_pp_buffer_size_hint", name, value, 1)
    return round_up(num_max_tensor_bytes) * num_max_inflight_tensors * 2 * 2


class PipelineCommMixin:
    """``pp_set_config`` / ``pp_send`` / ``pp_recv`` for `ep_moe.ElasticBuffer`.

    Uses the host's ``group``, ``rank``, ``num_ranks``, ``num_bytes``, ``buffer`` (device, backend name),
    ``num_gpu_timeout_secs`` (every wait's deadline) and ``_check_live``.
    """

    _pp: _PPState | None = None
    _pp_retired: list | None = None  # native transports of earlier configurations (freed by `_pp_release`)

    # ---------------------------------------------------------------- public API
    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """The ``num_bytes`` a buffer needs for `pp_set_config` with these values.

        Args:
            num_max_tensor_bytes: the largest message, in bytes.
            num_max_inflight_tensors: the slots per direction and neighbour.

        Returns:
            The slots' bytes (see `pp_set_config`) rounded up to 2 MiB, as V2.
        """
        return round_up(_pp_slot_bytes(num_max_tensor_bytes, num_max_inflight_tensors), ALIGNMENT_BYTES)

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int, *,
                      transport: str | None = None) -> None:
        """Reserve PP slots per direction (send, recv) and per neighbour (prev, next), on the buffer's device.

        Every rank of the group should call it with the same values (a message carries the sender's config and
        the receiver refuses a different one). Outstanding sends are waited for first.

        Args:
            num_max_tensor_bytes: the slot size, rounded up to 32 bytes (int >= 1).
            num_max_inflight_tensors: slots per direction and neighbour (int >= 1).
            transport: (ep_moe, keyword only) ``"auto"``, ``"torch"`` or ``"native"`` (`pp_transport`), the same on
                every rank; None: ``$EP_MOE_PPAGRS_TRANSPORT``, else ``"auto"``. The native transport allocates a
                symmetric buffer, so there the call is collective (every rank of the group calls it) and the
                ranks' values must be equal (`PPConfigError` on every rank otherwise, before any message moves).

        Raises:
            PPConfigError: a value below 1, or ``slot bytes x inflight x 2 x 2`` over the buffer's ``num_bytes``.
        """
        op = "pp_set_config"
        self._check_live(op)
        try:
            check_positive_int(f"ElasticBuffer.{op}", "num_max_tensor_bytes", num_max_tensor_bytes, 1)
            check_positive_int(f"ElasticBuffer.{op}", "num_max_inflight_tensors", num_max_inflight_tensors, 1)
        except ValueError as exc:
            raise PPConfigError(str(exc)) from None
        chosen = pp_transport(self.buffer.backend_name, transport)
        slot_bytes = round_up(num_max_tensor_bytes)
        total = _pp_slot_bytes(num_max_tensor_bytes, num_max_inflight_tensors)
        if total > self.num_bytes:
            raise PPConfigError(
                f"ep_moe.ElasticBuffer.{op}: {slot_bytes} bytes per slot (num_max_tensor_bytes={num_max_tensor_bytes} "
                f"rounded up to 32) x num_max_inflight_tensors={num_max_inflight_tensors} x 2 directions x 2 "
                f"neighbours = {total} bytes exceeds the buffer's num_bytes={self.num_bytes}")
        previous = self._pp
        if previous is not None:
            for peer, channel in previous.channels.items():
                pending = (len(channel.loopback) if previous.native is None
                           else channel.next_send_seq - channel.next_recv_seq if peer == self.rank else 0)
                if pending:
                    raise PPConfigError(f"ep_moe.ElasticBuffer.{op}: {pending} message(s) this rank sent "
                                        "to itself are not received yet (pp_recv them first)")
                if previous.native is not None:
                    if peer != self.rank:
                        previous.native.drain(peer, channel.next_send_seq, PPTimeoutError, op,
                                              f"pp_set_config: waiting for rank {peer} to pp_recv message "
                                              f"#{channel.next_send_seq - 1}")
                    continue
                while channel.in_flight:
                    self._pp_retire_oldest(op, peer, channel)
        device = self.buffer.device
        native = chosen == "native"
        channels = {}
        for peer in self._pp_neighbours():
            old = previous.channels.get(peer) if previous is not None else None
            rows = 0 if native else num_max_inflight_tensors  # the native slots live in the symmetric buffer
            channel = _Channel(send_slots=torch.empty(rows, slot_bytes, dtype=torch.uint8, device=device),
                               recv_slots=torch.empty(rows, slot_bytes, dtype=torch.uint8, device=device))
            if old is not None:  # message numbers continue: the peers' counters do not restart
                channel.next_send_seq, channel.next_recv_seq = old.next_send_seq, old.next_recv_seq
            channels[peer] = channel
        state = _PPState(chosen, slot_bytes, num_max_inflight_tensors, channels)
        if native:
            state.native = self._pp_native_transport(op, slot_bytes, num_max_inflight_tensors, channels)
        if previous is not None and previous.native is not None:
            self._pp_retired = [*(self._pp_retired or []), previous.native]
        self._pp = state

    def pp_send(self, x: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Send ``x`` to a neighbour; returns once the message is posted, and ``x`` may be changed at once.

        When all ``num_max_inflight_tensors`` slots to that peer hold messages it has not received, waits for the
        oldest to be received.

        Args:
            x: any shape up to 8 dims, any dtype with a header code, on the buffer's device, at most the slot's
                bytes; copied into a send slot.
            dst_rank_idx: the neighbour, a rank index in the group: ``(r + 1) % R`` or ``(r - 1) % R``.
            num_sms: accepted (the native transport takes no SMs; torch's uses its group's own).

        Raises:
            PPConfigError: no ``pp_set_config``. PPPeerError: not a neighbour. PPTensorError: a bad ``x``.
                All before anything is sent.
            PPTimeoutError: the wait for a slot past ``num_gpu_timeout_secs`` (naming rank and stage).
        """
        op = "pp_send"
        state, channel = self._pp_prepare(op, x, dst_rank_idx, "dst_rank_idx", num_sms)
        nbytes = x.numel() * x.element_size()
        if nbytes > state.slot_bytes:
            raise PPTensorError(f"ep_moe.ElasticBuffer.{op}: argument 'x' must fit a slot of {state.slot_bytes} "
                                f"bytes (pp_set_config's num_max_tensor_bytes), got {nbytes} bytes "
                                f"({x.dtype}{tuple(x.shape)})")
        if state.native is None and len(channel.in_flight) + len(channel.loopback) >= state.inflight:
            if dst_rank_idx == self.rank:
                raise PPSlotsFullError(f"ep_moe.ElasticBuffer.{op}: all {state.inflight} slots of rank {self.rank} to "
                                       "itself hold messages it has not received (pp_recv them first)")
            self._pp_retire_oldest(op, dst_rank_idx, channel)
        values = [_MAGIC, self.rank, channel.next_send_seq, dtype_code(x.dtype), nbytes, state.slot_bytes,
                  state.inflight, x.dim(), *x.shape]
        if state.native is not None:
            self._pp_send_native(op, state, channel, x, dst_rank_idx, values)
            return
        seq = channel.next_send_seq
        slot = seq % state.inflight
        staged = channel.send_slots[slot, :nbytes]
        if nbytes:
            staged.copy_(byte_view(x.contiguous()))
        channel.next_send_seq += 1
        if dst_rank_idx == self.rank:
            channel.loopback.append((values, slot))
            return
        header = host_header(values, HEADER_LEN, self.buffer.device)
        works = [dist.isend(header, group=self.group, group_dst=dst_rank_idx)]
        if nbytes:
            works.append(dist.isend(staged, group=self.group, group_dst=dst_rank_idx))
        channel.in_flight.append(_Outgoing(seq, slot, works, header))

    def pp_recv(self, x: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Receive the next message from a neighbour into ``x`` (in place).

        Args:
            x: the sender's dtype and shape (any strides), on the buffer's device.
            src_rank_idx: the neighbour, a rank index in the group: ``(r + 1) % R`` or ``(r - 1) % R``.
            num_sms: accepted (the native transport takes no SMs; torch's uses its group's own).

        Raises:
            PPConfigError, PPPeerError, PPTensorError: as `pp_send`.
            PPMismatchError: ``x``'s dtype or shape is not the sender's, naming both sides (the message is taken
                and dropped, so the order of later messages holds).
            PPTimeoutError: no message within ``num_gpu_timeout_secs`` (naming rank and stage).
        """
        op = "pp_recv"
        state, channel = self._pp_prepare(op, x, src_rank_idx, "src_rank_idx", num_sms)
        seq = channel.next_recv_seq
        where = f"message #{seq} from rank {src_rank_idx}"
        if state.native is not None:
            self._pp_recv_native(op, state, channel, x, src_rank_idx)
            return
        if src_rank_idx == self.rank:
            if not channel.loopback:
                raise PPTimeoutError(f"ep_moe.ElasticBuffer.{op}: rank {self.rank} of 1 in stage 'pp_recv {where}': "
                                     "no message to itself is pending (it would wait forever)")
            values, slot = channel.loopback.popleft()
            channel.next_recv_seq += 1
            problems = self._pp_header_problems(values, x, seq, src_rank_idx, state)
            if problems:
                raise PPMismatchError(f"ep_moe.ElasticBuffer.{op}: sender and receiver disagree on message #{seq} "
                                      f"from rank {src_rank_idx} to rank {self.rank}: " + "; ".join(problems))
            self._pp_fill(x, channel.send_slots[slot, :values[_H_NBYTES]])
            return
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.buffer.device)
        work = dist.irecv(header, group=self.group, group_src=src_rank_idx)
        self._pp_wait(op, work, f"pp_recv header of {where}")
        values = header.tolist()
        channel.next_recv_seq += 1
        if values[_H_MAGIC] != _MAGIC:
            raise PPMismatchError(f"ep_moe.ElasticBuffer.{op}: rank {self.rank} received from rank {src_rank_idx} a "
                                  "message that is not a pp_send (another transfer between the two ranks?)")
        nbytes = values[_H_NBYTES]
        problems = self._pp_header_problems(values, x, seq, src_rank_idx, state)
        if problems:  # take the payload aside (the sender has posted it), so that later messages stay in order
            if nbytes:
                scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.buffer.device)
                self._pp_wait(op, dist.irecv(scratch, group=self.group, group_src=src_rank_idx),
                              f"pp_recv payload of {where}")
            raise PPMismatchError(f"ep_moe.ElasticBuffer.{op}: sender and receiver disagree on message #{seq} "
                                  f"from rank {src_rank_idx} to rank {self.rank}: " + "; ".join(problems))
        if not nbytes:
            return
        direct = x.is_contiguous()
        landing = byte_view(x) if direct else channel.recv_slots[seq % state.inflight, :nbytes]
        self._pp_wait(op, dist.irecv(landing, group=self.group, group_src=src_rank_idx),
                      f"pp_recv payload of {where}")
        if not direct:
            self._pp_fill(x, landing)

    # ---------------------------------------------------------------- native transport
    def _pp_native_transport(self, op: str, slot_bytes: int, inflight: int, channels: dict[int, _Channel]):
        """A `PPStreamTransport` for this configuration, after checking that every rank asks for the same one."""
        from ..native.stream_transport import PPStreamTransport, shared_waiter

        configs: list = [None] * self.num_ranks
        dist.all_gather_object(configs, (slot_bytes, inflight), group=self.group)
        if len(set(configs)) > 1:
            described = ", ".join(f"rank {i}: {s}-byte slots x {n}" for i, (s, n) in enumerate(configs))
            raise PPConfigError(f"ep_moe.ElasticBuffer.{op}: the ranks configure different PP slots ({described}); "
                                "the native transport needs the same pp_set_config on every rank")
        waiter = shared_waiter(self, self.buffer.device, self.rank, self.num_ranks, float(self.num_gpu_timeout_secs))
        waiter.check(PPTimeoutError, op)
        bases = {peer: (c.next_send_seq, c.next_recv_seq) for peer, c in channels.items()}
        return PPStreamTransport(self.group, self.buffer.device, self.rank, self.num_ranks, slot_bytes, inflight,
                                 bases, waiter)

    def _pp_send_native(self, op: str, state: _PPState, channel: _Channel, x: torch.Tensor, dst: int,
                        values: list[int]) -> None:
        native = state.native
        native.waiter.check(PPTimeoutError, op)
        seq = channel.next_send_seq
        if dst == self.rank and seq - channel.next_recv_seq >= state.inflight:
            raise PPSlotsFullError(f"ep_moe.ElasticBuffer.{op}: all {state.inflight} slots of rank {self.rank} to "
                                   "itself hold messages it has not received (pp_recv them first)")
        native.wait_free(dst, seq, PPTimeoutError, op,
                         f"pp_send to rank {dst}: waiting for rank {dst} to pp_recv message #{seq - state.inflight} "
                         f"(all {state.inflight} slots in flight)")
        payload = byte_view(x.contiguous()) if x.numel() else torch.empty(0, dtype=torch.uint8, device=x.device)
        native.post(dst, seq, values, payload)
        channel.next_send_seq += 1

    def _pp_recv_native(self, op: str, state: _PPState, channel: _Channel, x: torch.Tensor, src: int) -> None:
        native = state.native
        native.waiter.check(PPTimeoutError, op)
        seq = channel.next_recv_seq
        where = f"message #{seq} from rank {src}"
        if src == self.rank and channel.next_send_seq <= seq:
            raise PPTimeoutError(f"ep_moe.ElasticBuffer.{op}: rank {self.rank} of 1 in stage 'pp_recv {where}': "
                                 "no message to itself is pending (it would wait forever)")
        values = native.take_header(src, seq, PPTimeoutError, op, f"pp_recv header of {where}")
        channel.next_recv_seq += 1
        if values[_H_MAGIC] != _MAGIC:
            native.release(src, seq)
            raise PPMismatchError(f"ep_moe.ElasticBuffer.{op}: rank {self.rank} received from rank {src} a "
                                  "message that is not a pp_send (another transfer between the two ranks?)")
        problems = self._pp_header_problems(values, x, seq, src, state)
        if problems:  # the slot is freed without a copy, so that later messages stay in order
            native.release(src, seq)
            raise PPMismatchError(f"ep_moe.ElasticBuffer.{op}: sender and receiver disagree on message #{seq} "
                                  f"from rank {src} to rank {self.rank}: " + "; ".join(problems))
        nbytes = values[_H_NBYTES]
        if nbytes:
            self._pp_fill(x, native.payload(src, seq, nbytes))
        native.release(src, seq)

    def _pp_release(self) -> None:
        """Free the native transports' symmetric buffers (`ElasticBuffer.destroy`)."""
        transports = [*(self._pp_retired or []), *([self._pp.native] if self._pp is not None else [])]
        self._pp_retired, self._pp = [], None
        if transports:  # the native module is imported only by a buffer that used a transport
            from ..native.stream_transport import destroy_transports

            destroy_transports(self, transports)

    # ---------------------------------------------------------------- helpers
    def _pp_neighbours(self) -> list[int]:
        return sorted({(self.rank - 1) % self.num_ranks, (self.rank + 1) % self.num_ranks})

    def _pp_prepare(self, op: str, x: object, peer: object, peer_arg: str, num_sms: object
                    ) -> tuple[_PPState, _Channel]:
        self._check_live(op)
        state = self._pp
        if state is None:
            raise PPConfigError(f"ep_moe.ElasticBuffer.{op}: call pp_set_config(num_max_tensor_bytes, "
                                "num_max_inflight_tensors) first")
        if isinstance(peer, bool) or not isinstance(peer, int) or peer not in state.channels:
            raise PPPeerError(f"ep_moe.ElasticBuffer.{op}: argument '{peer_arg}' must be a ring neighbour of rank "
                              f"{self.rank} (prev {(self.rank - 1) % self.num_ranks} or next "
                              f"{(self.rank + 1) % self.num_ranks} of {self.num_ranks}), got {peer!r}")
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0:
            raise PPConfigError(f"ep_moe.ElasticBuffer.{op}: argument 'num_sms' must be an int >= 0, got {num_sms!r}")
        check_wire_tensor(PPTensorError, "PP", op, "x", x, self.buffer.device)
        return state, state.channels[peer]

    def _pp_wait(self, op: str, work, stage: str) -> None:
        wait_work(work, self.buffer.device, float(self.num_gpu_timeout_secs), PPTimeoutError, op, self.rank,
                  self.num_ranks, stage)

    def _pp_retire_oldest(self, op: str, peer: int, channel: _Channel) -> None:
        """Wait until ``peer`` has received our oldest message to it, freeing its slot."""
        oldest = channel.in_flight[0]
        for work in oldest.works:
            self._pp_wait(op, work, f"pp_send to rank {peer}: waiting for rank {peer} to pp_recv message "
                          f"#{oldest.seq} (all {len(channel.in_flight)} slots in flight)")
        channel.in_flight.popleft()

    def _pp_header_problems(self, values: list[int], x: torch.Tensor, seq: int, src: int,
                            state: _PPState) -> list[str]:
        """What the sender's header and the receiver's ``x`` and config disagree on (empty: nothing)."""
        ndim = values[_H_NDIM]
        sent_shape = tuple(values[_H_DIMS:_H_DIMS + ndim])
        problems = []
        if values[_H_SEQ] != seq:
            problems.append(f"message number: rank {src} sent #{values[_H_SEQ]}, rank {self.rank} expects #{seq}")
        if (values[_H_SLOT], values[_H_INFLIGHT]) != (state.slot_bytes, state.inflight):
            problems.append(f"pp_set_config: rank {src} has {values[_H_SLOT]}-byte slots x {values[_H_INFLIGHT]}, "
                            f"rank {self.rank} has {state.slot_bytes}-byte slots x {state.inflight}")
        if values[_H_DTYPE] != dtype_code(x.dtype) or sent_shape != tuple(x.shape):
            problems.append(f"tensor: rank {src} sent {dtype_name(values[_H_DTYPE])}{sent_shape}, rank {self.rank} "
                            f"receives into {x.dtype}{tuple(x.shape)}")
        return problems

    @staticmethod
    def _pp_fill(x: torch.Tensor, payload: torch.Tensor) -> None:
        if payload.numel():
            x.copy_(payload.view(x.dtype).view(x.shape))


__all__ = ["HEADER_LEN", "PPConfigError", "PPError", "PPMismatchError", "PPPeerError", "PPSlotsFullError",
           "PPTensorError", "PPTimeoutError", "PipelineCommMixin", "pp_transport"]
