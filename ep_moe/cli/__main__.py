"""``python -m ep_moe.cli COMMAND ...`` (the same as ``ep-moe COMMAND ...``)."""

import sys

from . import main

sys.exit(main())
