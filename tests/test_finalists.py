"""The search's finalists measured before one is chosen: which strategies are finalists,
the corrections their measurements teach the cost model (fitted, stored, applied), the
plan's record of them, and parallelize on 2 gloo processes choosing the measured-fastest
finalist when the simulator is wrong on purpose."""
import dataclasses
import json
import math

import pytest
from _finalist_workers import flattered, learning, wide

import flexflow as ff
from flexflow.cost.corrections import (
    Corrections,
    corrections_path,
    load_corrections,
    save_corrections,
)
from flexflow.cost.model import CostModel
from flexflow.finalists import Finalist, not_runnable, pick_finalists
from flexflow.finalists.fit import fit_corrections
from flexflow.finalists.measure import TIMED_S, _plan_rounds, fastest
from flexflow.plan import searched_plan


@pytest.fixture(scope="module")
def mlp():
    module, batch = wide(batch=64, width=64)
    machine = ff.Machine.preset("cpu", devices=2)
    return ff.trace(module, batch), machine


# ---- which strategies are finalists ------------------------------------------------------------
def test_finalists_are_distinct_with_data_parallelism_and_the_simulators_choice(mlp):
    graph, machine = mlp
    found = ff.search(graph, machine, evaluations=40, shard=False)
    first = found.source
    picked, notes = pick_finalists(found, 3, first, machine)
    names = [f.name for f in picked]
    assert names[0] == first and "data_parallel" in names and len(picked) == 3
    assert all(a.strategy != b.strategy for i, a in enumerate(picked) for b in picked[i + 1:])
    rest = [f.predicted_s for f in picked if f.name not in (first, "data_parallel")]
    assert rest == sorted(rest) and not notes
    assert all(f.strategy.machine_fingerprint == machine.fingerprint() for f in picked)
    # a candidate the executor cannot run (in a precision it does not run) is left out, with a note
    dp = found.baseline_strategies["data_parallel"]
    assert not_runnable(dp) is None and not_runnable(dp, "bf16-mixed") is None
    assert not_runnable(dp, "16-mixed") is None
    assert "precision 'bf16-true'" in not_runnable(dp, "bf16-true")
    picked, notes = pick_finalists(found, 3, first, machine, "bf16-true")
    assert picked == [] and len(notes) >= 3 and all("bf16-true" in n for n in notes)


def test_plan_lists_finalists_and_round_trips(mlp):
    graph, machine = mlp
    p = searched_plan(graph, machine, evaluations=30, shard=False, finalists=3)
    assert len(p.finalists) == 3 and p.simulator_choice == p.chosen and not p.measured
    assert "finalists" in p.summary() and "data_parallel" in p.finalists_line()
    p.finalists[1].measured_s, p.finalists[1].rounds_s = 0.01, [0.01, 0.011]
    p.finalists[2].dropped = "RuntimeError: out of memory"
    q = ff.Plan.from_json(p.to_json())
    assert [f.name for f in q.finalists] == [f.name for f in p.finalists] and q.measured
    assert q.finalists[1].measured_s == 0.01 and q.finalists[2].dropped.startswith("RuntimeError")
    assert q.finalists[0].bind(graph) == p.finalists[0].strategy
    assert fastest(q.finalists).name == p.finalists[1].name
    assert searched_plan(graph, machine, evaluations=10, finalists=1).finalists == []
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="finalists must be"):
            ff.plan(graph.module, machine, (), finalists=bad)
    with pytest.raises(ValueError, match="finalist_steps"):
        ff.plan(graph.module, machine, (), finalist_steps=0)


def test_measuring_fits_the_budget():
    assert _plan_rounds(6, 0.0, 1.0) == (5, 2)
    assert _plan_rounds(6, 0.1, 10.0, 1) == (5, 2)  # 10 steps of 0.1 s: more than TIMED_S already
    assert _plan_rounds(6, 0.1, 0.55) == (5, 1)  # one step per round fits, two do not
    assert _plan_rounds(6, 1.0, 0.1) == (1, 1)  # at least one step
    assert _plan_rounds(2, 0.0, 1.0) == (2, 1)
    # 3 finalists of 5 ms: each repeats to about TIMED_S, within the time left
    rounds, per = _plan_rounds(6, 0.015, 10.0, 3)
    assert rounds == 5 and rounds * per * 0.005 == pytest.approx(TIMED_S, rel=0.1)
    rounds, per = _plan_rounds(6, 0.015, 0.5, 3)  # little time: 80% of it at most
    assert rounds * per * 0.015 <= 0.4 and per >= 2


# ---- corrections -----------------------------------------------------------------------------
def test_corrections_scale_messages_collectives_and_op_times(mlp):
    graph, machine = mlp
    c = Corrections(compute=2.0, message=3.0, sync=0.5)
    m = c.machine(machine)
    assert m.transfer_time_s(0, 1, 4096) == pytest.approx(3 * machine.transfer_time_s(0, 1, 4096))
    assert m.allreduce_time_s([0, 1], 2**20) == pytest.approx(0.5 * machine.allreduce_time_s([0, 1], 2**20))
    assert Corrections().machine(machine) is machine and Corrections().identity and not c.identity
    cm = CostModel(machine)
    fixed = c.cost_model(cm)
    ops = {op.kind: op for op in graph.compute_ops}
    dp = ff.Strategy.data_parallel(graph, machine)
    from flexflow.strategy.regions import partitions
    for kind in ("linear", "relu"):
        op = ops[kind]
        part = partitions(op, dp[op.name])[0]
        assert fixed.op_time(op, part, 0) == pytest.approx(tuple(2.0 * t for t in cm.op_time(op, part, 0)))
    assert Corrections(message=2.0).cost_model(cm) is cm
    assert Corrections(message=100.0).message == 5.0  # kept in range
    with pytest.raises(ValueError, match="message"):
        Corrections(message=-1.0)


def test_corrections_are_stored_per_machine_and_graph(mlp, recwarn):
    graph, machine = mlp
    fp = graph.fingerprint()
    assert load_corrections(machine, fp).identity
    c = Corrections(1.5, message=2.0, sync=1.25, samples=3)
    path = save_corrections(machine, fp, c)
    save_corrections(machine, "another graph", Corrections(0.5))
    assert path == corrections_path(machine) and path.parent.name == "corrections"
    got = load_corrections(machine, fp)
    assert got.factors() == c.factors() and got.samples == 3
    assert load_corrections(machine, "another graph").compute == 0.5
    assert load_corrections(machine, "a third graph").identity
    assert load_corrections(ff.Machine.preset("cpu", devices=3), fp).identity  # another machine
    path.write_text("{not json")
    assert load_corrections(machine, fp).identity and "ignoring the corrections" in str(recwarn.pop().message)
    path.write_text(json.dumps({"format": "flexflow-corrections", "version": 99}))
    assert load_corrections(machine, fp).identity and "version" in str(recwarn.pop().message)
    path.write_text(json.dumps({"format": "flexflow-corrections", "version": 1, "graphs": {fp: c.to_dict()}}))
    assert load_corrections(machine, fp).identity and "afresh" in str(recwarn.pop().message)  # learnt biased
    save_corrections(machine, fp, c)  # replaces it
    assert load_corrections(machine, fp).factors() == c.factors()
    d = json.loads(path.read_text())
    d["profile_version"] -= 1  # learnt against op profiles of an older format: measured again
    path.write_text(json.dumps(d))
    assert load_corrections(machine, fp).identity and "afresh" in str(recwarn.pop().message)


def test_a_factor_held_at_its_edge_leaves_the_step_to_the_others():
    """At the bottom of its range, a factor the step would lower further is held there; the
    other two are solved without it (a step counting on the clamped one moves nothing)."""
    import numpy as np

    from flexflow.finalists.fit import _bounded_step
    a = np.array([[2.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 2.0]])
    b = np.array([0.5, 0.2, -1.0])
    free = _bounded_step(a, b, {"compute": 1.0, "message": 1.0, "sync": 1.0})
    np.testing.assert_allclose(a @ free, b)  # nothing at an edge: the plain step
    assert free[2] < 0  # it lowers sync
    held = _bounded_step(a, b, {"compute": 1.0, "message": 1.0, "sync": 0.2})
    assert held[2] == 0.0 and held[0] == pytest.approx(0.25) and held[1] == pytest.approx(0.2)
    assert _bounded_step(a, -b, {"compute": 1.0, "message": 1.0, "sync": 0.2})[2] > 0  # inwards: free


def _finalists_measured_by(graph, machine, truth: Corrections, used: Corrections) -> list:
    """Data parallel, model parallel and expert, predicted under ``used`` and 'measured' by a
    simulator under ``truth``."""
    real = ff.Simulator(graph, truth.machine(machine), truth.cost_model(CostModel(machine)))
    sim = ff.Simulator(graph, used.machine(machine), used.cost_model(CostModel(machine)))
    out = []
    for make in (ff.Strategy.data_parallel, ff.Strategy.model_parallel, ff.Strategy.expert):
        s = make(graph, machine)
        free = ff.Strategy(graph, dict(s.items()))  # simulated on corrected copies of the machine
        f = Finalist(s.name, s.to_json(), sim.simulate(free), strategy=s)
        f.measured_s = real.simulate(free).iteration_time
        out.append(f)
    return out


@pytest.mark.parametrize("truth,used", [(Corrections(1.5, message=3.0), Corrections()),
                                        (Corrections(), Corrections(message=0.2, sync=5.0))],
                         ids=["slow_messages", "from_the_edges"])
def test_fit_learns_factors_that_predict_the_measurements(mlp, truth, used):
    """Steps 'measured' by a simulator whose messages cost 3x and ops 1.5x (or with none of
    the corrections in use, which sit at the edges of their range): the fit finds factors
    under which the predictions err far less."""
    graph, machine = mlp
    finalists = _finalists_measured_by(graph, machine, truth, used)
    before = max(abs(f.error) for f in finalists)
    fitted, refit = fit_corrections(graph, machine, CostModel(machine), used, finalists)
    after = max(abs(refit[f.name] - f.measured_s) / f.measured_s for f in finalists)
    assert before > 0.3 and after < min(0.1, 0.25 * before), (before, after, fitted.factors())
    assert fitted.message == pytest.approx(truth.message, rel=0.2)
    assert fitted.samples == 3 and len(fitted.history) == 1
    # nothing measured: nothing learnt
    assert fit_corrections(graph, machine, CostModel(machine), truth, [dataclasses.replace(finalists[0],
                           measured_s=None)]) == (truth, {})


def test_the_fit_averages_a_plan_over_the_calls_that_measured_it(mlp):
    """The second call's finalists (the same plans) measured 1.2x the first call's: the fit
    takes every measurement of a plan in the history, so it predicts their geometric mean
    (1.095x), not the latest call's alone; a history row it cannot read is passed over."""
    graph, machine = mlp
    truth = Corrections(1.5, message=3.0)
    first = _finalists_measured_by(graph, machine, truth, Corrections())
    fitted, _ = fit_corrections(graph, machine, CostModel(machine), Corrections(), first)
    assert all(len(row) == 5 for row in fitted.history[-1]["finalists"])  # the strategies kept
    fitted.history[-1]["finalists"].append(["lost", 1.0, 1.0, 1.0, "not a strategy"])
    second = [dataclasses.replace(f, measured_s=f.measured_s * 1.2) for f in first]
    alone, refit_alone = fit_corrections(graph, machine, CostModel(machine),
                                         Corrections(**fitted.factors()), second)
    both, refit_both = fit_corrections(graph, machine, CostModel(machine), fitted, second)
    assert both.history[-1]["points"] == 3 and alone.history[-1]["points"] == 3
    for f in first:
        assert refit_alone[f.name] / f.measured_s == pytest.approx(1.2, rel=0.05)
        assert refit_both[f.name] / f.measured_s == pytest.approx(1.2 ** 0.5, rel=0.05)


# ---- on 2 processes ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_flattering_simulator_still_leads_to_the_measured_fastest():
    res = ff.launch(flattered, 2, timeout_s=300)
    r0 = res[0]
    measured = {k: v for k, v in r0["measured"].items() if v is not None}
    # the simulator chose everything on one device, flattered ~1000x; data parallelism ran too
    assert r0["one_device"][r0["simulator_choice"]]
    assert "data_parallel" in measured and len(measured) >= 2
    assert r0["predicted"][r0["simulator_choice"]] < 0.2 * r0["predicted"]["data_parallel"]
    # the plan runs the finalist that measured fastest, the same on every rank
    assert r0["chosen"] == min(measured, key=measured.get)
    assert all(r["plan"] == r0["plan"] and r["runs"] for r in res)
    # training starts from the module's own parameters: one process's losses
    for r in res:
        assert r["losses"] == pytest.approx(r0["reference"], rel=1e-5)
    # one line says it all, on rank 0; a given cost model learns nothing
    assert len(r0["lines"]) == 1 and "measured" in r0["lines"][0] and r0["chosen"] in r0["lines"][0]
    assert res[1]["lines"] == [] and not r0["stored"]


@pytest.mark.slow
def test_measurements_correct_the_next_search_and_a_failing_finalist_is_dropped():
    res = ff.launch(learning, 2, "data_parallel", timeout_s=300)
    r0 = res[0]
    first, second = ff.Plan.from_json(r0["first"]), ff.Plan.from_json(r0["second"])
    assert first.measured and r0["path"] and first.corrections["fitted"] == r0["stored"]
    assert all(f.refit_s is not None for f in first.finalists if f.measured_s is not None)
    # the second search used what the first learnt
    assert Corrections(**second.corrections.get("used", {})).factors() == r0["stored"] or \
        Corrections(**r0["stored"]).identity
    # data parallelism failed on rank 1 only: dropped on every rank, with a warning; the run went on
    dp = next(f for f in second.finalists if f.name == "data_parallel")
    assert dp.measured_s is None and "rank 1" in dp.dropped and "out of memory on purpose" in dp.dropped
    assert any("'data_parallel' dropped" in w for w in r0["warnings"])
    assert second.chosen != "data_parallel" and second.measured
    for r in res:
        assert ff.Plan.from_json(r["second"]).chosen == second.chosen
        assert r["losses"] == pytest.approx(r0["reference"], rel=1e-5)
    # ff.plan with the devices at hand measures too, the same plan on every rank
    planned = ff.Plan.from_json(r0["planned"])
    assert planned.measured and all(r["planned"] == r0["planned"] for r in res)
    assert math.isfinite(planned.measure_seconds)


def test_the_step_finds_its_loss_without_reading_a_pending_one():
    """A finalist's step must not read the loss before the backward: reading an output that
    rides on the gradient all-reduce costs that bucket's all-reduce twice (a data-parallel
    finalist of a wide MLP measured twice as slow as the same plan trained)."""
    import torch

    from flexflow.finalists.measure import _loss
    from flexflow.runtime.pending import pending

    reads = []
    loss = pending(torch.tensor(2.0, requires_grad=True) * 1.0, lambda: reads.append(1))
    assert _loss(loss) is loss and _loss({"loss": loss}) is loss
    assert loss.numel() == 1 and loss.ndim == 0 and loss.nelement() == 1 and loss.shape == ()
    assert reads == []
    float(loss)  # a read waits, once
    assert reads == [1]
    vec = pending(torch.ones(3, requires_grad=True) * 1.0, lambda: reads.append(2))
    assert float(_loss(vec)) == 3.0 and reads == [1, 2]  # not a scalar: summed, which reads it
