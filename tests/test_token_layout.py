"""Balanced context parallelism: a causal attention split head-tail (dim ``z``) over a graph
whose tokens run in that order (flexflow.strategy.layout) -- the rule's blocks, the
graph analysis (what is reordered, what is refused) and the plan computed in one process
against the module.  The multi-process runs are in test_megatron.py."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flexflow as ff
from flexflow.graph.ops import RULES
from flexflow.graph.ops.attention import head_tail_order
from flexflow.models._common import make_inputs
from flexflow.strategy.config import ParallelConfig, StrategyError
from flexflow.strategy.layout import token_layout
from flexflow.strategy.localrun import run_graph
from flexflow.strategy.regions import partitions

sys.path.insert(0, str(Path(__file__).parent))
from _corpus import NanoGPT  # noqa: E402


def test_head_tail_order_gives_block_i_chunks_i_and_its_mirror():
    assert head_tail_order(8, 2) == [0, 1, 6, 7, 2, 3, 4, 5]
    assert head_tail_order(16, 4)[:4] == [0, 1, 14, 15] and sorted(head_tail_order(16, 4)) == list(range(16))
    with pytest.raises(ValueError, match="divisible by 6"):
        head_tail_order(8, 3)


class _Attend(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_head_tail_blocks_compute_the_attention_of_the_reordered_sequence():
    """Each z block, given its queries and every key in the head-tail order, computes the
    rows of the causal attention of the whole sequence it holds; all blocks cost alike."""
    torch.manual_seed(0)
    L, c = 16, 4
    q, k, v = (torch.randn(2, 3, L, 8) for _ in range(3))
    g = ff.trace(_Attend(), (q, k, v))
    op = next(o for o in g.compute_ops if o.rule == "attention")
    assert "z" in op.parallel_dims
    order = torch.tensor(head_tail_order(L, c))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    qo, ko, vo = (t.index_select(2, order) for t in (q, k, v))
    parts = partitions(op, ParallelConfig({"z": c}, range(c)))
    flops = {RULES["attention"].flops(op, p.block) for p in parts}
    assert len(flops) == 1
    out = torch.cat([RULES["attention"].compute(op, p.block, [qo[p.inputs[0]], ko[p.inputs[1]], vo[p.inputs[2]]], {})
                     for p in parts], dim=2)
    assert all(p.inputs[1][2] == slice(0, L) for p in parts)
    assert torch.allclose(out, full.index_select(2, order), atol=1e-6)
    with pytest.raises(StrategyError, match="divisible by 6"):
        partitions(op, ParallelConfig({"z": 3}, range(3)))
    with pytest.raises(StrategyError, match="not both"):
        partitions(op, ParallelConfig({"z": 2, "l": 2}, range(4)))


class _Logits(NanoGPT):
    """nanoGPT returning its logits beside the loss: an output in sequence order."""

    def forward(self, idx, targets):
        loss = super().forward(idx, targets)
        x = self.wte(idx) + self.wpe(torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device))
        return self.lm_head(self.ln_f(x)), loss


def test_nanogpt_runs_head_tail_with_its_position_ids_reordered():
    m = _Logits()
    x = make_inputs(m.input_specs(2), seed=0, device="cpu", dtype=torch.float32)
    g = ff.trace(m, x)
    lay = token_layout(g, 2)
    kinds = {g.op(n).kind for n in lay.values}
    assert {"idx", "targets"} <= set(lay.values) and len(kinds) == 2  # the inputs and the position ids
    assert len(lay.outputs) == 1  # the logits, put back in sequence order
    mach = ff.Machine.preset("h100-cluster", devices=4)
    s = ff.Strategy.megatron(g, mach, tp=2, cp=2, cp_balance=True)
    attn = [o for o in g.compute_ops if o.rule == "attention"]
    assert all(s[o.name].degree("z") == 2 for o in attn)
    with torch.no_grad():
        (logits, loss), (ref_logits, ref_loss) = run_graph(g, m, x, s), m(*x)
    assert torch.allclose(logits, ref_logits, atol=1e-5) and torch.allclose(loss, ref_loss, atol=1e-6)


class _ShiftedCausal(nn.Module):
    """Hugging Face's causal-LM loss (logits shifted by one) after a causal attention."""

    def __init__(self, d=16, V=32):
        super().__init__()
        self.emb, self.qkv, self.head = nn.Embedding(V, d), nn.Linear(d, 3 * d), nn.Linear(d, V)

    def forward(self, ids, labels):
        h = self.emb(ids)
        B, T, C = h.shape
        q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in self.qkv(h).split(C, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        logits = self.head(h + a)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


def test_a_model_that_shifts_its_tokens_is_refused_by_name_and_stays_contiguous():
    m = _ShiftedCausal()
    x = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    g = ff.trace(m, x)
    with pytest.raises(StrategyError, match="a shift or a slice"):
        token_layout(g, 2)
    mach = ff.Machine.preset("h100-cluster", devices=4)
    with pytest.raises(StrategyError, match="getitem.*cp_balance=False splits the sequence contiguously"):
        ff.Strategy.megatron(g, mach, tp=2, cp=2, cp_balance=True)
    s = ff.Strategy.megatron(g, mach, tp=2, cp=2)  # balanced where it can be: here contiguous
    attn = next(o for o in g.compute_ops if o.rule == "attention")
    assert s[attn.name].degree("l") > 1 and s[attn.name].degree("z") == 1
    with torch.no_grad():
        assert torch.allclose(run_graph(g, m, x, s), m(*x), atol=1e-6)


def test_attentions_split_head_tail_different_ways_are_refused():
    m, x = ff.models.get("llama", size="small", batch_size=2)
    g = ff.trace(m, x)
    mach = ff.Machine.preset("h100-cluster", devices=8)
    s = ff.Strategy.megatron(g, mach, tp=2, cp=2)
    attn = [o for o in g.compute_ops if o.rule == "attention"]
    one = s[attn[0].name]
    other = ParallelConfig({"n": 2, "h": 2, "l": 2}, one.devices)
    with pytest.raises(StrategyError, match="head-tail different ways"):
        s.replace(attn[0].name, other)
    with pytest.raises(StrategyError, match="head-tail different ways"):
        ff.Strategy(g, {**dict(s), attn[0].name: other}, mach)
    # the JSON of a balanced plan loads back as the same plan
    assert ff.Strategy.from_json(s.to_json(), g, mach) == s
