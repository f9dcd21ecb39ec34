"""`ElasticBuffer`: DeepEP V2's buffer API (``deep_ep.ElasticBuffer``) over an `ep_moe.Buffer`.

One class, two layouts chosen per call (docs/semantics.md, section "ElasticBuffer (DeepEP V2's buffer)"):

* ``do_expand=False``, the compact layout: the rank-major dispatch (`ep_moe.buffer.autograd_ops.dispatch`: one row
  per token and receiving rank, by source rank then token) and its combine, which sums the rows per token and
  carries ``topk_weights`` back alongside;
* ``do_expand=True``, the expanded layout: the expert-major dispatch (`ep_moe.buffer.expert_major_ops`: one row per
  (token, local expert) pair, grouped by expert, each group padded to ``expert_alignment``) and its combine, a
  plain sum per token (as in V2 the weights are not applied; they travel back alongside).

Both are differentiable end to end. ``do_cpu_sync=False`` gives fixed-size outputs sized from
``num_max_tokens_per_rank`` and no host read; a ``handle`` repeats a dispatch's layout (cached dispatch).

Memory types (``.memory_type``) and Engram (`engram_write` / `engram_fetch`) come from
`ep_moe.elastic.engram.EngramMixin` over `ep_moe.elastic.memory`. With the elastic and hybrid types the range's
GPU segment is the native backend's dispatch/combine memory (``comm_memory_in_segment``; docs/semantics.md, section
"ElasticBuffer: memory types and Engram"). Pipeline-parallel send/recv (``pp_*``, `ep_moe.elastic.pipeline_comm`)
and all-gather / reduce-scatter sessions (AGRS, `ep_moe.elastic.agrs`) come from their mixins: the copy engine on
the native backend by default, torch.distributed otherwise. RDMA queue pairs are not provided (``sl_idx``,
``num_allocated_qps`` and ``num_qps`` are recorded only).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends.hybrid import HybridBackend, LogicalTopology, host_topology, logical_topology
from ..buffer import autograd_ops as ops
from ..buffer.argument_checks import _fail, check_num_experts, check_positive_int, check_tensor, split_hidden
from ..buffer.buffer_v1 import BACKENDS, Buffer
from ..buffer.dispatch_handle import DispatchHandle
from ..buffer.event_overlap import EventOverlap
from ..buffer.expert_major_ops import ExpertHandle, expert_cached_dispatch, expert_combine, expert_dispatch
from ..config import Config
from ..distributed import disable_multicast
from ..permute import unpermute_sum
from .agrs import AGRSMixin
from .engram import EngramMixin
from .memory import memory_type_of_group
from .memory.cuda_vmm import vmm_unavailable_reason
from .memory.segment_layout import ALIGNMENT_BYTES  # num_bytes is a multiple of it (2 MiB), as in DeepEP V2
from .pipeline_comm import PipelineCommMixin

log = logging.getLogger("ep_moe")



@dataclass
class ElasticHandle:
    """The handle of an `ElasticBuffer.dispatch` (DeepEP V2's ``EPHandle``), for its combine or a cached dispatch.

    The fields V2 clients read come first (their status: docs/compat.md, section "EPHandle"). L local experts,
    R ranks, T this rank's tokens, N the rank-major rows received.

    Args:
        do_expand: the layout: True expanded (expert-major), False compact (rank-major).
        num_experts, expert_alignment, num_max_tokens_per_rank: E, A and the token bound of the dispatch.
        num_sms: the dispatch's SM count; its combine and a cached dispatch use it unless given another.
        topk_idx: ``[T, K]`` int64, the dispatch's routing (a copy unless ``do_handle_copy=False``).
        num_recv_tokens: N (compact rows, or the rank-major rows behind the expanded ones); -1 without a host sync.
        num_expanded_tokens: the sum of the aligned per-expert counts; -1 without a host sync.
        num_recv_tokens_per_expert_list: the L aligned counts on the host; ``[]`` without a host sync.
        psum_num_recv_tokens_per_scaleup_rank: ``[R]`` int32 on the device, inclusive prefix sum of rows per source.
        psum_num_recv_tokens_per_expert: ``[L]`` int32 on the device (compact: inclusive prefix sum of the aligned
            counts; expanded: expert e's first row plus its unaligned count).
        num_unaligned_recv_tokens_per_expert: ``[L]`` int32, (token, expert) pairs per local expert; expanded only.
        inner: ep_moe's handle: a `DispatchHandle` (compact) or an `ExpertHandle` (expanded).
        num_worst_tokens: 0 (exact size, after a host sync) or the fixed row bound of the rank-major dispatch.
        recv_topk_idx: compact: the dispatch's ``[N, K]`` int64 ``recv_topk_idx``; else None.
        rank: the dispatching rank (the handle's metadata is computed from it).
    """

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    """The SM count of the dispatch; its combine and a cached dispatch use it unless given another."""
    topk_idx: Tensor
    """[T, K] int64: the routing of the dispatch (a copy unless ``do_handle_copy=False``)."""
    num_recv_tokens: int
    """Rows received (compact) / rank-major rows behind the expanded ones; -1 without a host sync."""
    num_expanded_tokens: int
    """Sum of the aligned per-expert counts (the expanded rows in use); -1 without a host sync."""
    num_recv_tokens_per_expert_list: list
    """The L aligned per-expert counts on the host; ``[]`` without a host sync (``do_cpu_sync=False``)."""
    psum_num_recv_tokens_per_scaleup_rank: Tensor
    """[R] int32 on the device: inclusive prefix sum of the rows received from each source rank."""
    psum_num_recv_tokens_per_expert: Tensor
    """[L] int32 on the device. Compact: the inclusive prefix sum of the aligned counts. Expanded (as V2): expert
    e's first row plus its unaligned count, so ``psum[e] - align(psum[e-1], A)`` is e's count."""
    num_unaligned_recv_tokens_per_expert: Tensor | None
    """[L] int32 on the device: the (token, expert) pairs per local expert; expanded layout only, else None."""
    inner: DispatchHandle | ExpertHandle
    num_worst_tokens: int
    """0 (exact size, after a host sync) or the fixed row bound of the rank-major dispatch."""
    recv_topk_idx: Tensor | None = None
    """Compact layout: the dispatch's ``recv_topk_idx`` (a cached dispatch returns it again)."""
    rank: int = 0
    """The dispatching rank (the handle's metadata is computed from it)."""
    _recv_src_metadata: Tensor | None = field(default=None, repr=False)  # computed on first read
    _dst_buffer_slot_idx: Tensor | None = field(default=None, repr=False)

    @property
    def recv_src_metadata(self) -> Tensor | None:
        """V2's source metadata of the received rows, ``[N, 2 + K]`` int32 on the device (computed on first read).

        One row per rank-major received row: column 0 the source token's global index
        ``src_rank * num_max_tokens_per_rank + t``; column 1 ``src_rank * K + k`` with k the first top-k entry of
        the token whose expert is local; columns ``2 + k`` the expanded row of pair (token, k) in the expanded
        layout, -1 where entry k is not local and always -1 in the compact layout. Rows past the received ones
        (fixed size) are -1. None when ``num_max_tokens_per_rank`` is 0 (V2 requires it)."""
        if self._recv_src_metadata is None and self.num_max_tokens_per_rank > 0:
            self._recv_src_metadata = _source_metadata(self)
        return self._recv_src_metadata

    @recv_src_metadata.setter
    def recv_src_metadata(self, value: Tensor | None) -> None:
        self._recv_src_metadata = value

    @property
    def dst_buffer_slot_idx(self) -> Tensor:
        """Each top-k entry's destination row, ``[T, K]`` int32 on the device (computed on first read).

        For each top-k entry of this rank's tokens, the rank-major row that the token lands in on the entry's
        rank (the same row for every entry of a token on one rank), -1 where ``topk_idx`` is -1."""
        if self._dst_buffer_slot_idx is None:
            self._dst_buffer_slot_idx = _destination_rows(self)
        return self._dst_buffer_slot_idx

    @dst_buffer_slot_idx.setter
    def dst_buffer_slot_idx(self, value: Tensor) -> None:
        self._dst_buffer_slot_idx = value

    def deterministic_sort(self, *args, **kwargs) -> None:
        """Do nothing: the dispatch's outputs are in V2's deterministic order already.

        V2 sorts a dispatch's outputs by source token (expanded: by expert, then source token) when
        ``deterministic=True``; ep_moe's dispatch returns them in that order already (rows by source rank, then
        token; expanded rows by expert, source rank, token), so there is nothing to do."""

    token_metadata_at_forward = None
    """V2's per-channel forwarding metadata of its hybrid kernels: ep_moe's hybrid path keeps none (None)."""
    channel_linked_list = None
    """V2's per-channel linked list of its hybrid kernels: ep_moe's hybrid path keeps none (None)."""


def _received_sources(handle: ElasticHandle) -> tuple[Tensor, Tensor, Tensor]:
    """``(src_rank [N], src_token [N], local [N, K] bool)`` of the rank-major received rows behind ``handle``:
    -1 ranks and tokens on rows past the received ones; ``local`` marks the top-k entries whose expert is on this
    rank."""
    inner = handle.inner
    if handle.do_expand:
        local = inner.layout.slot_of_pair >= 0
        dispatch = inner.dispatch
    else:
        local = handle.recv_topk_idx >= 0
        dispatch = inner
    if dispatch is None:  # one rank, expanded: the received rows are the tokens with an expert, in order
        has = local.any(dim=1)
        order = torch.argsort((~has).to(torch.int8), stable=True)
        rows = torch.where(has[order], order, -1)
        num_rows = handle.num_recv_tokens if handle.num_worst_tokens == 0 else handle.num_worst_tokens
        rows = torch.cat([rows, rows.new_full((max(num_rows - rows.shape[0], 0),), -1)])[:num_rows]
        local = torch.cat([local, local.new_zeros(max(num_rows - local.shape[0], 0), local.shape[1])])
        return torch.where(rows >= 0, 0, -1), rows, local[rows.clamp(min=0)] & (rows >= 0).unsqueeze(1)
    return dispatch.recv_src_rank.to(torch.int64), dispatch.recv_src_idx.to(torch.int64), local


def _source_metadata(handle: ElasticHandle) -> Tensor:
    src_rank, src_token, local = _received_sources(handle)
    num_topk = local.shape[1]
    received = src_rank >= 0
    first_local = torch.where(local.any(dim=1), local.to(torch.int8).argmax(dim=1), -1)
    meta = torch.full((local.shape[0], 2 + num_topk), -1, dtype=torch.int32, device=local.device)
    meta[:, 0] = torch.where(received, src_rank * handle.num_max_tokens_per_rank + src_token, -1).to(torch.int32)
    meta[:, 1] = torch.where(received & (first_local >= 0), src_rank * num_topk + first_local, -1).to(torch.int32)
    if handle.do_expand:
        slots = handle.inner.layout.slot_of_pair
        if handle.inner.dispatch is None:  # the layout's rows are the tokens: pick the received ones
            slots = slots[src_token.clamp(min=0)]
        meta[:, 2:] = torch.where(local, slots, -1).to(torch.int32)
    return meta


def _destination_rows(handle: ElasticHandle) -> Tensor:
    topk_idx = handle.topk_idx
    dispatch = handle.inner.dispatch if handle.do_expand else handle.inner
    valid = topk_idx >= 0
    if dispatch is None:  # one rank, expanded: the tokens with an expert, in order, are the received rows
        rows = (torch.cumsum(valid.any(dim=1).to(torch.int64), dim=0) - 1).unsqueeze(1)
        return torch.where(valid, rows, -1).to(torch.int32)
    num_ranks = dispatch.rank_prefix_matrix.shape[0]
    dst = torch.where(valid, topk_idx // (handle.num_experts // num_ranks), 0)
    # row of token t on rank r: the rows of lower source ranks on r, then t's place among this rank's tokens to r
    before = (dispatch.rank_prefix_matrix[handle.rank - 1].to(torch.int64) if handle.rank > 0 else
              torch.zeros(num_ranks, dtype=torch.int64, device=topk_idx.device))
    place = torch.cumsum(dispatch.is_token_in_rank.to(torch.int64), dim=0) - 1  # [T, R]
    rows = before[dst] + place.gather(1, dst)
    return torch.where(valid, rows, -1).to(torch.int32)


def _event_of(event):
    """The ``torch.cuda.Event`` inside a DeepEP-style event argument (EventOverlap, EventHandle, raw), or None."""
    while event is not None and not isinstance(event, torch.cuda.Event):
        event = getattr(event, "event", None)
    return event


def _wait_for(*events) -> None:
    for event in events:
        event = _event_of(event)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


def _destroy_quietly(buffer: Buffer) -> None:
    try:
        buffer.destroy()
    except Exception as exc:  # at interpreter exit the device or the group may be gone already
        log.debug("ep_moe.ElasticBuffer: destroy at collection failed: %s", exc)


class ElasticBuffer(EngramMixin, PipelineCommMixin, AGRSMixin):
    """DeepEP V2's ``ElasticBuffer`` on ep_moe: dispatch and combine in the compact or expanded layout, PP, AGRS.

    DeepEP's arguments keep V2's names, order and defaults; each one's status is in docs/compat.md, section
    "ElasticBuffer", and sizes, memory types and hybrid mode in docs/semantics.md, sections "ElasticBuffer ...".

    Args:
        group: the EP process group (None: the world group).
        num_bytes: GPU bytes, a multiple of 2 MiB (None: `get_buffer_size_hint` of the MoE settings). GPU memory
            type: where the native backend starts (it grows); elastic and hybrid types: the fixed GPU segment.
        num_cpu_bytes: host bytes per rank for Engram tables (0: the GPU memory type; > 0: elastic or hybrid).
        num_max_tokens_per_rank: the bound on every rank's tokens; sizes the outputs of ``do_cpu_sync=False``.
        hidden, num_topk, use_fp8_dispatch: the MoE settings that size ``num_bytes`` (FP8 may be sent either way).
        deterministic, sl_idx, num_allocated_qps: recorded (every order is fixed; there are no RDMA queue pairs).
        allow_hybrid_mode: two hops (docs/hybrid.md) when the logical topology has more than one scale-out rank.
        allow_multiple_reduction: the expanded and the hybrid combine sum a token's rows per rank / node first.
        prefer_overlap_with_compute: enters `get_theoretical_num_sms` (the SM count comes from ep_moe's tuner).
        num_cpu_timeout_secs, num_gpu_timeout_secs: deadlines of `engram_fetch`'s waits, of every wait for a peer.
        explicitly_destroy: True: freed by `destroy` only; False: also when collected or at interpreter exit.
        backend, check_inputs: as `ep_moe.Buffer` (``"auto"``, ``"native"`` or ``"torch"``; range-check expert ids).
        num_scaleout_ranks, num_hybrid_chunks, hybrid_scaleup: hybrid mode's view, chunk count and in-node
            transport (docs/configuration.md, section "Hybrid mode: `ElasticBuffer` across nodes").

    Raises:
        ValueError: naming the argument. RuntimeError: torch.distributed is not initialized.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, backend: str = "auto", check_inputs: bool = True,
                 num_scaleout_ranks: int | None = None, num_hybrid_chunks: int | None = None,
                 hybrid_scaleup: str | None = None) -> None:
        op = "ElasticBuffer"
        if not dist.is_initialized():
            raise RuntimeError("ep_moe.ElasticBuffer: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        if backend not in BACKENDS:
            raise _fail(op, "backend", f"one of {BACKENDS}", repr(backend))
        check_positive_int(op, "num_cpu_bytes", num_cpu_bytes, 0)
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                            ("num_topk", num_topk), ("sl_idx", sl_idx), ("num_allocated_qps", num_allocated_qps)):
            check_positive_int(op, name, value, 0)
        for name, value in (("num_cpu_timeout_secs", num_cpu_timeout_secs),
                            ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise _fail(op, name, "a positive number of seconds", repr(value))
        group = group if group is not None else dist.group.WORLD
        if num_scaleout_ranks is not None:  # checked before anything is made
            LogicalTopology.blocks(dist.get_world_size(group), num_scaleout_ranks)
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                                  allow_hybrid_mode, allow_multiple_reduction)
        check_positive_int(op, "num_bytes", num_bytes, 0)
        if num_bytes % ALIGNMENT_BYTES:
            raise _fail(op, "num_bytes", "a multiple of 2 MiB (get_buffer_size_hint gives one)", num_bytes)
        disable_multicast()  # before any symmetric memory is made
        memory_type = memory_type_of_group(group, num_cpu_bytes, allow_hybrid_mode)  # collective with CPU bytes
        if memory_type != "gpu" and num_max_tokens_per_rank and hidden:
            # the GPU segment is the dispatch/combine memory and does not grow: it must hold the stated sizes
            need = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                             allow_hybrid_mode, allow_multiple_reduction)
            if num_bytes < need:
                raise _fail(op, "num_bytes", f">= get_buffer_size_hint(...) = {need} for the {memory_type} memory "
                            f"type (its GPU segment is the dispatch/combine memory: num_max_tokens_per_rank="
                            f"{num_max_tokens_per_rank}, hidden={hidden}, num_topk={num_topk})", num_bytes)
        # elastic / hybrid: the backend allocates no memory of its own here (the native one is given the segment)
        self.buffer = Buffer(group, num_bytes if memory_type == "gpu" else 0, explicitly_destroy=explicitly_destroy,
                             backend=backend, timeout_s=float(num_gpu_timeout_secs), check_inputs=check_inputs)
        self.group = self.buffer.group
        self.rank = self.rank_idx = self.buffer.rank
        self.num_ranks = self.group_size = self.buffer.group_size
        self.num_bytes = num_bytes
        self.num_cpu_bytes = num_cpu_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden, self.num_topk, self.use_fp8_dispatch = hidden, num_topk, use_fp8_dispatch
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.sl_idx, self.num_allocated_qps = sl_idx, num_allocated_qps
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = num_cpu_timeout_secs, num_gpu_timeout_secs
        self.explicitly_destroy = explicitly_destroy
        # Logical (scale-out x scale-up) and physical (hosts) topology; two hops when it spans scale-out ranks.
        physical = host_topology(self.group)
        self.topology = logical_topology(physical, self.num_ranks, allow_hybrid_mode, num_scaleout_ranks)
        if self.topology.is_hybrid:
            flat_backend, self.buffer.backend = self.buffer.backend, HybridBackend(
                self.group, self.buffer.device, float(num_gpu_timeout_secs), self.topology,
                num_chunks=num_hybrid_chunks, scaleup=hybrid_scaleup, native_options=self.buffer.native_options,
                allow_multiple_reduction=allow_multiple_reduction)
            flat_backend.destroy()
            self.buffer.backend_reason = f"hybrid mode, {self.topology.num_scaleout_ranks} x " \
                                         f"{self.topology.num_scaleup_ranks} ({self.topology.source})"
        self.num_scaleout_ranks, self.num_scaleup_ranks = (self.topology.num_scaleout_ranks,
                                                           self.topology.num_scaleup_ranks)
        self.scaleout_rank_idx = self.topology.node_of[self.rank]
        self.scaleup_rank_idx = self.topology.local_of[self.rank]
        self.num_rdma_ranks, self.num_nvlink_ranks = physical.num_scaleout_ranks, physical.num_scaleup_ranks
        self._plans: dict = {}  # (E, K, H, dtype) -> the tuner's plan (native backend); ("hybrid", ...) -> its shape
        self._destroyed = False
        self._finalizer = None if explicitly_destroy else weakref.finalize(self, _destroy_quietly, self.buffer)
        share = self._segment_is_comm_memory(memory_type, num_bytes)
        # .memory_type, .memory (ep_moe.elastic.engram)
        self._setup_memory(num_bytes, num_cpu_bytes, allow_hybrid_mode, memory_type, share_gpu=share)
        # True: the native backend's dispatch/combine memory is the GPU segment of .memory (elastic / hybrid type,
        # flat native backend, num_bytes > 0); False: the backend has its own (GPU type, torch, hybrid mode)
        self.comm_memory_in_segment = share
        if share:
            try:
                self.buffer.backend.use_data_memory(self.memory.gpu, self.memory.gpu_fd, "ElasticBuffer",
                                                    "num_bytes")
            finally:
                self.memory.close_gpu_fd()  # every peer has mapped it (or every rank raised)
        self.buffer.barrier()

    # ---------------------------------------------------------------- static API
    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup | None, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of GPU memory in which one rank can receive every token of every rank.

        Args:
            group: the EP group (None: the world group); only its size counts.
            num_max_tokens_per_rank: the most tokens any rank dispatches in one call.
            hidden: H, elements per row.
            num_topk: K, top-k entries per token.
            use_fp8_dispatch: size the dispatch for FP8 rows and their scales instead of bf16 rows.
            allow_hybrid_mode: accepted as V2's, unused.
            allow_multiple_reduction: False: also fit the expanded combine's rows, ``num_topk`` fp32 blocks of
                ``hidden`` each.

        Returns:
            The byte count, a multiple of 2 MiB: the larger of what the dispatch and the combine (bf16 rows)
            need (`Buffer.get_buffer_size_hint`).
        """
        num_ranks = dist.get_world_size(group if group is not None else dist.group.WORLD)
        size = Buffer.get_buffer_size_hint(num_max_tokens_per_rank, hidden, num_ranks, num_topk, torch.bfloat16,
                                           use_fp8_dispatch)
        if not allow_multiple_reduction:
            size = max(size, Buffer.get_buffer_size_hint(num_max_tokens_per_rank, hidden * max(num_topk, 1),
                                                         num_ranks, num_topk, torch.float32))
        return size

    @staticmethod
    def capture() -> EventOverlap:
        """Record an event on the current stream.

        Returns:
            An `EventOverlap` holding that event; an empty one on CPU.
        """
        return Buffer.capture()

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The buffer's communication stream (`Buffer.get_comm_stream`).

        Returns:
            The ``torch.cuda.Stream``, or None on CPU; every call has joined the current stream when it returns.
        """
        return self.buffer.get_comm_stream()

    def get_physical_domain_size(self) -> tuple[int, int]:
        """The group's physical topology, from the ranks' host names.

        Returns:
            ``(RDMA ranks, NVLink ranks)``: the hosts of the group and the ranks per host.
        """
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """The logical topology dispatch and combine use (`ep_moe.backends.hybrid.node_topology`).

        Returns:
            ``(scale-out ranks, scale-up ranks)``; ``(1, R)`` with ``allow_hybrid_mode=False``.
        """
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """DeepEP V2's analytic SM count for this group (`ep_moe.tuning.get_theoretical_num_sms`).

        A dispatch with ``num_sms=0`` does not use it: it takes ep_moe's calibrated plan
        (`ep_moe.tuning.plan_for_layer`) on the native backend.

        Args:
            num_experts: E. num_topk: K.
            num_scaleout_topk: reserved (0; a group-limited gate is not modelled).
            rdma_gbs: NIC rate per GPU in GB/s (0: detected).
            nvlink_gbs: NVLink rate per GPU in GB/s (0: detected).
            sm_read_gbs: what one SM reads per second, GB/s. sm_write_gbs: what it writes.

        Returns:
            The SM count (an even int); NVLink domains are the logical scale-up ranks' in hybrid mode, else the
            hosts'; ``prefer_overlap_with_compute=False`` asks for at least 64.
        """
        from ..tuning import get_theoretical_num_sms

        return get_theoretical_num_sms(num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs,
                                       sm_write_gbs, num_ranks=self.num_ranks,
                                       num_nvlink_ranks=(self.num_scaleup_ranks if self.num_scaleout_ranks > 1
                                                         else self.num_nvlink_ranks), hybrid=self.allow_hybrid_mode,
                                       prefer_overlap_with_compute=self.prefer_overlap_with_compute)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP V2's queue-pair count for a kernel (`ep_moe.tuning.get_theoretical_num_qps`), reported, not used.

        ep_moe's network hop is NCCL (no queue pairs of its own).

        Args:
            num_sms: the kernel's SM count, an int >= 1.

        Returns:
            The count: hybrid when the logical topology has scale-out ranks, at most ``num_allocated_qps`` when
            that is set.

        Raises:
            ValueError: ``num_sms`` is not a positive int.
        """
        from ..tuning import get_theoretical_num_qps

        return get_theoretical_num_qps(num_sms, self.num_scaleout_ranks > 1, self.num_allocated_qps)

    # ---------------------------------------------------------------- helpers
    def _segment_is_comm_memory(self, memory_type: str, num_bytes: int) -> bool:
        """Collective (elastic / hybrid types): whether the GPU segment becomes the native backend's
        dispatch/combine memory, the same answer on every rank: the flat native backend, a non-empty segment,
        and every rank's device able to export it as a file descriptor (else, logged, the backend allocates its
        own memory on first use)."""
        if memory_type == "gpu" or num_bytes == 0 or self.buffer.backend_name != "native":
            return False
        reason = vmm_unavailable_reason(self.buffer.device, exportable=True, host=False)
        reasons: list = [None] * self.num_ranks
        dist.all_gather_object(reasons, reason, group=self.group)
        refused = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None]
        if refused:
            if self.rank == 0:
                log.warning("ep_moe.ElasticBuffer: the GPU segment cannot be shared (%s); the native backend "
                            "allocates its own dispatch/combine memory", "; ".join(refused))
            return False
        return True

    def _check_fixed_size_fits(self, op: str, data: Tensor, scales: Tensor | None, num_topk: int, bound: int,
                               do_expand: bool) -> None:
        """Elastic / hybrid types: a fixed-size call (``do_cpu_sync=False``) of ``bound`` tokens per rank must fit
        the GPU segment; checked on every backend (the torch backend keeps its own memory, but a program that runs
        there runs on the native one too), before anything is sent."""
        if self.memory is None or not self.num_bytes:
            return
        num_ranks, hidden = self.num_ranks, data.shape[1]
        need = Buffer.get_buffer_size_hint(bound, hidden, num_ranks, num_topk, data.dtype, scales is not None)
        if do_expand and not self.allow_multiple_reduction:  # that combine sends fp32 rows
            need = max(need, Buffer.get_buffer_size_hint(bound, hidden, num_ranks, num_topk, torch.float32))
        if need > self.num_bytes:
            raise _fail(op, "num_bytes", f">= {need} bytes for this fixed-size call ({bound} tokens per rank "
                        f"(num_max_tokens_per_rank), hidden {hidden}, {data.dtype}, top-{num_topk}; the "
                        f"{self.memory_type} memory's GPU segment is the dispatch/combine memory): create the "
                        f"buffer with a larger num_bytes or pass a smaller num_max_tokens_per_rank", self.num_bytes)

    def _check_live(self, op: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"ep_moe.ElasticBuffer.{op}: the buffer was destroyed")

    def _plan(self, num_experts: int, num_topk: int, hidden: int, dtype: torch.dtype, tokens: int) -> int:
        key = (num_experts, num_topk, hidden, dtype)
        if key not in self._plans:
            from ..tuning import plan_for_layer

            self._plans[key] = plan_for_layer(num_experts, num_topk, hidden, tokens, dtype,
                                              num_ranks=self.num_ranks).num_sms
        return self._plans[key]

    def _hybrid_plan(self, num_sms: int, num_experts: int, num_topk: int, x: Tensor, bound: int) -> int:
        """Hybrid backend: the hybrid model's plan of this shape (`ep_moe.tuning.hybrid_model.plan_hybrid`, made once
        per shape, for the largest token count of any rank) sets the chunk count of the call (unless fixed by
        ``num_hybrid_chunks`` / ``EP_MOE_HYBRID_CHUNKS``) and, without an explicit ``num_sms``, the SMs of the
        in-node hop."""
        from ..tuning.hybrid_model import apply_hybrid_plan

        key = ("hybrid", num_experts, num_topk, x.shape[1], x.dtype)
        backend = self.buffer.backend
        plan = self._plans.get(key)
        if plan is None:
            if not bound:  # ranks may hold different token counts: plan for the largest so that all agree
                tokens = torch.tensor([x.shape[0]], device=self.buffer.device)
                dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=self.group)
                bound = int(tokens)
            plan = self._plans[key] = apply_hybrid_plan(backend, num_experts, num_topk, x.shape[1], bound,
                                                        x.element_size())
        elif not backend.chunks_fixed:  # another shape's plan may have set another count since
            backend.set_num_chunks(plan.num_chunks)
        return num_sms or plan.scaleup_sms

    def _num_sms(self, num_sms: int, num_experts: int, num_topk: int, x: Tensor, bound: int) -> int:
        """The given count, else (native backend) the tuner's plan of this shape, else the buffer default."""
        check_positive_int("ElasticBuffer.dispatch", "num_sms", num_sms, 0)
        if self.buffer.backend_name == "hybrid":
            return self._hybrid_plan(num_sms, num_experts, num_topk, x, bound)
        if num_sms:
            return num_sms
        if self.buffer.backend_name != "native":
            return Buffer.num_sms
        if (num_experts, num_topk, x.shape[1], x.dtype) not in self._plans and not bound:
            # Ranks may hold different token counts: plan for the largest so that all agree (first call only).
            tokens = torch.tensor([x.shape[0]], device=self.buffer.device)
            dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=self.group)
            bound = int(tokens)
        return self._plan(num_experts, num_topk, x.shape[1], x.dtype, bound)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x, topk_idx: Tensor | None = None, topk_weights: Tensor | None = None,
                 cumulative_local_expert_recv_stats: Tensor | None = None, num_experts: int | None = None,
                 num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None, num_sms: int = 0,
                 num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: ElasticHandle | None = None, do_handle_copy: bool = True, do_cpu_sync: bool | None = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Send each token to the ranks of its experts (DeepEP V2's argument order and names).

        Args:
            x: ``[T, H]`` bf16/fp32, or the FP8 pair ``(x_e4m3 [T, H], scales [T, H/128] fp32)`` (forward only).
            topk_idx: ``[T, K]`` int64 global expert ids or -1 (None with ``handle``). topk_weights: ``[T, K]`` fp32.
            cumulative_local_expert_recv_stats: ``[L]`` int32/int64, incremented by the received pairs, or None.
            num_experts: E (from the handle on a cached dispatch). expert_alignment: A (default 1).
            num_max_tokens_per_rank: the bound on every rank's ``T`` for ``do_cpu_sync=False`` (default: the buffer's).
            num_sms: SMs, kept in the handle; 0: the tuner's plan on the native backend, else `ep_moe.Buffer.num_sms`.
            previous_event, previous_event_before_epilogue: waited for first. do_handle_copy: copy ``topk_idx``.
            handle: repeat this earlier dispatch's layout (``topk_idx`` None, ``do_cpu_sync`` None or False).
            do_cpu_sync: None: True fresh, False cached. False: fixed size, ``W = num_max_tokens_per_rank * R``, no
                host read, zero (index -1) past the used rows (the layouts' sizes: docs/semantics.md, "ElasticBuffer").
            do_expand: the expanded (expert-major) layout instead of the compact (rank-major) one.
            num_qps, async_with_compute_stream, allocate_on_comm_stream, do_zero_padding, use_tma_aligned_col_major_sf:
                accepted, ignored (each argument's status: docs/compat.md, section "dispatch").

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``: compact ``[N, H]``, ``[N, K]`` local ids
            or -1, ``[N, K]`` fp32 (0 where not local); expanded ``[M, H]`` by local expert, None, ``[M]`` fp32. FP8
            input gives a pair as ``recv_x``; weights are None without ``topk_weights``; ``handle``: an `ElasticHandle`.

        Raises:
            ValueError: a bad argument, named. RuntimeError: the buffer was destroyed."""
        op = "ElasticBuffer.dispatch"
        self._check_live("dispatch")
        data, scales = split_hidden(op, x, self.buffer.device, self.buffer.backend.supported_dtypes)
        check_positive_int(op, "num_qps", num_qps, 0)
        _wait_for(previous_event, previous_event_before_epilogue)
        if handle is not None:
            return self._cached_dispatch(op, data, scales, topk_idx, topk_weights, num_experts,
                                         num_max_tokens_per_rank, expert_alignment, num_sms, handle, do_cpu_sync,
                                         do_expand)
        if topk_idx is None:
            raise _fail(op, "topk_idx", "a [T, K] int64 tensor (or pass handle for a cached dispatch)", None)
        if num_experts is None:
            raise _fail(op, "num_experts", "a positive int (given for a fresh dispatch)", None)
        check_num_experts(op, num_experts, self.num_ranks)
        alignment = 1 if expert_alignment is None else check_positive_int(op, "expert_alignment",
                                                                          expert_alignment, 1)
        bound = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        check_positive_int(op, "num_max_tokens_per_rank", bound, 0)
        sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        if not sync:
            if not bound:
                raise _fail(op, "num_max_tokens_per_rank", "> 0 (in the call or the buffer) with do_cpu_sync=False",
                            bound)
            if data.shape[0] > bound:
                raise _fail(op, "num_max_tokens_per_rank", f">= the {data.shape[0]} tokens of x", bound)
        check_tensor(op, "topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2, device=data.device,
                     shape=(data.shape[0], None))
        weights = topk_weights
        if weights is None:
            weights = torch.zeros(topk_idx.shape, dtype=torch.float32, device=data.device)
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            check_tensor(op, "cumulative_local_expert_recv_stats", stats, dtypes=(torch.int32, torch.int64), ndim=1,
                         device=data.device, shape=(num_experts // self.num_ranks,))
        num_worst_tokens = 0 if sync else bound * self.num_ranks
        if not sync:
            self._check_fixed_size_fits(op, data, scales, topk_idx.shape[1], bound, do_expand)
        num_sms = self._num_sms(num_sms, num_experts, topk_idx.shape[1], data, bound)
        routing = topk_idx.clone() if do_handle_copy else topk_idx
        common = dict(num_experts=num_experts, expert_alignment=alignment, num_max_tokens_per_rank=bound,
                      num_sms=num_sms, topk_idx=routing, num_worst_tokens=num_worst_tokens, rank=self.rank)
        if do_expand:
            out = expert_dispatch(self.buffer, x, topk_idx, weights, num_experts, alignment, num_worst_tokens, num_sms)
            aligned, unaligned = out.tokens_per_expert, out.pairs_per_expert
            starts = torch.cumsum(aligned, 0) - aligned
            counts = [] if not sync else (out.tokens_per_expert_list if out.tokens_per_expert_list is not None
                                          else aligned.tolist())
            inner = out.handle
            if inner.dispatch is not None:
                per_rank = inner.dispatch.rank_prefix_matrix[:, self.rank]
                recv_rows = inner.layout.num_rows if sync else -1
            else:  # one rank, no rank-major copy: the tokens with an expert are the received ones
                per_rank = (topk_idx >= 0).any(dim=1).sum().reshape(1)
                recv_rows = int(per_rank) if sync else -1  # a host read only where the call syncs anyway
            new = ElasticHandle(do_expand=True, num_recv_tokens=recv_rows,
                                num_expanded_tokens=sum(counts) if sync else -1,
                                num_recv_tokens_per_expert_list=counts,
                                psum_num_recv_tokens_per_scaleup_rank=per_rank.to(torch.int32),
                                psum_num_recv_tokens_per_expert=(starts + unaligned).to(torch.int32),
                                num_unaligned_recv_tokens_per_expert=unaligned.to(torch.int32), inner=inner, **common)
            result = (out.expert_x, None, out.expert_weights if topk_weights is not None else None)
        else:
            if scales is None:
                out = ops.dispatch(self.buffer, x, topk_idx, weights, num_experts, alignment, num_worst_tokens,
                                   num_sms)
            else:
                out = self._dispatch_fp8(data, scales, topk_idx, weights, num_experts, alignment, num_worst_tokens,
                                         num_sms)
            unaligned = None
            if sync:
                host = out.num_recv_tokens_per_expert_host
                counts = host.tolist() if host.numel() else out.num_recv_tokens_per_expert.tolist()
            else:
                counts = []
            new = ElasticHandle(do_expand=False, num_recv_tokens=out.handle.num_recv_tokens,
                                num_expanded_tokens=sum(counts) if sync else -1,
                                num_recv_tokens_per_expert_list=counts,
                                psum_num_recv_tokens_per_scaleup_rank=out.handle.rank_prefix_matrix[:, self.rank]
                                .to(torch.int32),
                                psum_num_recv_tokens_per_expert=torch.cumsum(out.num_recv_tokens_per_expert, 0)
                                .to(torch.int32),
                                num_unaligned_recv_tokens_per_expert=None, inner=out.handle,
                                recv_topk_idx=out.recv_topk_idx, **common)
            result = (out.recv_x, out.recv_topk_idx, out.recv_topk_weights if topk_weights is not None else None)
        if stats is not None:
            with torch.no_grad():
                if unaligned is None:
                    local = num_experts // self.num_ranks
                    ids = out.recv_topk_idx[out.recv_topk_idx >= 0]
                    unaligned = torch.bincount(ids, minlength=local)
                stats.add_(unaligned.to(stats.dtype))
        return (*result, new, EventOverlap(None))

    def _dispatch_fp8(self, data: Tensor, scales: Tensor, topk_idx: Tensor, weights: Tensor, num_experts: int,
                      alignment: int, num_worst_tokens: int, num_sms: int) -> ops.DispatchOutput:
        """The compact dispatch of an FP8 pair: `Buffer`'s (which carries the scales), no autograd; the result in
        `ops.dispatch`'s shape with ``recv_x`` the pair of rows and scales."""
        result, _ = self.buffer.dispatch_result((data, scales), topk_idx=topk_idx, topk_weights=weights.detach(),
                                                expert_alignment=alignment, num_worst_tokens=num_worst_tokens,
                                                config=Config(num_sms), num_experts=num_experts)
        host = result.num_recv_tokens_per_expert_list
        return ops.DispatchOutput((result.recv_x, result.recv_scales), result.recv_topk_idx,
                                  result.recv_topk_weights, result.num_recv_tokens_per_expert, result.handle,
                                  torch.tensor(host if host is not None and not num_worst_tokens else [],
                                               dtype=torch.int64, device="cpu"))

    def _cached_rows(self, data: Tensor, scales: Tensor | None, inner: DispatchHandle, num_sms: int):
        """A cached rank-major dispatch of ``data`` (differentiable) or of the FP8 pair (no autograd)."""
        if scales is None:
            return ops.cached_dispatch(self.buffer, data, inner, num_sms)
        return self.buffer.dispatch((data, scales), handle=inner, config=Config(num_sms))[0]

    def _cached_dispatch(self, op, data, scales, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                         expert_alignment, num_sms, handle, do_cpu_sync, do_expand):
        if not isinstance(handle, ElasticHandle):
            raise _fail(op, "handle", "the ElasticHandle of an ElasticBuffer.dispatch", type(handle).__name__)
        if topk_idx is not None:
            raise _fail(op, "topk_idx", "None in a cached dispatch (with handle)", "a tensor")
        if do_cpu_sync:
            raise _fail(op, "do_cpu_sync", "None or False in a cached dispatch (with handle)", do_cpu_sync)
        if do_expand and not handle.do_expand:
            raise _fail(op, "do_expand", "False with the handle of a compact dispatch", True)
        for name, given, recorded in (("num_experts", num_experts, handle.num_experts),
                                      ("expert_alignment", expert_alignment, handle.expert_alignment),
                                      ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                       handle.num_max_tokens_per_rank)):
            if given is not None and given != recorded:
                raise _fail(op, name, f"None or the handle's {recorded}", given)
        if data.shape[0] != handle.topk_idx.shape[0]:
            raise _fail(op, "x", f"[T={handle.topk_idx.shape[0]}, H] (the handle's dispatch)", tuple(data.shape))
        if topk_weights is not None:
            check_tensor(op, "topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2, device=data.device,
                         shape=tuple(handle.topk_idx.shape))
        check_positive_int(op, "num_sms", num_sms, 0)
        num_sms = num_sms or handle.num_sms
        if not handle.do_expand:
            recv_x = self._cached_rows(data, scales, handle.inner, num_sms)
            recv_w = None
            if topk_weights is not None:
                recv_w = ops.cached_dispatch_weights(self.buffer, topk_weights, handle.inner, num_sms)
                recv_w = torch.where(handle.recv_topk_idx >= 0, recv_w, torch.zeros_like(recv_w))
            return recv_x, handle.recv_topk_idx, recv_w, handle, EventOverlap(None)
        expert_x, expert_w = expert_cached_dispatch(self.buffer, data if scales is None else (data, scales),
                                                    handle.inner, topk_weights, num_sms)
        return expert_x, None, expert_w, handle, EventOverlap(None)

    # ---------------------------------------------------------------- combine
    def combine(self, x: Tensor, handle: ElasticHandle, topk_weights: Tensor | None = None,
                bias: Tensor | tuple | None = None, num_sms: int = 0, num_qps: int = 0, previous_event=None,
                previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False, *, expert_weights: Tensor | None = None):
        """Return the rows of the dispatch that made ``handle`` to their tokens and sum them (DeepEP V2's order).

        Args:
            x: compact: ``[N, H]``, one row per received row; expanded: ``[M, H]``, one per expanded row.
            topk_weights: compact ``[N, K]`` / expanded ``[M]`` fp32 carried back alongside and summed per
                (token, k) (not applied to ``x``, as in V2), or None. Expanded with weights needs
                ``allow_multiple_reduction=True`` (as V2).
            bias: ``[T, H]`` or a pair: the fp32 sum starts from ``bias[0] + bias[1]`` (V2's order).
            num_sms: 0: the handle's.
            num_qps, previous_event, previous_event_before_epilogue, async_with_compute_stream,
                allocate_on_comm_stream: as in `dispatch`.
            expert_weights: (ep_moe, expanded only) ``[M]`` fp32 to weight each row before the sum, or None.

        Returns:
            ``(combined_x [T, H] in x's dtype, combined_topk_weights [T, K] fp32 or None, event)``. Compact: the
            sums of `ep_moe.buffer.autograd_ops.combine`. Expanded: `ep_moe.buffer.expert_major_ops.expert_combine`
            with the buffer's ``allow_multiple_reduction``; ``combined_topk_weights[t, k]`` is the weight of the row
            of pair (t, k), 0 where ``topk_idx`` is -1.

        Raises:
            ValueError: a bad argument, named. RuntimeError: the buffer was destroyed.
        """
        op = "ElasticBuffer.combine"
        self._check_live("combine")
        if not isinstance(handle, ElasticHandle):
            raise _fail(op, "handle", "the ElasticHandle of an ElasticBuffer.dispatch", type(handle).__name__)
        check_positive_int(op, "num_sms", num_sms, 0)
        check_positive_int(op, "num_qps", num_qps, 0)
        _wait_for(previous_event, previous_event_before_epilogue)
        num_sms = num_sms or handle.num_sms
        if not handle.do_expand:
            if expert_weights is not None:
                raise _fail(op, "expert_weights", "None with the handle of a compact dispatch", "a tensor")
            combined, combined_w = ops.combine(self.buffer, x, handle.inner, topk_weights, bias, num_sms)
            return combined, combined_w, EventOverlap(None)
        inner: ExpertHandle = handle.inner
        layout = inner.layout
        check_tensor(op, "x", x, dtypes=self.buffer.backend.supported_dtypes, ndim=2, device=self.buffer.device,
                     shape=(layout.num_slots, None))
        weight_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        for name, w in (("topk_weights", topk_weights), ("expert_weights", expert_weights)):
            if w is not None:
                check_tensor(op, name, w, dtypes=(weight_dtype,), ndim=1, device=x.device, shape=(layout.num_slots,))
        if not self.allow_multiple_reduction and inner.dispatch is not None:
            if topk_weights is not None:
                raise _fail(op, "topk_weights", "None in the expanded layout with allow_multiple_reduction=False",
                            "a tensor")
            if bias is not None:
                raise _fail(op, "bias", "None in the expanded layout with allow_multiple_reduction=False",
                            "a tensor")
            combined = expert_combine(self.buffer, x, inner._replace(num_sms=num_sms), expert_weights, False)
            return combined, None, EventOverlap(None)
        rows = unpermute_sum(x, layout, expert_weights)  # per token, this rank's rows summed, rounded once
        pair_w = None
        if topk_weights is not None:  # each slot's weight back to its pair (t, k); 0 where there is none
            padded = torch.cat([topk_weights, topk_weights.new_zeros(1)])
            slot = layout.slot_of_pair
            pair_w = padded[torch.where(slot >= 0, slot, layout.num_slots)]
        if inner.dispatch is not None:
            combined, combined_w = ops.combine(self.buffer, rows, inner.dispatch, pair_w, bias, num_sms)
            return combined, combined_w, EventOverlap(None)
        biases = bias if isinstance(bias, tuple | list) else (bias, None)
        if any(b is not None for b in biases):  # the one-rank combine: the same fp32 sum (biases first), one rounding
            acc = torch.zeros(rows.shape, dtype=torch.float64 if rows.dtype == torch.float64 else torch.float32,
                              device=rows.device)
            for b in biases:
                if b is not None:
                    check_tensor(op, "bias", b, dtypes=self.buffer.backend.supported_dtypes, ndim=2,
                                 device=x.device, shape=tuple(rows.shape))
                    acc = acc + b.to(acc.dtype)
            rows = (acc + rows.to(acc.dtype)).to(x.dtype)
        return rows, pair_w, EventOverlap(None)

    # ---------------------------------------------------------------- lifecycle
    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Wait for every rank of the group (raises after ``num_gpu_timeout_secs``, naming the rank and stage).

        Args:
            use_comm_stream: accepted as V2's, ignored (the barrier is one collective of the group).
            with_cpu_sync: also synchronize the device before and after.
            sequential: accepted as V2's, ignored.

        Raises:
            RuntimeError: the buffer was destroyed.
        """
        self._check_live("barrier")
        cuda = with_cpu_sync and self.buffer.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.buffer.device)
        self.buffer.barrier()
        if cuda:
            torch.cuda.synchronize(self.buffer.device)

    def destroy(self) -> None:
        """Free the buffer's resources (required with ``explicitly_destroy=True``; idempotent).

        PP and AGRS memory first, then the backend, then the memory; the buffer is unusable afterwards.
        """
        if self._destroyed:
            return
        self._destroyed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        self._pp_release()  # the native PP / AGRS transports' symmetric buffers
        self._agrs_release()
        self.buffer.destroy()  # before the memory: the native backend's dispatch/combine memory may be its segment
        self._release_memory()

    def __repr__(self) -> str:
        return (f"ElasticBuffer(rank={self.rank}, num_ranks={self.num_ranks}, backend={self.buffer.backend_name!r}, "
                f"num_bytes={self.num_bytes}, num_cpu_bytes={self.num_cpu_bytes}, memory_type={self.memory_type!r}, "
                f"num_max_tokens_per_rank={self.num_max_tokens_per_rank})")


__all__ = ["ALIGNMENT_BYTES", "ElasticBuffer", "ElasticHandle"]
