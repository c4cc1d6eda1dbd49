"""Activation recomputation (``ParallelConfig.recompute``) in the simulator and the search,
and shard levels in the search's space.  Pure: no processes, analytic costs."""
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import flexflow as ff
from flexflow.cost.model import CostModel
from flexflow.search.common import _Space
from flexflow.search.levers import Levers
from flexflow.sim.simulate import Simulator
from flexflow.sim.taskkeys import _ps
from flexflow.strategy.candidates import candidate_configs
from flexflow.strategy.regions import has_param_replicas, partitions
from flexflow.strategy.strategy import Strategy

B, W, L = 1024, 64, 3  # a chain whose activations outweigh its parameters


class GeluChain(nn.Module):
    """L blocks of Linear(W, 4W) -> GELU -> Linear(4W, W) (or ReLU), an mse loss."""

    def __init__(self, act=nn.functional.gelu):
        super().__init__()
        self.act = act
        self.up = nn.ModuleList(nn.Linear(W, 4 * W) for _ in range(L))
        self.down = nn.ModuleList(nn.Linear(4 * W, W) for _ in range(L))

    def forward(self, x, y):
        for up, down in zip(self.up, self.down):
            x = down(self.act(up(x)))
        return nn.functional.mse_loss(x, y)


def _chain(act=nn.functional.gelu):
    torch.manual_seed(0)
    return ff.trace(GeluChain(act), (torch.randn(B, W), torch.randn(B, W)))


def _live(sim):
    """Bytes live at every position of the step on every device (memory.py's positions)."""
    return np.cumsum(sim._tg.MEMDIFF, axis=0)


def _with_recompute(strategy, ops):
    for op in ops:
        strategy = strategy.replace(op.name, strategy[op.name].with_recompute())
    return strategy


@pytest.fixture(scope="module")
def one():
    return ff.Machine.preset("p100-cluster", devices=1)


def test_recomputing_a_gelu_chain_frees_what_the_liveness_model_says(one):
    """Each GELU's output (B x 4W floats) is saved by the linear after it: kept from the
    GELU's forward to that linear's backward.  Recomputed, it lives over the GELU's forward
    and the linear's forward (which reads it), and again at the linear's backward, where it
    is made anew; in between it is gone.  The peak is where the backward starts: every
    GELU's output but the last block's is gone there.  On one device the step is serial,
    so it takes exactly the GELUs' forward times longer."""
    g = _chain()
    sim = Simulator(g, one)
    plain = Strategy.data_parallel(g, one)
    gelus = [op for op in g.compute_ops if op.kind == "gelu"]
    rc = _with_recompute(plain, gelus)
    r0 = sim.simulate(plain, incremental=False)
    live0 = _live(sim)
    r1 = sim.simulate(rc, incremental=False)
    live1 = _live(sim)
    n = len(g.ops)
    out = B * 4 * W * 4
    want = np.zeros_like(live0)
    for op in gelus:
        o = g.index[op.name]
        consumer = o + 1  # its linear
        want[o + 2:2 * n - 1 - consumer] += out  # (exclusive end: the consumer's backward)
    assert np.array_equal(live0 - live1, want)
    assert r0.peak_memory[0] - r1.peak_memory[0] == (L - 1) * out
    cm = sim.cost_model
    extra = sum(_ps(cm.op_time(op, partitions(op, rc[op.name])[0], 0)[0]) for op in gelus)
    grew = round(r1.iteration_time * 1e12) - round(r0.iteration_time * 1e12)
    # (to the picosecond but for the update tasks' rounding: a unit's update is rounded once,
    # and a recomputed GELU no longer fuses with its neighbours into one unit)
    assert abs(grew - extra) <= len(g.compute_ops), (grew, extra)
    assert r1.comm_bytes == r0.comm_bytes and r1.sync_bytes == r0.sync_bytes


def test_recomputing_an_op_that_saves_only_its_output_trades_it_for_its_input(one):
    """ReLU saves its output, not its input: recomputed, its output goes, but its input
    (the linear's output, the same size) stays until ReLU's backward (its checkpoint holds
    it) -- nothing saved, one more copy where each of them is made and at ReLU's backward."""
    g = _chain(torch.relu)
    sim = Simulator(g, one)
    plain = Strategy.data_parallel(g, one)
    relu = next(op for op in g.compute_ops if op.kind == "relu")
    sim.simulate(plain, incremental=False)
    live0 = _live(sim)
    sim.simulate(_with_recompute(plain, [relu]), incremental=False)
    live1 = _live(sim)
    n, o = len(g.ops), g.index[relu.name]
    down = o + 1
    want = np.zeros_like(live0)
    want[down] = want[2 * n - 1 - down] = want[2 * n - 1 - o] = B * 4 * W * 4
    assert np.array_equal(live1 - live0, want)


@pytest.fixture(scope="module")
def transformer():
    module, inputs = ff.models.get("transformer", size="small", batch_size=64)
    return ff.trace(module, inputs)


@pytest.fixture(scope="module")
def p100():
    return ff.Machine.preset("p100-cluster", devices=4)


def test_recompute_lowers_a_transformers_peak_and_costs_about_its_forward(transformer, p100):
    g, m = transformer, p100
    sim = Simulator(g, m)
    dp = Strategy.data_parallel(g, m)
    space = _Space(g, m)
    levers = Levers(space, sim.ctx, shard=False, recompute=True)
    picked = [g.op(space.reps[gi]) for gi in levers.recompute]
    assert {"gelu", "softmax", "linear", "dropout"} <= {op.kind for op in picked}
    assert not any(op.kind in ("view", "transpose", "embedding") for op in picked)
    r0 = sim.simulate(dp, incremental=False)
    # the linear layers' outputs (recomputing a chain of ops one by one saves less: each
    # op's checkpoint holds its inputs, a recomputed producer's output among them)
    linears = [op for op in picked if op.kind == "linear"]
    r1 = sim.simulate(_with_recompute(dp, linears), incremental=False)
    # (q, k and v save little: the attention's matmuls keep copies of their own, re-laid
    # by head, not the projections' outputs; measured on this CPU the step's peak drops by
    # about a tenth, benchmarks/results/memory_accuracy.md)
    assert max(r1.peak_memory) < 0.9 * max(r0.peak_memory)
    # every device runs a quarter of each op: the step grows by about one partition's forwards
    cm = sim.cost_model
    fwd = sum(cm.op_time(op, partitions(op, dp[op.name])[0], 0)[0] for op in linears)
    grew = r1.iteration_time - r0.iteration_time
    assert 0.8 * fwd <= grew <= 1.2 * fwd, (grew, fwd)


def _walk(g, machine, steps, seed, **options):
    """Random changes -- a new config, recomputation toggled, another shard level -- delta
    against full simulation at every step (results and the liveness rows)."""
    cm = CostModel(machine)
    delta, full = Simulator(g, machine, cm, **options), Simulator(g, machine, cm, **options)
    rng = random.Random(seed)
    reps = [ms[0] for ms in g.groups.values()]
    cur = Strategy.data_parallel(g, machine)
    kinds = {"rc": 0, "shard": 0}
    for step in range(steps):
        op = g.op(rng.choice(reps))
        c = cur[op.name]
        u = rng.random()
        if u < 0.35:
            new = candidate_configs(op, machine)[rng.randrange(len(candidate_configs(op, machine)))]
            new = new.with_recompute(c.recompute)
        elif u < 0.7 or not (op.params and has_param_replicas(op, c)):
            new = c.with_recompute(not c.recompute)
            kinds["rc"] += 1
        else:
            new = c.with_shard(rng.choice([s for s in range(4) if s != c.shard]))
            kinds["shard"] += 1
        nxt = cur.replace(op.name, new)
        rd = delta.simulate(nxt)
        rf = full.simulate(nxt, incremental=False)
        assert rd == rf, (step, op.name, new)
        assert np.array_equal(delta._tg.MEMDIFF, full._tg.MEMDIFF), step
        if step % 25 == 0:  # and with plans of its own (nothing cached from the walk)
            assert Simulator(g, machine, CostModel(machine), **options).simulate(nxt) == rf
        if rng.random() < 0.7:
            cur = nxt
        if step % 50 == 49:
            cur = Strategy.data_parallel(g, machine)
    assert kinds["rc"] > steps // 4 and kinds["shard"] > 0
    return delta


def test_delta_equals_full_with_recompute_and_shard_toggles(transformer, p100):
    _walk(transformer, p100, 150, seed=0, optimizer="adam")
    module, inputs = ff.models.get("nmt", size="small", batch_size=16)  # shared parameters
    _walk(ff.trace(module, inputs), ff.Machine.preset("k80-cluster", devices=8), 100, seed=1)
    _walk(_chain(), ff.Machine.preset("cpu", devices=2), 100, seed=2, optimizer="momentum")


def test_levers_carry_over_base_changes_and_move_whole_op_kinds(transformer, p100):
    g, m = transformer, p100
    sim = Simulator(g, m)
    space = _Space(g, m)
    lv = Levers(space, sim.ctx, shard=True, recompute=True)
    gelu = next(gi for gi in lv.recompute if g.op(space.reps[gi]).kind == "gelu")
    fc = next(gi for gi in lv.shard if "mlp_fc" in space.reps[gi])
    dp = Strategy.data_parallel(g, m)
    cur = dp[space.reps[fc]].with_shard(2).with_recompute()
    # a base that keeps parameter replicas keeps the shard level; one that splits the
    # parameters (no replicas) drops it; the recomputation stays either way
    keeps = next(c for c in space.cands[fc] if c != lv.base(cur) and has_param_replicas(g.op(space.reps[fc]), c))
    drops = next(c for c in space.cands[fc] if not has_param_replicas(g.op(space.reps[fc]), c))
    assert lv.carry(fc, keeps, cur) == keeps.with_shard(2).with_recompute()
    assert lv.carry(fc, drops, cur) == drops.with_recompute()
    assert lv.carry(gelu, space.cands[gelu][0], dp[space.reps[gelu]]) is space.cands[gelu][0]
    assert set(lv.variants(fc, cur)) == {cur.with_recompute(False), cur.with_shard(0), cur.with_shard(1),
                                        cur.with_shard(3)}
    # a block move reaches every group of the kind at once
    moves = lv.block_moves(dp)
    on = [(s, gs) for s, gs in moves if set(gs) == set(lv.rc_kind[gelu])]
    assert len(on) == 1 and all(on[0][0][space.reps[h]].recompute for h in lv.rc_kind[gelu])
    z3 = [(s, gs) for s, gs in moves if set(gs) == set(lv.sh_kind[fc]) and s[space.reps[fc]].shard == 3]
    assert len(z3) == 1 and len(lv.sh_kind[fc]) == 13  # every linear layer
    rng = random.Random(0)
    for _ in range(50):
        move = lv.propose(rng, dp)
        if move is not None:
            s, gs = move
            assert gs and all(s[space.reps[h]] != dp[space.reps[h]] for h in gs)
            assert all(s[space.reps[h]].with_shard(0).with_recompute(False) == dp[space.reps[h]] for h in gs)


def _capped(g, m, peak):
    return m.with_memory(int(peak))


def test_search_fits_by_recompute_or_shard_where_data_parallelism_does_not(transformer, p100):
    g, m = transformer, p100
    sim = Simulator(g, m)
    space = _Space(g, m)
    lv = Levers(space, sim.ctx, shard=False, recompute=True)
    dp = Strategy.data_parallel(g, m)
    peak = lambda s: max(sim.simulate(s, incremental=False).peak_memory)
    # the linear layers recomputed (a chain of ops recomputed one by one saves less: each op's
    # checkpoint holds its inputs)
    linears = [gi for gi in lv.recompute if g.op(space.reps[gi]).kind == "linear"]
    all_rc = lv.apply(dp, linears, lambda h, c: c.with_recompute())[0]
    p_dp, p_rc, p_fsdp = peak(dp), peak(all_rc), peak(Strategy.fsdp(g, m))
    assert p_rc < p_fsdp < p_dp
    # (tensor parallelism keeps 1/4 of each gathered input: below FSDP, above all_rc)
    p_tp = min(peak(Strategy.megatron(g, m)), peak(Strategy.megatron(g, m, shard=3)))
    assert p_rc < p_tp
    # recomputation alone fits, sharding alone does not
    tight = _capped(g, m, (p_rc + min(p_fsdp, p_tp)) / 2)
    for kw in ({}, {"shard": False, "recompute": True}):
        r = ff.search(g, tight, evaluations=300, seed=0, progress=False, **kw)
        assert not r.baselines["data_parallel"].feasible and r.result.feasible, kw
        assert not any(b.feasible for b in r.baselines.values())
        used = [r.strategy[op.name] for op in g.compute_ops]
        assert any(c.recompute for c in used)
        picked = {op.name for op in g.compute_ops if r.strategy[op.name].recompute}
        assert picked != {space.reps[gi] for gi in lv.recompute}  # chosen, not every lever at once
        if kw:
            assert not any(c.shard for c in used)
    # sharding alone fits
    loose = _capped(g, m, (p_fsdp + p_dp) / 2)
    r = ff.search(g, loose, evaluations=200, seed=0, progress=False, recompute=False)
    assert r.result.feasible and not r.baselines["data_parallel"].feasible
    assert not any(r.strategy[op.name].recompute for op in g.compute_ops)
    assert any(r.strategy[op.name].shard for op in g.compute_ops)


def test_search_without_shard_or_recompute_never_chooses_them(transformer, p100):
    g, m = transformer, p100
    sim = Simulator(g, m)
    tight = _capped(g, m, 0.8 * max(sim.simulate(Strategy.data_parallel(g, m)).peak_memory))
    for kw in ({"shard": False, "recompute": False}, {"shard": False}):  # (the latter: parallelize's)
        r = ff.search(g, tight, evaluations=200, seed=0, progress=False, **kw)
        assert "fsdp" not in r.baselines and "data_parallel_rc" not in r.chains
        for s in [r.strategy] + list(r.baseline_strategies.values()):
            assert not any(s[op.name].shard or s[op.name].recompute for op in g.compute_ops)


def test_a_search_with_levers_is_reproducible_and_delta_free(transformer, p100):
    g = transformer
    tight = _capped(g, p100, 0.8 * max(Simulator(g, p100).simulate(Strategy.data_parallel(g, p100)).peak_memory))
    a = ff.search(g, tight, evaluations=150, seed=3, progress=False)
    b = ff.search(g, tight, evaluations=150, seed=3, progress=False)
    full = ff.search(g, tight, evaluations=150, seed=3, progress=False, delta=False)
    assert "data_parallel_rc" in a.chains
    assert a.strategy.to_json() == b.strategy.to_json() == full.strategy.to_json()
    assert a.result.iteration_time == b.result.iteration_time == full.result.iteration_time


# ---- one checkpoint a block ------------------------------------------------------------------
def _blocks_recomputed(graph, strategy):  # op by op: the reference for Strategy.recompute_blocks
    from flexflow.graph.ir import repeated_block
    for op in graph.compute_ops:
        if repeated_block(op.module_path):
            strategy = strategy.replace(op.name, strategy[op.name].with_recompute())
    return strategy


def test_repeated_block_names():
    from flexflow.graph.ir import repeated_block
    assert repeated_block("layers.3.mlp.up") == "layers.3" and repeated_block("h.11") == "h.11"
    assert repeated_block("") == repeated_block("fc1") == repeated_block("encoder.norm") == ""


@pytest.mark.slow
@pytest.mark.parametrize("name,precision", [("llama", "32-true"), ("gpt2", "bf16-mixed")])
def test_recomputing_whole_blocks_keeps_what_comes_into_them_as_measured(name, precision):
    from _shard_workers import measured_peak
    """Every op of every block recomputed: each block keeps only its inputs (the recomputed
    ops of one block chain instead of holding each other's outputs), the executor's
    MemTracker peak falls well below the plain step's, and both are within 10% of the
    simulator's predictions."""
    torch.manual_seed(0)
    module, inputs = ff.models.get(name, size="small", batch_size=64)
    graph = ff.trace(module, inputs)
    m = ff.Machine.preset("cpu", devices=1)
    plain = Strategy.data_parallel(graph, m)
    blocks = plain.recompute_blocks()
    sim = Simulator(graph, m, optimizer="adam", reduce_outputs="eager", precision=precision)
    out = {}
    for label, s in (("plain", plain), ("blocks", blocks)):
        measured = measured_peak(module, inputs, s, m, precision)
        predicted = sim.simulate(s).peak_memory[0]
        assert abs(predicted - measured) <= 0.1 * measured, (label, measured, predicted)
        out[label] = measured
    assert out["blocks"] < 0.85 * out["plain"], out


def test_a_block_checkpoint_keeps_one_residual_stream_a_layer():
    """A 7B-wide decoder (meta) under fsdp on 8 H100s, every block op recomputed: the step
    saves about all of each layer's activations but its float32 residual stream (REFERENCE.md:
    34 bytes a token and width unit a layer in 16 bits; autocast keeps the stream in float32,
    4 bytes) -- each op checkpointed alone would keep its inputs and save little."""
    from flexflow.models.gpt2 import GPT2, GPT2Config
    devices, b, s, h, layers = 8, 4, 2048, 4096, 8
    with torch.device("meta"):
        module = GPT2(GPT2Config(layers=layers, width=h, heads=32, vocab=50368, seq_len=s, positions=s))
        inputs = (torch.zeros(devices * b, s, dtype=torch.long), torch.zeros(devices * b, s, dtype=torch.long))
    graph = ff.trace(module, inputs)
    m = ff.Machine.preset("h100-cluster", devices=devices)
    fsdp = Strategy.fsdp(graph, m)
    sim = Simulator(graph, m, optimizer="adam", precision="bf16-mixed")
    plain = max(sim.simulate(fsdp, incremental=False).peak_memory)
    blocks = max(sim.simulate(fsdp.recompute_blocks(), incremental=False).peak_memory)
    sbh = b * s * h
    assert plain - blocks > 0.8 * layers * (34 - 4) * sbh, (plain, blocks)


class _DeepBlock(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.lin, self.depth = nn.Linear(width, width), depth

    def forward(self, x):
        for _ in range(self.depth):
            x = torch.tanh(self.lin(x))
        return x


class _Deep(nn.Module):
    """One block (``blocks.0``) applying one linear layer and tanh 300 times: a chain of 600
    recomputed ops."""

    def __init__(self, width: int = 8, depth: int = 300):
        super().__init__()
        self.blocks = nn.ModuleList([_DeepBlock(width, depth)])

    def forward(self, x, y):
        return nn.functional.mse_loss(self.blocks[0](x), y)


def test_a_long_chain_is_made_again_in_a_loop_not_a_recursion():
    """Every op of a 600-op block recomputed: the backward makes the chain again in a loop
    (a recursion as deep as the chain would pass Python's limit), with the plain step's
    gradients."""
    torch.manual_seed(0)
    module = _Deep()
    inputs = (torch.randn(4, 8), torch.randn(4, 8))
    graph = ff.trace(module, inputs)
    m = ff.Machine.preset("cpu", devices=1)
    plain = Strategy.data_parallel(graph, m)
    rc = plain
    for op in graph.compute_ops:
        rc = rc.replace(op.name, rc[op.name].with_recompute())
    grads = []
    for s in (plain, rc):
        par = ff.parallelize(module, example_inputs=inputs, strategy=s, machine=m)
        par(*inputs).backward()
        grads.append([p.grad.clone() for p in par.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_strategy_recompute_blocks_is_every_op_of_the_blocks():
    from flexflow.graph.ir import repeated_block
    module, inputs = ff.models.get("gpt2", size="small")  # tied embedding: outside the blocks
    graph = ff.trace(module, inputs)
    m = ff.Machine.preset("cpu", devices=2)
    fsdp = Strategy.fsdp(graph, m)
    rc = fsdp.recompute_blocks()
    assert rc == _blocks_recomputed(graph, fsdp) and rc.name == "fsdp_rc" and rc != fsdp
    for op in graph.compute_ops:
        assert rc[op.name].recompute == bool(repeated_block(op.module_path))
        assert rc[op.name].with_recompute(False) == fsdp[op.name]
