"""Engram fetch from GPU-mapped host memory against the host-to-device copy rate of the same bytes.

    python3 benchmarks/engram_fetch.py                               # one GPU: elastic memory, one rank
    torchrun --nproc-per-node 8 benchmarks/engram_fetch.py           # one node: hybrid memory, direct path

Each rank writes a ``[n, row_bytes / 2]`` bf16 table into its host segment (`ElasticBuffer.engram_write`), then
fetches ``tokens x entries`` random global ids (default 64k x 8 rows of 1 KiB = 512 MiB) with
`ElasticBuffer.engram_fetch`; the rows are read by a gather kernel straight from the mapped host memory. In the
same run it times ``copy_`` of the same number of bytes from pinned host memory to the device (the copy engine,
the rate a fetch staged through the host could at best reach). Prints the median of ``--iters`` runs of each, GB/s
(1e9 bytes / s), and their ratio (the goal: >= 0.8).

Checked on every rank, bit for bit: the first fetch and the last timed one (kept by the timed call) against the
same rows gathered on the device from every rank's table (each rank's broadcast in turn: an exchange that shares
nothing with the Engram path), and the host-to-device copy's last destination against its pinned source. Each
rank's line ends with ``check ok`` or ``check DIFF``; a mismatch is printed (rank, call, first differing element)
and the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from _checked import gather_problems, mismatch, report, verdict

from ep_moe import ElasticBuffer
from ep_moe.benchmarking.timing import median_event_seconds
from ep_moe.distributed import launch


def _expected(table: torch.Tensor, indices: torch.Tensor, rank: int, num_ranks: int) -> torch.Tensor:
    """``concat(tables)[indices]`` (entry ``i`` is row ``i % n`` of rank ``i // n``), gathered on the device, each
    rank's table broadcast in turn (collective)."""
    n, flat = table.shape[0], indices.reshape(-1).long()
    want = torch.empty(flat.numel(), table.shape[1], dtype=table.dtype, device=table.device)
    for owner in range(num_ranks):
        rows = table if owner == rank else torch.empty_like(table)
        if num_ranks > 1:
            dist.broadcast(rows, src=owner)
        mine = flat // n == owner
        want[mine] = rows[flat[mine] % n]
    return want.view(*indices.shape, table.shape[1])


def _run(rank: int, num_ranks: int, args: argparse.Namespace) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    hidden = args.row_bytes // 2
    table_bytes = args.table_entries * args.row_bytes
    eb = ElasticBuffer(None, num_cpu_bytes=table_bytes + (1 << 20), explicitly_destroy=True)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    table = torch.randn(args.table_entries, hidden, generator=gen, device=device).to(torch.bfloat16)
    eb.engram_write(table)
    indices = torch.randint(0, num_ranks * args.table_entries, (args.tokens, args.entries), generator=gen,
                            device=device, dtype=torch.int32)
    want = _expected(table, indices, rank, num_ranks)
    del table
    fetched, _ = eb.engram_fetch(indices)()
    problems = [p for p in [mismatch("first engram_fetch", fetched, want, None)] if p]
    num_bytes = fetched.numel() * fetched.element_size()
    del fetched
    last = {}

    def fetch() -> None:
        last["fetched"], _ = eb.engram_fetch(indices)()

    fetch_s = median_event_seconds(fetch, args.iters)
    problems += [p for p in [mismatch("last timed engram_fetch", last.pop("fetched"), want, None)] if p]
    del want
    source = torch.randint(0, 256, (num_bytes,), generator=gen, dtype=torch.uint8, device=device)
    pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(source)  # random bytes, so that a copy left undone shows
    target = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
    copy_s = median_event_seconds(lambda: target.copy_(pinned, non_blocking=True), args.iters)
    problems += [p for p in [mismatch("last timed host-to-device copy", target, source, None)] if p]
    problems = gather_problems(problems)
    result = {"rank": rank, "memory_type": eb.memory_type, "bytes": num_bytes, "fetch_gbs": num_bytes / fetch_s / 1e9,
              "h2d_gbs": num_bytes / copy_s / 1e9, "check": verdict([p for p in problems
                                                                      if p.startswith(f"rank {rank}: ")]),
              "problems": problems}
    eb.destroy()
    dist.barrier()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--entries", type=int, default=8, help="entries fetched per token (P)")
    parser.add_argument("--row-bytes", type=int, default=1024, help="bytes per table row (bf16)")
    parser.add_argument("--table-entries", type=int, default=262144, help="rows per rank (n)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=1, help="ranks when not under torchrun (one GPU each)")
    args = parser.parse_args()
    results = launch(_run, args.nproc, args, device_type="cuda")
    for result in results:
        print(f"rank {result['rank']} ({result['memory_type']} memory): engram_fetch {result['fetch_gbs']:.1f} GB/s, "
              f"host-to-device copy {result['h2d_gbs']:.1f} GB/s of the same {result['bytes'] / 2**20:.0f} MiB: "
              f"{result['fetch_gbs'] / result['h2d_gbs']:.2f} of it; check {result['check']}")
    problems = results[0]["problems"]  # every rank's, gathered on each
    if results[0]["rank"] != 0:  # another rank's process under torchrun: rank 0 reports
        return 1 if problems else 0
    return report("engram_fetch", problems)


if __name__ == "__main__":
    sys.exit(main())
