"""The SOAP strategy space: configs, strategies, and the one partition
function everything else asks "which device holds which slice".

A :class:`ParallelConfig` gives a degree per parallel dim and the device of
each partition.  :func:`partitions` turns an (op, config) pair into the
output region, input regions and parameter regions of every partition;
:func:`param_placement` derives from the same regions which devices hold
which parameter block and so which devices all-reduce which gradients.
The simulator, the memory estimate and the executor all use these two.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import random as _random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator

from .ir import Op, OpGraph, dtype_bytes
from .ops import RULES
from .ops.base import out_region, region_numel

__all__ = ["ParallelConfig", "Partition", "Strategy", "StrategyError", "partitions",
           "candidate_configs", "param_placement", "ParamShard", "validate_config",
           "strategy_space_log10", "format_devices", "overlap", "REPLICA", "pick_replica",
           "canonical_partitions"]

_LETTER = {"n": "S", "s": "T", "r": "R"}  # sample prints as S (the paper), sequence as T, replicas R

# Replicated placement: ``{"r": k}`` computes the op whole on k devices.  Each
# partition holds the full output (every partition's regions are those of the
# whole op), parameters are held by all k and their gradients all-reduced among
# them; a consumer reads from one replica (:func:`pick_replica`).
REPLICA = "r"


class StrategyError(ValueError):
    """A config or strategy that does not fit its op, graph or machine."""


def format_devices(devices) -> str:
    devices = tuple(devices)
    if len(devices) > 1 and devices == tuple(range(devices[0], devices[0] + len(devices))):
        return f"[{devices[0]}..{devices[-1]}]"
    return "[" + ",".join(map(str, devices)) + "]"


class ParallelConfig:
    """Frozen: a degree per parallel dim (1 when absent) and one device per partition."""

    __slots__ = ("_degrees", "_devices", "_hash")

    def __init__(self, degrees: Mapping[str, int], devices):
        items = []
        for k, v in dict(degrees).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise StrategyError(f"degree of dim {k!r} must be a positive int, got {v!r}")
            if v > 1:
                items.append((str(k), v))
        devs = tuple(int(d) for d in devices)
        n = math.prod(v for _, v in items)
        if len(devs) != n:
            raise StrategyError(f"config {dict(items)} has {n} partitions but {len(devs)} devices {devs}")
        if len(set(devs)) != len(devs) or any(d < 0 for d in devs):
            raise StrategyError(f"devices {devs} must be distinct non-negative ids")
        object.__setattr__(self, "_degrees", tuple(sorted(items)))
        object.__setattr__(self, "_devices", devs)
        object.__setattr__(self, "_hash", hash((self._degrees, devs)))

    def __setattr__(self, k, v):
        raise AttributeError("ParallelConfig is frozen")

    def __reduce__(self):  # pickle (multiprocessing) through the checked constructor
        return ParallelConfig, (dict(self._degrees), self._devices)

    @property
    def degrees(self) -> dict[str, int]:
        return dict(self._degrees)

    @property
    def devices(self) -> tuple[int, ...]:
        return self._devices

    @property
    def num_partitions(self) -> int:
        return len(self._devices)

    def degree(self, dim: str) -> int:
        return dict(self._degrees).get(dim, 1)

    def __eq__(self, other):
        return (isinstance(other, ParallelConfig) and self._degrees == other._degrees
                and self._devices == other._devices)

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"ParallelConfig({dict(self._degrees)}, {self._devices})"

    def __str__(self):
        items = sorted(self._degrees, key=lambda kv: (kv[0] != "n", kv[0]))
        degs = " ".join(f"{_LETTER.get(k, k.upper())}{v}" for k, v in items) or "whole"
        return f"{degs} @{format_devices(self._devices)}"

    def to_dict(self) -> dict:
        return {"degrees": dict(self._degrees), "devices": list(self._devices)}

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelConfig":
        if not isinstance(d, dict) or "devices" not in d:
            raise StrategyError(f"a config needs 'degrees' and 'devices', got {d!r}")
        return cls(d.get("degrees", {}), d["devices"])


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
        if deg > dims[name].size:
            raise StrategyError(f"{op.describe()}: cannot split dim {name!r} of size "
                                f"{dims[name].size} into {deg} parts (output shape {op.output_shape})")
    if num_devices is not None and any(d >= num_devices for d in config.devices):
        raise StrategyError(f"{op.describe()}: config {config} uses device "
                            f"{max(config.devices)} but the machine has {num_devices} devices")


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
    split = [d for d in op.dims if degs.get(d.name, 1) > 1]
    ranges = []
    for d in split:
        k = degs[d.name]
        ranges.append([(i * d.size // k, (i + 1) * d.size // k) for i in range(k)])
    partial = any(d.axis is None for d in split)
    names = [d.name for d in split]
    parts = []
    for idx, combo in enumerate(itertools.product(*ranges)):
        block = dict(zip(names, combo))
        ins, ps = rule.regions(op, block)
        parts.append(Partition(idx, config.devices[idx], block, out_region(op, block),
                               tuple(ins), ps, partial))
    cache[config] = parts
    return parts


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


def param_placement(graph: OpGraph, strategy: "Strategy") -> dict[str, tuple[tuple, list[ParamShard], bool]]:
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


# --------------------------------------------------------------------------- candidates
def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def candidate_configs(op: Op, machine) -> list[ParallelConfig]:
    """Every config the search may choose for ``op``: power-of-two degrees
    per parallel dim whose product fits the machine, on contiguous device
    blocks aligned to their size (the paper's space), whole-op placements
    on any single device included."""
    D = machine.num_devices if not isinstance(machine, int) else machine
    cache = op.__dict__.setdefault("_candidates", {})
    if D in cache:
        return cache[D]
    # the configs depend only on the dims' names and sizes and whether a sample dim
    # exists: ops alike (every unrolled step of a layer) share one list
    shared = (tuple((d.name, d.size) for d in op.dims), op.parallel_dims.get("n") != "sample", D)
    hit = _CANDIDATES.get(shared)
    if hit is not None:
        cache[D] = hit
        return hit
    per_dim = [[(d.name, k) for k in _pow2_upto(min(d.size, D))] for d in op.dims]
    out = []
    for combo in itertools.product(*per_dim):
        p = math.prod(k for _, k in combo)
        if p > D:
            continue
        degs = {n: k for n, k in combo if k > 1}
        for start in range(0, D - p + 1, p):
            out.append(ParallelConfig(degs, range(start, start + p)))
    if op.parallel_dims.get("n") != "sample":  # no batch to split: replicas instead
        for p in _pow2_upto(D)[1:]:
            for start in range(0, D - p + 1, p):
                out.append(ParallelConfig({REPLICA: p}, range(start, start + p)))
    cache[D] = _CANDIDATES[shared] = out
    return out


_CANDIDATES: dict = {}  # (dims' names and sizes, no sample dim, devices) -> configs


def strategy_space_log10(graph: OpGraph, machine) -> float:
    """log10 of the number of strategies (one config per share group)."""
    total = 0.0
    for members in graph.groups.values():
        total += math.log10(len(candidate_configs(graph.op(members[0]), machine)))
    return total


# --------------------------------------------------------------------------- strategy
class Strategy(Mapping):
    """Op name -> ParallelConfig for every placed op of a graph.

    Ops that share parameters always share one config."""

    def __init__(self, graph: OpGraph, configs: Mapping[str, ParallelConfig], machine=None,
                 name: str = "custom"):
        self.graph = graph
        self.name = name
        self.machine_fingerprint = machine.fingerprint() if machine is not None else None
        self.num_devices = machine.num_devices if machine is not None else None
        self._configs: dict[str, ParallelConfig] = {}
        for op in graph.compute_ops:
            if op.name in configs:
                self._configs[op.name] = configs[op.name]
            else:
                rep = next((m for m in graph.groups[op.group] if m in configs), None)
                if rep is None:
                    raise StrategyError(f"strategy has no config for {op.describe()}")
                self._configs[op.name] = configs[rep]
        unknown = [k for k in configs if k not in self._configs]
        if unknown:
            raise StrategyError(f"strategy names ops the graph does not have: {unknown[:5]}")
        for members in graph.groups.values():
            if len({self._configs[m] for m in members}) > 1:
                raise StrategyError(f"ops {members[:3]}... share parameters and must share one config")
        for op in graph.compute_ops:
            validate_config(op, self._configs[op.name], self.num_devices)

    # Mapping
    def __getitem__(self, k: str) -> ParallelConfig:
        return self._configs[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._configs)

    def __len__(self) -> int:
        return len(self._configs)

    def __eq__(self, other):
        return isinstance(other, Strategy) and self._configs == other._configs

    def __hash__(self):
        return hash(tuple(sorted(self._configs.items())))

    def _derive(self, configs, name=None) -> "Strategy":
        s = Strategy.__new__(Strategy)
        s.graph, s.name = self.graph, name or self.name
        s.machine_fingerprint, s.num_devices = self.machine_fingerprint, self.num_devices
        s._configs = configs
        return s

    def replace(self, op_name: str, config: ParallelConfig) -> "Strategy":
        """A new strategy with ``op_name`` (and every op sharing its parameters) on ``config``."""
        op = self.graph.op(op_name)
        validate_config(op, config, self.num_devices)
        configs = dict(self._configs)
        for m in self.graph.groups[op.group]:
            configs[m] = config
        return self._derive(configs)

    def devices_used(self) -> set[int]:
        return {d for c in self._configs.values() for d in c.devices}

    def check(self, machine) -> None:
        """Refuse a strategy made for another machine, or one that does not fit it."""
        if self.machine_fingerprint and self.machine_fingerprint != machine.fingerprint():
            raise StrategyError(f"strategy was made for another machine (fingerprint "
                                f"{self.machine_fingerprint}, this machine {machine.fingerprint()})")
        for op in self.graph.compute_ops:
            validate_config(op, self._configs[op.name], machine.num_devices)

    def table(self) -> str:
        """One line per share group: ``conv3: S4 C2 @[0..7]``."""
        lines = []
        for members in self.graph.groups.values():
            op = self.graph.op(members[0])
            extra = f" (+{len(members) - 1} sharing)" if len(members) > 1 else ""
            lines.append(f"{op.name}: {self._configs[op.name]}{extra}")
        return "\n".join(lines)

    # JSON
    def to_json(self) -> str:
        return json.dumps({
            "format": "flexflow-strategy", "version": 1, "name": self.name,
            "graph": self.graph.fingerprint(), "machine": self.machine_fingerprint,
            "num_devices": self.num_devices,
            "ops": {k: c.to_dict() for k, c in self._configs.items()},
        }, indent=1)

    @classmethod
    def from_json(cls, text: str, graph: OpGraph, machine=None) -> "Strategy":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise StrategyError(f"strategy file is not valid JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != "flexflow-strategy":
            raise StrategyError("not a flexflow strategy file (missing \"format\": \"flexflow-strategy\")")
        if d.get("graph") != graph.fingerprint():
            raise StrategyError(f"strategy was made for another graph (fingerprint {d.get('graph')}, "
                                f"this graph {graph.fingerprint()}): trace the same model, batch and dtype")
        ops = d.get("ops")
        if not isinstance(ops, dict):
            raise StrategyError("strategy file has no \"ops\" object")
        configs = {}
        for k, v in ops.items():
            if k not in graph:
                raise StrategyError(f"strategy entry {k!r} names no op of this graph")
            try:
                configs[k] = ParallelConfig.from_dict(v)
            except StrategyError as e:
                raise StrategyError(f"strategy entry {k!r}: {e}") from None
        s = cls(graph, configs, name=d.get("name", "custom"))
        s.machine_fingerprint = d.get("machine")
        s.num_devices = d.get("num_devices")
        if machine is not None:
            s.check(machine)
        return s

    # built-ins
    @classmethod
    def data_parallel(cls, graph: OpGraph, machine) -> "Strategy":
        """Every op split along its sample dim over all devices; an op with no
        sample dim that reads only graph constants (positions, masks) and such
        ops is replicated on every device, as DistributedDataParallel in effect
        does (no activation travels for it; its gradients are all-reduced)."""
        D = machine.num_devices
        configs = {}
        replicated = _constant_fed(graph) if D > 1 else set()
        for members in graph.groups.values():
            op = graph.op(members[0])
            if all(m in replicated for m in members):
                configs[op.name] = ParallelConfig({REPLICA: D}, range(D))
            else:
                configs[op.name] = _sample_config(op, D)
        return cls(graph, configs, machine, name="data_parallel")

    @classmethod
    def model_parallel(cls, graph: OpGraph, machine) -> "Strategy":
        """Each op whole on one device; consecutive ops grouped so that
        parameter bytes are balanced over the devices."""
        D = machine.num_devices
        group_bytes = {g: graph.op(m[0]).param_bytes for g, m in graph.groups.items()}
        total = sum(group_bytes.values())
        configs, placed, cum, dev = {}, {}, 0.0, 0
        for op in graph.compute_ops:
            g = op.group
            if g not in placed:
                if total > 0 and group_bytes[g] > 0:
                    dev = min(D - 1, int((cum + group_bytes[g] / 2) * D / total))
                    cum += group_bytes[g]
                placed[g] = dev
            configs[op.name] = ParallelConfig({}, (placed[g],))
        return cls(graph, configs, machine, name="model_parallel")

    @classmethod
    def expert(cls, graph: OpGraph, machine) -> "Strategy":
        """"One weird trick": data parallel for convolution, pooling and
        recurrence; fully connected layers (the softmax layer included)
        split along their output channels over all devices."""
        D = machine.num_devices
        configs = {}
        for members in graph.groups.values():
            op = graph.op(members[0])
            if op.rule == "linear" and "c" in op.parallel_dims and op.dim("c").size >= 2:
                k = min(D, op.dim("c").size)
                configs[op.name] = ParallelConfig({"c": k}, range(k))
            else:
                configs[op.name] = _sample_config(op, D)
        return cls(graph, configs, machine, name="expert")

    @classmethod
    def single_device(cls, graph: OpGraph, machine, device: int = 0) -> "Strategy":
        """Every op whole on ``device``: no parallelism.  A model too small for
        its communication to pay (tiny layers, latency-bound steps) trains
        fastest this way; the other devices only receive the outputs."""
        if not 0 <= device < machine.num_devices:
            raise StrategyError(f"device {device} is not one of the machine's {machine.num_devices} devices")
        configs = {op.name: ParallelConfig({}, (device,)) for op in graph.compute_ops}
        return cls(graph, configs, machine, name="single_device")

    @classmethod
    def random(cls, graph: OpGraph, machine, seed: int = 0, *, base: "Strategy | None" = None,
               fraction: float = 1.0) -> "Strategy":
        """A uniformly random candidate config per share group; with ``base``, each
        group's config is redrawn with probability ``fraction`` and else kept from
        ``base`` (a random strategy at a chosen distance from, say, data parallelism)."""
        if not 0.0 <= fraction <= 1.0:
            raise StrategyError(f"fraction must lie in [0, 1], got {fraction!r}")
        rng = _random.Random(seed)
        configs = {}
        for members in graph.groups.values():
            op = graph.op(members[0])
            drawn = rng.choice(candidate_configs(op, machine))
            keep = base is not None and rng.random() >= fraction
            configs[op.name] = base[op.name] if keep else drawn
        name = f"random{seed}" if base is None else f"random{seed}@{fraction:g}"
        return cls(graph, configs, machine, name=name)


def _constant_fed(graph: OpGraph) -> set[str]:
    """Placed ops without a sample dim whose inputs are all graph constants
    (``everywhere`` ops other than the inputs) or such ops themselves."""
    out: set[str] = set()
    for op in graph.compute_ops:
        if op.parallel_dims.get("n") == "sample" or not op.inputs:
            continue
        if all((graph.op(i).everywhere and graph.op(i).kind != "input") or i in out for i in op.inputs):
            out.add(op.name)
    return out


def _sample_config(op: Op, D: int) -> ParallelConfig:
    if "n" in op.parallel_dims and op.parallel_dims["n"] == "sample":
        k = min(D, op.dim("n").size)
        return ParallelConfig({"n": k}, range(k))
    return ParallelConfig({}, (0,))


def overlap(a: tuple, b: tuple) -> tuple | None:
    """Intersection of two regions (tuples of slices), or None when empty."""
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)
