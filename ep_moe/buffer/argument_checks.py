"""Argument checks for dispatch and combine. Every check runs before any communication, and every
error names the argument and what was expected (docs/semantics.md)."""

from __future__ import annotations

import torch

from .dispatch_handle import DispatchHandle

HIDDEN_DTYPES = (torch.bfloat16, torch.float32)
FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)
FP8_BLOCK = 128  # one fp32 scale per 128 hidden elements, as DeepEP's FP8 dispatch expects


def _fail(op: str, arg: str, expected: str, got: object) -> ValueError:
    return ValueError(f"ep_moe.{op}: argument '{arg}' must be {expected}, got {got}")


def check_tensor(op: str, arg: str, t: object, *, dtypes: tuple, ndim: int, device: torch.device,
                 shape: tuple | None = None) -> torch.Tensor:
    """Check type, dtype, rank, device and (where given, ``None`` = any) shape of one tensor."""
    if not isinstance(t, torch.Tensor):
        raise _fail(op, arg, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        raise _fail(op, arg, f"of dtype {' or '.join(str(d) for d in dtypes)}", t.dtype)
    if t.dim() != ndim:
        raise _fail(op, arg, f"{ndim}-D", f"shape {tuple(t.shape)}")
    where = t.device
    # equal devices first (one comparison); else the same type with either index unset passes
    if where != device and (where.type != device.type or (device.index is not None and where.index is not None)):
        raise _fail(op, arg, f"on device {device}", where)
    if shape is not None:
        for dim, (want, have) in enumerate(zip(shape, t.shape)):
            if want is not None and want != have:
                raise _fail(op, arg, f"of shape {tuple('*' if s is None else s for s in shape)}",
                            f"{tuple(t.shape)} (dimension {dim})")
    return t


def split_hidden(op: str, x: object, device: torch.device, dtypes: tuple = HIDDEN_DTYPES
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Accept ``x`` as a ``[T, H]`` tensor of one of ``dtypes`` or an FP8 pair
    ``(x_e4m3 [T, H], scales [T, H/128] fp32)``."""
    if isinstance(x, tuple | list):
        if len(x) != 2:
            raise _fail(op, "x", "a tensor or a pair (x_fp8, scales)", f"a sequence of {len(x)}")
        data, scales = x
        check_tensor(op, "x[0]", data, dtypes=FP8_DTYPES, ndim=2, device=device)
        hidden = data.shape[1]
        if hidden % FP8_BLOCK != 0:
            raise _fail(op, "x[0]", f"of hidden size divisible by {FP8_BLOCK} for FP8", hidden)
        check_tensor(op, "x[1]", scales, dtypes=(torch.float32,), ndim=2, device=device,
                     shape=(data.shape[0], hidden // FP8_BLOCK))
        return data, scales
    check_tensor(op, "x", x, dtypes=dtypes, ndim=2, device=device)
    return x, None


def check_topk(op: str, topk_idx: object, topk_weights: object, num_tokens: int | None, num_experts: int,
               device: torch.device, check_values: bool) -> None:
    """Check ``topk_idx [T, K]`` int64 in ``[-1, E)`` (T = ``num_tokens``; None: any) and ``topk_weights [T, K]``
    fp32 (or None)."""
    check_tensor(op, "topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2, device=device, shape=(num_tokens, None))
    if topk_weights is not None:
        check_tensor(op, "topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2, device=device,
                     shape=tuple(topk_idx.shape))
    if check_values and topk_idx.numel() > 0:
        lo, hi = torch.stack([topk_idx.min(), topk_idx.max()]).tolist()  # one host sync, not two
        if lo < -1 or hi >= num_experts:
            raise _fail(op, "topk_idx", f"expert ids in [-1, {num_experts}) (num_experts={num_experts})",
                        f"values in [{lo}, {hi}]")


def check_num_experts(op: str, num_experts: object, num_ranks: int) -> int:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise _fail(op, "num_experts", "a positive int", repr(num_experts))
    if num_experts % num_ranks != 0:
        raise _fail(op, "num_experts", f"divisible by the group size {num_ranks}", num_experts)
    return num_experts


def check_positive_int(op: str, arg: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _fail(op, arg, f"an int >= {minimum}", repr(value))
    return value


def check_handle(op: str, handle: object, num_ranks: int, device: torch.device,
                 num_tokens: int | None = None) -> DispatchHandle:
    """Check that ``handle`` came from a dispatch on this group and (if given) matches ``num_tokens``."""
    if not isinstance(handle, DispatchHandle):
        raise _fail(op, "handle", "the DispatchHandle returned by Buffer.dispatch", type(handle).__name__)
    if handle.num_ranks != num_ranks:
        raise _fail(op, "handle", f"from a group of {num_ranks} ranks", f"one of {handle.num_ranks}")
    where = handle.is_token_in_rank.device
    if where != device and where.type != device.type:  # equal devices first: one comparison
        raise _fail(op, "handle", f"on device {device}", where)
    if num_tokens is not None and handle.num_tokens != num_tokens:
        raise _fail(op, "handle", f"from a dispatch of {num_tokens} tokens (x.shape[0])",
                    f"one of {handle.num_tokens} tokens")
    return handle
