"""The extension's expert-major torch ops that the shape-specialized JIT kernels (`ep_moe.native.jit.expert_major`)
do not cover, through the JIT layer: ``ep_moe_native::permute_received_rows``, ``unpermute_own_rows``,
``routing_map_to_topk`` and ``routing_map_to_topk_backward`` (``csrc/expert_major_ops.cpp``), with the same
arguments, checks and outputs, for an install that compiled nothing.

The kernels are the extension's own source (``csrc/expert_major.cu``, included by ``kernels/expert_major_csrc.cu``),
compiled once per architecture (generic, as the extension's); the host half of ``csrc/expert_major_ops.cpp`` (checks,
outputs, filling the parameter structs, choosing the instantiation) is done here over the ctypes mirrors of
`ep_moe.native.jit.params`, and every kernel is launched with the driver API on the current stream of the tensors'
device. Before the first launch on a device (outside a CUDA graph capture, which a read-back would break) the
module checks that the mirrors and constants equal what the compiler sees (`JitLayoutError` otherwise).

Every function takes CUDA tensors of one device and raises `ValueError` naming a bad argument before anything is
launched.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from . import KernelSource, module
from . import params as P
from .cubin import find_kernel, function_symbols
from .driver import PTR, Function
from .intranode import JitLayoutError, _read_back, probe_file

SOURCE = KernelSource.of("expert_major_csrc.cu")
_K = dict(P.EXPERT_MAJOR_CONSTANTS)
ROW_THREADS, ROWS_PER_BLOCK = _K["kRowThreads"], _K["kRowsPerBlock"]
ROW_DTYPES = {torch.bfloat16: _K["kRowBF16"], torch.float32: _K["kRowFP32"]}
TOKEN_THREADS = 128  # routing_map_to_topk's launch_per_token: one thread per token

# The kernels' mangled-name fragments (cubin.find_kernel): the instantiations kernels/expert_major_csrc.cu makes.
PERMUTE_KERNELS = {16: "19permute_rows_kernelI5uint4EE", 4: "19permute_rows_kernelIjEE",
                   2: "19permute_rows_kernelItEE", 1: "19permute_rows_kernelIhEE"}  # by word bytes
UNPERMUTE_KERNELS = {(torch.bfloat16, 8): "20unpermute_sum_kernelI13__nv_bfloat16Li8EEE",
                     (torch.bfloat16, 1): "20unpermute_sum_kernelI13__nv_bfloat16Li1EEE",
                     (torch.float32, 4): "20unpermute_sum_kernelIfLi4EEE",
                     (torch.float32, 1): "20unpermute_sum_kernelIfLi1EEE"}  # by (dtype, elements per pack)
ROUTING_KERNELS = {torch.bfloat16: "26routing_map_to_topk_kernelI13__nv_bfloat16EE",
                   torch.float32: "26routing_map_to_topk_kernelIfEE"}
ROUTING_BACKWARD_KERNELS = {torch.bfloat16: "35routing_map_to_topk_backward_kernelI13__nv_bfloat16EE",
                            torch.float32: "35routing_map_to_topk_backward_kernelIfEE"}
KERNELS: dict[str, str] = {
    **{f"permute_{w}": f for w, f in PERMUTE_KERNELS.items()},
    **{f"unpermute_{str(d).split('.')[-1]}_{v}": f for (d, v), f in UNPERMUTE_KERNELS.items()},
    **{f"routing_{str(d).split('.')[-1]}": f for d, f in ROUTING_KERNELS.items()},
    **{f"routing_backward_{str(d).split('.')[-1]}": f for d, f in ROUTING_BACKWARD_KERNELS.items()},
}

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)


def probe_source() -> str:
    """The layout probe of expert_major.h's mirrored structs (`params.probe_source`)."""
    return P.probe_source(P.EXPERT_MAJOR_MIRRORED, header=P.EXPERT_MAJOR_H)


def specializations() -> list[KernelSource]:
    """What these kernels compile (one generic build per architecture, and their layout probe)."""
    return [SOURCE, KernelSource.of(probe_file(text=probe_source()))]


class _Kernels:
    """The kernels loaded on one device; ``checked`` once the mirrors and constants were compared with the
    compiler's (`check`)."""

    def __init__(self, device: int) -> None:
        self.device = device
        loaded = self.loaded = module(SOURCE, device)
        symbols = function_symbols(loaded._cubin)
        self.fn: dict[str, Function] = {fragment: loaded.function(find_kernel(symbols, fragment), ())
                                        for fragment in KERNELS.values()}
        self.checked = False

    def check(self) -> None:
        """Compare the mirrors and constants with the compiled sources' (a read-back: not during a capture)."""
        with torch.cuda.device(self.device):
            constants = _read_back(self.loaded.function("ep_expert_major_constants", (PTR,)),
                                   len(P.EXPERT_MAJOR_CONSTANTS), self.device)
            probe = module(KernelSource.of(probe_file(text=probe_source())), self.device)
            layout = _read_back(probe.function("ep_params_layout", (PTR,)),
                                len(P.layout_of(P.EXPERT_MAJOR_MIRRORED)), self.device)
        wrong = (P.constant_mismatches(constants, P.EXPERT_MAJOR_CONSTANTS)
                 + P.layout_mismatches(layout, P.EXPERT_MAJOR_MIRRORED))
        if wrong:
            raise JitLayoutError("ep_moe.native.jit: the parameter mirrors (ep_moe/native/jit/params.py) do not match "
                                 "csrc/expert_major.h; add the new fields to the mirror in the header's order:\n  "
                                 + "\n  ".join(wrong))
        self.checked = True


_kernels: dict[int, _Kernels] = {}
_lock = threading.Lock()


def kernels(device: int) -> _Kernels:
    """The kernels on ``device`` (compiled or read from the cache and loaded at first use; checked at the first use
    outside a CUDA graph capture)."""
    found = _kernels.get(device)
    if found is None:
        with _lock:
            found = _kernels.get(device)
            if found is None:
                found = _kernels[device] = _Kernels(device)
    if not found.checked and not torch.cuda.is_current_stream_capturing():
        with _lock:
            if not found.checked:
                found.check()
    return found


def _launch(device: int, fragment: str, grid: int, block: int, params) -> None:
    kernels(device).fn[fragment].launch_params(grid, block, _raw_stream(device), params)


# ------------------------------------------------------------------------------------------ checks
def _fail(op: str, message: str) -> ValueError:
    return ValueError(f"ep_moe.native.jit.{op}: {message}")


def _check(t: Tensor, op: str, name: str, device: torch.device) -> None:
    if not t.is_cuda or t.device != device:
        raise _fail(op, f"argument '{name}' must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise _fail(op, f"argument '{name}' must be contiguous")


def _dtype(t: Tensor, dtype: torch.dtype, op: str, name: str) -> None:
    if t.dtype != dtype:
        raise _fail(op, f"argument '{name}' must be {dtype}, got {t.dtype}")


def _row_dtype(dtype: torch.dtype, op: str, name: str) -> int:
    found = ROW_DTYPES.get(dtype)
    if found is None:
        raise _fail(op, f"argument '{name}' must be bfloat16 or float32, got {dtype}")
    return found


def _device_index(t: Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def word_bytes(row_bytes: int, *addresses: int) -> int:
    """The widest of 16/4/2/1 bytes dividing ``row_bytes`` and every address (0 for a null one): the permute's
    instantiation (``by_word`` of csrc/expert_major.cu)."""
    for word in (16, 4, 2):
        if row_bytes % word == 0 and all(a % word == 0 for a in addresses):
            return word
    return 1


def pack_elements(element_size: int, hidden: int, *addresses: int) -> int:
    """Elements per 16-byte pack when ``hidden`` and every (non-null) address allow it, else 1 (``by_pack``)."""
    vec = 16 // element_size
    return vec if hidden % vec == 0 and all(a % 16 == 0 for a in addresses) else 1


def _own_range_check(op: str, rank_prefix_matrix: Tensor, rank: int) -> int:
    num_ranks = rank_prefix_matrix.shape[0] if rank_prefix_matrix.dim() >= 1 else 0
    if rank_prefix_matrix.dim() != 2 or rank_prefix_matrix.shape[1] != num_ranks or not 0 <= rank < num_ranks:
        raise _fail(op, "argument 'rank_prefix_matrix' must be [R, R] with 0 <= rank < R")
    return num_ranks


# ------------------------------------------------------------------------------------------ the ops
def permute_received_rows(rows: Tensor, num_rows: int, own_x: Tensor, own_tokens: Tensor, rank_prefix_matrix: Tensor,
                          rank: int, pair_of_slot: Tensor, num_topk: int, values: Tensor | None
                          ) -> tuple[Tensor, Tensor]:
    """``ep_moe_native::permute_received_rows``: ``(out [M, H] of rows' dtype, slot_values [M] fp32, empty without
    values)``; received row i is ``own_x[own_tokens[i - first]]`` inside this rank's own range of
    ``rank_prefix_matrix [R, R]`` int32 (read on the device), else ``rows[i]``. ``rows [>= num_rows, H]`` and
    ``own_x [T, H]`` of one dtype, ``own_tokens [T]`` int32, ``pair_of_slot [M]`` int64, ``values [num_rows * K]``
    fp32 or None."""
    op = "permute_received_rows"
    if rows.dim() != 2 or own_x.dim() != 2 or rows.shape[1] != own_x.shape[1] or rows.dtype != own_x.dtype:
        raise _fail(op, f"arguments 'rows' and 'own_x' must be [*, H] of one dtype, got {tuple(rows.shape)} "
                        f"{rows.dtype} and {tuple(own_x.shape)} {own_x.dtype}")
    if not 0 <= num_rows <= rows.shape[0]:
        raise _fail(op, f"argument 'num_rows' must be in [0, {rows.shape[0]}] (the buffer's rows), got {num_rows}")
    if num_topk < 1:
        raise _fail(op, f"argument 'num_topk' must be >= 1, got {num_topk}")
    device = rows.device
    for t, name in ((rows, "rows"), (own_x, "own_x"), (own_tokens, "own_tokens"),
                    (rank_prefix_matrix, "rank_prefix_matrix"), (pair_of_slot, "pair_of_slot")):
        _check(t, op, name, device)
    _dtype(own_tokens, torch.int32, op, "own_tokens")
    _dtype(rank_prefix_matrix, torch.int32, op, "rank_prefix_matrix")
    _dtype(pair_of_slot, torch.int64, op, "pair_of_slot")
    num_ranks = _own_range_check(op, rank_prefix_matrix, rank)
    if own_tokens.numel() != own_x.shape[0]:
        raise _fail(op, f"argument 'own_tokens' must have a token per row of own_x ({own_x.shape[0]}), got "
                        f"{own_tokens.numel()}")
    slots = pair_of_slot.numel()
    out = rows.new_empty((slots, rows.shape[1]))
    p = P.PermuteRowsParams()
    if values is not None:
        _check(values, op, "values", device)
        _dtype(values, torch.float32, op, "values")
        if values.numel() != num_rows * num_topk:
            raise _fail(op, f"argument 'values' must have N * K = {num_rows * num_topk} elements, got {values.numel()}")
        slot_values = rows.new_empty(slots, dtype=torch.float32)
        p.values, p.slot_values = values.data_ptr(), slot_values.data_ptr()
    else:
        slot_values = rows.new_empty(0, dtype=torch.float32)
    row_bytes = rows.shape[1] * rows.element_size()
    p.x, p.out, p.row_bytes = rows.data_ptr(), out.data_ptr(), row_bytes
    p.pair_of_slot, p.num_slots, p.num_pairs, p.num_topk = pair_of_slot.data_ptr(), slots, num_rows * num_topk, num_topk
    p.own_x, p.own_tokens, p.rank_prefix_matrix = own_x.data_ptr(), own_tokens.data_ptr(), rank_prefix_matrix.data_ptr()
    p.num_ranks, p.rank, p.num_own_rows = num_ranks, rank, own_x.shape[0]
    if slots > 0 and (row_bytes > 0 or values is not None):
        word = word_bytes(row_bytes, p.x, p.out, p.own_x)
        _launch(_device_index(rows), PERMUTE_KERNELS[word], _blocks(slots, ROWS_PER_BLOCK), ROW_THREADS, p)
    return out, slot_values


def unpermute_own_rows(y: Tensor, weights: Tensor | None, sorted_slots: Tensor, rank_prefix_matrix: Tensor,
                       rank: int) -> Tensor:
    """``ep_moe_native::unpermute_own_rows``: ``out [N, H]`` of y's dtype whose rows in this rank's own range of
    ``rank_prefix_matrix [R, R]`` int32 (read on the device) are `unpermute_sum`'s rows (the fp32 sum over each
    row's slots in order, weighted by ``weights [M]`` fp32 when given, rounded once); the other rows are left
    unwritten. ``y [M, H]`` bf16/fp32, ``sorted_slots [N, K]`` int64."""
    op = "unpermute_own_rows"
    if y.dim() != 2 or sorted_slots.dim() != 2:
        raise _fail(op, "arguments 'y' and 'sorted_slots' must be [M, H] and [N, K]")
    device = y.device
    for t, name in ((y, "y"), (sorted_slots, "sorted_slots"), (rank_prefix_matrix, "rank_prefix_matrix")):
        _check(t, op, name, device)
    _dtype(sorted_slots, torch.int64, op, "sorted_slots")
    _dtype(rank_prefix_matrix, torch.int32, op, "rank_prefix_matrix")
    num_ranks = _own_range_check(op, rank_prefix_matrix, rank)
    (rows, topk), (slots, hidden) = sorted_slots.shape, y.shape
    p = P.UnpermuteSumParams()
    p.dtype = _row_dtype(y.dtype, op, "y")
    if weights is not None:
        _check(weights, op, "weights", device)
        _dtype(weights, torch.float32, op, "weights")
        if weights.numel() != slots:
            raise _fail(op, f"argument 'weights' must be [M={slots}]")
        p.weights = weights.data_ptr()
    out = y.new_empty((rows, hidden))
    p.y, p.out, p.hidden, p.num_rows, p.num_slots, p.num_topk = y.data_ptr(), out.data_ptr(), hidden, rows, slots, topk
    p.sorted_slots = sorted_slots.data_ptr()
    p.rank_prefix_matrix, p.num_ranks, p.rank = rank_prefix_matrix.data_ptr(), num_ranks, rank
    if rows > 0:
        vec = pack_elements(y.element_size(), hidden, p.y, p.out)
        _launch(_device_index(y), UNPERMUTE_KERNELS[(y.dtype, vec)], _blocks(rows, ROWS_PER_BLOCK), ROW_THREADS, p)
    return out


def routing_map_to_topk(routing_map: Tensor, probs: Tensor, num_topk: int) -> tuple[Tensor, Tensor]:
    """``ep_moe_native::routing_map_to_topk``: ``(topk_idx [T, K] int64: each token's first K selected experts in
    increasing id, then -1; topk_weights [T, K] fp32: their probs, 0 for -1)``. ``routing_map [T, E]`` bool,
    ``probs [T, E]`` bf16/fp32."""
    op = "routing_map_to_topk"
    if routing_map.dim() != 2 or probs.shape != routing_map.shape:
        raise _fail(op, "'routing_map' and 'probs' must be [T, E] of one shape")
    if num_topk < 1:
        raise _fail(op, f"argument 'num_topk' must be >= 1, got {num_topk}")
    device = routing_map.device
    _check(routing_map, op, "routing_map", device)
    _check(probs, op, "probs", device)
    _dtype(routing_map, torch.bool, op, "routing_map")
    p = P.RoutingMapParams()
    p.probs_dtype = _row_dtype(probs.dtype, op, "probs")
    tokens, experts = routing_map.shape
    idx = routing_map.new_empty((tokens, num_topk), dtype=torch.int64)
    weights = routing_map.new_empty((tokens, num_topk), dtype=torch.float32)
    p.routing_map, p.probs, p.num_tokens, p.num_experts, p.num_topk = (routing_map.data_ptr(), probs.data_ptr(), tokens,
                                                                       experts, num_topk)
    p.topk_idx, p.topk_weights = idx.data_ptr(), weights.data_ptr()
    if tokens > 0:
        _launch(_device_index(routing_map), ROUTING_KERNELS[probs.dtype], _blocks(tokens, TOKEN_THREADS),
                TOKEN_THREADS, p)
    return idx, weights


def routing_map_to_topk_backward(grad_weights: Tensor, topk_idx: Tensor, num_experts: int, dtype: torch.dtype
                                 ) -> Tensor:
    """``ep_moe_native::routing_map_to_topk_backward``: ``grad_probs [T, E]`` of ``dtype`` (bf16/fp32): each
    ``grad_weights [T, K]`` fp32 value (plus 0, rounded to ``dtype``) at its expert ``topk_idx [T, K]`` int64, 0
    elsewhere."""
    op = "routing_map_to_topk_backward"
    if grad_weights.dim() != 2 or topk_idx.shape != grad_weights.shape or num_experts < 1:
        raise _fail(op, "'grad_weights' and 'topk_idx' must be [T, K] of one shape, and num_experts >= 1")
    device = topk_idx.device
    _check(grad_weights, op, "grad_weights", device)
    _check(topk_idx, op, "topk_idx", device)
    _dtype(grad_weights, torch.float32, op, "grad_weights")
    _dtype(topk_idx, torch.int64, op, "topk_idx")
    p = P.RoutingMapParams()
    p.probs_dtype = _row_dtype(dtype, op, "dtype")
    tokens, topk = topk_idx.shape
    grad = topk_idx.new_empty((tokens, num_experts), dtype=dtype)
    p.num_tokens, p.num_experts, p.num_topk = tokens, num_experts, topk
    p.topk_idx, p.topk_weights, p.grad_probs = topk_idx.data_ptr(), grad_weights.data_ptr(), grad.data_ptr()
    if tokens > 0:
        _launch(_device_index(topk_idx), ROUTING_BACKWARD_KERNELS[dtype], _blocks(tokens, TOKEN_THREADS),
                TOKEN_THREADS, p)
    return grad


__all__ = ["KERNELS", "SOURCE", "kernels", "pack_elements", "permute_received_rows", "probe_source",
           "routing_map_to_topk", "routing_map_to_topk_backward", "specializations", "unpermute_own_rows",
           "word_bytes"]
