"""SwiGLU experts: `GroupedExperts` (this EP rank's experts over dispatcher-grouped rows) and the dense
`SwiGLU` MLP (dense FFN layers and the shared expert).

SwiGLU: ``y = (silu(x @ w1) * (x @ w3)) @ w2``, no biases.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EXPERT_IMPLS = ("auto", "grouped_mm", "loop")
GROUPED_MM_ALIGNMENT = 16  # rows per expert group for torch._grouped_mm on CUDA (bf16)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts`` that is the same in every process (unlike ``hash(str)``)."""
    digest = 0
    for part in parts:
        digest = zlib.crc32(f"{part}\x1f".encode(), digest)
    return (digest * 0x9E3779B97F4A7C15 + len(parts)) % (2**63 - 1)


def _normal(shape: tuple[int, ...], std: float, generator: torch.Generator | None) -> Tensor:
    """Normal(0, std) drawn in fp32 on the CPU (the same numbers whatever the target device/dtype)."""
    return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)


def mark_expert(param: nn.Parameter) -> nn.Parameter:
    """Tag a parameter as expert-parallel: its gradient is reduced over the expert-data-parallel group."""
    param.is_expert = True
    return param


def is_expert_param(param: Tensor) -> bool:
    return bool(getattr(param, "is_expert", False))


def grouped_mm_available(x: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` serves ``x`` on its fast path: CUDA, bf16, compute capability >= 9.0."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP ``[..., H] -> [..., H]``: w1, w3 ``[F, H]``, w2 ``[H, F]`` (``F.linear`` layout).

    Args:
        init_method_std: std of w1 and w3; output_init_std: std of w2 (default: the same).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, dtype: torch.dtype = torch.float32,
                 init_method_std: float = 0.02, output_init_std: float | None = None) -> None:
        super().__init__()
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.init_method_std = init_method_std
        self.output_init_std = output_init_std if output_init_std is not None else init_method_std
        self.w1 = nn.Parameter(torch.empty(ffn_hidden_size, hidden_size, dtype=dtype, device="cpu"))
        self.w3 = nn.Parameter(torch.empty(ffn_hidden_size, hidden_size, dtype=dtype, device="cpu"))
        self.w2 = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, dtype=dtype, device="cpu"))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        for w, std in ((self.w1, self.init_method_std), (self.w3, self.init_method_std),
                       (self.w2, self.output_init_std)):
            w.copy_(_normal(tuple(w.shape), std, generator))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class GroupedExperts(nn.Module):
    """This EP rank's SwiGLU experts, stacked: ``w1, w3 [L, H, F]``, ``w2 [L, F, H]``.

    Global expert ``g`` lives on EP rank ``g // L`` as local expert ``g % L`` (the dispatcher's layout).

    Args:
        num_experts: E, all experts of the layer. hidden_size: H. ffn_hidden_size: F (per expert).
        ep_rank, ep_size: this rank and the EP group size (``E % ep_size == 0``).
        dtype: parameter dtype. init_method_std: std of w1, w3; output_init_std: std of w2.
        impl: ``"auto"`` (``torch._grouped_mm`` where `grouped_mm_available`, else the loop),
            ``"grouped_mm"`` (always; torch >= 2.8 also runs it on CPU) or ``"loop"``.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, ep_rank: int = 0,
                 ep_size: int = 1, dtype: torch.dtype = torch.float32, init_method_std: float = 0.02,
                 output_init_std: float | None = None, impl: str = "auto") -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"GroupedExperts: argument 'num_experts' must be divisible by ep_size={ep_size}, "
                             f"got {num_experts}")
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"GroupedExperts: argument 'ep_rank' must be in [0, {ep_size}), got {ep_rank}")
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"GroupedExperts: argument 'impl' must be one of {EXPERT_IMPLS}, got {impl!r}")
        if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
            raise ValueError("GroupedExperts: argument 'impl' is 'grouped_mm' but this torch has no _grouped_mm")
        self.num_experts, self.ep_rank, self.ep_size = num_experts, ep_rank, ep_size
        self.num_local_experts = num_experts // ep_size
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.init_method_std = init_method_std
        self.output_init_std = output_init_std if output_init_std is not None else init_method_std
        self.impl = impl
        local = self.num_local_experts
        self.w1 = mark_expert(nn.Parameter(torch.empty(local, hidden_size, ffn_hidden_size, dtype=dtype,
                                                         device="cpu")))
        self.w3 = mark_expert(nn.Parameter(torch.empty(local, hidden_size, ffn_hidden_size, dtype=dtype,
                                                         device="cpu")))
        self.w2 = mark_expert(nn.Parameter(torch.empty(local, ffn_hidden_size, hidden_size, dtype=dtype,
                                                         device="cpu")))
        self.reset_parameters(0)

    @property
    def first_expert(self) -> int:
        """Global id of local expert 0."""
        return self.ep_rank * self.num_local_experts

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Draw every local expert from its own generator seeded by ``(seed, global expert id)`` (w1, w3,
        w2 in that order), so the model is the same whatever the EP size."""
        for local in range(self.num_local_experts):
            gen = torch.Generator().manual_seed(derive_seed(seed, "expert", self.first_expert + local))
            for w, std in ((self.w1, self.init_method_std), (self.w3, self.init_method_std),
                           (self.w2, self.output_init_std)):
                w[local].copy_(_normal(tuple(w.shape[1:]), std, gen))

    def uses_grouped_mm(self, x: Tensor) -> bool:
        return self.impl == "grouped_mm" or (self.impl == "auto" and grouped_mm_available(x))

    def expert_alignment(self, x: Tensor) -> int:
        """Row alignment the dispatcher must pad each expert's group to for input like ``x``."""
        return GROUPED_MM_ALIGNMENT if self.uses_grouped_mm(x) else 1

    def forward(self, x: Tensor, tokens_per_expert: Tensor, probs: Tensor | None = None) -> Tensor:
        """Run the experts over grouped rows.

        Args:
            x: ``[M, H]``: the rows of local expert 0, then 1, ... (`TokenDispatcher.dispatch` order).
            tokens_per_expert: ``[L]`` int rows per local expert (padding included); rows after their
                sum (fixed-size dispatch) give zeros.
            probs: ``[M]`` fp32 routing weight of each row, multiplied into the expert's output (fp32), or None.

        Returns:
            ``[M, H]`` in ``x``'s dtype.
        """
        local = self.num_local_experts
        if x.ndim != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"GroupedExperts: argument 'x' must be [M, {self.hidden_size}], got {tuple(x.shape)}")
        if tokens_per_expert.shape != (local,):
            raise ValueError(f"GroupedExperts: argument 'tokens_per_expert' must have shape ({local},), "
                             f"got {tuple(tokens_per_expert.shape)}")
        if probs is not None and probs.shape != (x.shape[0],):
            raise ValueError(f"GroupedExperts: argument 'probs' must have shape ({x.shape[0]},), "
                             f"got {tuple(probs.shape)}")
        w1, w3, w2 = (w.to(x.dtype) for w in (self.w1, self.w3, self.w2))
        if self.uses_grouped_mm(x):
            y = self._grouped_mm(x, tokens_per_expert, w1, w3, w2)
        else:
            y = self._loop(x, tokens_per_expert, w1, w3, w2)
        if probs is not None:
            y = (y.float() * probs.unsqueeze(1)).to(x.dtype)
        return y

    @staticmethod
    def _grouped_mm(x: Tensor, tokens_per_expert: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
        ends = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        # Rows past the last group (fixed-size dispatch) are neither read nor written by the kernel, in the
        # forward or the backward: mask them on the way in and out so they give zeros and zero gradients.
        valid = (torch.arange(x.shape[0], device=x.device) < ends[-1]).unsqueeze(1)
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        x = torch.where(valid, x, zero)
        h = F.silu(torch._grouped_mm(x, w1, offs=ends)) * torch._grouped_mm(x, w3, offs=ends)
        return torch.where(valid, torch._grouped_mm(h, w2, offs=ends), zero)

    @staticmethod
    def _loop(x: Tensor, tokens_per_expert: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
        counts = [int(c) for c in tokens_per_expert.tolist()]
        used = sum(counts)
        if used > x.shape[0]:
            raise ValueError(f"GroupedExperts: argument 'tokens_per_expert' sums to {used} > {x.shape[0]} rows")
        outs = []
        # Every expert runs, even on zero rows, so every expert weight gets a (zero) gradient.
        for local, rows in enumerate(torch.split(x[:used], counts)):
            outs.append((F.silu(rows @ w1[local]) * (rows @ w3[local])) @ w2[local])
        outs.append(x.new_zeros(x.shape[0] - used, w2.shape[-1]))
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts} of {self.num_experts} (first {self.first_expert}), "
                f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, impl={self.impl}")


def scaled_output_std(std: float, num_layers: int) -> float:
    """Megatron's output-projection init: ``std / sqrt(2 * num_layers)``."""
    return std / math.sqrt(2.0 * num_layers)
