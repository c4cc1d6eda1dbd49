"""Reads of one tensor that several ops share (the query, key and value projections of one
normalized input; an MLP's gate and up): received once, cast once under autocast, counted
once by the simulator -- in time, in bytes moved and in memory."""
from __future__ import annotations

import random

import _loop_workers as L

import flexflow as ff
from flexflow.hardware.machine import Machine
from flexflow.runtime.plan import Plan
from flexflow.sim.simulate import Simulator
from flexflow.sim.taskgraph import TaskGraph
from flexflow.strategy.candidates import candidate_configs


def _llama(batch=8):
    m, x = L.build("llama", batch)
    return m, x, ff.trace(m, x)


def test_the_executor_receives_and_casts_a_shared_read_once():
    m, x, g = _llama()
    mach = Machine.preset("cpu", devices=2)
    s = ff.Strategy.megatron(g, mach, tp=2)
    p = Plan(g, s, m, [0, 1], rank=0, world=2, precision="bf16-mixed")
    consumers = {ex.consumer for ex in p.exchanges}
    for blk in ("layers_0", "layers_1"):
        # q, k and v read the attention norm's output whole (gathered across the group) ...
        assert p.share_src[(f"{blk}_attention_wk", 0)] == (f"{blk}_attention_wq", 0)
        assert p.share_src[(f"{blk}_attention_wv", 0)] == (f"{blk}_attention_wq", 0)
        assert p.share_src[(f"{blk}_feed_forward_w3", 0)] == (f"{blk}_feed_forward_w1", 0)
        # ... with one exchange, the first reader's
        assert f"{blk}_attention_wq" in consumers
        assert not {f"{blk}_attention_wk", f"{blk}_attention_wv", f"{blk}_feed_forward_w3"} & consumers
        # and under autocast one bfloat16 copy for the three
        assert {p.cast_share[(f"{blk}_attention_w{w}", 0)][0] for w in "qkv"} == {(f"{blk}_attention_wq", 0)}
    # float32: nothing to cast; a plan that reads apart shares nothing
    assert not Plan(g, s, m, [0, 1], rank=0, world=2).cast_share
    wk = "layers_0_attention_wk"
    other = next(c for c in candidate_configs(g.op(wk), mach) if c.devices == (1,))
    apart = Plan(g, s.replace(wk, other), m, [0, 1], rank=0, world=2)
    assert (wk, 0) not in apart.share_src and apart.num_exchanges > p.num_exchanges


def test_the_simulator_moves_and_holds_a_shared_read_once():
    _, _, g = _llama(batch=8)
    mach = Machine.preset("h100-cluster", devices=4)
    s = ff.Strategy.megatron(g, mach, tp=4)
    sim = Simulator(g, mach, precision="bf16-mixed", optimizer="adam")
    shared = sim.simulate(s)
    tg = sim._tg
    names = [op.name for op in tg.ctx.ops]
    wk = names.index("layers_0_attention_wk")
    assert tg.ESHARE[wk][0] and not tg.ESHARE[names.index("layers_0_attention_wq")][0]
    # the same plan with k's weight split by its inputs (each device reads a quarter of the
    # features, so it cannot share q's read): k's edge moves what the shared one did not
    k_cfg = s["layers_0_attention_wk"]
    apart_s = s.replace("layers_0_attention_wk", ff.ParallelConfig({"k": 4}, k_cfg.devices))
    apart = Simulator(g, mach, precision="bf16-mixed", optimizer="adam").simulate(apart_s)
    assert apart.comm_bytes > shared.comm_bytes
    # memory: the plan counted with every read apart holds more than with shared ones (on a
    # pair, whose exchanges are point to point and keep the received input for the backward;
    # a group of 4 gathers it again there instead: tests/test_collectives.py)
    mach2 = Machine.preset("h100-cluster", devices=2)
    s2 = ff.Strategy.megatron(g, mach2, tp=2)
    held = max(Simulator(g, mach2, precision="bf16-mixed", optimizer="adam").simulate(s2).peak_memory)
    sim2 = Simulator(g, mach2, precision="bf16-mixed", optimizer="adam")
    sim2.ctx.live.read_group = lambda o, j, cfg: None  # (nothing shared)
    assert max(sim2.simulate(s2).peak_memory) > held


def test_delta_equals_full_from_a_tensor_parallel_plan():
    """Random moves of the readers of shared reads (their configs drawn, or set to a sibling's,
    which makes a read shared again): the delta simulation equals a fresh one throughout."""
    _, _, g = _llama(batch=8)
    mach = Machine.preset("h100-cluster", devices=4)
    TaskGraph.keep_columns = True
    try:
        delta = Simulator(g, mach, precision="bf16-mixed", optimizer="adam")
        full = Simulator(g, mach, precision="bf16-mixed", optimizer="adam")
        cur = ff.Strategy.megatron(g, mach, tp=4)
        assert delta.simulate(cur) == full.simulate(cur, incremental=False)
        rng = random.Random(0)
        readers = [op.name for op in g.compute_ops if op.rule in ("linear", "rms_norm")]
        for step in range(60):
            op = rng.choice(readers)
            if rng.random() < 0.5:
                sib = rng.choice(readers)
                cfg = cur[sib] if cur[sib].degrees.keys() <= {d.name for d in g.op(op).dims} else None
            else:
                cfg = None
            cfg = cfg or rng.choice(candidate_configs(g.op(op), mach))
            try:
                new = cur.replace(op, cfg)
            except ff.StrategyError:
                continue
            rd = delta.simulate(new)
            assert rd == full.simulate(new, incremental=False), (step, op)
            if step % 10 == 0:
                delta._tg.validate()
                delta._sched.arrays.check(delta._tg)
            cur = new
    finally:
        TaskGraph.keep_columns = False
