"""Models as people write them (tests/_corpus.py): where the batch is, and that every
plan trains as one process does.

Pure part: the batch dim each model's trace finds, and under data parallelism no op
whole on one device except where ``graph.whole_reasons`` says why.  Distributed part:
data parallelism and three random strategies on 2 gloo processes against the plain
module in one process (float32, 1e-5), losses and every parameter after 3 SGD steps.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
import torch

import _dist_workers as W
import flexflow as ff
from _corpus import CORPUS
from flexflow.graph.batchflow import BatchDimError
from flexflow.launch import launch
from flexflow.models._common import make_inputs
from flexflow.strategy.regions import partitions

TOL = 1e-5
BATCH = 4


@contextlib.contextmanager
def _as_leaves(*types):
    """Trace modules of ``types`` as leaves (opaque ops), as the tracer takes a module it does
    not know."""
    import flexflow.graph.trace as tr
    leaf = tr._Tracer.is_leaf_module
    tr._Tracer.is_leaf_module = lambda self, m, q: isinstance(m, types) or leaf(self, m, q)
    try:
        yield
    finally:
        tr._Tracer.is_leaf_module = leaf


def _build(name, batch=BATCH):
    torch.manual_seed(0)
    module = CORPUS[name]()
    return module, make_inputs(module.input_specs(batch), seed=0, device="cpu", dtype=torch.float32)


# the ops that may run whole under data parallelism, and the words of the reason
EXPECTED_WHOLE = {
    "seqfirst_encoder": {"view": "merges the batch", "view_1": "merges the batch", "cross_entropy": "scalar"},
    "seqfirst_mha": {"add_1": "scalar"},
    "seqfirst_rnns": {"add": "scalar"},
}


@pytest.mark.parametrize("name", sorted(CORPUS))
@pytest.mark.parametrize("devices", [2, 8])
def test_data_parallel_leaves_no_op_whole_without_a_reason(name, devices):
    module, example = _build(name, batch=8)
    graph = ff.trace(module, example)
    assert graph.batch_size == 8
    s = ff.Strategy.data_parallel(graph, ff.Machine.preset("h100-cluster", devices=devices))
    whole = {op.name for op in graph.compute_ops if len(s[op.name].devices) == 1}
    want = EXPECTED_WHOLE.get(name, {})
    assert whole == set(want), (name, sorted(whole))
    for op_name, words in want.items():
        assert words in graph.whole_reasons[op_name], (op_name, graph.whole_reasons.get(op_name))
    for op in graph.compute_ops:  # every split op holds whole samples: its blocks are the batch's
        d = op.sample_dim
        if d is not None and len(s[op.name].devices) > 1:
            parts = partitions(op, s[op.name])
            sizes = {p.block[d.name][1] - p.block[d.name][0] for p in parts}
            assert all(x % d.unit == 0 for x in sizes), op.name


def test_a_flattened_loss_splits_by_samples():
    graph = ff.trace(*_build("nanogpt", batch=8))
    ce = graph.op("cross_entropy")
    flat = graph.op(ce.inputs[0])
    assert flat.output_shape == (8 * 8, 48) and flat.sample_dim.unit == 8
    assert ce.sample_dim is not None and ce.sample_dim.axis is None
    s = ff.Strategy.data_parallel(graph, ff.Machine.preset("h100-node"))
    assert s[ce.name].degrees == {ce.sample_dim.name: 8}
    # device k's rows of the flattened logits are the rows of samples block k
    for p in partitions(flat, s[flat.name]):
        a, b = p.output[0].start, p.output[0].stop
        assert (a, b) == (p.index * 8, (p.index + 1) * 8)
        assert p.inputs[0][0] == slice(p.index, p.index + 1)


def test_sequence_first_inputs_are_found_and_can_be_declared():
    module, example = _build("seqfirst_layer", batch=6)
    graph = ff.trace(module, example)
    assert graph.batch_size == 6
    emb = graph.op("emb")
    assert emb.sample_dim.axis == 1  # (T, B, d): the batch is axis 1
    assert graph.op("layer").sample_dim.axis == 1
    declared = ff.trace(module, example, batch_dim=1)
    assert declared.op("emb").sample_dim.axis == 1
    # declared wrong, the sequence is split as the batch; the encoder layer then runs whole
    wrong = ff.trace(module, example, batch_dim=0)
    assert wrong.batch_size == 8 and wrong.op("layer").sample_dim is None
    with pytest.raises(BatchDimError, match="2 tensor inputs"):
        ff.trace(module, example, batch_dim=[1])
    with pytest.raises(BatchDimError, match="does not index"):
        ff.trace(module, example, batch_dim=[1, 5])


def test_an_opaque_op_splits_only_where_proven():
    class Mixer(torch.nn.Module):  # mixes samples: must run whole
        def forward(self, x):
            return x - x.mean(0, keepdim=True)

    class PerSample(torch.nn.Module):  # independent samples: proven at capture
        def forward(self, x):
            return x * x.sum(1, keepdim=True)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.mix, self.per = torch.nn.Linear(6, 6), Mixer(), PerSample()

        def forward(self, x):
            return self.per(self.mix(self.fc(x))).pow(2).mean()

    with _as_leaves(Mixer, PerSample):  # opaque leaves, as a user's unknown module would be
        graph = ff.trace(M(), (torch.randn(8, 6),))
    assert graph.op("mix").rule == "opaque" and graph.op("mix").sample_dim is None
    assert "does not give that block" in graph.whole_reasons["mix"]
    assert graph.op("per").rule == "opaque" and graph.op("per").sample_dim is not None


@pytest.fixture(scope="module")
def corpus_runs():
    # train mode (dropout off), but the layers model in eval mode: a train-mode BatchNorm split
    # by samples normalises each block by its own statistics, as DDP without SyncBatchNorm
    cases = [(name, BATCH, "eval" if name == "layers" else "train",
              ["data_parallel", "random:0", "random:1", "random:2"], False) for name in sorted(CORPUS)]
    t0 = time.monotonic()
    out = launch(W.suite, 2, cases, timeout_s=240)
    return [r["equivalence"] for r in out], time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_every_plan_trains_as_one_process(corpus_runs, name):
    results, _ = corpus_runs
    recs = [r for r in results[0] if r["model"] == name]
    assert len(recs) == 4
    bad = [f"{r['spec']}: loss err {r['loss_err']:.2e}, {r['worst']} err {r['param_err']:.2e}"
           for r in recs if r["loss_err"] > TOL or r["param_err"] > TOL]
    assert not bad, "\n".join(bad)
    for other in results[1:]:
        for r in recs:
            o = next(x for x in other if x["model"] == name and x["spec"] == r["spec"])
            assert o["losses"] == r["losses"], (name, r["spec"])


def test_a_plan_whose_partitions_compute_other_shapes_is_refused_at_setup(monkeypatch):
    from flexflow.graph.ops import RULES
    from flexflow.strategy.config import StrategyError
    from flexflow.strategy.shapecheck import check_partition_shapes
    module, example = _build("flat_mlp", batch=8)
    graph = ff.trace(module, example)
    s = ff.Strategy.data_parallel(graph, ff.Machine.preset("cpu", devices=2))
    assert check_partition_shapes(graph, s) > 0
    rule = RULES["reshape"]
    real = type(rule).compute
    # a rule that gets a split wrong: the partition of a view computes twice its rows
    monkeypatch.setattr(type(rule), "compute",
                        lambda self, op, block, inputs, params: inputs[0].reshape(-1, op.output_shape[-1]).repeat(2, 1)
                        if op.name == "view" else real(self, op, block, inputs, params))
    t0 = time.perf_counter()
    with pytest.raises(StrategyError, match=r"view \[view\].*computes a \(64, 16\) output where its region is \(32, 16\)"):
        check_partition_shapes(graph, s)
    assert time.perf_counter() - t0 < 10


def test_trace_command_names_the_ops_that_run_whole_and_why(tmp_path, capsys):
    from flexflow.cli import main
    f = tmp_path / "seqfirst.py"
    f.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from _corpus import SeqFirstEncoder\n"
        "from flexflow.models._common import make_inputs\n"
        "def build():\n"
        "    m = SeqFirstEncoder()\n"
        "    return m, make_inputs(m.input_specs(4), seed=0, device='cpu', dtype=torch.float32)\n")
    assert main(["trace", f"{f}:build"]) == 0
    out = capsys.readouterr().out
    assert "batch 4" in out and "ops that cannot split the batch" in out
    assert "view: the reshape merges the batch into a dim after another" in out
    assert main(["trace", f"{f}:build", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert set(js["whole"]) == {"view", "view_1", "cross_entropy"}
    assert main(["trace", f"{f}:build", "--batch-dim", "0"]) == 0  # declared wrong: the sequence
    assert "batch 8" in capsys.readouterr().out
    assert main(["trace", f"{f}:build", "--batch-dim", "1", "7"]) == 2
    assert "does not index its shape" in capsys.readouterr().err


def test_parallelize_takes_batch_dim_in_one_process():
    module, example = _build("seqfirst_layer", batch=4)
    ref = float(module(*example))
    par = ff.parallelize(module, example_inputs=example, batch_dim=1)
    assert par.runtime.graph.op("emb").sample_dim.axis == 1
    assert abs(float(par(*example)) - ref) <= 1e-6 * abs(ref)
    with pytest.raises(BatchDimError, match="does not index"):
        ff.parallelize(module, example_inputs=example, batch_dim=[1, 7])


def test_an_opaque_op_on_the_meta_device_is_checked_with_stand_ins():
    class PerSample(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6))

        def forward(self, x):
            return x * self.w * x.sum(-1, keepdim=True)

    class Mixer(torch.nn.Module):
        def forward(self, x):
            return x - x.mean(0, keepdim=True)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.per, self.mix = torch.nn.Linear(6, 6), PerSample(), Mixer()

        def forward(self, x):
            return self.mix(self.per(self.fc(x))).pow(2).mean()

    with _as_leaves(PerSample, Mixer):
        with torch.device("meta"):
            module = M()
        small = ff.trace(module, (torch.zeros(8, 6, device="meta"),))
        # a batch too large to check whole: checked on a mini-batch of two samples
        big = ff.trace(module, (torch.zeros(1 << 20, 6, device="meta"),))
    for graph in (small, big):
        assert graph.op("per").sample_dim is not None, graph.whole_reasons
        assert graph.op("mix").sample_dim is None and "does not give" in graph.whole_reasons["mix"]


def test_a_negative_batch_dim_counts_from_the_end():
    module, example = _build("seqfirst_layer", batch=6)
    assert ff.trace(module, example, batch_dim=-1).op("emb").sample_dim.axis == 1


@pytest.mark.slow
def test_plans_on_4_ranks_with_collectives_train_as_one_process():
    """On 4 processes a data-parallel layer read whole (nanoGPT's and the sequence-first models'
    data-parallel plans, two random plans) is an all-gather run as one collective: equal to
    one process, and the ranks agree."""
    from flexflow.hardware.machine import Machine
    from flexflow.runtime.plan import Plan
    specs = ["data_parallel", "random:1", "random:3"]
    with_collectives = set()
    for name in sorted(CORPUS):
        module, inputs = W.build(name, BATCH)
        graph = ff.trace(module, inputs)
        for spec in specs:
            s = W.make_strategy(spec, graph, Machine.preset("cpu", devices=4))
            plan = Plan(graph, s, module, list(range(4)), rank=0, world=4)
            with_collectives |= {(name, spec) for ex in plan.exchanges if ex.coll is not None}
    assert {("nanogpt", "data_parallel"), ("seqfirst_mha", "data_parallel"),
            ("seqfirst_rnns", "random:1")} <= with_collectives, with_collectives
    cases = [(name, BATCH, "eval" if name == "layers" else "train", specs, False) for name in sorted(CORPUS)]
    out = launch(W.suite, 4, cases, timeout_s=600)
    first = out[0]["equivalence"]
    bad = [(r["model"], r["spec"], r["loss_err"], r["param_err"]) for r in first
           if r["loss_err"] > TOL or r["param_err"] > TOL]
    assert len(first) == len(cases) * len(specs) and not bad, bad
    assert all(o["losses"] == r["losses"] for res in out[1:] for o, r in zip(res["equivalence"], first))
