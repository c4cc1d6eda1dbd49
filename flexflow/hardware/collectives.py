"""Collectives as NCCL runs them: ring and tree all-reduce (hierarchical across nodes: a
chain inside each node, a double binary tree between nodes), NVLink SHARP inside an
NVSwitch node, and ring reduce-scatter / all-gather; NCCL picks the algorithm and protocol
that its own model predicts fastest, and so does this.

Bandwidths are bus bandwidths as nccl-tests reports them (``busbw``: what each GPU's links
carry; a ring all-reduce of S bytes among p GPUs lasts 2(p-1)/p * S / busbw), taken from
published nccl-tests runs (see :data:`flexflow.hardware.specs.NCCL_FIGURES`).  Latencies
and the protocols' bandwidth shares follow NCCL's own tuning model (``src/graph/tuning.cc``
of NVIDIA/nccl: ``baseLat``, ``hwLat``, the LL protocol at a quarter of the bandwidth, the
tree at 0.9 of the ring's), in microseconds there, in seconds here.

A group of devices is described by its size ``p``, its node count ``nodes`` and ``per_node``,
the most of its devices on one node: with one NIC per GPU (rails) a node's ``per_node``
devices use ``per_node`` NICs at once, so the inter-node bus bandwidth is ``per_node``
times a NIC's; with one NIC per node it is one NIC's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CollectiveSpec", "GroupShape", "allreduce_latency_s", "allreduce_s", "ring_collective_s"]


@dataclass(frozen=True)
class CollectiveSpec:
    """Bus bandwidths of one kind of cluster, as nccl-tests measures them (bytes/s)."""
    ring_busbw_Bps: float  # inside a node, the ring algorithm (all_gather_perf, NCCL_ALGO=Ring)
    nic_busbw_Bps: float  # one NIC, in a ring across nodes (what one rail carries)
    nvls_busbw_Bps: float = 0.0  # inside an NVSwitch node, all_reduce_perf with NVLink SHARP; 0: none

    def to_dict(self) -> dict:
        return {"ring_busbw_Bps": self.ring_busbw_Bps, "nic_busbw_Bps": self.nic_busbw_Bps,
                "nvls_busbw_Bps": self.nvls_busbw_Bps}


@dataclass(frozen=True)
class GroupShape:
    """Where a group's devices sit: ``p`` devices on ``nodes`` nodes, at most ``per_node`` on
    one; ``node_size``: the devices per node of the machine; ``rails``: one NIC per GPU."""
    p: int
    nodes: int
    per_node: int
    node_size: int
    rails: bool


# NCCL's tuning model (tuning.cc), Simple and LL protocols, in seconds:
# (algorithm, protocol) -> (base latency, per step over NVLink, per step over the network)
_LATENCY_S = {
    ("ring", "simple"): (8.4e-6, 3.4e-6, 9.6e-6),
    ("ring", "ll"): (3.6e-6, 0.47e-6, 2.7e-6),
    ("tree", "simple"): (0.0, 28e-6, 50e-6),
    ("tree", "ll"): (4.4e-6, 0.52e-6, 5.0e-6),
}
# share of the algorithm's bus bandwidth each protocol reaches (LL sends 8 bytes of which 4
# are data and flags, and NCCL models it at a quarter; the tree at 0.9 of the ring)
_BW_SHARE = {("ring", "simple"): 1.0, ("ring", "ll"): 0.25, ("tree", "simple"): 0.9, ("tree", "ll"): 0.9 / 3.8}


def _busbw(spec: CollectiveSpec, g: GroupShape) -> float:
    """The bus bandwidth of a ring over the group: NVLink inside a node, and across nodes
    the NICs the node's members use (one each with rails, else the node's one)."""
    if g.nodes == 1:
        return spec.ring_busbw_Bps
    nics = g.per_node if g.rails else 1
    return min(spec.ring_busbw_Bps, nics * spec.nic_busbw_Bps)


def _latency(algo: str, proto: str, g: GroupShape, rounds: int) -> float:
    """Latency of an algorithm that passes the ring ``rounds`` times (all-reduce 2, reduce-
    scatter and all-gather 1): each pass is p-1 steps, nodes-1 of them between nodes."""
    base, nvl, net = _LATENCY_S[algo, proto]
    if algo == "ring":
        inter = rounds * (g.nodes - 1)
        return base + (rounds * (g.p - 1) - inter) * nvl + inter * net
    # tree: up and down a chain inside the node and a binary tree between nodes
    return base + 2 * ((g.per_node - 1) * nvl + math.ceil(math.log2(g.nodes)) * net)


def _allreduce_options(spec: CollectiveSpec, g: GroupShape):
    """(latency, seconds per byte) of each algorithm and protocol NCCL may run."""
    bus = _busbw(spec, g)
    steps = 2 * (g.p - 1)
    out = []
    for (algo, proto), share in _BW_SHARE.items():
        if algo == "tree" and g.nodes == 1:
            continue  # inside a node NCCL's tree is a chain: the ring is never slower
        # ring: 2(p-1)/p of the buffer over each GPU's links; tree: the buffer up and down
        per_byte = (steps / g.p if algo == "ring" else 2.0) / (bus * share)
        out.append((_latency(algo, proto, g, 2), per_byte))
    if spec.nvls_busbw_Bps and g.nodes == 1 and g.p > 2:
        # NVLink SHARP: the switch reduces; its algorithm bandwidth is the measured bus
        # bandwidth at a full node converted back (busbw = algbw * 2(n-1)/n)
        n = g.node_size
        algbw = spec.nvls_busbw_Bps * n / (2 * (n - 1))
        out.append((_latency("ring", "simple", g, 2), 1.0 / algbw))
    return out


def allreduce_s(spec: CollectiveSpec, g: GroupShape, nbytes: float) -> tuple[float, float]:
    """(latency, total seconds) of an all-reduce of ``nbytes`` per device, by the fastest
    algorithm and protocol; (0, 0) for one device or no bytes."""
    if g.p <= 1 or nbytes <= 0:
        return 0.0, 0.0
    lat, per_byte = min(_allreduce_options(spec, g), key=lambda o: o[0] + o[1] * nbytes)
    return lat, lat + per_byte * nbytes


def allreduce_latency_s(spec: CollectiveSpec, g: GroupShape) -> float:
    """The latency of the quickest all-reduce of a tiny message (NCCL's LL protocol)."""
    if g.p <= 1:
        return 0.0
    return min(lat for lat, _ in _allreduce_options(spec, g))


def ring_collective_s(spec: CollectiveSpec, g: GroupShape, nbytes: float) -> float:
    """A ring reduce-scatter or all-gather of a buffer of ``nbytes`` (the whole, of which each
    device ends with or starts from 1/p): p-1 steps of nbytes/p, the faster protocol."""
    if g.p <= 1 or nbytes <= 0:
        return 0.0
    bus = _busbw(spec, g)
    steps = g.p - 1
    return min(_latency("ring", proto, g, 1) + steps / g.p * nbytes / (bus * _BW_SHARE["ring", proto])
               for proto in ("simple", "ll"))
