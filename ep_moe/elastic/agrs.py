"""All-gather / reduce-scatter sessions (AGRS) of `ep_moe.ElasticBuffer` (DeepEP V2's API), as the mixin `AGRSMixin`.

`AGRSMixin.agrs_set_config` allocates ``num_max_session_bytes`` (rounded up to 32) on the device, with room for at
most ``num_max_all_gathers_per_session`` operations per session (`create_agrs_session` .. `destroy_agrs_session`).
Each operation takes ``round_up(R x n, 32)`` bytes per ``n``-byte tensor, rank ``j``'s slot at ``j x n``.

* `agrs_get_inplace_tensor(shape, dtype)`: this rank's slot of a new chunk; `all_gather` gathers it without a copy.
* `all_gather(tensors)`: ``gathered[j] [R, *tensors[j].shape]``, a view of the session memory valid until the
  session is destroyed, and ``handle``; ``handle()`` waits until every peer's data has arrived.
* `reduce_scatter(tensor [R, *S])`: ``shard [*S]``, filled by ``handle()`` with ``((t_0[r] + t_1[r]) + ...)``,
  summed in fp32 (fp64 for fp64) in increasing rank order and rounded once to the input's dtype.
* `destroy_agrs_session()`: waits for the session's operations, then a group barrier; the memory is reused.

Every operation first all-gathers a header of `HEADER_LEN` int64 (numbers, tensor count, bytes, dtypes, shapes,
room left), so a disagreement or a full session raises the same named error on every rank before anything moves.

Transports (`agrs_transport`): with ``"torch"`` the rows move by torch.distributed collectives into the chunk
(``all_gather_into_tensor``, ``all_to_all_single``) and ``handle()`` makes the stream wait for them. With ``"native"``
(the native backend's default) each rank's copy engine writes into the peers' symmetric session memory
(`ep_moe.native.stream_transport`), the header also names each tensor's chunk, and ``handle()`` waits on the host
for the peers' rows. On a GPU the headers are read on the host (one wait per operation).

Contract and errors: docs/semantics.md, section "ElasticBuffer: PP and AGRS" (the native transport: docs/native.md;
V2's differences: docs/compat.md, section "All-gather / reduce-scatter sessions (AGRS)").
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..buffer.argument_checks import check_positive_int
from .memory.segment_layout import ALIGNMENT_BYTES
from .peer_wait import wait_work
from .transport_choice import choose_transport
from .wire_format import (
    MAX_DIMS,
    byte_view,
    check_wire_tensor,
    dtype_code,
    dtype_name,
    host_header,
    nbytes,
    round_up,
)

HEADER_LEN = 11 + MAX_DIMS
_MAGIC = 0x4147_5253  # "AGRS"
OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_DESTROY = 1, 2, 3
_OP_NAMES = {OP_ALL_GATHER: "all_gather", OP_REDUCE_SCATTER: "reduce_scatter", OP_DESTROY: "destroy_agrs_session"}
# Header slots (the dims of the first tensor follow). _H_PLACE: a digest of the chunks the tensors take.
(_H_MAGIC, _H_OP, _H_SESSION, _H_INDEX, _H_FULL, _H_COUNT, _H_BYTES, _H_DIGEST, _H_DTYPE, _H_NDIM, _H_PLACE,
 _H_DIMS) = range(12)
REDUCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class AGRSError(RuntimeError):
    """Base of the AGRS errors."""


class AGRSConfigError(AGRSError, ValueError):
    """``agrs_set_config`` arguments out of range or over the buffer, or a session before ``agrs_set_config``."""


class AGRSSessionError(AGRSError):
    """A call in the wrong session state: no session open, one already open, a tensor of the session memory that
    is not one of this session's unused in-place tensors."""


class AGRSTensorError(AGRSError, ValueError):
    """A tensor that cannot take part: not a tensor, another device, a dtype without a code, too many dims, a
    reduce-scatter input that is not ``[R, ...]`` floating point."""


class AGRSCapacityError(AGRSError, ValueError):
    """The operation would use more than the session's bytes or operations (on some rank)."""


class AGRSMismatchError(AGRSError, ValueError):
    """The ranks called different operations or with different tensors."""


class AGRSTimeoutError(AGRSError, TimeoutError):
    """A peer did not join an operation within the buffer's timeout (the message names rank and stage)."""


def agrs_transport(backend_name: str, requested: str | None = None) -> str:
    """The transport AGRS uses on a buffer of ``backend_name`` (`ep_moe.elastic.transport_choice.choose_transport`):
    ``"native"`` (copy engine + stream memory operations) on the native backend, ``"torch"`` elsewhere or when
    ``requested`` (else ``$EP_MOE_PPAGRS_TRANSPORT``) is ``"torch"``. Raises `AGRSConfigError` for a bad
    ``requested``."""
    try:
        return choose_transport(backend_name, requested, "agrs_set_config")
    except ValueError as exc:
        raise AGRSConfigError(str(exc)) from None


class AGRSHandle:
    """What `all_gather` / `reduce_scatter` return beside their tensors: call it (or `wait`) to wait until every
    peer's data has arrived (and, for a reduce-scatter, the shard is summed). Idempotent; waits up to the buffer's
    timeout (`AGRSTimeoutError` naming rank and stage)."""

    def __init__(self, owner: AGRSMixin, op: str, works: list, stage: str, finish=None, keep=None) -> None:
        self._owner, self._op, self._works, self._stage, self._finish = owner, op, works, stage, finish
        self._keep = keep  # a tensor the collective still reads (the reduce-scatter's padded send rows)
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for work in self._works:
            self._owner._agrs_wait(self._op, work, self._stage)
        if self._finish is not None:
            self._finish()
        self.done = True
        self._works, self._finish, self._keep = [], None, None

    __call__ = wait


@dataclass
class _Inplace:
    chunk: int     # byte offset of the chunk in the session memory
    stride: int    # bytes of one rank's slot (the tensor's bytes)
    shape: tuple
    dtype: torch.dtype
    data_ptr: int


@dataclass
class _AGRSState:
    transport: str
    session_bytes: int            # the whole session's chunks, rounded
    max_ops: int
    memory: torch.Tensor          # [>= session_bytes] uint8
    session: int = 0              # number of the open session (1, 2, ...); 0 before the first
    open: bool = False
    used: int = 0                 # bytes of the chunks taken in the open session
    ops: int = 0                  # operations run in the open session
    inplace: list = field(default_factory=list)   # unused _Inplace of the open session
    handles: list = field(default_factory=list)   # AGRSHandle of the open session
    native: object = None         # ep_moe.native.stream_transport.AGRSStreamTransport on the native transport


def _digest(tensors: list[tuple[tuple, torch.dtype]]) -> int:
    """A stable 31-bit digest of dtypes and shapes (the same on every process)."""
    return zlib.crc32(repr([(dtype_code(d), tuple(s)) for s, d in tensors]).encode()) & 0x7FFF_FFFF


def _place_digest(chunks: list[tuple[int, int]]) -> int:
    """A stable 31-bit digest of an operation's (chunk offset, slot stride) pairs."""
    return zlib.crc32(repr(chunks).encode()) & 0x7FFF_FFFF


class AGRSMixin:
    """AGRS sessions for `ep_moe.ElasticBuffer`.

    Uses the host's ``group``, ``rank``, ``num_ranks``, ``num_bytes``, ``buffer`` (device, backend name),
    ``num_gpu_timeout_secs`` (every wait's deadline) and ``_check_live``.
    """

    _agrs: _AGRSState | None = None
    _agrs_retired: list | None = None  # native transports of earlier configurations (freed by `_agrs_release`)

    # ---------------------------------------------------------------- public API
    @staticmethod
    def get_agrs_num_max_session_bytes(group: dist.ProcessGroup | None, shapes, dtype: torch.dtype) -> int:
        """The session bytes that gathering tensors of these shapes takes on a group (DeepEP V2's formula).

        Args:
            group: the group (None: the world); only its size R counts.
            shapes: one shape, or a sequence of shapes.
            dtype: the tensors' dtype.

        Returns:
            The sum over the shapes of ``round_up(R x bytes, 32)``: the chunks this session memory hands out.
        """
        if isinstance(shapes, tuple | list | torch.Size) and shapes and isinstance(shapes[0], int):
            shapes = (shapes,)
        num_ranks = dist.get_world_size(group)
        return sum(round_up(num_ranks * nbytes(tuple(s), dtype)) for s in shapes)

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup | None, num_max_session_bytes: int) -> int:
        """The ``num_bytes`` a buffer needs for AGRS sessions of this size (V2's).

        Args:
            group: accepted as V2's, unused.
            num_max_session_bytes: a session's bytes (`get_agrs_num_max_session_bytes`), an int >= 0.

        Returns:
            ``num_max_session_bytes`` rounded up to 2 MiB (the session memory is separate here, so only the check
            against ``num_bytes`` reads it).

        Raises:
            ValueError: ``num_max_session_bytes`` is not an int >= 0.
        """
        check_positive_int("ElasticBuffer.get_agrs_buffer_size_hint", "num_max_session_bytes",
                           num_max_session_bytes, 0)
        return round_up(num_max_session_bytes, ALIGNMENT_BYTES)

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int, *,
                        transport: str | None = None) -> None:
        """Allocate the AGRS session memory on the buffer's device.

        Every rank should call it with the same values (a full session on one rank raises on all).

        Args:
            num_max_session_bytes: the gathered bytes of one session as V2 counts them
                (`get_agrs_num_max_session_bytes`); ``round_up(num_max_session_bytes, 32)`` bytes are allocated.
            num_max_all_gathers_per_session: the operations a session may run (int >= 1).
            transport: (ep_moe, keyword only) ``"auto"``, ``"torch"`` or ``"native"`` (`agrs_transport`), the same
                on every rank; None: ``$EP_MOE_PPAGRS_TRANSPORT``, else ``"auto"``. The native transport allocates
                a symmetric buffer (of the largest of the ranks' values), so there the call is collective.

        Raises:
            AGRSConfigError: a value below 1, or the memory over the buffer's ``num_bytes``.
            AGRSSessionError: a session is open.
        """
        op = "agrs_set_config"
        self._check_live(op)
        try:
            check_positive_int(f"ElasticBuffer.{op}", "num_max_session_bytes", num_max_session_bytes, 1)
            check_positive_int(f"ElasticBuffer.{op}", "num_max_all_gathers_per_session",
                               num_max_all_gathers_per_session, 1)
        except ValueError as exc:
            raise AGRSConfigError(str(exc)) from None
        if self._agrs is not None and self._agrs.open:
            raise AGRSSessionError(f"ep_moe.ElasticBuffer.{op}: session {self._agrs.session} is open "
                                   "(destroy_agrs_session first)")
        total = round_up(num_max_session_bytes)
        if total > self.num_bytes:
            raise AGRSConfigError(
                f"ep_moe.ElasticBuffer.{op}: num_max_session_bytes={num_max_session_bytes} (rounded up to 32: "
                f"{total}) exceeds the buffer's num_bytes={self.num_bytes}")
        per_rank = round_up(-(-total // self.num_ranks))  # the native transport's memory is R equal parts
        chosen = agrs_transport(self.buffer.backend_name, transport)
        session = self._agrs.session if self._agrs is not None else 0
        native = None
        if chosen == "native":
            from ..native.stream_transport import AGRSStreamTransport, shared_waiter

            configs: list = [None] * self.num_ranks
            dist.all_gather_object(configs, (per_rank, num_max_all_gathers_per_session), group=self.group)
            waiter = shared_waiter(self, self.buffer.device, self.rank, self.num_ranks,
                                   float(self.num_gpu_timeout_secs))
            waiter.check(AGRSTimeoutError, op)
            native = AGRSStreamTransport(self.group, self.buffer.device, self.rank, self.num_ranks,
                                         max(c[0] for c in configs), max(c[1] for c in configs), HEADER_LEN, waiter)
            memory = native.data
        else:
            memory = torch.empty(total, dtype=torch.uint8, device=self.buffer.device)
        if self._agrs is not None and self._agrs.native is not None:
            self._agrs_retired = [*(self._agrs_retired or []), self._agrs.native]
        self._agrs = _AGRSState(chosen, total, num_max_all_gathers_per_session, memory, session, native=native)

    def create_agrs_session(self) -> int:
        """Open an AGRS session; local (no communication).

        Returns:
            The session's number, 1, 2, ...

        Raises:
            AGRSConfigError: before `agrs_set_config`. AGRSSessionError: while one is open.
        """
        state = self._agrs_state("create_agrs_session", want_open=False)
        state.session += 1
        state.open, state.used, state.ops, state.inplace, state.handles = True, 0, 0, [], []
        return state.session

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True):
        """A session for a ``with`` block (DeepEP V2's context manager): ``with buffer.agrs_new_session(): ...``.

        An exception inside leaves the session open (destroying it is collective, and the peers may not get there).

        Args:
            enabled: True: `create_agrs_session` on entry and `destroy_agrs_session` on a normal exit; False: nothing.

        Returns:
            The context manager; ``as`` gives the session's number (None when not ``enabled``).
        """
        if not enabled:
            yield None
            return
        session = self.create_agrs_session()
        yield session
        self.destroy_agrs_session()

    def agrs_get_inplace_tensor(self, shape, dtype: torch.dtype):
        """A tensor in this rank's slot of a new chunk of the session memory, for `all_gather` without a copy.

        Passing it to `all_gather` (once, in this session) gathers it without a local copy. It takes its bytes of
        the session now. Its content is undefined until written.

        Args:
            shape: a sequence of ints >= 0 (at most 8), or a list of shapes (DeepEP V2's batched form).
            dtype: a torch dtype AGRS carries.

        Returns:
            A contiguous ``shape`` tensor of ``dtype``; for a list of shapes, a tuple of such tensors, in order.

        Raises:
            AGRSCapacityError: the session's bytes are not there. AGRSTensorError: a bad ``shape`` or ``dtype``.
            AGRSSessionError: no session is open.
        """
        if isinstance(shape, list | tuple) and shape and all(isinstance(s, list | tuple | torch.Size) for s in shape):
            return tuple(self.agrs_get_inplace_tensor(s, dtype) for s in shape)
        op = "agrs_get_inplace_tensor"
        state = self._agrs_state(op, want_open=True)
        if not isinstance(shape, tuple | list | torch.Size) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise AGRSTensorError(f"ep_moe.ElasticBuffer.{op}: argument 'shape' must be a sequence of ints >= 0, "
                                  f"got {shape!r}")
        shape = tuple(shape)
        if not isinstance(dtype, torch.dtype) or dtype_code(dtype) == 0:
            raise AGRSTensorError(f"ep_moe.ElasticBuffer.{op}: argument 'dtype' must be a torch dtype AGRS carries, "
                                  f"got {dtype!r}")
        if len(shape) > MAX_DIMS:
            raise AGRSTensorError(f"ep_moe.ElasticBuffer.{op}: argument 'shape' must have at most {MAX_DIMS} dims, "
                                  f"got {len(shape)}")
        stride = nbytes(shape, dtype)
        cost = round_up(stride * self.num_ranks)
        if state.used + cost > state.session_bytes:
            raise AGRSCapacityError(f"ep_moe.ElasticBuffer.{op}: {cost} more bytes would exceed the "
                                    f"session's {state.session_bytes} (used {state.used}; agrs_set_config's "
                                    "num_max_session_bytes)")
        chunk = state.used
        state.used += cost
        own = state.memory[chunk + self.rank * stride: chunk + self.rank * stride + nbytes(shape, dtype)]
        tensor = own.view(dtype).view(shape) if own.numel() else torch.empty(shape, dtype=dtype,
                                                                             device=self.buffer.device)
        state.inplace.append(_Inplace(chunk, stride, shape, dtype, tensor.data_ptr() if own.numel() else -1))
        return tensor

    def all_gather(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...] | torch.Tensor
                   ) -> tuple[list[torch.Tensor] | torch.Tensor, AGRSHandle]:
        """Gather each of ``tensors`` from every rank, in one operation of the session.

        Args:
            tensors: a list or tuple of tensors, or one tensor (then ``(gathered tensor, handle)`` is returned, as
                DeepEP V2's single-tensor call). In-place tensors (`agrs_get_inplace_tensor`) are not copied;
                others are copied into this rank's slot. Every rank passes the same count, dtypes and shapes.

        Returns:
            ``(gathered, handle)``: ``gathered[j]`` is ``[R, *tensors[j].shape]`` of its dtype, ``gathered[j][i]``
            rank i's tensor, a view of the session memory. Read ``gathered`` after ``handle()``; it stays valid
            until `destroy_agrs_session`.

        Raises:
            AGRSMismatchError: the ranks' counts, dtypes or shapes differ (on every rank).
            AGRSCapacityError: over the session's bytes or operations on any rank (on every rank, before anything
                is sent).
            AGRSSessionError, AGRSTensorError: no open session; a bad tensor.
        """
        if isinstance(tensors, torch.Tensor):
            (gathered,), handle = self._all_gather([tensors])
            return gathered, handle
        return self._all_gather(tensors)

    def _all_gather(self, tensors) -> tuple[list[torch.Tensor], AGRSHandle]:
        op = "all_gather"
        state = self._agrs_state(op, want_open=True)
        if not isinstance(tensors, list | tuple) or not tensors:
            raise AGRSTensorError(f"ep_moe.ElasticBuffer.{op}: argument 'tensors' must be a non-empty list of "
                                  f"tensors, got {tensors!r}")
        plan, new_bytes = [], 0  # (tensor, in-place record, chunk, stride)
        for j, t in enumerate(tensors):
            self._agrs_check_tensor(op, f"tensors[{j}]", t)
            inplace = self._agrs_inplace_of(op, f"tensors[{j}]", t, state, taken=[p[1] for p in plan])
            if inplace is None:
                stride = t.numel() * t.element_size()
                plan.append((t, None, state.used + new_bytes, stride))
                new_bytes += round_up(stride * self.num_ranks)
            else:
                plan.append((t, inplace, inplace.chunk, inplace.stride))
        full = self._agrs_room(state, new_bytes)
        shapes = [(tuple(t.shape), t.dtype) for t in tensors]
        total = sum(t.numel() * t.element_size() for t in tensors)
        self._agrs_agree(op, state, OP_ALL_GATHER, shapes, total, full, new_bytes,
                         place=_place_digest([(chunk, stride) for _, _, chunk, stride in plan]))
        state.ops += 1
        state.used += new_bytes
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
        gathered, works, copies = [], [], []
        for t, inplace, chunk, stride in plan:
            size = t.numel() * t.element_size()
            if inplace is not None:
                state.inplace.remove(inplace)
            block = state.memory[chunk: chunk + self.num_ranks * stride]
            own = block[self.rank * stride: self.rank * stride + stride]
            if size and inplace is None:
                own[:size].copy_(byte_view(t.contiguous()))
            if size and state.native is None:
                works.append(gather(block, own, group=self.group, async_op=True))
            elif size:  # native: this rank's slot into the same chunk of every peer's session memory
                copies += [(j, chunk + self.rank * stride, own[:size]) for j in state.native.peers]
            rows = block.view(self.num_ranks, stride)[:, :size] if size else None
            gathered.append(rows.view(t.dtype).view(self.num_ranks, *t.shape) if size
                            else torch.empty((self.num_ranks, *t.shape), dtype=t.dtype, device=t.device))
        stage = f"all_gather #{state.ops} of session {state.session}: data"
        if state.native is not None:
            works = [self._agrs_send_native(op, state, copies, stage)]
        handle = AGRSHandle(self, op, works, stage)
        state.handles.append(handle)
        return gathered, handle

    def reduce_scatter(self, tensor: torch.Tensor) -> tuple[torch.Tensor, AGRSHandle]:
        """Sum a tensor over the ranks and scatter it: one operation of the session.

        The rows from every rank land in the session memory (``round_up(R x bytes of [*S], 32)`` bytes of it).

        Args:
            tensor: ``[R, *S]`` bf16/fp16/fp32/fp64.

        Returns:
            ``(shard, handle)``: rank r's ``shard`` (``[*S]``, the input's dtype) is ``sum over ranks j of
            tensor_j[r]``, added in fp32 (fp64 for fp64) in increasing rank order and rounded once, filled by
            ``handle()``.

        Raises:
            AGRSMismatchError, AGRSCapacityError, AGRSSessionError, AGRSTensorError: as `all_gather`.
        """
        op = "reduce_scatter"
        state = self._agrs_state(op, want_open=True)
        self._agrs_check_tensor(op, "tensor", tensor)
        if tensor.dtype not in REDUCE_DTYPES or tensor.dim() < 1 or tensor.shape[0] != self.num_ranks:
            raise AGRSTensorError(f"ep_moe.ElasticBuffer.{op}: argument 'tensor' must be [R={self.num_ranks}, ...] "
                                  f"of {' or '.join(map(str, REDUCE_DTYPES))}, got {tensor.dtype}{tuple(tensor.shape)}")
        self._agrs_inplace_of(op, "tensor", tensor, state, taken=[], allow=False)
        shard_shape = tuple(tensor.shape[1:])
        size = stride = nbytes(shard_shape, tensor.dtype)
        cost = round_up(size * self.num_ranks)
        full = self._agrs_room(state, cost)
        chunk = state.used
        self._agrs_agree(op, state, OP_REDUCE_SCATTER, [(tuple(tensor.shape), tensor.dtype)], size * self.num_ranks,
                         full, cost, place=_place_digest([(chunk, stride)]))
        state.ops += 1
        state.used += cost
        block = state.memory[chunk: chunk + self.num_ranks * stride]
        shard = torch.empty(shard_shape, dtype=tensor.dtype, device=tensor.device)
        works, finish, send = [], None, None
        stage = f"reduce_scatter #{state.ops} of session {state.session}: data"
        rows = tensor.contiguous().view(self.num_ranks, -1) if size else None
        if state.native is not None:  # row j into peer j's chunk, at this rank's slot; this rank's row locally
            row_bytes = rows.view(torch.uint8) if size else None
            if size:
                block[self.rank * stride: self.rank * stride + size].copy_(row_bytes[self.rank])
            works = [self._agrs_send_native(op, state, [(j, chunk + self.rank * stride, row_bytes[j])
                                                        for j in state.native.peers] if size else [], stage)]
        elif size:
            send = byte_view(rows)
            works.append(dist.all_to_all_single(block, send, group=self.group, async_op=True))
        if size:
            received = block.view(self.num_ranks, stride)[:, :size]
            acc_dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32

            def finish() -> None:
                parts = received.view(tensor.dtype).view(self.num_ranks, *shard_shape)
                acc = parts[0].to(acc_dtype, copy=True)
                for j in range(1, self.num_ranks):  # in increasing rank order, each add rounded to acc_dtype
                    acc.add_(parts[j].to(acc_dtype))
                shard.copy_(acc)

        handle = AGRSHandle(self, op, works, stage, finish, keep=send)
        state.handles.append(handle)
        return shard, handle

    def destroy_agrs_session(self) -> None:
        """Close the open session; its gathered views and in-place tensors are then invalid.

        Waits for its operations (as their handles would), then tells every peer that this rank is done with the
        session memory (a barrier of the group, checked: every rank closes the same session). The next session
        reuses the memory.

        Raises:
            AGRSSessionError: no session is open.
        """
        op = "destroy_agrs_session"
        state = self._agrs_state(op, want_open=True)
        for handle in state.handles:
            handle.wait()
        self._agrs_agree(op, state, OP_DESTROY, [], 0, 0, 0)
        state.open, state.used, state.ops, state.inplace, state.handles = False, 0, 0, [], []

    # ---------------------------------------------------------------- helpers
    def _agrs_state(self, op: str, want_open: bool) -> _AGRSState:
        self._check_live(op)
        state = self._agrs
        if state is None:
            raise AGRSConfigError(f"ep_moe.ElasticBuffer.{op}: call agrs_set_config(num_max_session_bytes, "
                                  "num_max_all_gathers_per_session) first")
        if want_open and not state.open:
            raise AGRSSessionError(f"ep_moe.ElasticBuffer.{op}: no AGRS session is open (create_agrs_session first)")
        if not want_open and state.open:
            raise AGRSSessionError(f"ep_moe.ElasticBuffer.{op}: session {state.session} is still open "
                                   "(destroy_agrs_session first)")
        if state.native is not None:
            state.native.waiter.check(AGRSTimeoutError, op)
        return state

    def _agrs_wait(self, op: str, work, stage: str) -> None:
        wait_work(work, self.buffer.device, float(self.num_gpu_timeout_secs), AGRSTimeoutError, op, self.rank,
                  self.num_ranks, stage)

    def _agrs_check_tensor(self, op: str, arg: str, t: object) -> None:
        check_wire_tensor(AGRSTensorError, "AGRS", op, arg, t, self.buffer.device)

    def _agrs_inplace_of(self, op: str, arg: str, t: torch.Tensor, state: _AGRSState, taken: list,
                         allow: bool = True) -> _Inplace | None:
        """The unused in-place record ``t`` is (None for a tensor outside the session memory). A tensor inside the
        session memory that is not such a record (a stale in-place tensor, a gathered view, a slice) is refused:
        gathering from it could overwrite memory the session still uses."""
        if t.numel() == 0:
            return None
        begin = state.memory.data_ptr()
        end = begin + state.memory.numel()
        ptr = t.data_ptr()
        if not begin <= ptr < end:
            return None
        if allow:
            for record in state.inplace:
                if (record.data_ptr == ptr and record.shape == tuple(t.shape) and record.dtype == t.dtype
                        and t.is_contiguous() and not any(record is p for p in taken)):
                    return record
        raise AGRSSessionError(f"ep_moe.ElasticBuffer.{op}: argument '{arg}' lies in the AGRS session memory but "
                               "is not an unused in-place tensor of this session"
                               + ("" if allow else " (reduce_scatter takes no in-place input)")
                               + " (one from an earlier session, used twice, a gathered view, or a slice of one):"
                               " copy it out first")

    def _agrs_room(self, state: _AGRSState, new_bytes: int) -> int:
        """0 when the session has room for one more operation of ``new_bytes`` (its chunks), else 1 (bytes) or 2
        (operations)."""
        if state.ops + 1 > state.max_ops:
            return 2
        return 1 if state.used + new_bytes > state.session_bytes else 0

    def _agrs_agree(self, op: str, state: _AGRSState, code: int, shapes: list, total: int, full: int,
                    new_bytes: int, place: int = 0) -> None:
        """All-gather every rank's header and raise the same error on every rank where they differ or a rank has
        no room (before any data moves). ``place``: `_place_digest` of the chunks the operation's tensors take
        (the native transport requires it equal on every rank)."""
        first_shape, first_dtype = shapes[0] if shapes else ((), None)
        values = [_MAGIC, code, state.session, state.ops + 1, full, len(shapes), total, _digest(shapes),
                  dtype_code(first_dtype) if first_dtype is not None else 0, len(first_shape), place, *first_shape]
        stage = f"{_OP_NAMES[code]} #{state.ops + 1} of session {state.session}: header exchange"
        if state.native is not None:  # a session's end goes on the current stream: after this rank's reads
            rows = state.native.exchange(values, AGRSTimeoutError, op, stage, on_current_stream=code == OP_DESTROY)
        else:
            header = host_header(values, HEADER_LEN, self.buffer.device)
            out = torch.empty(self.num_ranks * HEADER_LEN, dtype=torch.int64, device=self.buffer.device)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
            self._agrs_wait(op, gather(out, header, group=self.group, async_op=True), stage)
            rows = out.view(self.num_ranks, HEADER_LEN).tolist()
        where = f"ep_moe.ElasticBuffer.{op} (session {state.session}, operation #{state.ops + 1})"
        # Different operations first (the most basic disagreement), then room, then the tensors.
        ops = [row[_H_OP] if row[_H_MAGIC] == _MAGIC else -1 for row in rows]
        if len(set(ops)) > 1 or any(row[_H_SESSION] != state.session or row[_H_INDEX] != state.ops + 1
                                    for row in rows):
            described = ", ".join(f"rank {i}: {_OP_NAMES.get(o, 'another transfer')} #{row[_H_INDEX]} of session "
                                  f"{row[_H_SESSION]}" for i, (o, row) in enumerate(zip(ops, rows)))
            raise AGRSMismatchError(f"{where}: the ranks are at different operations ({described})")
        short = [(i, row[_H_FULL]) for i, row in enumerate(rows) if row[_H_FULL]]
        if short:
            described = ", ".join(f"rank {i}: {'bytes' if f == 1 else 'operations'}" for i, f in short)
            mine_text = (f"this rank: {new_bytes} more bytes with {state.used} of {state.session_bytes} "
                         f"used, operation {state.ops + 1} of {state.max_ops}")
            raise AGRSCapacityError(f"{where}: the session is full on {described} ({mine_text}; "
                                    "agrs_set_config's num_max_session_bytes / num_max_all_gathers_per_session)")
        if len({(*row[_H_COUNT:_H_PLACE], *row[_H_DIMS:]) for row in rows}) > 1:
            described = "; ".join(
                f"rank {i}: {row[_H_COUNT]} tensor(s), {row[_H_BYTES]} bytes, first "
                f"{dtype_name(row[_H_DTYPE])}{tuple(row[_H_DIMS:_H_DIMS + row[_H_NDIM]])}"
                for i, row in enumerate(rows))
            raise AGRSMismatchError(f"{where}: the ranks pass different tensors ({described})")
        if state.native is not None and len({row[_H_PLACE] for row in rows}) > 1:
            raise AGRSMismatchError(f"{where}: the ranks place the tensors at different chunks of the session memory "
                                    "(agrs_get_inplace_tensor called in a different order or with different shapes "
                                    "on some rank); the native transport writes each rank's rows at the sender's "
                                    "offsets, so they must agree")

    def _agrs_send_native(self, op: str, state: _AGRSState, copies: list, stage: str):
        """Queue the copies (peer, session-memory offset, bytes) and the data words of the operation just counted;
        the handle's waitable for the peers' rows."""
        state.native.put(copies)
        state.native.signal(state.ops, state.session)
        return state.native.arrival(state.ops, state.session, AGRSTimeoutError, op, stage)

    def _agrs_release(self) -> None:
        """Free the native transports' symmetric buffers (`ElasticBuffer.destroy`)."""
        transports = [*(self._agrs_retired or []), *([self._agrs.native] if self._agrs is not None else [])]
        self._agrs_retired, self._agrs = [], None
        if transports:  # the native module is imported only by a buffer that used a transport
            from ..native.stream_transport import destroy_transports

            destroy_transports(self, transports)


__all__ = ["AGRSCapacityError", "AGRSConfigError", "AGRSError", "AGRSHandle", "AGRSMismatchError", "AGRSMixin",
           "AGRSSessionError", "AGRSTensorError", "AGRSTimeoutError", "HEADER_LEN", "REDUCE_DTYPES",
           "agrs_transport"]
