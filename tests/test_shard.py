"""Shard levels (ZeRO stages) and recomputation in the strategy space and the simulator,
without processes."""
import json
import pickle

import pytest
import torch
import torch.nn as nn

import flexflow as ff
from flexflow.strategy import StrategyError

from _small_models import MLP




def _mlp(batch=8, width=256):
    torch.manual_seed(0)
    m = MLP(width)
    return m, (torch.randn(batch, width), torch.randn(batch, width))


def test_config_prints_hashes_and_round_trips_its_shard_and_recompute():
    plain = ff.ParallelConfig({"n": 4}, range(4))
    z3 = ff.ParallelConfig({"n": 4}, range(4), shard=3)
    rc = ff.ParallelConfig({"n": 2, "c": 2}, range(4), recompute=True)
    assert str(z3) == "S4 Z3 @[0..3]" and str(rc) == "S2 C2 RC @[0..3]" and str(plain) == "S4 @[0..3]"
    assert z3 != plain and hash(plain) == hash(ff.ParallelConfig({"n": 4}, (0, 1, 2, 3)))
    assert plain.to_dict() == {"degrees": {"n": 4}, "devices": [0, 1, 2, 3]}  # unchanged for plain configs
    for c in (z3, rc, plain):
        assert ff.ParallelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
        assert pickle.loads(pickle.dumps(c)) == c
    assert z3.with_shard(0) == plain and plain.with_recompute().recompute
    for bad in (4, -1, True, 1.0):
        with pytest.raises(StrategyError, match="shard must be one of"):
            ff.ParallelConfig({"n": 2}, (0, 1), shard=bad)
    with pytest.raises(StrategyError, match="recompute"):
        ff.ParallelConfig({"n": 2}, (0, 1), recompute=1)


def test_a_shard_level_needs_parameters_and_their_replicas():
    m, x = _mlp()
    g = ff.trace(m, x)
    mach = ff.Machine.preset("cpu", devices=2)
    dp = ff.Strategy.data_parallel(g, mach)
    linear = next(op for op in g.compute_ops if op.params)
    relu = next(op for op in g.compute_ops if not op.params)
    assert dp.replace(linear.name, dp[linear.name].with_shard(2))[linear.name].shard == 2
    with pytest.raises(StrategyError, match=f"{relu.name}.*has none"):
        dp.replace(relu.name, dp[relu.name].with_shard(1))
    whole = ff.ParallelConfig({}, (0,), shard=3)
    with pytest.raises(StrategyError, match=f"{linear.name}.*needs replicas"):
        dp.replace(linear.name, whole)
    by_out = ff.ParallelConfig({"c": 2}, (0, 1), shard=1)  # each device its own block: nothing to shard
    with pytest.raises(StrategyError, match="needs replicas"):
        dp.replace(linear.name, by_out)


def test_fsdp_and_zero_shard_every_replicated_parameter_and_nothing_else():
    module, inputs = ff.models.get("transformer", size="small", batch_size=8)
    g = ff.trace(module, inputs)
    mach = ff.Machine.preset("p100-cluster", devices=4)
    dp = ff.Strategy.data_parallel(g, mach)
    for stage, s in ((1, ff.Strategy.zero(g, mach, 1)), (2, ff.Strategy.zero(g, mach, 2)),
                     (3, ff.Strategy.fsdp(g, mach))):
        for op in g.compute_ops:
            want = stage if op.params else 0
            assert s[op.name].shard == want, (op.name, s[op.name])
            assert s[op.name].with_shard(0) == dp[op.name]
        assert ff.Strategy.from_json(s.to_json(), g) == s
    assert ff.Strategy.fsdp(g, mach).name == "fsdp" and ff.Strategy.zero(g, mach, 0) == dp
    with pytest.raises(StrategyError, match="stage"):
        ff.Strategy.zero(g, mach, 4)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_each_stage_keeps_less_of_the_parameter_state(optimizer):
    m, x = _mlp(batch=4, width=512)
    g = ff.trace(m, x)
    n = 4
    mach = ff.Machine.preset("p100-cluster", devices=n)
    sim = ff.Simulator(g, mach, optimizer=optimizer)
    res = {k: sim.simulate(s, incremental=False)
           for k, s in (("dp", ff.Strategy.data_parallel(g, mach)), ("z1", ff.Strategy.zero(g, mach, 1)),
                        ("z2", ff.Strategy.zero(g, mach, 2)), ("z3", ff.Strategy.fsdp(g, mach)))}
    peaks = {k: max(r.peak_memory) for k, r in res.items()}
    params = sum(p.numel() * 4 for p in m.parameters())
    if optimizer == "adam":
        assert peaks["dp"] > peaks["z1"] > peaks["z2"] > peaks["z3"]
        # the optimizer state (two float32 copies) is what level 1 splits: (n-1)/n of 2P saved,
        # less the optimizer step's temporaries, which follow the largest slice it updates, and
        # the flat slices the optimizer updates beside the full parameters (P/n)
        assert peaks["dp"] - peaks["z1"] >= 2 * params * (n - 1) / n - params / n - 2 * 512 * 512 * 4
    else:  # no optimizer state to split: level 1 only adds the flat slices (P/n) and the
        # forward's gather buffers: a unit (one layer here) being gathered and the next one
        # prefetched, each a receive buffer of the unit and a send buffer of its slice
        unit = (512 * 512 + 512) * 4
        assert 0 < peaks["z1"] - peaks["dp"] <= params / n + 2 * (unit + unit / n) + 1024
        assert peaks["z1"] > peaks["z2"] > peaks["z3"]
    # levels 1-2 move what an all-reduce moves; level 3 gathers the parameters once more
    assert res["z1"].sync_bytes == res["z2"].sync_bytes == res["dp"].sync_bytes
    assert res["z3"].sync_bytes == pytest.approx(1.5 * res["dp"].sync_bytes)
    for r in res.values():
        assert r.iteration_time > 0


def test_delta_simulation_equals_full_across_shard_changes():
    import random
    module, inputs = ff.models.get("transformer", size="small", batch_size=8)
    g = ff.trace(module, inputs)
    mach = ff.Machine.preset("p100-cluster", devices=4)
    sim = ff.Simulator(g, mach, optimizer="adam")
    fresh = ff.Simulator(g, mach, optimizer="adam")
    s = ff.Strategy.data_parallel(g, mach)
    rng = random.Random(0)
    ops = [op for op in g.compute_ops if op.params]
    for _ in range(30):
        op = rng.choice(ops)
        s = s.replace(op.name, s[op.name].with_shard(rng.choice([0, 1, 2, 3])))
        a, b = sim.simulate(s), fresh.simulate(s, incremental=False)
        assert a.iteration_time == b.iteration_time and a.peak_memory == b.peak_memory
        assert a.sync_bytes == b.sync_bytes


def test_the_executor_takes_shard_levels_and_recomputation():
    from flexflow.api import _as_strategy
    m, x = _mlp()
    g = ff.trace(m, x)
    mach = ff.Machine.preset("cpu", devices=2)
    _as_strategy(ff.Strategy.fsdp(g, mach), g, mach, [0, 1], False)
    dp = ff.Strategy.data_parallel(g, mach)
    op = g.compute_ops[0]
    _as_strategy(dp.replace(op.name, dp[op.name].with_recompute()), g, mach, [0, 1], False)


def test_with_memory_caps_each_device():
    mach = ff.Machine.preset("h200-node").with_memory(80 * 2**30)
    assert all(d.spec.memory_bytes == 80 * 2**30 for d in mach.devices)
    with pytest.raises(ValueError, match="positive"):
        mach.with_memory(0)
