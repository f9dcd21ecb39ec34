"""The intranode kernels (layout, notify, dispatch, combine, barrier) through the JIT layer: the functions that
`ep_moe.backends.native_backend` calls, each checking its arguments and launching its kernel.

The kernels are ``kernels/dispatch_layout.cuh`` and ``kernels/intranode_kernels.cuh`` (included by
``kernels/intranode.cu``), compiled once per architecture (nothing is specialized: they take ranks, rows and types
at run time); the host half (checks, filling the parameter structs) is done here over the
ctypes mirrors of `ep_moe.native.jit.params`, and every kernel is launched with the driver API on the current
stream of the tensors' device. Before the first launch on a device the module checks that the mirrors and the
constants it uses equal what the compiler sees (`JitLayoutError` otherwise).

A call with the copy engine (``copy_engine_seq > 0``) launches its kernel, then queues the copy-engine half
(`ep_moe.native.jit.copy_engine`, over the driver API) on the side streams the backend passes.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

import torch
from torch import Tensor

from . import KernelSource, PerDevice, module
from . import params as P
from .copy_engine import cuda_ops, enqueue_combine, enqueue_dispatch, most_rows_back
from .cubin import find_kernel, function_symbols
from .driver import PTR, Function, HostEvent, host_device_pointer, memset_zero_async, prepared_args
from .launch_args import check_all as _check_all
from .launch_args import check_cuda as _check_cuda
from .launch_args import device_index as _device
from .launch_args import fail as _fail
from .launch_args import is_pinned as _is_pinned
from .launch_args import ptr as _ptr
from .launch_args import raw_stream as _raw_stream
from .layout_probe import JitLayoutError, probe_file, read_back

_K = dict(P.CONSTANTS)
MAX_RANKS = _K["kMaxRanks"]
MAX_CHUNKS = _K["kMaxChunks"]
CONTROL_BYTES = _K["kControlBytes"]
MAX_NOTIFY_EXPERTS = _K["kMaxNotifyExperts"]
ERROR_WORDS = _K["kErrWords"]
MISMATCH_WORDS = _K["kMismatchWords"]  # the mismatch record after the error record (rank agreement)
HEADER_LEN, HEADER_WORDS, HEADER_COPY_SEQ = _K["kHeaderLen"], _K["kHeaderWords"], _K["kHeaderCopySeq"]
TRACE_SLOTS = _K["kTraceSlots"]
COPY_ENGINE_TRACE_SLOTS = _K["kCopyEngineTraceSlots"]
MAX_COPY_ENGINE_CHUNKS = _K["kMaxCopyEngineChunks"]
MAX_COPY_STREAMS = _K["kMaxCopyStreams"]
THREADS, NOTIFY_THREADS, LAYOUT_THREADS = _K["kThreads"], _K["kNotifyThreads"], _K["kLayoutThreads"]
ELEM_TYPES = {torch.bfloat16: 1, torch.float32: 2}  # ElemType of kernels.h (kNone = 0)

SOURCE = KernelSource.of("intranode.cu")
# The kernels' mangled-name fragments (cubin.find_kernel): C++ names in ep_moe's unnamed namespace.
KERNELS = {"layout": "13layout_kernelE", "notify": "13notify_kernelE", "dispatch": "15dispatch_kernelE",
           "combine_bf16": "14combine_kernelILi1EE", "combine_fp32": "14combine_kernelILi2EE",
           "barrier": "14barrier_kernelE", "exchange": "15exchange_kernelE",
           "close_epoch": "18close_epoch_kernelE"}


# ------------------------------------------------------------------------------------------ loading and checks
def specializations() -> list[KernelSource]:
    """What the intranode kernels compile (one generic build per architecture, and the layout probe)."""
    return [SOURCE, KernelSource.of(probe_file())]


class _Kernels:
    """The intranode kernels loaded on one device, after the layout and constants checks."""

    def __init__(self, device: int) -> None:
        with torch.cuda.device(device):
            loaded = module(SOURCE, device)
            constants = read_back(loaded.function("ep_intranode_constants", (PTR,)), len(P.CONSTANTS), device)
            probe = module(KernelSource.of(probe_file()), device)
            layout = read_back(probe.function("ep_params_layout", (PTR,)), len(P.layout_of()), device)
        wrong = P.constant_mismatches(constants) + P.layout_mismatches(layout)
        if wrong:
            raise JitLayoutError("ep_moe.native.jit: the parameter mirrors (ep_moe/native/jit/params.py) do not match "
                                 "the CUDA sources; add the new fields to the mirror in kernels.h's order:\n  "
                                 + "\n  ".join(wrong))
        # where Control::copy_engine_flag starts in a control block (read, not mirrored: Control may grow)
        self.control_flags_offset = constants[-1]
        symbols = function_symbols(loaded._cubin)
        combine_smem = _K["kBulkSmemBudget"]  # the most a bulk-copy combine asks for (bulk_piece16 stays below)
        self.fn = {name: loaded.function(find_kernel(symbols, fragment), (),
                                         combine_smem if name.startswith("combine") else 0)
                   for name, fragment in KERNELS.items()}


_kernels: PerDevice = PerDevice(_Kernels)
LAUNCHES: dict[str, int] = dict.fromkeys(KERNELS, 0)  # kernels this process launched through this module, by name


def kernels(device: int) -> _Kernels:
    """The kernels on ``device`` (compiled or read from the cache, loaded and checked at first use)."""
    return _kernels.of(device)


def _launch(device: int, name: str, grid: int, block: int, *params, shared_bytes: int = 0) -> None:
    """Kernel ``name`` (a key of `KERNELS`) on ``device``'s current stream, its arguments ``params`` (ctypes
    objects, by value)."""
    kernels(device).fn[name].launch_params(grid, block, _raw_stream(device), *params, shared_bytes=shared_bytes)
    LAUNCHES[name] += 1


def _launch_prepared(env: Env, name: str, grid: int, block: int, prepared: _Prepared, shared_bytes: int = 0
                     ) -> None:
    """`_launch` of a `_Prepared` struct (through its pointer array), with the functions ``env`` looked up once."""
    env.functions[name].launch_prepared(grid, block, _raw_stream(env.device), prepared.args, shared_bytes)
    LAUNCHES[name] += 1


# ------------------------------------------------------------------------------------------ argument checks
def _elem_type(t: Tensor, name: str) -> int:
    found = ELEM_TYPES.get(t.dtype)
    if found is None:
        raise _fail(f"argument '{name}' must be bfloat16 or float32, got {t.dtype}")
    return found


def _trace_ptr(trace: Tensor | None, num_blocks: int) -> int:
    if trace is None:
        return 0
    _check_cuda(trace, "trace")
    if trace.dtype != torch.int64 or trace.numel() < num_blocks * TRACE_SLOTS:
        raise _fail(f"argument 'trace' must be int64 with {TRACE_SLOTS} slots per block")
    return trace.data_ptr()


def _copy_engine_params(p, streams: list[int], flag_stream: int, seq: int, go: Tensor | None, shares: list[int],
                        num_push_blocks: int, trace: Tensor | None, num_blocks: int) -> None:
    """Fill ``p.copy_engine`` (seq 0: none), checked before any kernel starts, since the kernel releases the copy
    streams and the copies write into the peers' buffers unchecked."""
    if seq == 0:
        return
    if seq < 0 or num_push_blocks != 0 or go is None:
        raise _fail("a copy-engine call needs no pusher blocks and the go word ('copy_engine_go')")
    if not 1 <= len(streams) <= MAX_COPY_STREAMS or 0 in streams:
        raise _fail(f"argument 'copy_engine_streams' must hold 1 to {MAX_COPY_STREAMS} side streams (not the legacy "
                    f"default stream), got {len(streams)}")
    if flag_stream in streams:
        raise _fail("argument 'copy_engine_flag_stream' must not be one of the copy streams")
    _check_cuda(go, "copy_engine_go")
    if go.dtype != torch.int64 or go.numel() < 1:
        raise _fail("argument 'copy_engine_go' must be an int64 CUDA tensor")
    if not 1 <= len(shares) <= MAX_COPY_ENGINE_CHUNKS:
        raise _fail(f"argument 'copy_engine_shares' must hold 1 to {MAX_COPY_ENGINE_CHUNKS} shares, got {len(shares)}")
    ce = p.copy_engine
    total = 0
    for k, share in enumerate(shares):
        if not 1 <= share <= 1024:
            raise _fail(f"argument 'copy_engine_shares' must be in [1, 1024], got {share}")
        total += share
        ce.bounds[k + 1] = total
    ce.chunks, ce.seq, ce.go = len(shares), seq, go.data_ptr()
    if trace is not None:  # the copy-engine timeline after the blocks' slots
        if trace.numel() < num_blocks * TRACE_SLOTS + COPY_ENGINE_TRACE_SLOTS:
            raise _fail(f"a copy-engine call's trace needs {COPY_ENGINE_TRACE_SLOTS} slots after the blocks'")
        ce.trace = trace.data_ptr() + num_blocks * TRACE_SLOTS * 8


# ------------------------------------------------------------------------------------------ prepared structs
_MAX_PREPARED = 64  # prepared structs per Env (kinds x data buffers x offsets); beyond, start again


class _Prepared:
    """One parameter struct reused by every call of a kind with the same fixed inputs (the Env, the peers' data
    buffers, region offsets): a call sets only the fields that can change, the header check is copied in only when
    the header changes, and the driver reads the struct through a pointer array built once. The driver copies the
    arguments during cuLaunchKernel, so the struct may be refilled for the next call at once; the lock keeps two
    threads from filling it at the same time."""

    __slots__ = ("params", "view", "args", "check_key", "lock")

    def __init__(self, make) -> None:
        self.params = make()
        self.view = memoryview(self.params).cast("B")  # what the FieldWriters write into
        self.args = prepared_args(self.params)
        self.check_key: tuple | None = None
        self.lock = threading.Lock()

    def set_check(self, header: list[int], digest_from_prefix: bool, test_perturb: Tensor | None,
                  copy_seq: int | None) -> None:
        """``params.check`` = `header_check` of these arguments, its copy-engine slot set to ``copy_seq`` (None:
        left as the header has it); cached, so built and validated once per header."""
        key = (tuple(header), digest_from_prefix, None if test_perturb is None else test_perturb.data_ptr(), copy_seq)
        if key != self.check_key:
            self.params.check = _cached_header_check(key, header, digest_from_prefix, test_perturb, copy_seq)
            self.check_key = key


_header_checks: dict[tuple, P.HeaderCheck] = {}


def _cached_header_check(key: tuple, header: list[int], digest_from_prefix: bool, test_perturb: Tensor | None,
                         copy_seq: int | None) -> P.HeaderCheck:
    found = _header_checks.get(key)
    if found is None:
        found = header_check(header, digest_from_prefix, test_perturb)  # validates (raises before any launch)
        if copy_seq is not None:
            found.header[HEADER_COPY_SEQ] = copy_seq
        if len(_header_checks) >= 256:
            _header_checks.clear()
        _header_checks[key] = found
    return found


class BoundLaunch:
    """One launcher call, checked and filled once, launched again with other tensors of the same shapes: a copy of
    the parameter struct that call launched, in which a later call writes only ``fields`` (its tensors' addresses
    and sizes: `DISPATCH_BOUND`, `FRESH_DISPATCH_BOUND`, `NOTIFY_BOUND`, `COMBINE_BOUND`) and launches the same
    kernel the same way.

    The launcher's checks ran on the first call's tensors; a later call's tensors are the caller's to check alike
    (contiguous, on the device, the first call's dtypes and row widths, 16-byte aligned rows), and everything else
    the launch depends on (the Env, the data buffer, the header, block split, options) is the caller's key for the
    bound call. The struct is private to this object; the lock keeps two threads from filling it at once (the
    driver copies it during the launch)."""

    __slots__ = ("params", "view", "args", "function", "name", "grid", "block", "shared", "device", "fields", "lock")

    def __init__(self, env: Env, name: str, grid: int, block: int, shared: int, params, fields: tuple[str, ...]
                 ) -> None:
        self.params = type(params).from_buffer_copy(params)
        self.view = memoryview(self.params).cast("B")
        self.args = prepared_args(self.params)
        self.function, self.name, self.device = env.functions[name], name, env.device
        self.grid, self.block, self.shared = grid, block, shared
        self.fields = _bound_writer(type(params), fields)
        self.lock = threading.Lock()

    def __call__(self, *values: int) -> None:
        """Launch with ``values`` in ``fields``' order, on the current stream of the bound device; raises
        ``ValueError`` naming the struct when a value does not fit its field (nothing is launched then)."""
        with self.lock:
            self.fields.write(self.view, *values)
            self.function.launch_prepared(self.grid, self.block, _raw_stream(self.device), self.args, self.shared)
        LAUNCHES[self.name] += 1


_bound_writer = functools.cache(P.FieldWriter)  # a few (struct, fields) pairs, each a run of its struct


# What a bound call changes per call, in this order (`BoundLaunch`): a cached dispatch, a dispatch with top-k, its
# notify, a combine. Each is a run of consecutive fields of its struct (kernels.h): one pack_into.
DISPATCH_BOUND = ("rank_prefix_matrix", "send_list", "x", "scales", "recv_x", "recv_scales", "num_recv_rows")
FRESH_DISPATCH_BOUND = DISPATCH_BOUND + ("topk_idx", "topk_weights", "recv_topk_idx", "recv_topk_weights",
                                         "recv_src_idx", "recv_src_rank", "expert_scratch", "num_recv_per_expert")
NOTIFY_BOUND = ("is_token_in_rank", "num_tokens_per_rank", "rank_prefix_matrix", "pos", "send_list", "topk_idx")
COMBINE_BOUND = ("rank_prefix_matrix", "is_token_in_rank", "pos", "y", "weights", "bias0", "bias1", "out",
                 "out_weights", "summation_order")


def _with_env(params, env: Env, data_ptrs: list[int] | None = None, combine: bool = False):
    """``params`` with the fields a prepared struct keeps: the Env (the combine's with its chunking) and the peers'
    data buffers."""
    params.env = env.env
    if combine:
        params.env.chunks_per_pair = env.combine_chunks_per_pair
    for r, ptr in enumerate(data_ptrs or ()):
        params.data[r] = ptr
    return params


# ------------------------------------------------------------------------------------------ Env
class Env:
    """What every collective kernel of one rank needs (``KernelEnv``): the peers' control blocks, this rank's
    private ``state`` (a CUDA tensor of >= 64 bytes) and pinned ``error`` record (int32, >= ERROR_WORDS), the
    timeout, and the chunking (dispatch's in the struct, combine's beside it); raises `ValueError` naming a bad
    one."""

    def __init__(self, rank: int, ctrl_ptrs: list[int], state: Tensor, error: Tensor, timeout_ns: int,
                 dispatch_chunks: int, combine_chunks: int, min_chunk_rows: int) -> None:
        num_ranks = len(ctrl_ptrs)
        if not 1 <= num_ranks <= MAX_RANKS:
            raise _fail(f"argument 'ctrl_ptrs' must hold 1 to {MAX_RANKS} pointers (the group size), got {num_ranks}")
        if not 0 <= rank < num_ranks:
            raise _fail(f"argument 'rank' must be in [0, {num_ranks}), got {rank}")
        _check_cuda(state, "state")
        if state.nbytes < 64:
            raise _fail(f"argument 'state' must hold at least 64 bytes, got {state.nbytes}")
        if not _is_pinned(error) or error.dtype != torch.int32 or error.numel() < ERROR_WORDS + MISMATCH_WORDS:
            raise _fail(f"argument 'error' must be a pinned int32 CPU tensor of {ERROR_WORDS} + {MISMATCH_WORDS} words "
                        "(error record, mismatch record)")
        for name, chunks in (("dispatch_chunks", dispatch_chunks), ("combine_chunks", combine_chunks)):
            if not 1 <= chunks <= MAX_CHUNKS:
                raise _fail(f"argument '{name}' must be in [1, {MAX_CHUNKS}], got {chunks}")
        if min_chunk_rows < 1:
            raise _fail(f"argument 'min_chunk_rows' must be >= 1, got {min_chunk_rows}")
        self.device = _device(state)
        self.state, self.error = state, error  # kept alive with the Env
        env = self.env = P.KernelEnv()
        env.rank, env.num_ranks = rank, num_ranks
        for r, p in enumerate(ctrl_ptrs):
            env.ctrl[r] = p
        env.state = state.data_ptr()
        env.error = host_device_pointer(error.data_ptr(), self.device)
        env.timeout_ns = int(timeout_ns)
        env.chunks_per_pair = dispatch_chunks
        env.min_chunk_rows = min_chunk_rows
        self.combine_chunks_per_pair = combine_chunks
        self._mapped: dict[int, tuple[Tensor, int]] = {}
        self._prepared: dict[tuple, _Prepared] = {}
        # Compile (or read) and check the kernels now, while the backend is being built (its ranks then meet in
        # a barrier), not in a first call, where peers would wait in a kernel for this rank's compile; likewise the
        # expert-major ops of the fused paths (permute of rows in place, own rows of a combine).
        self.functions: dict[str, Function] = kernels(self.device).fn  # looked up once, not per call
        if num_ranks > 1:
            from . import expert_major_exchange

            expert_major_exchange.kernels(self.device)

    def prepared(self, key: tuple, make) -> _Prepared:
        """The parameter struct this Env reuses for calls of ``key`` (a kind and its fixed inputs), made by
        ``make(params)`` (which fills the fixed fields) at first use."""
        found = self._prepared.get(key)
        if found is None:
            if len(self._prepared) >= _MAX_PREPARED:  # e.g. a data buffer that grew many times
                self._prepared.clear()
            found = self._prepared[key] = _Prepared(make)
        return found

    def pinned(self, t: Tensor) -> bool:
        """`_is_pinned` of ``t``, without asking CUDA again (``Tensor.is_pinned`` is a CUDA pointer query per call)
        for a tensor this Env mapped (`device_pointer`: only after this check passed): that same tensor object at
        the same address is still pinned memory. Dtype and size are the caller's to check on every call."""
        found = self._mapped.get(t.data_ptr())
        return (found is not None and found[0] is t) or _is_pinned(t)

    def device_pointer(self, pinned: Tensor) -> int:
        """The device address of a pinned host tensor (the notify's count buffers), looked up once per tensor:
        the tensor is kept, so its address cannot be reused by another allocation while this Env lives."""
        found = self._mapped.get(pinned.data_ptr())
        if found is None or found[0] is not pinned:
            found = self._mapped[pinned.data_ptr()] = (pinned, host_device_pointer(pinned.data_ptr(), self.device))
        return found[1]


# ------------------------------------------------------------------------------------------ layout
def layout(topk_idx: Tensor, num_experts: int, num_ranks: int) -> list[Tensor]:
    """``[num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool]`` of
    ``topk_idx [T, K]`` int64 (ids outside [0, E) count nowhere), on its device's current stream."""
    _check_cuda(topk_idx, "topk_idx")
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise _fail("argument 'topk_idx' must be [T, K] int64")
    if not (1 <= num_ranks <= 32 and num_experts % num_ranks == 0):
        raise _fail(f"arguments 'num_ranks' ({num_ranks}) and 'num_experts' ({num_experts}): need 1 <= num_ranks "
                    "<= 32 dividing num_experts")
    device = _device(topk_idx)
    num_tokens, num_topk = topk_idx.shape
    # Empty outputs, the counts zeroed by a memset (no torch fill kernel), then the kernel. Both counts live in one
    # allocation zeroed by one memset (host time per call is this launcher's cost): per_expert at its start, per_rank at the next 16-byte boundary, so that both are 16-byte aligned.
    expert_words = (num_experts + 3) // 4 * 4
    counts = topk_idx.new_empty(expert_words + num_ranks, dtype=torch.int32)
    per_expert, _, per_rank = torch.split_with_sizes(counts, (num_experts, expert_words - num_experts, num_ranks))
    in_rank = topk_idx.new_empty((num_tokens, num_ranks), dtype=torch.bool)
    stream = _raw_stream(device)
    _zero(device, counts, stream)
    if num_tokens == 0:
        return [per_rank, per_expert, in_rank]
    with _layout_lock:
        _LAYOUT_FIELDS.write(_layout_view, topk_idx.data_ptr(), num_tokens, num_topk, num_experts, num_ranks,
                             per_rank.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr())
        kernels(device).fn["layout"].launch_prepared((num_tokens + LAYOUT_THREADS - 1) // LAYOUT_THREADS,
                                                     LAYOUT_THREADS, stream, _layout_args)
    LAUNCHES["layout"] += 1
    return [per_rank, per_expert, in_rank]


_layout_params = P.LayoutParams()  # every field set by each call: one struct for the process
_layout_args = prepared_args(_layout_params)
_layout_view = memoryview(_layout_params).cast("B")
_LAYOUT_FIELDS = P.FieldWriter(P.LayoutParams, P.LayoutParams.field_names())  # every field, one pack per call
_layout_lock = threading.Lock()


def stream_waiter(device: int) -> Callable[[], None]:
    """A function that blocks the host until the work queued so far on ``device``'s current stream ran (one driver
    event, recorded and waited for per call); it raises `DriverError` with an error a kernel left."""
    event = HostEvent(device)
    return lambda: event.wait(_raw_stream(device))


def _zero(device: int, t: Tensor, stream: int) -> None:
    """Zero int32 ``t`` on ``stream`` (`driver.memset_zero_async`)."""
    memset_zero_async(t.data_ptr(), t.numel(), stream, device)


# ------------------------------------------------------------------------------------------ rank agreement
def header_check(header: list[int], digest_from_prefix: bool, test_perturb: Tensor | None) -> P.HeaderCheck:
    """This rank's header of a call (`HEADER_WORDS` int32 values: ep_moe/backends/agreement.py's slots, then the
    native words) and the test-only perturbation (None: off), as ``header_check`` of binding.cpp fills it."""
    if len(header) != HEADER_WORDS:
        raise _fail(f"argument 'header' must hold {HEADER_WORDS} values, got {len(header)}")
    check = P.HeaderCheck()
    for slot, value in enumerate(header):
        if not -(1 << 31) <= value < (1 << 31):
            raise _fail(f"header value {value} (slot {slot}) does not fit int32")
        check.header[slot] = value
    check.digest_from_prefix = digest_from_prefix
    if test_perturb is not None:
        _check_cuda(test_perturb, "test_header_perturbation")
        if test_perturb.dtype != torch.int32 or test_perturb.numel() != 3:
            raise _fail("argument 'test_header_perturbation' must be an int32 CUDA tensor of 3 (source, slot, value "
                        "added)")
        check.test_perturb = test_perturb.data_ptr()
    return check


def _host_words(num_ranks: int) -> int:
    """int32 words of the notify's pinned ``host_counts``: the counts, then every rank's header as seen, this
    rank's own and the verdict."""
    return num_ranks * (num_ranks + 1) + num_ranks * HEADER_WORDS + HEADER_LEN + 1


def exchange(env: Env, header: list[int], prefix: Tensor | None, host_counts: Tensor,
             test_perturb: Tensor | None) -> None:
    """A header exchange as an operation of its own, before a host-side decision:
    every rank's header lands in ``host_counts`` where the notify's header check writes it. ``prefix``: the
    handle's ``[R, R]`` int32 rank prefix matrix, whose layout digest fills the layout slot (None: the header's
    own value)."""
    num_ranks = env.env.num_ranks
    words = _host_words(num_ranks)
    if not env.pinned(host_counts) or host_counts.dtype != torch.int32 or host_counts.numel() < words:
        raise _fail(f"argument 'host_counts' must be pinned int32 of at least {words} words")
    if prefix is not None:
        _check_cuda(prefix, "prefix")
        if prefix.dtype != torch.int32 or prefix.numel() != num_ranks * num_ranks:
            raise _fail("argument 'prefix' must be a contiguous [R, R] int32 CUDA tensor")
    check = header_check(header, prefix is not None, test_perturb)
    host_out = env.device_pointer(host_counts) + num_ranks * (num_ranks + 1) * 4
    _launch(env.device, "exchange", 1, 32, env.env, check, P.PTR(_ptr(prefix, "prefix")), P.PTR(host_out))


def close_epoch(env: Env) -> None:
    """Close the epoch of a notify that no dispatch kernel follows."""
    _launch(env.device, "close_epoch", 1, 1, env.env)


# ------------------------------------------------------------------------------------------ notify
def notify(env: Env, is_token_in_rank: Tensor, num_tokens_per_rank: Tensor, rank_prefix_matrix: Tensor, pos: Tensor,
           send_list: Tensor, host_counts: Tensor, num_worst_tokens: int, rows_capacity: int,
           topk_idx: Tensor | None, experts_per_rank: int, expert_alignment: int,
           host_expert_counts: Tensor | None, header: list[int], test_perturb: Tensor | None,
           bind: bool = False) -> BoundLaunch | None:
    """The count exchange and the per-destination token lists. ``bind``: also return
    this call as a `BoundLaunch` of `NOTIFY_BOUND`."""
    num_ranks = env.env.num_ranks
    _check_all(_NOTIFY_TENSORS, is_token_in_rank, num_tokens_per_rank, rank_prefix_matrix, pos, send_list)
    num_tokens = is_token_in_rank.shape[0]
    if is_token_in_rank.dtype != torch.bool or is_token_in_rank.dim() != 2 or is_token_in_rank.shape[1] != num_ranks:
        raise _fail("argument 'is_token_in_rank' must be [T, R] bool")
    if num_tokens_per_rank.numel() != num_ranks or num_tokens_per_rank.dtype not in (torch.int32, torch.int64):
        raise _fail("argument 'num_tokens_per_rank' must be [R] int32/int64")
    if rank_prefix_matrix.numel() != num_ranks * num_ranks or rank_prefix_matrix.dtype != torch.int32:
        raise _fail("argument 'rank_prefix_matrix' must be [R, R] int32")
    if (pos.numel() != num_tokens * num_ranks or send_list.numel() != num_tokens * num_ranks
            or pos.dtype != torch.int32 or send_list.dtype != torch.int32):
        raise _fail("arguments 'pos' and 'send_list' must hold T * R int32")
    if not env.pinned(host_counts) or host_counts.numel() < _host_words(num_ranks):
        raise _fail(f"argument 'host_counts' must be pinned, R * R + R int32 then the header check's "
                    f"{_host_words(num_ranks) - num_ranks * (num_ranks + 1)}")
    if host_expert_counts is not None:  # the per-expert counts travel with the row counts
        if topk_idx is None or topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
            raise _fail("argument 'topk_idx' must be [T, K] int64 when per-expert counts are exchanged")
        if not 1 <= experts_per_rank <= MAX_NOTIFY_EXPERTS:
            raise _fail(f"argument 'experts_per_rank' must be in [1, {MAX_NOTIFY_EXPERTS}] to travel in notify, "
                        f"got {experts_per_rank}")
        if expert_alignment < 1:
            raise _fail(f"argument 'expert_alignment' must be >= 1, got {expert_alignment}")
        if (not env.pinned(host_expert_counts) or host_expert_counts.dtype != torch.int64
                or host_expert_counts.numel() < experts_per_rank):
            raise _fail("argument 'host_expert_counts' must be pinned int64 with room for every local expert")
        _check_cuda(topk_idx, "topk_idx")
    prepared = env.prepared(("notify",), lambda: _with_env(P.NotifyParams(), env))
    with prepared.lock:  # every field a call may change is set below
        if host_expert_counts is None:
            topk_ptr, experts = 0, (0, 0, 0, 0)
        else:
            topk_ptr = topk_idx.data_ptr()
            experts = (topk_idx.shape[1], experts_per_rank, expert_alignment, env.device_pointer(host_expert_counts))
        _NOTIFY_FIELDS.write(prepared.view, is_token_in_rank.data_ptr(), num_tokens_per_rank.data_ptr(),
                             rank_prefix_matrix.data_ptr(), pos.data_ptr(), send_list.data_ptr(), topk_ptr,
                             num_tokens_per_rank.dtype == torch.int64, num_tokens, env.device_pointer(host_counts),
                             num_worst_tokens, rows_capacity, *experts)
        prepared.set_check(header, False, test_perturb, None)
        _launch_prepared(env, "notify", 1 + num_ranks, NOTIFY_THREADS, prepared)
        return BoundLaunch(env, "notify", 1 + num_ranks, NOTIFY_THREADS, 0, prepared.params, NOTIFY_BOUND) \
            if bind else None


_NOTIFY_TENSORS = ("is_token_in_rank", "num_tokens_per_rank", "rank_prefix_matrix", "pos", "send_list")
# What a notify call writes (every field but the Env and the header check), in the struct's order.
_NOTIFY_FIELDS = P.FieldWriter(P.NotifyParams, NOTIFY_BOUND + (
    "counts_int64", "num_tokens", "host_counts", "num_worst_tokens", "rows_capacity", "num_topk", "experts_per_rank",
    "expert_alignment", "host_expert_counts"))


# ------------------------------------------------------------------------------------------ dispatch
def dispatch(env: Env, data_ptrs: list[int], offsets: list[int], rank_prefix_matrix: Tensor, send_list: Tensor,
             x: Tensor, scales: Tensor | None, topk_idx: Tensor | None, topk_weights: Tensor | None,
             experts_per_rank: int, recv_x: Tensor, recv_scales: Tensor | None, recv_topk_idx: Tensor | None,
             recv_topk_weights: Tensor | None, recv_src_idx: Tensor | None, recv_src_rank: Tensor | None,
             expert_scratch: Tensor | None, num_recv_per_expert: Tensor | None, expert_alignment: int,
             rows_capacity: int, write_arrival: bool, num_blocks: int, num_push_blocks: int, trace: Tensor | None,
             copy_engine_streams: list[int], copy_engine_flag_stream: int, copy_engine_seq: int,
             copy_engine_go: Tensor | None, copy_engine_shares: list[int], copy_engine_tokens: list[int],
             host_prefix: list[int], cached_src_idx: Tensor | None, header: list[int],
             test_perturb: Tensor | None, rows_in_place: bool, bind: bool = False) -> BoundLaunch | None:
    """Rows to their destinations; with ``copy_engine_seq > 0`` every rank's whole x
    (and, fresh, its top-k and send lists) goes to the peers by the copy engine (`copy_engine.enqueue_dispatch`).
    ``rows_in_place`` (DispatchParams): recv_x is ``[0, H]`` (its dtype and width only), recv_scales None, and the
    received rows count is recv_topk_idx's (fresh) or cached_src_idx's (cached: the handle's recv_src_idx, of which
    only the size is used; no copy engine). ``bind``: also return this call as a `BoundLaunch` of `DISPATCH_BOUND`
    (cached) or `FRESH_DISPATCH_BOUND` (with top-k), not with rows in place or the copy engine (None then)."""
    num_ranks = env.env.num_ranks
    if len(data_ptrs) != num_ranks or len(offsets) != 5:
        raise _fail("arguments 'data_ptrs' and 'offsets' must hold R pointers and 5 offsets")
    _check_all(_DISPATCH_TENSORS, rank_prefix_matrix, send_list, x, recv_x)
    if x.dim() != 2 or recv_x.dim() != 2 or x.shape[1] != recv_x.shape[1] or x.dtype != recv_x.dtype:
        raise _fail("arguments 'x' and 'recv_x' must be [*, H] of one dtype")
    x_bytes = x.shape[1] * x.element_size()
    if x_bytes % 16 or x.data_ptr() % 16 or recv_x.data_ptr() % 16:
        raise _fail("rows of 'x' and 'recv_x' must be 16-byte multiples at 16-byte-aligned addresses")
    if send_list.numel() != x.shape[0] * num_ranks:
        raise _fail("argument 'send_list' does not match x ([R, T] int32)")
    if not (num_blocks >= 1 and 0 <= num_push_blocks < num_blocks + (1 if num_ranks == 1 else 0)):
        raise _fail(f"bad block split: num_blocks {num_blocks}, num_push_blocks {num_push_blocks}")
    has_topk = topk_idx is not None
    if has_topk != (topk_weights is not None):
        raise _fail("arguments 'topk_idx' and 'topk_weights' go together")
    if (scales is not None) != (recv_scales is not None) and not (rows_in_place and recv_scales is None):
        raise _fail("arguments 'scales' and 'recv_scales' go together")
    if rows_in_place and not ((has_topk or (cached_src_idx is not None and cached_src_idx.dim() == 1))
                              and recv_x.shape[0] == 0 and copy_engine_seq == 0):
        raise _fail("a dispatch with rows in place has top-k (fresh) or 'cached_src_idx' (cached), an empty recv_x "
                    "and no copy engine")
    if has_topk and not (recv_topk_idx is not None and recv_topk_weights is not None and recv_src_idx is not None
                         and recv_src_rank is not None and expert_scratch is not None
                         and num_recv_per_expert is not None and expert_scratch.numel() >= experts_per_rank
                         and num_recv_per_expert.numel() == experts_per_rank):
        raise _fail("a dispatch with top-k needs every top-k output (recv_topk_idx, recv_topk_weights, "
                    "recv_src_idx, recv_src_rank, expert_scratch, num_recv_per_expert)")
    scales_ptr, topk_ptr, weights_ptr = _ptr(scales, "scales"), _ptr(topk_idx, "topk_idx"), _ptr(topk_weights,
                                                                                                 "topk_weights")
    # rows in place: N is recv_topk_idx's (fresh) or cached_src_idx's (cached; only its size is used)
    num_recv_rows = (recv_x.shape[0] if not rows_in_place else recv_topk_idx.shape[0] if has_topk
                     else cached_src_idx.shape[0])
    fresh = copy_engine_seq != 0  # a copy-engine call fills a struct of its own (rare, and it has more fields)
    if fresh:
        prepared = None
        p = _with_env(P.DispatchParams(), env, data_ptrs)
        p.off_x, p.off_scales, p.off_idx, p.off_weights, p.off_src = offsets
    else:
        prepared = env.prepared(("dispatch", tuple(data_ptrs), tuple(offsets)),
                                lambda: _dispatch_template(env, data_ptrs, offsets))
        p = prepared.params
    with _NO_LOCK if fresh else prepared.lock:  # every field a call may change is set below
        _DISPATCH_FIELDS.write(
            memoryview(p).cast("B") if fresh else prepared.view, rank_prefix_matrix.data_ptr(), send_list.data_ptr(),
            x.data_ptr(), scales_ptr, 0 if rows_in_place else recv_x.data_ptr(), _ptr(recv_scales, "recv_scales"),
            num_recv_rows, topk_ptr, weights_ptr, _ptr(recv_topk_idx, "recv_topk_idx"),
            _ptr(recv_topk_weights, "recv_topk_weights"), _ptr(recv_src_idx, "recv_src_idx"),
            _ptr(recv_src_rank, "recv_src_rank"), _ptr(expert_scratch, "expert_scratch"),
            _ptr(num_recv_per_expert, "num_recv_per_expert"), x.shape[0], x_bytes,
            scales.shape[1] if scales is not None else 0, scales is not None, has_topk,
            topk_idx.shape[1] if has_topk else 0, experts_per_rank, rows_capacity, expert_alignment, write_arrival,
            num_blocks, num_push_blocks, _trace_ptr(trace, num_blocks))
        p.rows_in_place = rows_in_place
        shared = 4 * experts_per_rank if has_topk else 0  # hist[]: received pairs per local expert
        # a cached dispatch checks the header in the kernel (with the handle's layout digest and the number its
        # copy stream writes); a fresh one's notify did
        if not fresh:
            prepared.set_check(header, write_arrival, test_perturb, 0)
            _launch_prepared(env, "dispatch", num_blocks, THREADS, prepared, shared)
            if bind and not rows_in_place:
                return BoundLaunch(env, "dispatch", num_blocks, THREADS, shared, p,
                                   FRESH_DISPATCH_BOUND if has_topk else DISPATCH_BOUND)
            return None
    _copy_engine_params(p, copy_engine_streams, copy_engine_flag_stream, copy_engine_seq, copy_engine_go,
                        copy_engine_shares, num_push_blocks, trace, num_blocks)
    p.check = header_check(header, write_arrival, test_perturb)
    p.check.header[HEADER_COPY_SEQ] = copy_engine_seq
    # Every source's tokens must fit its slot (the copies are not bounds-checked). A cached dispatch reads the
    # handle's recv_src_idx; a fresh one the send lists its peers' copy streams stage.
    if (len(copy_engine_tokens) != num_ranks or len(host_prefix) != num_ranks * num_ranks
            or has_topk == (cached_src_idx is not None)):
        raise _fail("a copy-engine dispatch needs every rank's tokens ('copy_engine_tokens'), the R x R prefix matrix "
                    "('host_prefix'), and 'cached_src_idx' exactly when cached")
    p.copy_engine_slot_rows = slot_rows = rows_capacity // num_ranks
    for r, tokens in enumerate(copy_engine_tokens):
        if not 0 <= tokens <= slot_rows:
            raise _fail(f"rank {r}'s {tokens} tokens do not fit its slot of {slot_rows} rows")
        p.copy_engine_tokens[r] = tokens
    me = env.env.rank
    if copy_engine_tokens[me] != p.num_tokens:
        raise _fail(f"x has {p.num_tokens} tokens but the layout {copy_engine_tokens[me]}")
    if p.num_recv_rows != host_prefix[(num_ranks - 1) * num_ranks + me]:
        raise _fail("a copy-engine dispatch receives exactly its rows (no padding)")
    if cached_src_idx is not None:
        _check_cuda(cached_src_idx, "cached_src_idx")
        if cached_src_idx.dtype != torch.int32 or cached_src_idx.numel() < recv_x.shape[0]:
            raise _fail("argument 'cached_src_idx' must be int32 with a row per received row")
        p.cached_src_idx = cached_src_idx.data_ptr()
    # The kernel goes first: the copy streams' first operation waits for its go word (see combine).
    loaded = kernels(env.device)
    _launch(env.device, "dispatch", num_blocks, THREADS, p, shared_bytes=shared)
    enqueue_dispatch(cuda_ops(env.device), p, list(host_prefix), list(copy_engine_streams), copy_engine_flag_stream,
                     loaded.control_flags_offset)
    return None


_NO_LOCK = contextlib.nullcontext()
_DISPATCH_TENSORS = ("rank_prefix_matrix", "send_list", "x", "recv_x")
# What a dispatch call writes (before its copy-engine fields, header check and rows_in_place), in the struct's order.
_DISPATCH_FIELDS = P.FieldWriter(P.DispatchParams, FRESH_DISPATCH_BOUND + (
    "num_tokens", "x_bytes", "num_scales", "has_scales", "has_topk", "num_topk", "experts_per_rank", "rows_capacity",
    "expert_alignment", "write_arrival", "num_blocks", "num_push_blocks", "trace"))


def _dispatch_template(env: Env, data_ptrs: list[int], offsets: list[int]) -> P.DispatchParams:
    p = _with_env(P.DispatchParams(), env, data_ptrs)
    p.off_x, p.off_scales, p.off_idx, p.off_weights, p.off_src = offsets
    return p


# ------------------------------------------------------------------------------------------ combine
def bulk_piece16(num_ranks: int, n16: int) -> int:
    """16-byte words per source and stage of a bulk-copy combine (``bulk_piece16`` of kernels/intranode_kernels.cuh)."""
    most = ((_K["kBulkSmemBudget"] - _K["kBulkHeaderBytes"])
            // (_K["kReduceWarps"] * _K["kBulkStages"] * num_ranks * 16) // 32 * 32)
    if most < 32 or n16 <= 0:
        return 0
    pieces = (n16 + most - 1) // most
    return ((n16 + pieces - 1) // pieces + 31) // 32 * 32


def bulk_smem_bytes(num_ranks: int, piece16: int) -> int:
    """Dynamic shared memory of a bulk-copy combine (``bulk_smem_bytes`` of kernels/intranode_kernels.cuh)."""
    return _K["kBulkHeaderBytes"] + _K["kReduceWarps"] * _K["kBulkStages"] * num_ranks * piece16 * 16


def combine(env: Env, data_ptrs: list[int], off_y: int, off_weights: int, rows_capacity: int,
            rank_prefix_matrix: Tensor, is_token_in_rank: Tensor, pos: Tensor, y: Tensor, weights: Tensor | None,
            bias0: Tensor | None, bias1: Tensor | None, out: Tensor, out_weights: Tensor | None, num_blocks: int,
            num_push_blocks: int, trace: Tensor | None, copy_engine_streams: list[int], copy_engine_flag_stream: int,
            copy_engine_seq: int, copy_engine_go: Tensor | None, copy_engine_shares: list[int],
            host_prefix: list[int], bulk_reduce: bool, header: list[int], test_perturb: Tensor | None,
            expert_y: Tensor | None, expert_weights: Tensor | None, sorted_slots: Tensor | None,
            summation_order: Tensor | None = None, bind: bool = False) -> BoundLaunch | None:
    """Rows back to their sources, summed per token; with ``copy_engine_seq > 0`` the
    rows go back by the copy engine (`copy_engine.enqueue_combine`) while every block reduces. ``expert_y``
    (CombineParams): an expert-major combine; ``y`` then holds the own rows only (``[N, H]``, N = the rows of
    ``sorted_slots [N, K]``). ``summation_order`` ``[T, R]`` int32: per token, the ranks in the order their rows
    are added (None: increasing rank). ``bind``: also return this call as a `BoundLaunch` of `COMBINE_BOUND` (not an
    expert-major combine, not with the copy engine; None otherwise)."""
    num_ranks = env.env.num_ranks
    if len(data_ptrs) != num_ranks:
        raise _fail("argument 'data_ptrs' must hold R pointers")
    _check_all(_COMBINE_TENSORS, rank_prefix_matrix, is_token_in_rank, pos, y, out)
    num_tokens = is_token_in_rank.shape[0]
    if pos.numel() < num_tokens * num_ranks:
        raise _fail("argument 'pos' does not match is_token_in_rank")
    if out.dim() != 2 or out.shape[0] != num_tokens or out.shape[1] != y.shape[1] or out.dtype != y.dtype:
        raise _fail("argument 'out' must be [T, H] of y's dtype")
    y_bytes = y.shape[1] * y.element_size()
    if y_bytes % 16 or y.data_ptr() % 16 or out.data_ptr() % 16:
        raise _fail("rows of 'y' and 'out' must be 16-byte multiples at 16-byte-aligned addresses")
    y_type = _elem_type(y, "y")
    has_weights = weights is not None
    if has_weights != (out_weights is not None):
        raise _fail("arguments 'topk_weights' and 'out_weights' go together")
    num_topk = weights.shape[1] if has_weights else 0
    if has_weights and (out_weights.dim() != 2 or tuple(out_weights.shape) != (num_tokens, num_topk)):
        raise _fail("argument 'out_weights' must be [T, K]")
    if expert_y is not None:  # checked before anything is filled
        if sorted_slots is None:
            raise _fail("argument 'expert_y' needs 'sorted_slots'")
        _check_cuda(expert_y, "expert_y")
        _check_cuda(sorted_slots, "sorted_slots")
        if (expert_y.dim() != 2 or expert_y.shape[1] != y.shape[1] or expert_y.dtype != y.dtype
                or expert_y.data_ptr() % 16):
            raise _fail("argument 'expert_y' must be [M, H] of y's dtype at a 16-byte-aligned address")
        if (sorted_slots.dim() != 2 or sorted_slots.shape[0] != y.shape[0] or sorted_slots.dtype != torch.int64
                or copy_engine_seq != 0):
            raise _fail("an expert-major combine needs 'sorted_slots' [N, K] int64 (N = y's rows) and no copy engine")
        if expert_weights is not None and expert_weights.numel() != expert_y.shape[0]:
            raise _fail("argument 'expert_weights' must be [M]")
    if summation_order is not None:
        _check_cuda(summation_order, "summation_order")
        if (summation_order.dtype != torch.int32 or tuple(summation_order.shape) != (num_tokens, num_ranks)
                or not summation_order.is_contiguous()):
            raise _fail("argument 'summation_order' must be [T, R] int32, contiguous")
    weights_ptr, out_weights_ptr = _ptr(weights, "topk_weights"), _ptr(out_weights, "out_weights")
    bias0_ptr, bias1_ptr = _ptr(bias0, "bias0"), _ptr(bias1, "bias1")
    bias0_type = _elem_type(bias0, "bias0") if bias0 is not None else 0
    bias1_type = _elem_type(bias1, "bias1") if bias1 is not None else 0
    fresh = copy_engine_seq != 0  # a copy-engine call fills a struct of its own (as dispatch)
    if fresh:
        prepared = None
        p = _with_env(P.CombineParams(), env, data_ptrs, combine=True)
        p.off_y, p.off_weights = off_y, off_weights
    else:
        prepared = env.prepared(("combine", tuple(data_ptrs), off_y, off_weights),
                                lambda: _combine_template(env, data_ptrs, off_y, off_weights))
        p = prepared.params
    name = "combine_bf16" if y_type == 1 else "combine_fp32"
    with _NO_LOCK if fresh else prepared.lock:  # every field a call may change is set below
        view = memoryview(p).cast("B") if fresh else prepared.view
        _COMBINE_FIELDS.write(
            view, rows_capacity, rank_prefix_matrix.data_ptr(), is_token_in_rank.data_ptr(), pos.data_ptr(),
            y.data_ptr(), weights_ptr, bias0_ptr, bias1_ptr, out.data_ptr(), out_weights_ptr,
            0 if summation_order is None else summation_order.data_ptr(), num_tokens, y_type, y.shape[1],
            has_weights, num_topk, bias0_type, bias1_type, num_blocks, num_push_blocks, _trace_ptr(trace, num_blocks))
        p.bulk_reduce = bulk_reduce
        if expert_y is None:
            _COMBINE_EXPERT_FIELDS.write(view, 0, 0, 0, 0, 0)
        else:
            _COMBINE_EXPERT_FIELDS.write(view, expert_y.data_ptr(), _ptr(expert_weights, "expert_weights"),
                                         sorted_slots.data_ptr(), sorted_slots.shape[1], expert_y.shape[0])
        p.bulk_piece16 = piece16 = bulk_piece16(num_ranks, y_bytes // 16) if bulk_reduce else 0
        shared = bulk_smem_bytes(num_ranks, piece16) if piece16 > 0 else 0
        if not fresh:
            prepared.set_check(header, True, test_perturb, 0)  # with the handle's layout digest
            _launch_prepared(env, name, num_blocks, THREADS, prepared, shared)
            if bind and expert_y is None:
                return BoundLaunch(env, name, num_blocks, THREADS, shared, p, COMBINE_BOUND)
            return None
    _copy_engine_params(p, copy_engine_streams, copy_engine_flag_stream, copy_engine_seq, copy_engine_go,
                        copy_engine_shares, num_push_blocks, trace, num_blocks)
    p.check = header_check(header, True, test_perturb)  # with the handle's layout digest
    p.check.header[HEADER_COPY_SEQ] = copy_engine_seq
    if len(host_prefix) != num_ranks * num_ranks:  # the copies are not bounds-checked: every rank's rows must fit
        raise _fail("argument 'host_prefix' must hold the R x R rank prefix matrix")
    most = most_rows_back(list(host_prefix), num_ranks)
    if most > rows_capacity:
        raise _fail(f"a rank gets {most} rows back but the symmetric buffer holds {rows_capacity}")
    # The kernel goes first: the copy streams' first operation waits for the kernel's go word, and streams can share
    # a hardware queue, where that wait would hold back a kernel queued after it.
    loaded = kernels(env.device)
    _launch(env.device, name, num_blocks, THREADS, p, shared_bytes=shared)
    enqueue_combine(cuda_ops(env.device), p, list(host_prefix), list(copy_engine_streams), copy_engine_flag_stream,
                    loaded.control_flags_offset)
    return None


_COMBINE_TENSORS = ("rank_prefix_matrix", "is_token_in_rank", "pos", "y", "out")
# What a combine call writes before its copy-engine fields, and its expert-major rows after the header check.
_COMBINE_FIELDS = P.FieldWriter(P.CombineParams, ("rows_capacity", *COMBINE_BOUND, "num_tokens", "y_type", "hidden",
                                                  "has_weights", "num_topk", "bias0_type", "bias1_type", "num_blocks",
                                                  "num_push_blocks", "trace"))
_COMBINE_EXPERT_FIELDS = P.FieldWriter(P.CombineParams, ("expert_y", "expert_weights", "sorted_slots", "expert_topk",
                                                         "expert_slots"))


def _combine_template(env: Env, data_ptrs: list[int], off_y: int, off_weights: int) -> P.CombineParams:
    p = _with_env(P.CombineParams(), env, data_ptrs, combine=True)
    p.off_y, p.off_weights = off_y, off_weights
    return p


# ------------------------------------------------------------------------------------------ barrier
def barrier(env: Env) -> None:
    """A device barrier over the group."""
    _launch(env.device, "barrier", 1, 32, env.env)


__all__ = ["COMBINE_BOUND", "DISPATCH_BOUND", "FRESH_DISPATCH_BOUND", "KERNELS", "LAUNCHES", "NOTIFY_BOUND",
           "SOURCE", "BoundLaunch", "Env", "JitLayoutError", "barrier", "bulk_piece16", "bulk_smem_bytes",
           "close_epoch", "combine", "dispatch", "exchange", "header_check", "kernels", "layout", "notify", "probe_file",
           "specializations", "stream_waiter"]
