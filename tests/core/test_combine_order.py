"""The combine's summation order is DeepEP V2's, bit for bit, on the torch backend over gloo (2 and 3 ranks).

The expected sums are written here as plain loops over each token's top-k list, from V2's recipe: a rank first
sums, per received token, its rows of that token in top-k order (fp32, one rounding: the compact combine's input
is such a partial row, the expanded combine forms it); the source starts from ``bias[0] + bias[1]`` in fp32 and
adds the ranks' partial rows in the order of each rank's last top-k position; one rounding. With
``allow_multiple_reduction=False`` the source adds every (token, k) row in top-k order. The rows span many
binades, so another order gives other bits: each case also checks that the increasing-rank order would differ.
"""

from __future__ import annotations

import pytest
import torch
from support.world_sizes import run_world_sizes
from support_core import check, check_bits

from ep_moe import ElasticBuffer

HIDDEN, TOPK = 64, 4


def _routing(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    """[T, K] distinct experts per token, in random order (so a rank's last position is not its rank order),
    a -1 entry in every fifth token and no expert at all in every seventh."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:TOPK] for _ in range(num_tokens)])
    idx[::5, 1] = -1
    idx[3::7] = -1
    return idx


def _pair_rows(global_token: torch.Tensor) -> torch.Tensor:
    """[n, K, H] bf16: the row of each (token, k), a function of the token's global index (as V2's test data)
    spanning 2^-4 .. 2^24 with both signs: large rows cancel, and what is left of the small ones depends on the
    order of the additions."""
    k = torch.arange(TOPK).view(1, TOPK, 1)
    h = torch.arange(HIDDEN).view(1, 1, HIDDEN)
    t = global_token.view(-1, 1, 1).to(torch.int64)
    seed = (t * 131 + k * 17 + h * 7) % 97
    magnitude = torch.exp2(((seed % 29) - 4).to(torch.float32))
    sign = torch.where(seed % 2 == 0, 1.0, -1.0)
    return (sign * magnitude * (1 + (seed % 13).to(torch.float32) / 16)).to(torch.bfloat16)


def _expected(rows: torch.Tensor, idx: torch.Tensor, experts_per_rank: int, bias: tuple, by_last: bool,
              reduce_per_rank: bool) -> torch.Tensor:
    """V2's combine of one source rank's tokens (``rows [T, K, H]``), as plain loops."""
    out = torch.zeros(rows.shape[0], HIDDEN, dtype=torch.float32)
    for t in range(rows.shape[0]):
        acc = torch.zeros(HIDDEN, dtype=torch.float32)
        for b in bias:
            if b is not None:
                acc = acc + b[t].float()
        ks = [k for k in range(TOPK) if idx[t, k] >= 0]
        if not reduce_per_rank:
            for k in ks:
                acc = acc + rows[t, k].float()
        else:
            ranks = sorted({int(idx[t, k]) // experts_per_rank for k in ks},
                           key=lambda r: max(k for k in ks if int(idx[t, k]) // experts_per_rank == r)
                           if by_last else r)
            for r in ranks:
                partial = torch.zeros(HIDDEN, dtype=torch.float32)
                for k in ks:
                    if int(idx[t, k]) // experts_per_rank == r:
                        partial = partial + rows[t, k].float()
                acc = acc + partial.to(torch.bfloat16).float()
        out[t] = acc
    return out.to(torch.bfloat16)


def _worker(rank: int, num_ranks: int, group, seed: int) -> bool:
    num_tokens, num_experts = 48, 4 * num_ranks
    experts_per_rank = num_experts // num_ranks
    where = f"R={num_ranks} rank={rank}"
    idx = _routing(num_tokens, num_experts, seed + rank)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    w = torch.rand(num_tokens, TOPK, generator=torch.Generator().manual_seed(rank + 100))
    w = torch.where(idx >= 0, w, torch.zeros_like(w))
    bias = tuple(torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(rank + 200 + i))
                 .to(torch.bfloat16) for i in range(2))
    mine = _pair_rows(rank * num_tokens + torch.arange(num_tokens))
    differs = False
    for allow_multiple_reduction in (True, False):
        eb = ElasticBuffer(group, num_max_tokens_per_rank=num_tokens, backend="torch", num_gpu_timeout_secs=60,
                           allow_multiple_reduction=allow_multiple_reduction)
        recv_x, recv_idx, _, handle, _ = eb.dispatch(x, idx, w, num_experts=num_experts)
        _, _, _, expanded, _ = eb.dispatch(x, idx, w, num_experts=num_experts, do_expand=True)
        meta = handle.recv_src_metadata[:handle.num_recv_tokens].to(torch.int64)
        rows = _pair_rows(meta[:, 0])  # [N, K, H]: the received tokens' (token, k) rows
        local = recv_idx[:handle.num_recv_tokens] >= 0
        partial = torch.zeros(rows.shape[0], HIDDEN, dtype=torch.float32)
        for k in range(TOPK):  # the compact combine's input: this rank's rows of each token, top-k order
            partial = torch.where(local[:, k:k + 1], partial + rows[:, k].float(), partial)
        for name, b in (("no bias", (None, None)), ("one bias", (bias[0], None)), ("two biases", bias)):
            arg = b if b[1] is not None else b[0]
            if allow_multiple_reduction:
                compact = torch.zeros_like(recv_x)
                compact[:handle.num_recv_tokens] = partial.to(torch.bfloat16)
                got = eb.combine(compact, handle, bias=arg)[0]
                want = _expected(mine, idx, experts_per_rank, b, by_last=True, reduce_per_rank=True)
                check_bits(got, want, where, f"compact combine, {name}")
                differs |= not torch.equal(want, _expected(mine, idx, experts_per_rank, b, False, True))
            if allow_multiple_reduction or b[0] is None:  # V2: no bias with the unreduced expanded combine
                emeta = expanded.recv_src_metadata[:expanded.num_recv_tokens].to(torch.int64)
                erows = _pair_rows(emeta[:, 0])
                y = torch.zeros(expanded.inner.layout.num_slots + 1, HIDDEN, dtype=torch.bfloat16)
                y[emeta[:, 2:].flatten()] = erows.reshape(-1, HIDDEN)  # -1 entries land in the spare last row
                got = eb.combine(y[:-1], expanded, bias=arg)[0]
                want = _expected(mine, idx, experts_per_rank, b, by_last=True,
                                 reduce_per_rank=allow_multiple_reduction)
                check_bits(got, want, where, f"expanded combine (allow_multiple_reduction="
                                             f"{allow_multiple_reduction}), {name}")
        eb.destroy()
    return differs


@pytest.mark.parametrize("seed", [0, 1])
def test_combine_adds_rows_in_deepep_v2_order(seed: int) -> None:
    results = run_world_sizes(_worker, [2, 3], seed)
    for num_ranks, differs in results.items():
        # the data must tell the orders apart somewhere, or the test would prove nothing
        check(any(differs), f"R={num_ranks}", "the increasing-rank order gives the same bits: the data is too mild")
