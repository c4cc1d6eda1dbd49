"""Execution simulator: task graph, full and delta simulation, memory, Chrome trace."""
import gc
import json
import math
import random

import pytest
import torch

import flexflow as ff
from flexflow.cost.model import CostModel
from flexflow.hardware.machine import Machine
from flexflow.sim.simulate import SimResult, Simulator
from flexflow.strategy.config import ParallelConfig
from flexflow.strategy.strategy import Strategy
from flexflow.strategy.candidates import candidate_configs
from flexflow.strategy.regions import partitions
from flexflow.sim.taskgraph import TaskGraph


@pytest.fixture(scope="module")
def lenet():
    m, x = ff.models.get("lenet", batch_size=64 * 4, size="paper", device="meta")
    return ff.trace(m, x)


@pytest.fixture(scope="module")
def inception():
    m, x = ff.models.get("inception_v3", batch_size=64 * 16, size="paper", device="meta")
    return ff.trace(m, x)


@pytest.fixture(scope="module")
def nmt_small():
    m, x = ff.models.get("nmt", batch_size=32, size="small", device="meta")
    return ff.trace(m, x)


@pytest.fixture(scope="module")
def p100_16():
    return Machine.preset("p100-cluster", devices=16)


def _update_s(machine, nbytes, copies=0):  # default optimizer: sgd
    s = machine.devices[0].spec
    return (3 + 2 * copies) * nbytes / s.mem_bw_Bps + s.launch_overhead_s


def test_one_device_is_the_sum_of_compute(lenet, inception):
    for g in (lenet, inception):
        m = Machine.preset("p100-cluster", devices=1)
        cm = CostModel(m)
        s = Strategy.data_parallel(g, m)
        r = Simulator(g, m, cm).simulate(s)
        assert r.comm_bytes == 0 and r.sync_bytes == 0
        expected = 0.0
        for op in g.compute_ops:
            (p,) = partitions(op, s[op.name])
            f, b = cm.op_time(op, p, 0)
            expected += f + b
            expected += sum(_update_s(m, math.prod(shape) * 4) for shape in op.param_shapes.values())
        assert r.iteration_time == pytest.approx(expected, rel=1e-6)
        assert r.device_busy[0] == pytest.approx(r.iteration_time, rel=1e-9)
        assert r.link_busy == []
    assert r.feasible is False and "device 0" in r.message  # a 1024 batch of inception_v3 on one P100


@pytest.mark.parametrize("n", [2, 4, 16])
def test_data_parallel_syncs_every_parameter(lenet, inception, n):
    m = Machine.preset("p100-cluster", devices=n)
    for g in (lenet, inception):
        r = Simulator(g, m).simulate(Strategy.data_parallel(g, m))
        assert r.sync_bytes == 2 * (n - 1) * g.param_bytes
        # every op of lenet and inception_v3 has a sample dim: data parallel moves no activations
        assert all("n" in op.parallel_dims for op in g.compute_ops)
        assert r.comm_bytes == 0
        assert r.feasible == (g is lenet or n == 16)  # the 1024 batch fits 16 P100s, not 2 or 4


def test_model_parallel_has_no_sync(lenet, inception, p100_16):
    for g in (lenet, inception):
        r = Simulator(g, p100_16).simulate(Strategy.model_parallel(g, p100_16))
        assert r.sync_bytes == 0
        assert r.comm_bytes > 0  # ops on different devices exchange activations


def _critical_path(g, strategy, cm):
    """Longest op path of min-partition forward + backward compute times."""
    best = {}
    for op in g.compute_ops:
        parts = partitions(op, strategy[op.name])
        times = [cm.op_time(op, p, p.device) for p in parts]
        w = min(f for f, _ in times) + min(b for _, b in times)
        best[op.name] = w + max((best[u] for u in op.inputs if u in best), default=0.0)
    return max(best.values())


def test_never_faster_than_the_compute_critical_path(inception, nmt_small, p100_16):
    for g in (inception, nmt_small):
        cm = CostModel(p100_16)
        sim = Simulator(g, p100_16, cm)
        strategies = [Strategy.data_parallel(g, p100_16), Strategy.model_parallel(g, p100_16),
                      Strategy.expert(g, p100_16)] + [Strategy.random(g, p100_16, k) for k in range(3)]
        for s in strategies:
            r = sim.simulate(s, incremental=False)
            cp = _critical_path(g, s, cm)
            assert r.iteration_time >= cp * (1 - 1e-9), s.name
            assert max(r.device_busy) <= r.iteration_time * (1 + 1e-9)


def test_overfull_strategy_is_infeasible_and_names_the_device():
    m, x = ff.models.get("transformer", batch_size=64 * 16, size="paper", device="meta")
    g = ff.trace(m, x)
    mach = Machine.preset("p100-cluster", devices=16)
    r = Simulator(g, mach).simulate(Strategy.model_parallel(g, mach))
    assert not r.feasible
    worst = max(range(16), key=lambda d: r.peak_memory[d] - r.memory_capacity[d])
    assert f"device {worst}" in r.message
    excess = r.peak_memory[worst] - r.memory_capacity[worst]
    assert excess > 0 and f"{excess:,} bytes" in r.message
    assert all(c == 16 * 2**30 for c in r.memory_capacity)


def test_memory_counts_optimizer_state_by_kind(lenet):
    m = Machine.preset("p100-cluster", devices=1)
    s = Strategy.data_parallel(lenet, m)
    peak = {k: Simulator(lenet, m, optimizer=k).simulate(s).peak_memory[0] for k in ("sgd", "momentum", "adam")}
    assert peak["momentum"] - peak["sgd"] == lenet.param_bytes  # one state copy, at every position
    assert peak["adam"] - peak["momentum"] >= lenet.param_bytes
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        Simulator(lenet, m, optimizer="rmsprop")


def test_memory_frees_activations_by_liveness(inception):
    """Activations are freed at their last use: the peak is well below keeping every output,
    and above what the step holds at its end (parameters, gradients, state)."""
    m = Machine.preset("p100-cluster", devices=1)
    r = Simulator(inception, m, optimizer="adam").simulate(Strategy.data_parallel(inception, m))
    acts = sum(op.output_bytes for op in inception.compute_ops)
    assert 4 * inception.param_bytes < r.peak_memory[0] < 4 * inception.param_bytes + acts


def _measured_peak(name, optimizer):
    """MemTracker's peak of one training step of the small zoo model on this CPU."""
    from torch.distributed._tools.mem_tracker import MemTracker
    module, inputs = ff.models.get(name, size="small")
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-3)}[optimizer]
    opt = make(module.parameters())

    def step(xs):
        opt.zero_grad()
        module(*xs).backward()
        opt.step()
    step(inputs)  # the optimizer state exists from here on
    mt = MemTracker()
    mt.track_external(module, opt)
    with mt:
        step([x.clone() for x in inputs])  # the batch counts, as on a device
    return ff.trace(module, inputs), mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("name,optimizer", [("lenet", "adam"), ("nmt", "sgd"), ("transformer", "adam")])
def test_peak_memory_matches_memtracker(name, optimizer):
    g, measured = _measured_peak(name, optimizer)
    m = Machine.preset("cpu", devices=1)
    pred = Simulator(g, m, optimizer=optimizer).simulate(Strategy.data_parallel(g, m)).peak_memory[0]
    assert abs(pred - measured) <= 0.1 * measured, (pred, measured)


def _walk(g, machine, steps, seed, check_every=1, validate_every=0, **options):
    """Random single-op changes, kept when within 2% of the best time seen (as a search
    would; the others are dropped, so the next call differs in two ops), back to data
    parallelism every 100 steps (a new chain); delta vs full at every step."""
    gc.disable()  # the walk keeps many task graphs and plans alive: collections are slow
    # the consistency checks compare the scheduler's arrays with the task graph's own lists
    TaskGraph.keep_columns = bool(validate_every)
    try:
        return _walk_inner(g, machine, steps, seed, check_every, validate_every, options)
    finally:
        gc.enable()
        TaskGraph.keep_columns = False


def _walk_inner(g, machine, steps, seed, check_every, validate_every, options):
    cm = CostModel(machine)
    delta, full = Simulator(g, machine, cm, **options), Simulator(g, machine, cm, **options)
    rng = random.Random(seed)
    reps = [members[0] for members in g.groups.values()]
    cur = Strategy.data_parallel(g, machine)
    assert delta.simulate(cur) == full.simulate(cur, incremental=False)
    best = full.simulate(cur, incremental=False).iteration_time
    start = cur
    for step in range(steps):
        if step % 100 == 99:
            cur = start
        op = rng.choice(reps)
        new = cur.replace(op, rng.choice(candidate_configs(g.op(op), machine)))
        rd = delta.simulate(new)
        if step % check_every == 0:
            rf = full.simulate(new, incremental=False)
            assert rd.iteration_time == pytest.approx(rf.iteration_time, rel=1e-9, abs=0)
            assert rd == rf, (step, op)
        if validate_every and step % validate_every == 0:
            delta._tg.validate()
            delta._sched.arrays.check(delta._tg)
        if rd.iteration_time <= 1.02 * best:
            cur, best = new, min(best, rd.iteration_time)
    return delta


@pytest.mark.slow
def test_delta_equals_full_on_1000_random_changes(inception, p100_16):
    sim = _walk(inception, p100_16, 1000, seed=1)
    assert sim.stats["delta"] >= 900  # (a change of many ops at once falls back to full)


def test_delta_equals_full_with_shared_parameters_and_validates(nmt_small, lenet):
    _walk(nmt_small, Machine.preset("p100-cluster", devices=8), 150, seed=2, validate_every=10)
    _walk(lenet, Machine.preset("k80-cluster", devices=8), 150, seed=3, validate_every=10)


def test_delta_equals_full_with_parameter_server_sync_and_adam(nmt_small, lenet):
    _walk(nmt_small, Machine.preset("k80-cluster", devices=8), 80, seed=4, sync="ps", optimizer="adam")
    _walk(lenet, Machine.preset("p100-cluster", devices=4), 80, seed=5, sync="ps", optimizer="momentum")


def _walk_within(g, machine, steps, seed, **options):
    """Proposals simulated with a limit near their true time: None exactly when the full
    simulation is slower than the limit, else the full result; a stopped run leaves the
    simulator exact for the next call, limited or not."""
    TaskGraph.keep_columns = True  # (for the final check)
    try:
        return _walk_within_inner(g, machine, steps, seed, **options)
    finally:
        TaskGraph.keep_columns = False


def _walk_within_inner(g, machine, steps, seed, **options):
    cm = CostModel(machine)
    lim, full = Simulator(g, machine, cm, **options), Simulator(g, machine, cm, **options)
    rng = random.Random(seed)
    reps = [members[0] for members in g.groups.values()]
    cur = Strategy.data_parallel(g, machine)
    for step in range(steps):
        op = rng.choice(reps)
        new = cur.replace(op, rng.choice(candidate_configs(g.op(op), machine)))
        rf = full.simulate(new, incremental=False)
        if step % 7 == 6:  # an unlimited call right after whatever the last one did
            assert lim.simulate(new) == rf
            continue
        limit = rf.iteration_time * rng.choice([0.5, 0.9, 0.99, 1.01, 1.1, 2.0])
        rd = lim.simulate_within(new, limit)
        if rf.iteration_time > limit:
            assert rd is None, (step, op)
        else:
            assert rd == rf, (step, op)
        if rng.random() < 0.3:
            cur = new
    assert lim.stats["stopped"] > 0 and lim.stats["delta"] > lim.stats["stopped"]
    lim._sched.arrays.check(lim._tg)
    return lim


@pytest.mark.slow
def test_simulate_within_stops_exactly_when_slower(inception, nmt_small, lenet):
    _walk_within(inception, Machine.preset("p100-cluster", devices=16), 120, seed=11)
    _walk_within(nmt_small, Machine.preset("k80-cluster", devices=8), 80, seed=12, sync="ps", optimizer="adam")
    _walk_within(lenet, _on_cores()[0], 80, seed=13)
    sim = Simulator(lenet, Machine.preset("p100-cluster", devices=4))
    dp = Strategy.data_parallel(lenet, sim.machine)
    t = sim.simulate(dp, incremental=False).iteration_time
    assert sim.simulate_within(dp, t / 2, incremental=False) is None
    assert sim.simulate_within(dp, 2 * t) == sim.simulate(dp, incremental=False)
    assert sim.simulate_within(dp, float("inf")).iteration_time == t


_CORE_SCRIPT = """
import json, random, sys
import flexflow as ff
from flexflow.hardware.machine import Machine
from flexflow.sim.simulate import Simulator
from flexflow.sim.schedcore import JIT
from flexflow.strategy import Strategy, candidate_configs
from flexflow.sim.taskgraph import TaskGraph
TaskGraph.keep_columns = True
m, x = ff.models.get("lenet", batch_size=32, device="meta")
g = ff.trace(m, x)
mach = Machine.preset("k80-cluster", devices=8)
sim = Simulator(g, mach)
rng = random.Random(0)
reps = [ms[0] for ms in g.groups.values()]
cur = Strategy.data_parallel(g, mach)
out = [sim.simulate(Strategy.random(g, mach, 1)).iteration_time]  # a bigger graph first
last = sim.simulate(cur).iteration_time
for step in range(60):
    op = rng.choice(reps)
    new = cur.replace(op, rng.choice(candidate_configs(g.op(op), mach)))
    if step % 20 == 10:
        new = Strategy.random(g, mach, step)
    r = sim.simulate_within(new, last * rng.choice([0.9, 1.1]))
    out.append(None if r is None else r.iteration_time)
    if r is not None:
        cur, last = new, r.iteration_time
sim._sched.arrays.check(sim._tg)
print(json.dumps({"jit": JIT, "times": out}))
"""


@pytest.mark.slow
def test_interpreted_core_gives_the_same_results():
    """Without numba (or with FLEXFLOW_NO_JIT=1) the scheduling kernels run interpreted, with
    numpy's bounds checks, and give the same results as compiled."""
    import json
    import os
    import subprocess
    import sys
    runs = []
    for off in ("", "1"):
        env = dict(os.environ, FLEXFLOW_NO_JIT=off)
        p = subprocess.run([sys.executable, "-c", _CORE_SCRIPT], env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert runs[1]["jit"] is False
    assert runs[0]["times"] == runs[1]["times"]
    assert None in runs[0]["times"] and sum(t is not None for t in runs[0]["times"]) >= 5


def test_parameter_server_sync_comes_after_the_task_graph(lenet):
    """sync="ps": every replica but the first sends each gradient to the first and gets the
    values back, one transfer after another, after the rest of the step; nothing to sync,
    nothing added."""
    from flexflow.sim.taskgraph import PS
    m = Machine.preset("k80-cluster", devices=4)
    sim = Simulator(lenet, m, sync="ps")
    r = sim.simulate(Strategy.data_parallel(lenet, m), incremental=False)
    graph_end = max(sim._sched.free)
    extra = 0
    for op in lenet.compute_ops:
        nb = sum(math.prod(s) * 4 for s in op.param_shapes.values())
        if nb:
            extra += sum(sim.ctx.transfer_ps(d, 0, nb) + sim.ctx.transfer_ps(0, d, nb) for d in (1, 2, 3))
    assert round(r.iteration_time * PS) == graph_end + extra
    ring = Simulator(lenet, m).simulate(Strategy.data_parallel(lenet, m))
    assert r.sync_bytes == ring.sync_bytes and r.iteration_time > ring.iteration_time
    mp = Strategy.model_parallel(lenet, m)  # every op on one device: no replicas
    assert Simulator(lenet, m, sync="ps").simulate(mp) == Simulator(lenet, m).simulate(mp)
    with pytest.raises(ValueError, match="unknown sync model 'tree'"):
        Simulator(lenet, m, sync="tree")


def test_incremental_with_many_changes_and_repeats(inception, p100_16):
    sim = Simulator(inception, p100_16)
    a, b = Strategy.data_parallel(inception, p100_16), Strategy.random(inception, p100_16, 5)
    ra = sim.simulate(a)
    rb = sim.simulate(b)          # everything changed: a full simulation
    assert sim.simulate(b) == rb  # nothing changed
    assert sim.simulate(a) == ra
    assert rb == Simulator(inception, p100_16).simulate(b)


def test_chrome_trace(tmp_path, lenet):
    m = Machine.preset("p100-cluster", devices=8)
    s = Strategy.model_parallel(lenet, m).replace("fc1", ParallelConfig({"c": 4}, range(4, 8)))
    r = Simulator(lenet, m).simulate(s)
    path = tmp_path / "trace.json"
    r.to_chrome_trace(path)
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert len(set(names.values())) == len(names)
    used_devices = {d for c in s.values() for d in c.devices}
    assert {f"device {d}" for d in used_devices} <= set(names)
    used_links = {m.links[l].name for l, b in enumerate(r.link_busy) if b > 0}
    assert used_links and used_links <= set(names)
    assert set(names) == {f"device {d}" for d in used_devices} | used_links
    assert {e["name"].rsplit(" ", 1)[-1] for e in events} >= {"fwd", "bwd", "xfer", "update"}
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    assert end == pytest.approx(r.iteration_time * 1e6, rel=1e-9)
    # per row, tasks never overlap
    rows = {}
    for e in events:
        rows.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in rows.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))


def test_result_fields(lenet):
    m = Machine.preset("p100-cluster", devices=4)
    r = Simulator(lenet, m).simulate(Strategy.data_parallel(lenet, m))
    assert isinstance(r, SimResult)
    assert len(r.peak_memory) == len(r.device_busy) == len(r.memory_capacity) == 4
    assert len(r.link_busy) == len(m.links)
    assert r.iteration_time > 0 and r.throughput == pytest.approx(1 / r.iteration_time)


def test_bad_strategies_are_refused_and_leave_the_simulator_usable(lenet):
    m = Machine.preset("p100-cluster", devices=4)
    sim = Simulator(lenet, m)
    dp = Strategy.data_parallel(lenet, m)
    r = sim.simulate(dp)
    bad = dict(dp)
    bad["fc1"] = ParallelConfig({"c": 2}, (3, 7))  # device 7 is not on a 4-device machine
    with pytest.raises(ValueError, match="fc1"):
        sim.simulate(bad)
    assert sim.simulate(dp) == r
    other = Strategy.data_parallel(lenet, Machine.preset("k80-cluster", devices=4))
    with pytest.raises(ValueError, match="another machine"):
        sim.simulate(other)


def _on_cores(devices=4):
    """A cpu-like machine whose messages and collectives run on the computing cores."""
    import dataclasses
    m = Machine.preset("p100-cluster", devices=devices)
    link = dataclasses.replace(m.intra_node, latency_s=200e-6, allreduce_latency_s=150e-6,
                               allreduce_bandwidth_Bps=1e9)
    on = dataclasses.replace(m, spec=dataclasses.replace(m.spec, comm_on_cores=True), intra_node=link,
                             inter_node=dataclasses.replace(m.inter_node, latency_s=300e-6))
    return on, dataclasses.replace(on, spec=dataclasses.replace(m.spec, comm_on_cores=False))


def test_comm_on_cores_holds_both_ends_and_adds_collective_latency(lenet):
    """Where communication runs on the cores that compute, a transfer keeps its sender and
    receiver busy for its duration (so the devices' busy time grows by exactly those
    transfers and all-reduces), and each gradient bucket's and the loss all-reduce's latency adds to the step
    (the loss's only where it does not ride on the gradients)."""
    from flexflow.cost.model import GRAD_BUCKET_BYTES
    from flexflow.sim.taskkeys import SYNC, XB, XF, decode_prio
    on, off = _on_cores(4)
    assert on.fingerprint() != off.fingerprint() and Machine.from_json(on.to_json()) == on
    s = Strategy(lenet, dict(Strategy.random(lenet, off, 7).items()))  # for either machine
    son, soff = Simulator(lenet, on), Simulator(lenet, off)
    r_on, r_off = son.simulate(s), soff.simulate(s)
    a = son._sched.arrays
    alive, prio, dur = a.column("alive"), a.column("prio"), a.column("dur")
    extra = [0] * 4
    for t in range(len(alive)):
        if alive[t] and decode_prio(prio[t])[1] in (XF, XB, SYNC):
            rs = a.resources(t)
            for r in (rs if len(rs) > 1 else ()):  # (held with the link: a transfer or all-reduce)
                if r < 4:
                    extra[r] += dur[t]
    assert sum(extra) > 0
    for d in range(4):
        assert r_on.device_busy[d] == pytest.approx(r_off.device_busy[d] + extra[d] / 1e12, rel=1e-9)
    # data parallelism: the gradients of lenet fit one bucket; one latency for it, and the
    # loss rides on it; all-reduced on its own ("eager"), the loss adds one more
    dp = Strategy(lenet, dict(Strategy.data_parallel(lenet, off).items()))
    nbytes = lenet.param_bytes
    assert nbytes < GRAD_BUCKET_BYTES
    lat = on.allreduce_latency_s(range(4))
    assert lat == pytest.approx(6 * 150e-6)
    son.simulate(dp)
    assert son._collective_latency_ps(son._tg) == round(lat * 1e12)
    eager = Simulator(lenet, on, reduce_outputs="eager")
    eager.simulate(dp)
    assert eager._collective_latency_ps(eager._tg) == round(2 * lat * 1e12)
    assert eager.simulate(dp).iteration_time >= 2 * lat


def test_sync_skew_costs_a_share_of_the_second_busiest_compute(lenet):
    """With ``sync_skew``, the step's synchronisations wait for the slowest rank: it adds the
    skew times the compute of the second busiest device, and nothing when one device
    computes alone."""
    import dataclasses
    on, _ = _on_cores(4)
    skewed = dataclasses.replace(on, spec=dataclasses.replace(on.spec, sync_skew=0.2))
    assert "sync_skew" not in on.to_dict()["device"] and Machine.from_json(skewed.to_json()) == skewed
    assert skewed.fingerprint() != on.fingerprint()
    for make in (Strategy.data_parallel, Strategy.model_parallel, lambda g, m: Strategy.random(g, m, 3)):
        s = Strategy(lenet, dict(make(lenet, on).items()))
        plain, sk = Simulator(lenet, on).simulate(s), Simulator(lenet, skewed).simulate(s)
        sim = Simulator(lenet, skewed)
        sim.simulate(s)
        tg = sim._tg
        busy = sorted((tg.OPBUSY[:, :4].sum(0) + tg.UBUSY.sum(0)).tolist())
        assert busy[-2] > 0
        assert sk.iteration_time == pytest.approx(plain.iteration_time + 0.2 * busy[-2] / 1e12, abs=1e-12)
    one = Strategy(lenet, dict(Strategy.single_device(lenet, on).items()))
    assert Simulator(lenet, skewed).simulate(one).iteration_time == Simulator(lenet, on).simulate(one).iteration_time


def test_delta_equals_full_with_comm_on_cores(lenet, nmt_small):
    import dataclasses
    on, _ = _on_cores(4)
    _walk(lenet, on, 120, seed=8, validate_every=20)
    skewed = dataclasses.replace(on, spec=dataclasses.replace(on.spec, sync_skew=0.15))
    _walk(nmt_small, skewed, 80, seed=9, optimizer="adam")


def _lagged(devices=4, lag=120e-6):
    import dataclasses
    on, _ = _on_cores(devices)
    return dataclasses.replace(on, spec=dataclasses.replace(on.spec, message_lag_s=lag))


def test_delta_and_limited_runs_are_exact_with_a_message_lag(lenet, nmt_small):
    _walk(lenet, _lagged(), 120, seed=10, validate_every=20)
    _walk(nmt_small, _lagged(lag=50e-6), 80, seed=11, optimizer="adam")
    _walk_within(nmt_small, _lagged(), 120, seed=12)


def test_message_lag_frees_the_cores_and_delays_the_consumer(lenet):
    """With ``message_lag_s``, a transfer holds its devices for its latency less the lag, and
    its consumer starts no earlier than the lag after the transfer ends; the devices' busy
    time drops by the lag per transfer (and here the step gets shorter)."""
    from flexflow.sim.schedcore import PLEN, POFF
    from flexflow.sim.taskkeys import XB, XF, decode_prio
    lag = 120e-6
    on, lagged = _on_cores(4)[0], _lagged(lag=lag)
    assert "message_lag_s" not in on.to_dict()["device"] and Machine.from_json(lagged.to_json()) == lagged
    assert lagged.fingerprint() != on.fingerprint() and "hold no core" in lagged.describe()
    s = Strategy(lenet, dict(Strategy.random(lenet, on, 7).items()))
    plain, sim = Simulator(lenet, on), Simulator(lenet, lagged)
    r0, r1 = plain.simulate(s), sim.simulate(s)
    a = sim._sched.arrays
    alive, prio, dur, fin = a.column("alive"), a.column("prio"), a.column("dur"), a.FIN.tolist()
    xfers = [t for t in range(len(alive)) if alive[t] and decode_prio(prio[t])[1] in (XF, XB)]
    assert xfers
    lag_ps = round(lag * 1e12)
    succ = {t: [] for t in xfers}
    for c in range(len(alive)):
        if alive[c]:
            o, n = a.C[c, POFF], a.C[c, PLEN]
            for p in a.pred.buf[o:o + n].tolist():
                if p in succ:
                    succ[p].append(c)
    for t in xfers:
        assert succ[t]
        for c in succ[t]:
            assert fin[c] - dur[c] >= fin[t] + lag_ps
    moved = [0] * 4
    for t in xfers:
        for r in a.resources(t):
            if r < 4:
                moved[r] += lag_ps
    for d in range(4):
        assert r1.device_busy[d] == pytest.approx(r0.device_busy[d] - moved[d] / 1e12, rel=1e-9)
    assert r1.iteration_time <= r0.iteration_time
    # a lag as long as the latency: the transfers hold nothing but their bytes' time
    full = _lagged(lag=200e-6)
    assert Simulator(lenet, full).simulate(s).iteration_time <= r1.iteration_time


def test_ops_of_one_kind_share_plans_and_give_what_their_own_plans_give(nmt_small):
    """Unrolled steps of a recurrent layer are one kind (``Context.kind``): they share their
    templates and transfer geometry.  Every plan so shared equals the plan computed for the op
    alone (partitions, times, transfers, priorities), over random configs."""
    from flexflow.sim.plans import Context
    from flexflow.sim.taskkeys import XB, XF, _prio
    machine = Machine.preset("p100-cluster", devices=4)
    cm = CostModel(machine)
    shared = Context(nmt_small, machine, cm)
    alone = Context(nmt_small, machine, cm)
    alone.kind = list(range(len(alone.ops)))  # every op its own kind: nothing shared
    ops = nmt_small.ops
    assert len(set(k for k in shared.kind if k >= 0)) < len(shared.compute) / 2  # the steps do share
    rng = random.Random(0)
    for o in shared.compute:
        cs = candidate_configs(ops[o], machine)
        for cfg in rng.sample(cs, min(3, len(cs))):
            a, b = shared.template(o, cfg), alone.template(o, cfg)
            assert (a.devs, a.fwd, a.bwd, a.busy.tolist()) == (b.devs, b.fwd, b.bwd, b.busy.tolist())
            for j in shared.ext_inputs[o]:
                u = shared.inputs[o][j]
                cu = rng.choice(candidate_configs(ops[u], machine))
                for x, y in [(shared.edge_plan(u, o, j, cu, cfg), alone.edge_plan(u, o, j, cu, cfg))]:
                    assert x.xq == y.xq and x.xk == y.xk and x.direct == y.direct and x.identity == y.identity
                    assert x.fcols == y.fcols and x.bcols == y.bcols and x.comm == y.comm
                    assert x.recv.tolist() == y.recv.tolist() and x.busy.tolist() == y.busy.tolist()
                    # the priorities are the consumer's own (op o, input j, partitions k and q)
                    assert x.fcols[3] == [_prio(o, XF, j, k, q) for q, k in zip(x.xq, x.xk)]
                    assert x.bcols[3] == [_prio(o, XB, j, k, q) for q, k in zip(x.xq, x.xk)]
    # equal kinds mean equal partitions
    by_kind = {}
    for o in shared.compute:
        by_kind.setdefault(shared.kind[o], []).append(o)
    for members in by_kind.values():
        for cfg in candidate_configs(ops[members[0]], machine)[:4]:
            want = [(p.device, p.output, p.inputs, p.params) for p in partitions(ops[members[0]], cfg)]
            for o in members[1:]:
                assert [(p.device, p.output, p.inputs, p.params) for p in partitions(ops[o], cfg)] == want


def test_ready_queue_dequeues_in_ready_priority_id_order():
    """The compiled scheduler's bucket queue against a plain heap over (ready, priority, id),
    on random task graphs full of ties: zero and equal durations, equal and repeated
    priorities, tasks on several resources, a delta run from the middle."""
    import heapq
    from types import SimpleNamespace
    from flexflow.sim.schedarrays import TaskArrays
    from flexflow.sim.taskkeys import TID_BITS

    def reference(tg, R):
        n = len(tg.DUR)
        cnt = [len(p) for p in tg.PRED]
        succ = [[] for _ in range(n)]
        for t, ps in enumerate(tg.PRED):
            for p in ps:
                succ[p].append(t)
        ready, fin, free, log = [0] * n, [0] * n, [0] * R, []
        q = [(0, tg.KP[t] >> TID_BITS, t) for t in range(n) if not cnt[t]]
        heapq.heapify(q)
        while q:
            r, _, t = heapq.heappop(q)
            res = [tg.RES1[t]] if tg.RES1[t] >= 0 else list(tg.RESM[t])
            s = max([r] + [free[x] for x in res])
            fin[t] = s + tg.DUR[t]
            for x in res:
                free[x] = fin[t]
            log.append(t)
            for c in succ[t]:
                ready[c] = max(ready[c], fin[t])
                cnt[c] -= 1
                if not cnt[c]:
                    heapq.heappush(q, (ready[c], tg.KP[c] >> TID_BITS, c))
        return log, fin

    for seed in range(40):
        rng = random.Random(seed)
        n, R = rng.randrange(5, 400), rng.randrange(1, 6)
        dur = [rng.choice([0, 0, 1, 2, 5, 5, 5]) for _ in range(n)]
        res1, resm = [], []
        for _ in range(n):
            k = rng.choice([1, 1, 1, 2, 3])
            rs = rng.sample(range(R), min(k, R))
            res1.append(rs[0] if len(rs) == 1 else -1)
            resm.append(None if len(rs) == 1 else tuple(rs))
        pred = [tuple(rng.sample(range(t), min(t, rng.choice([0, 1, 1, 2, 3])))) for t in range(n)]
        prio = [rng.randrange(4) for _ in range(n)]  # many equal priorities: the id decides
        tg = SimpleNamespace(DUR=dur, RES1=res1, RESM=resm, PRED=pred, ALIVE=[True] * n,
                             KP=[p << TID_BITS | t for t, p in enumerate(prio)])
        a = TaskArrays(R)
        a.load(tg)
        assert a.run_full()
        log, fin = reference(tg, R)
        assert a.log().tolist() == log and a.FIN.tolist() == fin
        # a delta run after changing one task's duration gives the full run's order too
        t = rng.randrange(n)
        tg.DUR[t] += 3
        a.update(tg, set(), set(), ([t], [tg.DUR[t]], [res1[t]], [resm[t]], [prio[t]]))
        a.run_delta([], [t], [])
        log, fin = reference(tg, R)
        assert a.log().tolist() == log and a.FIN.tolist() == fin


def test_picking_h_or_c_out_of_a_cell_takes_no_time():
    """An unrolled LSTM's ``h, c = cell(x, (h, c))`` traces as index ops on the cell's
    stacked (h, c); the executor hands the part on and runs nothing
    (``ops.picks_stacked_part``), so the simulator gives those ops no time, while an
    index op on a plain tensor (the embedding's ``x[:, t]``) keeps its time."""
    module, inputs = ff.models.get("rnnlm", batch_size=8, size="small", seed=0)
    g = ff.trace(module, inputs)
    m = Machine.preset("cpu", devices=2)
    sim = Simulator(g, m)
    ctx = sim.ctx
    free = [o for o, f in enumerate(ctx.free) if f]
    assert free
    for o in free:
        op = ctx.ops[o]
        assert op.rule == "index" and g.op(op.inputs[0]).attrs.get("stacked")
    plain = [o for o in ctx.compute if ctx.ops[o].rule == "index" and not ctx.free[o]]
    assert plain  # x[:, t] of the embedding's output
    one = ParallelConfig({}, (0,))
    assert all(x == 1 for o in free for x in ctx.template(o, one).fwd + ctx.template(o, one).bwd)
    assert all(x > 1 for o in plain for x in ctx.template(o, one).fwd)


class _WithLoss(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.body(x), y)


def test_the_optimizer_update_moves_what_torch_s_passes_move():
    """The update is memory bound at the bytes torch's optimizer moves per parameter byte
    (UPDATE_TRAFFIC: SGD 3, momentum 8, Adam 18): the steps differ by exactly that much."""
    from flexflow.sim.memory import UPDATE_TRAFFIC
    module = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 8))
    x, y = torch.randn(8, 4096), torch.randint(0, 8, (8,))
    graph = ff.trace(_WithLoss(module), (x, y))
    m = ff.Machine.preset("h200-node", devices=1)
    dp = ff.Strategy.data_parallel(graph, m)
    t = {o: ff.Simulator(graph, m, optimizer=o).simulate(dp).iteration_time for o in UPDATE_TRAFFIC}
    nbytes = 4 * sum(p.numel() for p in module.parameters())
    for o in ("momentum", "adam"):
        want = (UPDATE_TRAFFIC[o] - UPDATE_TRAFFIC["sgd"]) * nbytes / m.spec.mem_bw_Bps
        assert t[o] - t["sgd"] == pytest.approx(want, rel=1e-3), o


@pytest.mark.slow
def test_more_than_a_thousand_devices_simulate():
    """Partition indices have 15 bits in the task keys: clusters of up to 32,767 devices
    (Llama 3 trained on 16,384) simulate; data parallelism of an MLP on 1,030 devices."""
    import torch.nn as nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.fc2(self.fc1(x).relu()), y)

    n = 1030
    graph = ff.trace(MLP(), (torch.randn(2 * n, 16), torch.randint(0, 4, (2 * n,))))
    machine = ff.Machine.preset("h100-cluster", devices=n)
    r = ff.Simulator(graph, machine).simulate(ff.Strategy.data_parallel(graph, machine), incremental=False)
    assert len(r.peak_memory) == n and r.iteration_time > 0 and r.sync_bytes > 0
