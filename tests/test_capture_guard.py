"""Capture never crashes for a rule's sake: a rule that meets a call it does not handle
makes the op opaque.  The pattern that once broke the concat rule -- a key / value cache
that starts as an empty 1-d tensor, concatenated along a negative axis, inside a model
called by keywords and wrapped the usual way (``self.net(input_ids=x, labels=y).loss``)
-- traces, searches and trains equal to one process."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flexflow as ff
from flexflow.graph.ops import RULES, catalog
from flexflow.strategy.localrun import run_graph

VOCAB, SEQ, BATCH = 13, 6, 4


class _Output:
    """What a library model returns: an object with the loss and the logits."""

    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class CachedLM(nn.Module):
    """A decoder as libraries write theirs: keyword inputs, an output object, causal fused
    attention, and keys / values appended to a cache that starts as a 1-d empty tensor
    (``torch.cat`` skips it: the legacy rule for empty tensors)."""

    def __init__(self, dim: int = 8, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(VOCAB, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("past", torch.zeros(0), persistent=False)

    def forward(self, input_ids=None, labels=None):
        x = self.emb(input_ids)
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        k = torch.cat([self.past, k], dim=-2)  # (B, heads, T, hd): the empty cache adds nothing
        v = torch.cat([self.past, v], dim=-2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        logits = self.head(x + self.proj(a))
        return _Output(F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits)


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = CachedLM()

    def forward(self, x, y):
        return self.net(input_ids=x, labels=y).loss


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _model():
    torch.manual_seed(0)
    return Wrapped()


def test_wrapped_model_with_an_empty_cache_traces_and_computes_the_module():
    module, inputs = _model(), _batch()
    graph = ff.trace(module, inputs)
    cats = [op for op in graph.ops if op.kind == "cat"]
    assert len(cats) == 2 and all(op.rule == "concat" for op in cats) and not graph.opaque
    assert all(op.attrs["spans"][0] == (0, 0) for op in cats)  # the empty cache: read by no partition
    pieces = [op for op in graph.ops if op.name.startswith("unbind")]
    assert len(pieces) == 3 and all(op.parallel_dims["n"] == "sample" for op in pieces)
    ref = module(*inputs)
    machine = ff.Machine.preset("h100-node", devices=4)
    for seed in range(4):
        torch.testing.assert_close(run_graph(graph, module, inputs, ff.Strategy.random(graph, machine, seed)), ref)


def test_wrapped_model_searches_never_worse_than_data_parallel():
    module, inputs = _model(), _batch()
    graph = ff.trace(module, inputs)
    res = ff.search(graph, ff.Machine.preset("h100-node", devices=4), budget=1.0, seed=0)
    assert res.result.iteration_time <= res.baselines["data_parallel"].iteration_time * (1 + 1e-9)


def test_a_rule_that_fails_makes_the_op_opaque(monkeypatch):
    module, inputs = _model(), _batch()

    def broken(self, op, batch):
        raise IndexError("tuple index out of range")
    monkeypatch.setattr(type(RULES["concat"]), "dims", broken)  # a rule that cannot say its dims
    real = catalog.classify

    def failing(b, name, mod):  # a rule that fails while it reads the call
        if name == "linear" and "proj" in str(b.node.target):
            return {}["no such argument"]
        return real(b, name, mod)
    monkeypatch.setattr(catalog, "classify", failing)
    graph = ff.trace(module, inputs)
    kinds = {graph.op(n).kind for n in graph.opaque}
    assert kinds == {"cat", "linear"} and len(graph.opaque) == 3
    proj = next(op for op in graph.ops if op.kind == "linear" and "proj" in op.name)
    assert proj.rule == "opaque" and set(proj.params) == {"weight", "bias"} and len(proj.inputs) == 1
    ref = module(*inputs)
    machine = ff.Machine.preset("h100-node", devices=2)
    for seed in range(3):
        torch.testing.assert_close(run_graph(graph, module, inputs, ff.Strategy.random(graph, machine, seed)), ref)


def test_concat_calls_the_rule_does_not_handle_stay_whole():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)  # (N, 4)
            y = torch.cat([h, h.flip(0)], dim=-1)  # a plain concat along the last axis
            z = torch.stack([h.sum(), h.mean()])  # 0-d tensors stacked
            return y.sum() + z.sum()
    m, x = Odd(), torch.randn(3, 4)
    graph = ff.trace(m, (x,))
    cat = next(op for op in graph.ops if op.kind == "cat")
    assert cat.rule == "concat" and cat.attrs["axis"] == 1
    stack = next(op for op in graph.ops if op.kind == "stack")
    assert stack.rule == "concat" and stack.attrs["spans"] == [(0, 1), (1, 1)]
    torch.testing.assert_close(run_graph(graph, m, (x,)), m(x))


# --------------------------------------------------------------------------- training
def _train_wrapped(rank, specs, steps=2):
    """Every rank trains the wrapped model ``steps`` SGD steps under each spec ("searched"
    or a random strategy's seed); rank 0 also trains the module alone and reports the
    largest relative errors of the losses and the parameters."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    machine = ff.Machine.preset("cpu", devices=dist.get_world_size())
    out = []
    for spec in specs:
        module, (x, y) = _model(), _batch()
        ref = copy.deepcopy(module)
        graph = ff.trace(module, (x, y))
        strategy = None if spec == "searched" else ff.Strategy.random(graph, machine, int(spec)).to_json()
        par = ff.parallelize(module, example_inputs=(x, y), strategy=strategy, machine=machine, budget=0.5)
        runs = []
        for net in (par, ref):
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            losses = []
            for step in range(steps):
                xs, ys = _batch(step)
                opt.zero_grad()
                loss = net(xs, ys)
                loss.backward()
                opt.step()
                losses.append(float(loss))
            runs.append(losses)
        state, want = par.state_dict(), ref.state_dict()
        err = max(float((state[k] - v).abs().max() / v.abs().max().clamp_min(1e-6)) for k, v in want.items())
        loss_err = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(*runs))
        out.append({"spec": spec, "loss_err": loss_err, "param_err": err, "keys": sorted(state) == sorted(want),
                    "losses": runs[0]})
    return out


@pytest.mark.slow
def test_wrapped_model_trains_equal_to_one_process():
    ranks = ff.launch(_train_wrapped, 2, ["searched", "1"], timeout_s=300)
    for rec, other in zip(ranks[0], ranks[1]):
        assert rec["keys"], rec["spec"]
        assert rec["loss_err"] <= 1e-5 and rec["param_err"] <= 1e-5, rec
        assert other["losses"] == rec["losses"], f"{rec['spec']}: ranks disagree"
