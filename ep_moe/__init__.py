"""ep_moe: expert-parallel token dispatch and combine for training Mixture-of-Experts models.

Main entry points:

* `Buffer`: DeepEP-style ``get_dispatch_layout`` / ``dispatch`` / ``combine`` for one EP group,
  on the ``native`` (NVLink kernels) or ``torch`` (torch.distributed) backend.
* `dispatch` / `combine` / `cached_dispatch`: the same, differentiable (torch.library custom ops).
* `expert_dispatch` / `expert_combine` / `expert_cached_dispatch`: the expert-major layout (rows grouped by local
  expert for a grouped GEMM), the weighted combine and the cached dispatch, differentiable.
* `ElasticBuffer`: DeepEP V2's buffer API (compact and expanded layouts, cached and fixed-size dispatch) on a
  `Buffer`.
* `TokenDispatcher`: what an MoE layer calls (the expert-major dispatch and combine, SM counts planned).
"""

from .distributed import disable_multicast

# Before anything of this package (or the caller) creates symmetric memory or an NCCL communicator.
disable_multicast()

from .buffer import Buffer  # noqa: E402
from .config import Config, NativeOptions  # noqa: E402
from .dispatcher import DispatchContext, TokenDispatcher  # noqa: E402
from .elastic import ElasticBuffer, ElasticHandle  # noqa: E402
from .event import EventOverlap  # noqa: E402
from .expert_major import (  # noqa: E402
    ExpertDispatchOutput,
    ExpertHandle,
    expert_cached_dispatch,
    expert_combine,
    expert_dispatch,
)
from .handle import DispatchHandle  # noqa: E402
from .ops import DispatchOutput, cached_dispatch, combine, dispatch  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Config",
    "DispatchContext",
    "DispatchHandle",
    "DispatchOutput",
    "ElasticBuffer",
    "ElasticHandle",
    "EventOverlap",
    "ExpertDispatchOutput",
    "ExpertHandle",
    "NativeOptions",
    "TokenDispatcher",
    "cached_dispatch",
    "combine",
    "dispatch",
    "expert_cached_dispatch",
    "expert_combine",
    "expert_dispatch",
]
