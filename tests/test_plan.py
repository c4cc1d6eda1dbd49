"""Plans apart from runs: ff.plan, Plan (JSON, summary, binding), parallelize(plan=)."""
import json

import pytest

import flexflow as ff
from flexflow.strategy import StrategyError

import _plan_workers as W
from _plan_workers import run_plan, tiny


def test_plan_predicts_chooses_and_round_trips():
    module, batch = tiny()
    machine = ff.Machine.preset("p100-cluster", devices=4)
    p = ff.plan(module, machine, batch, evaluations=60)
    assert isinstance(p, ff.Plan) and p.machine == machine
    assert {"data_parallel", "model_parallel", "expert", "optcnn"} <= set(p.baselines)
    dp = p.baselines["data_parallel"].iteration_time
    # data parallelism, or a plan predicted at least min_gain faster than it
    assert p.chosen == "data_parallel" or p.predicted.iteration_time <= dp * (1 - p.min_gain)
    text = p.summary()
    assert "data_parallel" in text and f"chosen ({p.chosen})" in text
    q = ff.Plan.from_json(p.to_json())
    assert (q.chosen, q.graph_fingerprint, q.machine, q.optimizer) == (p.chosen, p.graph_fingerprint, machine, "sgd")
    assert q.predicted.iteration_time == p.predicted.iteration_time
    assert q.baselines.keys() == p.baselines.keys() and q.strategy is None
    graph = ff.trace(module, batch)
    assert q.bind(graph) == p.strategy
    assert ff.Strategy.from_json(p.to_json(), graph) == p.strategy  # a plan file is a strategy file too


def test_min_gain_falls_back_to_data_parallelism():
    module, batch = tiny()
    machine = ff.Machine.preset("p100-cluster", devices=4)
    p = ff.plan(module, machine, batch, evaluations=60, min_gain=0.99)
    assert p.chosen == "data_parallel" and p.predicted is p.baselines["data_parallel"]
    with pytest.raises(ValueError, match="min_gain"):
        ff.plan(module, machine, batch, evaluations=10, min_gain=1.5)


def test_a_plan_refuses_another_graph_or_device_count():
    module, batch = tiny()
    machine = ff.Machine.preset("cpu", devices=2)
    p = ff.plan(module, machine, batch, evaluations=20)
    other_module, other_batch = tiny(batch=12)
    with pytest.raises(StrategyError, match="another graph"):
        p.bind(ff.trace(other_module, other_batch))
    with pytest.raises(StrategyError, match="made for 2 devices"):
        p.check_devices(None, 4)
    with pytest.raises(StrategyError, match="P100"):
        p.check_devices(ff.Machine.preset("p100-cluster", devices=2), 2)
    with pytest.raises(StrategyError, match="not a flexflow plan"):
        ff.Plan.from_json(json.dumps({"format": "something"}))


def test_parallelize_runs_a_plan_made_elsewhere():
    module, batch = tiny()
    p2 = ff.plan(module, ff.Machine.preset("cpu", devices=2), batch, evaluations=40, shard=False)
    p4 = ff.plan(module, ff.Machine.preset("cpu", devices=4), batch, evaluations=20, shard=False)
    res = ff.launch(run_plan, 2, p2.to_json(), p4.to_json(), timeout_s=180)
    for r in res:
        assert r["losses"] == pytest.approx(res[0]["reference"], rel=1e-5)
        assert r["chosen"] == p2.chosen and r["same_graph"]
        assert ff.Strategy.from_json(r["strategy"], ff.trace(module, batch)) == p2.strategy
        assert r["refused"] is not None and "made for 4 devices" in r["refused"]


@pytest.mark.slow
def test_plan_on_one_rank_joins_no_collective():
    res = ff.launch(W.plan_on_rank0_then_broadcast, 2, timeout_s=120)
    assert [r["type"] for r in res] == ["str", "str"] and res[0]["chosen"] == res[1]["chosen"]


def test_plan_measures_only_when_asked_and_where_it_can():
    module, batch = W.tiny()
    with pytest.raises(ValueError, match=r"plan\(measure=True\) measures the finalists on the devices"):
        ff.plan(module, ff.Machine.preset("cpu", devices=2), batch, evaluations=10, measure=True)
    with pytest.raises(TypeError, match="measure must be True or False"):
        ff.plan(module, ff.Machine.preset("cpu", devices=2), batch, evaluations=10, measure="yes")
