"""Result checks of the checked (untimed) calls: each returns a list of human-readable mismatches (empty
when everything agrees), so that a failed check is reported beside the timings, not hidden."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """True when both are None, or have the same shape, dtype and bytes (FP8 and NaN included)."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # 0-dim included


def compare(what: str, got, want) -> list[str]:
    """Bitwise comparison of tensors, pairs of tensors (FP8 ``(x, scales)``) or plain values."""
    if isinstance(want, tuple | list) and want and isinstance(want[0], torch.Tensor):
        if not isinstance(got, tuple | list) or len(got) != len(want):
            return [f"{what}: expected a pair of tensors, got {type(got).__name__}"]
        return [m for i, (g, w) in enumerate(zip(got, want)) for m in compare(f"{what}[{i}]", g, w)]
    if isinstance(want, torch.Tensor) or want is None:
        if isinstance(got, torch.Tensor) or got is None:
            if same_bits(got, want):
                return []
            return [f"{what}: differs ({_difference(got, want)})"]
        return [f"{what}: expected a tensor, got {type(got).__name__}"]
    return [] if got == want else [f"{what}: {got!r} != expected {want!r}"]


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _describe(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    return f"{tuple(t.shape)} {t.dtype}"


def _difference(got: torch.Tensor | None, want: torch.Tensor | None) -> str:
    """How two tensors differ: shapes/dtypes, or how many elements and the first one."""
    if got is None or want is None or got.shape != want.shape or got.dtype != want.dtype:
        return f"{_describe(got)} vs expected {_describe(want)}"
    as_int = _SAME_SIZE_INT[got.element_size()]
    unequal = got.contiguous().view(as_int) != want.contiguous().view(as_int)
    first = tuple(unequal.nonzero()[0].tolist())
    return (f"{int(unequal.sum())} of {unequal.numel()} elements of {_describe(got)}, first at {first}: "
            f"{got[first].item()!r} vs expected {want[first].item()!r}")


def round_trip_reference(x: torch.Tensor, is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """What ``combine(dispatch(x))`` returns when every rank sends back the rows it received: each
    token summed once per rank it went to, in fp32, one rank after the other, then cast (docs/semantics.md)."""
    copies = is_token_in_rank.sum(dim=1)
    acc = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    xf = x.to(acc.dtype)
    for k in range(is_token_in_rank.shape[1]):
        acc = torch.where((copies > k).unsqueeze(1), acc + xf, acc)
    return acc.to(x.dtype)


def expected_recv_counts(counts_by_source: torch.Tensor, experts_by_source: torch.Tensor, rank: int
                         ) -> tuple[int, list[int]]:
    """Rows rank ``rank`` receives and its per-local-expert (token, expert) counts, from every rank's
    layout: ``counts_by_source [R, R]`` (num_tokens_per_rank of each source) and ``experts_by_source
    [R, E]`` (num_tokens_per_expert of each source)."""
    num_ranks = counts_by_source.shape[0]
    local = experts_by_source.shape[1] // num_ranks
    rows = int(counts_by_source[:, rank].sum())
    per_expert = experts_by_source[:, rank * local:(rank + 1) * local].sum(dim=0).tolist()
    return rows, [int(c) for c in per_expert]


def check_layout(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> list[str]:
    """``get_dispatch_layout``'s ``(per_rank, per_expert, in_rank)`` against the reference, by value."""
    names = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank")
    problems = []
    for name, g, w in zip(names, got, want):
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or not torch.equal(g.to(w.dtype), w):
            problems.append(f"layout {name}: differs from ep_moe.reference.reference_layout")
    return problems


# What a fixed-size dispatch (num_worst_tokens) puts in its padding rows (docs/semantics.md): 0 is all-zero bytes.
FIXED_PADDING = {"recv_x": 0, "recv_scales": 0, "recv_topk_idx": -1, "recv_topk_weights": 0, "recv_src_idx": -1,
                 "recv_src_rank": -1}


# The expert-major dispatch's per-row outputs and what its fixed-size slots past the used rows hold.
EXPERT_FIXED_PADDING = {"expert_x": 0, "expert_scales": 0, "expert_weights": 0}


def check_fixed(fixed: dict, exact: dict, rows: int, padding_of: dict = FIXED_PADDING) -> list[str]:
    """A fixed-size dispatch's outputs against the exact-size dispatch's of the same input: every per-row
    output (named as `ep_moe.benchmarking.verification.named_outputs` names them; ``padding_of``: name ->
    padding value) equals the exact one in its first ``rows`` rows and holds the padding value after them; the
    rank prefix matrix (rank-major) or the per-expert counts (expert-major) are the same."""
    problems = []
    for name, pad in padding_of.items():
        if name not in exact:
            continue
        got = fixed.get(name)
        if not isinstance(got, torch.Tensor):
            problems.append(f"fixed-size {name}: expected a tensor, got {type(got).__name__}")
            continue
        problems += compare(f"fixed-size {name}[:{rows}] vs dispatch", got[:rows], exact[name])
        padding = got[rows:]
        wrong = padding.contiguous().view(torch.uint8).any() if pad == 0 else (padding != pad).any()
        if bool(wrong):
            problems.append(f"fixed-size {name}: padding rows are not {pad}")
    for name in ("rank_prefix_matrix", "tokens_per_expert", "pairs_per_expert"):
        if name in exact:
            problems += compare(f"fixed-size {name} vs dispatch", fixed.get(name), exact[name])
    return problems


def expert_round_trip_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                                num_ranks: int, num_experts: int) -> torch.Tensor:
    """What ``expert_combine(expert_dispatch(x), weights=expert_weights)`` returns on the source of ``x [T, H]``
    (docs/semantics.md, "Expert-major layout"): per rank, the fp32 sum of ``w * x`` over the token's experts
    there in increasing id (each product rounded first), rounded to x's dtype; then those rows summed in fp32
    in increasing rank, rounded once. A loop over the token's own routing: no other rank's data is needed."""
    local = num_experts // num_ranks
    xf = x.float()
    total = torch.zeros_like(xf)
    for rank in range(num_ranks):
        part = torch.zeros_like(xf)
        for expert in range(rank * local, (rank + 1) * local):
            hit = topk_idx == expert  # [T, K]: a token names an expert at most once in the bench's routing
            weight = (topk_weights * hit).sum(dim=1, keepdim=True)
            part = torch.where(hit.any(dim=1, keepdim=True), part + weight * xf, part)
        total = total + part.to(x.dtype).float()
    return total.to(x.dtype)
