"""Operator profiler and cost model: cache hits, concurrent processes, corrupt cache
recovery, analytic FLOP counts against hand counts, measured times that grow with the
shape, distinct ops listed once, measured-vs-analytic sources, package fallback."""
import dataclasses
import json
import math
import multiprocessing as mp

import pytest
import torch
import torch.nn as nn

import flexflow as ff
from flexflow.cost import profile as prof
from flexflow.cost import profiledb
from flexflow.cost.model import CostModel, fit_efficiency, fit_rules, partition_flops
from flexflow.strategy.localrun import whole_config
from flexflow.cost.profile import ProfileDB, device_kind_of, device_name, key_str, profile_graph
from flexflow.strategy.regions import partitions


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXFLOW_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _small(name, batch=None):
    module, inputs = ff.models.get(name, size="small", batch_size=batch)
    return ff.trace(module, inputs)


def _whole(op):
    return partitions(op, whole_config(op))[0]


def _op(graph, kind):
    return next(op for op in graph.ops if op.kind == kind)


def _cache_file(cache):
    return cache / "profiles" / f"{device_name('cpu')}.json"


# ---- cache ---------------------------------------------------------------------------------
def test_second_profile_hits_cache(cache):
    g = _small("lenet")
    r1 = profile_graph(g, repeats=2)
    assert r1.measured == len(r1.ops) > 0 and r1.cached == 0 and r1.errors == 0
    assert _cache_file(cache).exists()
    r2 = profile_graph(g, repeats=2)
    assert r2.measured == 0 and r2.cached == len(r1.ops)
    assert all(e["cached"] for e in r2.ops)
    assert [e["forward_ms"] for e in r2.ops] == pytest.approx([e["forward_ms"] for e in r1.ops])
    d = r2.to_dict()
    json.dumps(d)
    assert d["measured"] == 0 and d["device_kind"] == "cpu"


def _child(batch, queue):
    torch.set_num_threads(1)  # both children: one cache file (cpu-...-1t), little contention
    r = profile_graph(_small("lenet", batch), repeats=2)
    queue.put((sorted(e["key"] for e in r.ops), r.path))


@pytest.mark.slow
def test_two_processes_share_one_cache(cache):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(b, q)) for b in (4, 6)]
    for p in procs:
        p.start()
    (keys_a, path_a), (keys_b, path_b) = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert path_a == path_b and path_a.startswith(str(cache))
    assert set(keys_a) != set(keys_b)
    on_disk = json.loads(open(path_a).read())["entries"]
    assert set(on_disk) == set(keys_a) | set(keys_b)
    db = ProfileDB.load("cpu-shared", path_a)
    assert profile_graph(_small("lenet", 6), repeats=2, db=db).measured == 0


def test_corrupt_cache_is_rebuilt_with_warning(cache):
    path = _cache_file(cache)
    path.parent.mkdir(parents=True)
    path.write_text('{"format": "flexflow-profile", "entries": {tru')
    g = _small("lenet")
    with pytest.warns(UserWarning, match="corrupt"):
        r = profile_graph(g, repeats=2)
    assert r.measured == len(r.ops) and r.errors == 0
    assert len(json.loads(path.read_text())["entries"]) == len(r.ops)
    path.write_text("[1, 2, 3]")
    with pytest.warns(UserWarning, match="corrupt"):
        db = ProfileDB.load(device_name("cpu"))
    assert len(db) == 0


def test_db_record_lookup_save_roundtrip(tmp_path):
    db = ProfileDB.load("cpu-test", tmp_path / "p.json")
    key = ("relu", "pointwise", "torch.float32", (2, 3), ((2, 3),), (), (), ("float32",))
    db.record(key, 1e-5, 2e-5, {"rule": "pointwise", "flops": 6.0, "dtype": "float32"})
    db.save()
    db2 = ProfileDB.load("cpu-test", tmp_path / "p.json")
    assert db2.device_kind == "cpu"
    assert db2.lookup("cpu", key) == (1e-5, 2e-5)
    assert db2.lookup("H200", key) is None
    assert db2.lookup("cpu", key[:-1]) is None


# ---- FLOP counts ---------------------------------------------------------------------------
class _Mods(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, stride=2)
        self.gconv = nn.Conv2d(8, 12, 3, padding=1, groups=4)
        self.fc = nn.Linear(20, 30)
        self.cell = nn.LSTMCell(10, 16)
        self.cell0 = nn.LSTMCell(10, 16)

    def forward(self, img, x, a, b, s, h, c):
        y = self.gconv(self.conv(img)).sum()
        y = y + self.fc(x).sum() + torch.matmul(a, b).sum()
        h2, c2 = self.cell(s, (h, c))
        h3, c3 = self.cell0(s)
        return y + h2.sum() + c2.sum() + h3.sum() + c3.sum()


def test_analytic_flops_equal_hand_counts():
    inputs = (torch.randn(2, 3, 10, 10), torch.randn(5, 20), torch.randn(2, 3, 4, 5),
              torch.randn(2, 3, 5, 6), torch.randn(4, 10), torch.randn(4, 16), torch.randn(4, 16))
    g = ff.trace(_Mods(), inputs)
    flops = {op.name: partition_flops(op, _whole(op)) for op in g.ops if not op.everywhere}
    macs = {"conv": 2 * 8 * 5 * 5 * (3 * 3 * 3),        # out N*C*H*W x (Cin * kh * kw)
            "gconv": 2 * 12 * 5 * 5 * (2 * 3 * 3),      # groups=4: Cin/groups = 2 per output
            "fc": 5 * 30 * 20,
            "matmul": 2 * 3 * 4 * 6 * 5}
    for name, m in macs.items():
        assert flops[name] == 2 * m, name
    # LSTM cell: 4 gates x H units x (I + H) MACs per sample, plus 12 element-wise per unit
    assert flops["cell"] == 2 * 4 * 4 * 16 * (10 + 16) + 12 * 4 * 16
    # without a state the h @ W_hh product is not computed
    assert flops["cell0"] == 2 * 4 * 4 * 16 * 10 + 12 * 4 * 16
    # partitions of a split op add up to the whole op
    fc = g.op("fc")
    parts = partitions(fc, ff.ParallelConfig({"n": 1, "c": 3}, (0, 1, 2)))
    assert sum(partition_flops(fc, p) for p in parts) == flops["fc"]


# ---- measurements --------------------------------------------------------------------------
class _Sizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.Linear(256, 256)
        self.big = nn.Linear(1024, 1024)
        self.c8 = nn.Conv2d(8, 8, 3, padding=1)
        self.c64 = nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x, y, a, b):
        return (self.small(x).sum() + self.big(y).sum() + self.c8(a).sum() + self.c64(b).sum())


def test_measured_times_positive_and_grow_with_shape(tmp_path):
    inputs = (torch.randn(64, 256), torch.randn(64, 1024), torch.randn(4, 8, 32, 32),
              torch.randn(4, 64, 32, 32))
    g = ff.trace(_Sizes(), inputs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: no barrier stalls when the host is oversubscribed
    try:
        for attempt in range(3):  # a busy shared host can stall one measurement: measure afresh
            db = ProfileDB(f"cpu-try{attempt}", "cpu", tmp_path / f"try{attempt}.json")
            r = profile_graph(g, repeats=5, db=db, save=False)
            by = {e["op"]: e for e in r.ops}
            assert r.errors == 0 and r.measured == len(r.ops)
            assert all(e["forward_ms"] > 0 and e["backward_ms"] > 0 for e in r.ops)
            if all(by[a][f] < by[b][f] for a, b in (("small", "big"), ("c8", "c64"))
                   for f in ("forward_ms", "backward_ms")):
                break
        else:
            pytest.fail(f"times do not grow with the shape: {[(e['op'], e['forward_ms']) for e in r.ops]}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_inception_lists_every_distinct_op_once():
    g = _small("inception_v3")
    r = profile_graph(g, repeats=1)
    assert r.errors == 0
    keys = [e["key"] for e in r.ops]
    assert len(keys) == len(set(keys))
    names = [n for e in r.ops for n in e["ops"]]
    assert sorted(names) == sorted(op.name for op in g.compute_ops)
    km = CostModel(None)
    expected = {key_str(km.key(op, _whole(op))) for op in g.compute_ops}
    assert set(keys) == expected
    relu = [e for e in r.ops if e["kind"] == "relu"]
    assert sum(len(e["ops"]) for e in relu) == sum(op.kind == "relu" for op in g.ops) > len(relu)


@pytest.mark.parametrize("name", ["rnnlm", "nmt", "transformer"])
def test_integer_inputs_are_valid_indices(name):
    r = profile_graph(_small(name), repeats=1)
    assert r.errors == 0 and r.measured == len(r.ops)


class _InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.nn.functional.relu(self.fc(x), inplace=True)
        y.add_(1.0)
        return y.sum()


def test_in_place_ops_and_op_filter():
    g = ff.trace(_InPlace(), (torch.randn(4, 8),))
    r = profile_graph(g, repeats=2, ops=["relu", "add_"])
    assert r.errors == 0 and sorted(e["op"] for e in r.ops) == ["add_", "relu"]


def test_strategy_profiles_its_partitions():
    g = _small("lenet")
    machine = ff.Machine.preset("cpu", devices=2)
    s = ff.Strategy.data_parallel(g, machine)
    r = profile_graph(g, strategy=s, repeats=1)
    km = CostModel(None)
    want = {key_str(km.key(op, p)) for op in g.compute_ops for p in partitions(op, s[op.name])}
    assert {e["key"] for e in r.ops} == want
    conv = next(e for e in r.ops if e["kind"] == "conv2d")
    assert conv["output_shape"][0] == 4 and conv["count"] == 2  # batch 8 split in two


# ---- cost model ----------------------------------------------------------------------------
def test_cost_model_measured_where_profiled_else_analytic():
    g = _small("lenet")
    r = profile_graph(g, repeats=2)
    db = ProfileDB.load(device_name("cpu"))
    machine = ff.Machine.preset("cpu", devices=2)
    cm = CostModel(machine, profile=db)
    fc = g.op("fc1")
    whole = _whole(fc)
    assert cm.source(fc, whole, 0) == "measured"
    entry = next(e for e in r.ops if e["op"] == "fc1")
    assert cm.op_time(fc, whole, 1) == pytest.approx((entry["forward_ms"] / 1e3, entry["backward_ms"] / 1e3))
    split = partitions(fc, ff.ParallelConfig({"n": 1, "c": 2}, (0, 1)))[0]
    assert cm.source(fc, split, 0) == "analytic"
    assert cm.op_time(fc, split, 0) == cm.analytic(fc, split, machine.spec)
    # another device kind never uses the cpu measurements
    gpu = CostModel(ff.Machine.preset("h200-node"), profile=db)
    assert gpu.source(fc, whole, 0) == "analytic"
    # for_machine finds this host's profile and fits efficiencies to it
    fm = CostModel.for_machine(machine)
    assert fm.source(fc, whole, 0) == "measured"
    assert fm.efficiency["conv"] != CostModel(machine).efficiency["conv"]
    assert CostModel.for_machine(ff.Machine.preset("p100-cluster")).profile is None


def test_fit_efficiency_median_and_clip():
    spec = ff.Machine.preset("cpu").spec
    peak, oh = spec.flops("float32"), spec.launch_overhead_s
    entries = [{"rule": "linear", "dtype": "float32", "flops": peak * t, "fwd_s": oh + t / eff}
               for t, eff in ((1e-3, 0.2), (2e-3, 0.3), (1e-3, 0.4))]
    entries += [{"rule": "conv", "dtype": "float32", "flops": peak, "fwd_s": oh + 0.1},     # 10 > 1
                {"rule": "relu", "dtype": "float32", "flops": 0.0, "fwd_s": 1e-3}]        # no FLOPs
    eff = fit_efficiency(entries, spec)
    assert eff["linear"] == pytest.approx(0.3)
    assert eff["conv"] == 1.0
    assert "relu" not in eff


def test_fit_rules_recovers_synthetic_parameters():
    spec = ff.Machine.preset("cpu").spec
    peak = spec.flops("float32")
    entries = []
    for i, flops in enumerate([1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8, 1e9]):
        work = flops / (peak * 0.4)
        entries.append({"rule": "linear", "kind": "linear", "dtype": "float32", "flops": flops, "bytes": 0.0,
                        "backward_factor": 2.0, "fwd_s": work + 20e-6, "bwd_s": 2.0 * 1.5 * work + 30e-6})
    f = fit_rules(entries, spec)["linear"]
    assert f.efficiency == pytest.approx(0.4, rel=0.06)
    assert f.overhead_fwd_s == pytest.approx(20e-6, abs=2e-6)
    assert f.backward_scale == pytest.approx(1.5, rel=0.06)
    assert f.overhead_bwd_s == pytest.approx(30e-6, abs=3e-6)
    assert "kind:linear" in fit_rules(entries, spec) and "kind:linear" not in fit_rules(entries[:3], spec)
    # the cost model predicts with the fit
    g = ff.trace(nn.Linear(64, 32), (torch.randn(16, 64),))
    op = next(o for o in g.ops if o.kind == "linear")
    work = partition_flops(op, _whole(op)) / (peak * f.efficiency)
    fwd, bwd = CostModel(ff.Machine.preset("cpu"), fits={"linear": f}).analytic(op, _whole(op), spec)
    assert fwd == pytest.approx(max(work, 0) + f.overhead_fwd_s, rel=0.2)
    assert bwd == pytest.approx(2 * f.backward_scale * work + f.overhead_bwd_s, rel=0.2)


def test_package_profile_is_a_read_only_fallback(tmp_path, monkeypatch):
    g = _small("lenet")
    fc = g.op("fc1")
    key = CostModel(None).key(fc, _whole(fc))
    monkeypatch.setattr(profiledb, "_PKG_DATA", tmp_path / "data")
    pkg = prof.package_profile_path("H200")
    db = ProfileDB("cuda-NVIDIA_H200", "H200", pkg)
    db.record(key, 3e-6, 6e-6, {"rule": "linear", "dtype": "float32", "flops": 2e5})
    db.save()
    cm = CostModel.for_machine(ff.Machine.preset("h200-node"))
    assert cm.source(fc, _whole(fc), 3) == "measured"
    assert cm.op_time(fc, _whole(fc), 3) == (3e-6, 6e-6)
    assert cm.profile.read_only
    with pytest.raises(RuntimeError, match="read-only"):
        cm.profile.save()


def test_device_kinds():
    assert device_kind_of("cpu") == "cpu" == ff.Machine.preset("cpu").spec.kind
    assert device_name("cpu").startswith("cpu-") and device_name("cpu").endswith(f"-{torch.get_num_threads()}t")
    assert profiledb._gpu_kind("NVIDIA H200") == "H200" and profiledb._kind_from_name("cuda-NVIDIA_H200") == "H200"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device here"):
            device_kind_of("cuda")
        with pytest.raises(RuntimeError, match="no CUDA device here"):
            profile_graph(_small("lenet"), device="cuda")


# ---- profiling before a search (parallelize) -----------------------------------------------
def test_host_cost_model_profiles_what_the_search_may_choose(cache):
    from flexflow.api import host_cost_model
    from flexflow.strategy.candidates import candidate_configs
    g = _small("lenet")
    machine = ff.Machine.preset("cpu", devices=2)
    cm, rep = host_cost_model(g, machine, "cpu", seconds=math.inf)  # (no time limit: the host's speed does not matter)
    assert rep is not None and rep.measured > 0 and rep.skipped == 0 and rep.errors == 0
    # data parallelism, everything on one device and every candidate config are measured
    for op in g.compute_ops:
        for cfg in [ff.Strategy.data_parallel(g, machine)[op.name], *candidate_configs(op, machine)]:
            for part in partitions(op, cfg):
                assert cm.source(op, part, part.device) == "measured", (op.name, cfg)
    cm2, rep2 = host_cost_model(g, machine, "cpu", seconds=math.inf)  # all cached now
    assert rep2.measured == 0 and rep2.cached > 0
    # another device kind: nothing measured here, no report
    _, none = host_cost_model(g, ff.Machine.preset("p100-cluster"), "cpu", seconds=math.inf)
    assert none is None


def test_a_mixed_precision_profile_is_what_a_mixed_precision_simulator_reads(cache):
    """Profiled under "bf16-mixed", the ops are timed in the dtypes autocast gives them, under
    the keys the simulator of that precision looks up; a float32 profile does not serve it."""
    from flexflow.api import host_cost_model
    from flexflow.cost.precision import priced_cost_model, priced_ops, precision
    g = _small("transformer")
    machine = ff.Machine.preset("cpu", devices=2)
    dp = ff.Strategy.data_parallel(g, machine)
    priced = dict(zip((o.name for o in g.ops), priced_ops(g, precision("bf16-mixed"))))
    matmuls = [op for op in g.compute_ops if priced[op.name].dtype == torch.bfloat16]
    assert matmuls  # the run changes some dtypes, or the test shows nothing

    def sources(cm):
        pcm = priced_cost_model(cm, "bf16-mixed", g)
        return {pcm.source(op, part, part.device) for op in matmuls for part in partitions(op, dp[op.name])}

    cm32, rep32 = host_cost_model(g, machine, "cpu", seconds=math.inf)
    assert rep32.errors == 0 and sources(cm32) == {"analytic"}
    cm16, rep16 = host_cost_model(g, machine, "cpu", seconds=math.inf, precision="bf16-mixed")
    assert rep16.measured > 0 and rep16.errors == 0 and sources(cm16) == {"measured"}
    assert {e["dtype"] for e in rep16.ops} >= {"bfloat16", "float32"}  # the loss stays in float32
    with pytest.raises(ValueError, match="precision"):
        profile_graph(g, precision="bf17")


def test_host_cost_model_stops_at_its_time(cache):
    from flexflow.api import host_cost_model
    g = _small("inception_v3")
    machine = ff.Machine.preset("cpu", devices=2)
    cm, rep = host_cost_model(g, machine, "cpu", seconds=1e-9)
    assert rep.measured <= 1 and rep.skipped > 0
    assert "skipped (out of time)" in rep.table()
    assert any(e.get("skipped") for e in rep.ops)


def test_cost_key_follows_input_gradients_set_after_the_first_key():
    """An op's own part of the cost key is kept per op, but not across a change of
    which inputs get gradients (OpGraph sets that after building the op)."""
    import dataclasses
    g = ff.trace(*ff.models.get("alexnet", size="small", device="meta"))
    conv = g.op("conv1")
    assert not conv.input_needs_grad(0)  # the image batch
    cm = CostModel(ff.Machine.preset("cpu", devices=1))
    part = partitions(conv, whole_config(conv))[0]
    lone = dataclasses.replace(conv, input_grads=None)  # every floating input needs a gradient
    k_lone = cm.key(lone, part)
    assert k_lone != cm.key(conv, part)
    lone.input_grads = conv.input_grads
    assert cm.key(lone, part) == cm.key(conv, part)


def test_ops_alike_share_candidate_configs():
    from flexflow.strategy.candidates import _CANDIDATES, candidate_configs
    g = ff.trace(*ff.models.get("rnnlm", size="small", device="meta"))
    m = ff.Machine.preset("cpu", devices=4)
    cells = [op for op in g.compute_ops if op.name.startswith("cells_")]
    first = candidate_configs(cells[0], m)
    for op in cells[1:]:
        assert candidate_configs(op, m) is first
    _CANDIDATES.clear()  # computed afresh: the same configs
    fresh = candidate_configs(dataclasses.replace(cells[-1]), m)  # (a new op: no cache of its own)
    assert fresh == first and fresh is not first


# ---- what an entry stands for ----------------------------------------------------------------
def test_cpu_timer_counts_the_threads_own_time_only(monkeypatch):
    """With one torch thread a CPU op is timed by the thread's CPU time: time the core
    spends on other jobs (here: the wall clock moving while the thread's CPU time does
    not) is not counted; with several threads, by the wall clock (the workers' time is not
    on this thread).  Clocks that move only when told to."""
    import types
    clocks = {"thread": 10.0, "wall": 1000.0}
    monkeypatch.setattr(prof, "time", types.SimpleNamespace(thread_time=lambda: clocks["thread"],
                                                            perf_counter=lambda: clocks["wall"]))
    threads = torch.get_num_threads()
    try:
        for n, counted in ((1, 0.002), (2, 0.05)):
            torch.set_num_threads(n)
            timer = prof._Timer(torch.device("cpu"))
            t0 = timer.start()
            clocks["wall"] += 0.05  # 50 ms pass, of which the thread ran 2 ms
            clocks["thread"] += 0.002
            assert timer.stop(t0) == pytest.approx(counted), n
    finally:
        torch.set_num_threads(threads)


def test_backward_entries_leave_out_the_engine_call(cache, monkeypatch):
    """A profiled backward is one autograd engine call per op; a step's backward is one
    call in all: each entry's backward has the call's fixed cost taken off (recorded as
    bwd_call_s), never below a fifth of what was measured."""
    monkeypatch.setattr(prof, "_engine_call_s", lambda dev, timer: 30e-6)
    times = iter([(1e-4, 2e-4, 5), (1e-5, 3e-5, 5)] * 50)
    monkeypatch.setattr(prof, "profile_partitions", lambda items, *a, **k: [next(times) for _ in items])
    g = _small("lenet")
    r = profile_graph(g, repeats=2)
    entries = json.loads(_cache_file(cache).read_text())["entries"].values()
    assert len(entries) == len(r.ops) >= 2
    for e in entries:
        raw = e["bwd_s"] + e["bwd_call_s"]
        assert raw in (pytest.approx(2e-4), pytest.approx(3e-5))
        assert e["bwd_s"] == pytest.approx(max(raw - 30e-6, 0.2 * raw))
    bwd = {round(e["bwd_s"], 9) for e in entries}
    assert bwd == {1.7e-4, 6e-6}  # 200 us less the call; 30 us kept at a fifth
    assert sorted({round(e["backward_ms"], 6) for e in r.ops}) == [0.006, 0.17]


class _ScriptedTimer:
    """A timer whose measurements are the values given, in order."""

    def __init__(self, values):
        self.values = iter(values)

    def start(self):
        return 0.0

    def stop(self, t0):
        return next(self.values)

    def flush(self):
        pass

    @staticmethod
    def read(t):
        return t


class _PendingTimer:
    """A GPU-like timer: ``stop`` gives a pending time, readable only after a ``flush``
    that came later (the device's queue drained); the times are 1 ms each."""

    def __init__(self, dev=None):
        self.flushes, self.stops = 0, 0

    def start(self):
        return None

    def stop(self, t0):
        self.stops += 1
        return ("pending", self.flushes)

    def flush(self):
        self.flushes += 1

    def read(self, t):
        if isinstance(t, tuple):
            assert t[1] < self.flushes, "a pending time read before the device was waited for"
            return 1e-3
        return t


def test_gpu_times_are_read_once_per_round_after_the_device_is_waited_for(monkeypatch):
    """On a GPU no op waits for the one before (each op's time is what it adds to a stream of
    ops): the profiler waits once per round, then reads the round's times."""
    timers = []
    monkeypatch.setattr(prof, "_Timer", lambda dev: timers.append(_PendingTimer()) or timers[-1])
    g = _small("lenet")
    items = [(op, _whole(op)) for op in g.compute_ops[:3]]
    got = prof.profile_partitions(items, "cpu", repeats=3, warmup=1)
    assert all(f == pytest.approx(1e-3) and n == 3 for f, _, n in got)
    t = timers[0]
    assert 2 <= t.flushes < t.stops  # one wait per round, not per op


def test_engine_call_cost_is_the_one_node_backward_less_a_node():
    """The engine call's fixed cost: the median one-node backward less the cost per node
    (the 11-node chain's extra over the one-node, per extra node), never negative; after
    one warm-up round."""
    cpu = torch.device("cpu")
    warm, one, eleven = [1.0] * 3, [50e-6, 49e-6, 51e-6], [150e-6, 151e-6, 149e-6]
    assert prof._engine_call_s(cpu, _ScriptedTimer(warm + one + eleven), runs=3) == pytest.approx(40e-6)
    # no cost per node to take off (the long chain no slower): the one-node time
    assert prof._engine_call_s(cpu, _ScriptedTimer(warm + one + one), runs=3) == pytest.approx(50e-6)
    # nodes dearer than the whole one-node call: none left for the call
    assert prof._engine_call_s(cpu, _ScriptedTimer(warm + one + [2e-3] * 3), runs=3) == 0.0
    real = prof._engine_call_s(cpu, prof._Timer(cpu))  # measured: a cost, not a failure
    assert math.isfinite(real) and real >= 0.0


def test_older_cache_format_is_measured_again(cache):
    path = _cache_file(cache)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": "flexflow-profile", "version": 1, "device_name": "x",
                                "entries": {"k": {"fwd_s": 1.0, "bwd_s": 1.0}}}))
    with pytest.warns(UserWarning, match="older flexflow"):
        r = profile_graph(_small("lenet"), repeats=2)
    assert r.measured == len(r.ops) and r.cached == 0
    d = json.loads(path.read_text())
    assert d["version"] == profiledb.VERSION and "k" not in d["entries"]


def test_partitions_are_measured_round_robin_in_the_order_given(monkeypatch):
    """profile_partitions runs one run of each partition per round, in the order given, until
    each has its warm-up and ``repeats`` counted runs; a partition that fails is reported
    by its exception and the others go on."""
    g = _small("lenet")
    ops = [op for op in g.compute_ops][:3]
    items = [(op, prof.partitions(op, prof.ParallelConfig({}, (0,)))[0]) for op in ops]
    calls = []
    fail = ops[1].name

    def once(self, timer):
        calls.append(self.op.name)
        if self.op.name == fail and len([c for c in calls if c == fail]) == 2:
            raise ValueError("boom")
        return (0.02, 0.03)  # slow enough for one warm-up only
    monkeypatch.setattr(prof._Run, "once", once)
    got = prof.profile_partitions(items, repeats=3, warmup=1)
    names = [op.name for op in ops]
    assert calls[:3] == names and calls[3:6] == names  # round-robin
    assert calls[6:] == [names[0], names[2]] * 2  # the failed one dropped
    assert got[0] == (0.02, 0.03, 3) and got[2] == (0.02, 0.03, 3)
    assert isinstance(got[1], ValueError)


def test_gpu_validate_dry_run_on_the_cpu(tmp_path):
    """benchmarks/gpu_validate.py end to end on the CPU (its dry run): every stage of a case
    runs, a bad case is reported in the table and does not stop the others."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    env = {**__import__("os").environ, "FLEXFLOW_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_validate.py"), "--device", "cpu",
                        "--cases", "gpt2:nosuchsize:32-true,llama:small:bf16-mixed:4:16:rc",
                        "--steps", "1", "--warmup", "1", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (tmp_path / "gpu_validate-cpu.md").read_text()
    assert "gpt2 nosuchsize 32-true, case: `ValueError: unknown size 'nosuchsize'" in md
    row = json.loads((tmp_path / "gpu_validate-cpu.json").read_text())["rows"][1]
    assert row["errors"] == {} and row["recompute"] and row["batch"] == 4
    for k in ("analytic", "profiled", "flexflow", "plain"):
        assert row[k]["step_ms"] > 0, k
    assert row["profile"]["measured"] > 0 and {x["rule"] for x in row["rules"]} >= {"linear", "attention"}
    assert (tmp_path / "profile-cpu.json").exists()
