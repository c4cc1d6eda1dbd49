"""OptCNN's layer-wise parallelism (Jia et al., ICML 2018) as a baseline: min-sum
elimination over share groups, exact on series-parallel graphs."""
from __future__ import annotations

import math

import numpy as np

from ..cost.model import CostModel
from ..graph.ir import Op, OpGraph, dtype_bytes
from ..strategy.boxes import OpBoxes, region_array
from ..strategy.config import ParallelConfig
from ..strategy.regions import partitions
from ..strategy.strategy import Strategy
from .common import Candidates, SearchError, _Space

__all__ = ["optcnn", "optcnn_cost"]


def optcnn(graph: OpGraph, machine, cost_model=None, *, candidates: Candidates | None = None) -> Strategy:
    """OptCNN's layer-wise parallelism (Jia et al., ICML 2018): every op split
    over all devices along sample, attribute and parameter dims, the config of
    each chosen by dynamic programming over node costs (compute + parameter
    sync) and edge costs (redistribution); see :class:`_OptCNN`."""
    return _OptCNN(graph, machine, cost_model, candidates).solve()


def optcnn_cost(graph: OpGraph, machine, strategy: Strategy, cost_model=None, *,
                candidates: Candidates | None = None) -> float:
    """OptCNN's objective for ``strategy`` (every config must be in its domain)."""
    return _OptCNN(graph, machine, cost_model, candidates).value(strategy)


class _OptCNN:
    """OptCNN's cost model and its graph reductions.

    Variables: share groups (ops sharing parameters take one config).  Domain:
    the candidate configs whose partitions use all devices (the most
    partitions the op allows, from device 0 up, when it cannot use all).
    Node cost of a group under config c: for each member op, the slowest
    partition's forward + backward time, plus the all-reduce time
    (``machine.allreduce_time_s``) of every parameter shard held by several
    partitions.  Edge cost (producer config, consumer config): each consumer
    partition needs its input region (partition regions; all partials of it
    when the producer leaves partial sums) minus what the producer partition
    on its own device holds (region overlap); it receives that over the
    slowest route into its device from the producer's devices (latency +
    bytes / bandwidth, ``machine.route``: all senders share the receiver's
    link or NIC); the edge costs the slowest receiver, twice (activations
    forward, their gradients backward).  This is O(partitions) per config
    pair, which keeps 64 devices tractable.  The cost of a strategy is the sum
    of node and edge costs.  (The tables are built from region arrays assembled
    one dim at a time where the op's rule is separable, :mod:`flexflow.strategy.
    boxes`; ``fast = False`` enumerates every partition instead: the same tables.)

    Solving: OptCNN's node elimination (an op with one in- and one out-edge
    becomes an edge), edge elimination (parallel edges add), and leaf
    elimination, all exact; this is min-sum variable elimination on factors of
    at most two variables, which solves chains and series-parallel graphs
    exactly.  When no such reduction applies, the variable whose elimination
    makes the smallest factor is eliminated exactly when that factor has at
    most ``cap`` entries; otherwise (never on the zoo's graphs) the most
    connected variable is fixed greedily to its best config given the others'
    best, and ``self.exact`` becomes False.  (``cap`` counts the entries of the
    table built to eliminate it, its own configs included.)
    """

    cap = 1 << 21
    fast = True  # regions assembled per dim (strategy.boxes) where the rule allows; same tables

    def __init__(self, graph, machine, cost_model=None, candidates=None):
        self.graph, self.machine = graph, machine
        spec = machine.devices[0].spec
        # a partition's time depends on its device only through the device's spec
        self._fast = self.fast and all(d.spec == spec for d in machine.devices)
        self._sigs: dict = {}
        self._opboxes: dict = {}
        self.cm = cost_model if cost_model is not None else CostModel(machine)
        self.space = space = _Space(graph, machine, candidates)
        D = machine.num_devices
        full = tuple(range(D))
        self.domains = []
        for cs in space.cands:
            dom = [c for c in cs if c.devices == full]
            if not dom:
                most = max(c.num_partitions for c in cs)
                dom = [c for c in cs if c.num_partitions == most and c.devices[0] == 0] or \
                      [c for c in cs if c.num_partitions == most]
            self.domains.append(dom)
        self.var = {op: i for i, k in enumerate(space.keys) for op in graph.groups[k]}
        lat = np.zeros((D, D))
        inv_bw = np.zeros((D, D))
        for s in range(D):
            for d in range(D):
                r = machine.route(s, d)
                if r:
                    links = [machine.links[i] for i in r]
                    lat[s, d] = sum(l.latency_s for l in links)
                    inv_bw[s, d] = 1.0 / min(l.bandwidth_Bps for l in links)
        self.lat, self.inv_bw = lat, inv_bw
        self._cache: dict = {}
        self._build()
        self.exact = True

    # -- tables
    def _build(self):
        g, sp = self.graph, self.space
        self.unary = [np.zeros(len(d)) for d in self.domains]
        self.pair: dict[tuple[int, int], np.ndarray] = {}
        for i, key in enumerate(sp.keys):
            for name in g.groups[key]:
                self.unary[i] += self._node(g.op(name), self.domains[i])
            self.unary[i] += self._sync(g.op(sp.reps[i]), self.domains[i])
        for v in g.compute_ops:
            for idx, u in enumerate(v.inputs):
                uop = g.op(u)
                if uop.everywhere:
                    continue
                a, b = self.var[u], self.var[v.name]
                t = self._edge(uop, v, idx, self.domains[a], self.domains[b])
                if a == b:
                    self.unary[a] += np.diag(t)
                elif a < b:
                    self.pair[a, b] = self.pair.get((a, b), 0) + t
                else:
                    self.pair[b, a] = self.pair.get((b, a), 0) + t.T

    def _sig(self, op: Op) -> tuple:
        hit = self._sigs.get(op.name)
        if hit is None or hit[0] is not op:
            sig = (op.kind, op.rule, str(op.dtype), tuple(op.output_shape), tuple(map(tuple, op.input_shapes)),
                   tuple(op.dims), tuple(sorted(op.param_shapes.items())), repr(sorted(op.attrs.items(), key=str)))
            hit = self._sigs[op.name] = (op, sig)
        return hit[1]

    def _ob(self, op: Op) -> OpBoxes | None:
        """The region arrays of ops with ``op``'s signature (None: enumerate partitions)."""
        if not self._fast:
            return None
        sig = self._sig(op)
        hit = self._opboxes.get(sig)
        if hit is None:
            hit = self._opboxes[sig] = OpBoxes(op)
        return hit

    def _parts(self, op: Op, cfg: ParallelConfig):
        """partitions(), shared by ops with one signature (same shapes, kind, attrs)."""
        key = ("parts", self._sig(op), cfg)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = partitions(op, cfg)
        return hit

    def _node(self, op: Op, dom) -> np.ndarray:
        key = ("node", self._sig(op), tuple(dom))
        if key not in self._cache:
            ob = self._ob(op)
            out = []
            for c in dom:
                # the first partition of each region shape: those of the cost model's keys
                parts = (ob.firsts(c) if ob is not None else None) or self._parts(op, c)
                out.append(max(sum(self.cm.op_time(op, p, p.device)) for p in parts))
            self._cache[key] = np.array(out)
        return self._cache[key]

    def _sync(self, op: Op, dom) -> np.ndarray:
        if not op.params:
            return np.zeros(len(dom))
        key = ("sync", self._sig(op), tuple(dom))
        if key not in self._cache:
            ob = self._ob(op)
            self._cache[key] = np.array([self._sync_boxes(op, c, ob) if ob is not None and ob.plan(c) is not None
                                         else _sync_time_s(self.machine, op, c, self._parts(op, c)) for c in dom])
        return self._cache[key]

    def _sync_boxes(self, op: Op, config, ob: OpBoxes) -> float:
        """``_sync_time_s`` from the parameters' region arrays."""
        total = 0.0
        size = dtype_bytes(op.dtype)
        for local in op.params:
            rows = ob.boxes(config, ob.param_index[local])
            holders: dict = {}
            for row, dev in zip(rows.reshape(len(rows), -1).tolist(), config.devices):
                holders.setdefault(tuple(row), []).append(dev)
            t = 0.0
            for row, devs in holders.items():
                if len(devs) > 1:
                    half = len(row) // 2
                    nbytes = math.prod(b - a for a, b in zip(row[:half], row[half:])) * size
                    t = max(t, self._allreduce(devs, nbytes))
            total += t
        return total

    def _allreduce(self, devs, nbytes) -> float:
        key = ("ar", tuple(devs), nbytes)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self.machine.allreduce_time_s(devs, nbytes)
        return hit

    def _part_boxes(self, op: Op, cfg, idx, rank) -> np.ndarray:
        """``region_array`` of the partitions' input ``idx`` regions (None: their outputs),
        shared by ops of one signature."""
        key = ("boxes", self._sig(op), cfg, idx)
        hit = self._cache.get(key)
        if hit is None:
            ob = self._ob(op)
            if ob is not None:
                hit = ob.boxes(cfg, 0 if idx is None else 1 + idx, rank)
            if hit is None:
                parts = self._parts(op, cfg)
                hit = region_array([p.output if idx is None else p.inputs[idx] for p in parts], rank)
            self._cache[key] = hit
        return hit

    def _slowest_in(self, devices) -> tuple[np.ndarray, np.ndarray]:
        """Per device d, the latency and inverse bandwidth of the slowest route into d from
        ``devices`` other than d (0 where there is none).  A device's route to itself is
        empty (0 in both tables) and no entry is negative, so the maximum over all of
        ``devices`` is the maximum over the others."""
        key = ("in", devices)
        hit = self._cache.get(key)
        if hit is None:
            srcs = list(devices)
            hit = self._cache[key] = (self.lat[srcs].max(0), self.inv_bw[srcs].max(0))
        return hit

    def _edge(self, u: Op, v: Op, idx: int, dom_u, dom_v) -> np.ndarray:
        key = ("edge", self._sig(u), self._sig(v), idx, tuple(dom_u), tuple(dom_v))
        if key in self._cache:
            return self._cache[key]
        out = (self._edge_blocks if self._fast else self._edge_loop)(u, v, idx, dom_u, dom_v)
        self._cache[key] = out
        return out

    def _edge_loop(self, u: Op, v: Op, idx: int, dom_u, dom_v) -> np.ndarray:
        """The edge table, one producer config at a time."""
        rank = len(u.output_shape)
        esize = dtype_bytes(u.dtype)
        D = self.machine.num_devices
        out = np.zeros((len(dom_u), len(dom_v)))
        by_count: dict[int, list[int]] = {}  # consumer configs stacked by partition count
        for j, c in enumerate(dom_v):
            by_count.setdefault(c.num_partitions, []).append(j)
        cons = []
        for js in by_count.values():
            boxes = np.stack([self._part_boxes(v, dom_v[j], idx, rank) for j in js])  # (J, P', 2, A)
            need = np.clip(boxes[:, :, 1] - boxes[:, :, 0], 0, None).prod(-1)  # (J, P')
            cons.append((js, boxes, need, np.array([dom_v[j].devices for j in js])))
        reduction = {d.name for d in u.dims if d.axis is None}
        for i, cu in enumerate(dom_u):
            pb = self._part_boxes(u, cu, None, rank)  # (P, 2, A)
            on = np.full(D, -1)
            on[list(cu.devices)] = np.arange(cu.num_partitions)  # device -> producer partition
            partial = math.prod(cu.degree(d) for d in reduction)
            lat_in, inv_in = self._slowest_in(cu.devices)
            for js, cb, need, cdev in cons:
                q = on[cdev]  # (J, P') producer partition on the consumer's device, or -1
                own = pb[np.maximum(q, 0)]  # (J, P', 2, A)
                lo = np.maximum(cb[:, :, 0], own[:, :, 0])
                hi = np.minimum(cb[:, :, 1], own[:, :, 1])
                local = np.where(q >= 0, np.clip(hi - lo, 0, None).prod(-1), 0)
                recv = (need * partial - local) * esize  # bytes from other devices
                t = np.where(recv > 0, lat_in[cdev] + recv * inv_in[cdev], 0.0)
                out[i, js] = 2.0 * t.max(1)
        return out

    def _edge_blocks(self, u: Op, v: Op, idx: int, dom_u, dom_v) -> np.ndarray:
        """``_edge_loop``'s table, equal entry for entry, a block of configs at a time:
        producer configs on one device list against consumer configs on one device list
        (a consumer partition's producer partition is then the same for all of them).
        Along each axis, the overlap of a producer and a consumer partition is computed
        once per distinct pair of interval columns and gathered; with the same route
        costs into every consumer device, the slowest receiver is the one receiving the
        most (the time is monotone in the bytes)."""
        rank = len(u.output_shape)
        esize = dtype_bytes(u.dtype)
        D = self.machine.num_devices
        out = np.zeros((len(dom_u), len(dom_v)))
        reduction = {d.name for d in u.dims if d.axis is None}
        cons = []
        for vdevs, js in _by_devices(dom_v).items():
            cb = np.stack([self._part_boxes(v, dom_v[j], idx, rank) for j in js])  # (J, P', 2, A)
            need = np.clip(cb[:, :, 1] - cb[:, :, 0], 0, None).prod(-1)  # (J, P')
            cons.append((js, np.array(vdevs), cb, need, [_distinct(cb[:, :, :, a]) for a in range(rank)]))
        for udevs, is_ in _by_devices(dom_u).items():
            pb = np.stack([self._part_boxes(u, dom_u[i], None, rank) for i in is_])  # (I, P, 2, A)
            partial = np.array([math.prod(dom_u[i].degree(d) for d in reduction) for i in is_])
            on = np.full(D, -1)
            on[list(udevs)] = np.arange(len(udevs))  # device -> producer partition
            lat_in, inv_in = self._slowest_in(udevs)
            for js, cdev, cb, need, cdist in cons:
                q = on[cdev]  # (P',) producer partition on the consumer's device, or -1
                own = pb[:, np.maximum(q, 0)]  # (I, P', 2, A)
                lat, inv = lat_in[cdev], inv_in[cdev]
                same = bool((lat == lat[0]).all() and (inv == inv[0]).all())
                missing = bool((q < 0).any())
                # local[i, j, p]: elements consumer partition p finds on its own device, the
                # product over axes of the overlaps; an axis along which all producers (or
                # all consumers) are alike gives a factor of (J, P') (or (I, P'))
                full, uside, cside = [], np.ones((len(is_), 1, len(q)), dtype=np.int64), 1
                for a in range(rank):
                    ut, ui = _distinct(own[:, :, :, a])
                    ct, ci = cdist[a]
                    ov = np.clip(np.minimum(ut[:, None, :, 1], ct[None, :, :, 1])
                                 - np.maximum(ut[:, None, :, 0], ct[None, :, :, 0]), 0, None)
                    if len(ut) == 1:
                        cside = cside * ov[0, ci][None]
                    elif len(ct) == 1:
                        uside = uside * ov[ui, 0][:, None]
                    else:
                        full.append((ov.reshape(-1, len(q)), ui * len(ct), ci))
                many = bool((partial != 1).any())
                step = max(1, (1 << 16) // (len(js) * len(q)))
                for lo in range(0, len(is_), step):
                    sl = slice(lo, lo + step)
                    local = None
                    for table, ui, ci in full:
                        g = table[ui[sl, None] + ci[None, :]]  # (I, J, P')
                        local = g if local is None else np.multiply(local, g, out=local)
                    if local is None:
                        local = uside[sl] * cside
                    else:
                        local *= uside[sl]
                        local *= cside
                    if missing:
                        local = np.where(q >= 0, local, 0)
                    # elements from other devices, less esize
                    x = need[None] * partial[sl, None, None] - local if many else need[None] - local
                    if same:  # the slowest receiver is the one receiving the most
                        m = x.max(-1) * esize
                        t = np.where(m > 0, lat[0] + m * inv[0], 0.0)
                    else:
                        recv = x * esize
                        t = np.where(recv > 0, lat + recv * inv, 0.0).max(-1)
                    out[np.ix_(is_[sl], js)] = 2.0 * t
        return out

    # -- objective and solver
    def value(self, strategy: Strategy) -> float:
        ix = []
        for i, rep in enumerate(self.space.reps):
            try:
                ix.append(self.domains[i].index(strategy[rep]))
            except ValueError:
                raise SearchError(f"{rep}: config {strategy[rep]} is not an all-device config") from None
        total = sum(float(u[j]) for u, j in zip(self.unary, ix))
        return total + sum(float(t[ix[a], ix[b]]) for (a, b), t in self.pair.items())

    def solve(self) -> Strategy:
        n = len(self.domains)
        factors: dict[int, tuple[tuple, np.ndarray]] = {}
        touching: list[set] = [set() for _ in range(n)]
        nbs: dict[int, list] = {}  # neighbours(v), dropped when touching[v] changes

        def add(scope, arr):
            fid = len(add.ids)
            add.ids.append(fid)
            factors[fid] = (scope, arr)
            for x in scope:
                touching[x].add(fid)
                nbs.pop(x, None)
        add.ids = []
        for i, u in enumerate(self.unary):
            add((i,), u)
        for (a, b), t in self.pair.items():
            add((a, b), np.asarray(t, dtype=float))
        alive = set(range(n))
        records = []  # (var, scope of its argmin table, table) in elimination order

        def neighbours(v):
            hit = nbs.get(v)
            if hit is None:
                hit = nbs[v] = sorted({x for f in touching[v] for x in factors[f][0]} - {v})
            return hit

        while alive:
            best = None
            for v in sorted(alive):
                nb = neighbours(v)
                if len(nb) <= 2 and (best is None or len(nb) < len(best[1])):
                    best = (v, nb)
                    if not nb:
                        break
            if best is None:
                sizes = {v: math.prod(len(self.domains[x]) for x in neighbours(v) + [v]) for v in sorted(alive)}
                v = min(sizes, key=sizes.get)
                if sizes[v] <= self.cap:
                    best = (v, neighbours(v))
            if best is not None:
                v, nb = best
                scope = tuple(sorted(nb + [v]))
                total = np.zeros([len(self.domains[x]) for x in scope])
                for fid in list(touching[v]):
                    fs, arr = factors.pop(fid)
                    for x in fs:
                        touching[x].discard(fid)
                        nbs.pop(x, None)
                    total += arr.reshape([arr.shape[fs.index(x)] if x in fs else 1 for x in scope])
                ax = scope.index(v)
                records.append((v, tuple(nb), total.argmin(axis=ax)))
                add(tuple(nb), total.min(axis=ax))
            else:  # greedy: fix the most connected variable to its locally best config
                self.exact = False
                v = max(sorted(alive), key=lambda x: len(neighbours(x)))
                score = np.zeros(len(self.domains[v]))
                for fid in touching[v]:
                    fs, arr = factors[fid]
                    ax = fs.index(v)
                    score += np.moveaxis(arr, ax, 0).reshape(arr.shape[ax], -1).min(axis=1)
                val = int(score.argmin())
                for fid in list(touching[v]):
                    fs, arr = factors.pop(fid)
                    for x in fs:
                        touching[x].discard(fid)
                        nbs.pop(x, None)
                    add(tuple(x for x in fs if x != v), np.take(arr, val, axis=fs.index(v)))
                records.append((v, (), np.array(val)))
            alive.discard(v)
        choice: dict[int, int] = {}
        for v, nb, table in reversed(records):
            choice[v] = int(table[tuple(choice[x] for x in nb)])
        configs = {rep: self.domains[i][choice[i]] for i, rep in enumerate(self.space.reps)}
        return Strategy(self.graph, configs, self.machine, name="optcnn")


def _by_devices(dom) -> dict:
    """Indices of the configs of ``dom`` by their device list."""
    out: dict = {}
    for k, c in enumerate(dom):
        out.setdefault(c.devices, []).append(k)
    return out


def _distinct(x: np.ndarray):
    """The distinct rows of ``x`` (N, ...) in order of first appearance, and each row's
    index among them."""
    flat = np.ascontiguousarray(x).reshape(len(x), -1)
    seen: dict = {}
    firsts, inv = [], []
    for k, row in enumerate(flat):
        key = row.tobytes()
        if key not in seen:
            seen[key] = len(firsts)
            firsts.append(k)
        inv.append(seen[key])
    return x[firsts], np.array(inv, dtype=np.int64)


def _sync_time_s(machine, op: Op, config: ParallelConfig, parts=None) -> float:
    """All-reduce time of the op's parameters under ``config``: partitions holding
    the same region of a parameter all-reduce its gradient (shards of one
    parameter in parallel, parameters one after the other)."""
    parts = parts if parts is not None else partitions(op, config)
    total = 0.0
    for local in op.params:
        holders: dict = {}
        for p in parts:
            holders.setdefault(tuple((s.start, s.stop) for s in p.params[local]), []).append(p.device)
        t = 0.0
        for region, devs in holders.items():
            if len(devs) > 1:
                nbytes = math.prod(b - a for a, b in region) * dtype_bytes(op.dtype)
                t = max(t, machine.allreduce_time_s(devs, nbytes))
        total += t
    return total
