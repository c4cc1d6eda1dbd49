"""The load lower bound (flexflow/bound.py) and the search's screen built on it: the bound
never exceeds the simulated iteration time, its incremental update equals a fresh one, and
a search screened by it follows exactly the chain of an unscreened one."""
import random

import pytest

import flexflow as ff
from flexflow.sim.bound import LoadBound
from flexflow.cost.model import CostModel
from flexflow.hardware.machine import Machine
from flexflow.search import search
from flexflow.search.common import _Space
from flexflow.search.mcmc import _propose
from flexflow.sim.simulate import Simulator
from flexflow.strategy.strategy import Strategy
from flexflow.sim.taskkeys import PS


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name in ("lenet", "rnnlm", "inception_v3"):
        module, inputs = ff.models.get(name, batch_size=64 * 8, size="small", device="meta")
        out[name] = ff.trace(module, inputs)
    return out


@pytest.mark.parametrize("name,sync", [("lenet", "ring"), ("rnnlm", "ring"), ("inception_v3", "ring"),
                                       ("rnnlm", "ps")])
def test_bound_is_below_the_simulation_and_incremental_equals_fresh(graphs, name, sync):
    g = graphs[name]
    m = Machine.preset("k80-cluster", devices=8)  # two nodes: transfers on several links
    sim = Simulator(g, m, CostModel(m), sync=sync)
    space = _Space(g, m)
    rng = random.Random(5)
    cur = Strategy.random(g, m, 3)
    bound = LoadBound(sim.ctx, cur)
    assert bound.value() <= round(sim.simulate(cur).iteration_time * PS)
    tight = []
    for i in range(60):
        new, groups = _propose(rng, space, cur, 0.5)
        lb = bound.lower_bound(new, groups)
        end = round(sim.simulate(new).iteration_time * PS)
        assert lb <= end, (i, lb, end)
        assert lb == LoadBound(sim.ctx, new).value()
        tight.append(lb / end)
        if rng.random() < 0.5:
            bound.commit(new)
            cur = new
    assert max(tight) > 0.5  # a bound, not a trivial one


def test_commit_needs_the_bounded_strategy(graphs):
    g = graphs["lenet"]
    m = Machine.preset("p100-cluster", devices=4)
    sim = Simulator(g, m, CostModel(m))
    dp = Strategy.data_parallel(g, m)
    bound = LoadBound(sim.ctx, dp)
    with pytest.raises(ValueError):
        bound.commit(dp)


@pytest.mark.parametrize("name", ["inception_v3", "rnnlm"])
def test_screen_keeps_the_chain(graphs, name):
    g = graphs[name]
    m = Machine.preset("k80-cluster", devices=8)
    runs = [search(g, m, evaluations=300, seed=2, progress=False, screen=s) for s in (True, False)]
    a, b = runs
    # screened: the load bound settles it; cut: the schedule stops once it proves the
    # proposal slower than anything the test accepts (Simulator.simulate_within)
    assert a.screened > 0 and a.cut > 0 and b.screened == b.cut == 0
    assert a.simulations + a.screened + a.cut == a.evaluations == b.evaluations == b.simulations
    assert a.strategy.to_json() == b.strategy.to_json()
    assert a.accept_rate == b.accept_rate
    assert [(e, t) for e, _, t in a.history] == [(e, t) for e, _, t in b.history]


def test_threads_do_not_change_the_result(graphs, monkeypatch):
    """Proposals are simulated in rounds side by side (search/parallel.py); the rounds are
    the same whatever the number of threads, so the search is too, polish included."""
    from flexflow.search import parallel

    g = graphs["inception_v3"]
    m = Machine.preset("k80-cluster", devices=8)
    runs = []
    for threads in ("1", "3"):
        monkeypatch.setenv("FLEXFLOW_SEARCH_THREADS", threads)
        assert parallel.Evaluator().threads == int(threads)
        runs.append(search(g, m, evaluations=400, seed=5, progress=False))
    a, b = runs
    assert a.strategy.to_json() == b.strategy.to_json()
    assert (a.evaluations, a.simulations, a.screened, a.cut) == (b.evaluations, b.simulations, b.screened, b.cut)
    assert [(e, t) for e, _, t in a.history] == [(e, t) for e, _, t in b.history]
    assert a.accept_rate == b.accept_rate and a.local_optimum == b.local_optimum


def test_a_hopeless_start_is_screened_not_simulated(graphs, monkeypatch):
    """A random start whose load bound is already more than 1.5x another start's cost would
    begin at the best start anyway: the screen settles it without building its (large) task
    graph, and the chain is the one an unscreened search follows."""
    import flexflow.sim.simulate as sim_mod
    g = graphs["inception_v3"]
    m = Machine.preset("k80-cluster", devices=8)
    simulated = []
    real = sim_mod.Simulator._simulate_gc

    def spy(self, strategy, *a, **k):
        simulated.append(getattr(strategy, "name", ""))
        return real(self, strategy, *a, **k)
    monkeypatch.setattr(sim_mod.Simulator, "_simulate_gc", spy)
    a = search(g, m, evaluations=60, seed=3, progress=False, chains=6)
    starts = [n for n in a.chains if n.startswith("random")]
    assert starts and not any(n.startswith("random") for n in simulated)
    b = search(g, m, evaluations=60, seed=3, progress=False, chains=6, screen=False)
    assert any(n.startswith("random") for n in simulated)  # (unscreened: simulated)
    assert a.strategy.to_json() == b.strategy.to_json() and a.evaluations == b.evaluations
    assert [(e, t) for e, _, t in a.history] == [(e, t) for e, _, t in b.history]


def test_block_moves_carry_a_split_downstream(graphs):
    g = graphs["inception_v3"]
    m = Machine.preset("k80-cluster", devices=8)
    space = _Space(g, m)
    rng = random.Random(0)
    cur = Strategy.data_parallel(g, m)
    sizes = []
    for _ in range(200):
        new, groups = _propose(rng, space, cur, 1.0)
        assert len(set(groups)) == len(groups)
        changed = [gi for gi, rep in enumerate(space.reps) if new[rep] != cur[rep]]
        assert sorted(changed) == sorted(groups)
        assert all(new[space.reps[gi]] in space.index[gi] for gi in groups)
        sizes.append(len(groups))
    assert max(sizes) > 4
    assert all(len(_propose(rng, space, cur, 0.0)[1]) == 1 for _ in range(50))


def test_reused_baseline_results_give_the_same_search(graphs):
    from flexflow.search import SearchError, baseline_strategies
    g = graphs["rnnlm"]
    m = Machine.preset("k80-cluster", devices=8)
    cm = CostModel(m)
    base = baseline_strategies(g, m, cm)
    sim = Simulator(g, m, cm)
    res = {k: sim.simulate(s, incremental=False) for k, s in base.items()}
    a = search(g, m, evaluations=300, seed=4, cost_model=cm, progress=False, baselines=base)
    b = search(g, m, evaluations=300, seed=4, cost_model=cm, progress=False, baselines=base,
               baseline_results=res)
    assert a.strategy.to_json() == b.strategy.to_json() and a.evaluations == b.evaluations
    assert [(e, t) for e, _, t in a.history] == [(e, t) for e, _, t in b.history]
    assert a.simulations == b.simulations and all(b.baselines[k] is res[k] for k in res)  # reused as given
    with pytest.raises(SearchError, match="baseline_results"):
        search(g, m, evaluations=10, cost_model=cm, progress=False, baseline_results=res)
