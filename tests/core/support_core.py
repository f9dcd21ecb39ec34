"""Helpers shared by the core tests (this module holds no tests).

Every spawned rank regenerates *all* ranks' inputs from seeds, so each rank can compute the
single-process reference (`ep_moe.reference`) itself and compare its own outputs against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from support.bits import bit_difference

FP8 = torch.float8_e4m3fn


class CaseFailure(AssertionError):
    """A mismatch in one named case on one rank (raised at once: the peers then fail fast too)."""


def check(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CaseFailure(f"[{where}] {what}")


def expect_raises(seen: list[str], rank: int, base: type, error: type, fn, *words: str) -> None:
    """``fn()`` raises ``error`` (a subclass of ``base``) whose message holds every one of ``words``; its class
    name is appended to ``seen``."""
    try:
        fn()
    except error as exc:
        text = str(exc)
        assert all(w in text for w in words), f"rank {rank}: {error.__name__} without {words}: {text}"
        assert isinstance(exc, base)
        seen.append(error.__name__)
        return
    raise AssertionError(f"rank {rank}: expected {error.__name__}")


def check_bits(got: object, want: torch.Tensor | None, where: str, what: str) -> None:
    """``got`` has ``want``'s type, dtype, shape and device kind and the very same bits (`support.bits`)."""
    difference = bit_difference(got, want)
    check(difference is None, where, f"{what}: {difference}")


def check_equal(got: torch.Tensor, want: torch.Tensor, where: str, what: str) -> None:
    """Same dtype, shape and values (``-0.0 == 0.0``: for sums, whose zero sign is not specified)."""
    check(got.dtype == want.dtype and got.shape == want.shape, where,
          f"{what}: {got.dtype}{tuple(got.shape)}, expected {want.dtype}{tuple(want.shape)}")
    check(torch.equal(got, want), where, f"{what}: values differ")


def routing(kind: str, num_tokens: int, num_topk: int, num_experts: int, num_ranks: int,
            gen: torch.Generator) -> torch.Tensor:
    """``[T, K]`` int64 expert ids for one rank (distinct ids per token, -1 = none).

    Kinds: ``random`` (~20 % of the entries dropped to -1, anywhere in the row, and every fifth
    token with no expert at all), ``all_minus_one``,
    ``one_expert`` (every token to expert E-1 only), ``one_rank`` (all K experts on the last rank),
    ``sparse`` (only even expert ids: the odd experts receive nothing), ``every_rank`` (one expert on
    each rank; K must equal R), ``skip_rank0`` (never rank 0: rank 0 receives nothing).
    """
    per_rank = num_experts // num_ranks
    T, K = num_tokens, num_topk

    def pick(pool: torch.Tensor) -> torch.Tensor:
        order = torch.rand(T, pool.numel(), generator=gen).argsort(dim=1)[:, :K]
        return pool[order]

    if kind == "random":
        idx = pick(torch.arange(num_experts))
        idx = idx.masked_fill(torch.rand(T, K, generator=gen) < 0.2, -1)
        idx[3::5] = -1  # some tokens go nowhere at all
        return idx
    if kind == "all_minus_one":
        return torch.full((T, K), -1, dtype=torch.int64)
    if kind == "one_expert":
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = num_experts - 1
        return idx
    if kind == "one_rank":
        return pick(torch.arange((num_ranks - 1) * per_rank, num_experts))
    if kind == "sparse":
        return pick(torch.arange(0, num_experts, 2))
    if kind == "every_rank":
        assert K == num_ranks
        return torch.arange(num_ranks) * per_rank + torch.randint(per_rank, (T, num_ranks), generator=gen)
    if kind == "skip_rank0":
        return pick(torch.arange(per_rank, num_experts))
    raise ValueError(kind)


@dataclass(frozen=True)
class Case:
    """One dispatch/combine scenario over all ranks (``tokens[s]`` = T on rank s)."""

    name: str
    tokens: tuple[int, ...]
    hidden: int
    topk: int
    experts: int
    kind: str
    dtype: str  # "bf16", "fp32", "fp64" or "fp8"
    alignment: int = 1


@dataclass
class Inputs:
    xs: list[torch.Tensor]                # [T_s, H] per rank (e4m3 for fp8)
    scales: list[torch.Tensor] | None     # [T_s, H/128] fp32 per rank, fp8 only
    idxs: list[torch.Tensor]              # [T_s, K] int64
    weights: list[torch.Tensor]           # [T_s, K] fp32

    def x(self, rank: int):
        """What rank ``rank`` passes as ``x`` to `Buffer.dispatch` (a pair for fp8)."""
        return (self.xs[rank], self.scales[rank]) if self.scales is not None else self.xs[rank]


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def make_inputs(case: Case, num_ranks: int, seed: int) -> Inputs:
    xs, scales, idxs, weights = [], [], [], []
    for s in range(num_ranks):
        gen = torch.Generator().manual_seed(seed * 7919 + s)
        T = case.tokens[s]
        dense = torch.randn(T, case.hidden, generator=gen)
        if case.dtype == "fp8":
            xs.append(dense.to(FP8))
            scales.append(torch.rand(T, case.hidden // 128, generator=gen) + 0.5)
        else:
            xs.append(dense.to(DTYPES[case.dtype]))
        idxs.append(routing(case.kind, T, case.topk, case.experts, num_ranks, gen))
        weights.append(torch.rand(T, case.topk, generator=gen))
    return Inputs(xs, scales if case.dtype == "fp8" else None, idxs, weights)


def small_ints(num_rows: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Integers in [-8, 8]: sums of a few of them are exact in bf16 and fp32."""
    return torch.randint(-8, 9, (num_rows, hidden), generator=gen).to(dtype)
