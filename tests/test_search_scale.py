"""The search at the scale of today's decoders: honest counting (proposals apart from chain
starts and baselines), repeat moves over a model's blocks, baselines reused across calls,
and the tensor-parallel baselines where memory binds.  Small budgets throughout."""
from __future__ import annotations

import random

import pytest

import flexflow as ff
from flexflow.search import baselines as B
from flexflow.search.common import _Space
from flexflow.search.repeats import Repeats
from flexflow.sim.simulate import Simulator


@pytest.fixture(scope="module")
def decoder():
    m, x = ff.models.get("llama", size="small", batch_size=8)
    return ff.trace(m, x)


@pytest.fixture(scope="module")
def p100():
    return ff.Machine.preset("p100-cluster", devices=8)


def test_evaluations_count_proposals_only(decoder, p100):
    r = ff.search(decoder, p100, evaluations=60, seed=0, progress=False)
    assert r.evaluations == r.simulations + r.screened + r.cut <= 60
    assert r.start_simulations + r.start_screened >= 1  # the chains' starts, counted apart
    assert r.start_simulations + r.start_screened <= len(r.chains) + 1  # (+1: the polish's start)
    assert 0 <= r.start_seconds and 0 < r.baseline_seconds < r.seconds
    d = r.to_dict()
    assert d["evaluations"] == r.evaluations and d["starts"]["simulated"] == r.start_simulations
    assert d["proposals"] == {"simulated": r.simulations, "cut": r.cut, "screened": r.screened}


def test_repeats_are_the_same_op_of_every_block(decoder, p100):
    space = _Space(decoder, p100)
    rep = Repeats(space)
    assert rep
    for gs in rep.sets:  # two blocks: pairs of the same op
        a, b = (decoder.op(space.reps[g]) for g in gs)
        assert len(gs) == 2 and a.kind == b.kind and a.output_shape == b.output_shape
        assert a.module_path.replace(".0", ".1") == b.module_path
    names = {space.reps[g] for gs in rep.sets for g in gs}
    assert {"layers_0_attention_wq", "layers_1_attention_wq"} <= names
    assert "tok_embeddings" not in names and "output" not in names  # once in the model
    dp = ff.Strategy.data_parallel(decoder, p100)
    rng = random.Random(0)
    for _ in range(20):
        move = rep.propose(rng, dp)
        if move is None:
            continue
        new, changed = move
        gs = next(s for s in rep.sets if changed[0] in s)
        assert set(changed) <= set(gs)
        assert len({new[space.reps[g]] for g in gs}) == 1  # one config for all of them
    # aligning: a change to one block carried to the other
    wq0 = dp.replace("layers_0_attention_wq", ff.ParallelConfig({"c": 8}, range(8)))
    aligned = [s for s, _ in rep.align_moves(wq0)]
    assert any(s["layers_1_attention_wq"] == ff.ParallelConfig({"c": 8}, range(8)) for s in aligned)


def test_baselines_are_reused_for_the_same_graph_and_machine(decoder, p100, monkeypatch):
    monkeypatch.setattr(B, "_REUSE", type(B._REUSE)())
    monkeypatch.setattr(B, "_REUSE_CPU_S", 0.0)  # keep even these small ones
    a = ff.search(decoder, p100, evaluations=30, seed=1, progress=False)
    b = ff.search(decoder, p100, evaluations=30, seed=1, progress=False)
    assert not a.baselines_reused and b.baselines_reused
    assert {k: r.iteration_time for k, r in a.baselines.items()} == {k: r.iteration_time for k, r in b.baselines.items()}
    assert a.strategy.to_json() == b.strategy.to_json()
    other = ff.search(decoder, p100, evaluations=30, seed=1, progress=False, optimizer="adam")
    assert not other.baselines_reused  # another optimizer: other memory, other results
    monkeypatch.setattr(B, "_REUSE_CPU_S", 1e9)  # small ones are not kept by default
    monkeypatch.setattr(B, "_REUSE", type(B._REUSE)())
    ff.search(decoder, p100, evaluations=10, seed=1, progress=False)
    assert not ff.search(decoder, p100, evaluations=10, seed=1, progress=False).baselines_reused


def test_megatron_baselines_join_where_memory_binds(decoder, p100):
    sim = Simulator(decoder, p100, optimizer="adam")
    dp = sim.simulate(ff.Strategy.data_parallel(decoder, p100), incremental=False)
    roomy = ff.search(decoder, p100, evaluations=20, seed=0, progress=False, optimizer="adam")
    assert "megatron" not in roomy.baselines and "fsdp" not in roomy.baselines  # data parallelism fits
    tight = p100.with_memory(int(0.7 * max(dp.peak_memory)))
    r = ff.search(decoder, tight, evaluations=150, seed=0, progress=False, optimizer="adam")
    assert {"fsdp", "megatron", "fsdp_tp"} <= set(r.baselines) and "megatron" in r.chains
    assert r.baseline_strategies["megatron"]["layers_0_feed_forward_w2"].degrees.get("k") == 4
    assert r.result.feasible
    best = min(b.iteration_time for b in r.baselines.values() if b.feasible)
    assert r.result.iteration_time <= best * (1 + 1e-12)


def test_the_analytic_cost_model_and_its_plans_are_reused_on_the_same_machine(decoder, p100, monkeypatch):
    """A search given no cost model takes the previous search's analytic model on the same
    machine object (its plan caches warm), only where it is configured the same; the search
    is the same either way."""
    from flexflow.cost import model as cost_model
    from flexflow.search import common
    monkeypatch.setattr(common, "_MODELS", {})
    a = ff.search(decoder, p100, evaluations=30, seed=2, progress=False)
    (machine, cm), = common._MODELS.values()
    assert machine is p100 and cm.__dict__.get("_simulator_contexts")
    b = ff.search(decoder, p100, evaluations=30, seed=2, progress=False)
    assert common._MODELS[p100.fingerprint()][1] is cm
    assert a.strategy.to_json() == b.strategy.to_json()
    assert [(e, t) for e, _, t in a.history] == [(e, t) for e, _, t in b.history]
    # another machine object, or other default efficiencies: a new model
    other = ff.Machine.preset("p100-cluster", devices=8)
    assert common._analytic_model(other, decoder) is not cm
    assert common._analytic_model(p100, decoder) is not cm  # (the other machine's replaced it)
    cm2 = common._analytic_model(p100, decoder)
    assert common._analytic_model(p100, decoder) is cm2
    monkeypatch.setitem(cost_model.DEFAULT_EFFICIENCY, "a_rule_of_its_own", 0.123)
    assert common._analytic_model(p100, decoder) is not cm2
