"""Exchanges priced as the collectives the runtime runs them as (:mod:`flexflow.runtime.collex`).

Where the messages of an exchange between two partitionings are, group by group, every
ordered pair of members once (:func:`flexflow.strategy.collective.clique_groups`), all of
one size, and without partial sums each message is its sender's whole block, the runtime
runs the group's messages as one all-gather (partial sums: a reduce-scatter, or an
all-reduce where every member reads one region).  :func:`collective_seconds` gives each
transfer of such a group the collective's time divided by the most transfers of the group
that share one resource (a transfer holding the receiving end of its route:
:func:`receiver_resources`), so the busiest link is busy for the collective's time and every
consumer has its input when the collective is done; the task graph (``plans.py``) and the
exhaustive search's lower bound (``flexflow.search.exhaustive``) both price transfers so."""
from __future__ import annotations

import numpy as np

from ..strategy.collective import clique_groups

__all__ = ["collective_seconds", "receiver_resources", "transfer_resources"]


def transfer_resources(machine, a: int, b: int) -> tuple:
    """Resources a transfer a -> b holds, as the task graph numbers them: the route's links
    (the device count plus the link id), and both devices where their cores move messages."""
    links = tuple(machine.num_devices + l for l in machine.route(a, b))
    return (a, *links, b) if machine.spec.comm_on_cores else links


def receiver_resources(machine, a: int, b: int) -> tuple:
    """The resources a collective's piece a -> b holds: on devices with their own
    communication engines (GPUs), the receiving end of the route (its last link: a NIC's
    incoming side across nodes) -- NCCL's ring or tree keeps every link busy at once, where
    pieces holding both ends would queue behind each other in the order they are listed
    (all senders feeding one receiver first); where the cores move the bytes (gloo on
    CPUs), the whole route, both ends' cores included, as a point-to-point message."""
    links = transfer_resources(machine, a, b)
    return links if machine.spec.comm_on_cores else links[-1:]


def collective_seconds(machine, src, dst, nbytes, partial: bool, region, block_bytes, lag_s: float = 0.0):
    """(seconds per transfer, kind) when the transfers (src, dst, nbytes per transfer;
    ``region(i)``: transfer i's consumer input region, ``block_bytes(i)``: its sender's block
    bytes, asked only of a candidate) are collectives, else None.  kind: ``"gather"`` (its
    backward a reduce-scatter, as long), ``"scatter"`` (its backward an all-gather) or
    ``"reduce"`` (all-reduce both ways).  ``lag_s``: the part of a message's latency its
    consumer waits after the transfer (the task graph's lag)."""
    src, dst, nbytes = (np.asarray(x, np.int64) for x in (src, dst, nbytes))
    if not len(src) or (nbytes != nbytes[0]).any() or not np.array_equal(np.unique(src), np.unique(dst)):
        return None  # (the cheap refusals first: most exchanges are not collectives)
    groups = clique_groups(zip(src.tolist(), dst.tolist()))
    piece = int(nbytes[0])
    if groups is None or (not partial and any(block_bytes(i) != piece for i in range(len(src)))):
        return None
    member = [np.isin(src, g) for g in groups]
    kind = "gather" if not partial else "reduce" if all(
        len({tuple((s.start, s.stop) for s in region(i)) for i in np.flatnonzero(sel)}) == 1
        for sel in member) else "scatter"
    out = np.empty(len(src))
    for g, sel in zip(groups, member):
        if kind == "reduce":
            t = machine.allreduce_time_s(g, piece)
        elif kind == "scatter":
            t = machine.reduce_scatter_time_s(g, len(g) * piece)
        else:
            t = machine.allgather_time_s(g, len(g) * piece)
        count: dict = {}
        for a, b in zip(src[sel].tolist(), dst[sel].tolist()):
            for r in receiver_resources(machine, a, b):
                count[r] = count.get(r, 0) + 1
        out[sel] = max(t - lag_s, 0.0) / max(count.values())
    return out, kind
