"""Region arrays assembled per dim (``strategy.boxes``) against ``partitions``, which
defines them: for every op of every zoo model whose rule declares itself separable, on
uneven splits (3 and 7 parts, halos of convolutions and pools), several dims at once and
replicas; and OptCNN's tables built on them against the same tables built by enumerating
every partition."""
import itertools

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flexflow as ff
from flexflow.graph.ops import RULES
from flexflow.search import _OptCNN
from flexflow.strategy.boxes import OpBoxes, region_array
from flexflow.strategy.config import REPLICA, ParallelConfig, StrategyError
from flexflow.strategy.regions import partitions, validate_config


def _configs(op):
    """Uneven and mixed splits of the op's dims (those the candidates leave out too)."""
    dims = op.dims
    out = []
    for d in dims:
        out += [{d.name: k} for k in (2, 3, 7) if k <= d.size]
    for a, b in itertools.combinations(dims, 2):
        out += [{a.name: ka, b.name: kb} for ka, kb in ((3, 2), (2, 7)) if ka <= a.size and kb <= b.size]
    if len(dims) >= 3:
        out.append({d.name: 2 for d in dims[:3]})
    if dims:
        out.append({d.name: 2 for d in dims})
    out.append({REPLICA: 3})
    configs = [ParallelConfig(degs, range(int(np.prod(list(degs.values()))))) for degs in out]
    return [c for c in configs if _valid(op, c)]


def _valid(op, config) -> bool:
    """Whether the op takes the config (a head-tail split needs two equal chunks a block and
    no contiguous split of the rows besides: those are refused, the rest all taken)."""
    try:
        validate_config(op, config)
    except StrategyError:
        assert "z" in config.degrees, (op.describe(), config)
        return False
    return True


def _regions(op, p):
    """A partition's regions in OpBoxes' numbering: output, inputs, parameters and buffers."""
    return [p.output, *p.inputs, *p.params.values()]


def _shape(r):
    return None if r is None else tuple(s.stop - s.start for s in r)


def _check(op, ob, config):
    parts = partitions(op, config)
    assert ob.plan(config) is not None, (op.describe(), config)
    regs = [_regions(op, p) for p in parts]
    ranks = [len(op.output_shape), *map(len, op.input_shapes), *(None for _ in parts[0].params)]
    assert list(parts[0].params) == ob.layout.names
    for r, rank in enumerate(ranks):
        col = [x[r] for x in regs]
        rank = rank if rank is not None else len(col[0])
        want = region_array(col, rank)
        got = ob.boxes(config, r, rank)
        assert got.shape == want.shape and (got == want).all(), (op.describe(), config, r)
    # the first partition of every distinct combination of region shapes, in order
    firsts = {}
    for p, x in zip(parts, regs):
        firsts.setdefault(tuple(map(_shape, x)), p)
    assert ob.firsts(config) == list(firsts.values()), (op.describe(), config)


@pytest.mark.parametrize("name", ff.models.names())
def test_separable_rules_assemble_the_partitions_regions(name):
    module, inputs = ff.models.get(name, batch_size=21, device="meta")
    g = ff.trace(module, inputs)
    seen, checked = set(), 0
    for op in g.compute_ops:
        if op.everywhere or not RULES[op.rule].separable:
            continue
        sig = (op.rule, op.kind, tuple(op.output_shape), tuple(map(tuple, op.input_shapes)),
               tuple(sorted(op.param_shapes.items())), repr(sorted(op.attrs.items(), key=str)))
        if sig in seen:
            continue
        seen.add(sig)
        ob = OpBoxes(op)
        for config in _configs(op):
            _check(op, ob, config)
            checked += 1
    assert checked > 10


def test_convolution_and_pool_halos_are_assembled():
    """Strided and padded windows, split 3 and 7 ways along both spatial axes at once."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 5, 5, stride=2, padding=2)
            self.conv2 = nn.Conv2d(5, 4, 3, stride=1, padding=0, dilation=2)

        def forward(self, x):
            return self.conv2(F.max_pool2d(self.conv(x), 3, stride=2, padding=1)).sum()

    g = ff.trace(Net(), (torch.randn(5, 3, 61, 47),))
    for op in g.compute_ops:
        if op.rule not in ("conv", "pool"):
            continue
        ob = OpBoxes(op)
        hw = [d for d in op.dims if d.name in ("h", "w")]
        assert len(hw) == 2
        for kh, kw in ((3, 7), (7, 3), (7, 7)):
            if kh <= hw[0].size and kw <= hw[1].size:
                _check(op, ob, ParallelConfig({"h": kh, "w": kw, "n": 2}, range(2 * kh * kw)))


class _Tables(_OptCNN):
    fast = False  # the plain enumeration of every partition


class _Mixed(nn.Module):
    """A layer too narrow for all 16 devices (4 samples, one output: on the 4 devices of one
    node) between two that use them all: edges between configs on different device lists
    (consumer partitions with no producer partition on their device, route costs that
    differ between receivers)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(48, 96), nn.Linear(96, 1), nn.Linear(1, 40)

    def forward(self, x, y):
        return F.cross_entropy(self.c(F.relu(self.b(F.relu(self.a(x))))), y)


def _graphs():
    lenet = ff.trace(*ff.models.get("lenet", batch_size=64 * 4, device="meta"))
    rnnlm = ff.trace(*ff.models.get("rnnlm", size="small", batch_size=24, device="meta"))
    gpt2 = ff.trace(*ff.models.get("gpt2", size="small", batch_size=12, device="meta"))
    mixed = ff.trace(_Mixed(), (torch.randn(4, 48), torch.randint(0, 40, (4,))))
    inc = ff.trace(*ff.models.get("inception_v3", batch_size=24, device="meta"))
    return [("lenet", lenet, 4), ("lenet", lenet, 16), ("rnnlm", rnnlm, 8), ("gpt2", gpt2, 8),
            ("mixed", mixed, 16), ("inception_v3", inc, 4)]


def _same_tables(fast, plain):
    assert len(fast.unary) == len(plain.unary)
    for a, b in zip(fast.unary, plain.unary):
        assert np.array_equal(a, b)
    assert fast.pair.keys() == plain.pair.keys()
    for k in fast.pair:
        assert np.array_equal(fast.pair[k], plain.pair[k]), k


def test_optcnn_tables_equal_the_plain_enumeration(monkeypatch):
    for name, g, D in _graphs():
        machine = ff.Machine.preset("k80-cluster", devices=D)
        fast, plain = _OptCNN(g, machine), _Tables(g, machine)
        _same_tables(fast, plain)
        s = fast.solve()
        assert s == plain.solve() and fast.value(s) == plain.value(s), (name, D)
    # a rule that does not declare itself separable: its ops' partitions are enumerated
    monkeypatch.setattr(type(RULES["conv"]), "separable", False)
    g = _graphs()[0][1]
    machine = ff.Machine.preset("k80-cluster", devices=8)
    fast = _OptCNN(g, machine)
    conv = next(ob for ob in fast._opboxes.values() if ob.op.rule == "conv")
    assert all(p is None for p in conv._plans.values())
    _same_tables(fast, _Tables(g, machine))
