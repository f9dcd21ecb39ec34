"""Hybrid (two-hop) expert parallelism across nodes: the logical topology of a group (`topology`) and the
dispatch/combine backend that crosses the network once per destination node, chunk by chunk, overlapped with the
in-node hop (`backend`)."""

from .hybrid_backend import ENV_CHUNKS, ENV_SCALEUP, SCALEUP_MODES, HopTraffic, HybridBackend
from .node_topology import (
           ENV_SCALEOUT_RANKS,
           LogicalTopology,
           discover_topology,
           host_topology,
           logical_topology,
)

__all__ = ["ENV_CHUNKS", "ENV_SCALEOUT_RANKS", "ENV_SCALEUP", "SCALEUP_MODES", "HopTraffic", "HybridBackend",
           "LogicalTopology", "discover_topology", "host_topology", "logical_topology"]
