"""``ep-moe demo``: dispatch random tokens across spawned CPU ranks, combine them back, check the result."""

from __future__ import annotations

import argparse

import torch

from ..buffer.buffer_v1 import Buffer
from ..distributed import run_distributed


def _rank_main(rank: int, world_size: int, tokens: int, hidden: int, experts: int, topk: int) -> dict:
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=gen, dtype=torch.float32, device="cpu")
    topk_weights, topk_idx = scores.topk(topk, dim=1)
    buffer = Buffer(backend="torch")
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts)
    recv_x, recv_idx, recv_w, per_local_expert, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    combined, _, _ = buffer.combine(recv_x, handle)
    ranks_per_token = in_rank.sum(1, keepdim=True).to(torch.float32)
    expected = (x.float() * ranks_per_token).to(torch.bfloat16)
    return {"rank": rank, "sent": in_rank.sum().item(), "received": recv_x.shape[0],
            "per_local_expert": per_local_expert, "round_trip_ok": bool(torch.equal(combined, expected))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ep-moe demo", description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    args = parser.parse_args(argv)
    results = run_distributed(_rank_main, args.ranks, args.tokens, args.hidden, args.experts, args.topk)
    for r in results:
        print(f"rank {r['rank']}: sent {r['sent']} rows, received {r['received']}, "
              f"per local expert {r['per_local_expert']}, combine(dispatch(x)) == x * ranks: {r['round_trip_ok']}")
    return 0 if all(r["round_trip_ok"] for r in results) else 1
