"""MCMC search (section 5 of the paper); the local descent that polishes its best is ``descent.py``."""
from __future__ import annotations

import functools
import math
import random
import time
import warnings

from ..cost.precision import precision as _precision
from ..cost.precision import priced_cost_model
from ..graph.ir import OpGraph
from ..sim.bound import LoadBound
from ..sim.simulate import deferred_collections
from ..sim.taskkeys import PS
from ..strategy.strategy import Strategy
from .baselines import baseline_strategies, cpu_seconds, keep, memory_baselines, reuse_key, reused
from .levers import LEVER_MOVE, Levers
from .descent import _evaluate, descend, is_local_optimum
from .parallel import ROUND, Evaluator
from .pipemoves import descend_pipeline
from .repeats import REPEAT_MOVE, Repeats
from .common import (
    BASELINES,
    Candidates,
    SearchError,
    SearchResult,
    _better,
    _Run,
    _simulator,
    _analytic_model,
    _Space,
)

__all__ = ["search", "is_local_optimum"]

_WARMUP = 50  # proposals a chain makes before it may restart from the best chain
_LAGGING = 1.5  # ... when its cost is more than this times the best chain's
_OVERHEAD_TASKS = 200  # a proposal's fixed cost, in tasks, for the turn taking


def _deferred_collections(fn):
    """``fn`` with the cyclic collector off (``simulate.deferred_collections``)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with deferred_collections():
            return fn(*args, **kwargs)
    return run


@_deferred_collections
def search(graph: OpGraph, machine, budget: float = 30.0, seed: int = 0, cost_model=None, *,
           evaluations: int | None = None, init: Strategy | str | None = None, progress=None,
           chains: int | None = None, delta: bool = True, candidates: Candidates | None = None,
           polish: bool = True, temperature: float = 0.01,
           baselines: dict | None = None, optimizer: str = "sgd", sync: str = "ring",
           screen: bool = True, block: float = 0.1, baseline_results: dict | None = None,
           reduce_outputs: str = "with_gradients", shard: bool = True,
           precision: str = "32-true", recompute: bool | None = None, repeat: bool = True) -> SearchResult:
    """MCMC search for a fast strategy of ``graph`` on ``machine``.

    shard: whether shard levels (``ParallelConfig.shard``) may be chosen.  They are a memory
        lever: where memory binds (data parallelism does not fit) the ``fsdp`` baseline is one
        of the strategies the result is never worse than and the chains change shard levels
        too (``levers.py``); where data parallelism fits the search is the plain SOAP search.
    recompute: whether recomputation (``ParallelConfig.recompute``) may be chosen, where
        memory binds; None (the default): as ``shard`` (so ``shard=False``, which
        ``parallelize`` passes for an executor that runs neither, gives neither).  With both
        False the search is the plain SOAP search, bit for bit.

    budget: seconds for the whole call (baselines included); ignored when
        ``evaluations`` is given, which makes the run reproducible (same seed and
        evaluations -> same strategy, whatever the wall time).
    init: a Strategy (or its JSON text) to start one more chain from.
    chains: number of chains (default: init if given, data parallel, expert,
        OptCNN, everything on device 0 and one random start); more chains add
        random starts.
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
    baseline_results: name -> SimResult of those ``baselines`` under this cost
        model, optimizer and sync model (e.g. a previous result's ``baselines``), to
        reuse instead of simulating them again.
    optimizer: "sgd", "momentum" or "adam": whose state counts in the memory
        every strategy must fit.
    sync: the simulator's parameter-sync model ("ring", or "ps" for the paper's
        parameter server; see :class:`flexflow.Simulator`).
    reduce_outputs: how the executor will return the loss to every rank
        (:func:`flexflow.parallelize`), which the simulator prices.
    screen: reject, without simulating, a proposal whose lower bound (the load of
        its busiest device or link, :class:`flexflow.sim.bound.LoadBound`) already fails
        the acceptance test.  The uniform draw of the test is made before the
        simulation, so the chain is the same with and without the screen; a
        screened proposal counts as an evaluation (``SearchResult.screened``; the
        simulated ones are ``SearchResult.simulations``).  With the screen on, a
        simulation also stops as soon as its schedule proves the proposal would be
        rejected (``Simulator.simulate_within``; ``SearchResult.cut``).
    precision: "32-true", "bf16-mixed", "16-mixed" or "bf16-true": the training precision
        every simulator prices (see :class:`flexflow.Simulator`); the OptCNN baseline
        times its ops in it too.
    repeat: whether repeat moves are made where the graph repeats a block (a transformer's
        layers): with probability ``repeats.REPEAT_MOVE`` a proposal gives the same op of
        every block one config (``repeats.py``), and the polish tries aligning them.
    block: probability that a proposal is a block move: the chosen config then
        continues downstream through up to 8 consumer groups (``_Space.follow``:
        the same config, or the same split of another op kind), as a layer's ops or
        an embedding and its per-step slices move together.
    """
    t0 = time.perf_counter()
    if evaluations is not None and (isinstance(evaluations, bool) or int(evaluations) < 1):
        raise SearchError(f"evaluations must be a positive integer, got {evaluations!r}")
    if evaluations is None and not budget > 0:
        raise SearchError(f"budget must be a positive number of seconds, got {budget!r}")
    precision = _precision(precision).name  # a clear error for an unknown name
    cm = cost_model if cost_model is not None else _analytic_model(machine, graph)
    space = _Space(graph, machine, candidates)
    if isinstance(init, str):
        init = Strategy.from_json(init, graph, machine)
    if init is not None:
        if init.graph is not graph and init.graph.fingerprint() != graph.fingerprint():
            raise SearchError("init strategy was made for another graph")
        init.check(machine)

    make_sim = functools.partial(_simulator, graph, machine, cm, optimizer, sync, reduce_outputs, precision)
    base_sims = {}  # baseline -> the simulator holding its task graph: the chain starting there goes on from it
    key = None
    if baselines is None and baseline_results is None and candidates is None:
        key = reuse_key(graph, machine, cost_model, optimizer, sync, reduce_outputs, precision, shard)
    hit = reused(key, graph, machine)
    reused_baselines = hit is not None
    cpu0 = cpu_seconds()
    if hit is not None:  # an earlier search of this graph on this machine built and simulated them
        base, base_res = hit
    else:
        base = dict(baselines) if baselines is not None else baseline_strategies(
            graph, machine, priced_cost_model(cm, precision, graph), candidates=candidates, shard=shard, memory=False)
    missing = [k for k in BASELINES if k not in base]
    if missing:
        raise SearchError(f"baselines lack {missing}")
    if hit is not None:
        base_res = hit[1]
    elif baseline_results is not None:
        if baselines is None or set(baseline_results) != set(base):
            raise SearchError("baseline_results needs the baselines it was simulated from")
        base_res = dict(baseline_results)
    else:
        base_res = {"data_parallel": _simulate_on(base_sims, "data_parallel", base["data_parallel"], make_sim)}
        if baselines is None and not base_res["data_parallel"].feasible:
            # shard levels, recomputation and tensor parallelism are memory plans: only where
            # data parallelism does not fit are fsdp, megatron and fsdp_tp built and simulated
            # (where it fits, the search keeps to the plain space: the simulator's sync order
            # favours sharded clusters over a data-parallel bucket chain by more than a real
            # run would, see docs/limitations.md; and the zoo's models that fit train fastest
            # without tensor parallelism)
            base.update(memory_baselines(graph, machine, shard=shard, data_parallel=base["data_parallel"]))
        base_res.update({k: _simulate_on(base_sims, k, s, make_sim) for k, s in base.items() if k not in base_res})
        keep(key, base, base_res, cost_model, cpu_seconds() - cpu0)
    spent = time.perf_counter() - t0
    if evaluations is None and spent >= 0.5 * budget:
        warnings.warn(f"building and simulating the baselines took {spent:.1f} s of the {budget:g}-s budget, "
                      f"which leaves the search {max(budget - spent, 0):.1f} s; give a larger budget, or reuse "
                      f"a previous result's baselines: search(..., baselines=result.baseline_strategies, "
                      f"baseline_results=result.baselines)", stacklevel=3)
    if recompute is None:
        recompute = shard
    dp_fits = base_res["data_parallel"].feasible
    levers = None
    if (shard or recompute) and not dp_fits:
        # memory binds: shard levels and recomputation join the space (levers.py)
        ctx = make_sim().ctx
        levers = Levers(space, ctx, shard, recompute) or None
    repeats = (Repeats(space) or None) if repeat else None
    feasible = [r.iteration_time for r in base_res.values() if r.feasible]
    scale_s = min(feasible or [r.iteration_time for r in base_res.values()])
    scale_s = scale_s if scale_s > 0 else 1e-6
    # beta relative to the cost scale: a move `temperature` (1%) slower than the
    # best baseline is accepted half the time, 5% slower 3% of the time.
    beta = math.log(2.0) / (temperature * scale_s)

    starts: list[tuple[str, Strategy]] = [("init", init)] if init is not None else []
    starts += [(k, base[k]) for k in ("data_parallel", "expert", "optcnn")]
    if levers is not None:
        starts += levers.starts(base)
    starts += [(k, base[k]) for k in ("megatron", "fsdp_tp") if k in base_res]
    one = Strategy.single_device(graph, machine)
    if all(one[rep] in space.index[i] for i, rep in enumerate(space.reps)):  # within the space
        starts.append(("single_device", one))
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
    # pipelined plans (the 3-D baselines) get the last fifth of the budget: their own moves
    # (micro-batches, schedule, stage boundaries: pipemoves.py) from the fastest of them
    piped = [k for k in base if base[k].pipeline is not None and k in base_res]
    polish_frac = 0.8 if piped else 1.0
    mcmc_frac = (0.6 if piped else 0.75) if polish else polish_frac
    proposed = accepted = 0
    try:
        state, cost, sims, bounds, size = [], [], [], [], []
        for name, s in starts:
            sim = base_sims.pop(name, None) or make_sim()
            sims.append(sim)
            state.append(s)
            if name not in base_res and screen and cost and \
                    LoadBound(sim.ctx, s).value() / PS > _LAGGING * min(cost) * (1.0 + 1e-12):
                # its cost is at least its load bound, more than _LAGGING times a start's:
                # it would begin at the best start instead (below), simulated or not (a
                # random start at 64 devices has 10x data parallelism's tasks)
                run.screened()
                cost.append(math.inf)
                size.append(0)
                continue
            # a baseline start is simulated already; the chain's simulator starts with its
            # first proposal
            res = base_res[name] if name in base_res else sim.simulate(s, incremental=delta)
            cost.append(run.seen(s, res, count=name not in base_res)[1])
            size.append(res.num_tasks)
        run.started()
        base_sims.clear()  # (the baselines no chain starts from: their task graphs go)
        lead = min(range(len(starts)), key=cost.__getitem__)
        for c in range(len(starts)):  # a hopeless start begins at the best one instead
            if cost[c] > _LAGGING * cost[lead]:
                state[c], cost[c], size[c] = state[lead], cost[lead], size[lead]
                sims[c] = make_sim()  # (its own start's task graph goes now, not when it rebuilds)
        bounds = [LoadBound(sim.ctx, s) if screen else None for sim, s in zip(sims, state)]
        # Chains take turns by work, not by rounds: the next proposal goes to the chain whose
        # proposals so far add up to the fewest tasks (its current task graph's size per
        # proposal), so a chain sitting on a huge task graph (OptCNN's or a random start's
        # at 64 devices: 10x data parallelism's tasks) does not eat the budget.  A chain
        # that is more than ``_LAGGING`` times the best chain's cost after ``_WARMUP``
        # proposals restarts from the best chain's state.  Both rules see only accepted
        # states, so the screen does not change them.
        work = [0] * len(starts)
        moves = [0] * len(starts)
        with Evaluator() as ev:
            while space.movable and not run.spent(mcmc_frac, patience=True):
                # a round: up to ROUND proposals, of distinct chains (parallel.py); those the
                # screen leaves are simulated side by side, then read in the order they were made
                # (the screen settles a proposal in its place: the rounds, and so the chains, are
                # the same with and without it)
                jobs, picked = [], set()
                while len(picked) < min(ROUND, len(starts)):
                    if run.spent(mcmc_frac, patience=True, pending=len(jobs)):
                        break
                    c = min((i for i in range(len(starts)) if i not in picked), key=work.__getitem__)
                    picked.add(c)
                    work[c] += size[c] + _OVERHEAD_TASKS
                    moves[c] += 1
                    lead = min(range(len(starts)), key=cost.__getitem__)
                    if moves[c] > _WARMUP and cost[c] > _LAGGING * cost[lead]:
                        state[c], cost[c], size[c] = state[lead], cost[lead], size[lead]
                        if screen:
                            bounds[c] = LoadBound(sims[c].ctx, state[c])
                        moves[c] = 0
                    new, groups = _propose(rng, space, state[c], block, levers, repeats)
                    # accept iff cost <= cur or u < exp(-beta (cost - cur)), u drawn first
                    u = rng.random()
                    proposed += 1
                    limit = None
                    if screen:
                        lb = bounds[c].lower_bound(new, groups) / PS
                        # cost >= lb > cur and u >= exp(-beta (lb - cur)) >= exp(-beta (cost - cur)):
                        # the test below would reject it (the factor guards against rounding)
                        if lb > cost[c] and run.can_screen(lb) and \
                                u >= math.exp(-beta * (lb - cost[c])) * (1.0 + 1e-12):
                            jobs.append((c, None, u, None))  # screened: counted in its place below
                            continue
                        if run.best_key is not None and run.best_key[0] == 0:
                            # The test rejects every cost above max(cost - ln(u) / beta, best) (u = 0:
                            # none); the schedule stops as soon as it proves the time is above it.
                            limit = max(cost[c] - math.log(u) / beta, run.best_key[1]) * (1.0 + 1e-9) \
                                if u > 0 else math.inf
                    jobs.append((c, new, u, limit))
                results = iter(ev.map([(_evaluate, sims[c], new, limit, delta)
                                        for c, new, _, limit in jobs if new is not None]))
                for c, new, u, _ in jobs:
                    k, res = run.settle(new, results, new is None)
                    if k is not None and (k[1] <= cost[c] or u < math.exp(-beta * (k[1] - cost[c]))):
                        state[c], cost[c], size[c] = new, k[1], res.num_tasks
                        accepted += 1
                        if screen:
                            bounds[c].commit(new)  # (its last lower_bound was this proposal's)
            converged = False
            if polish and space.movable:
                order = sorted(range(len(starts)), key=cost.__getitem__)  # the best chain's first
                converged, _ = descend(run, space, graph, [sims[c] for c in order], make_sim, ev, delta, seed,
                                       screen, levers, repeats, until=polish_frac)
            if piped:  # the fastest pipelined plan's own moves
                first = min(piped, key=lambda k: run.key(base_res[k]))
                descend_pipeline(run, make_sim(), base[first], base_res[first], 1.0)
    finally:
        run.close()

    best, best_res, best_key, source = run.best, run.best_res, run.best_key, "search"
    for k in base:  # never worse than a baseline
        kk = run.key(base_res[k])
        if kk[0] == best_key[0] == 1:  # nothing fits: never slower than a baseline either
            kk = (1, base_res[k].iteration_time)
            best_key = (1, best_res.iteration_time)
        if _better(kk, best_key):
            best, best_res, best_key, source = base[k], base_res[k], kk, k
            converged = False  # the polish's optimum was not this one
    if source == "search":
        same = next((k for k in base if base[k] == best), None)
        if same is not None:  # the search ended where a baseline started: say so
            best, best_res, source = base[same], base_res[same], same
        else:
            best = Strategy(graph, dict(best), machine, name="search",
                            pipeline=best.pipeline.to_dict() if best.pipeline is not None else None)
    return SearchResult(best, best_res, base_res, run.evals, time.perf_counter() - t0, base,
                        run.history, accepted / max(proposed, 1), beta, [n for n, _ in starts],
                        source, converged, baseline_s, run.sims, run.screens, run.cuts,
                        run.start_sims, run.start_screens, max(run.start_s - baseline_s, 0.0), reused_baselines)


def _simulate_on(sims: dict, name: str, strategy: Strategy, make_sim):
    """A baseline simulated from scratch.  Data parallelism gets a simulator of its own, the
    others take turns on one (at 64 GPUs a 70B model's task graphs are gigabytes each: they
    are not all kept); ``sims`` maps a baseline to the simulator still holding its graph,
    which the chain that starts there goes on from."""
    held = next((k for k in sims if k != "data_parallel"), None)
    sim = make_sim() if name == "data_parallel" or held is None else sims.pop(held)
    sims[name] = sim
    return sim.simulate(strategy, incremental=False)


def _propose(rng: random.Random, space: _Space, cur: Strategy, block: float,
             levers: Levers | None = None, repeats: Repeats | None = None) -> tuple[Strategy, list[int]]:
    """A random move from ``cur`` (:func:`_move`), drawn again where it breaks the token
    layout (a causal attention moved off the head-tail split the others keep: a
    :class:`StrategyError` from ``Strategy.replace``)."""
    for _ in range(64):
        try:
            return _move(rng, space, cur, block, levers, repeats)
        except StrategyError:
            continue
    raise SearchError("64 proposals in a row broke the strategy's token layout")


def _move(rng: random.Random, space: _Space, cur: Strategy, block: float,
          levers: Levers | None = None, repeats: Repeats | None = None) -> tuple[Strategy, list[int]]:
    """A random move from ``cur``: one movable share group to another of its candidates
    (uniformly: a symmetric proposal), and with probability ``block`` the same split carried
    on downstream through 1-8 consumer groups.  With ``levers`` (memory binds), with
    probability ``LEVER_MOVE`` a lever move instead (shard level or recomputation of one
    group or of every group of its op kind), and a changed group keeps its levers where its
    new config can take them.  Returns (strategy, changed groups)."""
    if levers is not None and rng.random() < LEVER_MOVE:
        move = levers.propose(rng, cur)
        if move is not None:
            return move
    if repeats and rng.random() < REPEAT_MOVE:
        move = repeats.propose(rng, cur, levers)
        if move is not None:
            return move
    gi = space.movable[rng.randrange(len(space.movable))]
    rep, cs, ix = space.reps[gi], space.cands[gi], space.index[gi]
    now = ix.get(cur[rep] if levers is None else levers.base(cur[rep]))
    if now is None:
        j = rng.randrange(len(cs))
    else:
        j = rng.randrange(len(cs) - 1)
        j += j >= now
    cfg = cs[j]
    new = cur.replace(rep, cfg if levers is None else levers.carry(gi, cfg, cur[rep]))
    groups = [gi]
    if block and rng.random() < block:
        extra = 1 << rng.randrange(4)
        seen, g = {gi}, gi
        while extra:
            step = None
            for h in space.next_groups(g):
                if h not in seen:
                    c = space.follow(h, cfg)
                    if c is not None:
                        step = h, c
                        break
            if step is None:
                break
            g, cfg = step
            seen.add(g)
            c = cfg if levers is None else levers.carry(g, cfg, new[space.reps[g]])
            if new[space.reps[g]] != c:
                new = new.replace(space.reps[g], c)
                groups.append(g)
            extra -= 1
    return new, groups
