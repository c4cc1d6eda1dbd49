"""flexflow.fused_cross_entropy: F.cross_entropy's value and gradient without a float32 copy
of the logits; traced as one loss op split by rows; priced and held in the logits' dtype."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flexflow as ff
from flexflow.cost.precision import precision, priced_ops
from flexflow.strategy.localrun import run_graph


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_value_and_gradient_are_cross_entropys(reduction):
    torch.manual_seed(0)
    x = torch.randn(5000, 37, dtype=torch.float64, requires_grad=True)  # (more rows than one block)
    t = torch.randint(0, 37, (5000,))
    t[::7] = -1
    a = ff.fused_cross_entropy(x, t, ignore_index=-1, reduction=reduction)
    (ga,) = torch.autograd.grad(a, x)
    b = F.cross_entropy(x, t, ignore_index=-1, reduction=reduction)
    (gb,) = torch.autograd.grad(b, x)
    assert a.dtype == torch.float32 and torch.allclose(a.double(), b, rtol=1e-6)
    assert torch.allclose(ga, gb, atol=1e-7)
    xb = x.detach().bfloat16().requires_grad_()
    c = ff.fused_cross_entropy(xb, t, ignore_index=-1, reduction=reduction)
    (gc,) = torch.autograd.grad(c, xb)
    assert gc.dtype == torch.bfloat16  # the gradient in the logits' dtype
    assert torch.allclose(c, F.cross_entropy(xb.float(), t, ignore_index=-1, reduction=reduction), rtol=1e-5)


def test_bad_input_is_named():
    x, t = torch.randn(4, 3), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match="logits \\(rows, classes\\)"):
        ff.fused_cross_entropy(x.view(2, 2, 3), t)
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        ff.fused_cross_entropy(x, t, reduction="none")


class _LM(nn.Module):
    def __init__(self, V=40, d=16, fused=True):
        super().__init__()
        self.emb, self.mix, self.head, self.fused = nn.Embedding(V, d), nn.Linear(d, d), nn.Linear(d, V), fused

    def forward(self, ids, targets):
        logits = self.head(torch.tanh(self.mix(self.emb(ids))))
        loss = ff.fused_cross_entropy if self.fused else F.cross_entropy
        return loss(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_traced_as_one_loss_split_by_rows_and_held_in_the_compute_dtype():
    torch.manual_seed(0)
    x = (torch.randint(0, 40, (8, 6)), torch.randint(0, 40, (8, 6)))
    m = _LM()
    g = ff.trace(m, x)
    op = next(o for o in g.compute_ops if o.rule == "loss")
    assert op.kind == "fused_cross_entropy" and op.attrs["fn"] == "fused" and "n" in op.parallel_dims
    mach = ff.Machine.preset("cpu", devices=4)
    s = ff.Strategy.data_parallel(g, mach)
    with torch.no_grad():
        assert torch.allclose(run_graph(g, m, x, s), m(*x), rtol=1e-6)
    for name in ("bf16-mixed", "bf16-params"):  # the logits stay bfloat16 (F.cross_entropy's: float32)
        priced = {o.name: o for o in priced_ops(g, precision(name))}
        assert priced[op.name].input_dtypes[0] == torch.bfloat16, name
        plain = ff.trace(_LM(fused=False), x)
        ce = next(o for o in priced_ops(plain, precision(name)) if o.rule == "loss")
        assert ce.input_dtypes[0] == torch.float32, name


def test_the_memory_model_keeps_no_float32_copy_of_the_logits():
    """A language model whose head dominates: the fused loss's peak is below the plain one's
    by about the float32 log-softmax and its gradient."""
    x = (torch.zeros(16, 64, dtype=torch.long, device="meta"), torch.zeros(16, 64, dtype=torch.long, device="meta"))
    mach = ff.Machine.preset("h100-cluster", devices=2)
    peaks = {}
    for fused in (True, False):
        with torch.device("meta"):
            m = _LM(V=32000, d=64, fused=fused)
        g = ff.trace(m, x)
        sim = ff.Simulator(g, mach, optimizer="adam", precision="bf16-params")
        peaks[fused] = max(sim.simulate(ff.Strategy.data_parallel(g, mach), incremental=False).peak_memory)
    logits_f32 = 8 * 64 * 32000 * 4  # a device's rows of float32 logits
    assert peaks[False] - peaks[True] >= logits_f32


@pytest.mark.slow
def test_plans_with_the_fused_loss_train_as_one_process():
    """GPT-2 with its loss fused, on 2 ranks: data parallel (the loss split by rows, each a
    partial sum of the mean) and two random plans train as one process (3 SGD steps)."""
    import _dist_workers as W
    from flexflow.launch import launch
    out = launch(W.suite, 2, [("gpt2_fused", 4, "train", ["data_parallel", "random:0", "random:1"], False)],
                 timeout_s=240)
    recs = out[0]["equivalence"]
    assert len(recs) == 3
    for r in recs:
        assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, r
        assert out[1]["equivalence"][recs.index(r)]["losses"] == r["losses"]
