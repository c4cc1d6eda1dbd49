"""Partitions and regions: the one function everything else asks "which device holds
which slice".

:func:`partitions` turns an (op, config) pair into the output region, input regions and
parameter regions of every partition; :func:`param_placement` derives from the same regions
which devices hold which parameter block and so which devices all-reduce which gradients.
The simulator, the memory estimate and the executor all use these two.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from ..graph.ir import Op, OpGraph
from ..graph.ops import RULES
from ..graph.ops.base import out_region, region_numel
from .config import REPLICA, ParallelConfig, StrategyError

__all__ = ['Partition', 'validate_config', 'has_param_replicas', 'partitions', 'partition_at', 'split_dims', 'block_ranges', 'pick_replica', 'canonical_partitions', 'ParamShard', 'param_placement', 'overlap', 'input_reads', 'shared_reader']


@dataclass(frozen=True)
class Partition:
    """One partition of an op under a config: its block and regions."""

    index: int
    device: int
    block: dict  # dim -> (start, stop)
    output: tuple  # region of the op's output
    inputs: tuple  # region of each tensor input (None: not needed)
    params: dict  # param or buffer local name -> region in its view shape
    partial: bool  # a reduction dim is split: output holds a partial sum

    @property
    def output_numel(self) -> int:
        return region_numel(self.output)


def validate_config(op: Op, config: ParallelConfig, num_devices: int | None = None) -> None:
    """Raise StrategyError naming the op when ``config`` does not fit it."""
    dims = {d.name: d for d in op.dims}
    degrees = config.degrees
    if REPLICA in degrees and len(degrees) > 1:
        raise StrategyError(f"{op.describe()}: a replicated config ({REPLICA}) cannot also split dims "
                            f"{sorted(k for k in degrees if k != REPLICA)}")
    for name, deg in degrees.items():
        if name == REPLICA:
            continue
        if name not in dims:
            raise StrategyError(f"{op.describe()}: cannot split dim {name!r}; its parallel dims are "
                                f"{list(dims) or 'none (it runs whole on one device)'}")
        if deg > dims[name].blocks:
            unit = f" in blocks of {dims[name].unit}" if dims[name].unit > 1 else ""
            raise StrategyError(f"{op.describe()}: cannot split dim {name!r} of size "
                                f"{dims[name].size}{unit} into {deg} parts (output shape {op.output_shape})")
    if "z" in degrees and op.rule == "attention":
        L = op.output_shape[2]
        if "l" in degrees:
            raise StrategyError(f"{op.describe()}: its query rows split one way, contiguously (l) or head-tail (z), "
                                f"not both")
        if L % (2 * degrees["z"]):
            raise StrategyError(f"{op.describe()}: a head-tail split of its {L} rows into {degrees['z']} blocks "
                                f"needs the length divisible by {2 * degrees['z']} (two equal chunks a block)")
    if num_devices is not None and any(d >= num_devices for d in config.devices):
        raise StrategyError(f"{op.describe()}: config {config} uses device "
                            f"{max(config.devices)} but the machine has {num_devices} devices")
    if config.shard:
        if not op.params:
            raise StrategyError(f"{op.describe()}: shard={config.shard} needs parameters to shard, "
                                "and this op has none")
        if not has_param_replicas(op, config):
            raise StrategyError(f"{op.describe()}: shard={config.shard} needs replicas of a parameter "
                                f"region to shard among, and under {config} every partition holds "
                                "its own block (split a sample or attribute dim, or replicate)")


def has_param_replicas(op: Op, config: ParallelConfig) -> bool:
    """Whether two partitions of ``op`` under ``config`` hold the same region of a parameter."""
    parts = partitions(op, config.with_shard(0) if config.shard else config)
    for local in op.params:
        keys = [_key(p.params[local]) for p in parts if local in p.params]
        if len(set(keys)) < len(keys):
            return True
    return False


def partitions(op: Op, config: ParallelConfig) -> list[Partition]:
    """Every partition of ``op`` under ``config``, partition k on devices[k].

    Blocks are near-equal (sizes differ by at most one); partitions are
    numbered row-major over the op's dims in their declared order."""
    cache = op.__dict__.setdefault("_partitions", {})
    hit = cache.get(config)
    if hit is not None:
        return hit
    validate_config(op, config)
    rule = RULES[op.rule]
    degs = config.degrees
    if REPLICA in degs:  # k whole copies
        ins, ps = rule.regions(op, {})
        parts = [Partition(k, dev, {}, out_region(op, {}), tuple(ins), ps, False)
                 for k, dev in enumerate(config.devices)]
        cache[config] = parts
        return parts
    split = split_dims(op, config)
    ranges = [block_ranges(d.size, degs[d.name], d.unit) for d in split]
    partial = any(d.axis is None for d in split)
    names = [d.name for d in split]
    parts = [_partition(op, rule, config, idx, dict(zip(names, combo)), partial)
             for idx, combo in enumerate(itertools.product(*ranges))]
    cache[config] = parts
    return parts


def split_dims(op: Op, config: ParallelConfig) -> list:
    """The dims ``config`` splits (degree above 1), in the op's order: partitions are
    numbered row-major over these, the last varying fastest."""
    degs = config.degrees
    return [d for d in op.dims if degs.get(d.name, 1) > 1]


def block_ranges(size: int, k: int, unit: int = 1) -> list[tuple[int, int]]:
    """The [start, stop) of each of the ``k`` near-equal blocks of a dim of ``size``
    (near-equal in whole ``unit``s: see :class:`~flexflow.graph.ir.Dim`)."""
    if unit == 1:
        return [(i * size // k, (i + 1) * size // k) for i in range(k)]
    n = size // unit
    return [(i * n // k * unit, (i + 1) * n // k * unit) for i in range(k)]


def partition_at(op: Op, config: ParallelConfig, index: int, check: bool = True) -> Partition:
    """Partition ``index`` of ``op`` under ``config``: ``partitions(op, config)[index]``
    built alone (equal to it in every field), for callers that need a few partitions of
    many configs (``check=False``: the caller has validated ``config``)."""
    if REPLICA in config.degrees:
        return partitions(op, config)[index]
    if check:
        validate_config(op, config)
    degs = config.degrees
    split = split_dims(op, config)
    coords, rest = [], index
    for d in reversed(split):
        rest, i = divmod(rest, degs[d.name])
        coords.append(i)
    block = {}
    for d, i in zip(split, reversed(coords)):
        k = degs[d.name]
        n, u = d.size // d.unit, d.unit
        block[d.name] = (i * n // k * u, (i + 1) * n // k * u)
    return _partition(op, RULES[op.rule], config, index, block, any(d.axis is None for d in split))


def _partition(op: Op, rule, config: ParallelConfig, index: int, block: dict, partial: bool) -> Partition:
    ins, ps = rule.regions(op, block)
    return Partition(index, config.devices[index], block, out_region(op, block), tuple(ins), ps, partial)


def pick_replica(candidates, parts, device, index: int) -> int:
    """Of producer partitions ``candidates`` (indices into ``parts``) that hold
    the same output region, the one a consumer partition (number ``index``, on
    ``device``) reads from: the copy on its own device when there is one,
    else copies in turn by consumer index.  The simulator and the executor
    both route every replicated read through this function."""
    if len(candidates) == 1:
        return candidates[0]
    for q in candidates:
        if parts[q].device == device:
            return q
    return candidates[index % len(candidates)]


def canonical_partitions(parts) -> list:
    """The partitions that stand for their output region: all of them, but of
    replicas (same region) only the first.  Summing these over devices gives
    the op's full output once (partial sums all count)."""
    if parts and parts[0].partial:
        return list(parts)
    seen, out = set(), []
    for p in parts:
        key = tuple((r.start, r.stop) for r in p.output)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


@dataclass(frozen=True)
class ParamShard:
    """A block of a parameter (in its view shape) and the devices holding it."""

    region: tuple
    devices: tuple[int, ...]


def param_placement(graph: OpGraph, strategy: Mapping[str, ParallelConfig]) -> dict[str, tuple[tuple, list[ParamShard], bool]]:
    """Which devices hold which block of each parameter and buffer.

    Returns qualified name -> (view shape, shards, trainable).  A device
    holds the bounding box of every region its partitions read.  When the
    boxes of different devices overlap without being equal (a parameter
    used by two ops split differently, e.g. tied weights) every holder
    keeps the whole parameter.  A shard's gradient is all-reduced among
    exactly its devices."""
    regions: dict[str, dict[int, list[tuple]]] = {}
    views: dict[str, tuple] = {}
    trainable: dict[str, bool] = {}
    for op in graph.compute_ops:
        parts = partitions(op, strategy[op.name])
        for local, qual in list(op.params.items()) + list(op.buffers.items()):
            is_param = local in op.params
            view = op.param_views.get(local, op.param_shapes[local]) if is_param else op.buffer_shapes[local]
            if views.setdefault(qual, tuple(view)) != tuple(view):
                views[qual] = None  # inconsistent views: hold it whole
            trainable[qual] = is_param
            per_dev = regions.setdefault(qual, {})
            for p in parts:
                per_dev.setdefault(p.device, []).append(p.params[local])
    out = {}
    for qual, per_dev in regions.items():
        view = views[qual]
        if view is None:
            view = next(op.param_shapes.get(l) or op.buffer_shapes.get(l) for op in graph.compute_ops
                        for l, q in list(op.params.items()) + list(op.buffers.items()) if q == qual)
            boxes = {d: tuple(slice(0, s) for s in view) for d in per_dev}
        else:
            boxes = {d: _bounding_box(rs) for d, rs in per_dev.items()}
        distinct = list(dict.fromkeys(_key(b) for b in boxes.values()))
        if not _equal_or_disjoint(distinct):
            boxes = {d: tuple(slice(0, s) for s in view) for d in per_dev}
            distinct = [_key(next(iter(boxes.values())))]
        shards = []
        for k in distinct:
            devs = tuple(sorted(d for d, b in boxes.items() if _key(b) == k))
            shards.append(ParamShard(tuple(slice(a, b) for a, b in k), devs))
        out[qual] = (tuple(view), shards, trainable[qual])
    return out


def _key(region) -> tuple:
    return tuple((s.start, s.stop) for s in region)


def _bounding_box(regions) -> tuple:
    return tuple(slice(min(r[i].start for r in regions), max(r[i].stop for r in regions))
                 for i in range(len(regions[0])))


def _equal_or_disjoint(keys) -> bool:
    for a, b in itertools.combinations(keys, 2):
        if all(max(x[0], y[0]) < min(x[1], y[1]) for x, y in zip(a, b)):
            return False
    return True


def overlap(a: tuple, b: tuple) -> tuple | None:
    """Intersection of two regions (tuples of slices), or None when empty."""
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def input_reads(op: Op, config: ParallelConfig, j: int) -> tuple:
    """What ``op`` under ``config`` reads of its input ``j``: the sorted (device, region)
    pairs of its partitions, the region as ((start, stop), ...) per axis.  Two readers of one
    tensor with equal reads take the same data on the same devices: the executor receives it
    once and shares it between them (and, under autocast, one cast of it), and the simulator
    counts it once (:func:`shared_reader`)."""
    cache = op.__dict__.setdefault("_reads", {})
    key = (config, j)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = tuple(sorted(
            (p.device, tuple((s.start, s.stop) for s in p.inputs[j]))
            for p in partitions(op, config) if j < len(p.inputs) and p.inputs[j] is not None))
    return hit


def shared_reader(readers: list) -> dict:
    """Readers of one tensor that share a read: ``readers`` is [(key, reads)] in graph
    order (``reads`` from :func:`input_reads`, ``key`` any hashable naming the reader);
    returns reader key -> the key of the first reader with the same reads, for every reader
    after the first of its kind."""
    first: dict = {}
    out = {}
    for key, reads in readers:
        if not reads:
            continue
        f = first.setdefault(reads, key)
        if f != key:
            out[key] = f
    return out
