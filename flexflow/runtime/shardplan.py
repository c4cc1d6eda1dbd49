"""Shard levels in a rank's program: which parameters are sharded, how, and when gathered.

A parameter region held by n ranks (its replicas) at a shard level
(``ParallelConfig.shard``, the ZeRO stages) is split, flattened, into n
contiguous slices of ``ceil(numel / n)`` elements (the last ones shorter or
empty): replica i keeps slice i as the *flat parameter* its optimizer
updates, so any torch optimizer's state is sharded with no change to the
training loop.  What the replicas keep besides, by level:

- 1: the full region (the values the ops read) and its full gradient, which
  is all-reduced and then cut to the slice;
- 2: the full region; the gradient is reduce-scattered, so only the slice's
  gradient is kept;
- 3: as 2, and the full region lives only while its users run: gathered
  before the first user's forward, freed after the last user's forward,
  gathered again before the last user's backward and freed once the gradient
  is reduce-scattered.

At every level the full region is gathered from the slices (one all-gather
per *unit*: consecutive sharded regions of one group of ranks, dtype and
level, up to a few MiB, as FSDP wraps a block of layers; at levels 2-3 a
unit's gradients are reduce-scattered together too) whenever a slice changed since the last gather (the
optimizer stepped) or the region was freed.

The level of a region is the largest level among the ops of its *parameter
cluster* (the ops that share parameters, transitively), as the simulator
takes it (:mod:`flexflow.sim.paramplans`).  Everything here is pure: no
process group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..graph.ir import OpGraph

__all__ = ["Slice", "Unit", "group_units", "plan_units", "shard_levels", "slice_of"]


def shard_levels(graph: OpGraph, strategy) -> dict[str, int]:
    """qual -> shard level (> 0) of every parameter whose cluster has one."""
    parent: dict[str, str] = {}

    def find(q: str) -> str:
        while parent[q] != q:
            parent[q] = parent[parent[q]]
            q = parent[q]
        return q

    for op in graph.compute_ops:
        quals = list(op.params.values())
        for q in quals:
            parent.setdefault(q, q)
        for q in quals[1:]:
            a, b = find(quals[0]), find(q)
            if a != b:
                parent[b] = a
    level: dict[str, int] = {}
    for op in graph.compute_ops:
        s = strategy[op.name].shard
        for q in op.params.values():
            r = find(q)
            level[r] = max(level.get(r, 0), s)
    return {q: level[find(q)] for q in parent if level.get(find(q), 0)}


@dataclass(frozen=True)
class Slice:
    """Replica ``index`` of ``n``: elements ``[lo, hi)`` of a region of ``numel``
    flattened; ``chunk`` is every replica's padded slice length."""

    numel: int
    n: int
    index: int
    chunk: int
    lo: int
    hi: int


def slice_of(numel: int, ranks, rank: int) -> Slice:
    n = len(ranks)
    i = list(ranks).index(rank)
    chunk = -(-numel // n)
    lo = min(i * chunk, numel)
    return Slice(numel, n, i, chunk, lo, min(lo + chunk, numel))


@dataclass
class Unit:
    """Sharded regions gathered together: one group of ranks (``key``), one dtype,
    one first user (program position ``first``); ``last``: the position of the last
    forward user of any of them (level 3 frees them after it)."""

    key: tuple
    level: int
    quals: list
    first: int
    last: int
    offsets: list = field(default_factory=list)  # each region's chunk offset in the unit's slice
    chunk: int = 0  # the unit's slice length (sum of its regions' chunks)
    users: list = field(default_factory=list)  # program positions of the steps that read them
    keep: bool = False  # level 3: a user's output has no gradient, so it stays gathered to the end


def group_units(graph: OpGraph, shard_level: dict, shards: dict, tensors: dict, cap_bytes: float) -> list[list]:
    """The sharded regions of a rank grouped into units, in graph order of their first
    user: consecutive regions of one group of ranks, dtype and level, up to ``cap_bytes``
    of full regions a unit (FSDP wraps a block of layers the same way).  Every member of a
    group forms the same units (the same regions, the same order)."""
    first: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for q in op.params.values():
            if q in shard_level:
                first.setdefault(q, i)
    units: list[list] = []
    open_: dict[tuple, tuple] = {}  # (key, dtype, level) -> (unit, bytes)
    for q in sorted(first, key=lambda q: (first[q], q)):
        t = tensors[q]
        k = (shards[q][2], str(t.dtype), shard_level[q])
        unit, size = open_.get(k, (None, 0))
        if unit is None:
            unit = []
            units.append(unit)
        unit.append(q)
        size += t.numel() * t.element_size()
        open_[k] = (unit, size) if size < cap_bytes else (None, 0)
    return units


def plan_units(program, unit_quals: list, shard_level: dict, shards: dict, slices: dict) -> list[Unit]:
    """The gather units (``unit_quals``, from :func:`group_units`) with their program
    positions: first and last user, every user.  ``program``: the steps (``step.params``
    lists (local, qual, ...)); ``shards``: qual -> (view, region, ranks); ``slices``:
    qual -> :class:`Slice`."""
    users: dict[str, list] = {}
    for i, step in enumerate(program):
        for entry in step.params:
            q = entry[1]
            if q in shard_level and (not users.setdefault(q, []) or users[q][-1] != i):
                users[q].append(i)
    out = []
    for quals in unit_quals:
        pos = sorted({i for q in quals for i in users.get(q, ())})
        u = Unit(shards[quals[0]][2], shard_level[quals[0]], list(quals), pos[0] if pos else 0,
                 pos[-1] if pos else 0)
        u.users = pos
        for q in quals:
            u.offsets.append(u.chunk)
            u.chunk += slices[q].chunk
        out.append(u)
    return out
