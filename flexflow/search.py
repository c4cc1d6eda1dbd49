"""Strategy search: Metropolis-Hastings MCMC over SOAP strategies, scored by
the simulator (section 5 of the paper), the baselines it is compared with,
and the optimality checks of section 8.

    result = search(graph, machine, budget=30.0)     # or evaluations=N
    result.strategy.to_json()

- :func:`search` runs several chains (data parallel, expert, OptCNN and
  random starts, plus ``init``) round-robin, one :class:`Simulator` per chain
  so that each proposal (one share group's config changed) is a delta
  simulation; then a local descent ("polish") from the best strategy found.
- :func:`baseline_strategies` / :func:`optcnn`: data parallel, model
  parallel, expert and OptCNN's layer-wise dynamic programming.
- :func:`exhaustive_search` (branch and bound) and :func:`is_local_optimum`
  check the search on small cases.

Costs: the simulated iteration time; a strategy that does not fit device
memory costs its time plus a penalty (see :func:`_penalised`), and the best
*feasible* strategy always wins over any infeasible one.  When nothing fits,
the result is still no slower than any baseline.
"""
from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .cost import CostModel
from .ir import Op, OpGraph, dtype_bytes
from .ops.base import region_numel
from .strategy import ParallelConfig, Strategy, candidate_configs, overlap, partitions

__all__ = ["search", "SearchResult", "SearchError", "baseline_strategies", "optcnn", "optcnn_cost",
           "exhaustive_search", "is_local_optimum", "BASELINES"]

BASELINES = ("data_parallel", "model_parallel", "expert", "optcnn")
Candidates = Callable[[Op, object], Sequence[ParallelConfig]]
_REL = 1e-12  # relative tolerance: smaller differences are float noise, not improvements


class SearchError(ValueError):
    """The search cannot run on this graph/machine (no candidate config, bad init, ...)."""


def _simulator(graph: OpGraph, machine, cost_model):
    from .simulate import Simulator  # imported late: simulate imports nothing from here
    return Simulator(graph, machine, cost_model)


# --------------------------------------------------------------------------- space & costs
class _Space:
    """The search space: one variable per share group (its first member is the
    representative passed to Strategy.replace), each with its candidate configs."""

    def __init__(self, graph: OpGraph, machine, candidates: Candidates | None = None):
        fn = candidates or candidate_configs
        self.graph, self.machine = graph, machine
        self.keys = list(graph.groups)
        self.reps = [graph.groups[k][0] for k in self.keys]
        self.cands: list[list[ParallelConfig]] = []
        for rep in self.reps:
            cs = list(dict.fromkeys(fn(graph.op(rep), machine)))
            if not cs:
                raise SearchError(f"no candidate config for {graph.op(rep).describe()}")
            self.cands.append(cs)
        self.index = [{c: j for j, c in enumerate(cs)} for cs in self.cands]
        self.movable = [i for i, cs in enumerate(self.cands) if len(cs) > 1]

    def contains(self, strategy: Strategy) -> bool:
        return all(strategy[r] in ix for r, ix in zip(self.reps, self.index))

    def random(self, seed: int, name: str) -> Strategy:
        rng = random.Random(seed)
        configs = {r: rng.choice(cs) for r, cs in zip(self.reps, self.cands)}
        return Strategy(self.graph, configs, self.machine, name=name)


def _overflow(res, machine) -> float:
    """Largest relative excess of peak memory over capacity (0 when it fits)."""
    worst = 0.0
    for d, used in enumerate(res.peak_memory or ()):
        cap = machine.devices[d].spec.memory_bytes
        worst = max(worst, (used - cap) / cap)
    return worst


def _penalised(res, machine, scale_s: float) -> float:
    """The cost MCMC minimises: iteration time, plus for a strategy that does not
    fit memory ``scale_s * (1 + 10 * overflow)`` (overflow = worst device's excess
    over its capacity, relative): leaving feasibility is never worth it, and
    among infeasible strategies the chain is pulled towards less memory."""
    if res.feasible:
        return res.iteration_time
    return res.iteration_time + scale_s * (1.0 + 10.0 * max(_overflow(res, machine), 0.0))


def _better(a: tuple, b: tuple | None) -> bool:
    """a, b: (infeasible, cost) keys.  Feasible beats infeasible; then lower cost."""
    if b is None:
        return True
    if a[0] != b[0]:
        return a[0] < b[0]
    return a[1] < b[1] * (1.0 - _REL)


# --------------------------------------------------------------------------- results
@dataclass
class SearchResult:
    """What :func:`search` returns.  ``strategy`` is never worse than any baseline
    and never infeasible when a feasible strategy was seen."""

    strategy: Strategy
    result: object  # SimResult of strategy
    baselines: dict  # name -> SimResult (data_parallel, model_parallel, expert, optcnn)
    evaluations: int  # simulations run by the search (chains, proposals, polish)
    seconds: float  # wall time of the whole call, baselines included
    baseline_strategies: dict = field(default_factory=dict)  # name -> Strategy
    history: list = field(default_factory=list)  # (evaluations, seconds, best iteration time) at each improvement
    accept_rate: float = 0.0  # accepted / proposed MCMC moves
    beta: float = 0.0  # 1/s: p(S) ~ exp(-beta * cost(S))
    chains: list = field(default_factory=list)  # start strategy name of each chain
    source: str = "search"  # "search", or the baseline returned because the search did not beat it
    local_optimum: bool = False  # the polish ended with no single-group change improving it
    baseline_seconds: float = 0.0  # of ``seconds``: building and simulating the baselines

    @property
    def speedup(self) -> float:
        """Iteration-time speedup over data parallelism."""
        return self.baselines["data_parallel"].iteration_time / self.result.iteration_time

    def to_dict(self) -> dict:
        """The search part of ``flexflow search --json``: the best strategy's figures,
        the baselines', search seconds and evaluations (the CLI adds model, machine,
        devices, strategy and throughput)."""
        r = self.result
        return {"iteration_time_ms": r.iteration_time * 1e3, "comm_bytes": r.comm_bytes,
                "sync_bytes": r.sync_bytes, "peak_memory_bytes": list(r.peak_memory),
                "baselines": {k: {"iteration_time_ms": b.iteration_time * 1e3, "comm_bytes": b.comm_bytes,
                                  "sync_bytes": b.sync_bytes} for k, b in self.baselines.items()},
                "search_seconds": self.seconds, "evaluations": self.evaluations}

    def summary(self) -> str:
        lines = [f"best: {self.result.iteration_time * 1e3:.3f} ms/iteration ({self.source}), "
                 f"{self.evaluations} evaluations in {self.seconds:.1f} s"]
        for k, r in self.baselines.items():
            tag = "" if r.feasible else " (out of memory)"
            lines.append(f"  {k:>15}: {r.iteration_time * 1e3:.3f} ms{tag}")
        return "\n".join(lines)


class _Run:
    """Budget, evaluation count, best-so-far and progress display of one search."""

    def __init__(self, machine, budget_s, evaluations, t0, progress, scale_s):
        self.machine, self.budget_s, self.max_evals, self.t0 = machine, budget_s, evaluations, t0
        self.scale_s = scale_s
        self.evals = 0
        self.best_key = self.best = self.best_res = None
        self.history: list = []
        self.last_improve_evals, self.last_improve_s = 0, time.perf_counter() - t0
        self.callback = progress if callable(progress) else None
        show = progress is True or (progress is None and sys.stderr.isatty())
        self.bar, self._shown, self._t_shown = None, 0, 0.0
        if show:
            from tqdm import tqdm
            self.bar = tqdm(total=evaluations, desc="search", unit="eval", file=sys.stderr,
                            dynamic_ncols=True, leave=False)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def key(self, res) -> tuple:
        return (0 if res.feasible else 1, _penalised(res, self.machine, self.scale_s))

    def seen(self, strategy: Strategy, res) -> tuple:
        """Count one evaluation; remember it when it is the best so far."""
        self.evals += 1
        k = self.key(res)
        if _better(k, self.best_key):
            self.best_key, self.best, self.best_res = k, strategy, res
            self.last_improve_evals, self.last_improve_s = self.evals, self.elapsed()
            self.history.append((self.evals, self.last_improve_s, res.iteration_time))
        if self.bar is not None or self.callback is not None:
            now = self.elapsed()
            if now - self._t_shown > 0.2:
                self._t_shown = now
                if self.callback is not None:
                    self.callback(self.evals, now, self.best_res.iteration_time)
                if self.bar is not None:
                    self.bar.update(self.evals - self._shown)
                    self._shown = self.evals
                    self.bar.set_postfix_str(f"best {self.best_res.iteration_time * 1e3:.3f} ms, "
                                             f"{self.evals / max(now, 1e-9):.0f} eval/s")
        return k

    def spent(self, frac: float, patience: bool) -> bool:
        """Whether the phase that may use ``frac`` of the budget is over: that much
        is spent, or (patience) nothing improved for half of it."""
        if self.max_evals is not None:
            limit = self.max_evals * frac
            return self.evals >= limit or (patience and self.evals - self.last_improve_evals >= limit / 2)
        now = self.elapsed()
        limit = self.budget_s * frac
        return now >= limit or (patience and now - self.last_improve_s >= limit / 2)

    def close(self):
        if self.bar is not None:
            self.bar.update(self.evals - self._shown)
            self.bar.close()


# --------------------------------------------------------------------------- MCMC
def search(graph: OpGraph, machine, budget: float = 30.0, seed: int = 0, cost_model=None, *,
           evaluations: int | None = None, init: Strategy | str | None = None, progress=None,
           chains: int | None = None, delta: bool = True, candidates: Candidates | None = None,
           polish: bool = True, temperature: float = 0.01,
           baselines: dict | None = None) -> SearchResult:
    """MCMC search for a fast strategy of ``graph`` on ``machine``.

    budget: seconds for the whole call (baselines included); ignored when
        ``evaluations`` is given, which makes the run reproducible (same seed and
        evaluations -> same strategy, whatever the wall time).
    init: a Strategy (or its JSON text) to start one more chain from.
    chains: number of chains (default: init if given, data parallel, expert,
        OptCNN and one random start); more chains add random starts.
    delta: False simulates every proposal from scratch (for benchmarking).
    candidates: op, machine -> configs; restricts the space (default
        ``candidate_configs``).
    polish: spend the last quarter of the budget (and whatever the MCMC leaves
        when it stops early) on a local descent from the best strategy: the
        result is then locally optimal whenever the descent converges.
    temperature: beta = ln 2 / (temperature * reference cost): a proposal that is
        ``temperature`` (relative) slower than the reference is accepted with
        probability 1/2.  progress: True/False/None (tqdm on a tty) or a
        callable(evaluations, seconds, best_time_s).
    baselines: name -> Strategy to reuse (e.g. a previous result's
        ``baseline_strategies``) instead of recomputing them.
    """
    t0 = time.perf_counter()
    if evaluations is not None and (isinstance(evaluations, bool) or int(evaluations) < 1):
        raise SearchError(f"evaluations must be a positive integer, got {evaluations!r}")
    if evaluations is None and not budget > 0:
        raise SearchError(f"budget must be a positive number of seconds, got {budget!r}")
    cm = cost_model if cost_model is not None else CostModel(machine)
    space = _Space(graph, machine, candidates)
    if isinstance(init, str):
        init = Strategy.from_json(init, graph, machine)
    if init is not None:
        if init.graph is not graph and init.graph.fingerprint() != graph.fingerprint():
            raise SearchError("init strategy was made for another graph")
        init.check(machine)

    base = dict(baselines) if baselines is not None else \
        baseline_strategies(graph, machine, cm, candidates=candidates)
    missing = [k for k in BASELINES if k not in base]
    if missing:
        raise SearchError(f"baselines lack {missing}")
    sim0 = _simulator(graph, machine, cm)
    base_res = {k: sim0.simulate(s, incremental=False) for k, s in base.items()}
    feasible = [r.iteration_time for r in base_res.values() if r.feasible]
    scale_s = min(feasible or [r.iteration_time for r in base_res.values()])
    scale_s = scale_s if scale_s > 0 else 1e-6
    # beta relative to the cost scale: a move `temperature` (1%) slower than the
    # best baseline is accepted half the time, 5% slower 3% of the time.
    beta = math.log(2.0) / (temperature * scale_s)

    starts: list[tuple[str, Strategy]] = [("init", init)] if init is not None else []
    starts += [(k, base[k]) for k in ("data_parallel", "expert", "optcnn")]
    n_chains = chains if chains is not None else len(starts) + 1
    if n_chains < 1:
        raise SearchError(f"chains must be >= 1, got {chains!r}")
    i = 0
    while len(starts) < n_chains:
        name = f"random{i}"
        starts.append((name, space.random(seed * 7919 + i, name) if candidates else
                       Strategy.random(graph, machine, seed * 7919 + i)))
        i += 1
    starts = starts[:n_chains]

    baseline_s = time.perf_counter() - t0
    run = _Run(machine, budget, evaluations, t0, progress, scale_s)
    rng = random.Random(seed)
    mcmc_frac = 0.75 if polish else 1.0
    proposed = accepted = 0
    try:
        state, cost, sims = [], [], []
        for _, s in starts:
            sim = _simulator(graph, machine, cm)
            res = sim.simulate(s, incremental=delta)
            state.append(s)
            cost.append(run.seen(s, res)[1])
            sims.append(sim)
        while space.movable and not run.spent(mcmc_frac, patience=True):
            for c in range(len(starts)):
                if run.spent(mcmc_frac, patience=True):
                    break
                gi = space.movable[rng.randrange(len(space.movable))]
                rep, cs, ix = space.reps[gi], space.cands[gi], space.index[gi]
                cur = ix.get(state[c][rep])
                if cur is None:
                    j = rng.randrange(len(cs))
                else:  # uniformly one of the other candidates: a symmetric proposal
                    j = rng.randrange(len(cs) - 1)
                    j += j >= cur
                new = state[c].replace(rep, cs[j])
                res = sims[c].simulate(new, incremental=delta)
                k = run.seen(new, res)
                proposed += 1
                if k[1] <= cost[c] or rng.random() < math.exp(-beta * (k[1] - cost[c])):
                    state[c], cost[c] = new, k[1]
                    accepted += 1
        converged = False
        if polish and space.movable:
            converged = _descend(run, space, graph, machine, cm, delta, seed)
    finally:
        run.close()

    best, best_res, best_key, source = run.best, run.best_res, run.best_key, "search"
    for k in BASELINES:  # never worse than a baseline
        kk = run.key(base_res[k])
        if kk[0] == best_key[0] == 1:  # nothing fits: never slower than a baseline either
            kk = (1, base_res[k].iteration_time)
            best_key = (1, best_res.iteration_time)
        if _better(kk, best_key):
            best, best_res, best_key, source = base[k], base_res[k], kk, k
            converged = False  # the polish's optimum was not this one
    if source == "search":
        same = next((k for k in BASELINES if base[k] == best), None)
        if same is not None:  # the search ended where a baseline started: say so
            best, best_res, source = base[same], base_res[same], same
        else:
            best = Strategy(graph, dict(best), machine, name="search")
    return SearchResult(best, best_res, base_res, run.evals, time.perf_counter() - t0, base,
                        run.history, accepted / max(proposed, 1), beta, [n for n, _ in starts],
                        source, converged, baseline_s)


def _descend(run: _Run, space: _Space, graph, machine, cm, delta: bool, seed: int) -> bool:
    """Local descent from the run's best strategy, first improvement: single-group
    changes (in a seeded order) until none improves; then pair moves (two adjacent
    groups, producer and consumer, to one common config: a change the one-group
    proposals only reach through a worse intermediate strategy); back to single
    changes after a pair move improves.  Returns True when it converged (no
    single-group or pair change improves: a local optimum), False when the budget
    ran out first."""
    sim = _simulator(graph, machine, cm)
    order = list(range(len(space.reps)))
    random.Random(seed).shuffle(order)
    pairs = []
    for a, b in _adjacent_groups(graph, space):
        common = [c for c in space.cands[a] if c in space.index[b]]
        if common:
            pairs.append((a, b, common))
    state = {"cur": run.best, "key": None}

    def attempt(new) -> bool | None:
        if run.spent(1.0, patience=False):
            return None
        k = run.seen(new, sim.simulate(new, incremental=delta))
        if _better(k, state["key"]):
            state["cur"], state["key"] = new, k
            return True
        return False

    if run.spent(1.0, patience=False):
        return False
    state["key"] = run.seen(state["cur"], sim.simulate(state["cur"], incremental=delta))
    while True:
        quiet, i = 0, 0  # groups scanned in a row without an improvement
        while quiet < len(order):
            gi = order[i]
            rep, improved = space.reps[gi], False
            for cfg in space.cands[gi]:
                if cfg != state["cur"][rep]:
                    ok = attempt(state["cur"].replace(rep, cfg))
                    if ok is None:
                        return False
                    improved |= ok
            quiet = 0 if improved else quiet + 1
            i = (i + 1) % len(order)
        moved = False
        for a, b, common in pairs:
            ra, rb = space.reps[a], space.reps[b]
            for cfg in common:
                cur = state["cur"]
                if cur[ra] == cfg or cur[rb] == cfg:
                    continue  # a single-group change, already tried
                ok = attempt(cur.replace(ra, cfg).replace(rb, cfg))
                if ok is None:
                    return False
                if ok:
                    moved = True
                    break
            if moved:
                break
        if not moved:
            return True


def _adjacent_groups(graph: OpGraph, space: _Space) -> list[tuple[int, int]]:
    """(producer group, consumer group) pairs joined by an edge, in graph order."""
    gid = {op: i for i, k in enumerate(space.keys) for op in graph.groups[k]}
    out = {}
    for op in graph.compute_ops:
        for u in op.inputs:
            if u in gid and gid[u] != gid[op.name]:
                out[gid[u], gid[op.name]] = None
    return list(out)


def is_local_optimum(graph: OpGraph, machine, strategy: Strategy, cost_model=None, *,
                     candidates: Candidates | None = None):
    """(True, None) when no single share-group change (to any candidate config)
    improves ``strategy``; else (False, (op_name, config, iteration_time_s)), the
    first improving change found.  Feasible beats infeasible; ties do not improve."""
    cm = cost_model if cost_model is not None else CostModel(machine)
    space = _Space(graph, machine, candidates)
    sim = _simulator(graph, machine, cm)
    res = sim.simulate(strategy, incremental=False)
    scale = res.iteration_time
    key = lambda r: (0 if r.feasible else 1, _penalised(r, machine, scale))
    k0 = key(res)
    for rep, cs in zip(space.reps, space.cands):
        for cfg in cs:
            if cfg == strategy[rep]:
                continue
            r = sim.simulate(strategy.replace(rep, cfg), incremental=True)
            if _better(key(r), k0):
                return False, (rep, cfg, r.iteration_time)
    return True, None


# --------------------------------------------------------------------------- baselines
def baseline_strategies(graph: OpGraph, machine, cost_model=None, *,
                        candidates: Candidates | None = None) -> dict[str, Strategy]:
    """name -> Strategy for data_parallel, model_parallel, expert and optcnn."""
    return {"data_parallel": Strategy.data_parallel(graph, machine),
            "model_parallel": Strategy.model_parallel(graph, machine),
            "expert": Strategy.expert(graph, machine),
            "optcnn": optcnn(graph, machine, cost_model, candidates=candidates)}


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
    of node and edge costs.

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

    def __init__(self, graph, machine, cost_model=None, candidates=None):
        self.graph, self.machine = graph, machine
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

    @staticmethod
    def _sig(op: Op) -> tuple:
        return (op.kind, op.rule, str(op.dtype), tuple(op.output_shape), tuple(map(tuple, op.input_shapes)),
                tuple(op.dims), tuple(sorted(op.param_shapes.items())), repr(sorted(op.attrs.items(), key=str)))

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
            out = []
            for c in dom:
                out.append(max(sum(self.cm.op_time(op, p, p.device)) for p in self._parts(op, c)))
            self._cache[key] = np.array(out)
        return self._cache[key]

    def _sync(self, op: Op, dom) -> np.ndarray:
        if not op.params:
            return np.zeros(len(dom))
        key = ("sync", self._sig(op), tuple(dom))
        if key not in self._cache:
            self._cache[key] = np.array([_sync_time_s(self.machine, op, c, self._parts(op, c)) for c in dom])
        return self._cache[key]

    @staticmethod
    def _boxes(regions, rank) -> np.ndarray:
        """(P, 2, rank) int array of [start, stop) per axis; None -> empty box."""
        a = np.zeros((len(regions), 2, rank), dtype=np.int64)
        for k, r in enumerate(regions):
            if r is not None:
                a[k, 0] = [s.start for s in r]
                a[k, 1] = [s.stop for s in r]
        return a

    def _edge(self, u: Op, v: Op, idx: int, dom_u, dom_v) -> np.ndarray:
        key = ("edge", self._sig(u), self._sig(v), idx, tuple(dom_u), tuple(dom_v))
        if key in self._cache:
            return self._cache[key]
        rank = len(u.output_shape)
        esize = dtype_bytes(u.dtype)
        D = self.machine.num_devices
        out = np.zeros((len(dom_u), len(dom_v)))
        by_count: dict[int, list[int]] = {}  # consumer configs stacked by partition count
        for j, c in enumerate(dom_v):
            by_count.setdefault(c.num_partitions, []).append(j)
        cons = []
        for js in by_count.values():
            boxes = np.stack([self._boxes([p.inputs[idx] for p in self._parts(v, dom_v[j])], rank)
                              for j in js])  # (J, P', 2, A)
            need = np.clip(boxes[:, :, 1] - boxes[:, :, 0], 0, None).prod(-1)  # (J, P')
            cons.append((js, boxes, need, np.array([dom_v[j].devices for j in js])))
        reduction = {d.name for d in u.dims if d.axis is None}
        for i, cu in enumerate(dom_u):
            pb = self._boxes([p.output for p in self._parts(u, cu)], rank)  # (P, 2, A)
            on = np.full(D, -1)
            on[list(cu.devices)] = np.arange(cu.num_partitions)  # device -> producer partition
            partial = math.prod(cu.degree(d) for d in reduction)
            srcs = np.array(cu.devices)
            lat_in = np.zeros(D)  # slowest route into each device from the producer's devices
            inv_in = np.zeros(D)
            for d in range(D):
                others = srcs[srcs != d]
                if len(others):
                    lat_in[d] = self.lat[others, d].max()
                    inv_in[d] = self.inv_bw[others, d].max()
            for js, cb, need, cdev in cons:
                q = on[cdev]  # (J, P') producer partition on the consumer's device, or -1
                own = pb[np.maximum(q, 0)]  # (J, P', 2, A)
                lo = np.maximum(cb[:, :, 0], own[:, :, 0])
                hi = np.minimum(cb[:, :, 1], own[:, :, 1])
                local = np.where(q >= 0, np.clip(hi - lo, 0, None).prod(-1), 0)
                recv = (need * partial - local) * esize  # bytes from other devices
                t = np.where(recv > 0, lat_in[cdev] + recv * inv_in[cdev], 0.0)
                out[i, js] = 2.0 * t.max(1)
        self._cache[key] = out
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

        def add(scope, arr):
            fid = len(add.ids)
            add.ids.append(fid)
            factors[fid] = (scope, arr)
            for x in scope:
                touching[x].add(fid)
        add.ids = []
        for i, u in enumerate(self.unary):
            add((i,), u)
        for (a, b), t in self.pair.items():
            add((a, b), np.asarray(t, dtype=float))
        alive = set(range(n))
        records = []  # (var, scope of its argmin table, table) in elimination order

        def neighbours(v):
            return sorted({x for f in touching[v] for x in factors[f][0]} - {v})

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
                    total = total + arr.reshape([arr.shape[fs.index(x)] if x in fs else 1 for x in scope])
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
                    add(tuple(x for x in fs if x != v), np.take(arr, val, axis=fs.index(v)))
                records.append((v, (), np.array(val)))
            alive.discard(v)
        choice: dict[int, int] = {}
        for v, nb, table in reversed(records):
            choice[v] = int(table[tuple(choice[x] for x in nb)])
        configs = {rep: self.domains[i][choice[i]] for i, rep in enumerate(self.space.reps)}
        return Strategy(self.graph, configs, self.machine, name="optcnn")


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


# --------------------------------------------------------------------------- exhaustive
class _Bound:
    """Lower bounds on the simulated iteration time of every completion of a
    partial strategy, from what the simulator's task graph guarantees:

    - task dependencies: a partition's forward waits for the producer
      partitions it reads (plus the transfer, ``machine.transfer_time_s``, when
      they sit on another device); its backward for its own forward and for the
      backward of the consumer partitions that read it (plus the gradient
      transfer); a parameter shard's all-reduce (``machine.allreduce_time_s``)
      for the backward of its holders, its update for the all-reduce.  Ops not
      yet assigned count with their fastest partition and only with the
      dependencies that hold under any config.  This gives earliest start
      times (release times) of the assigned ops' tasks.
    - every device and link runs one task at a time: for each resource,
      max over its tasks k of (release_k + total duration of its tasks released
      no earlier than k); and all the work over all devices, unassigned groups
      at their least work, divided by the number of devices.
    """

    def __init__(self, graph: OpGraph, machine, space: _Space, cm):
        self.D = D = machine.num_devices
        self.machine, self.space = machine, space
        ops = self.ops = graph.compute_ops
        self.pos = pos = {op.name: k for k, op in enumerate(ops)}
        self.group_of = [0] * len(ops)
        for gi, key in enumerate(space.keys):
            for m in graph.groups[key]:
                self.group_of[pos[m]] = gi
        # inputs[k]: (input index, producer position); consumers[k]: (consumer position, input index)
        self.inputs = [[(i, pos[u]) for i, u in enumerate(op.inputs) if u in pos] for op in ops]
        self.consumers = [[] for _ in ops]
        for k, ins in enumerate(self.inputs):
            for i, u in ins:
                self.consumers[u].append((k, i))
        self.members = [[pos[m] for m in graph.groups[key]] for key in space.keys]
        self.work, self.total, self.tasks, self.syncs, self.update, self.devs = [], [], [], [], [], []
        self.f_min = np.zeros(len(ops))
        self.b_min = np.zeros(len(ops))
        needs_all = [{i: True for i, _ in ins} for ins in self.inputs]
        # a parameter used by several share groups (tied weights) is left out of the
        # sync tasks and counted in the updates of its first group only
        users: dict[str, list[int]] = {}
        for gi, members in enumerate(self.members):
            for k in members:
                for qual in ops[k].params.values():
                    if gi not in users.setdefault(qual, []):
                        users[qual].append(gi)
        for gi, members in enumerate(self.members):
            rep = ops[members[0]]
            own = [loc for loc, q in rep.params.items() if users[q][0] == gi]
            alone = [loc for loc, q in rep.params.items() if users[q] == [gi]]
            w_rows, t_rows, s_rows, u_rows = [], [], [], []
            for cfg in space.cands[gi]:
                w = np.zeros(D)
                t_row = {}
                for k in members:
                    op = ops[k]
                    parts = partitions(op, cfg)
                    ts = np.array([cm.op_time(op, p, p.device) for p in parts])
                    devs = [p.device for p in parts]
                    np.add.at(w, devs, ts.sum(1))
                    t_row[k] = (ts[:, 0].copy(), ts[:, 1].copy(), np.array(devs, dtype=np.int64))
                    for i, _ in self.inputs[k]:
                        if any(p.inputs[i] is None for p in parts):
                            needs_all[k][i] = False
                t_rows.append(t_row)
                s_rows.append(_sync_tasks(machine, rep, cfg, alone))
                # SGD update of the held parameter blocks: reads parameter and gradient and
                # writes the parameter at least (memory bound), one kernel per parameter
                upd = np.zeros(D)
                for p in partitions(rep, cfg):
                    spec = machine.devices[p.device].spec
                    for local in own:
                        nbytes = region_numel(p.params[local]) * dtype_bytes(rep.dtype)
                        upd[p.device] += 3 * nbytes / spec.mem_bw_Bps + spec.launch_overhead_s
                u_rows.append(upd)
                w_rows.append(w + upd)
            self.work.append(np.array(w_rows))
            self.total.append(np.array(w_rows).sum(1))
            self.tasks.append(t_rows)
            self.syncs.append(s_rows)
            self.update.append(np.array(u_rows))
            self.devs.append([row[members[0]][2] for row in t_rows])
            for k in members:
                self.f_min[k] = min(r[k][0].min() for r in t_rows)
                self.b_min[k] = min(r[k][1].min() for r in t_rows)
        self.min_total = [float(t.min()) for t in self.total]
        self.suffix_min = np.concatenate([np.cumsum(self.min_total[::-1])[::-1], [0.0]])
        self.needs_all = needs_all
        # covers[k][i]: op k as a whole reads all of input i, so under any config every
        # partition of the producer is read by some partition of op k
        self.covers = []
        for k, op in enumerate(ops):
            whole = partitions(op, ParallelConfig({}, (0,)))[0]
            cov = {}
            for i, u in self.inputs[k]:
                r = whole.inputs[i]
                cov[i] = r is not None and all(s.start <= 0 and s.stop >= n
                                               for s, n in zip(r, ops[u].output_shape))
            self.covers.append(cov)
        # the simulator rounds each task to integer picoseconds: allow for it
        self.slack_s = 1e-12 * (8 * len(ops) * max(D, 1) + 16)
        self._x: dict = {}

    def _xfer(self, u: int, ju: int, v: int, jv: int, i: int):
        """(fwd, bwd, remote) for producer u on candidate ju, consumer v on jv, input i:
        (P_v, P_u) matrices, -inf where consumer partition a reads nothing of
        producer partition b, else the transfer time (0 on one device), forward
        b -> a, backward a -> b; remote lists (a, b, fwd_s, fwd links, bwd_s, bwd links)."""
        key = (u, ju, v, jv, i)
        hit = self._x.get(key)
        if hit is None:
            uop, vop = self.ops[u], self.ops[v]
            cu = self.space.cands[self.group_of[u]][ju]
            cv = self.space.cands[self.group_of[v]][jv]
            pu, pv = partitions(uop, cu), partitions(vop, cv)
            esize = dtype_bytes(uop.dtype)
            fwd = np.full((len(pv), len(pu)), -np.inf)
            bwd = np.full((len(pv), len(pu)), -np.inf)
            remote = []
            m, D = self.machine, self.D
            for a, p in enumerate(pv):
                r = p.inputs[i]
                if r is None:
                    continue
                for b, q in enumerate(pu):
                    ov = overlap(r, q.output)
                    if ov is None:
                        continue
                    if q.device == p.device:
                        fwd[a, b] = bwd[a, b] = 0.0
                        continue
                    nbytes = region_numel(ov) * esize
                    fwd[a, b] = tf = m.transfer_time_s(q.device, p.device, nbytes)
                    bwd[a, b] = tb = m.transfer_time_s(p.device, q.device, nbytes)
                    remote.append((a, b, tf, [D + l for l in m.route(q.device, p.device)],
                                   tb, [D + l for l in m.route(p.device, q.device)]))
            # per link a transfer occupies: (link, producer partition, fwd s), (link, consumer partition, bwd s)
            fl = [(l, b, tf) for a, b, tf, lf, tb, lb in remote for l in lf]
            bl = [(l, a, tb) for a, b, tf, lf, tb, lb in remote for l in lb]
            as_arrays = lambda rows: (np.array([r[0] for r in rows], dtype=np.int64),
                                      np.array([r[1] for r in rows], dtype=np.int64),
                                      np.array([r[2] for r in rows], dtype=float))
            hit = self._x[key] = (fwd, bwd, as_arrays(fl), as_arrays(bl))
        return hit

    def __call__(self, assign: list[int]) -> float:
        """assign[g] = candidate index of group g, for the first len(assign) groups."""
        n_assigned = len(assign)
        load = np.zeros(self.D)
        done = 0.0
        for gi, j in enumerate(assign):
            load += self.work[gi][j]
            done += self.total[gi][j]
        bound = max(load.max(), (done + self.suffix_min[n_assigned]) / self.D)
        n = len(self.ops)
        jof = [assign[g] if g < n_assigned else -1 for g in self.group_of]
        tasks = self.tasks
        # earliest finish of the forward: per partition (assigned) or of the earliest partition
        ef: list = [None] * n
        ef_min = [0.0] * n
        for k in range(n):
            j = jof[k]
            if j >= 0:
                f = tasks[self.group_of[k]][j][k][0]
                start = np.zeros(len(f))
                for i, u in self.inputs[k]:
                    if jof[u] >= 0:
                        x = self._xfer(u, jof[u], k, j, i)[0]
                        start = np.maximum(start, (ef[u][None, :] + x).max(1))
                    elif self.needs_all[k][i]:
                        start = np.maximum(start, ef_min[u])
                ef[k] = start + f
                ef_min[k] = float(ef[k].min())
            else:
                start = max((ef_min[u] for i, u in self.inputs[k] if self.needs_all[k][i]), default=0.0)
                ef[k] = ef_min[k] = start + self.f_min[k]
        eb: list = [None] * n
        eb_min = [0.0] * n
        for k in reversed(range(n)):
            j = jof[k]
            if j >= 0:
                start = np.array(ef[k], dtype=float)
                for w, i in self.consumers[k]:
                    if jof[w] >= 0:
                        x = self._xfer(k, j, w, jof[w], i)[1]
                        start = np.maximum(start, (eb[w][:, None] + x).max(0))
                    elif self.covers[w][i]:
                        start = np.maximum(start, eb_min[w])
                eb[k] = start + tasks[self.group_of[k]][j][k][1]
                eb_min[k] = float(eb[k].min())
                bound = max(bound, float(eb[k].max()))
            else:
                start = max([ef_min[k]] + [eb_min[w] for w, i in self.consumers[k] if self.covers[w][i]])
                eb[k] = eb_min[k] = start + self.b_min[k]
                bound = max(bound, eb_min[k])
        # one task at a time per resource, tasks released at their earliest start
        res, rel, dur = [], [], []
        for k in range(n):
            j = jof[k]
            if j < 0:
                continue
            f, b, devs = tasks[self.group_of[k]][j][k]
            res += (devs, devs)
            rel += (ef[k] - f, eb[k] - b)
            dur += (f, b)
            for i, u in self.inputs[k]:
                if jof[u] >= 0:
                    _, _, (lf, qf, tf), (lb, qb, tb) = self._xfer(u, jof[u], k, j, i)
                    if len(lf):
                        res += (lf, lb)
                        rel += (ef[u][qf], eb[k][qb])
                        dur += (tf, tb)
        for gi in range(n_assigned):
            j = assign[gi]
            members = self.members[gi]
            upd = self.update[gi][j]
            if not upd.any():
                continue
            devs = self.devs[gi][j]
            held = np.max([eb[k] for k in members], axis=0)  # backward done on each partition
            after = held.copy()  # when each partition's update may start
            for sdur, links, parts in self.syncs[gi][j]:
                r = float(held[parts].max())
                res.append(links)
                rel.append(np.full(len(links), r))
                dur.append(np.full(len(links), sdur))
                after[parts] = np.maximum(after[parts], r + sdur)
            res.append(devs)
            rel.append(after)
            dur.append(upd[devs])
        if res:
            res, rel, dur = np.concatenate(res), np.concatenate(rel), np.concatenate(dur)
            order = np.lexsort((-rel, res))  # by resource, latest release first
            res, rel, dur = res[order], rel[order], dur[order]
            acc = np.cumsum(dur)
            first = np.flatnonzero(np.r_[True, res[1:] != res[:-1]])  # start of each resource's run
            base = np.repeat(np.r_[0.0, acc[first[1:] - 1]], np.diff(np.r_[first, len(res)]))
            bound = max(bound, float((rel + acc - base).max()))
        return bound - self.slack_s


def _sync_tasks(machine, op: Op, config: ParallelConfig, params) -> list:
    """(all-reduce seconds, link resource ids, holder partition indices) for every
    shard of the op's parameters ``params`` (local names) held by several
    partitions (equal or disjoint regions: partitions form a grid).  Only the bandwidth
    term of the ring all-reduce counts (t(2b) - t(b) of ``machine.allreduce_time_s``):
    the simulator may fuse gradients into buckets and share out the latency."""
    D = machine.num_devices
    out = []
    parts = partitions(op, config)
    for local in params:
        holders: dict = {}
        for p in parts:
            holders.setdefault(tuple((s.start, s.stop) for s in p.params[local]), []).append(p.index)
        for region, idx in holders.items():
            if len(idx) > 1:
                devs = [parts[i].device for i in idx]
                nbytes = math.prod(b - a for a, b in region) * dtype_bytes(op.dtype)
                bw_s = machine.allreduce_time_s(devs, 2 * nbytes) - machine.allreduce_time_s(devs, nbytes)
                out.append((max(bw_s, 0.0), [D + l for l in machine.allreduce_links(devs)], np.array(idx)))
    return out


def exhaustive_search(graph: OpGraph, machine, cost_model=None, max_states: int = 1_000_000, *,
                      candidates: Candidates | None = None, incumbent: Strategy | None = None):
    """Global optimum by branch and bound over every combination of candidate
    configs (one per share group), groups assigned in topological order, a
    subtree pruned when :class:`_Bound` proves it cannot beat the best
    simulated strategy so far.  Returns (strategy, SimResult, explored) where
    explored counts search-tree nodes.  Raises SearchError after ``max_states``
    nodes rather than claim an optimum it has not proved.  Feasibility is not
    pruned on: the optimum is over time among feasible strategies when one
    exists (bounds on time stay valid for the feasible subset)."""
    cm = cost_model if cost_model is not None else CostModel(machine)
    space = _Space(graph, machine, candidates)
    bound = _Bound(graph, machine, space, cm)
    sim = _simulator(graph, machine, cm)
    n = len(space.reps)
    best = {"key": None, "s": None, "res": None}
    scale = [None]

    def consider(s, res):
        if scale[0] is None:
            scale[0] = res.iteration_time
        k = (0 if res.feasible else 1, _penalised(res, machine, scale[0]))
        if _better(k, best["key"]):
            best.update(key=k, s=s, res=res)

    starts = [incumbent] if incumbent is not None else []
    starts += [Strategy.data_parallel(graph, machine), Strategy.expert(graph, machine),
               Strategy.model_parallel(graph, machine)]
    for s in starts:
        if space.contains(s):
            consider(s, sim.simulate(s, incremental=False))
    explored = 0
    cur = [space.random(0, "exhaustive")]
    assign: list[int] = []

    def visit(gi: int):
        nonlocal explored
        explored += 1
        if explored > max_states:
            raise SearchError(f"exhaustive search gave up after max_states={max_states} states; "
                              f"restrict the candidates or raise max_states")
        if gi == n:
            consider(cur[0], sim.simulate(cur[0], incremental=True))
            return
        children = []
        for j in range(len(space.cands[gi])):
            assign.append(j)
            children.append((bound(assign), j))  # visit the most promising first
            assign.pop()
        children.sort()
        for b, j in children:
            key = best["key"]
            if key is not None and key[0] == 0 and b >= key[1] * (1.0 - _REL):
                break  # this child and the rest cannot beat the best
            assign.append(j)
            prev = cur[0]
            cur[0] = prev.replace(space.reps[gi], space.cands[gi][j])
            visit(gi + 1)
            cur[0] = prev
            assign.pop()

    visit(0)
    s = Strategy(graph, dict(best["s"]), machine, name="exhaustive")
    return s, best["res"], explored
