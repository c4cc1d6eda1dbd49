"""Strategy search: MCMC against the exhaustive optimum, local optimality,
reproducibility, never worse than a baseline, memory feasibility, and OptCNN's
dynamic programming against brute force.  The machine is the simulated
p100-cluster (4 devices, one node): the analytic cost model, no profiling."""
import dataclasses
import itertools
import math
import random
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flexflow as ff
from flexflow.cost.model import CostModel
from flexflow.hardware.machine import Machine
from flexflow.models._common import make_inputs
from flexflow.models.rnn import RNNLM, rnnlm_config
from flexflow.search import (
    BASELINES,
    SearchError,
    _Bound,
    _OptCNN,
    _Space,
    exhaustive_search,
    is_local_optimum,
    optcnn,
    optcnn_cost,
    search)
from flexflow.sim.simulate import Simulator
from flexflow.strategy.strategy import Strategy
from flexflow.strategy.candidates import candidate_configs

D = 4


@pytest.fixture(scope="module")
def p100():
    return Machine.preset("p100-cluster", devices=D)


@pytest.fixture(scope="module")
def lenet():
    # paper size, batch 64 per device: compute, transfers and sync all matter
    module, inputs = ff.models.get("lenet", batch_size=64 * D, device="meta")
    return ff.trace(module, inputs)


def short_rnnlm(steps=2):
    """RNNLM with the paper's widths (hidden 1024, vocabulary 10,000) unrolled for
    only ``steps`` steps, batch 64 per device."""
    cfg = dataclasses.replace(rnnlm_config("paper"), steps=steps)
    with torch.device("meta"):
        module = RNNLM(cfg)
    inputs = make_inputs(module.input_specs(64 * D), seed=0, device="meta", dtype=torch.float32)
    return ff.trace(module, inputs)


@pytest.fixture(scope="module")
def rnnlm():
    return short_rnnlm(2)


def glue_on_all_devices(op, machine):
    """Candidate hook for the short RNNLM: ops that only move data (index,
    stack, transpose: 13 of its 17 share groups) are fixed to the sample split
    over all devices; every other op keeps all its candidates.  Without it the
    glue ops' nearly equal choices defeat the branch and bound's pruning; the
    MCMC searches the very same space."""
    cs = candidate_configs(op, machine)
    if not op.params and op.rule in ("index", "concat", "transpose"):
        return [c for c in cs if c.degrees == {"n": machine.num_devices}]
    return cs


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


# --------------------------------------------------------------------------- optimality
@pytest.fixture(scope="module")
def lenet_runs(lenet, p100):
    best, best_res, explored = exhaustive_search(lenet, p100, max_states=100_000)
    found = search(lenet, p100, evaluations=4000, seed=0, progress=False)
    return best, best_res, explored, found


@pytest.mark.slow
def test_lenet_mcmc_reaches_exhaustive_optimum(lenet, p100, lenet_runs):
    """The whole candidate space (about 1.5e10 strategies): branch and bound
    proves the optimum, and the MCMC search finds a strategy just as fast."""
    best, best_res, explored, found = lenet_runs
    assert explored < 100_000
    assert best_res.feasible
    assert found.source == "search"
    assert rel(found.result.iteration_time, best_res.iteration_time) <= 1e-9
    # and it beats data parallelism by a margin on this network
    assert found.result.iteration_time < 0.95 * found.baselines["data_parallel"].iteration_time


@pytest.mark.slow
def test_lenet_results_are_local_optima(lenet, p100, lenet_runs):
    best, _, _, found = lenet_runs
    assert found.local_optimum
    for s in (found.strategy, best):
        ok, change = is_local_optimum(lenet, p100, s)
        assert ok, change
    # a baseline is not: the check finds the improving change
    dp = Strategy.data_parallel(lenet, p100)
    ok, (op_name, config, t) = is_local_optimum(lenet, p100, dp)
    assert not ok and t < Simulator(lenet, p100).simulate(dp).iteration_time
    assert Simulator(lenet, p100).simulate(dp.replace(op_name, config)).iteration_time == pytest.approx(t)


def test_short_rnnlm_mcmc_reaches_exhaustive_optimum(rnnlm, p100):
    best, best_res, explored = exhaustive_search(rnnlm, p100, max_states=50_000,
                                                 candidates=glue_on_all_devices)
    found = search(rnnlm, p100, evaluations=2500, seed=0, progress=False, candidates=glue_on_all_devices)
    # (the optimum here is OptCNN's strategy: the search reports it by that name)
    assert rel(found.result.iteration_time, best_res.iteration_time) <= 1e-9
    assert is_local_optimum(rnnlm, p100, found.strategy, candidates=glue_on_all_devices) == (True, None)
    assert all(found.strategy[op.name] in glue_on_all_devices(op, p100) for op in rnnlm.compute_ops)
    assert found.result.iteration_time <= min(r.iteration_time for r in found.baselines.values())


@pytest.mark.parametrize("which", ["lenet", "rnnlm"])
def test_lower_bound_is_admissible(which, lenet, rnnlm, p100):
    """The branch and bound's bound never exceeds the simulated time of any
    completion: random strategies and data parallelism with a few random
    changes (near the good ones, where pruning matters), every prefix."""
    g = {"lenet": lenet, "rnnlm": rnnlm}[which]
    cm = CostModel(p100)
    space = _Space(g, p100)
    bound = _Bound(g, p100, space, cm)
    sim = Simulator(g, p100, cm)
    dp = Strategy.data_parallel(g, p100)
    rng = random.Random(0)
    for trial in range(16):
        if trial % 2:
            assign = [rng.randrange(len(cs)) for cs in space.cands]
        else:
            assign = [space.index[i][dp[r]] for i, r in enumerate(space.reps)]
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(assign))
                assign[i] = rng.randrange(len(space.cands[i]))
        s = Strategy(g, {r: space.cands[i][j] for i, (r, j) in enumerate(zip(space.reps, assign))}, p100)
        t = sim.simulate(s).iteration_time
        for k in range(len(assign) + 1):
            assert bound(assign[:k]) <= t, (k, s.table())


def test_exhaustive_gives_up_rather_than_guess(lenet, p100):
    with pytest.raises(SearchError, match="max_states"):
        exhaustive_search(lenet, p100, max_states=50)


# --------------------------------------------------------------------------- reproducibility
def test_same_seed_and_evaluations_same_strategy(lenet, p100):
    a = search(lenet, p100, evaluations=300, seed=7, progress=False)
    b = search(lenet, p100, evaluations=300, seed=7, progress=False)
    full = search(lenet, p100, evaluations=300, seed=7, progress=False, delta=False)
    assert a.evaluations == b.evaluations == full.evaluations <= 300
    assert a.strategy.to_json() == b.strategy.to_json() == full.strategy.to_json()
    assert a.result.iteration_time == b.result.iteration_time == full.result.iteration_time


def test_evaluator_runs_jobs_in_order_and_raises_the_first_error(monkeypatch):
    from flexflow.search.parallel import Evaluator

    import sys
    before = sys.getswitchinterval()
    with Evaluator(threads=2) as ev:
        assert ev.threads == 2
        assert ev.map([(pow, 2, k) for k in range(7)]) == [2 ** k for k in range(7)]
        with pytest.raises(ZeroDivisionError):
            ev.map([(divmod, 1, 1), (divmod, 1, 0), (int, "x")])
    assert sys.getswitchinterval() == before
    monkeypatch.setenv("FLEXFLOW_SEARCH_THREADS", "0")
    with pytest.raises(ValueError, match="FLEXFLOW_SEARCH_THREADS"):
        Evaluator()


@pytest.mark.slow
def test_result_fields_and_json_round_trip(lenet, p100, lenet_runs):
    found = lenet_runs[3]
    assert set(BASELINES) <= set(found.baselines) == set(found.baseline_strategies) <= set(BASELINES) | {"fsdp"}
    assert found.evaluations > 0 and found.seconds > 0 and 0 < found.accept_rate < 1
    times = [t for _, _, t in found.history]
    assert times == sorted(times, reverse=True) and times[-1] == found.result.iteration_time
    back = Strategy.from_json(found.strategy.to_json(), lenet, p100)
    assert back == found.strategy
    # init: one more chain starts from it; the result is at least as good
    again = search(lenet, p100, evaluations=100, seed=1, init=back, progress=False)
    assert again.chains[0] == "init"
    assert again.result.iteration_time <= found.result.iteration_time * (1 + 1e-12)


class _Clock:
    """A stand-in for ``time.perf_counter`` that moves ``step`` seconds at every read:
    a time budget then ends after a fixed number of clock reads, whatever the host."""

    def __init__(self, step: float = 2 ** -10):  # (about 1 ms, and sums of it are exact)
        self.now, self.step, self.reads = 1024.0, step, 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.step
        return self.now


def _fake_clock(monkeypatch, step: float = 2 ** -10) -> _Clock:
    """The search's clock (what ``flexflow.search`` reads for its budget) replaced by a _Clock."""
    from flexflow.search import common, mcmc
    clock = _Clock(step)
    fake = types.SimpleNamespace(perf_counter=clock)
    monkeypatch.setattr(common, "time", fake)
    monkeypatch.setattr(mcmc, "time", fake)
    return clock


def test_time_budget_is_respected(monkeypatch):
    """The search reads its clock as it goes and ends within a few reads past the budget: on
    a clock that moves 1 ms per read a 1-s search stops there (not because the polish
    converged: 8 devices, where LeNet's space is too large for that), half the budget gets
    fewer evaluations, and the same clock the same search."""
    module, inputs = ff.models.get("lenet", batch_size=64 * 8, device="meta")
    lenet, p100 = ff.trace(module, inputs), Machine.preset("p100-cluster", devices=8)
    clock = _fake_clock(monkeypatch)
    seen = []
    r = search(lenet, p100, budget=1.0, progress=lambda n, s, best: seen.append((n, s, best)))
    assert 1.0 <= r.seconds <= 1.0 + 8 * clock.step and not r.local_optimum
    assert clock.reads > 100  # the clock it ran on
    assert seen and all(b >= r.result.iteration_time for _, _, b in seen)
    assert all(0 < s <= r.seconds for _, s, _ in seen)
    half = search(lenet, p100, budget=0.5, progress=lambda *a: None)
    assert 0.5 <= half.seconds <= 0.5 + 8 * clock.step and 0 < half.evaluations < r.evaluations
    again = search(lenet, p100, budget=1.0, progress=lambda *a: None)
    assert again.evaluations == r.evaluations and again.strategy.to_json() == r.strategy.to_json()


# --------------------------------------------------------------------------- baselines, memory
@pytest.mark.parametrize("name", ["nmt", "inception_v3"])
def test_never_worse_than_any_baseline(p100, name):
    module, inputs = ff.models.get(name, size="small", device="meta", batch_size=8 * D)
    g = ff.trace(module, inputs)
    r = search(g, p100, evaluations=150, seed=0, progress=False)
    for k, b in r.baselines.items():
        assert r.result.iteration_time <= b.iteration_time * (1 + 1e-12) or not b.feasible, k
    assert r.result.feasible


def test_one_device_is_a_start():
    """Where communication costs more than the whole model's compute (a slow host
    network), the search returns everything on one device: a chain starts there.
    No baseline is that fast, and one proposal cannot get there from them.  (With
    the loss all-reduced on its own, which data parallelism pays on top of its
    gradients' all-reduce.)"""
    d = Machine.preset("cpu", devices=2).to_dict()
    d["intra_node"].update(latency_s=0.002, allreduce_latency_s=0.002)
    d["device"]["comm_on_cores"] = True
    slow = Machine.from_dict(d)
    module, inputs = ff.models.get("lenet", batch_size=8, size="small", device="meta")
    lenet = ff.trace(module, inputs)
    one = Simulator(lenet, slow, reduce_outputs="eager").simulate(Strategy.single_device(lenet, slow)).iteration_time
    found = ff.search(lenet, slow, evaluations=1, polish=False, reduce_outputs="eager")
    assert one < min(r.iteration_time for r in found.baselines.values())
    assert found.result.iteration_time <= one
    assert all(found.strategy[op.name].devices == (0,) for op in lenet.compute_ops) or \
        found.result.iteration_time < one


def test_feasible_when_data_parallel_is_not(lenet):
    """A machine whose memory data parallelism overflows (every device holds all
    parameters) but a strategy that splits the fully connected layers fits."""
    spec = Machine.preset("p100-cluster").to_dict()
    peak = {}
    for cap in (None,):
        m = Machine.preset("p100-cluster", devices=D)
        sim = Simulator(lenet, m)
        for name in ("data_parallel", "expert"):
            peak[name] = max(sim.simulate(getattr(Strategy, name)(lenet, m)).peak_memory)
    assert peak["expert"] < peak["data_parallel"]
    spec.update(nodes=1, num_devices=D, name="tiny-p100")
    spec["device"]["memory_bytes"] = (peak["expert"] + peak["data_parallel"]) // 2
    tiny = Machine.from_dict(spec)
    r = search(lenet, tiny, evaluations=600, seed=0, progress=False)
    assert not r.baselines["data_parallel"].feasible
    assert r.result.feasible
    for k, b in r.baselines.items():
        if b.feasible:
            assert r.result.iteration_time <= b.iteration_time * (1 + 1e-12), k


# --------------------------------------------------------------------------- OptCNN
class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), y)


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x, y):
        h = F.relu(self.fc1(x))
        h = h + F.relu(self.fc2(h))  # two paths from h to the add
        return F.cross_entropy(self.fc3(h), y)


@pytest.mark.parametrize("cls", [_Chain, _Residual])
def test_optcnn_dp_matches_brute_force(p100, cls):
    torch.manual_seed(0)
    g = ff.trace(cls(), (torch.randn(512, 64), torch.randint(0, 10, (512,))))
    dp = _OptCNN(g, p100)
    assert all(len(c.devices) == D for dom in dp.domains for c in dom)  # all-device configs
    chosen = dp.solve()
    assert dp.exact
    reps = dp.space.reps
    best = min(optcnn_cost(g, p100, Strategy(g, dict(zip(reps, combo)), p100))
               for combo in itertools.product(*dp.domains))
    assert math.isclose(optcnn_cost(g, p100, chosen), best, rel_tol=1e-12)
    assert optcnn(g, p100) == chosen


def test_optcnn_on_paper_networks_is_exact_and_no_worse_than_dp_by_its_cost(p100, lenet, rnnlm):
    for g in (lenet, rnnlm):
        dp = _OptCNN(g, p100)
        s = dp.solve()
        assert dp.exact
        assert dp.value(s) <= dp.value(Strategy.data_parallel(g, p100)) * (1 + 1e-12)


def test_nothing_fits_still_no_slower_than_a_baseline(lenet):
    spec = Machine.preset("p100-cluster").to_dict()
    spec.update(nodes=1, num_devices=D, name="no-memory")
    spec["device"]["memory_bytes"] = 1 << 20  # 1 MiB: nothing fits
    tiny = Machine.from_dict(spec)
    r = search(lenet, tiny, evaluations=200, seed=0, progress=False)
    assert not r.result.feasible and not any(b.feasible for b in r.baselines.values())
    assert r.result.iteration_time <= min(b.iteration_time for b in r.baselines.values()) * (1 + 1e-12)


def test_search_pauses_the_collector_and_restores_it(lenet, p100, monkeypatch):
    """During a search the cyclic collector is off (its objects are cached plans and task
    lists: rescanning them costs evaluations); no collection runs in it or at its end (its
    survivors go to the oldest generation unscanned); afterwards the collector is on again,
    also after a failure, and stays off where it was off."""
    import gc

    import flexflow.sim.simulate as sim_mod
    seen = []
    real = sim_mod.Simulator._simulate_gc  # (outside the simulation's own pause)

    def spy(self, *a, **k):
        seen.append(gc.isenabled())
        return real(self, *a, **k)
    monkeypatch.setattr(sim_mod.Simulator, "_simulate_gc", spy)
    assert gc.isenabled()
    runs = [g["collections"] for g in gc.get_stats()]
    ff.search(lenet, p100, evaluations=20, seed=0, progress=False)
    assert [g["collections"] for g in gc.get_stats()] == runs
    assert seen and not any(seen)
    assert gc.isenabled()
    with pytest.raises(SearchError):
        ff.search(lenet, p100, evaluations=20, seed=0, progress=False, chains=0)
    assert gc.isenabled()
    gc.disable()
    try:
        ff.search(lenet, p100, evaluations=5, seed=0, progress=False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_search_warns_when_the_baselines_take_most_of_the_budget(lenet, p100, monkeypatch):
    """A budget the baselines eat gets a clear warning that says how to reuse them (on a
    clock that moves about 1 ms per read, building the baselines takes 0.6 s of a 1-s budget)."""
    from flexflow.search import mcmc
    clock = _fake_clock(monkeypatch)
    build = mcmc.baseline_strategies

    def slow_baselines(*a, **k):
        clock.now += 0.6
        return build(*a, **k)
    monkeypatch.setattr(mcmc, "baseline_strategies", slow_baselines)
    with pytest.warns(UserWarning, match=r"baselines took 0\.6 s of the 1-s budget, which leaves the search 0\.4 s"):
        r = ff.search(lenet, p100, budget=1.0, seed=0, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reused, they cost nothing of the budget
        ff.search(lenet, p100, budget=1.0, seed=0, progress=False, baselines=r.baseline_strategies,
                  baseline_results=r.baselines)
