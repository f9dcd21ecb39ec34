"""One block of symmetric memory per EP group: the same size on every rank, every rank's copy
addressable from every GPU of the group (peer pointers), on `torch.distributed._symmetric_memory`.

The kernels only use unicast peer stores and loads: NVLink multicast stays off (`ep_moe.distributed.disable_multicast`,
when ``ep_moe`` is imported).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .sizing import align_up


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    from torch._C._distributed_c10d import _SymmetricMemory

    try:  # a block of its own (no pool): offsets within the allocation are the same on every rank
        return _SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device)
    except (TypeError, RuntimeError):
        import torch.distributed._symmetric_memory as symm_mem

        return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)


def _rendezvous(tensor: torch.Tensor, group: dist.ProcessGroup):
    import torch.distributed._symmetric_memory as symm_mem

    try:
        return symm_mem.rendezvous(tensor, group)
    except RuntimeError:
        # Older torch needs the group registered first (newer torch deprecates the call).
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group.group_name)
        return symm_mem.rendezvous(tensor, group)


class SymmetricBuffer:
    """``nbytes`` (rounded up to 2 MiB) of device memory on every rank of ``group``.

    Collective: every rank constructs it with the same size. ``ptrs[r]`` is the address, valid on this
    GPU, of rank ``r``'s copy; ``tensor`` is this rank's copy (uint8). Contents start undefined.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, nbytes: int) -> None:
        self.nbytes = align_up(max(int(nbytes), 1))
        self.group = group
        self.rank = dist.get_rank(group)
        with torch.cuda.device(device):
            self.tensor = _allocate(self.nbytes, device)
            self._handle = _rendezvous(self.tensor, group)
        base = list(self._handle.buffer_ptrs)
        offset = self.tensor.data_ptr() - base[self.rank]
        offsets: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(offsets, offset, group=group)
        if len(set(offsets)) != 1:
            raise RuntimeError(f"ep_moe: symmetric buffer landed at different offsets on the ranks ({offsets}); "
                               "set TORCH_SYMMMEM_IMPLICIT_POOL=0")
        self.ptrs: list[int] = [p + offset for p in base]
        self._offset = offset

    def peer_tensor(self, rank: int) -> torch.Tensor:
        """uint8 ``[nbytes]`` over rank ``rank``'s copy, addressable from this GPU (this rank's own is
        ``tensor``). Copies into it (``copy_``, the copy engine) land in the peer's memory."""
        if not 0 <= rank < len(self.ptrs):
            raise ValueError(f"ep_moe: argument 'rank' must be in [0, {len(self.ptrs)}), got {rank}")
        if rank == self.rank:
            return self.tensor
        return self._handle.get_buffer(rank, (self.nbytes,), torch.uint8, self._offset)

    def destroy(self) -> None:
        """Drop this rank's references (the memory is released once no rank maps it)."""
        self._handle = None
        self.tensor = None
        self.ptrs = []
