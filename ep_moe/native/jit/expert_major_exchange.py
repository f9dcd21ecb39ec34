"""The expert-major ops of the exchange (the dispatch and combine kernels), generic in the shape where the
shape-specialized JIT kernels (`ep_moe.native.jit.expert_major`) are not: `permute_received_rows` (the permute of
received rows left in place), `unpermute_own_rows` (the own rows of an expert-major combine), `routing_map_to_topk`
and `routing_map_to_topk_backward` (Megatron's dense routing map to top-k form and back).

The kernels are ``kernels/expert_major_kernels.cuh`` (included by ``kernels/expert_major_exchange.cu``), compiled
once per architecture (generic in the shape); the host half (checks, outputs, filling the parameter structs,
choosing the instantiation) is done here over the ctypes mirrors of `ep_moe.native.jit.params`, and every kernel is
launched with the driver API on the current stream of the tensors' device. Before the first launch on a device
(outside a CUDA graph capture, which a read-back would break) the module checks that the mirrors and constants equal
what the compiler sees (`JitLayoutError` otherwise).

Every function takes CUDA tensors of one device and raises `ValueError` naming a bad argument before anything is
launched.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from . import KernelSource, PerDevice, module
from . import params as P
from .cubin import find_kernel, function_symbols
from .driver import PTR, Function, prepared_args
from .expert_major import widest_word
from .launch_args import check_on, check_typed, device_index, fail, raw_stream
from .layout_probe import JitLayoutError, probe_file, read_back

SOURCE = KernelSource.of("expert_major_exchange.cu")
_K = dict(P.EXPERT_MAJOR_CONSTANTS)
ROW_THREADS, ROWS_PER_BLOCK = _K["kRowThreads"], _K["kRowsPerBlock"]
ROW_DTYPES = {torch.bfloat16: _K["kRowBF16"], torch.float32: _K["kRowFP32"]}
TOKEN_THREADS = 128  # routing_map_to_topk's blocks: one thread per token

# The kernels' mangled-name fragments (cubin.find_kernel): the instantiations kernels/expert_major_exchange.cu makes.
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
            constants = read_back(self.loaded.function("ep_expert_major_constants", (PTR,)),
                                  len(P.EXPERT_MAJOR_CONSTANTS), self.device)
            probe = module(KernelSource.of(probe_file(text=probe_source())), self.device)
            layout = read_back(probe.function("ep_params_layout", (PTR,)),
                               len(P.layout_of(P.EXPERT_MAJOR_MIRRORED)), self.device)
        wrong = (P.constant_mismatches(constants, P.EXPERT_MAJOR_CONSTANTS)
                 + P.layout_mismatches(layout, P.EXPERT_MAJOR_MIRRORED))
        if wrong:
            raise JitLayoutError("ep_moe.native.jit: the parameter mirrors (ep_moe/native/jit/params.py) do not match "
                                 "ep_moe/native/kernels/expert_major.h; add the new fields to the mirror in the "
                                 "header's order:\n  "
                                 + "\n  ".join(wrong))
        self.checked = True


_kernels: PerDevice = PerDevice(_Kernels)
_check_lock = threading.Lock()


def kernels(device: int) -> _Kernels:
    """The kernels on ``device`` (compiled or read from the cache and loaded at first use; checked at the first use
    outside a CUDA graph capture)."""
    found = _kernels.of(device)
    if not found.checked and not torch.cuda.is_current_stream_capturing():
        with _check_lock:
            if not found.checked:
                found.check()
    return found


class _Prepared:
    """One parameter struct per op for the process, refilled by one `params.FieldWriter` pack (every field, so
    nothing of an earlier call survives) and launched through a pointer array built once; the driver copies the
    arguments during cuLaunchKernel, and the lock keeps two threads from filling it at the same time."""

    __slots__ = ("params", "view", "args", "lock", "fields")

    def __init__(self, struct_type: type[P.Params]) -> None:
        self.params = struct_type()
        self.view = memoryview(self.params).cast("B")
        self.args = prepared_args(self.params)
        self.lock = threading.Lock()
        self.fields = P.FieldWriter(struct_type, struct_type.field_names())


_PERMUTE = _Prepared(P.PermuteRowsParams)
_UNPERMUTE = _Prepared(P.UnpermuteSumParams)
_ROUTING = _Prepared(P.RoutingMapParams)
_ROUTING_BACKWARD = _Prepared(P.RoutingMapParams)


def _launch(device: int, fragment: str, grid: int, block: int, prepared: _Prepared) -> None:
    """Kernel ``fragment`` on ``device``'s current stream with ``prepared``'s struct (call under its lock)."""
    kernels(device).fn[fragment].launch_prepared(grid, block, raw_stream(device), prepared.args)


# ------------------------------------------------------------------------------------------ checks
_INT32, _INT64, _FLOAT32, _BOOL = torch.int32, torch.int64, torch.float32, torch.bool


def _row_dtype(dtype: torch.dtype, op: str, name: str) -> int:
    found = ROW_DTYPES.get(dtype)
    if found is None:
        raise fail(f"argument '{name}' must be bfloat16 or float32, got {dtype}", op)
    return found


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def _own_range_check(op: str, rank_prefix_matrix: Tensor, rank: int) -> int:
    shape = rank_prefix_matrix.shape
    if len(shape) != 2 or shape[1] != shape[0] or not 0 <= rank < shape[0]:
        raise fail("argument 'rank_prefix_matrix' must be [R, R] with 0 <= rank < R", op)
    return shape[0]


# ------------------------------------------------------------------------------------------ the ops
def permute_received_rows(rows: Tensor, num_rows: int, own_x: Tensor, own_tokens: Tensor, rank_prefix_matrix: Tensor,
                          rank: int, pair_of_slot: Tensor, num_topk: int, values: Tensor | None
                          ) -> tuple[Tensor, Tensor]:
    """`ep_moe.permute.permute_received_rows` on CUDA: ``(out [M, H] of rows' dtype, slot_values [M] fp32, empty without
    values)``; received row i is ``own_x[own_tokens[i - first]]`` inside this rank's own range of
    ``rank_prefix_matrix [R, R]`` int32 (read on the device), else ``rows[i]``. ``rows [>= num_rows, H]`` and
    ``own_x [T, H]`` of one dtype, ``own_tokens [T]`` int32, ``pair_of_slot [M]`` int64, ``values [num_rows * K]``
    fp32 or None."""
    op = "permute_received_rows"
    rows_shape, own_shape = rows.shape, own_x.shape
    if len(rows_shape) != 2 or len(own_shape) != 2 or rows_shape[1] != own_shape[1] or rows.dtype != own_x.dtype:
        raise fail(f"arguments 'rows' and 'own_x' must be [*, H] of one dtype, got {tuple(rows_shape)} "
                   f"{rows.dtype} and {tuple(own_shape)} {own_x.dtype}", op)
    if not 0 <= num_rows <= rows_shape[0]:
        raise fail(f"argument 'num_rows' must be in [0, {rows_shape[0]}] (the buffer's rows), got "
                   f"{num_rows}", op)
    if num_topk < 1:
        raise fail(f"argument 'num_topk' must be >= 1, got {num_topk}", op)
    device = device_index(rows)
    check_on(rows, op, "rows", device)
    check_on(own_x, op, "own_x", device)
    check_typed(own_tokens, _INT32, op, "own_tokens", device)
    check_typed(rank_prefix_matrix, _INT32, op, "rank_prefix_matrix", device)
    check_typed(pair_of_slot, _INT64, op, "pair_of_slot", device)
    num_ranks = _own_range_check(op, rank_prefix_matrix, rank)
    if own_tokens.numel() != own_shape[0]:
        raise fail(f"argument 'own_tokens' must have a token per row of own_x ({own_shape[0]}), got "
                   f"{own_tokens.numel()}", op)
    if values is not None:
        check_typed(values, _FLOAT32, op, "values", device)
        if values.numel() != num_rows * num_topk:
            raise fail(f"argument 'values' must have N * K = {num_rows * num_topk} elements, got "
                       f"{values.numel()}", op)
    slots = pair_of_slot.numel()
    out = rows.new_empty((slots, rows_shape[1]))
    slot_values = rows.new_empty(slots if values is not None else 0, dtype=_FLOAT32)
    row_bytes = rows_shape[1] * rows.element_size()
    if slots > 0 and (row_bytes > 0 or values is not None):
        x_ptr, out_ptr, own_ptr = rows.data_ptr(), out.data_ptr(), own_x.data_ptr()
        values_ptr, slot_values_ptr = (0, 0) if values is None else (values.data_ptr(), slot_values.data_ptr())
        word = widest_word(row_bytes | x_ptr | out_ptr | own_ptr)  # permute_rows_kernel<Word>'s instantiation
        with _PERMUTE.lock:
            _PERMUTE.fields.write(_PERMUTE.view, x_ptr, out_ptr, row_bytes, pair_of_slot.data_ptr(), slots,
                                  num_rows * num_topk, num_topk, values_ptr, slot_values_ptr, own_ptr,
                                  own_tokens.data_ptr(), rank_prefix_matrix.data_ptr(), num_ranks, rank, own_shape[0])
            _launch(device, PERMUTE_KERNELS[word], _blocks(slots, ROWS_PER_BLOCK), ROW_THREADS, _PERMUTE)
    return out, slot_values


def unpermute_own_rows(y: Tensor, weights: Tensor | None, sorted_slots: Tensor, rank_prefix_matrix: Tensor,
                       rank: int) -> Tensor:
    """The own rows of an expert-major combine: ``out [N, H]`` of y's dtype whose rows in this rank's own range of
    ``rank_prefix_matrix [R, R]`` int32 (read on the device) are `unpermute_sum`'s rows (the fp32 sum over each
    row's slots in order, weighted by ``weights [M]`` fp32 when given, rounded once); the other rows are left
    unwritten. ``y [M, H]`` bf16/fp32, ``sorted_slots [N, K]`` int64."""
    op = "unpermute_own_rows"
    y_shape, slots_shape = y.shape, sorted_slots.shape
    if len(y_shape) != 2 or len(slots_shape) != 2:
        raise fail("arguments 'y' and 'sorted_slots' must be [M, H] and [N, K]", op)
    device = device_index(y)
    check_on(y, op, "y", device)
    check_typed(sorted_slots, _INT64, op, "sorted_slots", device)
    check_typed(rank_prefix_matrix, _INT32, op, "rank_prefix_matrix", device)
    num_ranks = _own_range_check(op, rank_prefix_matrix, rank)
    (rows, topk), (slots, hidden) = slots_shape, y_shape
    dtype = _row_dtype(y.dtype, op, "y")
    weights_ptr = 0
    if weights is not None:
        check_typed(weights, _FLOAT32, op, "weights", device)
        if weights.numel() != slots:
            raise fail(f"argument 'weights' must be [M={slots}]", op)
        weights_ptr = weights.data_ptr()
    out = y.new_empty((rows, hidden))
    if rows > 0:
        y_ptr, out_ptr = y.data_ptr(), out.data_ptr()
        vec = 16 // y.element_size()  # elements per 16-byte pack (`expert_major.pack_elements`, of the addresses)
        if hidden % vec or (y_ptr | out_ptr) & 15:
            vec = 1
        with _UNPERMUTE.lock:
            _UNPERMUTE.fields.write(_UNPERMUTE.view, y_ptr, out_ptr, dtype, hidden, rows, slots, topk, weights_ptr,
                                    sorted_slots.data_ptr(), 0, 0, 0, rank_prefix_matrix.data_ptr(), num_ranks, rank)
            _launch(device, UNPERMUTE_KERNELS[(y.dtype, vec)], _blocks(rows, ROWS_PER_BLOCK), ROW_THREADS, _UNPERMUTE)
    return out


def routing_map_to_topk(routing_map: Tensor, probs: Tensor, num_topk: int) -> tuple[Tensor, Tensor]:
    """Dense routing to top-k form: ``(topk_idx [T, K] int64: each token's first K selected experts in
    increasing id, then -1; topk_weights [T, K] fp32: their probs, 0 for -1)``. ``routing_map [T, E]`` bool,
    ``probs [T, E]`` bf16/fp32."""
    op = "routing_map_to_topk"
    shape = routing_map.shape
    if len(shape) != 2 or probs.shape != shape:
        raise fail("'routing_map' and 'probs' must be [T, E] of one shape", op)
    if num_topk < 1:
        raise fail(f"argument 'num_topk' must be >= 1, got {num_topk}", op)
    device = device_index(routing_map)
    check_typed(routing_map, _BOOL, op, "routing_map", device)
    check_on(probs, op, "probs", device)
    probs_dtype = _row_dtype(probs.dtype, op, "probs")
    tokens, experts = shape
    idx = routing_map.new_empty((tokens, num_topk), dtype=_INT64)
    weights = routing_map.new_empty((tokens, num_topk), dtype=_FLOAT32)
    if tokens > 0:
        with _ROUTING.lock:
            _ROUTING.fields.write(_ROUTING.view, routing_map.data_ptr(), probs.data_ptr(), probs_dtype, tokens, experts,
                                  num_topk, idx.data_ptr(), weights.data_ptr(), 0)
            _launch(device, ROUTING_KERNELS[probs.dtype], _blocks(tokens, TOKEN_THREADS), TOKEN_THREADS, _ROUTING)
    return idx, weights


def routing_map_to_topk_backward(grad_weights: Tensor, topk_idx: Tensor, num_experts: int, dtype: torch.dtype
                                 ) -> Tensor:
    """The gradient of `routing_map_to_topk`: ``grad_probs [T, E]`` of ``dtype`` (bf16/fp32): each
    ``grad_weights [T, K]`` fp32 value (plus 0, rounded to ``dtype``) at its expert ``topk_idx [T, K]`` int64, 0
    elsewhere."""
    op = "routing_map_to_topk_backward"
    shape = topk_idx.shape
    if grad_weights.dim() != 2 or shape != grad_weights.shape or num_experts < 1:
        raise fail("'grad_weights' and 'topk_idx' must be [T, K] of one shape, and num_experts >= 1", op)
    device = device_index(topk_idx)
    check_typed(grad_weights, _FLOAT32, op, "grad_weights", device)
    check_typed(topk_idx, _INT64, op, "topk_idx", device)
    probs_dtype = _row_dtype(dtype, op, "dtype")
    tokens, topk = shape
    grad = topk_idx.new_empty((tokens, num_experts), dtype=dtype)
    if tokens > 0:
        with _ROUTING_BACKWARD.lock:
            _ROUTING_BACKWARD.fields.write(_ROUTING_BACKWARD.view, 0, 0, probs_dtype, tokens, num_experts, topk,
                                           topk_idx.data_ptr(), grad_weights.data_ptr(), grad.data_ptr())
            _launch(device, ROUTING_BACKWARD_KERNELS[dtype], _blocks(tokens, TOKEN_THREADS), TOKEN_THREADS,
                    _ROUTING_BACKWARD)
    return grad


__all__ = ["KERNELS", "SOURCE", "kernels", "permute_received_rows", "probe_source", "routing_map_to_topk",
           "routing_map_to_topk_backward", "specializations", "unpermute_own_rows"]
