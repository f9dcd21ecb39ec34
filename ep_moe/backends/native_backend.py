"""The ``native`` backend: intranode dispatch and combine kernels over symmetric memory (NVLink).

Each rank owns a small control block (count exchange, arrival and chunk flags) and a data buffer that receives
rows (grown here, or given by `use_data_memory`: an `ElasticBuffer`'s GPU segment, which never grows). A
dispatch runs ``notify`` (every rank writes its per-destination counts into every peer's control block and lists
the tokens it sends, kept in the handle), then, in exact mode only, a host wait for the counts, then
``dispatch`` (pusher blocks store rows straight to their place in each receiver's buffer; local blocks copy the
own rows and drain the peers' chunks). A combine sends every received row back to its source and sums per token
in fp32 in the handle's ``summation_order`` (DeepEP V2's), by the reducers or, where `ep_moe.native.policy`
says so, with the rows moved by the copy engine. Results equal the ``torch`` backend's bit for bit; shapes the
kernels do not take (rows not a multiple of 16 bytes, too many local experts) go to an internal `TorchBackend`,
decided from shapes alone so every rank takes the same path.

Why the calls are safe across ranks (docs/native.md has the details):

* options (`NativeOptions`) are checked equal on every rank the first time the buffer sees them;
* every wait has a deadline (``timeout_s``); a kernel that misses it writes an error record to pinned host
  memory and `NativeTimeoutError` names the rank, stage and channel;
* ranks that disagree on a call (`ep_moe.backends.agreement`'s header) get the torch backend's ValueError,
  not a hang: the kernels compare every rank's header before any row moves.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from .. import native
from ..buffer.dispatch_handle import DispatchHandle
from ..config import Config, NativeOptions
from ..native import policy, sizing
from ..native.symmetric import SymmetricBuffer, VmmSymmetricBuffer
from . import agreement
from .agreement import HEADER_LEN
from .comm_backend import CommBackend, DispatchResult, ReceivedRows
from .torch_backend import TorchBackend

if TYPE_CHECKING:  # the JIT module loads with the kernels (`_c`), not with this module
    from ..native.jit.intranode import BoundLaunch

MAX_LOCAL_EXPERTS = 8192  # experts per rank the dispatch kernel counts in shared memory

STAGES = {
    1: "dispatch/notify (exchanging row counts)",
    2: "dispatch/send (waiting for the peer to enter the call)",
    3: "dispatch/receive (waiting for the peer's rows)",
    4: "combine/send (waiting for the peer to enter the call)",
    5: "combine/reduce (waiting for the peer's rows)",
    6: "barrier",
    7: "dispatch (receive buffer capacity)",
    8: "combine (receive buffer capacity)",
    9: "header exchange (before a host-side decision)",
}

# Mirrors of native/kernels/kernels.h (checked against the kernels' constants when a backend is built): the
# header's words (`HeaderSlot`: agreement's HEADER_LEN, then the copy-engine sequence numbers), the mismatch record
# after the error record (`MismatchWord`), and the most ranks.
HEADER_WORDS = HEADER_LEN + 2
_COPY_SEQ, _LAST_SEQ = HEADER_LEN, HEADER_LEN + 1
MAX_RANKS = 8
_FOUND, _RANK, _RANKS, _OWN = 0, 1, 2, 3
_SEEN = _OWN + HEADER_LEN
MISMATCH_WORDS = _SEEN + MAX_RANKS * HEADER_LEN


def mismatch_error(rank: int, own: list[int], seen: list[list[int]]) -> ValueError:
    """The `ValueError` of a disagreement the kernels of rank ``rank`` found: ``own`` is its header of the call,
    ``seen[r]`` rank ``r``'s as its kernel saw it (the same on every rank), worded by
    `agreement.mismatch_message`. Where every rank's header as seen is the same and only differs from ``own``
    (which only the test-only `NativeBackend.test_header_perturbation` causes), both are named apart; where all
    are the same, the ranks disagreed on taking the copy engine (native/kernels/intranode_kernels.cuh,
    check_headers_warp)."""
    op_name = {agreement.OP_COMBINE: "combine", agreement.OP_BARRIER: "barrier"}.get(own[0], "dispatch")
    message = agreement.mismatch_message(op_name, seen)
    if message is None:
        labels = [f"rank {rank}'s own call"] + [f"rank {r} as seen by rank {rank}'s kernel" for r in range(len(seen))]
        message = agreement.mismatch_message(op_name, [own, *seen], labels)
    return ValueError(message or f"ep_moe.{op_name}: ranks disagree on taking the copy engine for this call with "
                      "equal headers (only some ranks know the handle's layout on the host, e.g. a handle rebuilt "
                      "from its tensors on some ranks)")


def parse_mismatch_record(words: list[int]) -> ValueError | None:
    """The `ValueError` of a mismatch record (``MISMATCH_WORDS`` int32), or None when it holds none."""
    if words[_FOUND] == 0:
        return None
    num_ranks = words[_RANKS]
    seen = [words[_SEEN + r * HEADER_LEN:_SEEN + (r + 1) * HEADER_LEN] for r in range(num_ranks)]
    return mismatch_error(words[_RANK], words[_OWN:_OWN + HEADER_LEN], seen)


def parse_header_check(words: list[int], num_ranks: int) -> tuple[bool, list[int], list[list[int]]]:
    """What a notify or a header exchange wrote after the counts (``words`` from there): (the ranks disagree,
    this rank's header, every rank's as seen with its ``HEADER_WORDS`` words)."""
    seen = [words[r * HEADER_WORDS:(r + 1) * HEADER_WORDS] for r in range(num_ranks)]
    own = words[num_ranks * HEADER_WORDS:num_ranks * HEADER_WORDS + HEADER_LEN]
    return bool(words[num_ranks * HEADER_WORDS + HEADER_LEN]), own, seen


class NativeTimeoutError(TimeoutError, RuntimeError):
    """A peer did not arrive in time (caught by ``except TimeoutError`` and ``except RuntimeError``)."""


def _c():
    """The intranode kernels' module (`ep_moe.native.intranode_kernels`)."""
    return native.intranode_kernels()  # no import statement per call (a few µs on every operation)


def _own_rows(y: torch.Tensor, weights: torch.Tensor | None, sorted_slots: torch.Tensor, prefix: torch.Tensor,
              rank: int) -> torch.Tensor:
    """`ep_moe.native.jit.expert_major_exchange.unpermute_own_rows`: ``[N, H]``, this rank's own rows of
    ``unpermute_sum(y, weights)`` (the others unspecified)."""
    from ..native.jit import expert_major_exchange

    return expert_major_exchange.unpermute_own_rows(y, weights, sorted_slots, prefix, rank)


def _expert_major_ops() -> bool:
    """Whether the expert-major ops of the fused paths (permute of rows in place, own rows of a combine) exist
    here: `ep_moe.native.jit.expert_major_exchange`, which comes with the intranode kernels."""
    return native.kernels_available()


# the launches that are bound: a cached dispatch, a combine, a fresh dispatch and its notify, and a whole fixed-size
# dispatch (its notify and dispatch launches)
_CACHED, _COMBINE, _DISPATCH, _NOTIFY = agreement.OP_CACHED_DISPATCH, agreement.OP_COMBINE, agreement.OP_DISPATCH, 0
_FIXED = -1


class _Bound(NamedTuple):
    """A bound launch the backend keeps under its key (a whole fixed-size dispatch: its notify and dispatch)."""

    launch: BoundLaunch | tuple[BoundLaunch, BoundLaunch]
    options: NativeOptions  # kept so that the key's id(options) is not reused while the entry lives


class _FreshOutputs(NamedTuple):
    """A fresh dispatch's outputs (N = rows received, or ``num_worst_tokens``; L local experts)."""

    recv_x: torch.Tensor  # [N, H] of x's dtype ([0, H] when the rows stay in place)
    recv_scales: torch.Tensor | None  # [N, S] fp32 with FP8 scales (and rows not in place)
    recv_idx: torch.Tensor  # [N, K] int64
    recv_w: torch.Tensor  # [N, K] fp32
    src_idx: torch.Tensor  # [N] int32: each row's token index on its source
    src_rank: torch.Tensor  # [N] int32: each row's source rank
    counts: torch.Tensor  # [L] int64

    @classmethod
    def of(cls, x: torch.Tensor, num_scales: int, rows: int, num_topk: int, local_experts: int,
           in_place: bool) -> _FreshOutputs:
        dev = x.device
        return cls(torch.empty(0 if in_place else rows, x.shape[1], dtype=x.dtype, device=dev),
                   torch.empty(rows, num_scales, dtype=torch.float32, device=dev) if num_scales and not in_place
                   else None,
                   torch.empty(rows, num_topk, dtype=torch.int64, device=dev),
                   torch.empty(rows, num_topk, dtype=torch.float32, device=dev),
                   torch.empty(rows, dtype=torch.int32, device=dev),
                   torch.empty(rows, dtype=torch.int32, device=dev),
                   torch.empty(local_experts, dtype=torch.int64, device=dev))

    def dispatch_values(self, prefix: torch.Tensor, route: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None,
                        topk_idx: torch.Tensor, topk_weights: torch.Tensor, scratch: torch.Tensor) -> tuple[int, ...]:
        """The bound fields of the dispatch launch into these outputs (`FRESH_DISPATCH_BOUND`, in order)."""
        rows = self.src_idx.shape[0]
        return (prefix.data_ptr(), _send_list(route), x.data_ptr(), _address(scales), self.recv_x.data_ptr(),
                _address(self.recv_scales), rows, topk_idx.data_ptr(), topk_weights.data_ptr(),
                self.recv_idx.data_ptr(), self.recv_w.data_ptr(), self.src_idx.data_ptr(), self.src_rank.data_ptr(),
                scratch.data_ptr(), self.counts.data_ptr())


def _send_list(route: torch.Tensor) -> int:
    """The address of ``route[1]``, the ``[R, T]`` send lists after the ``[T, R]`` positions of ``route``."""
    return route.data_ptr() + 2 * route.numel()  # 4 bytes times half the elements


def _notify_values(in_rank: torch.Tensor, per_rank: torch.Tensor, prefix: torch.Tensor, route: torch.Tensor,
                   topk_idx: torch.Tensor | None) -> tuple[int, ...]:
    """The bound fields of a notify launch (`NOTIFY_BOUND`, in order); ``topk_idx`` where the expert counts
    travel."""
    return (in_rank.data_ptr(), per_rank.data_ptr(), prefix.data_ptr(), route.data_ptr(), _send_list(route),
            _address(topk_idx))


def _ready(t: torch.Tensor) -> bool:
    """Contiguous at a 16-byte-aligned address: what `_aligned` would return unchanged."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` contiguous at a 16-byte-aligned address (copied only when it is not)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class NativeBackend(CommBackend):
    """Dispatch/combine over NVLink with the CUDA kernels of `ep_moe.native` (see the module docstring)."""

    name = "native"
    supported_dtypes = (torch.bfloat16, torch.float32)
    # The count exchange also carries per-expert counts (up to MAX_NOTIFY_EXPERTS local experts; above
    # that the list is read after the dispatch kernel), so the host has them at the one count sync.
    host_expert_counts = True
    # Given data memory (`use_data_memory`): the (operation, argument) that sized it, named when a call needs more
    # (it cannot grow); None: the backend allocates its data buffer itself (first use, growth).
    _fixed_data: tuple[str, str] | None = None
    data_allocations = 0
    """Data buffers this backend allocated itself (the first, and each growth); 0 with given memory."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                 num_nvl_bytes: int = 0, *, options: NativeOptions) -> None:
        super().__init__(group, device, timeout_s)
        C = _c()
        if self.num_ranks > C.MAX_RANKS:
            raise ValueError(f"ep_moe.Buffer: argument 'group' must have at most {C.MAX_RANKS} ranks for the "
                             f"native backend, got {self.num_ranks}")
        if (C.HEADER_LEN, C.HEADER_WORDS, C.MISMATCH_WORDS) != (HEADER_LEN, HEADER_WORDS, MISMATCH_WORDS):
            raise RuntimeError("ep_moe[native]: the kernels' header layout (native/kernels/kernels.h) differs from the "
                               "backend's mirror of it (ep_moe/backends/native_backend.py)")
        policy.check_same_on_every_rank(options, group)
        self.options = options
        self._fallback = TorchBackend(group, device, timeout_s)
        self._broken: str | None = None
        self._destroyed = False
        with torch.cuda.device(device):
            self._control = SymmetricBuffer(group, device, C.CONTROL_BYTES)
            self._control.tensor.zero_()
            self._state = torch.zeros(8, dtype=torch.int64, device=device)  # LocalState (64 bytes)
            self._scratch = torch.zeros(64, dtype=torch.int32, device=device)  # expert counts, zero between calls
            # the error record, then the mismatch record (native/kernels/kernels.h)
            self._use_error_words(torch.zeros(C.ERROR_WORDS + C.MISMATCH_WORDS, dtype=torch.int32, device="cpu",
                                              pin_memory=True))
            # [R * R] rows s sends r, then [R] tokens of every rank (written by notify), then the header check's
            # words: [R][HEADER_WORDS] every rank's header as seen, this rank's, the verdict (notify, exchange)
            self._host_counts = torch.zeros(C.MAX_RANKS * (C.MAX_RANKS + 1) + C.MAX_RANKS * HEADER_WORDS + HEADER_LEN + 1,
                                            dtype=torch.int32, device="cpu",
                                            pin_memory=True)
            self._host_expert_counts = torch.zeros(C.MAX_NOTIFY_EXPERTS, dtype=torch.int64, device="cpu",
                                                   pin_memory=True)
            # the kernels' Env of each options value in use (chunk counts are fixed per Env), checked equal
            # on every rank before its first use
            self._buffer_env = self._new_env(options)
            self._envs = {options: self._buffer_env}
            self._data: SymmetricBuffer | None = None
            self._retired: list[SymmetricBuffer] = []  # replaced data buffers, freed at destroy()
            # what the host knows of an exact dispatch's layout, by id of its route tensor while that
            # tensor lives (tensors cannot be weak dict keys: their == is elementwise): the rows its calls
            # need in a buffer, the [R][R] count matrix, every rank's tokens (shared by all ranks), and whether
            # the bound call of a key takes this layout (`_route_fits`)
            self._route_layout: dict[int, tuple[int, list[list[int]], list[int], dict[tuple, bool]]] = {}
            self._bound: dict[tuple, _Bound] = {}  # bound launches by key ("bound calls" below)
            self._bind_next: set[tuple] = set()  # keys seen once: their next full call binds
            # copy-engine calls: their side streams, sequence number and go word (ep_moe/native/jit/copy_engine.py)
            self._copy_streams: list[torch.cuda.Stream] = []
            self._copy_flag_stream: torch.cuda.Stream | None = None
            self._copy_seq = 0
            self._copy_go = torch.zeros(1, dtype=torch.int64, device=device)
            if num_nvl_bytes > 0:
                self._data = SymmetricBuffer(group, device, num_nvl_bytes)
                self.data_allocations += 1
            index = torch.device(device).index
            self._wait_for_stream = C.stream_waiter(torch.cuda.current_device() if index is None else index)
            torch.cuda.synchronize(device)
        # Diagnostics: when True, every dispatch/combine kernel stamps each block's timeline (the slots of
        # `TraceSlot` in native/kernels/kernels.h) into `last_trace[op]`, an int64 [blocks, TRACE_SLOTS] tensor of
        # global-timer ns (read by benchmarks/profile_native.py).
        self.trace_kernels = False
        self.last_trace: dict[str, torch.Tensor] = {}
        self.last_push_blocks: dict[str, int] = {}  # pusher blocks of the traced kernel (leading the trace)
        # copy-engine calls: [0] go set, [1 + s * MAX_COPY_ENGINE_CHUNKS + k] source s's chunk k landed (ns)
        self.last_copy_engine_trace: dict[str, torch.Tensor] = {}
        # Test only: None (off, at no cost), or an int32 [3] tensor on the device (source rank, header slot,
        # value added): the kernels see that rank's header of every call with the value added to that slot, so
        # that a one-rank group runs the whole mismatch path (compare, skip, record, ValueError). Read when the
        # kernel runs (a CUDA-graph replay sees the values of the moment). Every rank must set the same.
        self.test_header_perturbation: torch.Tensor | None = None
        # calls that took the expert-major paths (rows left in place; rows summed as they go out)
        self.in_place_dispatches = 0
        self.expert_row_combines = 0
        dist.barrier(group=group)  # every control block is zero before any peer writes into it

    # ---------------------------------------------------------------- health and errors
    def _use_error_words(self, words: torch.Tensor) -> None:
        """``words``: int32 ``[ERROR_WORDS + MISMATCH_WORDS]`` pinned host memory the kernels write, the error record
        then the mismatch record (native/kernels/kernels.h); the one word of each read at every call is read in
        place."""
        self._error = words
        error_words = words.numel() - MISMATCH_WORDS
        self._error_record, self._mismatch_record = words[:error_words], words[error_words:]
        self._error_code = ctypes.c_int32.from_address(self._error_record.data_ptr())
        self._mismatch_found = ctypes.c_int32.from_address(self._mismatch_record.data_ptr() + 4 * _FOUND)

    def _raise_if_failed(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"ep_moe[native]: the buffer is unusable after an earlier failure: {self._broken}")
        if self._destroyed:
            raise RuntimeError("ep_moe[native]: the buffer was destroyed")
        if self._error_code.value == 0:  # the common case: one word, read without a tensor op
            return
        record = self._error_record.tolist()
        code, rank, stage, channel, peer, detail = record[:6]
        value = (record[7] << 32) | (record[6] & 0xFFFFFFFF)
        where = STAGES.get(stage, f"stage {stage}")
        if code == 1:
            message = (f"ep_moe[native]: rank {rank} of {self.num_ranks} timed out after {value / 1e9:.3g} s in "
                       f"stage '{where}', channel {channel}, waiting for rank {peer} (chunk {detail}); "
                       f"timeout_s={self.timeout_s:g}")
            self._broken = message
            raise NativeTimeoutError(message)
        needed, capacity = value >> 32, value & 0xFFFFFFFF
        message = (f"ep_moe[native]: rank {rank}, stage '{where}': rank {peer} needs {needed} rows but the "
                   f"symmetric buffer holds {capacity} (and the output {detail}); create the Buffer with a larger "
                   f"num_nvl_bytes (Buffer.get_buffer_size_hint) or a larger num_worst_tokens")
        self._broken = message
        raise RuntimeError(message)

    def _wait_on_host(self) -> None:
        """Block until the work queued so far on the current stream ran, then surface kernel errors (not a
        disagreement an earlier call recorded: see `_raise_mismatch` for where that is raised)."""
        self._wait_for_stream()
        self._raise_if_failed()

    def _raise_mismatch(self) -> None:
        """Raise (and clear) the mismatch record of a call that did not wait on the host. Only after a host wait
        that covers that call: every rank's kernels found the same disagreements, so every rank has the same
        record there and raises at the same point (a check at a call's start could see it on one rank and not
        yet on another, and put the ranks out of step)."""
        if self._mismatch_found.value == 0:  # the common case: one word
            return
        error = parse_mismatch_record(self._mismatch_record.tolist())
        self._mismatch_record[_FOUND] = 0
        raise error

    def _header_check(self) -> tuple[list[int], bool, list[int], list[list[int]]]:
        """What a notify or an exchange wrote into host_counts (after a host wait), in one read: its words (the
        R x R counts, every rank's tokens, then the header check), then `parse_header_check` of the check."""
        base = self.num_ranks * (self.num_ranks + 1)
        words = self._host_counts[:base + self.num_ranks * HEADER_WORDS + HEADER_LEN + 1].tolist()
        return words, *parse_header_check(words[base:], self.num_ranks)

    def _header(self, op: int, hidden: int, dtype: torch.dtype, scales: int = 0, topk: int = 0, experts: int = 0,
                worst: int = 0, last_seq: int = 0) -> list[int]:
        """This rank's header of a call (the kernels fill in a handle's layout digest and the copy-engine
        number of the call)."""
        return [*agreement.header(op, hidden, dtype, scales, topk, experts, worst), 0, 0, last_seq]

    def _agree_first(self, header: list[int], prefix: torch.Tensor | None = None) -> None:
        """Before a host-side decision that every rank must take alike (the torch fallback, a first or larger
        data buffer, options not used yet): exchange the call's ``header`` (with the layout digest of
        ``prefix``, a handle's rank_prefix_matrix) as an operation of its own and wait for it; raise the
        call's ValueError on a disagreement. A rank whose shapes need no such decision meets this exchange in
        its call's own kernels, which see the disagreement too (and record it). Not during CUDA-graph capture
        (no host wait there; the decisions above then raise or cannot differ)."""
        if torch.cuda.is_current_stream_capturing():
            return
        if prefix is not None:
            prefix = prefix.to(torch.int32).contiguous()
        _c().exchange(self._buffer_env, header, prefix, self._host_counts, self.test_header_perturbation)
        self._wait_on_host()
        _, disagree, own, seen = self._header_check()
        if disagree:
            raise mismatch_error(self.rank, own, [h[:HEADER_LEN] for h in seen])

    # ---------------------------------------------------------------- options
    def _new_env(self, options: NativeOptions):
        return _c().Env(self.rank, self._control.ptrs, self._state, self._error, int(self.timeout_s * 1e9),
                        options.dispatch_chunks, options.combine_chunks, options.min_chunk_rows)

    def _options_of(self, config: Config) -> NativeOptions:
        """A call's options: ``config.native``, else the buffer's."""
        return config.native if config.native is not None else self.options

    def _env_for(self, options: NativeOptions, agree=None):
        """The kernels' Env of ``options``. A value this buffer has not used yet is first checked equal on
        every rank (a collective, so every rank must pass it in the same call; not during graph capture),
        after ``agree()`` (`_agree_first` of the call's header), when given."""
        if options is self.options:  # the common case, without hashing fifteen fields per call
            return self._buffer_env
        env = self._envs.get(options)
        if env is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("ep_moe[native]: config.native holds options this buffer has not used "
                                   "yet; their first use checks them on every rank, which cannot happen during "
                                   "CUDA-graph capture: run one call with them before capturing")
            if agree is not None:
                agree()
            policy.check_same_on_every_rank(options, self.group)
            env = self._envs[options] = self._new_env(options)
        return env

    # ---------------------------------------------------------------- sizing
    def _split(self, config: Config, op: str) -> tuple[int, int]:
        """(blocks, pusher blocks) for ``op`` from the SM budget: a share of the SMs push over NVLink
        (`ep_moe.native.policy.push_fraction`, as the planner models it), at least one, and at least one
        block is left to copy locally (own rows, drained chunks) or reduce."""
        num_sms = max(2, config.num_sms)
        if self.num_ranks == 1:
            return num_sms, 0
        push = round(num_sms * policy.push_fraction(self._options_of(config), op))
        return num_sms, min(num_sms - 1, max(1, push))

    def _ensure_data(self, needed: int, agree=None) -> None:
        """First use: a data buffer of the largest size any rank needs (one collective, host sync), after
        ``agree()`` (`_agree_first` of the call's header), when given."""
        if self._data is not None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("ep_moe[native]: run one dispatch before CUDA-graph capture (it sizes the "
                               "symmetric buffer), or create the Buffer with num_nvl_bytes")
        if agree is not None:
            agree()
        # a gloo group (ranks sharing a GPU, EP_MOE_SYMMETRIC_MEMORY=vmm) reduces on the host
        gloo = "gloo" in str(dist.get_backend(self.group)).lower()
        size = torch.tensor([needed], dtype=torch.int64, device="cpu" if gloo else self.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self.group)
        self._data = SymmetricBuffer(self.group, self.device, int(size.item()))
        self.data_allocations += 1

    def use_data_memory(self, local: torch.Tensor, local_fd: int, op: str, argument: str) -> None:
        """Collective over the group: make ``local`` this rank's data buffer instead of allocating one, e.g. the
        GPU segment of an `ep_moe.ElasticBuffer`'s elastic or hybrid range (`ep_moe.elastic.memory.SymmetricMemory` with
        ``share_gpu``). ``local``: uint8 ``[nbytes]`` on this backend's device, ``nbytes`` a multiple of 2 MiB and
        equal on every rank, one VMM allocation exported as ``local_fd``; the peers map it through the fd
        (`VmmSymmetricBuffer` with ``local``, whatever ``EP_MOE_SYMMETRIC_MEMORY`` says). The caller keeps the
        memory alive until `destroy` and may close ``local_fd`` once this returns.

        The data buffer then never grows: a call that needs more raises ValueError naming ``op``'s ``argument``
        before any row moves (on every rank alike; an exact-size dispatch after its count exchange). Fixed-size
        calls are sized for ``num_worst_tokens`` rows both ways, which holds when no rank passes more than
        ``num_worst_tokens / num_ranks`` tokens (ElasticBuffer: ``num_worst_tokens = R * num_max_tokens_per_rank``
        and each rank's ``T <= num_max_tokens_per_rank``); the kernels' capacity check guards the rest.
        Raises RuntimeError where a data buffer exists already."""
        if self._data is not None:
            raise RuntimeError("ep_moe[native]: use_data_memory must come before the first call (the backend "
                               "has a data buffer already: create the Buffer with num_nvl_bytes=0)")
        self._data = VmmSymmetricBuffer(self.group, self.device, local.numel(), local=local, local_fd=local_fd)
        self._fixed_data = (op, argument)

    def _worst_rows(self, num_worst_tokens: int) -> int:
        """Rows a fixed-size dispatch of ``num_worst_tokens`` and its combine need in any rank's buffer: what a
        rank receives is at most ``num_worst_tokens``, what comes back to a source at most ``R - 1`` times its
        tokens, so ``R - 1`` times ``num_worst_tokens`` in general, ``num_worst_tokens`` itself with given memory
        (whose user keeps every rank's tokens within ``num_worst_tokens / R``: `use_data_memory`)."""
        if self._fixed_data is not None:
            return num_worst_tokens
        return max(1, self.num_ranks - 1) * num_worst_tokens

    def _fit(self, rows: int | None, hidden: int, elem_size: int, num_scales: int, num_topk: int,
             agree=None, optional: bool = False) -> None:
        """Grow the data buffer (collectively) to hold ``rows`` rows of this shape, both ways.

        Every rank calls it with the same ``rows``: derived from the count matrix every rank shares, or
        from ``num_worst_tokens`` (`_worst_rows`). ``None``: unknown here; the kernels check capacity on the
        device instead. ``agree()`` runs before the buffer grows (where the call's header has not been checked
        yet: `_agree_first`). Given memory (`use_data_memory`) does not grow: too small, it raises ValueError
        naming the argument that sized it (after ``agree()``), or, ``optional`` (the caller checks the capacity
        itself and does without), returns."""
        if rows is None:
            return
        needed = sizing.data_bytes_for(rows, hidden, elem_size, num_scales, num_topk)
        if needed <= self._data.nbytes:
            return
        if self._fixed_data is not None:
            if optional:
                return
            if agree is not None:
                agree()
            op, argument = self._fixed_data
            raise ValueError(f"ep_moe.{op}: argument '{argument}' must be at least {needed} bytes for this call "
                             f"({rows} rows of hidden {hidden}, {elem_size}-byte elements, {num_scales} scales, "
                             f"top-{num_topk}; the native backend's dispatch/combine memory is the buffer's GPU "
                             f"segment, which does not grow), got {self._data.nbytes}")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"ep_moe[native]: the symmetric buffer must grow to {needed} bytes, which cannot "
                               "happen during CUDA-graph capture: run the same call once before capturing")
        if agree is not None:
            agree()
        torch.cuda.current_stream(self.device).synchronize()
        self._retired.append(self._data)
        self._data = SymmetricBuffer(self.group, self.device, needed + needed // 4)
        self.data_allocations += 1

    def _remember_layout(self, route: torch.Tensor, rows: int, counts: list[list[int]], tokens: list[int]) -> None:
        key = id(route)
        self._route_layout[key] = (rows, counts, tokens, {})
        weakref.finalize(route, self._route_layout.pop, key, None)

    def _rows_bound(self, handle: DispatchHandle, route: torch.Tensor) -> int | None:
        """Rows a handle's calls need in any rank's buffer, where every rank knows it the same way."""
        known = self._route_layout.get(id(route))
        if known is not None:
            return known[0]
        if handle.num_worst_tokens:
            return self._worst_rows(handle.num_worst_tokens)
        return None

    def _scratch_for(self, num_local_experts: int) -> torch.Tensor:
        if self._scratch.numel() < num_local_experts:
            self._scratch = torch.zeros(num_local_experts, dtype=torch.int32, device=self.device)
        return self._scratch

    def _trace(self, op: str, blocks: int, pushers: int) -> torch.Tensor | None:
        """The trace buffer of a traced call (None when tracing is off): the blocks' slots, then the
        copy-engine timeline (INT64_MAX until stamped; see `CopyEngineParams::trace` in native/kernels/kernels.h)."""
        if not self.trace_kernels:
            return None
        C = _c()
        flat = torch.zeros(blocks * C.TRACE_SLOTS + C.COPY_ENGINE_TRACE_SLOTS, dtype=torch.int64, device=self.device)
        flat[blocks * C.TRACE_SLOTS:] = torch.iinfo(torch.int64).max
        self.last_push_blocks[op] = pushers
        self.last_trace[op] = flat[:blocks * C.TRACE_SLOTS].view(blocks, C.TRACE_SLOTS)
        self.last_copy_engine_trace[op] = flat[blocks * C.TRACE_SLOTS:]
        return flat

    def _kernels_take(self, row_bytes: int, num_local_experts: int = 0) -> bool:
        return row_bytes % 16 == 0 and num_local_experts <= MAX_LOCAL_EXPERTS

    def combines_expert_rows(self, row_bytes: int) -> bool:
        """At two or more ranks, rows the kernels take, with the expert-major ops (which form the own rows; see
        `CommBackend.combines_expert_rows`)."""
        return (self.num_ranks > 1 and self.options.expert_major_fused and self._kernels_take(row_bytes)
                and _expert_major_ops())

    def receives_in_place(self, row_bytes: int, num_experts: int) -> bool:
        """A fresh or cached (``num_experts`` 0) dispatch the kernels take, at two or more ranks, with the
        expert-major ops (which permute the rows from where they landed; see `CommBackend.receives_in_place`)."""
        return (self.num_ranks > 1 and self.options.expert_major_fused
                and self._kernels_take(row_bytes, num_experts // self.num_ranks) and _expert_major_ops())

    # ---------------------------------------------------------------- layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)``
        by the layout kernel; equal to `ep_moe.buffer.routing_layout.dispatch_layout`."""
        per_rank, per_expert, in_rank = _c().layout(topk_idx.contiguous(), num_experts, self.num_ranks)
        return per_rank, per_expert, in_rank

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, handle,
                 num_experts, expert_alignment, num_worst_tokens, config: Config, *, consume=None) -> DispatchResult:
        """``consume`` (a fresh or cached dispatch that `receives_in_place`): the kernel leaves the received rows
        where they landed (no copy into recv_x; never by the copy engine) and ``consume(result, ReceivedRows)``
        runs on this stream right after it; its value is ``result.consumed``."""
        self._raise_if_failed()
        if handle is not None and consume is None:
            recv = self._bound_cached_dispatch(x, x_scales, handle, config)
            if recv is not None:
                return DispatchResult(*recv, None, None, None, handle)
        elif num_worst_tokens and consume is None:
            fixed = self._bound_fixed_dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank,
                                               num_tokens_per_rank, num_experts, expert_alignment, num_worst_tokens,
                                               config)
            if fixed is not None:
                return fixed
        row = x.shape[1] * x.element_size()
        num_scales = x_scales.shape[1] if x_scales is not None else 0
        cached = handle is not None
        # This rank's header of the call (agreement's; a handle's layout digest is computed in the kernels).
        if cached:
            header = self._header(agreement.OP_CACHED_DISPATCH, x.shape[1], x.dtype, num_scales,
                                  worst=handle.num_worst_tokens)
        else:
            header = self._header(agreement.OP_DISPATCH, x.shape[1], x.dtype, num_scales, topk_idx.shape[1],
                                  num_experts, num_worst_tokens, last_seq=self._copy_seq)
        prefix_of_handle = handle.rank_prefix_matrix if cached else None

        def agree() -> None:
            self._agree_first(header, prefix_of_handle)

        local_experts = num_experts // self.num_ranks if handle is None else 0
        if consume is not None and not self.receives_in_place(row, num_experts if handle is None else 0):
            raise ValueError("ep_moe[native]: argument 'consume' needs a dispatch that receives_in_place")
        if not self._kernels_take(row, local_experts):
            agree()  # a rank whose shapes the kernels take meets this in its kernels (another header)
            return self._fallback.dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank,
                                           num_tokens_per_rank, handle, num_experts, expert_alignment,
                                           num_worst_tokens, config)
        C = _c()
        options = self._options_of(config)
        env = self._env_for(options, agree)
        perturb = self.test_header_perturbation
        x, x_scales = _aligned(x), _aligned(x_scales)
        num_tokens, hidden = x.shape
        num_ranks, me = self.num_ranks, self.rank
        blocks, pushers = self._split(config, "dispatch")

        if cached:  # the handle's layout, no count exchange
            route = handle.backend_state if handle.backend_state is not None else self._route_of(handle)
            prefix = handle.rank_prefix_matrix.to(torch.int32).contiguous()
            rows = handle.num_recv_rows
            self._ensure_data(sizing.data_bytes_for(num_ranks * max(num_tokens, 1), hidden, x.element_size(),
                                                    num_scales, 0), agree)
            self._fit(self._rows_bound(handle, route), hidden, x.element_size(), num_scales, 0, agree)
            layout = self._route_layout.get(id(route))
            in_place = consume is not None
            tokens = None
            if layout is not None and not in_place:  # rows left in place come by the pushers, in output order
                tokens = self._copy_engine_tokens(options, True, layout[1], layout[2], hidden,
                                                  x.element_size(), num_scales, 0, agree)
            regions = sizing.dispatch_regions(self._data.nbytes, row, 4 * num_scales, 0)
            recv_x = torch.empty(0 if in_place else rows, hidden, dtype=x.dtype, device=x.device)
            recv_scales = torch.empty(rows, num_scales, dtype=torch.float32, device=x.device) \
                if num_scales and not in_place else None
            args = (env, self._data.ptrs, list(regions[1:]), prefix, route[1], x, x_scales, None, None, 0,
                    recv_x, recv_scales, None, None, None, None, None, None, 1, regions.rows, True, blocks)
            if tokens is None:
                # with rows in place, the handle's recv_src_idx only gives the kernel the received row count
                key = None if in_place else self._bindable(_CACHED, handle, route, options, config, x.shape,
                                                           x.dtype, -1 if x_scales is None else num_scales)
                bound = C.dispatch(*args, pushers, self._trace("dispatch_cached", blocks, pushers),
                                   *self._NO_COPY_ENGINE, [], [], handle.recv_src_idx if in_place else None, header,
                                   perturb, in_place, bind=self._binds(key))
                self._keep_bound(key, bound, options, layout)
            else:  # x goes to the peers by the copy engine (see combine)
                with self._copy_engine_call(options, "dispatch", "dispatch_cached", blocks, num_scales) as ce:
                    C.dispatch(*args, *ce, tokens, policy.prefix_matrix(layout[1]), handle.recv_src_idx, header,
                               perturb, False)
            if not in_place:
                return DispatchResult(recv_x, recv_scales, None, None, None, handle)
            # as in a fresh dispatch (below): the peers' rows stay in this rank's buffer in output order, the own
            # rows are x's; `consume` reads them on this stream before any later call of this buffer
            received = ReceivedRows(
                self._data_view(regions.x, regions.rows, hidden, x.dtype),
                self._data_view(regions.scales, regions.rows, num_scales, torch.float32) if num_scales else None,
                rows, x, x_scales, route[1].view(num_ranks, num_tokens)[me], prefix, me)
            result = DispatchResult(None, None, None, None, None, handle)
            self.in_place_dispatches += 1
            return result._replace(consumed=consume(result, received))

        num_topk = topk_idx.shape[1]
        topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        is_token_in_rank = is_token_in_rank.contiguous()
        self._ensure_data(sizing.data_bytes_for(max(num_ranks * num_tokens, num_worst_tokens, 1), hidden,
                                                x.element_size(), num_scales, num_topk), agree)
        if num_worst_tokens:  # no rank receives more; what comes back: `_worst_rows`
            self._fit(self._worst_rows(num_worst_tokens), hidden, x.element_size(), num_scales, num_topk, agree)
        regions = sizing.dispatch_regions(self._data.nbytes, row, 4 * num_scales, num_topk)
        prefix = torch.empty(num_ranks, num_ranks, dtype=torch.int32, device=x.device)
        route = torch.empty(2, num_tokens, num_ranks, dtype=torch.int32, device=x.device)  # pos, send_list
        local_experts = num_experts // num_ranks
        experts_travel = not num_worst_tokens and local_experts <= C.MAX_NOTIFY_EXPERTS
        # The notify also exchanges the headers (a fixed-size dispatch's verdict reaches its dispatch kernel on
        # the device; an exact-size one's the host, below).
        per_rank = num_tokens_per_rank.contiguous()
        notify_bound = self._launch_bound(
            self._launch_key(_NOTIFY, options, config, num_tokens, per_rank.dtype, num_worst_tokens, regions.rows,
                             num_topk, local_experts, expert_alignment, experts_travel, *header),
            _notify_values(is_token_in_rank, per_rank, prefix, route, topk_idx if experts_travel else None),
            lambda bind: C.notify(env, is_token_in_rank, per_rank, prefix, route[0], route[1], self._host_counts,
                                  num_worst_tokens, regions.rows, topk_idx, local_experts, expert_alignment,
                                  self._host_expert_counts if experts_travel else None, header, perturb, bind=bind),
            options)
        counts_list = None
        tokens = None  # every rank's tokens when x goes by the copy engine
        if num_worst_tokens:
            rows = num_worst_tokens
        else:
            self._wait_on_host()  # an earlier call's mismatch record is raised once this call's kernels are queued
            host, disagree, own, seen = self._header_check()
            if disagree:  # before the counts are used: no dispatch kernel follows, so close the notify's epoch
                C.close_epoch(env)
                raise mismatch_error(me, own, [h[:HEADER_LEN] for h in seen])
            # Every rank's next copy-engine number the same, above every flag written so far (kernels.h).
            self._copy_seq = max(self._copy_seq, *(h[_LAST_SEQ] for h in seen))
            counts = [host[s * num_ranks:(s + 1) * num_ranks] for s in range(num_ranks)]
            tokens = host[num_ranks * num_ranks:num_ranks * (num_ranks + 1)]
            if experts_travel:
                counts_list = self._host_expert_counts[:local_experts].tolist()
            received = [sum(column) for column in zip(*counts)]  # rows each rank receives
            rows = received[me]
            # Every rank sees the same matrix, so all grow together (or none does).
            most = max(*received, *(sum(sent) - sent[s] for s, sent in enumerate(counts)))  # or sent away
            self._remember_layout(route, most, counts, tokens)
            try:
                self._fit(most, hidden, x.element_size(), num_scales, num_topk)
            except ValueError:  # given memory too small (every rank alike): no dispatch kernel follows
                C.close_epoch(env)
                raise
            # rows left in place are read from the pushers' layout: never by the copy engine
            tokens = None if consume is not None else self._copy_engine_tokens(
                options, False, counts, tokens, hidden, x.element_size(), num_scales, num_topk)
            regions = sizing.dispatch_regions(self._data.nbytes, row, 4 * num_scales, num_topk)
        in_place = consume is not None
        out = _FreshOutputs.of(x, num_scales, rows, num_topk, local_experts, in_place)
        recv_x, recv_scales, recv_idx, recv_w, src_idx, src_rank, counts_out = out
        scratch = self._scratch_for(local_experts)
        args = (env, self._data.ptrs, list(regions[1:]), prefix, route[1], x, x_scales, topk_idx,
                topk_weights, local_experts, recv_x, recv_scales, recv_idx, recv_w, src_idx, src_rank,
                scratch, counts_out, expert_alignment, regions.rows, False, blocks)
        if tokens is None and not in_place:
            dispatch_bound = self._launch_bound(
                self._launch_key(_DISPATCH, options, config, x.shape, x.dtype, num_scales, num_topk, local_experts,
                                 expert_alignment, regions.rows, *header),
                out.dispatch_values(prefix, route, x, x_scales, topk_idx, topk_weights, scratch),
                lambda bind: C.dispatch(*args, pushers, self._trace("dispatch", blocks, pushers),
                                        *self._NO_COPY_ENGINE, [], [], None, header, perturb, False, bind=bind),
                options)
            if num_worst_tokens and notify_bound is not None and dispatch_bound is not None:
                # nothing above was decided on the host but by the key's shapes: the whole call binds
                self._keep_bound(self._fixed_key(options, config, x, x_scales, topk_idx, topk_weights,
                                                 is_token_in_rank, per_rank, num_experts, expert_alignment,
                                                 num_worst_tokens), (notify_bound, dispatch_bound), options, None)
        elif tokens is None:
            C.dispatch(*args, pushers, self._trace("dispatch", blocks, pushers), *self._NO_COPY_ENGINE, [], [], None,
                       header, perturb, in_place)
        else:  # x, the top-k and the send lists go by the copy engine
            with self._copy_engine_call(options, "dispatch", "dispatch", blocks, num_scales) as ce:
                C.dispatch(*args, *ce, tokens, policy.prefix_matrix(counts), None, header, perturb, False)
        new_handle = DispatchHandle(prefix, src_idx, src_rank, is_token_in_rank,
                                    -1 if num_worst_tokens else rows, num_worst_tokens, route)
        if not num_worst_tokens:
            if counts_list is None:  # too many local experts to travel in notify
                counts_list = counts_out.tolist()
            # A disagreement an earlier call (without a host wait) recorded: raised here, after this call's
            # kernels are queued, so that every rank's calls stay in step (see _raise_mismatch).
            self._raise_mismatch()
        if not in_place:
            return DispatchResult(recv_x, recv_scales, recv_idx, recv_w, counts_out, new_handle, counts_list)
        # The peers' rows stay in this rank's buffer, where the pushers put them in output order; the own rows
        # are x's (send list to itself). `consume` reads them on this stream before any later call of this
        # buffer is queued behind it: peers write into this buffer again only after this rank's next kernel
        # (on this same stream, so after `consume`'s work) released its arrival (`arrive`) for that call, and a
        # buffer that grows is only retired (kept until destroy), never freed or reused.
        received = ReceivedRows(
            self._data_view(regions.x, regions.rows, hidden, x.dtype),
            self._data_view(regions.scales, regions.rows, num_scales, torch.float32) if num_scales else None,
            rows, x, x_scales, route[1].view(num_ranks, num_tokens)[me], prefix, me)
        result = DispatchResult(None, None, recv_idx, recv_w, counts_out, new_handle, counts_list)
        self.in_place_dispatches += 1
        return result._replace(consumed=consume(result, received))

    def _data_view(self, offset: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, width]`` of ``dtype`` at byte ``offset`` of this rank's data buffer (a view)."""
        nbytes = rows * width * dtype.itemsize
        return self._data.tensor[offset:offset + nbytes].view(dtype).view(rows, width)

    def _route_of(self, handle: DispatchHandle) -> torch.Tensor:
        """``[2, T, R]`` int32 (pos, send_list) of a handle made by another backend."""
        in_rank = handle.is_token_in_rank
        num_tokens, num_ranks = in_rank.shape
        pos = torch.where(in_rank, torch.cumsum(in_rank.to(torch.int32), 0, dtype=torch.int32) - 1, -1)
        send_list = torch.zeros(num_ranks, num_tokens, dtype=torch.int32, device=in_rank.device)
        tokens = torch.arange(num_tokens, dtype=torch.int32, device=in_rank.device).expand(num_ranks, -1)
        dest = torch.where(in_rank.t(), pos.t().to(torch.int64), num_tokens)
        padded = torch.zeros(num_ranks, num_tokens + 1, dtype=torch.int32, device=in_rank.device)
        padded.scatter_(1, dest, tokens)
        send_list.copy_(padded[:, :num_tokens])
        return torch.stack([pos.to(torch.int32), send_list.view(num_tokens, num_ranks)])

    # ---------------------------------------------------------------- combine
    def combine(self, y, handle, topk_weights, bias, config: Config, *, expert_rows=None):
        """``expert_rows`` = ``(sorted_slots [N, K] int64, weights [M] fp32 or None)`` (`combines_expert_rows`):
        ``y`` is ``[M, H]`` expert-major; the pushers form each rank-major row as they send it (never by the
        copy engine), and the own rows, which the reducers read in place, are formed first
        (``ep_moe_native::unpermute_own_rows``)."""
        self._raise_if_failed()
        if expert_rows is None:
            combined = self._bound_combine(y, handle, topk_weights, bias, config)
            if combined is not None:
                return combined
        header = self._header(agreement.OP_COMBINE, y.shape[1], y.dtype,
                              topk=topk_weights.shape[1] if topk_weights is not None else -1,
                              worst=handle.num_worst_tokens)

        def agree() -> None:
            self._agree_first(header, handle.rank_prefix_matrix)

        if expert_rows is not None:
            if not self.combines_expert_rows(y.shape[1] * y.element_size()) or any(b is not None for b in bias):
                raise ValueError("ep_moe[native]: argument 'expert_rows' needs rows the kernels take and no bias")
            sorted_slots, expert_weights = expert_rows
            expert_y = _aligned(y)
            expert_weights = None if expert_weights is None else expert_weights.contiguous()
            prefix = handle.rank_prefix_matrix.to(torch.int32).contiguous()
            y = _own_rows(expert_y, expert_weights, sorted_slots.contiguous(), prefix, self.rank)
            expert_args = (expert_y, expert_weights, sorted_slots.contiguous())
            self.expert_row_combines += 1
        else:
            expert_args = (None, None, None)
        if not self._kernels_take(y.shape[1] * y.element_size()) or any(
                b is not None and b.dtype not in self.supported_dtypes for b in bias):
            agree()  # a rank whose shapes the kernels take meets this in its kernels (another header)
            return self._fallback.combine(y, handle, topk_weights, bias, config)
        C = _c()
        options = self._options_of(config)
        env = self._env_for(options, agree)
        perturb = self.test_header_perturbation
        y, topk_weights = _aligned(y), (topk_weights.contiguous() if topk_weights is not None else None)
        num_tokens, hidden = handle.num_tokens, y.shape[1]
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        route = handle.backend_state if handle.backend_state is not None else self._route_of(handle)
        self._ensure_data(sizing.data_bytes_for(max(y.shape[0], self.num_ranks * num_tokens, 1), hidden,
                                                y.element_size(), 0, num_topk), agree)
        self._fit(self._rows_bound(handle, route), hidden, y.element_size(), 0, num_topk, agree)
        regions = sizing.combine_regions(self._data.nbytes, hidden * y.element_size(), num_topk)
        out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
        out_w = torch.empty(num_tokens, num_topk, dtype=torch.float32, device=y.device) if num_topk else None
        bias0, bias1 = (b.contiguous() if b is not None else None for b in bias)
        blocks, pushers = self._split(config, "combine")
        args = (env, self._data.ptrs, regions.y, regions.weights, regions.rows,
                handle.rank_prefix_matrix.to(torch.int32).contiguous(), handle.is_token_in_rank.contiguous(),
                route[0], y, topk_weights, bias0, bias1, out, out_w, blocks)
        # expert-major rows are summed as they go out: never by the copy engine
        counts = None if expert_rows is not None else self._copy_engine_counts(options, route,
                                                                                hidden * y.element_size())
        bulk = policy.bulk_reduce(options, copy_engine=counts is not None)
        order = None if handle.summation_order is None else handle.summation_order.contiguous()
        if counts is None:
            key = None if expert_rows is not None else self._bindable(
                _COMBINE, handle, route, options, config, num_tokens, y.shape[1], y.dtype,
                -1 if topk_weights is None else num_topk, *(None if b is None else b.dtype for b in (bias0, bias1)))
            bound = C.combine(*args, pushers, self._trace("combine", blocks, pushers), *self._NO_COPY_ENGINE, [],
                              bulk, header, perturb, *expert_args, order, bind=self._binds(key))
            self._keep_bound(key, bound, options, self._route_layout.get(id(route)))
        else:  # the rows go back by the copy engine
            with self._copy_engine_call(options, "combine", "combine", blocks) as ce:
                C.combine(*args, *ce, policy.prefix_matrix(counts), bulk, header, perturb, *expert_args, order)
        return out, out_w

    # ---------------------------------------------------------------- bound calls
    # A cached dispatch or a combine whose full path (above) found nothing to decide on the host but its shapes
    # keeps its launch (`ep_moe.native.jit.intranode.BoundLaunch`) under a key of everything that path's launch
    # depends on but the tensors: op, shapes and dtypes, the handle's fixed-size rows, the options and SM budget,
    # the data buffer. A later call with the same key and a handle known to fit (`_route_fits`) checks its tensors
    # as the launcher does and launches with their addresses: the same kernel with the same struct, bit for bit,
    # without the host path's decisions and checks. A fresh dispatch runs its whole host path and launches its
    # notify and dispatch kernels through bound launches (`_launch_bound`). A key binds at its second full call.
    _MAX_BOUND = 64

    def _bindable(self, op: int, handle: DispatchHandle, route: torch.Tensor, options: NativeOptions,
                  config: Config, *shapes) -> tuple | None:
        """The key of a full-path call that may be bound, or None (traced or perturbed calls, a handle whose route
        is not its own, graph capture: a layout checked there saw no copy engine only because of the capture)."""
        if route is not handle.backend_state or torch.cuda.is_current_stream_capturing():
            return None
        return self._launch_key(op, options, config, *shapes, handle.num_worst_tokens)

    def _launch_key(self, op: int, options: NativeOptions, config: Config, *shapes) -> tuple | None:
        """The key of a launch with these shapes and the options, SM budget and data buffer in use, or None where
        launches are not bound (traced or perturbed calls)."""
        if self.trace_kernels or self.test_header_perturbation is not None:
            return None
        return (op, *shapes, id(options), config.num_sms, id(self._data))

    def _launch_bound(self, key: tuple | None, values: tuple, full, options: NativeOptions) -> BoundLaunch | None:
        """One launch of a fresh dispatch: the launch bound under ``key`` with ``values`` (its bound fields, in
        order), else ``full(bind)``, the launcher's call (binding as `_binds` says), whose bound launch is kept.
        Returns the bound launch that launched or was kept, if any."""
        found = None if key is None else self._bound.get(key)
        if found is not None:
            found.launch(*values)
            return found.launch
        bound = full(self._binds(key))
        self._keep_bound(key, bound, options, None)
        return bound

    def _binds(self, key: tuple | None) -> bool:
        """Whether a full-path call of ``key`` binds its launch: from the second call of a key on (a shape seen once
        is not worth the copy; shapes that change every call then cost one set lookup each), unless it is bound."""
        if key is None or key in self._bound:
            return False
        if key in self._bind_next:
            return True
        if len(self._bind_next) >= self._MAX_BOUND:
            self._bind_next.clear()
        self._bind_next.add(key)
        return False

    def _keep_bound(self, key: tuple | None, bound, options: NativeOptions, layout) -> None:
        """Keep ``bound`` (if any) under ``key`` (with ``options``, so that their id is not reused while the key
        lives), and mark the handle's layout, which the full path just launched without the copy engine or a
        growth, as taking the key's bound call."""
        if key is None:
            return
        if bound is not None:
            if len(self._bound) >= self._MAX_BOUND:
                self._bound.clear()
            self._bound[key] = _Bound(bound, options)
        if layout is not None:
            layout[3][key] = True

    def _route_fits(self, handle: DispatchHandle, route: torch.Tensor, key: tuple, options: NativeOptions,
                    hidden: int, elem_size: int, num_scales: int, num_topk: int, cached: bool) -> bool:
        """Whether the full path of this handle's call (a cached dispatch or a combine of ``key``) would only launch:
        fixed-size rows (the buffer was fitted for them when the key was bound, and such a layout never goes by the
        copy engine), or an exact-size layout whose rows fit the data buffer (no growth) and whose call the policy
        keeps off the copy engine, as the full path decides them (`_fit`, `_copy_engine_tokens`,
        `_copy_engine_counts`); asked once per layout and key."""
        layout = self._route_layout.get(id(route))
        if layout is None:
            return handle.num_worst_tokens > 0
        known = layout[3].get(key)
        if known is None:
            row_bytes = hidden * elem_size + 4 * num_scales
            fits = sizing.data_bytes_for(layout[0], hidden, elem_size, num_scales, num_topk) <= self._data.nbytes
            copy_engine = (policy.wanted_for_dispatch(options, layout[1], layout[2], row_bytes, True) if cached
                           else policy.wanted(options, layout[1], row_bytes))
            known = layout[3][key] = fits and not copy_engine
        return known

    def _bound_cached_dispatch(self, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle,
                               config: Config) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A cached dispatch through its bound launch: ``(recv_x, recv_scales)``, or None (take the full path)."""
        route = handle.backend_state
        if not self._bound or route is None:
            return None
        options = self._options_of(config)
        num_scales = 0 if scales is None else scales.shape[1]
        key = self._launch_key(_CACHED, options, config, x.shape, x.dtype, num_scales if scales is not None else -1,
                               handle.num_worst_tokens)
        found = self._bound.get(key)
        prefix = handle.rank_prefix_matrix
        if (found is None or not _ready(x) or (scales is not None and not _ready(scales))
                or prefix.dtype != torch.int32 or not prefix.is_contiguous()
                or not self._route_fits(handle, route, key, options, x.shape[1], x.element_size(), num_scales, 0,
                                        True)):
            return None
        rows = handle.num_recv_rows
        recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=x.device)
        recv_scales = None if scales is None else torch.empty(rows, scales.shape[1], dtype=torch.float32,
                                                              device=x.device)
        found.launch(prefix.data_ptr(), _send_list(route), x.data_ptr(), _address(scales), recv_x.data_ptr(),
                     _address(recv_scales), rows)
        return recv_x, recv_scales

    def _bound_combine(self, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None, bias,
                       config: Config) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A combine through its bound launch: ``(out, out_weights)``, or None (take the full path)."""
        route = handle.backend_state
        if not self._bound or route is None:
            return None
        bias0, bias1 = bias
        options = self._options_of(config)
        prefix, in_rank, order = handle.rank_prefix_matrix, handle.is_token_in_rank, handle.summation_order
        num_tokens, num_topk = in_rank.shape[0], -1 if weights is None else weights.shape[1]
        key = self._launch_key(_COMBINE, options, config, num_tokens, y.shape[1], y.dtype, num_topk,
                               None if bias0 is None else bias0.dtype, None if bias1 is None else bias1.dtype,
                               handle.num_worst_tokens)
        found = self._bound.get(key)
        if (found is None or not _ready(y) or not all(t is None or t.is_contiguous() for t in (weights, bias0, bias1))
                or prefix.dtype != torch.int32 or not prefix.is_contiguous() or not in_rank.is_contiguous()
                or (order is not None and not order.is_contiguous())
                or not self._route_fits(handle, route, key, options, y.shape[1], y.element_size(), 0, max(num_topk, 0),
                                        False)):
            return None
        out = torch.empty(num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        out_w = torch.empty(num_tokens, num_topk, dtype=torch.float32, device=y.device) if num_topk > 0 else None
        found.launch(prefix.data_ptr(), in_rank.data_ptr(), route.data_ptr(), y.data_ptr(), _address(weights),
                     _address(bias0), _address(bias1), out.data_ptr(), _address(out_w), _address(order))
        return out, out_w

    def _fixed_key(self, options: NativeOptions, config: Config, x: torch.Tensor, scales: torch.Tensor | None,
                   topk_idx: torch.Tensor, topk_weights: torch.Tensor, in_rank: torch.Tensor, per_rank: torch.Tensor,
                   num_experts: int, expert_alignment: int, num_worst_tokens: int) -> tuple | None:
        """The key of a whole fixed-size dispatch: every tensor's shape and dtype (what the launchers checked), the
        arguments its header holds and the copy-engine number the header carries (`_launch_key` adds the rest)."""
        return self._launch_key(_FIXED, options, config, x.shape, x.dtype, None if scales is None else scales.shape,
                                topk_idx.shape, topk_idx.dtype, topk_weights.shape, topk_weights.dtype, in_rank.shape,
                                in_rank.dtype, per_rank.shape, per_rank.dtype, num_experts, expert_alignment,
                                num_worst_tokens, self._copy_seq)

    def _bound_fixed_dispatch(self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor,
                              topk_weights: torch.Tensor, in_rank: torch.Tensor, per_rank: torch.Tensor,
                              num_experts: int, expert_alignment: int, num_worst_tokens: int,
                              config: Config) -> DispatchResult | None:
        """A fixed-size dispatch through the notify and dispatch launches its full path bound under the same
        `_fixed_key`: its result, or None (take the full path). The full path decides nothing on the host for such
        a call but from the key (no host read, no copy engine, the buffer already fitted for ``num_worst_tokens``)."""
        if not self._bound:
            return None
        options = self._options_of(config)
        found = self._bound.get(self._fixed_key(options, config, x, scales, topk_idx, topk_weights, in_rank, per_rank,
                                                num_experts, expert_alignment, num_worst_tokens))
        if (found is None or not _ready(x) or (scales is not None and not _ready(scales))
                or not (topk_idx.is_contiguous() and topk_weights.is_contiguous() and in_rank.is_contiguous()
                        and per_rank.is_contiguous())):
            return None
        notify, dispatch = found.launch
        num_tokens, num_ranks = x.shape[0], self.num_ranks
        local_experts = num_experts // num_ranks
        prefix = torch.empty(num_ranks, num_ranks, dtype=torch.int32, device=x.device)
        route = torch.empty(2, num_tokens, num_ranks, dtype=torch.int32, device=x.device)  # pos, send_list
        notify(*_notify_values(in_rank, per_rank, prefix, route, None))
        out = _FreshOutputs.of(x, 0 if scales is None else scales.shape[1], num_worst_tokens, topk_idx.shape[1],
                               local_experts, False)
        dispatch(*out.dispatch_values(prefix, route, x, scales, topk_idx, topk_weights,
                                      self._scratch_for(local_experts)))
        handle = DispatchHandle(prefix, out.src_idx, out.src_rank, in_rank, -1, num_worst_tokens, route)
        return DispatchResult(out.recv_x, out.recv_scales, out.recv_idx, out.recv_w, out.counts, handle)

    # ---------------------------------------------------------------- copy engine
    # the copy-engine arguments of a call without it: streams, flag stream, sequence number, go word, shares
    _NO_COPY_ENGINE = ([], 0, 0, None, [])

    @contextlib.contextmanager
    def _copy_engine_call(self, options: NativeOptions, op: str, trace_op: str, blocks: int,
                          num_scales: int = 0):
        """The kernel arguments from the pusher count to the chunk shares of one copy-engine ``op``
        (`ep_moe.native.policy`; no pushers: every block copies locally or reduces; ``num_scales`` > 0:
        FP8 rows, which have their own shares). Its copy streams start after this stream's inputs are
        ready, and this stream waits for them (and the flag stream) afterwards (the caller's inputs are
        read there)."""
        stream = torch.cuda.current_stream(self.device)
        wanted = policy.copy_engine_streams(options, op)
        while len(self._copy_streams) < wanted:
            self._copy_streams.append(torch.cuda.Stream(self.device))
        streams = self._copy_streams[:wanted]
        for side in streams:
            side.wait_stream(stream)
        flags = None
        if policy.copy_engine_flag_stream(options, op):  # its work waits for the copy streams' events only
            if self._copy_flag_stream is None:
                self._copy_flag_stream = torch.cuda.Stream(self.device)
            flags = self._copy_flag_stream
        self._copy_seq += 1
        yield (0, self._trace(trace_op, blocks, 0), [side.cuda_stream for side in streams],
               0 if flags is None else flags.cuda_stream, self._copy_seq, self._copy_go,
               policy.copy_engine_shares(options, op, fp8=num_scales > 0))
        for side in streams + ([] if flags is None else [flags]):
            stream.wait_stream(side)

    def _copy_engine_layout(self, route: torch.Tensor) -> tuple[int, list[list[int]], list[int]] | None:
        """What the host knows of the handle's layout when a copy-engine call is possible, else None."""
        if torch.cuda.is_current_stream_capturing():
            return None
        return self._route_layout.get(id(route))

    def _copy_engine_counts(self, options: NativeOptions, route: torch.Tensor, row_bytes: int
                            ) -> list[list[int]] | None:
        """The count matrix when this combine goes through the copy engine (`ep_moe.native.policy.wanted`),
        else None: the same answer on every rank."""
        known = self._copy_engine_layout(route)
        if known is None:
            return None
        counts = known[1]
        return counts if policy.wanted(options, counts, row_bytes) else None

    def _copy_engine_tokens(self, options: NativeOptions, cached: bool, counts: list[list[int]],
                            tokens: list[int], hidden: int, elem_size: int, num_scales: int, num_topk: int,
                            agree=None) -> list[int] | None:
        """``tokens`` when this dispatch (``cached``: a re-dispatch with a handle) sends x by the copy engine,
        else None (the same answer on every rank; never during graph capture). The buffer grows
        (collectively, after ``agree()``: see `_fit`) until every rank's tokens fit its slot."""
        if torch.cuda.is_current_stream_capturing():
            return None
        row_bytes = hidden * elem_size + 4 * num_scales
        if not policy.wanted_for_dispatch(options, counts, tokens, row_bytes, cached):
            return None
        self._fit(self.num_ranks * max(tokens), hidden, elem_size, num_scales, num_topk, agree, optional=True)
        regions = sizing.dispatch_regions(self._data.nbytes, hidden * elem_size, 4 * num_scales, num_topk)
        return tokens if max(tokens) <= regions.rows // self.num_ranks else None

    # ---------------------------------------------------------------- lifecycle
    def barrier(self) -> None:
        """Every rank's arrival (raises after ``timeout_s``); then a disagreement an earlier call recorded (every
        call of this rank before the barrier has run: the device is synchronized) raises its ValueError.

        The barrier kernel runs only after every kernel this rank queued before, on any stream (an asynchronous
        call's run on the Buffer's communication stream): a kernel takes its epoch from the device state when it
        starts, so a barrier beside another kernel would take the same epoch, and this rank would stay one
        operation behind its peers (docs/native.md, "Rank agreement")."""
        self._raise_if_failed()
        torch.cuda.synchronize(self.device)
        self._raise_if_failed()
        _c().barrier(self._buffer_env)
        torch.cuda.synchronize(self.device)
        self._raise_if_failed()
        self._raise_mismatch()

    def destroy(self) -> None:
        if self._destroyed:
            return
        torch.cuda.synchronize(self.device)
        for buf in [self._data, self._control, *self._retired]:
            if buf is not None:
                buf.destroy()
        self._data, self._retired = None, []
        self._destroyed = True
