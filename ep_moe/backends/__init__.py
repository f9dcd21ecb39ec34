"""Communication backends behind `ep_moe.Buffer`: ``torch`` (torch.distributed) and ``native`` (NVLink kernels)."""

from .comm_backend import CommBackend, DispatchResult

__all__ = ["CommBackend", "DispatchResult"]
