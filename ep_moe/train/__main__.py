"""``python -m ep_moe.train RECIPE.yaml [key=value ...]`` (what torchrun runs: ``torchrun --nproc-per-node N
-m ep_moe.train RECIPE.yaml``)."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
