"""The torch.export front end on models written as libraries write them:
keyword inputs, dict and dataclass outputs, in-place writes, fused attention,
Conv1D-style addmm; its errors; the fx tracer stays first for the zoo."""
import dataclasses
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import flexflow as ff
from flexflow.strategy.localrun import run_graph
from flexflow.graph.trace import TraceError

import _capture_models as C


@pytest.fixture(scope="module")
def kwlm():
    torch.manual_seed(0)
    model = C.KwLM()
    return model, ff.trace(model, (), C.batch())


def test_keyword_inputs_and_dict_output(kwlm):
    model, graph = kwlm
    assert graph.frontend == "export"
    kinds = {op.kind for op in graph.compute_ops}
    assert {"attention", "linear", "embedding", "cross_entropy"} <= kinds
    # Conv1D's view -> addmm -> view is one linear (weight (in, out)) that keeps the batch axis
    conv = [op for op in graph.compute_ops if op.rule == "linear_t"]
    assert len(conv) == 1 and conv[0].output_shape == (4, C.SEQ, 3 * C.DIM)
    assert set(conv[0].parallel_dims) == {"n", "s", "c", "k"}  # k: split by inputs, partial sums
    rms = next(op for op in graph.compute_ops if op.kind == "mul" and op.params)
    assert rms.rule == "pointwise"  # a parameter times an activation is not opaque
    assert isinstance(graph.outputs, dict) and set(graph.outputs) == {"logits", "loss"}
    # the label shift (new_full + a write through a slice) runs whole, and is listed
    assert {graph.op(n).kind for n in graph.opaque} <= {"new_full", "write_into"}


def test_keyword_graph_equals_module_under_random_strategies(kwlm):
    model, graph = kwlm
    ref = model(**C.batch())
    machine = ff.Machine.preset("h200-node", devices=4)
    for seed in range(4):
        out = run_graph(graph, model, graph.flat_inputs((), C.batch()), ff.Strategy.random(graph, machine, seed))
        assert set(out) == set(ref)
        torch.testing.assert_close(out["logits"], ref["logits"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["loss"], ref["loss"], rtol=1e-5, atol=1e-6)


def test_flat_inputs_follow_the_traced_keywords(kwlm):
    _, graph = kwlm
    b = C.batch()
    shuffled = {k: b[k] for k in ("labels", "input_ids", "attention_mask")}
    assert all(x is y for x, y in zip(graph.flat_inputs((), shuffled), graph.flat_inputs((), b)))
    with pytest.raises(TypeError, match="not in example_kwargs"):
        graph.flat_inputs((), dict(b, extra=b["labels"]))


def test_attention_splits_heads_and_rows_causal_rows_too():
    """A causal attention splits its query rows as well (context parallelism): a later block
    reads the keys before it, under a mask anchored at its last row; random strategies
    compute what the module does."""
    class Att(nn.Module):
        def forward(self, q, k, v):
            return (F.scaled_dot_product_attention(q, k, v)
                    + F.scaled_dot_product_attention(q, k, v, is_causal=True))
    q, k, v = (torch.randn(2, 4, 5, 3) for _ in range(3))
    g = ff.trace(Att(), (q, k, v), frontend="export")
    plain, causal = [op for op in g.compute_ops if op.kind == "attention"]
    assert set(plain.parallel_dims) == {"n", "h", "l"} and set(causal.parallel_dims) == {"n", "h", "l"}
    machine = ff.Machine.preset("h200-node", devices=8)
    rows = 0
    for seed in range(8):
        s = ff.Strategy.random(g, machine, seed)
        rows += s[causal.name].degrees.get("l", 1) > 1
        out = run_graph(g, Att(), (q, k, v), s)
        torch.testing.assert_close(out, Att()(q, k, v), rtol=1e-5, atol=1e-6)
    assert rows > 0  # (some draws split the causal rows)
    # attention dropout draws per partition (as dropout does): still an attention op
    g = ff.trace(_Drop(), (q, k, v), frontend="export")
    assert [op.kind for op in g.compute_ops] == ["attention"]


class _Drop(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def test_dataclass_and_tuple_outputs_keep_their_type():
    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor
        scores: torch.Tensor

    pytree.register_dataclass(Out)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x, *, scale):
            s = self.fc(x) * scale
            return Out(loss=s.sum(), scores=s), (s.relu(),)

    torch.manual_seed(0)
    m, x = M(), torch.randn(4, 3)
    g = ff.trace(m, (x,), {"scale": 2.0})
    out, (r,) = run_graph(g, m, g.flat_inputs((x,), {"scale": 2.0}))
    ref, (rr,) = m(x, scale=2.0)
    assert isinstance(out, Out)
    torch.testing.assert_close(out.scores, ref.scores)
    torch.testing.assert_close(r, rr)


def test_data_dependent_control_flow_names_the_source_line():
    with pytest.raises(TraceError) as e:
        ff.trace(C.DataDependent(), (torch.randn(2, 4),))
    msg = str(e.value)
    assert re.search(r"_capture_models\.py:\d+", msg), msg
    assert "DataDependent" in msg and "\n" not in msg
    assert "control flow" in msg  # and it says what to do


def test_zoo_stays_on_the_fx_tracer():
    module, inputs = ff.models.get("rnnlm", size="small", batch_size=4)
    g = ff.trace(module, inputs)
    assert g.frontend == "fx" and any(op.kind == "lstm_cell" for op in g.ops) and not g.opaque


@pytest.mark.slow
def test_parallelize_keyword_inputs_dict_outputs_two_ranks():
    res = ff.launch(C.train_kwlm, 2, timeout_s=300)
    for r in res:
        assert r["keys"] == ["logits", "loss"]
        assert r["losses"] == res[0]["losses"]  # every rank returns the same loss
    r = res[0]
    assert r["exchanges"] > 0
    assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ref"])) < 1e-5
    assert r["param_err"] < 1e-5
