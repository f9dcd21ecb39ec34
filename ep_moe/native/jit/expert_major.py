"""The single-rank expert-major kernels (layout, permute, weighted reduce and its gradients) as JIT kernels, the
CUDA implementation of `ep_moe.permute`'s contract, with the sources in ``kernels/`` specialized per call on the
row width (in words or 16-byte packs), the top-k, the expert count and which optional outputs are wanted.

Every function takes contiguous CUDA tensors of one device (``ep_moe.permute`` checks shapes and dtypes
before it calls), allocates its outputs and launches on that device's current stream; the first call of a
specialization compiles (or reads the disk cache), later ones cost a dict lookup and the launch.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import KernelSource, module
from .driver import I32, I64, PTR, DriverError, Function, memset_zero_async
from .launch_args import device_index, fail, raw_stream

MAX_EXPERTS = 1024      # the layout's shared-memory counters (EP_EXPERTS)
LAYOUT_TILE = 256       # pairs per sub-tile = threads of a layout block
LAYOUT_MAX_BLOCKS = 256  # read at every call (a GPU test lowers it: blocks then take several sub-tiles)
ROWS_PER_BLOCK = 8      # the permute and backward kernels: one warp per slot, 256 threads
ROW_DTYPES = {torch.bfloat16: 0, torch.float32: 1}

_LAYOUT_SIG = (PTR, I64, I64, I64, I64, I32, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32)
_PERMUTE_SIG = (PTR, PTR, PTR, I64, I64, PTR, PTR)
_UNPERMUTE_SIG = (PTR, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR)
_BACKWARD_SIG = (PTR, PTR, PTR, PTR, I64, I64, PTR, PTR)

_functions: dict[tuple, Function] = {}


def _function(file: str, defines: tuple[tuple[str, int], ...], name: str, signature: tuple, device: int) -> Function:
    """The kernel ``name`` of ``file`` specialized by ``defines`` on ``device`` (built and loaded at first use)."""
    key = (file, defines, name, device)
    found = _functions.get(key)
    if found is None:
        found = _functions[key] = module(KernelSource.of(file, dict(defines)), device).function(name, signature)
    return found


def _on(device: int):
    """Make ``device`` current for the launches (the driver launches in the current context)."""
    return contextlib.nullcontext() if torch.cuda.current_device() == device else torch.cuda.device(device)


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def widest_word(bits: int) -> int:
    """The widest of 16/4/2/1 bytes dividing ``bits``, the bitwise OR of a row's bytes and its addresses (a power of
    two divides each of some non-negative numbers exactly when it divides their OR)."""
    return 16 if not bits & 15 else 4 if not bits & 3 else 2 if not bits & 1 else 1


def row_word_bytes(row_bytes: int, *tensors: Tensor) -> int:
    """The widest of 16/4/2/1 bytes dividing ``row_bytes`` and every tensor's address (`widest_word`)."""
    for t in tensors:
        row_bytes |= t.data_ptr()
    return widest_word(row_bytes)


def pack_elements(element_size: int, hidden: int, *tensors: Tensor | None) -> int:
    """Elements per 16-byte pack when ``hidden`` and every address allow it, else 1."""
    vec = 16 // element_size
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.data_ptr()
    return vec if hidden % vec == 0 and bits % 16 == 0 else 1


# ------------------------------------------------------------------------------------------ layout
_LAYOUT_KERNELS = ("ep_expert_layout", "ep_expert_count", "ep_expert_scan", "ep_expert_assign", "ep_expert_sort_rows")
PHASE_COUNT, PHASE_PLACE = 1, 2  # ep_expert_layout's phases (count and scan; assign and sort), as bits
PHASE_ALL = PHASE_COUNT | PHASE_PLACE
SCAN_THREADS = 1024  # ep_expert_scan's one block (the plain kernels only)
_NO_HOST = torch.empty(0, dtype=torch.int64, device="cpu")  # the host counts where none are read (never written: empty)


class _LayoutKernels:
    """One specialization's layout kernels on one device: ``ep_expert_layout`` (cooperative) and the four plain
    ones, with the most blocks the device holds at once of the first (a cooperative launch's limit)."""

    __slots__ = ("fused", "count", "scan", "assign", "sort_rows", "topk", "device", "resident")

    def __init__(self, functions: list[Function], topk: int, device: int, resident: int) -> None:
        self.fused, self.count, self.scan, self.assign, self.sort_rows = functions
        self.topk, self.device, self.resident = topk, device, resident

    def cooperative(self, phase: int, num_blocks: int, stream: int, args: tuple) -> None:
        """``phase`` of the layout in one cooperative launch of ``num_blocks`` blocks; before the count phase, the
        grid barrier's two words (``args[13]``, the call's own: never shared with a layout on another stream)
        are zeroed on the stream (the barrier leaves its count at 0, so the place phase needs no second memset)."""
        if phase & PHASE_COUNT:
            memset_zero_async(args[13], 2, stream, self.device)
        self.fused.launch_cooperative(num_blocks, LAYOUT_TILE, stream, *args, phase)

    def separately(self, phase: int, num_blocks: int, stream: int, args: tuple) -> None:
        """``phase`` of the layout as plain launches of the four kernels: the same phase functions without the grid
        barrier (the tests' check of the cooperative kernel against them)."""
        if phase & PHASE_COUNT:
            self.count.launch(num_blocks, LAYOUT_TILE, stream, *args, phase)
            self.scan.launch(1, SCAN_THREADS, stream, *args, phase)
        if phase & PHASE_PLACE:
            self.assign.launch(num_blocks, LAYOUT_TILE, stream, *args, phase)
            rows = args[1] // self.topk  # num_pairs // K
            self.sort_rows.launch(max(_blocks(rows, 256), 1), 256, stream, *args, phase)


def _resident_blocks(fused: Function, device: int) -> int:
    """How many blocks of ``fused`` (256 threads, static shared memory only) ``device`` holds at once."""
    resident = fused.max_active_blocks(LAYOUT_TILE) * torch.cuda.get_device_properties(device).multi_processor_count
    if resident < 1:
        raise DriverError(f"jit: {fused.name} fits no block on device {device} (occupancy 0): no cooperative launch")
    return resident


_layout: dict[tuple[int, int, int], _LayoutKernels] = {}


def _layout_functions(experts: int, topk: int, device: int) -> _LayoutKernels:
    """The layout's kernels of one specialization (looked up, and the occupancy queried, once)."""
    found = _layout.get((experts, topk, device))
    if found is None:
        defines = (("EP_EXPERTS", experts), ("EP_TOPK", topk))
        functions = [_function("expert_layout.cu", defines, name, _LAYOUT_SIG, device) for name in _LAYOUT_KERNELS]
        found = _layout[(experts, topk, device)] = _LayoutKernels(functions, topk, device,
                                                                   _resident_blocks(functions[0], device))
    return found


def expert_layout(topk_idx: Tensor, num_experts: int, alignment: int, num_slots: int, capacity: int = 0
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The layout of `ep_moe.permute.expert_layout`: ``(pair_of_slot [M], slot_of_pair [N, K], sorted_slots [N, K],
    tokens_per_expert [L], pairs_per_expert [L], tokens_per_expert on the host [L] (empty unless num_slots < 0,
    the exact size, which reads the counts once on the host, or a capacity))``. ``topk_idx [N, K]`` int64,
    ``1 <= num_experts <= MAX_EXPERTS``. ``capacity`` C > 0 (alignment 1; a run-time argument of the kernels):
    every expert owns exactly C slots, ``M = L * C``, with no host read.

    Launches: ``cuMemsetD32Async`` of the grid barrier's two words, then one cooperative launch of
    ``ep_expert_layout`` (count, scan, assign with the padding, sort), or two at the exact size with the host read
    between them (the size of pair_of_slot); no pairs (N = 0 or K = 0) take the same path and the kernel writes
    the zero counts and the padding (P = 0), at the exact size with no read (M = 0, or L * C). The outputs are
    views of one allocation (pair_of_slot apart at the exact size), with the kernels' block counts and barrier
    words behind them."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise fail(f"argument 'num_experts' must be in [1, {MAX_EXPERTS}], got {num_experts}", "expert_layout")
    rows, topk = topk_idx.shape
    pairs = rows * topk
    device = device_index(topk_idx)
    with _on(device):
        kernels = _layout_functions(num_experts, max(topk, 1), device)  # K = 0: no pairs; any K >= 1 does
        # the grid: every block resident at once (a cooperative launch's condition); with no pairs one block still
        # writes the counts and the padding
        tiles = _blocks(pairs, LAYOUT_TILE) or 1
        pairs_per_block = _blocks(tiles, min(tiles, LAYOUT_MAX_BLOCKS, kernels.resident)) * LAYOUT_TILE
        num_blocks = _blocks(pairs, pairs_per_block) or 1
        host = _NO_HOST
        if capacity:  # every count is known on the host
            host = torch.full((num_experts,), capacity, dtype=torch.int64, device="cpu")
            num_slots = num_experts * capacity
        elif num_slots < 0 and pairs == 0:  # the exact size of no pairs: every count is 0
            host = torch.zeros(num_experts, dtype=torch.int64, device="cpu")
            num_slots = 0
        exact = num_slots < 0  # the host reads the aligned counts between the two phases
        # One allocation: [pair_of_slot (fixed size only) | slot_of_pair | sorted_slots | tokens | pairs | the int32
        # block counts [num_blocks, L] and the barrier's two words] (int64 elements; the tail by raw addresses).
        head = 0 if exact else num_slots
        tail = (num_blocks * num_experts + 3) // 2
        buffer = topk_idx.new_empty(head + 2 * pairs + 2 * num_experts + tail)
        pair_of_slot, slot_of_pair, sorted_slots, tokens, counts, _ = buffer.split_with_sizes(
            (head, pairs, pairs, num_experts, num_experts, tail))
        base = buffer.data_ptr()
        at_slot_of_pair = base + 8 * head
        at_tokens = at_slot_of_pair + 16 * pairs
        at_block_counts = at_tokens + 16 * num_experts
        at_barrier = at_block_counts + 4 * num_blocks * num_experts
        stream = raw_stream(device)
        run = kernels.cooperative  # CUDA graph capture records cooperative launches too (checked on the H200)
        args = (topk_idx.data_ptr(), pairs, alignment, max(num_slots, 0), capacity, num_blocks, pairs_per_block,
                at_block_counts, at_tokens, at_tokens + 8 * num_experts, base, at_slot_of_pair,
                at_slot_of_pair + 8 * pairs, at_barrier)
        if not exact:
            run(PHASE_ALL, num_blocks, stream, args)
        else:
            run(PHASE_COUNT, num_blocks, stream, args)
            host = tokens.cpu()  # the one host read: waits for the counts
            num_slots = int(host.sum())
            pair_of_slot = topk_idx.new_empty(num_slots)
            run(PHASE_PLACE, num_blocks, stream, args[:3] + (num_slots,) + args[4:10] + (pair_of_slot.data_ptr(),)
                + args[11:])
    return pair_of_slot, slot_of_pair.view(rows, topk), sorted_slots.view(rows, topk), tokens, counts, host


# ------------------------------------------------------------------------------------------ rows
def permute_rows(x: Tensor, pair_of_slot: Tensor, num_topk: int, values: Tensor | None
                 ) -> tuple[Tensor, Tensor]:
    """The permute of `ep_moe.permute.permute_rows_and_values`: ``(rows [M, H] of x's dtype, slot_values [M] fp32, empty without
    values)``. ``x [N, H]`` any dtype, ``pair_of_slot [M]`` int64, ``values [N * K]`` fp32 or None."""
    slots, (num_rows, hidden) = pair_of_slot.numel(), x.shape
    out = x.new_empty((slots, hidden))  # new_empty: the cheapest allocation call from Python
    slot_values = x.new_empty(slots if values is not None else 0, dtype=torch.float32)
    row_bytes = hidden * x.element_size()
    if slots == 0 or (row_bytes == 0 and values is None):
        return out, slot_values
    word = row_word_bytes(row_bytes, x, out)
    device = device_index(x)
    # K = 0 has no pairs (every slot is padding): any K >= 1 gives the same kernel behaviour
    defines = (("EP_ROW_WORDS", row_bytes // word), ("EP_TOPK", max(num_topk, 1)), ("EP_VALUES", int(values is not None)),
               ("EP_WORD_BYTES", word))
    with _on(device):
        _function("permute_rows.cu", defines, "ep_permute_rows", _PERMUTE_SIG, device).launch(
            _blocks(slots, ROWS_PER_BLOCK), 256, raw_stream(device), x.data_ptr(), out.data_ptr(),
            pair_of_slot.data_ptr(), slots, num_rows * num_topk, _ptr(values),
            _ptr(slot_values) if values is not None else 0)
    return out, slot_values


def _row_dtype(t: Tensor, what: str) -> int:
    try:
        return ROW_DTYPES[t.dtype]
    except KeyError:
        raise fail(f"rows must be bfloat16 or float32, got {t.dtype}", what) from None


def reduce_row_threads(packs: int) -> int:
    """Threads per row of the weighted reduce for rows of ``packs`` packs: 128 (the row's loads spread over four
    warps) from 128 packs on, else one warp."""
    return 128 if packs >= 128 else 32


def unpermute_sum(y: Tensor, weights: Tensor | None, sorted_slots: Tensor, slot_values: Tensor | None,
                  slot_of_pair: Tensor | None) -> tuple[Tensor, Tensor]:
    """The weighted reduce of `ep_moe.permute.unpermute_sum`: ``(out [N, H] of y's dtype, pair_values [N, K] fp32, empty without
    slot_values)``. ``y [M, H]`` bf16/fp32, ``weights [M]`` fp32 or None, ``sorted_slots [N, K]`` int64;
    ``slot_values [M]`` fp32 with ``slot_of_pair [N, K]`` int64, or both None."""
    dtype = _row_dtype(y, "unpermute_sum")
    (rows, topk), (slots, hidden) = sorted_slots.shape, y.shape
    out = y.new_empty((rows, hidden))
    with_values = slot_values is not None
    pair_values = y.new_empty((rows, topk) if with_values else (0,), dtype=torch.float32)
    if rows == 0 or topk == 0:  # topk == 0: every row sums nothing
        return out.zero_(), pair_values
    vec = pack_elements(y.element_size(), hidden, y, out)
    device = device_index(y)
    row_threads = reduce_row_threads(hidden // vec)
    defines = (("EP_DTYPE", dtype), ("EP_PACKS", hidden // vec), ("EP_PAIR_VALUES", int(with_values)),
               ("EP_ROW_THREADS", row_threads), ("EP_TOPK", topk), ("EP_VEC", vec),
               ("EP_WEIGHTED", int(weights is not None)))
    with _on(device):
        _function("unpermute_sum.cu", defines, "ep_unpermute_sum", _UNPERMUTE_SIG, device).launch(
            _blocks(rows, 256 // row_threads), 256, raw_stream(device), y.data_ptr(), out.data_ptr(), rows, slots,
            _ptr(weights), sorted_slots.data_ptr(), _ptr(slot_values), _ptr(slot_of_pair) if with_values else 0,
            pair_values.data_ptr() if with_values else 0)
    return out, pair_values


def unpermute_sum_backward(grad_out: Tensor, y: Tensor, weights: Tensor | None, pair_of_slot: Tensor,
                           num_topk: int, need_grad_y: bool, need_grad_weights: bool) -> tuple[Tensor, Tensor]:
    """The gradients of `ep_moe.permute.unpermute_sum`: ``(grad_y [M, H] (empty unless need_grad_y), grad_weights [M]
    fp32 (empty unless need_grad_weights))``. ``grad_out [N, H]`` and ``y [M, H]`` of one dtype (bf16/fp32)."""
    dtype = _row_dtype(y, "unpermute_sum_backward")
    slots, hidden = pair_of_slot.numel(), y.shape[1]
    grad_y = y.new_empty((slots, hidden) if need_grad_y else (0,))
    grad_w = y.new_empty(slots if need_grad_weights else 0, dtype=torch.float32)
    if slots == 0 or not (need_grad_y or need_grad_weights):
        return grad_y, grad_w
    vec = pack_elements(y.element_size(), hidden, grad_out, y, grad_y if need_grad_y else None)
    device = device_index(y)
    defines = (("EP_DTYPE", dtype), ("EP_GRAD_W", int(need_grad_weights)), ("EP_GRAD_Y", int(need_grad_y)),
               ("EP_PACKS", hidden // vec), ("EP_TOPK", max(num_topk, 1)), ("EP_VEC", vec),
               ("EP_WEIGHTED", int(weights is not None)))
    with _on(device):
        _function("unpermute_sum_backward.cu", defines, "ep_unpermute_sum_backward", _BACKWARD_SIG, device).launch(
            _blocks(slots, ROWS_PER_BLOCK), 256, raw_stream(device), grad_out.data_ptr(), y.data_ptr(), _ptr(weights),
            pair_of_slot.data_ptr(), slots, grad_out.shape[0] * num_topk,
            grad_y.data_ptr() if need_grad_y else 0, grad_w.data_ptr() if need_grad_weights else 0)
    return grad_y, grad_w


# ------------------------------------------------------------------------------------------ ahead of time
SHAPE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def specializations(hidden: int, topk: int, experts: int, dtype: str = "bf16") -> list[KernelSource]:
    """The kernel specializations that the expert-major permute and reduce (forward and backward, with and without
    values and weights) take for rows of ``hidden`` elements of ``dtype`` (``bf16``, ``fp32``, or ``fp8``: rows
    that are only permuted), ``topk`` and ``experts`` local experts, at 16-byte aligned addresses (what torch's
    allocator gives): what ``ep-moe jit warmup`` compiles. Raises ``ValueError`` naming a bad argument."""
    if dtype not in SHAPE_DTYPES:
        raise ValueError(f"specializations: argument 'dtype' must be one of {sorted(SHAPE_DTYPES)}, got {dtype!r}")
    for name, value, low in (("hidden", hidden, 1), ("topk", topk, 1), ("experts", experts, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"specializations: argument '{name}' must be an integer >= {low}, got {value!r}")
    if experts > MAX_EXPERTS:
        raise ValueError(f"specializations: argument 'experts' must be <= {MAX_EXPERTS} (more use torch), got {experts}")
    element = SHAPE_DTYPES[dtype].itemsize
    row_bytes = hidden * element
    word = row_word_bytes(row_bytes)
    out = [KernelSource.of("expert_layout.cu", {"EP_EXPERTS": experts, "EP_TOPK": topk})]
    out += [KernelSource.of("permute_rows.cu", {"EP_ROW_WORDS": row_bytes // word, "EP_TOPK": topk,
                                                "EP_VALUES": values, "EP_WORD_BYTES": word}) for values in (0, 1)]
    if dtype == "fp8":
        return out
    vec = pack_elements(element, hidden)
    rows = {"EP_DTYPE": ROW_DTYPES[SHAPE_DTYPES[dtype]], "EP_PACKS": hidden // vec, "EP_TOPK": topk, "EP_VEC": vec}
    for weighted, pair_values in ((1, 0), (0, 0), (0, 1)):
        out.append(KernelSource.of("unpermute_sum.cu", {**rows, "EP_WEIGHTED": weighted, "EP_PAIR_VALUES": pair_values,
                                                        "EP_ROW_THREADS": reduce_row_threads(hidden // vec)}))
    for weighted, grad_y, grad_w in ((1, 1, 1), (1, 1, 0), (1, 0, 1), (0, 1, 0)):
        out.append(KernelSource.of("unpermute_sum_backward.cu", {**rows, "EP_WEIGHTED": weighted, "EP_GRAD_Y": grad_y,
                                                                 "EP_GRAD_W": grad_w}))
    return out


__all__ = ["MAX_EXPERTS", "SHAPE_DTYPES", "expert_layout", "pack_elements", "permute_rows", "reduce_row_threads",
           "row_word_bytes", "specializations", "unpermute_sum", "unpermute_sum_backward", "widest_word"]
