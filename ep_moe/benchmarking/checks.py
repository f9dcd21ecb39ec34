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
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


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


def check_fixed(fixed: dict, exact: dict, rows: int) -> list[str]:
    """A fixed-size dispatch's outputs against the exact-size dispatch's of the same input: every per-row
    output (named as `ep_moe.benchmarking.verification.named_outputs` names them) equals the exact one in its
    first ``rows`` rows and holds the padding value after them; the rank prefix matrix is the same."""
    problems = []
    for name, pad in FIXED_PADDING.items():
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
    problems += compare("fixed-size rank_prefix_matrix vs dispatch", fixed.get("rank_prefix_matrix"),
                        exact["rank_prefix_matrix"])
    return problems
