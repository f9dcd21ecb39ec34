"""The V2 handle fields of `ep_moe.ElasticBuffer.dispatch` that DeepEP's clients read (``recv_src_metadata``,
``dst_buffer_slot_idx``), against definitions written here from every rank's inputs, at 1 to 3 gloo ranks: compact
and expanded layouts, exact and fixed size, cached dispatches keeping them."""

from __future__ import annotations

import pytest
import torch
from support.world_sizes import run_world_sizes
from support_core import Case, check, make_inputs

from ep_moe import ElasticBuffer

CASES = [Case("random", (), 128, 3, 0, "random", "bf16", 1),
         Case("aligned, one rank", (), 128, 4, 0, "one_rank", "fp32", 8),
         Case("sparse", (), 128, 2, 0, "sparse", "bf16", 1)]


def _received(idxs: list[torch.Tensor], rank: int, local: int) -> list[tuple[int, int]]:
    """(source rank, token) of every row rank ``rank`` receives, by source then token (docs/semantics.md)."""
    return [(s, t) for s, idx in enumerate(idxs) for t in range(idx.shape[0])
            if bool(((idx[t] >= 0) & (idx[t] // local == rank)).any())]


def _worker(rank: int, num_ranks: int, group) -> int:
    checked = 0
    for case in CASES:
        tokens = tuple(7 + 3 * s for s in range(num_ranks))
        case = Case(case.name, tokens, case.hidden, case.topk, 4 * num_ranks, case.kind, case.dtype, case.alignment)
        bound = max(tokens) + 2
        inp = make_inputs(case, num_ranks, seed=11)
        local = case.experts // num_ranks
        eb = ElasticBuffer(group, num_max_tokens_per_rank=bound, hidden=case.hidden, num_topk=case.topk,
                           explicitly_destroy=True)
        rows = _received(inp.idxs, rank, local)
        want_global = torch.tensor([s * bound + t for s, t in rows], dtype=torch.int32)
        idx_of = {(s, t): inp.idxs[s][t] for s, t in rows}
        for expand in (False, True):
            for sync in (True, False):
                where = f"{case.name} R={num_ranks} rank {rank} expand={expand} sync={sync}"
                recv_x, _, _, h, _ = eb.dispatch(inp.xs[rank], inp.idxs[rank], inp.weights[rank],
                                                 num_experts=case.experts, expert_alignment=case.alignment,
                                                 do_cpu_sync=sync, do_expand=expand)
                meta = h.recv_src_metadata
                n = len(rows)
                check(meta.dtype == torch.int32 and meta.shape[1] == 2 + case.topk, where, "metadata shape")
                check(meta.shape[0] == (n if sync else bound * num_ranks), where, "metadata rows")
                check(torch.equal(meta[:n, 0], want_global), where, "column 0: the source token's global index")
                check(bool((meta[n:] == -1).all()), where, "rows past the received ones are -1")
                for i, (s, t) in enumerate(rows):
                    mine = (idx_of[(s, t)] >= 0) & (idx_of[(s, t)] // local == rank)
                    first = int(mine.to(torch.int8).argmax())
                    check(int(meta[i, 1]) == s * case.topk + first, where, f"column 1 of row {i}")
                    slots = meta[i, 2:]
                    if not expand:
                        check(bool((slots == -1).all()), where, f"compact row {i} has no expanded rows")
                        continue
                    check(torch.equal(slots >= 0, mine), where, f"row {i}: an expanded row per local entry")
                    for k in mine.nonzero().flatten().tolist():  # the expanded row holds the source's token
                        check(torch.equal(recv_x[int(slots[k])], inp.xs[s][t]), where, f"row {i} entry {k}")
                # dst_buffer_slot_idx: every rank's entries, checked on the rank they name
                dst = h.dst_buffer_slot_idx
                check(dst.dtype == torch.int32 and dst.shape == inp.idxs[rank].shape, where, "dst shape")
                check(torch.equal(dst < 0, inp.idxs[rank] < 0), where, "dst -1 exactly where topk_idx is -1")
                every = [dst]
                if num_ranks > 1:  # padded to the token bound: gloo gathers equal shapes
                    padded = torch.full((bound, case.topk), -1, dtype=torch.int32)
                    padded[:dst.shape[0]] = dst
                    every = [torch.empty_like(padded) for _ in range(num_ranks)]
                    torch.distributed.all_gather(every, padded, group=group)
                for s in range(num_ranks):
                    for t in range(tokens[s]):
                        for k in range(case.topk):
                            e = int(inp.idxs[s][t, k])
                            if e >= 0 and e // local == rank:
                                row = int(every[s][t, k])
                                check(int(meta[row, 0]) == s * bound + t, where, f"dst of ({s}, {t}, {k})")
                # a cached dispatch returns the same handle, so the same fields
                cached = eb.dispatch(inp.xs[rank], handle=h)[3]
                check(cached is h and torch.equal(cached.dst_buffer_slot_idx, dst), where, "cached handle")
                checked += 1
        eb.destroy()
    return checked


@pytest.mark.timeout(300)
def test_v2_handle_fields():
    results = run_world_sizes(_worker, [1, 2, 3])
    for n, per_rank in results.items():
        assert per_rank == [len(CASES) * 4] * n, (n, per_rank)


def test_metadata_needs_the_token_bound():
    import torch.distributed as dist

    from ep_moe.distributed import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        eb = ElasticBuffer(explicitly_destroy=True)
        x = torch.randn(5, 128)
        idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [3, 2], [0, 3]])
        _, _, _, h, _ = eb.dispatch(x, idx, num_experts=4)
        assert h.recv_src_metadata is None  # V2 requires num_max_tokens_per_rank
        assert h.dst_buffer_slot_idx.tolist() == [[0, 0], [1, -1], [-1, -1], [2, 2], [3, 3]]  # token 2 goes nowhere
        eb.destroy()
    finally:
        dist.destroy_process_group()
