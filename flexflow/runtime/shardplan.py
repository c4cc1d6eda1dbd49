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
per *unit*: the sharded regions of one shard group
(:mod:`flexflow.strategy.units`: consecutive clusters of parameters up to a cap, as
FSDP wraps a block of layers) with one group of ranks, dtype and level; at levels 2-3 a
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
from ..strategy.units import shard_groups

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


def group_units(graph: OpGraph, shard_level: dict, shards: dict, dtypes: dict, groups: dict | None = None) -> list[list]:
    """The sharded regions of a rank grouped into units, in graph order of their first
    user: the regions of one shard group (:func:`flexflow.strategy.units.shard_groups`,
    consecutive clusters of parameters up to a cap, as FSDP wraps a block of layers)
    with one group of ranks, gather dtype (``dtypes``) and level.  Every member of a group of ranks forms the
    same units (the same regions, the same order)."""
    groups = shard_groups(graph) if groups is None else groups
    first: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for q in op.params.values():
            if q in shard_level:
                first.setdefault(q, i)
    units: dict[tuple, list] = {}
    for q in sorted(first, key=lambda q: (first[q], q)):
        units.setdefault((groups.get(q, -1), shards[q][2], str(dtypes[q]), shard_level[q]), []).append(q)
    return list(units.values())


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
