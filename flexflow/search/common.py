"""What every search shares: the space of configs per share group, the cost of a
simulated result (time plus a memory penalty), the search result and the budget."""
from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..graph.ir import Op, OpGraph
from ..strategy.candidates import candidate_configs
from ..strategy.config import ParallelConfig
from ..strategy.strategy import Strategy

__all__ = ["SearchError", "SearchResult", "BASELINES"]

# the baselines every search has (``fsdp``, ``megatron`` and ``fsdp_tp`` join them where data
# parallelism does not fit and the graph has parameters to shard, pairs of linear layers to split)
BASELINES = ("data_parallel", "model_parallel", "expert", "optcnn")
Candidates = Callable[[Op, object], Sequence[ParallelConfig]]
_REL = 1e-12  # relative tolerance: smaller differences are float noise, not improvements


class SearchError(ValueError):
    """The search cannot run on this graph/machine (no candidate config, bad init, ...)."""


def _simulator(graph: OpGraph, machine, cost_model, optimizer: str = "sgd", sync: str = "ring",
               reduce_outputs: str = "with_gradients", precision: str = "32-true"):
    from ..sim.simulate import (
        Simulator,  # imported late: simulate imports nothing from here
    )
    return Simulator(graph, machine, cost_model, optimizer=optimizer, sync=sync, reduce_outputs=reduce_outputs,
                     precision=precision)


# the analytic cost model a search made for a machine (fingerprint -> (machine, model)): the
# next search there with the same default model reuses it, and with it the plans its simulator
# contexts cached (templates, transfer and parameter plans, memory events), which a new model
# computes again (a fifth of a 15-s search of nmt at 64 devices)
_MODELS: dict = {}


def _analytic_model(machine, graph: OpGraph):
    """``CostModel(machine)``, or the equal one an earlier search on this machine object made
    (its contexts of other graphs dropped)."""
    from ..cost.model import CostModel
    fresh = CostModel(machine)
    key = machine.fingerprint()
    hit = _MODELS.get(key)
    if hit is not None and hit[0] is machine and _same_model(hit[1], fresh):
        cm = hit[1]
        ctxs = cm.__dict__.get("_simulator_contexts")
        if ctxs:
            for k in [k for k, c in ctxs.items() if c.graph is not graph]:
                del ctxs[k]
        return cm
    _MODELS.clear()  # (one machine's at a time: the contexts hold their graphs' plans)
    _MODELS[key] = (machine, fresh)
    return fresh


def _same_model(a, b) -> bool:
    """Whether two cost models give the same times (what ``CostModel.__init__`` sets)."""
    return (type(a) is type(b) and a.machine is b.machine and a.efficiency == b.efficiency
            and a.profile is b.profile and a.overhead == b.overhead and a.fits == b.fits)


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
        self._next: list | None = None
        self._follow: dict = {}

    def next_groups(self, gi: int) -> list[int]:
        """Share groups that consume an output of group ``gi``, in graph order."""
        if self._next is None:
            gid = {op: i for i, k in enumerate(self.keys) for op in self.graph.groups[k]}
            nxt = [dict() for _ in self.keys]
            for op in self.graph.compute_ops:
                for u in op.inputs:
                    if u in gid and gid[u] != gid[op.name]:
                        nxt[gid[u]][gid[op.name]] = None
            self._next = [list(d) for d in nxt]
        return self._next[gi]

    def follow(self, gi: int, cfg: ParallelConfig) -> ParallelConfig | None:
        """The config of group ``gi`` that continues a producer's ``cfg``: ``cfg`` itself when
        it is a candidate, else a candidate on the same devices with the same degrees (dims
        named differently: an embedding split along its embedding dim, a slice of it along
        channels); None when there is none."""
        key = (gi, cfg)
        if key in self._follow:
            return self._follow[key]
        out = None
        if cfg in self.index[gi]:
            out = cfg
        else:
            shape = sorted(d for d in cfg.degrees.values() if d > 1)
            for c in self.cands[gi]:
                if c.devices == cfg.devices and sorted(d for d in c.degrees.values() if d > 1) == shape:
                    out = c
                    break
        self._follow[key] = out
        return out

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
    evaluations: int  # proposals the search scored (MCMC moves and the polish's changes):
    #   simulated in full or by delta (``simulations``), stopped once a proven bound showed
    #   them rejected (``cut``), or rejected by the load lower bound (``screened``); the
    #   chain starts (``start_simulations``, ``start_screened``) and the baselines are apart
    seconds: float  # wall time of the whole call, baselines included
    baseline_strategies: dict = field(default_factory=dict)  # name -> Strategy
    history: list = field(default_factory=list)  # (evaluations, seconds, best iteration time) at each improvement
    accept_rate: float = 0.0  # accepted / proposed MCMC moves
    beta: float = 0.0  # 1/s: p(S) ~ exp(-beta * cost(S))
    chains: list = field(default_factory=list)  # start strategy name of each chain
    source: str = "search"  # "search", or the baseline returned because the search did not beat it
    local_optimum: bool = False  # the polish ended with no single-group change improving it
    baseline_seconds: float = 0.0  # of ``seconds``: building and simulating the baselines
    simulations: int = 0  # of ``evaluations``: the ones simulated (delta or full)
    screened: int = 0  # of ``evaluations``: rejected by the load lower bound, not simulated
    cut: int = 0  # of ``evaluations``: simulations stopped once slower than any acceptable cost
    start_simulations: int = 0  # chain starts (and the polish's start) simulated, not evaluations
    start_screened: int = 0  # chain starts left out by their load lower bound, not simulated
    start_seconds: float = 0.0  # of ``seconds``: the chain starts, after the baselines
    baselines_reused: bool = False  # the baselines came from an earlier call (same graph and machine)

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
                "search_seconds": self.seconds, "evaluations": self.evaluations,
                "baseline_seconds": self.baseline_seconds, "start_seconds": self.start_seconds,
                "starts": {"simulated": self.start_simulations, "screened": self.start_screened},
                "proposals": {"simulated": self.simulations, "cut": self.cut, "screened": self.screened}}

    def summary(self) -> str:
        """The searched strategy against the baselines, as a table."""
        lines = [(f"best: {self.result.iteration_time * 1e3:.3f} ms/iteration ({self.source}), "
                  f"{self.evaluations} evaluations in {self.seconds:.1f} s (baselines "
                  f"{self.baseline_seconds:.1f} s, {self.start_simulations + self.start_screened} chain starts "
                  f"{self.start_seconds:.1f} s)")]
        for k, r in self.baselines.items():
            tag = "" if r.feasible else " (out of memory)"
            lines.append(f"  {k:>15}: {r.iteration_time * 1e3:.3f} ms{tag}")
        return "\n".join(lines)


class _Run:
    """Budget, evaluation count, best-so-far and progress display of one search."""

    def __init__(self, machine, budget_s, evaluations, t0, progress, scale_s):
        self.machine, self.budget_s, self.max_evals, self.t0 = machine, budget_s, evaluations, t0
        self.scale_s = scale_s
        self.evals = 0  # proposals evaluated: simulated (``sims``), cut or screened out
        self.sims = 0
        self.cuts = 0  # of evals: simulations stopped early (``cut``)
        self.screens = 0  # of evals: rejected by the load lower bound
        self.starting = True  # chain starts: counted apart (``start_sims``, ``start_screens``)
        self.start_sims = self.start_screens = 0
        self.start_s = 0.0
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

    def started(self) -> None:
        """The chain starts are done: from here on what is scored is a proposal."""
        if self.starting:
            self.starting = False
            self.start_s = self.elapsed()

    def seen(self, strategy: Strategy, res, start: bool = False, count: bool = True) -> tuple:
        """Count one evaluation (or, during the chain starts or with ``start``, one start
        simulated; ``count=False``: a start simulated before, a baseline); remember it
        when it is the best so far."""
        if self.starting or start:
            self.start_sims += count
        else:
            self.evals += 1
            self.sims += 1
        k = self.key(res)
        if _better(k, self.best_key):
            self.best_key, self.best, self.best_res = k, strategy, res
            self.last_improve_evals, self.last_improve_s = self.evals, self.elapsed()
            self.history.append((self.evals, self.last_improve_s, res.iteration_time))
        self._show()
        return k

    def can_screen(self, lower_bound_s: float) -> bool:
        """Whether a strategy whose cost is at least ``lower_bound_s`` cannot be the new best:
        a feasible strategy no slower than the bound was seen."""
        return self.best_key is not None and self.best_key[0] == 0 and lower_bound_s >= self.best_key[1]

    def screened(self) -> None:
        """Count one evaluation (a start, during the chain starts) settled by the lower
        bound, without a simulation."""
        if self.starting:
            self.start_screens += 1
        else:
            self.evals += 1
            self.screens += 1
        self._show()

    def cut(self) -> None:
        """Count one evaluation settled by a simulation stopped early: its schedule proved it
        slower than anything the search would accept (``Simulator.simulate_within``)."""
        self.evals += 1
        self.cuts += 1
        self._show()

    def settle(self, strategy: Strategy, results, screened: bool) -> tuple:
        """Count one proposal of a round, in its place: screened (``screened``), or the next
        of ``results`` (an iterator over the round's simulations): cut (None) or simulated.
        Returns (cost key, result) of a simulated one, else (None, None)."""
        if screened:
            self.screened()
            return None, None
        res = next(results)
        if res is None:
            self.cut()
            return None, None
        return self.seen(strategy, res), res

    def _show(self) -> None:
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

    def spent(self, frac: float, patience: bool, pending: int = 0) -> bool:
        """Whether the phase that may use ``frac`` of the budget is over: that much
        is spent, or (patience) nothing improved for half of it.  ``pending``: evaluations
        made but not yet counted (a round's)."""
        if self.max_evals is not None:
            limit = self.max_evals * frac
            n = self.evals + pending
            return n >= limit or (patience and n - self.last_improve_evals >= limit / 2)
        now = self.elapsed()
        limit = self.budget_s * frac
        return now >= limit or (patience and now - self.last_improve_s >= limit / 2)

    def close(self):
        if self.bar is not None:
            self.bar.update(self.evals - self._shown)
            self.bar.close()
