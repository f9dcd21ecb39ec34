"""Hybrid (two-hop) expert parallelism across nodes: the logical topology of a group (`topology`) and the
dispatch/combine backend that crosses the network once per destination node (`backend`)."""

from .backend import HopTraffic, HybridBackend
from .topology import ENV_SCALEOUT_RANKS, LogicalTopology, discover_topology, host_topology, logical_topology

__all__ = ["ENV_SCALEOUT_RANKS", "HopTraffic", "HybridBackend", "LogicalTopology", "discover_topology", "host_topology",
           "logical_topology"]
