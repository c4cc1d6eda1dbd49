"""Shard groups: which sharded parameters are gathered and reduce-scattered together.

The executor gathers the full regions of sharded parameters (``ParallelConfig.shard``
levels 1-3) in *units*, as FSDP wraps a block of layers: one all-gather (and at levels
2-3 one reduce-scatter) per unit instead of per parameter.  Which parameters may share
a unit is a function of the graph alone (:func:`shard_groups`), so that the executor and
the simulator's memory model (:mod:`flexflow.sim.memory`) agree on it under every
strategy: the graph's parameters, in the order of their first use, taken a *cluster*
(the parameters read by the same set of ops) at a time and packed into consecutive
groups of up to :data:`SHARD_UNIT_BYTES` of full parameters (a group is closed by the
cluster that reaches the cap).  The executor's unit is then a group's sharded
parameters with one group of ranks, dtype and level.
"""
from __future__ import annotations

import math

from ..graph.ir import OpGraph, dtype_bytes

__all__ = ["SHARD_UNIT_BYTES", "shard_groups"]

SHARD_UNIT_BYTES = 1 << 20  # full parameters of one gather unit, at most (a cluster may exceed it alone)


def shard_groups(graph: OpGraph, cap_bytes: int = SHARD_UNIT_BYTES) -> dict[str, int]:
    """Parameter (qualified name) -> its shard group, groups numbered in the order of
    their first use.  Buffers are never sharded and belong to no group."""
    users: dict[str, list[int]] = {}
    nbytes: dict[str, int] = {}
    for o, op in enumerate(graph.ops):
        if op.everywhere:
            continue
        for local, qual in op.params.items():
            u = users.setdefault(qual, [])
            if o not in u:
                u.append(o)
            nbytes.setdefault(qual, math.prod(op.param_shapes[local]) * dtype_bytes(op.dtype))
    clusters: dict[tuple, list[str]] = {}
    for qual, u in users.items():
        clusters.setdefault(tuple(u), []).append(qual)
    group: dict[str, int] = {}
    g, size = 0, 0
    for us in sorted(clusters, key=lambda us: (us[0], us)):
        for qual in clusters[us]:
            group[qual] = g
            size += nbytes[qual]
        if size >= cap_bytes:
            g, size = g + 1, 0
    return group
