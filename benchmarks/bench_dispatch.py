#!/usr/bin/env python3
"""Dispatch/combine benchmark of every backend, on the same routing: the same program as
``ep-moe bench`` (see ``docs/benchmarks.md``; ``--help`` lists the options).

    python3 benchmarks/bench_dispatch.py --tokens 128 256 512 1024 2048 4096 8192 16384 --num-sms 8 16 24 32
    torchrun --nproc-per-node 2 benchmarks/bench_dispatch.py --json bench.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's ep_moe, installed or not

from ep_moe.cli.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
