"""``python -m ep_moe.native``: whether the native kernels can run here, and why not (`ep_moe.native.report`;
``ep-moe env`` prints the same and the rest of the installation)."""

import sys

from .report import ITEMS, format_report

print(format_report(ITEMS), flush=True)
sys.exit(0)
