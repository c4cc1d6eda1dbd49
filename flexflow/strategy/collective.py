"""Which exchanges between two partitionings are collectives.

An exchange (a producer op's partitions to a consumer's input regions) moves one
message per (sending device, receiving device) pair.  When those pairs fall into
disjoint groups in which every device sends one message to every other member, the
exchange is, group by group, an all-gather (the producers hold disjoint blocks that
every consumer reads whole: a sequence-parallel norm read by a column-parallel
linear, a data-parallel layer read by a replicated one) or a reduce-scatter (the
producers hold partial sums and each consumer reads its block of the sum: a
row-parallel linear's output read by a sequence-parallel residual add).  The
simulator prices such a group as the collective (``Machine.allgather_time_s``,
``reduce_scatter_time_s``) and the runtime runs it as one
(``all_gather_into_tensor`` / ``reduce_scatter_tensor`` over the group); every
other exchange stays point-to-point.  Both ask :func:`clique_groups`.  A group of two stays
point-to-point too: its collective is one message each way, which as two messages leaves each
as soon as its producer is done instead of meeting at the consumer.

An all-gather whose readers are all linear layers (:func:`regatherable`) is not kept for
their backward: it is gathered again there from each member's piece, as Megatron's sequence
parallelism does, so a device keeps its 1/n shard of the input instead of the whole (a
recomputed reader's checkpoint keeps the recipe, and its recomputation gathers again); the
simulator's memory model and task graph count it so, the runtime runs it so.
"""
from __future__ import annotations

from collections.abc import Iterable

__all__ = ["clique_groups", "regatherable", "MIN_MEMBERS"]


MIN_MEMBERS = 3  # (a pair exchanges point to point: see above)


def clique_groups(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, ...]] | None:
    """The groups (sorted member tuples, in order of their first member) when the
    (src, dst) pairs of an exchange's messages between different devices are exactly
    every ordered pair within each of disjoint groups of :data:`MIN_MEMBERS` or more, one
    message each; else None (also for no pairs)."""
    pairs = list(pairs)
    if not pairs or any(a == b for a, b in pairs) or len(set(pairs)) != len(pairs):
        return None
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    members: dict[int, list[int]] = {}
    for x in list(parent):
        members.setdefault(find(x), []).append(x)
    count: dict[int, int] = {}
    for a, _ in pairs:
        count[find(a)] = count.get(find(a), 0) + 1
    groups = []
    for root, ms in members.items():
        t = len(ms)
        if t < MIN_MEMBERS or count.get(root, 0) != t * (t - 1):  # (distinct pairs within: all of them)
            return None
        groups.append(tuple(sorted(ms)))
    return sorted(groups)


def regatherable(op, cfg) -> bool:
    """Whether a reader's saved input, where it is all-gathered, may be gathered again in its
    backward instead of kept: a linear layer (it saves its input as it reads it, or autocast's
    copy of it; recomputed, its checkpoint keeps a recipe of it)."""
    return op.rule == "linear"
