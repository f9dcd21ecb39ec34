"""ep_moe: expert-parallel token dispatch and combine for training Mixture-of-Experts models.

Main entry points:

* `Buffer`: DeepEP-style ``get_dispatch_layout`` / ``dispatch`` / ``combine`` for one EP group,
  on the ``native`` (NVLink kernels) or ``torch`` (torch.distributed) backend.
* `dispatch` / `combine` / `cached_dispatch`: the same, differentiable (torch.library custom ops).
* `TokenDispatcher`: what an MoE layer calls (groups received tokens by local expert).
"""

from .buffer import Buffer
from .config import Config
from .dispatcher import DispatchContext, TokenDispatcher
from .event import EventOverlap
from .handle import DispatchHandle
from .ops import DispatchOutput, cached_dispatch, combine, dispatch

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Config",
    "DispatchContext",
    "DispatchHandle",
    "DispatchOutput",
    "EventOverlap",
    "TokenDispatcher",
    "cached_dispatch",
    "combine",
    "dispatch",
]
