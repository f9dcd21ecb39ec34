"""ZeRO-1 data parallelism for the trainer (``train.zero_stage: 1``) over `ep_moe.ElasticBuffer` AGRS sessions.

A bucket is a list of parameters whose gradients are summed over one group of ``D`` ranks (the non-expert
parameters over the data-parallel world, the experts over the expert-data-parallel group,
`ep_moe.train.parallel`). Its parameters are split over the group's ranks by whole tensors, in model order, into
``D`` contiguous runs of about equal size (rank ``d`` owns run ``d``). Every step:

1. ``reduce_scatter`` of the flat fp32 gradients laid out as ``[D, S]`` (row ``d``: rank ``d``'s run, padded to
   the longest run ``S``): each rank receives the sums of its own parameters' gradients, added in fp32 in rank
   order (the order of `ep_moe.train.parallel.all_reduce_sum` with ``deterministic``), and the other parameters'
   gradients are dropped;
2. the global gradient norm from per-parameter fp32 squared sums (each rank computes its own parameters', an
   ``all_gather`` shares them), added in model order as `ep_moe.train.parallel.clip_grad_norm` does, so the norm
   and the clip factor are the same numbers;
3. AdamW steps only this rank's parameters (its optimizer holds state for them alone: the ZeRO-1 saving);
4. ``all_gather`` of every rank's updated run (from an in-place tensor of the session, no local copy) into every
   rank's parameters.

With ``train.deterministic`` the losses equal the default (all-reduce) trainer's bit for bit. The AGRS buffers use
the torch backend (AGRS runs over torch.distributed on every backend).

Checkpoints: before a save every rank gathers its bucket groups' optimizer state (`ZeroOne.full_optimizer_state`),
so the checkpoint is the default trainer's format (it loads with or without ZeRO-1, at any EP size); a load keeps
the state of this rank's own parameters only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..elastic.elastic_buffer import ElasticBuffer
from .parallel import ParallelState, all_reduce_sum


def split_runs(sizes: list[int], num_ranks: int) -> list[tuple[int, int]]:
    """``num_ranks`` contiguous ``[begin, end)`` runs of the parameter indices whose element counts ``sizes``
    are split about evenly (a run may be empty): index ``i`` goes to the rank whose share holds the middle of
    its elements."""
    total = sum(sizes)
    owner, start = [], 0
    for n in sizes:
        middle = start + n / 2
        owner.append(min(num_ranks - 1, int(middle * num_ranks // max(total, 1))))
        start += n
    runs = []
    for d in range(num_ranks):
        members = [i for i, o in enumerate(owner) if o == d]
        begin = members[0] if members else (runs[-1][1] if runs else 0)
        runs.append((begin, members[-1] + 1 if members else begin))
    return runs


class ZeroBucket:
    """One bucket's sharding over ``group`` (see the module docstring). Collective over ``group`` to build."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup, device: torch.device,
                 timeout_s: float) -> None:
        self.params, self.group, self.device = params, group, device
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.runs = split_runs([p.numel() for p in params], self.size)
        self.offsets = []  # element offset of each parameter inside its run
        for begin, end in self.runs:
            offset = 0
            for i in range(begin, end):
                self.offsets.append(offset)
                offset += params[i].numel()
        self.run_numel = max(1, max(sum(params[i].numel() for i in range(b, e)) for b, e in self.runs))
        begin, end = self.runs[self.rank]
        self.owned = params[begin:end]
        self.buffer = None
        if self.size > 1:
            # a step's session: the gradients' reduce-scatter, the squared sums' and the runs' all-gathers
            session = ElasticBuffer.get_agrs_num_max_session_bytes(
                group, [(self.run_numel,), (len(params),), (self.run_numel,)], torch.float32)
            self.buffer = ElasticBuffer(group, num_bytes=ElasticBuffer.get_agrs_buffer_size_hint(group, session),
                                        backend="torch", num_gpu_timeout_secs=timeout_s, explicitly_destroy=True)
            self.buffer.agrs_set_config(session, 3)

    def reduce_gradients(self) -> torch.Tensor:
        """Step 1 and the squared sums of step 2: this rank's parameters get their summed gradients, the others
        none. Returns every parameter's fp32 squared gradient sum ``[P]`` (the same on every rank)."""
        if self.buffer is None:  # nothing to sum; as clip_grad_norm, parameters without a gradient do not count
            return self._squares([p for p in self.params if p.grad is not None])
        rows = torch.zeros(self.size, self.run_numel, dtype=torch.float32, device=self.device)
        for d, (begin, end) in enumerate(self.runs):
            for i in range(begin, end):
                p = self.params[i]
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                rows[d, self.offsets[i]: self.offsets[i] + p.numel()] = grad.reshape(-1).float()
        self.buffer.create_agrs_session()
        shard, handle = self.buffer.reduce_scatter(rows)
        handle()
        begin, end = self.runs[self.rank]
        for p in self.params:
            p.grad = None
        for i in range(begin, end):
            p = self.params[i]
            p.grad = shard[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p).to(p.dtype).clone()
        mine = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)
        if end > begin:
            mine[begin:end] = self._squares(self.owned)
        (table,), handle = self.buffer.all_gather([mine])
        handle()
        # Each column has one non-zero row (its owner's), so the sum over ranks is that value exactly.
        return table.sum(dim=0)

    @staticmethod
    def _squares(params: list[torch.nn.Parameter]) -> torch.Tensor:
        if not params:
            return torch.zeros(0, dtype=torch.float32, device="cpu")
        return torch.stack([(p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
                            .pow(2).sum() for p in params])

    def gather_parameters(self) -> None:
        """Step 4: every rank's updated parameters into every rank's copy; closes the step's session."""
        if self.buffer is None:
            return
        run = self.buffer.agrs_get_inplace_tensor((self.run_numel,), torch.float32)
        run.zero_()
        begin, end = self.runs[self.rank]
        for i in range(begin, end):
            p = self.params[i]
            run[self.offsets[i]: self.offsets[i] + p.numel()] = p.detach().reshape(-1).float()
        (table,), handle = self.buffer.all_gather([run])
        handle()
        with torch.no_grad():
            for d, (b, e) in enumerate(self.runs):
                if d == self.rank:
                    continue
                for i in range(b, e):
                    p = self.params[i]
                    p.copy_(table[d, self.offsets[i]: self.offsets[i] + p.numel()].view_as(p))
        self.buffer.destroy_agrs_session()

    def gather_optimizer_state(self, state: Mapping[torch.nn.Parameter, dict[str, Any]]
                               ) -> dict[torch.nn.Parameter, dict[str, Any]]:
        """Every parameter's optimizer state in this bucket, each from the rank that owns it (collective over the
        group; tensors land on the parameters' device)."""
        if self.buffer is None:
            return {p: state[p] for p in self.params if p in state}
        begin, end = self.runs[self.rank]
        mine = {i: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state[self.params[i]].items()}
                for i in range(begin, end) if self.params[i] in state}
        parts: list = [None] * self.size
        dist.all_gather_object(parts, mine, group=self.group)
        out = {}
        for d, part in enumerate(parts):
            for i, entry in part.items():
                p = self.params[i]
                out[p] = state[p] if d == self.rank else {
                    k: v.to(p.device) if isinstance(v, torch.Tensor) and v.ndim else v for k, v in entry.items()}
        return out

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()


class ZeroOne:
    """ZeRO-1 over the trainer's two buckets. Build with every rank (collective); give the optimizer
    `owned_parameters`; per step call `reduce_and_clip`, ``optimizer.step()``, then `gather_parameters`."""

    def __init__(self, non_expert: list[torch.nn.Parameter], expert: list[torch.nn.Parameter], ps: ParallelState,
                 timeout_s: float) -> None:
        self.ps = ps
        self.non_expert = ZeroBucket(non_expert, ps.dp_group, ps.device, timeout_s)
        self.expert = ZeroBucket(expert, ps.expert_dp_group, ps.device, timeout_s)

    def owned_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters this rank's optimizer steps (its runs of both buckets)."""
        return self.non_expert.owned + self.expert.owned

    def reduce_and_clip(self, max_norm: float) -> float:
        """Sum gradients (this rank's parameters only) and clip them by the global norm, as
        `ep_moe.train.parallel.clip_grad_norm` computes it; returns the norm before clipping."""
        non_expert_sq = self.non_expert.reduce_gradients()
        expert_sq = self.expert.reduce_gradients()

        def total(squares: torch.Tensor) -> torch.Tensor:
            if not squares.numel():
                return torch.zeros((), dtype=torch.float64, device=self.ps.device)
            return squares.to(self.ps.device).double().sum()

        expert_total = total(expert_sq).reshape(1)
        all_reduce_sum(expert_total, self.ps.ep_group, self.ps.deterministic)
        norm = float(torch.sqrt(total(non_expert_sq) + expert_total[0]))
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.owned_parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def gather_parameters(self) -> None:
        self.non_expert.gather_parameters()
        self.expert.gather_parameters()

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[torch.nn.Parameter, dict[str, Any]]:
        """The optimizer state of every parameter of both buckets, as an unsharded optimizer would hold it (for a
        checkpoint). Collective."""
        return {**self.non_expert.gather_optimizer_state(optimizer.state),
                **self.expert.gather_optimizer_state(optimizer.state)}

    def close(self) -> None:
        self.non_expert.close()
        self.expert.close()


__all__ = ["ZeroBucket", "ZeroOne", "split_runs"]
