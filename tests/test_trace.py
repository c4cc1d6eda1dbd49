"""Tracer: every zoo model traces, op-by-op execution equals the module,
op forms unify, shape reads fold, unknown ops become opaque, errors are clear."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flexflow as ff
from flexflow.strategy.localrun import run_graph


@pytest.mark.parametrize("name", ff.models.names())
def test_zoo_small_op_by_op_matches_module(name):
    module, inputs = ff.models.get(name, size="small", batch_size=5)
    module.eval()  # dropout off; batch norm on running statistics
    graph = ff.trace(module, inputs)
    assert not graph.opaque, f"{name} has opaque ops {graph.opaque}"
    ref = module(*inputs)
    out = run_graph(graph, module, inputs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["resnet101", "rnnlm", "lenet"])
def test_train_mode_op_by_op_matches_module(name):
    module, inputs = ff.models.get(name, size="small", batch_size=4)
    graph = ff.trace(module, inputs)
    ref = module(*inputs)
    out = run_graph(graph, module, inputs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def _count(graph, kind):
    return sum(1 for op in graph.ops if op.kind == kind)


@pytest.mark.slow
def test_paper_sizes_structure():
    g = ff.trace(*ff.models.get("inception_v3", device="meta"))
    assert _count(g, "conv2d") >= 94
    g = ff.trace(*ff.models.get("resnet101", device="meta"))
    assert _count(g, "conv2d") >= 100
    for name, layers in (("rnntc", 4), ("rnnlm", 2), ("nmt", 4)):
        g = ff.trace(*ff.models.get(name, device="meta"))
        cells = [op for op in g.ops if op.kind == "lstm_cell"]
        groups = {}
        for op in cells:
            groups.setdefault(op.group, []).append(op)
        assert len(groups) == layers, name
        for members in groups.values():
            assert len(members) >= 40, name  # one op per time step, one shared config


def test_op_forms_are_one_kind():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(x) + F.relu(x) + torch.relu(x) + x.relu()

    g = ff.trace(M(), (torch.randn(3, 4),))
    assert _count(g, "relu") == 4
    assert {op.rule for op in g.ops if op.kind == "relu"} == {"pointwise"}


def test_shape_reads_fold_to_constants():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            n, t = x.size(0), x.shape[1]
            h = torch.zeros(n, x.shape[-1])
            y = self.fc(x[:, : t - 1]).reshape(n, -1)
            return y.sum() + h.sum()

    x = torch.randn(3, 5, 8)
    m = M()
    g = ff.trace(m, (x,))
    torch.testing.assert_close(run_graph(g, m, (x,)), m(x))


def test_unknown_op_is_opaque_and_runs():
    class M(nn.Module):
        def forward(self, x):
            return torch.cumsum(x, dim=1).mean()

    x = torch.randn(6, 5)
    m = M()
    g = ff.trace(m, (x,))
    assert g.opaque == ["cumsum"]
    op = g.op("cumsum")
    assert op.parallel_dims == {"n": "sample"}
    machine = ff.Machine.preset("p100-cluster", devices=2)
    s = ff.Strategy.data_parallel(g, machine)
    torch.testing.assert_close(run_graph(g, m, (x,), s), m(x))


def test_untraceable_model_gives_clear_error():
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x * 2
            return x

    with pytest.raises(ff.TraceError) as e:
        ff.trace(Branchy(), (torch.randn(2, 2),))
    msg = str(e.value)
    assert "Branchy" in msg and "test_trace.py" in msg and "control flow" in msg


def test_missing_inputs_is_clear():
    with pytest.raises(ValueError, match="example_inputs"):
        ff.trace(nn.Linear(2, 2), None)


def test_shared_module_shares_one_group():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(torch.tanh(self.fc(x))).sum()

    g = ff.trace(M(), (torch.randn(2, 4),))
    fcs = [op for op in g.ops if op.kind == "linear"]
    assert len(fcs) == 2 and fcs[0].group == fcs[1].group
    assert len(g.groups[fcs[0].group]) == 2


def test_op_fields_follow_contract():
    g = ff.trace(*ff.models.get("lenet", size="small"))
    op = g.op("conv1")
    assert op.kind == "conv2d"
    assert op.param_shapes["weight"][0] == op.output_shape[1]
    assert op.parallel_dims == {"n": "sample", "c": "parameter", "h": "attribute", "w": "attribute"}
    assert len(g) == len(g.ops) and g.ops[0].kind == "input"


def test_fused_recurrent_modules_keep_their_parameters():
    """nn.LSTM's nested (out, (h, c)) output is one op that owns the LSTM's
    weights (it was once folded into a constant, dropping them), and every
    trainable parameter of the module is read by some op."""
    import sys, os
    sys.path.insert(0, os.path.dirname(__file__))
    from _dist_workers import build
    module, inputs = build("recurrent", 3)
    graph = ff.trace(module, inputs)
    used = {q for op in graph.ops for q in op.params.values()}
    assert used == {n for n, p in module.named_parameters()}
    lstm = next(op for op in graph.ops if op.kind == "lstm")
    assert set(lstm.params) == {n for n, _ in module.lstm.named_parameters()}
    assert {op.kind for op in graph.ops if "lstm" in op.inputs} == {"unpack"}
    torch.testing.assert_close(run_graph(graph, module, inputs), module(*inputs))
    grads = torch.autograd.grad(run_graph(graph, module, inputs), list(module.lstm.parameters()))
    assert all(g.abs().sum() > 0 for g in grads)
