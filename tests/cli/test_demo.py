"""``ep-moe demo``: a dispatch + combine round trip on spawned CPU ranks (torch backend) that checks
``combine(dispatch(x)) == x * ranks``, one line per rank; exit 0 when it holds on every rank, else 1."""

from __future__ import annotations

import re

from ep_moe.cli import demo
from ep_moe.cli import main as ep_moe_main

LINE = re.compile(r"rank (\d+): sent (\d+) rows, received (\d+), per local expert \[([\d, ]*)\], "
                  r"combine\(dispatch\(x\)\) == x \* ranks: (True|False)")


def test_demo_round_trip_on_two_ranks(capsys):
    ranks, tokens, experts, topk = 2, 16, 8, 2
    rc = ep_moe_main(["demo", "--ranks", str(ranks), "--tokens", str(tokens), "--hidden", "32",
                      "--experts", str(experts), "--topk", str(topk)])
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == ranks, out
    rows = [LINE.fullmatch(line) for line in lines]
    assert all(rows), out
    assert [int(m.group(1)) for m in rows] == list(range(ranks))
    assert all(m.group(5) == "True" for m in rows), out
    assert rc == 0
    sent = [int(m.group(2)) for m in rows]
    received = [int(m.group(3)) for m in rows]
    per_expert = [[int(n) for n in m.group(4).split(",")] for m in rows]
    # Every row a rank sends arrives at one rank; a token goes to each rank holding one of its experts.
    assert sum(sent) == sum(received)
    assert all(tokens <= s <= tokens * min(topk, ranks) for s in sent)
    # Each rank holds experts / ranks experts, and every (token, chosen expert) pair reaches exactly one of them.
    assert all(len(counts) == experts // ranks for counts in per_expert)
    assert sum(map(sum, per_expert)) == ranks * tokens * topk


def test_demo_exits_1_when_a_rank_does_not_get_its_tokens_back(capsys, monkeypatch):
    results = [{"rank": 0, "sent": 3, "received": 3, "per_local_expert": [2, 2], "round_trip_ok": True},
               {"rank": 1, "sent": 3, "received": 3, "per_local_expert": [1, 1], "round_trip_ok": False}]
    monkeypatch.setattr(demo, "run_distributed", lambda fn, world, *args: results)
    assert ep_moe_main(["demo", "--tokens", "2", "--experts", "4"]) == 1
    out = capsys.readouterr().out
    assert "rank 1: sent 3 rows, received 3, per local expert [1, 1], combine(dispatch(x)) == x * ranks: False" in out
