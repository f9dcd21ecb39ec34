"""ep_moe: expert-parallel token dispatch and combine for training Mixture-of-Experts models.

The public surface, DeepEP-shaped:

* `Buffer` (V1: ``get_dispatch_layout`` / ``dispatch`` / ``combine`` for one EP group, on the ``native`` or
  ``torch`` backend), its `DispatchHandle`, `Config` and `EventOverlap`;
* `ElasticBuffer` (V2: compact and expanded layouts, Engram, PP, AGRS) and its `ElasticHandle`;
* the differentiable ops: `dispatch` / `combine` / `cached_dispatch` and the expert-major `expert_dispatch` /
  `expert_combine` / `expert_cached_dispatch`;
* `TokenDispatcher` (what an MoE layer calls) and `MoELayer`.

Everything else is imported from its module (`ep_moe.config.NativeOptions`, `ep_moe.buffer.autograd_ops`, ...;
docs/architecture.md maps them). Importing this package changes no environment variable: NVLink multicast is
switched off where a buffer is made or a rank joins its group (`ep_moe.distributed.disable_multicast`).
"""

from .buffer.autograd_ops import cached_dispatch, combine, dispatch
from .buffer.buffer_v1 import Buffer
from .buffer.dispatch_handle import DispatchHandle
from .buffer.event_overlap import EventOverlap
from .buffer.expert_major_ops import expert_cached_dispatch, expert_combine, expert_dispatch
from .config import Config
from .elastic.elastic_buffer import ElasticBuffer, ElasticHandle
from .layers.moe import MoELayer
from .token_dispatcher import TokenDispatcher

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Config",
    "DispatchHandle",
    "ElasticBuffer",
    "ElasticHandle",
    "EventOverlap",
    "MoELayer",
    "TokenDispatcher",
    "cached_dispatch",
    "combine",
    "dispatch",
    "expert_cached_dispatch",
    "expert_combine",
    "expert_dispatch",
]
