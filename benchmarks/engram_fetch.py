"""Engram fetch from GPU-mapped host memory against the host-to-device copy rate of the same bytes.

    python3 benchmarks/engram_fetch.py                               # one GPU: elastic memory, one rank
    torchrun --nproc-per-node 8 benchmarks/engram_fetch.py           # one node: hybrid memory, direct path

Each rank writes a ``[n, row_bytes / 2]`` bf16 table into its host segment (`ElasticBuffer.engram_write`), then
fetches ``tokens x entries`` random global ids (default 64k x 8 rows of 1 KiB = 512 MiB) with
`ElasticBuffer.engram_fetch`; the rows are read by a gather kernel straight from the mapped host memory. In the
same run it times ``copy_`` of the same number of bytes from pinned host memory to the device (the copy engine,
the rate a fetch staged through the host could at best reach). Prints the median of ``--iters`` runs of each, GB/s
(1e9 bytes / s), and their ratio (the goal: >= 0.8). The first fetch is checked against a gather of the table on
the device.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ep_moe import ElasticBuffer
from ep_moe.benchmarking.timing import median_event_seconds
from ep_moe.distributed import launch


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
    fetched, _ = eb.engram_fetch(indices)()
    if num_ranks == 1:  # the check: the same gather from a device copy of the table
        if not torch.equal(fetched.view(torch.int16), table[indices.long()].view(torch.int16)):
            raise AssertionError("engram_fetch differs from indexing the table")
    del table
    num_bytes = fetched.numel() * fetched.element_size()
    del fetched
    fetch_s = median_event_seconds(lambda: eb.engram_fetch(indices)(), args.iters)
    pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    copy_s = median_event_seconds(lambda: target.copy_(pinned, non_blocking=True), args.iters)
    result = {"rank": rank, "memory_type": eb.memory_type, "bytes": num_bytes, "fetch_gbs": num_bytes / fetch_s / 1e9,
              "h2d_gbs": num_bytes / copy_s / 1e9}
    eb.destroy()
    dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--entries", type=int, default=8, help="entries fetched per token (P)")
    parser.add_argument("--row-bytes", type=int, default=1024, help="bytes per table row (bf16)")
    parser.add_argument("--table-entries", type=int, default=262144, help="rows per rank (n)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=1, help="ranks when not under torchrun (one GPU each)")
    args = parser.parse_args()
    for result in launch(_run, args.nproc, args, device_type="cuda"):
        print(f"rank {result['rank']} ({result['memory_type']} memory): engram_fetch {result['fetch_gbs']:.1f} GB/s, "
              f"host-to-device copy {result['h2d_gbs']:.1f} GB/s of the same {result['bytes'] / 2**20:.0f} MiB: "
              f"{result['fetch_gbs'] / result['h2d_gbs']:.2f} of it")


if __name__ == "__main__":
    main()
