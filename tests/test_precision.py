"""Training precision (``precision=``) in the simulator, the search and the CLI, without
processes: op times at the compute dtype's rate, memory and messages by dtype, MFU."""
import json
import math
import random

import numpy as np
import pytest
import torch
from torch import nn

import flexflow as ff
from flexflow.cli import main
from flexflow.cost.precision import PRECISIONS, precision, priced_op, priced_ops
from flexflow.sim.bound import LoadBound
from flexflow.sim.taskgraph import TaskGraph
from flexflow.sim.taskkeys import PS
from flexflow.strategy.regions import partitions

from _small_models import MLP

NAMES = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "bf16-params")




@pytest.fixture(scope="module")
def transformer():
    module, inputs = ff.models.get("transformer", batch_size=32, size="small")
    return ff.trace(module, inputs)


@pytest.fixture(scope="module")
def big_mlp():
    with torch.device("meta"):  # shapes only: a compute-bound step on a GPU
        m = MLP(width=2048)
        x = (torch.randn(4096, 2048), torch.randn(4096, 2048))
    return ff.trace(m, x)


def _activation_peak(sim, strategy):
    """Per device, the peak of the ops' memory events alone (no parameter state)."""
    tg = TaskGraph(sim.ctx, strategy)
    diff = np.zeros_like(tg.MEMDIFF)
    for ev in tg.MEV:
        if ev is not None and len(ev[0]):
            np.add.at(diff, ev[0], ev[1])
    return np.cumsum(diff, 0).max(0)


def test_unknown_name_is_a_value_error_listing_the_valid_ones(transformer):
    assert tuple(PRECISIONS) == NAMES
    mach = ff.Machine.preset("p100-cluster", devices=2)
    for bad in ("bf16", "fp32", 32, None):
        with pytest.raises(ValueError, match="unknown precision.*" + ", ".join(NAMES)):
            precision(bad)
    with pytest.raises(ValueError, match="32-true, bf16-mixed, bf16-true, 16-mixed, bf16-params"):
        ff.Simulator(transformer, mach, precision="fp8")
    with pytest.raises(ValueError, match="32-true, bf16-mixed, bf16-true, 16-mixed, bf16-params"):
        ff.search(transformer, mach, evaluations=5, progress=False, precision="half")


def test_priced_ops_change_floating_dtypes_only(transformer):
    mixed, true = precision("bf16-mixed"), precision("bf16-true")
    for op in transformer.ops:
        assert priced_op(op, precision("32-true")) is op
        for p in (mixed, true):
            v = priced_op(op, p)
            assert v.name == op.name and v.output_shape == op.output_shape
            for a, b in zip(op.input_dtypes, v.input_dtypes):
                assert b == a if not a.is_floating_point else b in (torch.bfloat16, torch.float32)
            if not op.dtype.is_floating_point:
                assert v.dtype == op.dtype  # token ids, targets
    loss = next(op for op in transformer.compute_ops if op.rule == "loss")
    emb = next(op for op in transformer.compute_ops if op.kind == "embedding")
    assert priced_op(loss, mixed).dtype == torch.float32  # autocast runs losses in float32
    assert priced_op(loss, true).dtype == torch.bfloat16
    assert priced_op(emb, true).dtype == torch.bfloat16
    assert not priced_op(emb, mixed).input_dtypes[0].is_floating_point
    # through the graph, as autocast runs it: the embedding reads a float32 table
    assert priced_ops(transformer, mixed)[transformer.index[emb.name]].dtype == torch.float32
    assert priced_op(emb, mixed).dtype == torch.float32  # (and the op's own view agrees since)
    assert loss.dtype == torch.float32 and emb.dtype == torch.float32  # the traced ops are untouched


def test_bf16_mixed_about_halves_activations_and_keeps_the_optimizer_state(transformer):
    mach = ff.Machine.preset("h200-node", devices=4)
    cm = ff.CostModel(mach)
    s = ff.Strategy.data_parallel(transformer, mach)
    sims = {p: ff.Simulator(transformer, mach, cm, optimizer="adam", precision=p) for p in NAMES}
    act = {p: _activation_peak(sim, s) for p, sim in sims.items()}
    ratio = act["bf16-mixed"] / act["32-true"]
    # the matrix products' outputs halve; the float32 residual stream, the norms reading it,
    # the loss and the byte masks do not
    assert ((0.5 < ratio) & (ratio < 0.75)).all(), ratio
    assert (act["bf16-true"] <= act["bf16-mixed"]).all()
    assert (act["16-mixed"] == act["bf16-mixed"]).all()
    cfg = TaskGraph(sims["32-true"].ctx, s).cfg
    for c in range(len(sims["32-true"].ctx.clusters)):
        plans = {p: sim.ctx.cluster_plan(c, cfg) for p, sim in sims.items()}
        # parameters and two Adam moments: float32 under *-mixed, halved under bf16-true
        assert (plans["bf16-mixed"].mem == plans["32-true"].mem).all()
        assert (plans["bf16-mixed"].grad == plans["32-true"].grad).all()
        assert (2 * plans["bf16-true"].mem == plans["32-true"].mem).all()
        assert (plans["32-true"].cast == 0).all() and (plans["bf16-true"].cast == 0).all()
    res = {p: sim.simulate(s) for p, sim in sims.items()}
    assert max(res["bf16-true"].peak_memory) < max(res["bf16-mixed"].peak_memory) < max(res["32-true"].peak_memory)


def test_compute_time_drops_by_the_devices_flops_ratio(big_mlp):
    for name, lower in (("h200-node", "bfloat16"), ("p100-cluster", "float16")):
        mach = ff.Machine.preset(name, devices=4)
        spec = mach.spec
        cm = ff.CostModel(mach)  # analytic: nothing profiled for GPUs here
        s = ff.Strategy.data_parallel(big_mlp, mach)
        prec = "bf16-mixed" if lower == "bfloat16" else "16-mixed"
        full, low = (ff.Simulator(big_mlp, mach, cm, precision=p) for p in ("32-true", prec))
        want = spec.flops(lower) / spec.flops("float32")
        linears = [o for o in full.ctx.compute if full.ctx.ops[o].kind == "linear"]
        for o in linears:
            op = full.ctx.ops[o]
            part = partitions(op, s[op.name])[0]
            assert cm.source(low.ctx.cops[o], part, part.device) == "analytic"
            t32 = cm.op_time(op, part, part.device)
            t16 = cm.op_time(low.ctx.cops[o], part, part.device)
            oh = spec.launch_overhead_s
            for a, b in zip(t32, t16):  # compute-bound: the roofline's FLOP term
                assert (a - oh) / (b - oh) == pytest.approx(want, rel=1e-9)
        r32, r16 = full.simulate(s), low.simulate(s)
        assert sum(r16.device_busy) < sum(r32.device_busy) / min(want, 2.0) * 1.05
    # P100 has no bfloat16: bf16-mixed computes at its float32 rate, moving half the bytes
    assert ff.Machine.preset("p100-cluster").spec.flops("bfloat16") == ff.Machine.preset("p100-cluster").spec.flops()


def test_sync_bytes_follow_the_reduce_and_gather_dtypes(transformer):
    mach = ff.Machine.preset("p100-cluster", devices=4)
    cm = ff.CostModel(mach)
    strategies = {"dp": ff.Strategy.data_parallel(transformer, mach), "z1": ff.Strategy.zero(transformer, mach, 1),
                  "z3": ff.Strategy.fsdp(transformer, mach)}
    res = {p: {k: ff.Simulator(transformer, mach, cm, precision=p).simulate(s, incremental=False)
               for k, s in strategies.items()} for p in NAMES}
    dp = res["32-true"]["dp"].sync_bytes
    assert dp > 0
    # level 0: all-reduced in float32 under *-mixed, in bfloat16 under bf16-true
    assert res["bf16-mixed"]["dp"].sync_bytes == res["16-mixed"]["dp"].sync_bytes == dp
    assert res["bf16-true"]["dp"].sync_bytes == dp // 2
    # level 1: float32 reduce-scatter (half an all-reduce) + an all-gather, in bfloat16 of the
    # parameters only matrix products read (the others, norms and embeddings, in float32)
    readers: dict = {}
    for op in transformer.compute_ops:
        for local, q in op.params.items():
            readers.setdefault(q, [set(), math.prod(op.param_shapes[local])])[0].add(op.rule)
    low = sum(n for rules, n in readers.values() if rules <= {"linear", "matmul", "conv", "attention"})
    gather = 0.5 * dp * (1 - 0.5 * low / sum(n for _, n in readers.values()))
    assert 0.5 * dp / 2 < gather < 0.5 * dp
    assert res["bf16-mixed"]["z1"].sync_bytes == pytest.approx(0.5 * dp + gather, rel=1e-3)
    # level 3: float32 reduce-scatter + two all-gathers (forward and backward)
    assert res["32-true"]["z3"].sync_bytes == pytest.approx(1.5 * dp)
    assert res["bf16-mixed"]["z3"].sync_bytes == pytest.approx(0.5 * dp + 2 * gather, rel=1e-3)
    assert res["bf16-true"]["z3"].sync_bytes == pytest.approx(1.5 * dp / 2)
    # activation messages in the compute dtype
    mp = ff.Strategy.model_parallel(transformer, mach)
    c32 = ff.Simulator(transformer, mach, cm).simulate(mp).comm_bytes
    c16 = ff.Simulator(transformer, mach, cm, precision="bf16-true").simulate(mp).comm_bytes
    assert c32 > 0 and c16 == c32 // 2


def test_level3_gathers_bf16_and_lower_levels_hold_autocasts_copies():
    m = MLP(width=512)
    g = ff.trace(m, (torch.randn(8, 512), torch.randn(8, 512)))
    mach = ff.Machine.preset("p100-cluster", devices=4)
    params = sum(p.numel() for p in m.parameters())
    for stage, s in ((0, ff.Strategy.data_parallel(g, mach)), (3, ff.Strategy.fsdp(g, mach))):
        sims = {p: ff.Simulator(g, mach, optimizer="adam", precision=p) for p in ("32-true", "bf16-mixed")}
        cfg = TaskGraph(sims["32-true"].ctx, s).cfg
        ctx = sims["bf16-mixed"].ctx
        plans = [ctx.cluster_plan(c, cfg) for c in range(len(ctx.clusters))]
        cast = sum(int(cp.cast[0]) for cp in plans)
        gathered = sum(int(cp.fval[0]) for cp in plans)
        if stage == 0:  # a bfloat16 copy of every parameter (weights and biases)
            assert cast == 2 * params and gathered == 0
        else:  # the full parameters gathered in bfloat16, no other copy
            assert cast == 0 and gathered == 2 * params


def test_delta_simulation_equals_full_under_bf16_mixed(transformer):
    mach = ff.Machine.preset("p100-cluster", devices=4)
    for prec in ("bf16-mixed", "bf16-true"):
        sim = ff.Simulator(transformer, mach, optimizer="adam", precision=prec)
        fresh = ff.Simulator(transformer, mach, optimizer="adam", precision=prec)
        rng = random.Random(1)
        s = ff.Strategy.data_parallel(transformer, mach)
        params = [op for op in transformer.compute_ops if op.params]
        for i in range(40):
            if i % 3 == 2:
                op = rng.choice(params)
                try:
                    s = s.replace(op.name, s[op.name].with_shard(rng.choice([0, 1, 2, 3])))
                except ff.StrategyError:
                    continue
            else:
                s = ff.Strategy.random(transformer, mach, seed=rng.randrange(10**6), base=s, fraction=0.1)
            a, b = sim.simulate(s), fresh.simulate(s, incremental=False)
            assert (a.iteration_time, a.peak_memory, a.sync_bytes, a.comm_bytes, a.device_busy) == \
                   (b.iteration_time, b.peak_memory, b.sync_bytes, b.comm_bytes, b.device_busy)
            assert LoadBound(sim.ctx, s).value() / PS <= a.iteration_time  # the screen stays a bound
        assert sim.stats["delta"] > 0


def test_search_prices_its_precision(transformer):
    mach = ff.Machine.preset("p100-cluster", devices=4)
    found = ff.search(transformer, mach, evaluations=60, seed=0, progress=False, optimizer="adam",
                      precision="bf16-true")
    again = ff.Simulator(transformer, mach, optimizer="adam", precision="bf16-true").simulate(found.strategy)
    assert found.result.iteration_time == again.iteration_time and found.result.peak_memory == again.peak_memory
    dp = ff.Simulator(transformer, mach, optimizer="adam", precision="bf16-true").simulate(
        found.baseline_strategies["data_parallel"])
    assert found.baselines["data_parallel"].peak_memory == dp.peak_memory


def test_cli_simulate_and_search_take_a_precision(capsys):
    args = ("simulate", "alexnet", "--machine", "h200-node", "--devices", "4", "--batch", "64", "--json")
    assert main(list(args)) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(list(args) + ["--precision", "bf16-mixed"]) == 0
    mixed = json.loads(capsys.readouterr().out)
    assert plain["precision"] == "32-true" and mixed["precision"] == "bf16-mixed"
    assert mixed["sync_bytes"] == plain["sync_bytes"] and mixed["iteration_time_ms"] < plain["iteration_time_ms"]
    assert 0 < mixed["mfu"] <= 1
    assert main(["search", "lenet", "--machine", "p100-cluster", "--devices", "2", "--batch", "16", "--json",
                 "--evaluations", "20", "--precision", "bf16-true"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16-true"
    assert main(list(args) + ["--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert "unknown precision 'fp16'" in err and "bf16-mixed" in err and len(err.strip().splitlines()) == 1


def test_mfu_of_a_large_gpu_model():
    module, inputs = ff.models.get("transformer", batch_size=64 * 8, device="meta")
    g = ff.trace(module, inputs)
    mach = ff.Machine.preset("h200-node", devices=8)
    s = ff.Strategy.data_parallel(g, mach)
    for prec, dtype in (("bf16-mixed", "bfloat16"), ("32-true", "float32")):
        r = ff.Simulator(g, mach, optimizer="adam", precision=prec).simulate(s)
        assert 0 < r.mfu <= 1
        assert r.peak_flops == 8 * mach.spec.flops(dtype)
        assert r.mfu == pytest.approx(r.model_flops / (r.iteration_time * r.peak_flops))
    # 3 x the forward FLOPs: 6 x parameters x tokens for a GPT, plus attention's
    # 12 x layers x width x sequence per token (non-causal; the zoo's model masks, not skips)
    cfg = ff.models.config("transformer")
    tokens = 64 * 8 * cfg.seq_len
    params = sum(math.prod(op.param_shapes[k]) for op in g.compute_ops for k in op.params
                 if op.kind == "linear")  # the embeddings are lookups: no FLOPs
    attention = 12 * cfg.layers * cfg.width * cfg.seq_len * tokens
    assert r.model_flops == pytest.approx(6 * params * tokens + attention, rel=0.1)


# Figures of the code before precision existed (computed from a copy of the tree without it):
# 32-true must reproduce them bit for bit.
_BEFORE = {
    ("transformer", "small", "data_parallel"): (0.000819922464, 672768, 0, [1084032] * 4),
    ("transformer", "small", "fsdp"): (0.000819118267, 1009152, 0, [831552] * 4),
    ("transformer", "small", "random0"): (0.00124363101, 266496, 9211904, [1707552, 2007652, 921568, 1235200]),
    ("alexnet", "paper", "zero2"): (0.202414921935, 1466420160, 0, [1514338008] * 4),
}


def test_32_true_is_what_the_simulator_gave_before(monkeypatch):
    from flexflow.sim.memory import UPDATE_TRAFFIC
    # (changed on purpose since: Adam's update moves 18 bytes per parameter byte, torch's passes,
    # where it was priced at 3 + 2 x its 2 state copies; the rest is pinned at the old figure)
    monkeypatch.setitem(UPDATE_TRAFFIC, "adam", 7)
    mach = ff.Machine.preset("p100-cluster", devices=4)
    built = {}
    for (name, size, strategy), want in _BEFORE.items():
        if (name, size) not in built:
            kw = {"batch_size": 32, "size": "small"} if size == "small" else \
                {"batch_size": ff.models.paper_batch(name) * 4, "device": "meta"}
            module, inputs = ff.models.get(name, **kw)
            built[name, size] = ff.trace(module, inputs)
        g = built[name, size]
        if strategy == "random0":
            s = ff.Strategy.random(g, mach, 0)
        elif strategy == "zero2":
            s = ff.Strategy.zero(g, mach, 2)
        else:
            s = getattr(ff.Strategy, strategy)(g, mach)
        peaks = []
        for kw in ({}, {"precision": "32-true"}):
            r = ff.Simulator(g, mach, ff.CostModel(mach), optimizer="adam", **kw).simulate(s, incremental=False)
            # (the peaks since changed on purpose: the all-reduce buckets the executor keeps
            # from step to step count the whole step; the two spellings still agree)
            peaks.append(r.peak_memory)
            if strategy == "random0":  # (changed on purpose since: a reshape that merges or splits
                # axes splits too, so the random draw is another strategy; the spellings still agree)
                continue
            peaks.pop()
            assert (r.sync_bytes, r.comm_bytes) == want[1:3], (name, strategy)
            if strategy in ("fsdp", "zero2"):  # (changed on purpose since: the all-gathers are tasks
                # of their own, before the users' forward and backward, no longer part of the sync)
                assert r.iteration_time == pytest.approx(want[0], rel=0.05), (name, strategy)
            else:
                assert r.iteration_time == want[0], (name, strategy)
            peaks.append(r.peak_memory)
        assert peaks[0] == peaks[1], (name, strategy)
        if strategy != "random0":
            assert all(a >= b for a, b in zip(peaks[0], want[3])), (name, strategy)


@pytest.mark.parametrize("name", ["transformer", "llama", "gpt2", "alexnet", "nmt"])
def test_mixed_dtypes_are_the_ones_autocast_gives(name, monkeypatch):
    """Every op's output dtype under bf16-mixed, as the simulator prices it, equals the
    dtype that op has when the graph runs op by op under CPU autocast: float32 residual
    streams and weighted norms stay float32, matrix products are bfloat16."""
    import flexflow.strategy.localrun as lr
    from flexflow.cost.precision import priced_ops

    torch.manual_seed(0)
    module, inputs = ff.models.get(name, size="small", batch_size=2)
    g = ff.trace(module, inputs)
    seen = {}
    real = lr.compute_partition

    def record(op, part, ins, params):
        y = real(op, part, ins, params)
        if isinstance(y, torch.Tensor):
            seen[op.name] = y.dtype
        return y
    monkeypatch.setattr(lr, "compute_partition", record)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lr.run_graph(g, module, inputs)
    priced = {op.name: op.dtype for op in priced_ops(g, precision("bf16-mixed"))}
    checked = [op.name for op in g.compute_ops if op.name in seen and op.dtype.is_floating_point]
    assert len(checked) > 5
    wrong = {n: (priced[n], seen[n]) for n in checked if priced[n] != seen[n]}
    assert not wrong
    kinds = {(op.kind, seen[op.name]) for op in g.compute_ops if op.name in checked}
    assert any(t == torch.bfloat16 for _, t in kinds)
    if name in ("transformer", "llama", "gpt2"):  # the residual stream stays float32
        assert ("add", torch.float32) in kinds


def test_bf16_params_keeps_a_bfloat16_residual_stream_and_float32_state(transformer):
    """bf16-params: every activation in bfloat16 (the residual stream too, where bf16-mixed
    keeps it in float32), the losses in float32; parameters, gradient reduction and optimizer
    state as bf16-mixed's; every sharded parameter gathered in bfloat16; the runtime refuses it
    with the way to run it."""
    import torch
    mach = ff.Machine.preset("h200-node", devices=4)
    cm = ff.CostModel(mach)
    prec = precision("bf16-params")
    for op in priced_ops(transformer, prec):
        if op.dtype.is_floating_point:
            assert op.dtype == (torch.float32 if op.rule in ("loss", "pointwise_loss") else torch.bfloat16), op.name
    s, z3 = ff.Strategy.data_parallel(transformer, mach), ff.Strategy.fsdp(transformer, mach)
    act = {p: _activation_peak(ff.Simulator(transformer, mach, cm, optimizer="adam", precision=p), s)
           for p in ("bf16-mixed", "bf16-params", "bf16-true")}
    assert (act["bf16-params"] < act["bf16-mixed"]).all() and (act["bf16-params"] >= act["bf16-true"]).all()
    res = {p: {k: ff.Simulator(transformer, mach, cm, optimizer="adam", precision=p).simulate(x, incremental=False)
               for k, x in (("dp", s), ("z3", z3))} for p in ("bf16-mixed", "bf16-params")}
    assert res["bf16-params"]["dp"].sync_bytes == res["bf16-mixed"]["dp"].sync_bytes  # float32 reduce
    assert res["bf16-params"]["z3"].sync_bytes < res["bf16-mixed"]["z3"].sync_bytes  # norms gathered in bf16 too
