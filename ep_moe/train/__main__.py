"""``python -m ep_moe.train RECIPE.yaml [key=value ...]`` (what torchrun runs: ``torchrun --nproc-per-node N
-m ep_moe.train RECIPE.yaml``)."""

import gc
import sys

from . import main

if __name__ == "__main__":
    # What is imported by now (torch, ep_moe) is never garbage: kept out of every collection, the collector has
    # far less to walk, at this process's exit above all (about 0.4 s less per command).
    gc.freeze()
    sys.exit(main())
