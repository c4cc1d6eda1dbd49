"""Pipelines: the strategy's pipeline (stages from placement, checks, JSON), the schedules,
and the simulator's composed step (exact cases, memory in flight, bubble)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import flexflow as ff
from flexflow.models import get
from flexflow.sim.pipeline import StageTimes, compose
from flexflow.strategy import ParallelConfig, StrategyError
from flexflow.strategy.pipeline import schedule_order


class DeepMLP(nn.Module):
    def __init__(self, width=32, layers=8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers))
        self.head = nn.Linear(width, 4)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x), y)


def _mlp(batch=16, layers=8):
    torch.manual_seed(0)
    m = DeepMLP(layers=layers)
    x, y = torch.randn(batch, 32), torch.randint(0, 4, (batch,))
    return m, (x, y), ff.trace(m, (x, y))


def _machine(n):
    return ff.Machine.preset("h100-cluster", n)


def _equal(F, B, p, v, xf=0):
    R = p * v
    return StageTimes(np.full(R, F, np.int64), np.full(R, B, np.int64), np.full(R - 1, xf, np.int64),
                      np.zeros(R - 1, np.int64), 0, 0, [0] * p, 0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 16), (3, 7)])
def test_equal_stages_take_m_plus_p_minus_1_over_m(schedule, p, m):
    F, B = 1000, 2000
    last_b, busy, first, _ = compose(_equal(F, B, p, 1), p, 1, m, schedule)
    assert max(last_b) == (m + p - 1) * (F + B)
    assert busy == [m * (F + B)] * p


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 4, 2)])
def test_interleaving_takes_vm_plus_p_minus_1_over_vm(p, v, m):
    F, B = 1000, 2000  # per chunk: each device's v chunks do the work of one stage
    last_b, busy, _, _ = compose(_equal(F, B, p, v), p, v, m, "interleaved-1f1b")
    compute = v * m * (F + B)
    assert max(last_b) * v * m == compute * (v * m + p - 1)
    assert busy == [compute] * p


def test_1f1b_holds_at_most_p_minus_s_micro_batches_and_gpipe_all():
    p, m = 4, 8
    act = np.eye(p, dtype=np.int64)  # run r weighs 1 on column r
    _, _, _, held = compose(_equal(10, 20, p, 1), p, 1, m, "1f1b", act)
    assert [int(held[s][s]) for s in range(p)] == [p - s for s in range(p)]
    _, _, _, held = compose(_equal(10, 20, p, 1), p, 1, m, "gpipe", act)
    assert [int(held[s][s]) for s in range(p)] == [m] * p


def test_every_schedule_runs_each_micro_batch_once_forward_then_backward():
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("gpipe", 2)):
        p, m = 4, 8
        for s in range(p):
            order = schedule_order(schedule, p, v, m, s)
            assert sorted(order) == sorted((k, c, b) for k in "FB" for c in range(v) for b in range(m))
            for c in range(v):
                for b in range(m):
                    assert order.index(("F", c, b)) < order.index(("B", c, b))


def test_stages_follow_placement_and_round_trip_in_json():
    m, x, g = _mlp()
    mach = _machine(4)
    s = ff.Strategy.megatron(g, mach, tp=1, pp=4, microbatches=4)
    pipe = s.pipeline
    assert pipe.num_stages == 4 and pipe.interleave == 1 and pipe.schedule == "1f1b"
    assert pipe.stages == ((0,), (1,), (2,), (3,))
    assert "pipeline: 4 stage(s)" in s.table()
    back = ff.Strategy.from_json(s.to_json(), g, mach)
    assert back == s and back.pipeline.stages == pipe.stages
    assert back != s.without_pipeline()
    two = ff.Strategy.megatron(g, mach, tp=1, pp=2, microbatches=4, interleave=2)
    assert two.pipeline.schedule == "interleaved-1f1b" and two.pipeline.interleave == 2
    assert [r[0] for r in two.pipeline.runs] == [0, 1, 0, 1]


def test_impossible_pipelines_say_why():
    m, x, g = _mlp()
    mach = _machine(4)
    s = ff.Strategy.megatron(g, mach, tp=1, pp=2, microbatches=2)
    with pytest.raises(StrategyError, match="do not divide the batch"):
        s.with_pipeline(3)
    with pytest.raises(StrategyError, match="schedule must be one of"):
        s.with_pipeline(2, "zigzag")
    with pytest.raises(StrategyError, match="does not fit one micro-batch"):
        ff.Strategy.data_parallel(g, mach).with_pipeline(8)  # 4-way split of micro-batches of 2
    inter = ff.Strategy.megatron(g, mach, tp=1, pp=2, microbatches=2, interleave=2)
    with pytest.raises(StrategyError, match="use 'interleaved-1f1b'"):
        inter.with_pipeline(2, "1f1b")
    with pytest.raises(StrategyError, match="multiple of the 2 stages"):
        inter.with_pipeline(1, "interleaved-1f1b")
    with pytest.raises(StrategyError, match="at least 2 runs"):
        s.with_pipeline(2, "interleaved-1f1b")
    # the loss sent back to stage 0: out of turn
    names = [op.name for op in g.compute_ops]
    with pytest.raises(StrategyError, match="out of turn"):
        s.replace(names[-1], ParallelConfig({}, (0,)))
    # an op in the middle of stage 1 sent back to stage 0: two runs a stage, not 1F1B's
    with pytest.raises(StrategyError, match="use 'interleaved-1f1b'"):
        s.replace(names[-3], ParallelConfig({}, (0,)))
    # two groups that share a device
    bad = s.without_pipeline().replace(names[0], ParallelConfig({"n": 2}, (0, 1)))
    with pytest.raises(StrategyError, match="disjoint device groups"):
        bad.with_pipeline(2)
    with pytest.raises(StrategyError, match="pp=3 does not divide"):
        ff.Strategy.megatron(g, mach, tp=1, pp=3)
    with pytest.raises(StrategyError, match="at least as many repeated blocks"):
        ff.Strategy.megatron(g, _machine(16), tp=1, pp=16)


def test_one_micro_batch_on_one_stage_is_the_plain_step(monkeypatch):
    import flexflow.sim.pipeline as P
    m, x, g = _mlp()
    mach = _machine(4)
    sim = ff.Simulator(g, mach)
    s = ff.Strategy.data_parallel(g, mach)
    plain, once = sim.simulate(s), sim.simulate(s.with_pipeline(1))  # (4 replicas simulated once)
    assert once.iteration_time == pytest.approx(plain.iteration_time, rel=1e-3)
    monkeypatch.setattr(P, "replicas", lambda strategy: (1, None))
    piped = ff.Simulator(g, mach).simulate(s.with_pipeline(1))
    assert piped.iteration_time == pytest.approx(plain.iteration_time, rel=1e-9)
    assert piped.peak_memory == plain.peak_memory and piped.bubble == 0.0


def test_simulated_pipeline_bubble_shrinks_with_micro_batches_and_1f1b_holds_less():
    m, x, g = _mlp(batch=32, layers=8)
    mach = _machine(4)
    sim = ff.Simulator(g, mach)
    bubbles = []
    for mb in (1, 2, 8, 32):
        r = sim.simulate(ff.Strategy.megatron(g, mach, tp=1, pp=4, microbatches=mb))
        assert r.feasible and 0 < r.bubble < 1
        bubbles.append(r.bubble)
    assert bubbles == sorted(bubbles, reverse=True)
    one = sim.simulate(ff.Strategy.megatron(g, mach, tp=1, pp=4, microbatches=32))
    gp = sim.simulate(ff.Strategy.megatron(g, mach, tp=1, pp=4, microbatches=32, schedule="gpipe"))
    assert max(one.peak_memory) < max(gp.peak_memory)
    assert one.iteration_time == pytest.approx(gp.iteration_time, rel=0.05)


def test_3d_plan_of_a_library_decoder_simulates():
    module, inputs = get("llama", batch_size=16, size="small")
    g = ff.trace(module, inputs)
    mach = _machine(16)
    s = ff.Strategy.megatron(g, mach, tp=4, pp=2, microbatches=4)
    assert s.pipeline.stages[0] == (0, 1, 2, 3, 8, 9, 10, 11)
    emb = next(op for op in g.compute_ops if op.rule == "embedding")
    assert set(s[emb.name].devices) <= set(s.pipeline.stages[0])
    loss = g.compute_ops[-1]
    assert set(s[loss.name].devices) <= set(s.pipeline.stages[-1])
    r = ff.Simulator(g, mach).simulate(s)
    assert r.feasible and r.iteration_time > 0 and 0 < r.bubble < 1


def test_identical_replicas_are_simulated_once_and_agree_with_all_of_them(monkeypatch):
    import flexflow.sim.pipeline as P
    module, inputs = get("llama", batch_size=32, size="small")
    g = ff.trace(module, inputs)
    mach = _machine(32)  # 4 nodes of 8
    s = ff.Strategy.megatron(g, mach, tp=4, pp=2, microbatches=4)
    d, rep = P.replicas(s)
    assert d == 4 and all(max(c.devices) < 8 for c in rep.values())
    fast = ff.Simulator(g, mach).simulate(s)
    monkeypatch.setattr(P, "replicas", lambda strategy: (1, None))
    full = ff.Simulator(g, mach).simulate(s)
    assert fast.iteration_time == pytest.approx(full.iteration_time, rel=0.1)
    assert max(fast.peak_memory) == pytest.approx(max(full.peak_memory), rel=0.1)
    assert len(fast.peak_memory) == len(full.peak_memory) == 32
    # a shard level spans the replicas: simulated whole
    monkeypatch.undo()
    assert P.replicas(ff.Strategy.megatron(g, mach, tp=4, pp=2, microbatches=4, shard=1))[0] == 1


def test_the_search_weighs_3d_plans_where_memory_binds_on_several_nodes():
    module, inputs = get("llama", batch_size=32, size="small")
    g = ff.trace(module, inputs)
    mach = _machine(16)
    dp = ff.Simulator(g, mach).simulate(ff.Strategy.data_parallel(g, mach))
    tight = mach.with_memory(int(max(dp.peak_memory) * 0.8))
    r = ff.search(g, tight, evaluations=60, seed=0)
    piped = r.baselines["megatron_pp2"]
    assert piped.feasible and piped.bubble > 0
    assert r.result.feasible and r.result.iteration_time <= piped.iteration_time
    assert r.baseline_strategies["megatron_pp2"].pipeline.num_stages == 2


def test_pipeline_moves_change_micro_batches_schedule_and_stage_boundaries():
    from flexflow.search.pipemoves import neighbours
    m, x, g = _mlp(batch=32, layers=8)
    mach = _machine(4)
    s = ff.Strategy.megatron(g, mach, tp=1, pp=2, microbatches=4)
    near = neighbours(s)
    specs = {(n.pipeline.microbatches, n.pipeline.schedule) for n in near}
    assert {(8, "1f1b"), (2, "1f1b"), (4, "gpipe"), (4, "interleaved-1f1b")} <= specs
    inter = next(n for n in near if n.pipeline.schedule == "interleaved-1f1b")
    assert inter.pipeline.interleave == 2 and [r[0] for r in inter.pipeline.runs] == [0, 1, 0, 1]
    assert any(n.pipeline.interleave == 1 for n in neighbours(inter))  # and back
    sizes = sorted(len(n.pipeline.runs[0][1]) for n in near if n.pipeline.microbatches == 4
                   and n.pipeline.schedule == "1f1b")
    first = len(s.pipeline.runs[0][1])
    assert sizes and min(sizes) < first < max(sizes)  # a block handed either way
    assert all(n != s for n in near)
    sim = ff.Simulator(g, mach)
    for n in near:
        assert sim.simulate(n).iteration_time > 0


def test_delta_simulation_of_pipelines_equals_a_fresh_one():
    from flexflow.search.pipemoves import neighbours
    module, inputs = get("llama", batch_size=16, size="small")
    g = ff.trace(module, inputs)
    mach = _machine(16)
    s = ff.Strategy.megatron(g, mach, tp=4, pp=2, microbatches=4)
    sim = ff.Simulator(g, mach, optimizer="adam")
    sim.simulate(s)
    names = [op.name for op in g.compute_ops]
    moved = [s.replace(names[3], ParallelConfig({"n": 2}, s.pipeline.stages[0][:2]))] + neighbours(s)
    for t in moved:
        inc = sim.simulate(t)  # delta from the previous one
        fresh = ff.Simulator(g, mach, optimizer="adam").simulate(t, incremental=False)
        assert inc.iteration_time == fresh.iteration_time and inc.peak_memory == fresh.peak_memory
        assert inc.bubble == fresh.bubble
