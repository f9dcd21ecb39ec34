"""``python -m ep_moe.native``: the environment report of ``ep-moe env`` (versions, GPUs, whether the native
kernels are built, and why not)."""

import sys

from ep_moe.cli.env import main

sys.exit(main())
