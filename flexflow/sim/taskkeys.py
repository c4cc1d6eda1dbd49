"""Task keys: kinds, canonical priorities and integer picosecond times shared by the task
graph, its plans and the scheduler.

Every task has a canonical priority (op index, kind, input, partitions) that breaks ties the
same way however the graph was built; the scheduler dequeues by (ready time, priority, task
id), the task id kept in the low ``TID_BITS`` of ``TaskGraph.KP`` (``prio << TID_BITS | tid``)."""
from __future__ import annotations

__all__ = ["PS", "KIND_NAMES", "SYNC_MODELS", "decode_prio"]

# "ring": bucketed ring all-reduce overlapping the backward (what the executor and DDP do);
# "ps": the paper's runtime -- gradients gathered to one replica, updated, sent back, after
# the task graph with no overlap (only to set the paper's figures side by side)
# "deferred" (a pipeline's micro-batch, sim/pipeline.py): the ring all-reduce's time is kept
# out of the task graph (in ``ps_ps``, per cluster the longest of its groups' syncs), as a
# pipeline syncs once after its last micro-batch
SYNC_MODELS = ("ring", "ps", "deferred")

PS = 10**12  # picoseconds per second
# Kinds in tie-breaking order: at equal ready time a transfer goes before compute of the same
# op, as the executor posts a send as soon as its producer is computed (before its next op)
XF, XB, F, B, SYNC, UPD, GATHER = range(7)
KIND_NAMES = ("xfer", "xfer-grad", "fwd", "bwd", "sync", "update", "gather")
_JB, _PB, _AB = 10, 15, 16  # bits: input index, partition index (up to 32,767 devices), op/param/cluster index
TID_BITS = 24
TID_MASK = (1 << TID_BITS) - 1


_AMAX = (1 << _AB) - 1


def _prio(a: int, kind: int, j: int = 0, k: int = 0, q: int = 0) -> int:
    # the backward meets ops in reverse order (as autograd runs it): at equal ready time a
    # later op's backward and gradient transfers go first
    if kind == B or kind == XB:
        a = _AMAX - a
    return ((((a << 3 | kind) << _JB | j) << _PB | k) << _PB) | q


def decode_prio(p: int) -> tuple[int, int, int, int, int]:
    """(a, kind, j, k, q) of a priority: a is the op (fwd/bwd/xfer), param (sync, gather) or
    cluster (update) index, j the input index, k / q the consumer / producer partition (or device)."""
    m = (1 << _PB) - 1
    q, k = p & m, (p >> _PB) & m
    p >>= 2 * _PB
    j = p & ((1 << _JB) - 1)
    p >>= _JB
    a, kind = p >> 3, p & 7
    return (_AMAX - a if kind == B or kind == XB else a), kind, j, k, q


def kind_of(prios):
    """The kind of each priority (an int or an integer numpy array): XF, XB, F, ..."""
    return (prios >> (2 * _PB + _JB)) & 7


def _ps(seconds: float) -> int:
    """Seconds -> integer picoseconds, at least 1 (every task takes time: keeps keys ordered)."""
    return max(1, int(round(seconds * PS)))

