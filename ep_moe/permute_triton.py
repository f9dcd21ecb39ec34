"""Triton kernels for the expert-major permute and the weighted reduce back, bit for bit equal to
their torch definitions in ``ep_moe.permute``.

Notation: ``N`` rank-major rows, ``K`` top-k columns, ``M`` expert-major slots, ``H`` hidden.

- ``pair_of_slot [M]`` int64: the flat pair ``row * K + k`` feeding each slot; ``N * K`` (any value outside
  ``[0, N * K)``) marks a padding slot.
- ``sorted_slots [N, K]`` int64: per row, the slots of its pairs in increasing order, then ``-1`` (any value
  outside ``[0, M)`` is skipped like ``-1``).

So an index out of range is never read through: nothing is read or written past a buffer's end, whatever the
index tensors hold.

Every function takes contiguous tensors on one CUDA device (CPU tensors too in Triton's interpreter, where
``TRITON_INTERPRET=1`` was set before Triton was imported: a whole process runs one way), writes into the
caller's ``out`` (``torch.empty`` is fine: every element is written) and returns it; a wrong type, shape,
dtype, device or layout raises ``ValueError`` naming the argument (``RuntimeError`` without Triton). Each call
is one kernel launch, on the tensors' device and its current stream (an empty input is answered with
``out.zero_()`` or nothing, and no launch).

Launches (memory-bound; offsets are int64 everywhere, so ``M * H`` may exceed ``2**31``): a program owns
``BLOCK_M`` rows (slots, or rank-major rows for ``unpermute_sum``) and loops over ``H`` in ``BLOCK_H``-wide
blocks, a tile of ``TILE_BYTES`` (``BLOCK_H = min(next_pow2(H), TILE_BYTES / element size)``, ``BLOCK_M``
the rest), ``NUM_WARPS`` warps. ``H`` and ``K`` are compile-time constants (one compile per dtype, ``H``, ``K``
and function). ``permute_rows`` moves the bytes as int32 (else int16, else uint8) elements of the same row
bytes. Conversions to and from bf16 are done on the bits, identical in the interpreter (whose own cast to
bf16 truncates) and on the GPU: round to nearest even as torch's ``.to``, and a NaN becomes ``0x7FFF`` (what
torch on CUDA and the GPU's own conversion give; torch's CPU kernels give ``0x7FC0`` or ``0xFFFF``).

- ``permute_rows``: ``out[s] = x[pair_of_slot[s] // K]``, zero bytes for padding (any dtype: a byte copy).
- ``unpermute_sum``: ``out[i] = fp32 sum over the slots s of sorted_slots[i], in order, of weights[s] * y[s]``
  (each product rounded to fp32 before its add: launched with ``enable_fp_fusion=False``), rounded once to
  ``y``'s dtype (round to nearest even).
- ``scale_permute``: ``out[s] = (weights[s] * grad_out[pair_of_slot[s] // K]).to(dtype)``, zero for padding:
  ``unpermute_sum``'s gradient with respect to ``y``.
- ``pair_dot``: ``out[s] = <grad_out[pair_of_slot[s] // K], y[s]>`` in fp32, zero for padding: the gradient
  with respect to the weights. Summation order (fixed, so results repeat bit for bit on one device and
  build): lane ``j`` of ``BLOCK_H`` accumulates the products at ``h = j, j + BLOCK_H, ...`` in increasing
  ``h`` (fused multiply-adds allowed), then ``tl.sum`` reduces the ``BLOCK_H`` lanes in its fixed tree.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .buffer.argument_checks import HIDDEN_DTYPES, check_tensor

try:  # CPU-only installs have no Triton: the module still imports, and available() says why not
    import triton
    import triton.language as tl
    _TRITON_ERROR: str | None = None
except Exception as exc:
    triton = None
    _TRITON_ERROR = f"Triton is not importable ({type(exc).__name__}: {exc})"

TILE_BYTES = 4096  # one program's tile, BLOCK_M x BLOCK_H elements of the rows it reads
MAX_UNROLL = 8  # unpermute_sum reads up to this many of a row's slots at once (any K works)
NUM_WARPS = 4
# unpermute_sum's launch: never fuse a multiply and an add (ptxas --fmad=false), so each weighted product is
# rounded to fp32 before it is added, as in the torch definition
ROW_LAUNCH = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}

# The slot-major kernel's modes
_COPY, _SCALE, _DOT = 0, 1, 2


def unavailable_reason() -> str:
    """Why the Triton kernels cannot run on a GPU here, in one line ('' when they can)."""
    if _TRITON_ERROR is not None:
        return _TRITON_ERROR
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return ""


def available() -> bool:
    """Triton imports and a CUDA device exists."""
    return not unavailable_reason()


# Whether the kernels run in Triton's interpreter: Triton decides when it is imported and when a kernel is
# decorated (TRITON_INTERPRET=1 must be set before both), so the whole process runs one way or the other.
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET", "0").strip().lower() in (
    "1", "true", "yes", "on", "y")


if triton is not None:
    @triton.jit
    def _to_f32(v):
        """bf16 -> fp32 by its bits (exact), fp32 unchanged."""
        if v.dtype == tl.bfloat16:
            return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        return v.to(tl.float32)

    @triton.jit
    def _from_f32(v, dtype: tl.constexpr):
        """fp32 -> dtype, to nearest even. For bf16 by its bits, as c10's round_to_nearest_even, and a NaN
        becomes 0x7FFF as the GPU's cvt.rn.bf16.f32 makes it (Triton's interpreter truncates on a cast)."""
        if dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = tl.where(v != v, 0x7FFF0000, bits + 0x7FFF + ((bits >> 16) & 1))
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return v.to(dtype)

    @triton.jit
    def _slot_kernel(src_ptr, y_ptr, w_ptr, pair_ptr, out_ptr, M, num_pairs, H: tl.constexpr, K: tl.constexpr,
                     MODE: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
        """One program per BLOCK_M slots. MODE 0 (copy) / 1 (scale): out[s, :] = (w[s] *) src[row(s), :],
        zero for padding; MODE 2 (dot): out[s] = sum_h src[row(s), h] * y[s, h] in fp32, zero for padding."""
        slots = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_m = slots < M
        pair = tl.load(pair_ptr + slots, mask=in_m, other=-1)
        valid = (pair >= 0) & (pair < num_pairs)
        rows = tl.where(valid, pair // K, 0)
        if WEIGHTED:
            w = tl.load(w_ptr + slots, mask=valid, other=0.0)
        if MODE == 2:
            dot = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_ok = cols[None, :] < H
            src = tl.load(src_ptr + rows[:, None] * H + cols[None, :], mask=valid[:, None] & col_ok, other=0)
            if MODE == 2:
                y = tl.load(y_ptr + slots[:, None] * H + cols[None, :], mask=valid[:, None] & col_ok, other=0)
                dot += _to_f32(src) * _to_f32(y)
            else:
                if WEIGHTED:
                    src = _from_f32(w[:, None] * _to_f32(src), out_ptr.dtype.element_ty)
                tl.store(out_ptr + slots[:, None] * H + cols[None, :], src, mask=in_m[:, None] & col_ok)
        if MODE == 2:
            tl.store(out_ptr + slots, tl.sum(dot, axis=1), mask=in_m)

    @triton.jit
    def _row_kernel(y_ptr, w_ptr, slots_ptr, out_ptr, N, M, H: tl.constexpr, K: tl.constexpr,
                    WEIGHTED: tl.constexpr, UNROLL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
        """One program per BLOCK_M rows: out[i, :] = the fp32 sum over j = 0..K-1 (in order) of
        (w[s] *) y[s, :] for s = slots[i, j] in [0, M), rounded once to out's dtype."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_n = rows < N
        for start in range(0, H, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_ok = cols[None, :] < H
            acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
            for j0 in range(0, K, UNROLL):
                for u in tl.static_range(UNROLL):
                    j = j0 + u + tl.zeros([BLOCK_M], dtype=tl.int32)  # a vector: the interpreter's masks
                    slot = tl.load(slots_ptr + rows * K + j, mask=in_n & (j < K), other=-1)
                    valid = (slot >= 0) & (slot < M)
                    slot = tl.where(valid, slot, 0)
                    term = _to_f32(tl.load(y_ptr + slot[:, None] * H + cols[None, :],
                                           mask=valid[:, None] & col_ok, other=0))
                    if WEIGHTED:
                        term = tl.load(w_ptr + slot, mask=valid, other=0.0)[:, None] * term
                    acc = tl.where(valid[:, None], acc + term, acc)
            tl.store(out_ptr + rows[:, None] * H + cols[None, :], _from_f32(acc, out_ptr.dtype.element_ty),
                     mask=in_n[:, None] & col_ok)


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device (and its current stream): make it the tensors' one (a no-op,
    without a device switch, when it already is)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _blocks(width: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_H) for rows of ``width`` elements of ``element_size`` bytes: a tile of TILE_BYTES."""
    tile = TILE_BYTES // element_size
    block_h = min(triton.next_power_of_2(max(width, 1)), tile)
    return max(1, tile // block_h), block_h


# ------------------------------------------------------------------------------------------ checks
def _check(op: str, arg: str, t: object, device: torch.device, dtypes: tuple | None, shape: tuple
           ) -> torch.Tensor:
    """check_tensor (type, dtype, rank, device, shape; ``dtypes=None``: any), then contiguity."""
    if dtypes is None and isinstance(t, torch.Tensor):
        dtypes = (t.dtype,)
    check_tensor(op, arg, t, dtypes=dtypes or (), ndim=len(shape), device=device, shape=shape)
    if not t.is_contiguous():
        raise ValueError(f"ep_moe.{op}: argument '{arg}' must be contiguous, got strides {t.stride()}")
    return t


def _device_of(op: str, arg: str, t: object) -> torch.device:
    """The device of the first tensor argument: CUDA, or any device in Triton's interpreter."""
    if triton is None:
        raise RuntimeError(f"ep_moe.permute_triton: {_TRITON_ERROR}")
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"ep_moe.{op}: argument '{arg}' must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"ep_moe.{op}: argument '{arg}' must be on a CUDA device (CPU tensors only in Triton's "
                         f"interpreter, TRITON_INTERPRET=1), got {t.device}")
    return t.device


def _check_topk(op: str, num_topk: object) -> int:
    if isinstance(num_topk, bool) or not isinstance(num_topk, int) or num_topk < 1:
        raise ValueError(f"ep_moe.{op}: argument 'num_topk' must be an int >= 1, got {num_topk!r}")
    return num_topk


def _check_slot_args(op: str, src_arg: str, src: object, pair_of_slot: object, num_topk: object,
                     src_dtypes: tuple | None) -> tuple[torch.device, int]:
    """The checks shared by the slot-major functions: ``src [N, H]`` and ``pair_of_slot [M]`` int64 on one
    device, ``num_topk >= 1``. Returns (device, K)."""
    device = _device_of(op, src_arg, src)
    _check(op, src_arg, src, device, src_dtypes, (None, None))
    _check(op, "pair_of_slot", pair_of_slot, device, (torch.int64,), (None,))
    return device, _check_topk(op, num_topk)


def _byte_width(*tensors: torch.Tensor, row_bytes: int) -> torch.dtype:
    """The widest of int32/int16/uint8 that divides the row bytes and every tensor's start address."""
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


def _launch_slots(src: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None, pair_of_slot: torch.Tensor,
                  num_topk: int, out: torch.Tensor, mode: int, fp_fusion: bool) -> torch.Tensor:
    M, N, H = pair_of_slot.shape[0], src.shape[0], src.shape[1]
    block_m, block_h = _blocks(H, src.element_size())
    with _on_device(out.device):
        _slot_kernel[(triton.cdiv(M, block_m),)](
            src, y, weights if weights is not None else pair_of_slot, pair_of_slot, out, M, N * num_topk, H,
            num_topk, MODE=mode, WEIGHTED=weights is not None, BLOCK_M=block_m, BLOCK_H=block_h,
            num_warps=NUM_WARPS, enable_fp_fusion=fp_fusion)
    return out


# ------------------------------------------------------------------------------------------ the API
def permute_rows(x: torch.Tensor, pair_of_slot: torch.Tensor, num_topk: int, out: torch.Tensor) -> torch.Tensor:
    """``out[s] = x[pair_of_slot[s] // num_topk]`` for ``x [N, H]`` of any dtype (bf16, fp32, FP8, fp32
    scales), all-zero bytes for a padding slot; ``out [M, H]`` of ``x``'s dtype. A byte copy."""
    op = "permute_rows"
    device, K = _check_slot_args(op, "x", x, pair_of_slot, num_topk, None)
    _check(op, "out", out, device, (x.dtype,), (pair_of_slot.shape[0], x.shape[1]))
    return run_permute_rows(x, pair_of_slot, K, out)


def run_permute_rows(x: torch.Tensor, pair_of_slot: torch.Tensor, num_topk: int, out: torch.Tensor) -> torch.Tensor:
    """`permute_rows` without its argument checks, for callers that made them (``ep_moe.permute``)."""
    if out.numel() == 0:
        return out
    if x.shape[0] == 0:
        return out.zero_()
    view = _byte_width(x, out, row_bytes=x.shape[1] * x.element_size())
    src, dst = x.view(torch.uint8).view(view), out.view(torch.uint8).view(view)
    _launch_slots(src, src, None, pair_of_slot, num_topk, dst, _COPY, fp_fusion=False)
    return out


def scale_permute(grad_out: torch.Tensor, weights: torch.Tensor | None, pair_of_slot: torch.Tensor, num_topk: int,
                  out: torch.Tensor) -> torch.Tensor:
    """``out[s] = (weights[s] * float(grad_out[pair_of_slot[s] // num_topk])).to(dtype)`` (``weights=None``:
    a plain copy), zero for padding: ``unpermute_sum``'s gradient with respect to ``y``. ``grad_out [N, H]``
    bf16/fp32, ``weights [M]`` fp32, ``out [M, H]`` of ``grad_out``'s dtype."""
    op = "scale_permute"
    device, K = _check_slot_args(op, "grad_out", grad_out, pair_of_slot, num_topk, HIDDEN_DTYPES)
    M = pair_of_slot.shape[0]
    if weights is not None:
        _check(op, "weights", weights, device, (torch.float32,), (M,))
    _check(op, "out", out, device, (grad_out.dtype,), (M, grad_out.shape[1]))
    return run_scale_permute(grad_out, weights, pair_of_slot, K, out)


def run_scale_permute(grad_out: torch.Tensor, weights: torch.Tensor | None, pair_of_slot: torch.Tensor,
                      num_topk: int, out: torch.Tensor) -> torch.Tensor:
    """`scale_permute` without its argument checks."""
    if weights is None:
        return run_permute_rows(grad_out, pair_of_slot, num_topk, out)
    if out.numel() == 0:
        return out
    if grad_out.shape[0] == 0:
        return out.zero_()
    return _launch_slots(grad_out, grad_out, weights, pair_of_slot, num_topk, out, _SCALE, fp_fusion=False)


def pair_dot(grad_out: torch.Tensor, y: torch.Tensor, pair_of_slot: torch.Tensor, num_topk: int,
             out: torch.Tensor) -> torch.Tensor:
    """``out[s] = sum_h float(grad_out[pair_of_slot[s] // num_topk, h]) * float(y[s, h])`` in fp32, zero for
    padding: ``unpermute_sum``'s gradient with respect to the weights. ``grad_out [N, H]`` and ``y [M, H]``
    of one dtype (bf16/fp32), ``out [M]`` fp32. Summation order: see the module docstring."""
    op = "pair_dot"
    device, K = _check_slot_args(op, "grad_out", grad_out, pair_of_slot, num_topk, HIDDEN_DTYPES)
    M = pair_of_slot.shape[0]
    _check(op, "y", y, device, (grad_out.dtype,), (M, grad_out.shape[1]))
    _check(op, "out", out, device, (torch.float32,), (M,))
    return run_pair_dot(grad_out, y, pair_of_slot, K, out)


def run_pair_dot(grad_out: torch.Tensor, y: torch.Tensor, pair_of_slot: torch.Tensor, num_topk: int,
                 out: torch.Tensor) -> torch.Tensor:
    """`pair_dot` without its argument checks."""
    if pair_of_slot.shape[0] == 0:
        return out
    if grad_out.shape[0] == 0 or grad_out.shape[1] == 0:
        return out.zero_()
    return _launch_slots(grad_out, y, None, pair_of_slot, num_topk, out, _DOT, fp_fusion=True)


def unpermute_sum(y: torch.Tensor, weights: torch.Tensor | None, sorted_slots: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """``out[i] = (sum over the slots s of sorted_slots[i] in order of weights[s] * float(y[s])).to(dtype)``,
    summed in fp32 from 0.0, each product rounded to fp32 before its add (``weights=None``: plain sums).
    ``y [M, H]`` bf16/fp32, ``weights [M]`` fp32, ``sorted_slots [N, K]`` int64, ``out [N, H]`` of ``y``'s
    dtype. Bit for bit the torch definition (ep_moe.permute)."""
    op = "unpermute_sum"
    device = _device_of(op, "y", y)
    _check(op, "y", y, device, HIDDEN_DTYPES, (None, None))
    M, H = y.shape
    if weights is not None:
        _check(op, "weights", weights, device, (torch.float32,), (M,))
    _check(op, "sorted_slots", sorted_slots, device, (torch.int64,), (None, None))
    N, K = sorted_slots.shape
    _check(op, "out", out, device, (y.dtype,), (N, H))
    return run_unpermute_sum(y, weights, sorted_slots, out)


def run_unpermute_sum(y: torch.Tensor, weights: torch.Tensor | None, sorted_slots: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """`unpermute_sum` without its argument checks."""
    (M, H), (N, K) = y.shape, sorted_slots.shape
    if out.numel() == 0:
        return out
    if M == 0 or K == 0:
        return out.zero_()
    block_m, block_h = _blocks(H, y.element_size())
    with _on_device(out.device):
        _row_kernel[(triton.cdiv(N, block_m),)](
            y, weights if weights is not None else sorted_slots, sorted_slots, out, N, M, H, K,
            WEIGHTED=weights is not None, UNROLL=min(triton.next_power_of_2(K), MAX_UNROLL), BLOCK_M=block_m,
            BLOCK_H=block_h, **ROW_LAUNCH)
    return out
