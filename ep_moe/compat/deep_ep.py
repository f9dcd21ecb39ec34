"""DeepEP's Python API on top of ep_moe, so that code written for DeepEP runs unchanged (``import deep_ep``).

Provided: ``ElasticBuffer`` (DeepEP V2's buffer over `ep_moe.ElasticBuffer`; its handle ``EPHandle`` is
`ep_moe.ElasticHandle`), ``Buffer`` (DeepEP's legacy normal-mode buffer over `ep_moe.Buffer`: layout, fresh and
cached dispatch, combine), ``Config``, ``EventHandle``, ``EventOverlap``, ``topk_idx_t`` (``torch.int64``), the
domain-size helpers, and the stand-ins ``deep_ep._C`` and ``deep_ep.utils``. Not provided: low-latency mode, the
internode (RDMA) kernels and ``get_local_buffer_tensor``, which raise with a message saying so.
``num_nvl_bytes`` / ``num_rdma_bytes`` are recorded but ep_moe sizes its own memory.

Making ``import deep_ep`` resolve to this module:

* in this process: `install` (before anything imports ``deep_ep``);
* a program and every process it spawns: ``python -m ep_moe.compat.deep_ep [--deep-ep PATH] program.py ARGS``
  (or ``-m module ARGS``);
* by hand, e.g. for ``torchrun``: ``export PYTHONPATH=$(python -m ep_moe.compat.deep_ep --shim-dir)``.

``deep_ep.utils`` loads from a DeepEP checkout named by ``install(utils_from=PATH)``, ``EP_MOE_DEEP_EP_PATH`` or
``--deep-ep PATH``; everything else stays ep_moe's. The backend is ep_moe's ``"auto"``
(``EP_MOE_BACKEND`` or ``backend=`` chooses).

Every DeepEP name, argument and default with what ep_moe does with it: docs/compat.md (sections "Module
`deep_ep`", "ElasticBuffer", "Legacy Buffer", "Config", "deep_ep._C and deep_ep.utils", "Gaps").
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import itertools
import logging
import os
import runpy
import sys
import types
import warnings

import torch
import torch.distributed as dist

from ..backends.hybrid import host_topology, logical_topology
from ..buffer.argument_checks import FP8_DTYPES, _fail
from ..buffer.buffer_v1 import DEFAULT_TIMEOUT_S
from ..buffer.buffer_v1 import Buffer as _CoreBuffer
from ..buffer.event_overlap import EventOverlap as _CoreEventOverlap
from ..buffer.routing_layout import round_up
from ..config import DEFAULT_NUM_SMS, NativeOptions
from ..config import Config as _CoreConfig
from ..elastic.elastic_buffer import ElasticBuffer as _CoreElasticBuffer
from ..elastic.elastic_buffer import ElasticHandle

log = logging.getLogger("ep_moe")

topk_idx_t = torch.int64
"""DeepEP's dtype of ``topk_idx`` (DeepEP can be built with int32; ep_moe uses int64)."""

DEEP_EP_API_VERSION = "2.1.0"
"""The DeepEP release whose API this module mirrors: V2's ``ElasticBuffer`` next to the legacy (V1) ``Buffer``,
as DeepEP 2.x itself exports both."""
DEEP_EP_LEGACY_API_VERSION = "1.2.1"
"""The DeepEP release whose normal-mode ``Buffer`` API (V2's legacy buffer) this module mirrors."""
__version__ = f"{DEEP_EP_API_VERSION}+ep_moe"

_NVL_PEERS = 8      # ranks one NVLink domain holds in DeepEP's sizing
_SIZING_TOPK = 128  # top-k columns and FP8 scale columns a ring row reserves (DeepEP-style sizing)
# DeepEP's chunk fields: its constructor's defaults, and the values of the recommended configs
# (`Buffer.get_dispatch_config`), which a caller may pass without being warned.
_CHUNK_FIELDS = ("num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")
_DEFAULT_CHUNKS = (6, 256, 6, 256)
_RECOMMENDED_CHUNKS = (8, 256, 16, 128)
_chunk_fields_warned = False  # the warning about ignored chunk fields is given once per process


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


# ------------------------------------------------------------------------------------------ events
class EventHandle:
    """DeepEP's ``EventHandle``: an event recorded on the current CUDA stream when constructed (empty on
    CPU, where every operation has completed when it returns)."""

    def __init__(self) -> None:
        self.event: torch.cuda.Event | None = None
        if _cuda_in_use():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    @classmethod
    def _wrap(cls, event: torch.cuda.Event | None) -> EventHandle:
        handle = cls.__new__(cls)
        handle.event = event
        return handle

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def wait(self, stream=None) -> None:
        """Make ``stream`` wait for the event (what ``torch.cuda.Stream.wait_event`` calls)."""
        if self.event is not None:
            self.event.wait(stream)

    def query(self) -> bool:
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class EventOverlap(_CoreEventOverlap):
    """DeepEP's ``EventOverlap``: ``event`` is an `EventHandle`; ``current_stream_wait()`` and
    ``with overlap:`` make the current stream wait for it."""

    def __init__(self, event: EventHandle | None = None, extra_tensors=None) -> None:
        if event is not None and not isinstance(event, EventHandle):
            event = EventHandle._wrap(event)  # a raw torch.cuda.Event
        super().__init__(event, extra_tensors)
        self.hook_after_wait = None
        self._release_handle_by_call = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current stream waits for the event; then the hook registered (`register_hook_after_wait`) runs
        once, and ``release_handle`` drops the event."""
        if self.event is not None:
            self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait) -> None:
        """Run ``hook_after_wait()`` after the next `current_stream_wait` (one hook at a time, as V2)."""
        if self.hook_after_wait is not None:
            raise RuntimeError("deep_ep.EventOverlap: a hook is already registered")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """``with overlap(release_handle=True):`` -- the wait at the end of the block also drops the event."""
        self._release_handle_by_call = release_handle
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


def _core_event(previous_event) -> _CoreEventOverlap | None:
    """A DeepEP-style ``previous_event`` as the `ep_moe.EventOverlap` the core buffer takes."""
    if previous_event is None:
        return None
    event = getattr(previous_event, "event", previous_event)
    if isinstance(event, EventHandle):
        event = event.event
    return _CoreEventOverlap(event)


def _wrap_event(core: _CoreEventOverlap) -> EventOverlap:
    return EventOverlap(EventHandle._wrap(core.event), core.extra_tensors)


# ------------------------------------------------------------------------------------------ config
class Config(_CoreConfig):
    """DeepEP's ``Config(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
    num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)``, usable wherever an
    `ep_moe.Config` is: ``num_sms`` (positive, even) is its SM budget. The four chunk sizes have no ep_moe
    counterpart: they are kept (callers read them back; the size hints use them) and otherwise ignored;
    values other than those of the recommended configs (`Buffer.get_dispatch_config`) warn once per process
    (`ep_moe.NativeOptions` sets the native kernels' chunking). Omitted ones take DeepEP's defaults."""

    def __init__(self, num_sms: int = DEFAULT_NUM_SMS, num_max_nvl_chunked_send_tokens: int | None = None,
                 num_max_nvl_chunked_recv_tokens: int | None = None,
                 num_max_rdma_chunked_send_tokens: int | None = None,
                 num_max_rdma_chunked_recv_tokens: int | None = None) -> None:
        given = (num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                 num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)
        chunks = tuple(default if value is None else value for value, default in zip(given, _DEFAULT_CHUNKS))
        for name, value in (("num_sms", num_sms), *zip(_CHUNK_FIELDS, chunks)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _fail("Config", name, "a positive int", repr(value))
        if num_sms % 2:
            raise _fail("Config", "num_sms", "even (two SMs per channel)", num_sms)
        object.__setattr__(self, "num_sms", num_sms)
        object.__setattr__(self, "native", None)
        object.__setattr__(self, "_deep_ep", chunks)
        ignored = [f"{name}={value}" for name, value, recommended in zip(_CHUNK_FIELDS, given,
                                                                         _RECOMMENDED_CHUNKS)
                   if value is not None and value != recommended]
        if ignored:
            _warn_chunk_fields_ignored(ignored)

    @classmethod
    def _recommended(cls, num_sms: int) -> Config:
        return cls(num_sms, *_RECOMMENDED_CHUNKS)

    # DeepEP's four chunk sizes, read back as given (ep_moe uses none of them).
    num_max_nvl_chunked_send_tokens = property(lambda self: self._deep_ep[0])
    num_max_nvl_chunked_recv_tokens = property(lambda self: self._deep_ep[1])
    num_max_rdma_chunked_send_tokens = property(lambda self: self._deep_ep[2])
    num_max_rdma_chunked_recv_tokens = property(lambda self: self._deep_ep[3])

    def _ring_bytes(self, hidden_bytes: int, peers: int, rows: int) -> int:
        channels = self.num_sms // 2
        row_bytes = hidden_bytes + _SIZING_TOPK * (8 + 4) + _SIZING_TOPK * 4 + 16  # data, top-k, scales, meta
        control = channels * peers * 64
        return (channels * peers * rows * row_bytes + control + 127) // 128 * 128

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes a DeepEP-style NVLink ring buffer would take for rows of ``hidden_bytes``. ep_moe sizes
        its own symmetric memory; callers (Megatron's ``get_buffer``) only compare this number."""
        return self._ring_bytes(hidden_bytes, min(num_ranks, _NVL_PEERS), self.num_max_nvl_chunked_recv_tokens)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0 within one NVLink domain (<= 8 ranks), as in DeepEP; else a DeepEP-style estimate."""
        if num_ranks <= _NVL_PEERS:
            return 0
        return self._ring_bytes(hidden_bytes, num_ranks // _NVL_PEERS, self.num_max_rdma_chunked_recv_tokens)

    def __repr__(self) -> str:
        return (f"deep_ep.Config(num_sms={self.num_sms}, nvl_send={self._deep_ep[0]}, nvl_recv={self._deep_ep[1]}, "
                f"rdma_send={self._deep_ep[2]}, rdma_recv={self._deep_ep[3]})")


def _warn_chunk_fields_ignored(ignored: list[str]) -> None:
    global _chunk_fields_warned
    if _chunk_fields_warned:
        return
    _chunk_fields_warned = True
    warnings.warn(f"ep_moe.compat.deep_ep.Config: {', '.join(ignored)} ignored: DeepEP's chunk sizes have no "
                  "ep_moe counterpart; ep_moe.NativeOptions (Buffer(native_options=...)) sets the native "
                  "kernels' chunking (warned once per process)", UserWarning, stacklevel=3)


# ------------------------------------------------------------------------------------------ elastic buffer
EPHandle = ElasticHandle
"""DeepEP V2's dispatch handle (`ep_moe.ElasticHandle`)."""


class ElasticBuffer(_CoreElasticBuffer):
    """DeepEP V2's ``deep_ep.ElasticBuffer`` on ep_moe (`ep_moe.ElasticBuffer`): DeepEP's arguments, plus
    keyword-only ``backend`` (default ``$EP_MOE_BACKEND`` or "auto") and ``check_inputs`` (default False, as
    DeepEP, which does not check expert ids). Events are DeepEP-style `EventOverlap` objects."""

    def __init__(self, group: dist.ProcessGroup | None = None, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, backend: str | None = None,
                 check_inputs: bool = False) -> None:
        if num_bytes is not None and num_cpu_bytes > 0:  # V2's num_bytes counts the CPU bytes; the core's does not
            if num_bytes <= num_cpu_bytes:
                raise _fail("ElasticBuffer", "num_bytes", f"> num_cpu_bytes={num_cpu_bytes} (V2: GPU + CPU bytes)",
                            num_bytes)
            num_bytes -= num_cpu_bytes
        self._replicated_sf: torch.Tensor | None = None
        super().__init__(group, num_bytes, num_cpu_bytes, num_max_tokens_per_rank, hidden, num_topk,
                         use_fp8_dispatch, deterministic, allow_hybrid_mode, allow_multiple_reduction,
                         prefer_overlap_with_compute, sl_idx, num_allocated_qps, num_cpu_timeout_secs,
                         num_gpu_timeout_secs, explicitly_destroy,
                         backend=backend or os.environ.get("EP_MOE_BACKEND", "auto"), check_inputs=check_inputs)

    @staticmethod
    def capture() -> EventHandle:
        """An `EventHandle` on the current stream (V2 returns the handle itself)."""
        return EventHandle()

    def dispatch(self, *args, **kwargs):
        """`ep_moe.ElasticBuffer.dispatch`; the event is a DeepEP-style `EventOverlap`."""
        *result, event = super().dispatch(*args, **kwargs)
        return (*result, _wrap_event(event))

    def combine(self, *args, **kwargs):
        """`ep_moe.ElasticBuffer.combine`; the event is a DeepEP-style `EventOverlap`."""
        *result, event = super().combine(*args, **kwargs)
        return (*result, _wrap_event(event))

    def engram_write(self, storage: torch.Tensor, sf: torch.Tensor | None = None) -> None:
        """`ep_moe.ElasticBuffer.engram_write`. V2 passes every rank's scales, replicated (``sf [R * n, S]``, so
        that fetches read them locally): they are kept on the device as given; a rank's own ``[n, S]`` goes to the
        host segment as in the core."""
        self._replicated_sf = None
        rows = storage.shape[0] if isinstance(storage, torch.Tensor) and storage.dim() == 2 else None
        if (sf is not None and rows is not None and self.num_ranks > 1 and isinstance(sf, torch.Tensor)
                and sf.dim() == 2 and sf.shape[0] == self.num_ranks * rows):
            super().engram_write(storage)
            self._replicated_sf = sf.detach().clone()
            return
        super().engram_write(storage, sf)

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False):
        """V2's fetch: a callable that waits and returns ``(data [T, P * H_e], sf [T, P * S] or None)``, each token's
        P entries side by side (`ep_moe.ElasticBuffer.engram_fetch` gives ``[T, P, H_e]``, of which this is a
        view). ``use_tma_aligned_col_major_sf``: ``sf`` column-major with the token dimension padded to 16 bytes
        (the TMA layout of an FP8 GEMM's scales; the same values)."""
        hook = super().engram_fetch(indices, num_qps)
        replicated = self._replicated_sf

        def wait():
            fetched, fetched_sf = hook()
            T, P = indices.shape
            if replicated is not None:
                fetched_sf = replicated.index_select(0, indices.reshape(-1).to(torch.int64))
            data = fetched.reshape(T, -1)
            if fetched_sf is None:
                return data, None
            fetched_sf = fetched_sf.reshape(T, -1)
            return data, _tma_aligned_col_major(fetched_sf) if use_tma_aligned_col_major_sf else fetched_sf

        return wait


    # V2's argument names and return forms of the mixins' calls
    def all_gather(self, t):
        """V2's form of `ep_moe.ElasticBuffer.all_gather`: one tensor gives ``(gathered, handle)``, a list or tuple
        of tensors ``(*gathered, handle)``."""
        if isinstance(t, torch.Tensor):
            return super().all_gather(t)
        gathered, handle = super().all_gather(t)
        return (*gathered, handle)

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        """`ep_moe.ElasticBuffer.agrs_get_inplace_tensor` under V2's argument name."""
        return super().agrs_get_inplace_tensor(shapes, dtype)

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """`ep_moe.ElasticBuffer.pp_send` under V2's argument name."""
        super().pp_send(t, dst_rank_idx, num_sms)

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """`ep_moe.ElasticBuffer.pp_recv` under V2's argument name."""
        super().pp_recv(t, src_rank_idx, num_sms)


def find_cuda_home() -> str | None:
    """V2's ``deep_ep.find_cuda_home``: the CUDA toolkit ep_moe's JIT would use (``CUDA_HOME``, ``CUDA_PATH``, the
    ``nvcc`` on ``PATH``, ``/usr/local/cuda``), or None."""
    from ..native.jit.compilers import _cuda_home

    home = _cuda_home()
    return None if home is None else str(home)


def find_nccl_root() -> str:
    raise NotImplementedError("ep_moe.compat.deep_ep: find_nccl_root is DeepEP's build-time NCCL discovery; ep_moe "
                              "links no NCCL of its own (it uses torch.distributed's)")


def check_nccl_so() -> None:
    """V2 checks that the NCCL loaded is the one its extension links; ep_moe links none (torch's is the only one),
    so there is nothing to check."""


def init_jit() -> None:
    """V2 initializes its JIT runtime at import; ep_moe's JIT compiles on first use, so there is nothing to do."""


def get_physical_domain_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """V2's ``deep_ep.get_physical_domain_size``: ``(RDMA ranks, NVLink ranks)`` of ``group`` = (hosts, ranks per
    host), from the ranks' host names (collective)."""
    topology = host_topology(group)
    return topology.num_scaleout_ranks, topology.num_scaleup_ranks


def get_logical_domain_size(group: dist.ProcessGroup | None = None, allow_hybrid_mode: bool = True
                            ) -> tuple[int, int]:
    """V2's ``deep_ep.get_logical_domain_size``: ``(scale-out ranks, scale-up ranks)`` that an ``ElasticBuffer``
    on ``group`` uses (`ep_moe.backends.hybrid.logical_topology`; collective)."""
    topology = logical_topology(host_topology(group), dist.get_world_size(group), allow_hybrid_mode)
    return topology.num_scaleout_ranks, topology.num_scaleup_ranks


def _tma_aligned_col_major(sf: torch.Tensor) -> torch.Tensor:
    """``sf [T, C]`` as a column-major tensor whose columns start 16-byte aligned (T padded), same values."""
    per_16_bytes = max(16 // sf.element_size(), 1)
    padded = -(-sf.shape[0] // per_16_bytes) * per_16_bytes
    out = torch.empty((sf.shape[1], padded), dtype=sf.dtype, device=sf.device)[:, :sf.shape[0]].t()
    out.copy_(sf)
    return out


# ------------------------------------------------------------------------------------------ buffer
def _contiguous_hidden(x):
    """DeepEP accepts column-major FP8 scales (``scales.T.contiguous().T``); hand the core row-major ones."""
    if isinstance(x, tuple | list) and len(x) == 2 and isinstance(x[1], torch.Tensor):
        return x[0].contiguous(), x[1].contiguous()
    return x


class Buffer(_CoreBuffer):
    """DeepEP's normal-mode ``deep_ep.Buffer`` on ep_moe (intranode and torch.distributed groups).

    Args: DeepEP's (``group``, ``num_nvl_bytes``, ``num_rdma_bytes``, ``low_latency_mode`` -- must be False --,
    ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``use_fabric``,
    ``explicitly_destroy``, ``enable_shrink``, ``comm`` -- must be None); keyword-only ``backend``
    ("auto" | "native" | "torch"; default ``$EP_MOE_BACKEND`` or "auto"), ``timeout_s``, ``check_inputs``
    (default False, as DeepEP, which does not check expert ids: True checks them at a host sync per call)
    and ``native_options`` (as `ep_moe.Buffer`'s). The SM budget of calls without a config is ep_moe's
    (`ep_moe.Buffer.num_sms`, shared with it).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, check_inputs: bool = False,
                 native_options: NativeOptions | None = None) -> None:
        if comm is not None:
            raise _fail("deep_ep.Buffer", "comm", "None (pass a torch.distributed group)", type(comm).__name__)
        if low_latency_mode:
            raise NotImplementedError("ep_moe.compat.deep_ep: low-latency mode is not provided (normal mode only)")
        backend = backend or os.environ.get("EP_MOE_BACKEND", "auto")
        # num_nvl_bytes is a DeepEP ring-buffer size; ep_moe sizes its own memory (0 = on first use).
        super().__init__(group, 0, num_rdma_bytes, False, num_qps_per_rank, allow_nvlink_for_low_latency_mode,
                         allow_mnnvl, explicitly_destroy, backend=backend, timeout_s=timeout_s,
                         check_inputs=check_inputs, native_options=native_options)
        self.num_nvl_bytes = num_nvl_bytes
        self.low_latency_mode = False
        self.enable_shrink = enable_shrink

    # ----------------------------------------------------------------- static API
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SM budget of the recommended configs and of calls without a config (even; `ep_moe.Buffer`'s
        too: one budget per process)."""
        if not isinstance(new_num_sms, int) or isinstance(new_num_sms, bool) or new_num_sms < 2 or new_num_sms % 2:
            raise _fail("deep_ep.Buffer.set_num_sms", "new_num_sms", "an even int >= 2", repr(new_num_sms))
        _CoreBuffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config._recommended(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config._recommended(Buffer.num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream, to pass as ``previous_event``."""
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether FP8 dispatch is available (DeepEP's test programs ask this before testing FP8)."""
        return bool(FP8_DTYPES)

    @staticmethod
    def get_low_latency_rdma_size_hint(*args, **kwargs) -> int:
        raise NotImplementedError("ep_moe.compat.deep_ep: low-latency mode is not provided")

    def low_latency_dispatch(self, *args, **kwargs):
        raise NotImplementedError("ep_moe.compat.deep_ep: low-latency mode is not provided")

    def low_latency_combine(self, *args, **kwargs):
        raise NotImplementedError("ep_moe.compat.deep_ep: low-latency mode is not provided")

    def clean_low_latency_buffer(self, *args, **kwargs) -> None:
        raise NotImplementedError("ep_moe.compat.deep_ep: low-latency mode is not provided")

    def low_latency_update_mask_buffer(self, *args, **kwargs) -> None:
        raise NotImplementedError("ep_moe.compat.deep_ep: low-latency mode is not provided")

    def low_latency_query_mask_buffer(self, *args, **kwargs) -> None:
        raise NotImplementedError("ep_moe.compat.deep_ep: low-latency mode is not provided")

    def low_latency_clean_mask_buffer(self, *args, **kwargs) -> None:
        raise NotImplementedError("ep_moe.compat.deep_ep: low-latency mode is not provided")

    def get_next_low_latency_combine_buffer(self, *args, **kwargs):
        raise NotImplementedError("ep_moe.compat.deep_ep: low-latency mode is not provided")

    def get_local_buffer_tensor(self, *args, **kwargs):
        raise NotImplementedError("ep_moe.compat.deep_ep: get_local_buffer_tensor is not provided (ep_moe's "
                                  "symmetric memory is laid out by its kernels, not exposed as a tensor)")

    # ----------------------------------------------------------------- layout, dispatch, combine
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """As `ep_moe.Buffer.get_dispatch_layout`; the event is a DeepEP-style `EventOverlap`."""
        *layout, event = super().get_dispatch_layout(topk_idx, num_experts, _core_event(previous_event),
                                                     async_finish, allocate_on_comm_stream)
        return (*layout, _wrap_event(event))

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *, num_experts: int | None = None):
        """DeepEP's ``dispatch``: ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``. Without ``topk_idx`` (and without ``handle``) it dispatches by ``is_token_in_rank``
        alone: ``recv_topk_idx``/``recv_topk_weights`` are None and the per-expert counts come from
        ``num_tokens_per_expert`` (one extra all-reduce of ``E`` counts)."""
        x = _contiguous_hidden(x)
        core_event = _core_event(previous_event)
        if handle is None and topk_idx is None:
            return self._dispatch_by_rank(x, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                          num_tokens_per_expert, topk_weights, expert_alignment, num_worst_tokens,
                                          config, core_event, async_finish)
        *result, event = super().dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                          num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                          num_worst_tokens, config, core_event, async_finish, allocate_on_comm_stream,
                                          num_experts=num_experts)
        return (*result, _wrap_event(event))

    def _dispatch_by_rank(self, x, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                          num_tokens_per_expert, topk_weights, expert_alignment, num_worst_tokens, config,
                          core_event, async_finish):
        op = "deep_ep.Buffer.dispatch"
        if topk_weights is not None:
            raise _fail(op, "topk_weights", "None when topk_idx is None", "a tensor")
        for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert)):
            if value is None:
                raise _fail(op, name, "a tensor from get_dispatch_layout (or pass topk_idx, or a handle)", None)
        num_experts = num_tokens_per_expert.shape[0]
        if num_experts % self.group_size:
            raise _fail(op, "num_tokens_per_expert", f"of a length divisible by the group size {self.group_size}",
                        num_experts)
        local = num_experts // self.group_size
        # One "expert" per destination rank (its first local expert) carries the rank layout through the
        # core dispatch, which routes by top-k; nothing of it is returned.
        first_expert = torch.arange(self.group_size, device=is_token_in_rank.device, dtype=torch.int64) * local
        rank_topk = torch.where(is_token_in_rank, first_expert, -1)
        zero_weights = torch.zeros(rank_topk.shape, dtype=torch.float32, device=rank_topk.device)
        *result, event = super().dispatch(x, None, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                          num_tokens_per_expert, rank_topk, zero_weights, 1, num_worst_tokens, config,
                                          core_event, async_finish)
        recv_x, handle = result[0], result[4]
        counts: list[int] = []
        if not num_worst_tokens:
            totals = num_tokens_per_expert.to(torch.int64).clone()
            dist.all_reduce(totals, group=self.group)
            mine = totals[self.rank * local:(self.rank + 1) * local]
            counts = round_up(mine, expert_alignment).tolist()
        return recv_x, None, None, counts, handle, _wrap_event(event)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's ``combine``: ``(combined_x, combined_topk_weights, event)``."""
        combined, combined_w, event = super().combine(x, handle, topk_weights, bias, config,
                                                      _core_event(previous_event), async_finish,
                                                      allocate_on_comm_stream)
        return combined, combined_w, _wrap_event(event)

    # ----------------------------------------------------------------- not provided
    def internode_dispatch(self, *args, **kwargs):
        raise NotImplementedError("ep_moe.compat.deep_ep: internode (RDMA) kernels are not provided; "
                                  "Buffer.dispatch serves any torch.distributed group")

    def internode_combine(self, *args, **kwargs):
        raise NotImplementedError("ep_moe.compat.deep_ep: internode (RDMA) kernels are not provided; "
                                  "Buffer.combine serves any torch.distributed group")


# ------------------------------------------------------------------------------------------ deep_ep._C
_NCCL_UNIQUE_ID_BYTES = 128
_comms: dict[int, tuple[int, int]] = {}  # a stand-in communicator handle -> (ranks, rank)
_comm_handles = itertools.count(1)


def _nccl_unique_id() -> bytes:
    """``_C.get_local_nccl_unique_id``: random bytes of an NCCL unique id's size. DeepEP's utils all-gather it
    and pass rank 0's to `_create_nccl_comm`, which needs no real id."""
    return os.urandom(_NCCL_UNIQUE_ID_BYTES)


def _create_nccl_comm(root_unique_id: object, num_ranks: int, rank: int) -> int:
    """``_C.create_nccl_comm``: a handle recording the group's size and this rank. No NCCL communicator is
    created: ep_moe's buffers communicate through the torch.distributed group itself."""
    handle = next(_comm_handles)
    _comms[handle] = (int(num_ranks), int(rank))
    return handle


def _destroy_nccl_comm(comm: int) -> None:
    """``_C.destroy_nccl_comm``: forget a handle of `_create_nccl_comm` (others are torch's own: left alone)."""
    _comms.pop(comm, None)


def _comm_size(comm: int) -> int:
    """The number of ranks of a communicator: a stand-in handle, or the raw NCCL communicator of a
    torch.distributed group (what DeepEP's utils pass when they reuse torch's, ``backend._comm_ptr()``)."""
    if comm in _comms:
        return _comms[comm][0]
    world = getattr(dist.distributed_c10d, "_world", None)
    for group in list(getattr(world, "pg_map", None) or ()):
        try:
            if group._get_backend(torch.device("cuda"))._comm_ptr() == comm:
                return group.size()
        except Exception:  # not an NCCL group, or no communicator yet
            continue
    raise NotImplementedError(f"ep_moe deep_ep._C: communicator {comm!r} is neither one of the stand-in "
                              "create_nccl_comm's nor the NCCL communicator of a torch.distributed group of this "
                              "process; ep_moe keeps no other NCCL communicators")


def _physical_domain_size(comm: int) -> tuple[int, int]:
    """``_C.get_physical_domain_size``: ``(RDMA ranks, NVLink ranks)`` = ``(1, ranks)``: the group is taken
    as one NVLink domain on one node (the buffers' ``get_physical_domain_size()`` finds the hosts)."""
    return 1, _comm_size(comm)


def _logical_domain_size(comm: int, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """``_C.get_logical_domain_size``: ``(scale-out ranks, scale-up ranks)``: the ``EP_MOE_SCALEOUT_RANKS``
    split in hybrid mode where set (as ep_moe's buffers do), else ``(1, ranks)``."""
    from ..backends.hybrid.node_topology import LogicalTopology, logical_topology

    num_ranks = _comm_size(comm)
    topology = logical_topology(LogicalTopology.flat(num_ranks), num_ranks, allow_hybrid_mode)
    return topology.num_scaleout_ranks, topology.num_scaleup_ranks


def _make_c_module() -> types.ModuleType:
    """The ``deep_ep._C`` stand-in (see the module docstring)."""
    module = types.ModuleType("deep_ep._C", "ep_moe's stand-in for DeepEP's compiled extension, as far as "
                                            "deep_ep.utils uses it (ep_moe.compat.deep_ep).")
    provided = {"EventHandle": EventHandle, "Config": Config, "topk_idx_t": topk_idx_t,
                "get_local_nccl_unique_id": _nccl_unique_id, "create_nccl_comm": _create_nccl_comm,
                "destroy_nccl_comm": _destroy_nccl_comm, "get_physical_domain_size": _physical_domain_size,
                "get_logical_domain_size": _logical_domain_size}
    module.__dict__.update(provided)

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"deep_ep._C.{name}: ep_moe has no compiled DeepEP extension; its stand-in provides "
                             f"only {', '.join(sorted(provided))} (what deep_ep.utils uses). DeepEP's own "
                             "buffers and kernels are not available: use deep_ep.Buffer / deep_ep.ElasticBuffer")

    module.__getattr__ = __getattr__
    return module


_C = _make_c_module()


# ------------------------------------------------------------------------------------------ import deep_ep
_ALIASES = ("deep_ep", "deep_ep.buffer", "deep_ep.buffers", "deep_ep.buffers.elastic", "deep_ep.buffers.legacy")
_UTILS = "deep_ep.utils"
ENV_DEEP_EP_PATH = "EP_MOE_DEEP_EP_PATH"
"""Environment variable naming a DeepEP checkout (or its ``deep_ep`` folder) whose ``deep_ep.utils`` `install`
loads; read each time `install` runs."""
_SHIM_MARK = "_EP_MOE_DEEP_EP_SHIM"
_SHIM_SOURCE = (
    "# Written by ep_moe.compat.deep_ep: `import deep_ep` resolves to ep_moe's DeepEP-compatible module.\n"
    f"{_SHIM_MARK} = True\n"
    "from ep_moe.compat.deep_ep import install as _install\n"
    "_install()\n"
)


class _UtilsFinder(importlib.abc.MetaPathFinder):
    """Finds ``deep_ep.utils`` in a DeepEP ``deep_ep`` folder, and nothing else: its submodules then load
    through its ``__path__``, while ``deep_ep.buffers`` and ``deep_ep._C`` stay ep_moe's."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != _UTILS:
            return None
        utils = os.path.join(self.folder, "utils")
        return importlib.util.spec_from_file_location(fullname, os.path.join(utils, "__init__.py"),
                                                      submodule_search_locations=[utils])


_utils_finder: _UtilsFinder | None = None


def deep_ep_folder(path: str) -> str:
    """The ``deep_ep`` folder of ``path``: a DeepEP checkout (holding ``deep_ep/utils/__init__.py``) or that
    ``deep_ep`` folder itself; a FileNotFoundError saying what was looked for otherwise."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    for folder in (os.path.join(path, "deep_ep"), path):
        if os.path.isfile(os.path.join(folder, "utils", "__init__.py")):
            return folder
    raise FileNotFoundError(f"ep_moe.compat.deep_ep: no deep_ep/utils/__init__.py in {path}: give a DeepEP "
                            "checkout or its deep_ep folder")


def _drop_user_utils() -> None:
    """Remove the folder's finder and forget the ``deep_ep.utils`` modules loaded from it."""
    global _utils_finder
    this = sys.modules[__name__]
    if _utils_finder is not None and _utils_finder in sys.meta_path:
        sys.meta_path.remove(_utils_finder)
    _utils_finder = None
    for name in [n for n in sys.modules if n == _UTILS or n.startswith(_UTILS + ".")]:
        if sys.modules[name] is not this:
            del sys.modules[name]
    if this.__dict__.get("utils") not in (None, this):
        del this.utils


def _use_utils(folder: str | None) -> None:
    """``deep_ep.utils`` from ``folder`` (a ``deep_ep`` folder), or this module where None."""
    global _utils_finder
    this = sys.modules[__name__]
    if _utils_finder is not None and _utils_finder.folder != folder:
        _drop_user_utils()
    if folder is None:
        this.utils = this  # `import deep_ep.utils` then `deep_ep.utils.X`
        sys.modules[_UTILS] = this
        return
    if _utils_finder is None:
        if sys.modules.get(_UTILS) is this:
            del sys.modules[_UTILS]
        if this.__dict__.get("utils") is this:
            del this.utils  # `from deep_ep import utils` must import the folder's package
        _utils_finder = _UtilsFinder(folder)
        sys.meta_path.insert(0, _utils_finder)


def install(rebind_megatron: bool = True, utils_from: str | None = None) -> types.ModuleType:
    """Make ``import deep_ep`` (and ``deep_ep.buffer``, V2's ``deep_ep.buffers.elastic`` and
    ``deep_ep.buffers.legacy``) resolve to this module and ``deep_ep._C`` to its stand-in, in this process.
    ``deep_ep.utils`` comes from ``utils_from`` (a DeepEP checkout or its ``deep_ep`` folder; None: the
    ``EP_MOE_DEEP_EP_PATH`` variable, if set), else it is this module; a folder other than the one installed
    before drops the ``deep_ep.utils`` modules loaded from that one. Call it before anything imports
    ``deep_ep``; a real DeepEP already imported is an error. With ``rebind_megatron``, a Megatron ``fused_a2a``
    imported earlier without DeepEP is reloaded so its flex dispatcher's ``deepep`` backend uses this module.
    Returns this module."""
    this = sys.modules[__name__]
    current = sys.modules.get("deep_ep")
    if current is not None and current is not this and not getattr(current, _SHIM_MARK, False):
        raise RuntimeError(f"ep_moe.compat.deep_ep.install: another deep_ep is already imported "
                           f"({getattr(current, '__file__', current)}); install before anything imports deep_ep")
    source = utils_from if utils_from is not None else os.environ.get(ENV_DEEP_EP_PATH) or None
    folder = deep_ep_folder(source) if source is not None else None
    this.buffer = this
    this.buffers = this.elastic = this.legacy = this  # V2's `deep_ep.buffers.elastic` / `.legacy`
    this.__path__ = []  # package-like: `deep_ep.utils` may be a real package (found by `_UtilsFinder` only)
    for name in _ALIASES:
        sys.modules[name] = this
    sys.modules["deep_ep._C"] = _C
    _use_utils(folder)
    if rebind_megatron:
        _rebind_megatron()
    return this


def uninstall() -> None:
    """Undo `install` (entries pointing elsewhere are left alone)."""
    this = sys.modules[__name__]
    _drop_user_utils()
    for name in (*_ALIASES, _UTILS):
        if sys.modules.get(name) is this:
            del sys.modules[name]
    if sys.modules.get("deep_ep._C") is _C:
        del sys.modules["deep_ep._C"]
    this.__dict__.pop("__path__", None)


def _rebind_megatron() -> None:
    fused_a2a = sys.modules.get("megatron.core.transformer.moe.fused_a2a")
    if fused_a2a is None or getattr(fused_a2a, "HAVE_DEEP_EP", True):
        return
    fused_a2a = importlib.reload(fused_a2a)
    token_dispatcher = sys.modules.get("megatron.core.transformer.moe.token_dispatcher")
    if token_dispatcher is not None:
        for name in ("fused_dispatch", "fused_combine", "set_deepep_num_sms"):
            if hasattr(token_dispatcher, name) and hasattr(fused_a2a, name):
                setattr(token_dispatcher, name, getattr(fused_a2a, name))
    log.info("ep_moe.compat.deep_ep: re-bound Megatron's fused_a2a (imported before install) to ep_moe")


def shim_dir() -> str:
    """A folder holding a ``deep_ep.py`` that calls `install`; put it on ``PYTHONPATH`` so that every
    process (``torchrun`` workers, ``multiprocessing`` children) resolves ``import deep_ep`` to ep_moe
    (``deep_ep.utils`` from ``$EP_MOE_DEEP_EP_PATH`` where set). Under ``$EP_MOE_CACHE_DIR`` (default
    ``~/.cache/ep_moe``)."""
    root = os.environ.get("EP_MOE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ep_moe")
    folder = os.path.join(root, "deep_ep_shim")
    target = os.path.join(folder, "deep_ep.py")
    try:
        with open(target, encoding="utf-8") as f:
            if f.read() == _SHIM_SOURCE:
                return folder
    except OSError:
        pass
    os.makedirs(folder, exist_ok=True)
    scratch = f"{target}.{os.getpid()}.tmp"
    with open(scratch, "w", encoding="utf-8") as f:
        f.write(_SHIM_SOURCE)
    os.replace(scratch, target)  # atomic: concurrent ranks never see half a file
    return folder


_USAGE = """usage: python -m ep_moe.compat.deep_ep --shim-dir
       python -m ep_moe.compat.deep_ep [--deep-ep PATH] program.py [ARGS...]
       python -m ep_moe.compat.deep_ep [--deep-ep PATH] -m module [ARGS...]

Runs a program written for DeepEP on ep_moe: `import deep_ep` resolves to ep_moe.compat.deep_ep in it and
in every process it spawns. --deep-ep PATH: deep_ep.utils comes from that DeepEP checkout (or its deep_ep
folder), also in spawned processes (through EP_MOE_DEEP_EP_PATH). --shim-dir prints a folder to put on
PYTHONPATH for the same effect (with EP_MOE_DEEP_EP_PATH set for deep_ep.utils)."""


def main(argv: list[str] | None = None) -> int:
    """The ``python -m ep_moe.compat.deep_ep`` launcher (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    utils_from = None
    if argv and (argv[0] == "--deep-ep" or argv[0].startswith("--deep-ep=")):
        if argv[0] == "--deep-ep":
            if len(argv) < 2:
                print(_USAGE, file=sys.stderr)
                return 2
            utils_from, argv = argv[1], argv[2:]
        else:
            utils_from, argv = argv[0].partition("=")[2], argv[1:]
        try:
            utils_from = deep_ep_folder(utils_from)
        except FileNotFoundError as e:
            print(e, file=sys.stderr)
            return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    folder = shim_dir()
    if argv[0] == "--shim-dir":
        print(folder)
        return 0
    # Child processes: exec'd ones read PYTHONPATH and EP_MOE_DEEP_EP_PATH; multiprocessing's spawn copies
    # this sys.path (the folder goes ahead of site-packages, where a real DeepEP may be installed).
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
    if utils_from is not None:
        os.environ[ENV_DEEP_EP_PATH] = utils_from
    sys.path.insert(1, folder)
    install()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(_USAGE, file=sys.stderr)
            return 2
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        program = argv[0]
        sys.argv = [program, *argv[1:]]
        sys.path[0] = os.path.dirname(os.path.abspath(program))
        runpy.run_path(program, run_name="__main__")
    return 0


__all__ = ["Buffer", "Config", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap", "check_nccl_so",
           "deep_ep_folder", "find_cuda_home", "find_nccl_root", "get_logical_domain_size",
           "get_physical_domain_size", "init_jit", "install", "shim_dir", "topk_idx_t", "uninstall"]

if __name__ == "__main__":
    # Run as a script, this file is `__main__`; the launcher works on the importable module.
    from ep_moe.compat import deep_ep as _module

    sys.exit(_module.main())
