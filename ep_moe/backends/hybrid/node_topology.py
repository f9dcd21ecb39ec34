"""The logical topology of an EP group: ``num_scaleout_ranks x num_scaleup_ranks`` (nodes x ranks per node).

Found from the launch (one all-gather of each rank's node key, `node_key`): under torchrun a node is one agent
(``GROUP_RANK``, with ``LOCAL_WORLD_SIZE`` ranks), under SLURM one ``SLURM_NODEID``, else one host name
(``socket.gethostname()``). Ranks with one key form a node, numbered by their lowest rank; a rank's local index
is its place among its node's ranks in rank order. The launch's keys count even where the host names are equal
(two agents on one machine are two nodes). Every node must hold the same number of ranks, else the group is
viewed flat (1 x R, logged). Overridable: the
``num_scaleout_ranks`` argument or the ``EP_MOE_SCALEOUT_RANKS`` variable cut the group into that many nodes of
consecutive ranks (8 ranks as 2 x 4: ranks 0-3 are node 0), which is how CPU tests simulate nodes on one host.
``allow_hybrid_mode=False`` gives the flat view.

Not to be confused with `ep_moe.tuning.machine_topology` (NVLink link discovery for the bandwidth model).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger("ep_moe")

ENV_SCALEOUT_RANKS = "EP_MOE_SCALEOUT_RANKS"
"""Environment override of the number of scale-out ranks (logical nodes of consecutive ranks)."""


@dataclass(frozen=True)
class LogicalTopology:
    """Which logical node and local index every rank of a group has.

    Attributes:
        node_of: ``node_of[r]``, the scale-out index of group rank r.
        local_of: ``local_of[r]``, its scale-up index inside its node.
        source: how it was found: "flat", "launch" (torchrun's agents or SLURM's nodes), "hosts" or
            "override".
    """

    node_of: tuple[int, ...]
    local_of: tuple[int, ...]
    source: str = "flat"

    def __post_init__(self) -> None:
        if len(self.node_of) != len(self.local_of) or not self.node_of:
            raise ValueError("LogicalTopology: argument 'node_of' and 'local_of' must be non-empty and of one length")
        slots = set(zip(self.node_of, self.local_of))
        if len(slots) != len(self.node_of) or slots != {(n, lo) for n in range(self.num_scaleout_ranks)
                                                        for lo in range(self.num_scaleup_ranks)}:
            raise ValueError("LogicalTopology: every (node, local index) of the S x G grid must be one rank, got "
                             f"node_of={self.node_of}, local_of={self.local_of}")

    @property
    def num_ranks(self) -> int:
        return len(self.node_of)

    @property
    def num_scaleout_ranks(self) -> int:
        """S: nodes (NVLink domains) of the group."""
        return max(self.node_of) + 1

    @property
    def num_scaleup_ranks(self) -> int:
        """G: ranks per node."""
        return max(self.local_of) + 1

    @property
    def is_hybrid(self) -> bool:
        """More than one scale-out rank: dispatch and combine take two hops."""
        return self.num_scaleout_ranks > 1

    def rank_at(self, node: int, local: int) -> int:
        """The group rank of (node, local index)."""
        return self._grid()[node][local]

    def _grid(self) -> list[list[int]]:
        grid = [[-1] * self.num_scaleup_ranks for _ in range(self.num_scaleout_ranks)]
        for r, (n, lo) in enumerate(zip(self.node_of, self.local_of)):
            grid[n][lo] = r
        return grid

    def scaleout_members(self, local: int) -> list[int]:
        """Group ranks of the scale-out hop of local index ``local``, by node."""
        return [row[local] for row in self._grid()]

    def scaleup_members(self, node: int) -> list[int]:
        """Group ranks of node ``node``, by local index."""
        return list(self._grid()[node])

    @staticmethod
    def flat(num_ranks: int) -> LogicalTopology:
        """One node of every rank (1 x R)."""
        return LogicalTopology((0,) * num_ranks, tuple(range(num_ranks)), "flat")

    @staticmethod
    def blocks(num_ranks: int, num_scaleout_ranks: int, source: str = "override") -> LogicalTopology:
        """``num_scaleout_ranks`` nodes of consecutive ranks."""
        if (not isinstance(num_scaleout_ranks, int) or isinstance(num_scaleout_ranks, bool) or num_scaleout_ranks < 1
                or num_ranks % num_scaleout_ranks):
            raise ValueError(f"LogicalTopology: argument 'num_scaleout_ranks' must be a positive divisor of the "
                             f"group size {num_ranks}, got {num_scaleout_ranks!r}")
        per_node = num_ranks // num_scaleout_ranks
        return LogicalTopology(tuple(r // per_node for r in range(num_ranks)),
                               tuple(r % per_node for r in range(num_ranks)), source)

    @staticmethod
    def from_hosts(hosts: list[str], source: str = "hosts") -> LogicalTopology:
        """Nodes from each rank's host name (or any node key, `node_key`); flat (logged) when the hosts hold
        different numbers of ranks. ``source``: the view's source when it has more than one node."""
        order: dict[str, int] = {}
        for h in hosts:
            order.setdefault(h, len(order))
        sizes = [sum(1 for h in hosts if h == name) for name in order]
        if len(set(sizes)) != 1:
            log.warning("ep_moe: hosts hold different numbers of ranks (%s); viewing the group flat (1 x %d)",
                        dict(zip(order, sizes)), len(hosts))
            return LogicalTopology.flat(len(hosts))
        seen: dict[str, int] = {}
        local = []
        for h in hosts:
            local.append(seen.get(h, 0))
            seen[h] = local[-1] + 1
        return LogicalTopology(tuple(order[h] for h in hosts), tuple(local), source if len(order) > 1 else "flat")


def _env_scaleout_ranks() -> int | None:
    value = os.environ.get(ENV_SCALEOUT_RANKS, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"ep_moe: environment variable {ENV_SCALEOUT_RANKS} must be an int, got {value!r}") from None


LAUNCH_NODE_VARIABLES = ("GROUP_RANK", "SLURM_NODEID")
"""The launchers' node index of this process, first found wins: torchrun's agent (``GROUP_RANK``, which
torchrun sets with ``LOCAL_WORLD_SIZE``), SLURM's node (``SLURM_NODEID``)."""


def node_key() -> tuple[str, str]:
    """This process's node as ``(source, key)``: ``("launch", "GROUP_RANK=1")`` under torchrun (the agent's
    index: agents on one host are distinct nodes), ``("launch", "SLURM_NODEID=0")`` under srun, else
    ``("hosts", <host name>)``."""
    for name in LAUNCH_NODE_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return "launch", f"{name}={value}"
    return "hosts", socket.gethostname()


def host_topology(group: dist.ProcessGroup | None = None) -> LogicalTopology:
    """The physical view of ``group``: nodes are the launch's nodes (`node_key`: torchrun agents, SLURM nodes,
    else hosts), from one all-gather of the keys (every rank of ``group`` calls it). Ranks that disagree on
    where their keys come from (some under a launcher, some not) are grouped by host name."""
    group = group if group is not None else dist.group.WORLD
    keys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, (node_key(), socket.gethostname()), group=group)
    sources = {k[0][0] for k in keys}
    if len(sources) == 1 and sources != {"hosts"}:
        return LogicalTopology.from_hosts([str(k[0][1]) for k in keys], "launch")
    return LogicalTopology.from_hosts([str(k[1]) for k in keys])


def logical_topology(physical: LogicalTopology | None, num_ranks: int, allow_hybrid_mode: bool = True,
                     num_scaleout_ranks: int | None = None) -> LogicalTopology:
    """The logical view: flat without ``allow_hybrid_mode``; else ``num_scaleout_ranks`` (or, when None,
    ``EP_MOE_SCALEOUT_RANKS``) nodes of consecutive ranks (a ValueError naming the argument unless it divides
    ``num_ranks``); else ``physical`` (which may then not be None)."""
    if not allow_hybrid_mode:
        return LogicalTopology.flat(num_ranks)
    override = num_scaleout_ranks if num_scaleout_ranks is not None else _env_scaleout_ranks()
    if override is not None:
        return LogicalTopology.blocks(num_ranks, override)
    if physical is None:
        raise ValueError("logical_topology: argument 'physical' must be given without an override")
    return physical


def discover_topology(group: dist.ProcessGroup | None = None, allow_hybrid_mode: bool = True,
                      num_scaleout_ranks: int | None = None) -> LogicalTopology:
    """The logical topology of ``group`` (None: the world), the same on every rank (`logical_topology`); the
    host names are gathered (a collective of the group) only when no override decides it."""
    group = group if group is not None else dist.group.WORLD
    num_ranks = dist.get_world_size(group)
    needs_hosts = allow_hybrid_mode and num_scaleout_ranks is None and _env_scaleout_ranks() is None
    return logical_topology(host_topology(group) if needs_hosts else None, num_ranks, allow_hybrid_mode,
                            num_scaleout_ranks)


__all__ = ["ENV_SCALEOUT_RANKS", "LAUNCH_NODE_VARIABLES", "LogicalTopology", "node_key", "discover_topology", "host_topology", "logical_topology"]
