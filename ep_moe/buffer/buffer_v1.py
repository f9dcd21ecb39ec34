"""`ep_moe.Buffer`: the communication object of one expert-parallel group.

Its methods mirror DeepEP's normal-mode ``deep_ep.Buffer`` (argument names, return tuples,
`EventOverlap`), so code written for DeepEP runs on it. Shapes: T tokens on this rank, H hidden,
K top-k, E experts, R ranks in the group, L = E / R local experts, N received rows.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref

import torch
import torch.distributed as dist

from .. import native
from ..backends.comm_backend import CommBackend, DispatchResult
from ..backends.torch_backend import TorchBackend
from ..config import DEFAULT_NUM_SMS, Config, NativeOptions
from ..distributed import disable_multicast
from .argument_checks import (
    _fail,
    check_handle,
    check_num_experts,
    check_positive_int,
    check_tensor,
    check_topk,
    split_hidden,
)
from .dispatch_handle import DispatchHandle
from .event_overlap import EventOverlap
from .routing_layout import summation_order

log = logging.getLogger("ep_moe")

BACKENDS = ("auto", "native", "torch")
DEFAULT_TIMEOUT_S = 100.0

_live_buffers: weakref.WeakValueDictionary[int, Buffer] = weakref.WeakValueDictionary()
_buffer_ids = itertools.count()


def buffer_by_id(buffer_id: int) -> Buffer:
    """The live `Buffer` with this ``buffer_id`` (the custom ops carry buffers by id)."""
    try:
        return _live_buffers[buffer_id]
    except KeyError:
        raise RuntimeError(f"ep_moe: Buffer {buffer_id} was destroyed or never existed") from None


@functools.lru_cache(maxsize=16)
def _default_config(num_sms: int) -> Config:
    return Config(num_sms=num_sms)


def _device_of(group: dist.ProcessGroup, requested: str) -> torch.device:
    """NCCL: the current CUDA device. gloo: the CPU, except where ``EP_MOE_SYMMETRIC_MEMORY=vmm`` asks for the
    native backend's VMM memory (ranks that may share one GPU) and ``requested`` is not ``"torch"``: the current
    CUDA device then (the native backend's host collectives run over gloo). On a gloo group with CUDA available
    and ``requested`` not ``"torch"`` this is a collective: every rank must name the same provider (a
    `ValueError` naming the ranks otherwise), so all choose the same kind of device."""
    backend = str(dist.get_backend(group)).lower()
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if "nccl" in backend or (requested != "torch" and native.agreed_symmetric_memory_provider(group) == "vmm"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Buffer:
    """Dispatch and combine MoE tokens within one expert-parallel process group.

    Args:
        group: the EP process group (default: the world group). gloo runs on CPU, NCCL on GPU; gloo runs on
            the current GPU too where ``EP_MOE_SYMMETRIC_MEMORY=vmm`` and ``backend`` is not ``"torch"`` (the
            native kernels over ranks that may share one GPU, docs/native.md).
        num_nvl_bytes: bytes of symmetric (NVLink) memory for the native backend; 0 = sized by
            `get_buffer_size_hint` on first use. Accepted (and ignored) by the torch backend.
        num_rdma_bytes, low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode,
            allow_mnnvl, explicitly_destroy: accepted for DeepEP compatibility.
        backend: ``"auto"`` (native when built and every peer is NVLink-reachable, else torch; logs
            one line saying which and why), ``"native"`` or ``"torch"`` (raise if they cannot run).
        timeout_s: seconds any wait for a peer may last before it raises (naming rank and stage).
        check_inputs: also check values (expert ids in range), which costs a host sync on GPU; skipped
            during CUDA-graph capture and with ``num_worst_tokens`` (no host sync allowed there): the ids are
            then the caller's responsibility.
        native_options: the native kernels' settings (kept as ``native_options``; a call's
            ``config.native`` overrides them for that call); None: `NativeOptions.from_env`. They must be
            equal on every rank: the native backend checks that here. The torch backend ignores them.

    Raises:
        ValueError: a bad ``backend`` or ``native_options``, ``low_latency_mode=True``, or options unequal across
            the ranks (naming the field and the ranks).
        RuntimeError: torch.distributed is not initialized, or ``backend="native"`` cannot run here (the reason).
    """

    num_sms: int = DEFAULT_NUM_SMS  # the SM budget of calls without a Config (`set_num_sms`)

    def __init__(self, group: dist.ProcessGroup | None = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, *, backend: str = "auto",
                 timeout_s: float = DEFAULT_TIMEOUT_S, check_inputs: bool = True,
                 native_options: NativeOptions | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ep_moe.Buffer: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        if backend not in BACKENDS:
            raise _fail("Buffer", "backend", f"one of {BACKENDS}", repr(backend))
        if native_options is not None and not isinstance(native_options, NativeOptions):
            raise _fail("Buffer", "native_options", "an ep_moe.NativeOptions or None",
                        type(native_options).__name__)
        self.native_options = NativeOptions.from_env() if native_options is None else native_options
        if low_latency_mode:
            raise _fail("Buffer", "low_latency_mode", "False (low-latency mode is not implemented)", True)
        disable_multicast()  # before the backend makes symmetric memory
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.device = _device_of(self.group, backend)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.timeout_s = float(timeout_s)
        self.check_inputs = check_inputs
        self.explicitly_destroy = explicitly_destroy
        self._comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Whether the communication stream may hold work the current stream has not waited for: an asynchronous
        # call's, or anyone's once the stream was handed out (`get_comm_stream`). See `_run`.
        self._comm_pending = False
        self._comm_shared = False
        self._compute_pending = False  # a synchronous call ran on the current stream since the last asynchronous one
        self.backend: CommBackend = self._make_backend(backend)
        self.buffer_id = next(_buffer_ids)
        _live_buffers[self.buffer_id] = self

    # ---------------------------------------------------------------- construction helpers
    def _make_backend(self, requested: str) -> CommBackend:
        """The backend asked for; sets ``backend_reason``, the one line that says why it was chosen."""
        if requested == "torch":
            self.backend_reason = "asked for by name"
            return TorchBackend(self.group, self.device, self.timeout_s)
        reason = native.unavailable_reason(self.group, self.device)
        if reason is None:
            from ..backends.native_backend import NativeBackend

            chosen = NativeBackend(self.group, self.device, self.timeout_s, self.num_nvl_bytes,
                                   options=self.native_options)
            self.backend_reason = "every peer is NVLink-reachable" if requested == "auto" else "asked for by name"
            if requested == "auto" and self.rank == 0:
                log.info("ep_moe: using backend 'native' (%s)", self.backend_reason)
            return chosen
        if requested == "native":
            raise RuntimeError(f"ep_moe.Buffer: backend 'native' cannot run here: {reason}")
        self.backend_reason = f"native unavailable: {reason}"
        if self.rank == 0:  # on GPUs someone may have expected the kernels: say it where it is seen
            log.log(logging.WARNING if self.device.type == "cuda" else logging.INFO,
                    "ep_moe: using backend 'torch' (%s)", self.backend_reason)
        return TorchBackend(self.group, self.device, self.timeout_s)

    @property
    def backend_name(self) -> str:
        """The backend's name: ``"native"``, ``"torch"`` or ``"hybrid"`` (an `ElasticBuffer` across nodes)."""
        return self.backend.name

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM budget of the calls that pass no `Config`, for every buffer of the process.

        Args:
            new_num_sms: the SM count, an even int >= 2 (even, as in DeepEP).

        Raises:
            ValueError: ``new_num_sms`` is not an even int >= 2.
        """
        check_positive_int("Buffer.set_num_sms", "new_num_sms", new_num_sms, 2)
        if new_num_sms % 2:
            raise _fail("Buffer.set_num_sms", "new_num_sms", "even", new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The `Config` of a dispatch that passes none.

        Args:
            num_ranks: the group size, taken as DeepEP takes it; every size gets the same config.

        Returns:
            ``Config(num_sms=Buffer.num_sms)`` (frozen: one object per SM budget).
        """
        return _default_config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The `Config` of a combine that passes none.

        Args:
            num_ranks: the group size, taken as DeepEP takes it; every size gets the same config.

        Returns:
            ``Config(num_sms=Buffer.num_sms)`` (frozen: one object per SM budget).
        """
        return _default_config(Buffer.num_sms)

    @staticmethod
    def get_buffer_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int,
                             dtype: torch.dtype = torch.bfloat16, fp8: bool = False) -> int:
        """Bytes of symmetric memory in which the native backend can receive every token of every rank.

        Args:
            num_max_tokens_per_rank: the most tokens any rank dispatches in one call.
            hidden: H, elements per row.
            num_ranks: R, the group size.
            num_topk: K, top-k entries per token.
            dtype: the rows' dtype (its item size; combine rows are at least 2 bytes an element).
            fp8: FP8 rows (1 byte an element) with their fp32 scales, one per 128 elements.

        Returns:
            The byte count, a multiple of 2 MiB: every rank's rows, each as wide as the wider of a dispatch row
            and a combine row, plus the control bytes.
        """
        elem = 1 if fp8 else dtype.itemsize
        return native.buffer_size_hint(num_max_tokens_per_rank, hidden, num_ranks, num_topk, elem, fp8)

    @staticmethod
    def capture() -> EventOverlap:
        """Record an event on the current stream, to pass as ``previous_event``.

        Returns:
            An `EventOverlap` holding that event; an empty one on CPU (or before CUDA is initialized).
        """
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            return EventOverlap(event)
        return EventOverlap(None)

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The communication stream, on which asynchronous calls (``async_finish=True``) run.

        Returns:
            The ``torch.cuda.Stream``, or None on CPU. Work a caller queues there is waited for by every later
            call of this buffer.
        """
        self._comm_shared = True
        return self._comm_stream

    # ---------------------------------------------------------------- streams and events
    def _run(self, fn, tensors_in: list, previous_event: EventOverlap | None, async_finish: bool):
        """Run ``fn()`` after ``previous_event`` (or the current stream's work) and the communication stream's.

        A synchronous call (the caller waits for it anyway) runs on the current stream: the same order as
        DeepEP's run on the communication stream joined at once, without a stream switch or marking every tensor
        in use by a second stream. An asynchronous one runs on the communication stream, after ``previous_event``
        and any synchronous call of this buffer before it, and returns an `EventOverlap` holding its tensors; until
        the current stream waits for that stream again, later calls queue behind it. Calls of one buffer never run
        side by side: they share the symmetric buffer."""
        comm = self._comm_stream
        if comm is None:
            return fn(), EventOverlap(None)
        waits = previous_event is not None and previous_event.event is not None
        if not async_finish:
            if waits or self._comm_pending or self._comm_shared:  # else no stream object is needed
                compute = torch.cuda.current_stream(self.device)
                if waits:
                    compute.wait_event(previous_event.event)
                if self._comm_pending or self._comm_shared:
                    compute.wait_stream(comm)
                    self._comm_pending = False
            self._compute_pending = True
            return fn(), EventOverlap(None)
        compute = torch.cuda.current_stream(self.device)  # with the device given: no current-device lookup
        if waits:
            comm.wait_event(previous_event.event)
            if self._compute_pending:  # a synchronous call queued after that event must not run beside this one
                comm.wait_stream(compute)
        else:
            comm.wait_stream(compute)
        self._comm_pending, self._compute_pending = True, False
        with torch.cuda.stream(comm):
            try:
                out = fn()
            except BaseException:
                # fn may have queued kernels before it raised (the native backend raises a rank disagreement
                # after its launches): they still read the inputs, and what the current stream runs next (a
                # barrier) must follow them, as after a call that returned
                _record_use(tensors_in, comm)
                compute.wait_stream(comm)
                self._comm_pending = False
                raise
        outputs = _cuda_tensors(out, [])
        _record_use(tensors_in, comm)
        for t in outputs:
            t.record_stream(compute)
        event = torch.cuda.Event()
        event.record(comm)
        return out, EventOverlap(event, tensors_in + outputs)

    def _to_host_list(self, t: torch.Tensor, async_finish: bool) -> list:
        """``t.tolist()`` after the stream that produced it: with ``async_finish`` the communication stream, which
        the current stream has not waited for yet, so the copy is queued behind the kernel that writes ``t``."""
        if not async_finish or self._comm_stream is None:
            return t.tolist()
        with torch.cuda.stream(self._comm_stream):
            return t.tolist()

    def _checking_values(self, num_worst_tokens: int = 0) -> bool:
        if not self.check_inputs or num_worst_tokens:
            return False
        return not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    # ---------------------------------------------------------------- layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Which ranks and experts each token goes to.

        Args:
            topk_idx: ``[T, K]`` int64 expert ids, -1 for none.
            num_experts: E, divisible by the group size.
            previous_event: an `EventOverlap` to wait for first, or None (the current stream's work).
            async_finish: run on the communication stream and return an event to wait on.
            allocate_on_comm_stream: accepted for DeepEP, ignored.

        Returns:
            ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank None,
            num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)``.

        Raises:
            ValueError: a bad argument, named (expert ids out of range when ``check_inputs`` is on).
        """
        check_num_experts("get_dispatch_layout", num_experts, self.group_size)
        check_topk("get_dispatch_layout", topk_idx, None, None, num_experts, self.device, self._checking_values())
        (per_rank, per_expert, in_rank), event = self._run(
            lambda: self.backend.get_dispatch_layout(topk_idx, num_experts), [topk_idx], previous_event,
            async_finish)
        return per_rank, None, per_expert, in_rank, event

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x, handle: DispatchHandle | None = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event: EventOverlap | None = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *,
                 num_experts: int | None = None):
        """Send each token to every rank that holds one of its experts (once per rank).

        Args:
            x: ``[T, H]`` bf16/fp32 (fp64 on the torch backend) or the FP8 pair ``(x_e4m3 [T, H], scales [T, H/128])``.
            handle: an earlier dispatch's `DispatchHandle`: repeat its layout (cached dispatch, no top-k arguments).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: ``[R]``, ``[T, R]`` bool and ``[E]`` from
                `get_dispatch_layout`; computed here from ``topk_idx`` when omitted (then pass ``num_experts``).
            num_tokens_per_rdma_rank: None (there are no RDMA ranks).
            topk_idx: ``[T, K]`` int64 expert ids (-1 for none). topk_weights: ``[T, K]`` fp32.
            expert_alignment: round each local expert's received count up to a multiple of this.
            num_worst_tokens: if > 0, received tensors have exactly this many rows (padding rows have
                ``topk_idx`` -1) and nothing waits on the host; an upper bound on rows received.
            config: this call's `Config` (None: `get_dispatch_config`). num_experts: E (keyword only).
            previous_event, async_finish: as `get_dispatch_layout`. allocate_on_comm_stream: accepted, ignored.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``:
            ``recv_x [N, H]`` (or the FP8 pair), rows by source rank then token index (docs/semantics.md,
            "Dispatch"); ``recv_topk_idx [N, K]`` int64 local expert ids or -1; ``recv_topk_weights [N, K]`` fp32
            (0 where not local); the list of L aligned counts (empty with ``num_worst_tokens``).
            A cached dispatch returns ``(recv_x, None, None, None, None, event)``.

        Raises:
            ValueError: a bad argument, named (docs/semantics.md, "Errors").
        """
        result, event = self.dispatch_result(
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
            topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
            num_experts=num_experts)
        recv_x = result.recv_x if result.recv_scales is None else (result.recv_x, result.recv_scales)
        if handle is not None:
            return recv_x, None, None, None, None, event
        counts_list = [] if num_worst_tokens else result.num_recv_tokens_per_expert_list
        if counts_list is None:
            counts_list = self._to_host_list(result.num_recv_tokens_per_expert, async_finish)
        return recv_x, result.recv_topk_idx, result.recv_topk_weights, counts_list, result.handle, event

    def dispatch_result(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                        is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                        expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                        previous_event: EventOverlap | None = None, async_finish: bool = False, *,
                        num_experts: int | None = None, consume_in_place=None) -> tuple[DispatchResult, EventOverlap]:
        """`dispatch` with its result as a `DispatchResult` (device counts kept, nothing read on the host).

        Args:
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
                topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event,
                async_finish, num_experts: as `dispatch`.
            consume_in_place: None, or ``fn(result, ReceivedRows)`` for a fresh dispatch for which
                ``receives_in_place(x, num_experts)`` is True, or a cached one for which ``receives_in_place(x, 0)``
                is: the received rows stay where they landed and ``fn`` runs on the communication stream right
                after the dispatch (the rows are valid only there).

        Returns:
            ``(result, event)``: the `DispatchResult` (``recv_x [N, H]``, ``recv_scales [N, H/128]`` fp32 or None,
            ``recv_topk_idx [N, K]`` int64, ``recv_topk_weights [N, K]`` fp32, ``num_recv_tokens_per_expert [L]``
            int64 on the device, the handle, the counts' host list or None; with ``consume_in_place``, ``recv_x``
            and ``recv_scales`` are None and ``result.consumed`` is fn's return value) and the `EventOverlap`.

        Raises:
            ValueError: a bad argument, named; ``consume_in_place`` where the backend cannot leave the rows.
        """
        op = "dispatch"
        data, scales = split_hidden(op, x, self.device, self.backend.supported_dtypes)
        config = config or self.get_dispatch_config(self.group_size)
        num_tokens = data.shape[0]
        check_positive_int(op, "expert_alignment", expert_alignment, 1)
        check_positive_int(op, "num_worst_tokens", num_worst_tokens, 0)
        if num_tokens_per_rdma_rank is not None:
            raise _fail(op, "num_tokens_per_rdma_rank", "None (intranode/torch groups have no RDMA ranks)",
                        "a tensor")
        if handle is not None:
            check_handle(op, handle, self.group_size, self.device, num_tokens)
            if topk_idx is not None or topk_weights is not None:
                raise _fail(op, "topk_idx", "None in a cached dispatch (with handle)", "a tensor")
            if num_worst_tokens not in (0, handle.num_worst_tokens):
                raise _fail(op, "num_worst_tokens", f"0 or the handle's {handle.num_worst_tokens}",
                            num_worst_tokens)
            if consume_in_place is not None:
                if not self.receives_in_place(x, 0):
                    raise _fail(op, "consume_in_place", "None: this buffer's backend cannot leave these rows in "
                                "place", "a function")
                return self._run(
                    lambda: self.backend.dispatch(data, scales, None, None, handle.is_token_in_rank, None, handle,
                                                  0, expert_alignment, handle.num_worst_tokens, config,
                                                  consume=consume_in_place),
                    [data, scales], previous_event, async_finish)
            return self._run(
                lambda: self.backend.dispatch(data, scales, None, None, handle.is_token_in_rank, None, handle,
                                              0, expert_alignment, handle.num_worst_tokens, config),
                [data, scales], previous_event, async_finish)

        if topk_idx is None:
            raise _fail(op, "topk_idx", "a [T, K] int64 tensor (or pass handle for a cached dispatch)", None)
        if num_tokens_per_expert is not None:
            check_tensor(op, "num_tokens_per_expert", num_tokens_per_expert, dtypes=(torch.int32, torch.int64),
                         ndim=1, device=self.device)
            if num_experts is not None and num_experts != num_tokens_per_expert.shape[0]:
                raise _fail(op, "num_experts", f"num_tokens_per_expert.shape[0] = "
                            f"{num_tokens_per_expert.shape[0]}", num_experts)
            num_experts = num_tokens_per_expert.shape[0]
        if num_experts is None:
            raise _fail(op, "num_tokens_per_expert", "a [E] tensor from get_dispatch_layout (or pass num_experts)",
                        None)
        check_num_experts(op, num_experts, self.group_size)
        if topk_weights is None:
            raise _fail(op, "topk_weights", "a [T, K] float32 tensor", None)
        check_topk(op, topk_idx, topk_weights, num_tokens, num_experts, self.device,
                   self._checking_values(num_worst_tokens))
        if (num_tokens_per_rank is None) != (is_token_in_rank is None):
            raise _fail(op, "is_token_in_rank", "given together with num_tokens_per_rank", "only one of them")
        if is_token_in_rank is None:
            num_tokens_per_rank, _, is_token_in_rank = self.backend.get_dispatch_layout(topk_idx, num_experts)
        check_tensor(op, "num_tokens_per_rank", num_tokens_per_rank, dtypes=(torch.int32, torch.int64), ndim=1,
                     device=self.device, shape=(self.group_size,))
        check_tensor(op, "is_token_in_rank", is_token_in_rank, dtypes=(torch.bool,), ndim=2, device=self.device,
                     shape=(num_tokens, self.group_size))
        if not num_worst_tokens and data.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise _fail(op, "num_worst_tokens", "> 0 during CUDA-graph capture (no host sync allowed)", 0)
        if consume_in_place is not None and not self.receives_in_place(x, num_experts):
            raise _fail(op, "consume_in_place", "None: this buffer's backend cannot leave these rows in place",
                        "a function")
        extra = {} if consume_in_place is None else {"consume": consume_in_place}

        def run() -> DispatchResult:
            result = self.backend.dispatch(data, scales, topk_idx, topk_weights, is_token_in_rank,
                                           num_tokens_per_rank, None, num_experts, expert_alignment,
                                           num_worst_tokens, config, **extra)
            if self.group_size == 1:  # one partial row per token: no order to keep
                return result
            order = summation_order(topk_idx, num_experts, self.group_size)
            return result._replace(handle=result.handle._replace(summation_order=order))

        return self._run(run, [data, scales, topk_idx, topk_weights, is_token_in_rank], previous_event,
                         async_finish)

    def receives_in_place(self, x, num_experts: int) -> bool:
        """Whether a dispatch of ``x`` can leave its received rows in place (`dispatch_result`'s ``consume_in_place``).

        Args:
            x: ``[T, H]`` or the FP8 pair; only its row width in bytes counts.
            num_experts: E of a fresh dispatch; 0: a cached dispatch (with a handle).

        Returns:
            True where the backend can; the same answer on every rank.
        """
        data = x[0] if isinstance(x, tuple | list) else x
        return self.backend.receives_in_place(data.shape[1] * data.element_size(), num_experts)

    # ---------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple | None = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Return each received row to its source and sum per token over the ranks it went to.

        Args:
            x: ``[N, H]`` bf16/fp32, one row per received row of the dispatch that made ``handle``.
            handle: from that dispatch.
            topk_weights: ``[N, K]`` fp32 to combine the same way, or None.
            bias: ``[T, H]`` tensor or a pair of them (either may be None), where the sum starts.
            config: this call's `Config` (None: `get_combine_config`).
            previous_event, async_finish: as `get_dispatch_layout`. allocate_on_comm_stream: accepted, ignored.

        Returns:
            ``(combined_x [T, H] x.dtype, combined_topk_weights [T, K] fp32 or None, event)``; the sum runs in
            fp32 from ``bias[0] + bias[1]``, adding the token's rows in ``handle.summation_order`` (DeepEP V2's
            order), then the cast (docs/semantics.md, "Combine").

        Raises:
            ValueError: a bad argument, named (docs/semantics.md, "Errors").
        """
        op = "combine"
        check_handle(op, handle, self.group_size, self.device)
        rows = handle.num_recv_rows
        check_tensor(op, "x", x, dtypes=self.backend.supported_dtypes, ndim=2, device=self.device,
                     shape=(rows if rows >= 0 else None, None))
        config = config or self.get_combine_config(self.group_size)
        if topk_weights is not None:
            check_tensor(op, "topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2, device=self.device,
                         shape=(x.shape[0], None))
        biases = bias if isinstance(bias, tuple | list) else (bias, None)
        if len(biases) != 2:
            raise _fail(op, "bias", "a tensor or a pair of tensors", f"a sequence of {len(biases)}")
        for i, b in enumerate(biases):
            if b is not None:
                check_tensor(op, f"bias[{i}]", b, dtypes=self.backend.supported_dtypes, ndim=2,
                             device=self.device, shape=(handle.num_tokens, x.shape[1]))
        (combined, combined_w), event = self._run(
            lambda: self.backend.combine(x, handle, topk_weights, tuple(biases), config),
            [x, topk_weights, *biases], previous_event, async_finish)
        return combined, combined_w, event

    def combines_expert_rows(self, y: torch.Tensor) -> bool:
        """Whether `combine_expert_rows` takes ``y`` on this buffer's backend.

        Args:
            y: ``[M, H]`` expert-major rows; only their width in bytes counts.

        Returns:
            True where the backend can; the same answer on every rank.
        """
        return self.backend.combines_expert_rows(y.shape[1] * y.element_size())

    def combine_expert_rows(self, y: torch.Tensor, handle: DispatchHandle, sorted_slots: torch.Tensor,
                            weights: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
        """`combine` of ``unpermute_sum(y, layout, weights)`` without forming those rank-major rows first.

        The backend sums each row's expert-major rows as it sends the row back (`combines_expert_rows`).

        Args:
            y: ``[M, H]`` bf16/fp32 expert-major rows. handle: the rank-major dispatch's.
            sorted_slots: ``[N, K]`` int64, each received row's slots in the order of the sum; entries < 0
                are skipped (the layout's ``slot_of_pair``: top-k order).
            weights: ``[M]`` fp32 or None (plain sums).
            config: this call's `Config` (None: `get_combine_config`).

        Returns:
            ``combined [T, H]`` in y's dtype, equal bit for bit to ``combine(ep_moe.permute.unpermute_sum(y,
            layout, weights), handle)``.

        Raises:
            ValueError: a bad argument, named; ``y`` rows this backend does not combine (`combines_expert_rows`).
        """
        op = "combine"
        check_handle(op, handle, self.group_size, self.device)
        rows = handle.num_recv_rows
        check_tensor(op, "y", y, dtypes=self.backend.supported_dtypes, ndim=2, device=self.device)
        check_tensor(op, "sorted_slots", sorted_slots, dtypes=(torch.int64,), ndim=2, device=self.device,
                     shape=(rows if rows >= 0 else None, None))
        if weights is not None:
            check_tensor(op, "weights", weights, dtypes=(torch.float32,), ndim=1, device=self.device,
                         shape=(y.shape[0],))
        if not self.combines_expert_rows(y):
            raise _fail(op, "y", "rows this buffer's backend combines from the expert-major layout "
                        "(see combines_expert_rows)", tuple(y.shape))
        config = config or self.get_combine_config(self.group_size)
        (combined, _), _ = self._run(
            lambda: self.backend.combine(y, handle, None, (None, None), config, expert_rows=(sorted_slots, weights)),
            [y, sorted_slots, weights], None, False)
        return combined

    # ---------------------------------------------------------------- lifecycle
    def barrier(self) -> None:
        """Wait for every rank of the group (raises after ``timeout_s``)."""
        self.backend.barrier()

    def destroy(self) -> None:
        """Free backend resources (symmetric memory); the buffer is unusable afterwards."""
        self.backend.destroy()
        _live_buffers.pop(self.buffer_id, None)

    def __repr__(self) -> str:
        return (f"Buffer(rank={self.rank}, group_size={self.group_size}, backend={self.backend_name!r}, "
                f"device={self.device})")


def _record_use(tensors: list, stream) -> None:
    """Mark the CUDA tensors among ``tensors`` as in use by ``stream`` (their memory is not reused before
    the work queued there so far has run)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


_SCALARS = (int, float, bool, str, type(None))


def _cuda_tensors(obj, found: list) -> list:
    """Append the CUDA tensors of a result (nested tuples, lists and NamedTuples; anything else is skipped) to
    ``found``, in order. Scalars are skipped without a call each: an exact dispatch's result holds its per-expert
    counts as a list of up to E ints (walking them with a call per item cost ~1,000 calls per dispatch at E = 256)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            found.append(obj)
    elif isinstance(obj, tuple | list):
        for item in obj:
            if not isinstance(item, _SCALARS):
                _cuda_tensors(item, found)
    return found
