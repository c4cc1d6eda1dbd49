"""Strategy space: configs, partitions tiling outputs, stitching equals the
whole op (uneven shapes), built-ins, JSON round trip and refusal."""
import json
import pickle
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flexflow as ff
from flexflow.strategy.localrun import run_graph
from flexflow.strategy.config import ParallelConfig, StrategyError
from flexflow.strategy.strategy import Strategy
from flexflow.strategy.candidates import candidate_configs, strategy_space_log10
from flexflow.strategy.regions import param_placement, partitions

P100_4 = ff.Machine.preset("p100-cluster", devices=4)
P100_16 = ff.Machine.preset("p100-cluster", devices=16)


class Uneven(nn.Module):
    """Dims of 3n+1 everywhere: batch 7, 13x13 images, 10 channels, 7 tokens."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 3, stride=2, padding=1)
        self.conv1d = nn.Conv1d(10, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(10)
        self.fc = nn.Linear(10 * 7 * 7, 13)
        self.emb = nn.Embedding(11, 10)
        self.cell = nn.LSTMCell(10, 7)
        self.ln = nn.LayerNorm(7)

    def forward(self, x, tokens, labels):
        y = F.relu(self.bn(self.conv(x)))  # (7, 10, 7, 7)
        y = F.max_pool2d(y, 3, stride=1, padding=1) + F.avg_pool2d(y, 3, 1, 1)
        z = self.fc(torch.flatten(y, 1))  # (7, 13)
        e = self.emb(tokens)  # (7, 4, 10)
        c = self.conv1d(e.transpose(1, 2))  # (7, 4, 4)
        h, cc = self.cell(e[:, 0])
        h, cc = self.cell(e[:, 1], (h, cc))
        att = torch.softmax(e @ e.transpose(1, 2), dim=-1) @ e  # (7, 4, 10)
        both = torch.cat([z, self.ln(h), att.mean(1), c.flatten(1)], dim=1)
        return F.cross_entropy(both, labels)


def _uneven():
    torch.manual_seed(0)
    m = Uneven().eval()
    inputs = (torch.randn(7, 3, 13, 13), torch.randint(0, 11, (7, 4)), torch.randint(0, 13, (7,)))
    return m, inputs


def test_partitions_tile_output_exactly_once():
    m, inputs = _uneven()
    g = ff.trace(m, inputs)
    rng = random.Random(0)
    checked = 0
    for op in g.compute_ops:
        for config in rng.sample(candidate_configs(op, P100_16), min(20, len(candidate_configs(op, P100_16)))):
            parts = partitions(op, config)
            cover = torch.zeros(op.output_shape, dtype=torch.int32)
            for p in parts:
                cover[p.output] += 1
            expected = max(1, len(parts)) if parts[0].partial else 1
            if parts[0].partial:  # a split reduction dim: each element summed over the partials
                assert int(cover.min()) >= 1
            else:
                assert torch.all(cover == expected), (op.name, config)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("seed", range(6))
def test_random_strategies_stitch_to_whole_output(seed):
    m, inputs = _uneven()
    g = ff.trace(m, inputs)
    s = Strategy.random(g, P100_16, seed)
    splits = sum(1 for name in s if s[name].num_partitions > 1)
    assert splits > len(s) // 3  # the strategy really splits ops
    torch.testing.assert_close(run_graph(g, m, inputs, s), m(*inputs), rtol=1e-5, atol=1e-6)


class _Losses(nn.Module):
    """Element-wise losses and hand-written reductions, as users write their losses."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.smooth = nn.SmoothL1Loss(beta=0.5)
        self.kl = nn.KLDivLoss(reduction="sum", log_target=True)

    def forward(self, x, y):
        z = self.fc(x)
        return (((z - y) ** 2).mean() + F.mse_loss(z, y, reduction="sum") + self.smooth(z, y)
                + F.binary_cross_entropy_with_logits(z, torch.sigmoid(y)) + (z - y).abs().sum(dim=1).mean()
                + z.sum(1, keepdim=True).mean(0).sum() + F.huber_loss(z, y, delta=2.0) + z.amax()
                + F.kl_div(F.log_softmax(z, -1), F.softmax(y, -1), reduction="batchmean")
                + self.kl(F.log_softmax(z, -1), F.log_softmax(y, -1)))


@pytest.mark.parametrize("seed", range(4))
def test_losses_and_reductions_split_into_partial_sums(seed):
    """Element-wise losses and sums/means split along what they reduce (the samples
    too): the partitions' partial sums add up to the module's loss."""
    m = _Losses()
    x, y = torch.randn(9, 6), torch.randn(9, 4)
    g = ff.trace(m, (x, y))
    kinds = {op.name: op.rule for op in g.compute_ops}
    assert "pointwise_loss" in kinds.values() and "opaque" not in kinds.values()
    mean = next(op for op in g.compute_ops if op.kind == "mean" and not op.attrs["axis_map"])
    assert mean.parallel_dims.get("n") == "sample"  # ((z - y) ** 2).mean() splits with the samples
    assert not next(op for op in g.compute_ops if op.kind == "amax").dims  # a max is no sum of parts
    s = Strategy.random(g, P100_4, seed)
    assert any(s[op.name].num_partitions > 1 for op in g.compute_ops if op.rule in ("reduce", "pointwise_loss"))
    torch.testing.assert_close(run_graph(g, m, (x, y), s), m(x, y), rtol=1e-5, atol=1e-5)


def test_spatial_and_parameter_splits_are_exact():
    m, inputs = _uneven()
    g = ff.trace(m, inputs)
    configs = {}
    for op in g.compute_ops:
        dims = op.parallel_dims
        degs = {d: 2 for d in ("h", "w") if d in dims} or {d: 2 for d in ("c", "e") if d in dims
                                                          and dims[d] == "parameter"}
        configs[op.name] = ParallelConfig(degs, range(2 ** len(degs)))
    s = Strategy(g, configs, P100_4)
    torch.testing.assert_close(run_graph(g, m, inputs, s), m(*inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ff.models.names())
def test_zoo_random_strategies_match(name):
    module, inputs = ff.models.get(name, size="small", batch_size=7)
    module.eval()
    g = ff.trace(module, inputs)
    ref = module(*inputs)
    for seed in range(2):
        s = Strategy.random(g, P100_4, seed)
        torch.testing.assert_close(run_graph(g, module, inputs, s), ref, rtol=1e-5, atol=1e-6)


def test_conv_halo_regions():
    m, inputs = _uneven()
    g = ff.trace(m, inputs)
    op = g.op("conv")  # 3x3, stride 2, padding 1: 13 -> 7 rows
    parts = partitions(op, ParallelConfig({"h": 2}, (0, 1)))
    assert [p.output[2] for p in parts] == [slice(0, 3), slice(3, 7)]
    # rows 0..2 read input rows -1..5 (clipped to 0..6); rows 3..6 read 5..13 (clipped to 5..13)
    assert [p.inputs[0][2] for p in parts] == [slice(0, 6), slice(5, 13)]
    linear = g.op("fc")
    p = partitions(linear, ParallelConfig({"c": 2}, (0, 1)))[1]
    assert p.inputs[0] == (slice(0, 7), slice(0, 490))  # the whole input row
    assert p.params["weight"] == (slice(6, 13), slice(0, 490))


def test_config_validation_and_str():
    c = ParallelConfig({"n": 4, "c": 2}, range(8))
    assert str(c) == "S4 C2 @[0..7]"
    assert c == ParallelConfig({"c": 2, "n": 4, "h": 1}, tuple(range(8)))
    assert hash(c) == hash(ParallelConfig({"c": 2, "n": 4}, range(8)))
    with pytest.raises(StrategyError, match="partitions"):
        ParallelConfig({"n": 4}, (0, 1))
    with pytest.raises(StrategyError, match="distinct"):
        ParallelConfig({"n": 2}, (1, 1))
    with pytest.raises(AttributeError):
        c.devices = (0,)
    back = pickle.loads(pickle.dumps(c))  # as multiprocessing sends it
    assert back == c and hash(back) == hash(c) and back.devices == c.devices
    g = ff.trace(*ff.models.get("lenet", size="small"))
    with pytest.raises(StrategyError, match="cannot split dim 'q'"):
        Strategy.data_parallel(g, P100_4).replace("conv1", ParallelConfig({"q": 2}, (0, 1)))
    with pytest.raises(StrategyError, match="size 10 into 16"):
        Strategy.data_parallel(g, P100_16).replace("fc2", ParallelConfig({"c": 16}, range(16)))


def test_candidates_are_powers_of_two_on_aligned_blocks():
    g = ff.trace(*ff.models.get("lenet", device="meta"))
    op = g.op("conv1")
    cands = candidate_configs(op, P100_16)
    assert len(set(cands)) == len(cands)
    for c in cands:
        for d in c.degrees.values():
            assert d & (d - 1) == 0
        n = c.num_partitions
        assert c.devices[0] % n == 0 and c.devices == tuple(range(c.devices[0], c.devices[0] + n))
    assert ParallelConfig({}, (5,)) in cands and ParallelConfig({"n": 16}, range(16)) in cands
    assert 9 < strategy_space_log10(g, P100_4) < 12  # the paper: about 10^11 for LeNet on 4 GPUs


def test_builtins():
    g = ff.trace(*ff.models.get("alexnet", device="meta", batch_size=1024))
    dp = Strategy.data_parallel(g, P100_16)
    assert all(dp[op.name] == ParallelConfig({"n": 16}, range(16)) for op in g.compute_ops)
    mp = Strategy.model_parallel(g, P100_4)
    assert all(mp[n].num_partitions == 1 for n in mp)
    r = ff.trace(*ff.models.get("resnet101", device="meta"))
    order = [Strategy.model_parallel(r, P100_4)[op.name].devices[0] for op in r.compute_ops]
    assert order == sorted(order) and set(order) == {0, 1, 2, 3}  # consecutive, balanced
    ex = Strategy.expert(g, P100_4)
    assert ex["fc1"] == ParallelConfig({"c": 4}, range(4))
    assert ex["conv1"] == ParallelConfig({"n": 4}, range(4))
    assert Strategy.random(g, P100_4, 3) == Strategy.random(g, P100_4, 3)
    # recurrent: data-parallel cells, vocabulary-split softmax layer
    g = ff.trace(*ff.models.get("rnnlm", device="meta", batch_size=256))
    ex = Strategy.expert(g, P100_4)
    cells = [op for op in g.ops if op.kind == "lstm_cell"]
    assert all(ex[c.name] == ParallelConfig({"n": 4}, range(4)) for c in cells)
    assert ex["decoder"].degrees == {"c": 4}


def test_shared_ops_change_together():
    g = ff.trace(*ff.models.get("rnnlm", size="small"))
    s = Strategy.data_parallel(g, P100_4)
    cell = next(op for op in g.ops if op.kind == "lstm_cell")
    s2 = s.replace(cell.name, ParallelConfig({"h": 2}, (2, 3)))
    members = g.groups[cell.group]
    assert len(members) == 4 and all(s2[m] == ParallelConfig({"h": 2}, (2, 3)) for m in members)
    with pytest.raises(StrategyError, match="share"):
        Strategy(g, {**dict(s), members[0]: ParallelConfig({}, (1,))}, P100_4)


def test_param_placement():
    a = ff.trace(*ff.models.get("alexnet", size="small"))
    place = param_placement(a, Strategy.data_parallel(a, P100_4))
    assert len(place) == 16
    for view, shards, trainable in place.values():
        assert trainable and len(shards) == 1 and shards[0].devices == (0, 1, 2, 3)
    g = ff.trace(*ff.models.get("transformer", size="small"))
    ex = Strategy.expert(g, P100_4)
    place = param_placement(g, ex)
    # tied embedding / LM head weight split two different ways: every holder keeps it whole
    view, shards, _ = place["wte.weight"]
    assert len(shards) == 1 and shards[0].region == tuple(slice(0, s) for s in view)
    # a c-split linear: four disjoint shards, one device each
    fc = next(op for op in g.ops if op.kind == "linear")
    view, shards, _ = place[fc.params["weight"]]
    assert len(shards) == 4 and all(len(sh.devices) == 1 for sh in shards)


def test_json_round_trip_and_refusals():
    g = ff.trace(*ff.models.get("lenet", size="small"))
    s = Strategy.random(g, P100_4, 1)
    text = s.to_json()
    s2 = Strategy.from_json(text, g, P100_4)
    assert s2 == s and s2.to_json() == text
    other = ff.trace(*ff.models.get("lenet", size="small", batch_size=9))
    with pytest.raises(StrategyError, match="another graph"):
        Strategy.from_json(text, other)
    with pytest.raises(StrategyError, match="another machine"):
        Strategy.from_json(text, g, ff.Machine.preset("k80-cluster", devices=4))
    d = json.loads(text)
    d["ops"]["conv1"] = {"degrees": {"n": 2}, "devices": [0]}
    with pytest.raises(StrategyError, match="'conv1'"):
        Strategy.from_json(json.dumps(d), g)
    d = json.loads(text)
    d["ops"]["nope"] = d["ops"]["conv1"]
    with pytest.raises(StrategyError, match="'nope'"):
        Strategy.from_json(json.dumps(d), g)
    with pytest.raises(StrategyError, match="not valid JSON"):
        Strategy.from_json("{", g)


def test_replicated_placement():
    """{"r": k}: k whole copies; data parallelism replicates what reads only
    constants (the transformer's position embedding) so that nothing travels
    for it, and its gradients are all-reduced among the copies."""
    from flexflow.strategy.config import REPLICA
    from flexflow.strategy.regions import canonical_partitions, pick_replica
    module, inputs = ff.models.get("transformer", size="small", batch_size=6)
    module.eval()
    g = ff.trace(module, inputs)
    wpe = g.op("wpe")
    assert "n" not in wpe.parallel_dims
    rep = ParallelConfig({REPLICA: 4}, range(4))
    assert str(rep) == "R4 @[0..3]" and rep in candidate_configs(wpe, P100_4)
    batched = next(op for op in g.compute_ops if op.parallel_dims.get("n") == "sample")
    assert not any(REPLICA in c.degrees for c in candidate_configs(batched, P100_4))  # split it instead
    parts = partitions(wpe, rep)
    whole = partitions(wpe, ParallelConfig({}, (0,)))[0]
    assert [p.device for p in parts] == [0, 1, 2, 3]
    assert all(p.output == whole.output and p.params == whole.params and not p.partial for p in parts)
    assert len(canonical_partitions(parts)) == 1
    assert pick_replica([0, 1, 2, 3], parts, 2, 0) == 2 and pick_replica([0, 1], parts, 7, 3) == 1
    with pytest.raises(StrategyError, match="replicated"):
        partitions(g.op(g.compute_ops[0].name), ParallelConfig({REPLICA: 2, "n": 2}, range(4)))
    dp = Strategy.data_parallel(g, P100_4)
    assert dp["wpe"] == rep
    assert sum(REPLICA in dp[op.name].degrees for op in g.compute_ops) == 1
    place = param_placement(g, dp)[wpe.params["weight"]]
    assert [s.devices for s in place[1]] == [(0, 1, 2, 3)]  # one shard, all-reduced among all
    res = ff.Simulator(g, P100_4).simulate(dp)
    assert res.comm_bytes == 0  # no activation travels under data parallelism
    torch.testing.assert_close(run_graph(g, module, inputs, dp), module(*inputs))
    text = dp.to_json()
    assert Strategy.from_json(text, g)["wpe"] == rep


def test_random_near_a_base_redraws_a_fraction_of_the_ops():
    module, inputs = ff.models.get("rnnlm", batch_size=4, size="small")
    g = ff.trace(module, inputs)
    dp = Strategy.data_parallel(g, P100_4)
    heads = [g.op(m[0]).name for m in g.groups.values()]
    assert all(Strategy.random(g, P100_4, 3, base=dp, fraction=0.0)[n] == dp[n] for n in heads)
    half = Strategy.random(g, P100_4, 3, base=dp, fraction=0.5)
    moved = sum(half[n] != dp[n] for n in heads)
    assert 0 < moved < len(heads)
    again = Strategy.random(g, P100_4, 3, base=dp, fraction=0.5)
    assert all(again[n] == half[n] for n in heads)  # the seed fixes the draw
    assert half.name == "random3@0.5"
    with pytest.raises(StrategyError, match="fraction"):
        Strategy.random(g, P100_4, 3, base=dp, fraction=1.5)


class _SeqLoss(nn.Module):
    """Token logits (B, T, V) scored with the class dim moved to place 1, as LM code writes it."""

    def __init__(self, reduction, fn="ce"):
        super().__init__()
        self.proj, self.reduction, self.fn = nn.Linear(6, 5), reduction, fn

    def forward(self, x, t):
        logits = self.proj(x).transpose(1, 2)
        if self.fn == "nll":
            return F.nll_loss(F.log_softmax(logits, 1), t, reduction=self.reduction, ignore_index=3)
        return F.cross_entropy(logits, t, reduction=self.reduction, ignore_index=3)


@pytest.mark.parametrize("reduction,fn", [("mean", "ce"), ("sum", "ce"), ("none", "ce"), ("mean", "nll")])
def test_a_loss_over_a_middle_class_dim_runs_class_last_with_the_same_values(reduction, fn):
    """The executor computes cross-entropy / NLL of (B, C, T) over (B*T, C) rows (torch's
    softmax over a middle dim is the slow one): the module's values, whole
    and split along samples and positions, with ignored targets in a 'sum' or 'none'."""
    from flexflow.graph.ops import RULES
    torch.manual_seed(0)
    module = _SeqLoss(reduction, fn)
    x, t = torch.randn(4, 7, 6), torch.randint(0, 5, (4, 7))
    if reduction != "mean":
        t[0, :3] = 3  # ignore_index (a split 'mean' assumes none, docs/limitations.md)
    graph = ff.trace(module, (x, t))
    loss = next(op for op in graph.ops if op.rule == "loss")
    assert loss.input_shapes[0] == (4, 5, 7)
    ref = module(x, t)
    xin = module.proj(x).transpose(1, 2)
    if fn == "nll":
        xin = F.log_softmax(xin, 1)
    seen = []
    orig = F.cross_entropy if fn == "ce" else F.nll_loss
    spy = (lambda *a, **k: seen.append(a[0].dim()) or orig(*a, **k))
    with pytest.MonkeyPatch.context() as mp:  # (torch.nn.functional's, while the rule runs)
        mp.setattr(F, "cross_entropy" if fn == "ce" else "nll_loss", spy)
        got = RULES["loss"].bind(loss, {})([xin, t], {})
    torch.testing.assert_close(got, ref)
    assert seen == [2]  # class dim last, rows
    machine = ff.Machine.preset("cpu", devices=4)
    for seed in range(4):
        torch.testing.assert_close(run_graph(graph, module, (x, t), ff.Strategy.random(graph, machine, seed)), ref)
