"""What the scripts in ``benchmarks/`` share to check the outputs of the calls they time: a comparison that names
the first differing element, bit for bit (`ep_moe.benchmarking.checks.compare`) or within a tolerance stated per
dtype, the problems of every rank gathered, and the failure report that makes a script exit non-zero."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ep_moe.benchmarking.checks import compare

# Tolerance of a result that another code path computes (a different dispatcher, DeepSpeed's layer against ours,
# NCCL's reduction against an fp32 sum), relative to the largest |expected| element: each element must be within
# RTOL x max|expected|. bf16 keeps 8 significant bits, a rounding step of 2^-8 = 3.9e-3 of a value; paths that
# order and round their sums over a token's experts or ranks differently land a few such steps of the largest
# values apart, and 2e-2 (5 steps) is the bound tests/integrations/test_megatron_gpu.py holds the layers to. fp32
# (a step of 6e-8) leaves reordered sums and GEMM blockings over 100 steps of margin at 1e-5, the bound the
# DeepSpeed layer is tested to. A dropped, stale or misplaced row differs by the size of the row itself and fails
# both. Paths that compute the same thing the same way (a layer against its own untimed call, a copy) compare
# bit for bit instead.
RTOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def max_rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf where shapes differ or a value is not finite where the other is)."""
    if got.shape != want.shape:
        return float("inf")
    g, w = got.detach().double(), want.detach().double()
    if not torch.equal(g.isfinite(), w.isfinite()):
        return float("inf")
    finite = w.isfinite()
    scale = w[finite].abs().max().item() if bool(finite.any()) else 0.0
    diff = (g - w)[finite].abs().max().item() if bool(finite.any()) else 0.0
    return diff / max(scale, 1e-30)


def mismatch(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float | None) -> str | None:
    """None when ``got`` matches ``want``: bit for bit (``rtol`` None), or every element within ``rtol`` x
    max|want| (NaN only where ``want`` has NaN). Otherwise one line naming ``what``, how many elements differ and
    the first one: its index, the value got and the value expected."""
    if rtol is None:
        problems = compare(what, got, want)
        return problems[0] if problems else None
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    g, w = got.detach().double(), want.detach().double()
    finite = w.isfinite()
    scale = w[finite].abs().max().item() if bool(finite.any()) else 0.0
    bad = ~torch.isclose(g, w, rtol=0.0, atol=rtol * scale, equal_nan=True)
    if not bool(bad.any()):
        return None
    first = tuple(bad.nonzero()[0].tolist())
    return (f"{what}: {int(bad.sum())} of {bad.numel()} elements differ by more than {rtol:g} x max|expected| "
            f"(max rel diff {max_rel_diff(got, want):.2e}), first at {first}: got {got[first].item()!r}, "
            f"expected {want[first].item()!r}")


def gather_problems(problems: list[str], group: dist.ProcessGroup | None = None) -> list[str]:
    """Every rank's problems, each prefixed with its rank (collective when torch.distributed is initialized; a
    lone process's own otherwise)."""
    if not dist.is_initialized():
        return list(problems)
    everyone: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, list(problems), group=group)
    return [f"rank {rank}: {p}" for rank, mine in enumerate(everyone) for p in (mine or [])]


def verdict(problems: list[str]) -> str:
    """The ``check`` column of a row: ``ok`` or ``DIFF``."""
    return "DIFF" if problems else "ok"


def report(tool: str, problems: list[str]) -> int:
    """Print every problem to stderr, naming ``tool``; the exit status: 1 if there is any, else 0."""
    for line in problems:
        print(f"{tool}: CHECK FAILED: {line}", file=sys.stderr, flush=True)
    if problems:
        print(f"{tool}: {len(problems)} check(s) failed: the timings above are of calls whose outputs are wrong",
              file=sys.stderr, flush=True)
    return 1 if problems else 0
