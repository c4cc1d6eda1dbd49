"""Strategy.megatron: tensor parallelism read off the graph (pairs of linear layers, the
second split by its inputs with partial sums), the 2-D plan, and a real 2-rank run."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flexflow as ff
from flexflow.launch import launch
from flexflow.models._common import InputSpec
from flexflow.strategy import StrategyError, param_placement
from flexflow.strategy.localrun import run_graph
from flexflow.strategy.megatron import linear_pairs


class Decoder(nn.Module):
    """A pre-norm decoder written differently from the zoo's: fused query/key/value
    projection, RMS-style norm by hand, SwiGLU MLP, torch's fused attention."""

    def __init__(self, width=16, heads=4, layers=2, vocab=32, seq=8):
        super().__init__()
        self.heads, self.seq = heads, seq
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "qkv": nn.Linear(width, 3 * width, bias=False), "out": nn.Linear(width, width, bias=False),
                "gate": nn.Linear(width, 2 * width, bias=False), "up": nn.Linear(width, 2 * width, bias=False),
                "down": nn.Linear(2 * width, width, bias=False),
                "n1": nn.LayerNorm(width), "n2": nn.LayerNorm(width)}))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, x, y):
        h = self.emb(x)
        N, T, W = h.shape
        for b in self.blocks:
            q, k, v = b["qkv"](b["n1"](h)).split(W, dim=-1)
            q, k, v = (t.reshape(N, T, self.heads, W // self.heads).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + b["out"](a.transpose(1, 2).reshape(N, T, W))
            z = b["n2"](h)
            h = h + b["down"](F.silu(b["gate"](z)) * b["up"](z))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    def input_specs(self, batch: int):
        return [InputSpec((batch, self.seq), "index", 32), InputSpec((batch, self.seq), "index", 32)]


def _transformer(batch=4):
    m, x = ff.models.get("transformer", size="small", batch_size=batch)
    m.eval()
    return m, x, ff.trace(m, x)


def _decoder(batch=4):
    torch.manual_seed(0)
    m = Decoder()
    x = (torch.randint(0, 32, (batch, 8)), torch.randint(0, 32, (batch, 8)))
    return m, x, ff.trace(m, x)


def test_pairs_are_found_from_the_graph():
    _, _, g = _transformer()
    pairs = {second: firsts for firsts, second, _ in linear_pairs(g)}
    assert pairs == {"blocks_0_attn_proj": ["blocks_0_attn_q", "blocks_0_attn_k", "blocks_0_attn_v"],
                     "blocks_0_mlp_proj": ["blocks_0_mlp_fc"],
                     "blocks_1_attn_proj": ["blocks_1_attn_q", "blocks_1_attn_k", "blocks_1_attn_v"],
                     "blocks_1_mlp_proj": ["blocks_1_mlp_fc"]}
    _, _, g = _decoder()
    seconds = {g.op(s).module_path: sorted(g.op(f).module_path for f in fs) for fs, s, _ in linear_pairs(g)}
    assert seconds == {"blocks.0.out": ["blocks.0.qkv"], "blocks.0.down": ["blocks.0.gate", "blocks.0.up"],
                       "blocks.1.out": ["blocks.1.qkv"], "blocks.1.down": ["blocks.1.gate", "blocks.1.up"]}


def test_the_plan_splits_pairs_heads_and_tokens():
    _, _, g = _transformer(batch=4)
    mach = ff.Machine.preset("p100-cluster", devices=8)  # 2 nodes of 4
    s = ff.Strategy.megatron(g, mach)  # tp: the devices of one node
    assert s.name == "megatron"
    assert s["blocks_0_attn_q"].degrees == {"n": 2, "c": 4}  # by outputs
    assert s["blocks_0_attn_proj"].degrees == {"n": 2, "k": 4}  # by inputs: partial sums
    assert s["blocks_0_mlp_fc"].degrees == {"n": 2, "c": 4} and s["blocks_0_mlp_proj"].degrees == {"n": 2, "k": 4}
    assert s["softmax"].degrees == {"n": 2, "c": 4}  # (N, heads, T, T): by heads
    assert s["blocks_0_ln_1"].degrees == {"n": 2, "s": 4}  # the trunk by tokens
    # partition k of the tensor-parallel dim runs on device node * 4 + k
    assert s["blocks_0_attn_proj"].devices == tuple(range(8))
    assert all(c.devices == tuple(range(8)) or c.num_partitions == 8 for c in s.values())
    # an op of a pair holds 1/4 of its weight; the rest of the trunk replicates its own
    w = param_placement(g, s)["blocks.0.mlp.proj.weight"]
    assert {sh.region[1].stop - sh.region[1].start for sh in w[1]} == {32}  # 128 inputs / 4
    assert ff.Strategy.megatron(g, mach, tp=8)["blocks_0_mlp_fc"].degrees == {"c": 8}  # no data parallelism


def test_shard_3_is_the_2d_plan_and_bad_arguments_are_refused():
    _, _, g = _transformer(batch=4)
    mach = ff.Machine.preset("p100-cluster", devices=8)
    s3 = ff.Strategy.megatron(g, mach, shard=3)
    plain = ff.Strategy.megatron(g, mach)
    for name, cfg in s3.items():  # the same split, every parameter replicated among nodes sharded
        assert cfg.with_shard(0) == plain[name]
        assert (cfg.shard == 3) == bool(g.op(name).params)
    with pytest.raises(StrategyError, match="tp must"):
        ff.Strategy.megatron(g, mach, tp=3)
    with pytest.raises(StrategyError, match="shard must"):
        ff.Strategy.megatron(g, mach, shard=4)
    with pytest.raises(StrategyError, match="more than the batch"):
        ff.Strategy.megatron(g, ff.Machine.preset("p100-cluster"), tp=2)  # 8 data-parallel groups, batch 4


def test_the_plan_computes_what_the_module_does_and_simulates():
    for m, x, g in (_transformer(batch=4), _decoder(batch=4)):
        mach = ff.Machine.preset("p100-cluster", devices=8)
        s = ff.Strategy.megatron(g, mach)
        with torch.no_grad():
            assert torch.allclose(run_graph(g, m, x, s), m(*x), rtol=1e-5, atol=1e-6)
        sim = ff.Simulator(g, mach)
        r = sim.simulate(s, incremental=False)
        dp = sim.simulate(ff.Strategy.data_parallel(g, mach), incremental=False)
        assert r.comm_bytes > 0 and r.iteration_time > 0
        # the pairs' weights are split 4 ways: less parameter sync than data parallelism
        assert r.sync_bytes < dp.sync_bytes
        assert sim.simulate(s, incremental=True).iteration_time == r.iteration_time


def test_reduction_split_stays_out_of_the_search_candidates():
    _, _, g = _transformer()
    op = g.op("blocks_0_mlp_proj")
    assert op.parallel_dims["k"] == "parameter"
    assert all("k" not in c.degrees for c in ff.candidate_configs(op, 8))


# --------------------------------------------------------------------------- 2 ranks
def _worker(rank: int, cases):
    return [_case(rank, *case) for case in cases]


def _llama(batch=4):
    m, x = ff.models.get("llama", size="small", batch_size=batch)
    return m, x, ff.trace(m, x)


def _nanogpt(batch=4):
    """nanoGPT as its author writes it (tests/_corpus.py): position ids from arange, the loss
    over flattened rows."""
    from _corpus import NanoGPT
    from flexflow.models._common import make_inputs
    torch.manual_seed(0)
    m = NanoGPT()
    x = make_inputs(m.input_specs(batch), seed=0, device="cpu", dtype=torch.float32)
    return m, x, ff.trace(m, x)


def _case(rank: int, which: str, tp: int, cp: int = 1, sp: bool = True, rc: bool = False, bal=None):
    from _dist_workers import _rel_err, _train  # the executor tests' SGD loop and error
    import torch.distributed as dist
    torch.set_num_threads(1)
    m, x, g = {"transformer": _transformer, "decoder": _decoder, "llama": _llama, "nanogpt": _nanogpt}[which](batch=4)
    init = copy.deepcopy(m.state_dict())
    ref_losses = ref_state = None
    if rank == 0:
        ref = copy.deepcopy(m)
        ref_losses = _train(ref, ref, 4)
        ref_state = ref.state_dict()
    m.load_state_dict(init)
    world = dist.get_world_size()
    s = ff.Strategy.megatron(g, ff.Machine.preset("cpu", devices=world), tp=tp, cp=cp, sequence_parallel=sp,
                             cp_balance=bal)
    s = s.recompute_blocks() if rc else s
    par = ff.parallelize(m, world, example_inputs=x, strategy=s)
    losses = _train(par, m, 4)
    kinds = [ex.coll.kind for ex in par.runtime.exchanges if ex.coll is not None]
    out = {"losses": losses, "exchanges": par.runtime.num_exchanges,
           "collectives": {k: kinds.count(k) for k in set(kinds)}, "regathered": len(par.runtime.regathered),
           "head_tail": par.runtime.reorder.layout.blocks if par.runtime.reorder is not None else 1}
    state = par.state_dict()  # (a collective: every rank)
    if rank == 0:
        out["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        out["param_err"] = max(_rel_err(state[k], ref_state[k]) for k in ref_state)
    return out


@pytest.mark.slow
def test_megatron_trains_equal_to_one_process_on_2_ranks():
    cases = [("transformer", 2), ("decoder", 2), ("decoder", 1), ("llama", 2, 1, False)]
    r0, r1 = launch(_worker, 2, cases, timeout_s=120)
    for case, a, b in zip(cases, r0, r1):
        assert a["losses"] == b["losses"] and a["exchanges"] > 0, case
        assert not a["collectives"], case  # a pair exchanges point to point (strategy.collective)
        assert a["loss_err"] < 1e-5 and a["param_err"] < 1e-5, (case, a)


@pytest.mark.slow
def test_tensor_parallel_collectives_train_equal_to_one_process_on_4_ranks():
    """tp=4: the sequence-parallel transitions run as collectives (an all-gather into each
    pair, its input gathered again for the backward; a reduce-scatter out of it), without
    sequence parallelism an all-reduce out of it; with every block recomputed, the
    recomputation gathers again; 4 SGD steps equal one process (float32)."""
    cases = [("llama", 4), ("decoder", 4), ("llama", 4, 1, False), ("llama", 4, 1, True, True)]
    res = launch(_worker, 4, cases, timeout_s=240)
    for k, case in enumerate(cases):
        a = res[0][k]
        sp = case[3] if len(case) > 3 else True
        assert all(r[k]["losses"] == a["losses"] for r in res), case
        want = {"gather": 2, "scatter": 2} if sp else {"gather": 1, "reduce": 2}
        assert all(a["collectives"].get(kind, 0) >= n for kind, n in want.items()), (case, a["collectives"])
        assert a["regathered"] >= 2 or not sp, (case, a)  # (without SP: a norm reads the embedding)
        assert a["loss_err"] < 1e-5 and a["param_err"] < 1e-5, (case, a)


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [
    (2, [("decoder", 1, 2), ("llama", 1, 2), ("llama", 1, 2, True, False, False)]),
    (4, [("decoder", 2, 2), ("llama", 2, 2), ("llama", 1, 4), ("llama", 2, 2, True, False, False),
         ("nanogpt", 2, 2)]),
])
def test_context_parallelism_trains_equal_to_one_process(world, cases):
    """megatron(cp=c): every op split along the tokens c ways besides tensor parallelism, the
    causal attention by its query rows -- balanced (the tokens head-tail, the keys and
    values all-gathered: the executor reorders the tokens and rotary tables) and
    contiguous (each chunk receiving the keys and values before it); 4 SGD steps equal one
    process (float32)."""
    res = launch(_worker, world, cases, timeout_s=240)
    for k, case in enumerate(cases):
        a = res[0][k]
        assert all(r[k]["losses"] == a["losses"] for r in res) and a["exchanges"] > 0, case
        balanced = len(case) < 6 or case[5] is not False
        assert a["head_tail"] == (case[2] if balanced else 1), (case, a["head_tail"])
        assert a["loss_err"] < 1e-5 and a["param_err"] < 1e-5, (case, a)


def test_context_parallelism_splits_the_attention_by_query_rows():
    m, x, g = _llama(batch=2)
    mach = ff.Machine.preset("h100-cluster", devices=8)
    s = ff.Strategy.megatron(g, mach, tp=2, cp=2, cp_balance=False)
    attn = next(op for op in g.compute_ops if op.rule == "attention")
    assert dict(s[attn.name].degrees) == {"n": 2, "h": 2, "l": 2}
    norm = next(op for op in g.compute_ops if op.kind == "rms_norm")
    assert dict(s[norm.name].degrees) == {"n": 2, "s": 4}  # tokens by tp (sequence parallel) x cp
    with torch.no_grad():
        assert torch.allclose(run_graph(g, m, x, s), m(*x), rtol=1e-5, atol=1e-6)
    # the later chunk of a causal attention reads the keys before it and computes the most
    from flexflow.strategy.regions import partitions
    from flexflow.graph.ops import RULES
    parts = partitions(attn, s[attn.name])
    T = attn.output_shape[2]
    first = next(p for p in parts if p.block["l"] == (0, T // 2))
    later = next(p for p in parts if p.block["l"] == (T // 2, T))
    assert first.inputs[1][2] == slice(0, T // 2) and later.inputs[1][2] == slice(0, T)
    f0, f1 = (RULES["attention"].flops(attn, p.block) for p in (first, later))
    assert f1 == 3 * f0  # the causal triangle: 1/4 and 3/4 of the op's count
    assert s.name == "megatron_cp2"
    with pytest.raises(StrategyError, match="does not divide"):
        ff.Strategy.megatron(g, mach, tp=2, cp=3)
    # one long sequence (a batch of one: its tokens stay splittable attributes)
    m1, x1, g1 = _llama(batch=1)
    assert g1.batch_size == 1 and all(op.sample_dim is None for op in g1.compute_ops)
    s1 = ff.Strategy.megatron(g1, mach, tp=2, cp=4)
    attn1 = next(op for op in g1.compute_ops if op.rule == "attention")
    assert dict(s1[attn1.name].degrees) == {"h": 2, "z": 4} and len(s1.devices_used()) == 8
    with torch.no_grad():
        assert torch.allclose(run_graph(g1, m1, x1, s1), m1(*x1), rtol=1e-5, atol=1e-6)


def test_balanced_context_parallelism_lays_the_tokens_out_head_tail():
    """megatron(cp=c) by default: the causal attention split head-tail (z), every block the
    same share of the triangle reading all the keys; the executor's reordering is the
    rotary tables' and the inputs'; the plan computes what the module does."""
    from flexflow.strategy.regions import partitions
    from flexflow.graph.ops import RULES
    from flexflow.strategy.layout import token_layout
    m, x, g = _llama(batch=2)
    mach = ff.Machine.preset("h100-cluster", devices=8)
    s = ff.Strategy.megatron(g, mach, tp=2, cp=2)
    attn = next(op for op in g.compute_ops if op.rule == "attention")
    assert dict(s[attn.name].degrees) == {"n": 2, "h": 2, "z": 2}
    T = attn.output_shape[2]
    parts = partitions(attn, s[attn.name])
    assert all(p.inputs[1][2] == slice(0, T) for p in parts)  # every block reads every key
    assert len({RULES["attention"].flops(attn, p.block) for p in parts}) == 1  # and computes alike
    lay = token_layout(g, 2)
    assert {n for n in lay.values if g.op(n).kind == "input"} == {"tokens", "targets"}
    tables = [n for n in lay.values if g.op(n).kind == "constant"]  # the rotary cos and sin tables
    assert len(tables) >= 4 and all(lay.values[n] == (g.op(n).output_shape[-1], T) and g.op(n).output_shape[0] == T
                                  for n in tables)
    with torch.no_grad():
        assert torch.allclose(run_graph(g, m, x, s), m(*x), rtol=1e-5, atol=1e-6)


def test_a_fused_projection_laid_out_by_heads_splits_without_exchanges():
    """GPT-2's fused q/k/v projection laid out [q | k | v] makes a column-parallel split
    cut across q, k and v (their blocks then cross the group); Megatron-LM's layout, each
    head's q, k, v side by side (``qkv="heads"``), hands each rank its own heads' q, k, v."""
    from flexflow.models.gpt2 import GPT2, GPT2Config
    mach = ff.Machine.preset("h100-cluster", devices=4)
    comm = {}
    for qkv in ("blocks", "heads"):
        torch.manual_seed(0)
        m = GPT2(GPT2Config(layers=2, width=32, heads=4, vocab=64, seq_len=16, positions=16, qkv=qkv))
        x = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
        g = ff.trace(m, x)
        s = ff.Strategy.megatron(g, mach, tp=4)
        with torch.no_grad():
            assert torch.allclose(run_graph(g, m, x, s), m(*x), rtol=1e-5, atol=1e-6)
        comm[qkv] = ff.Simulator(g, mach).simulate(s).comm_bytes
        if qkv == "heads":
            split = [op for op in g.compute_ops if op.name.startswith("split")]
            assert split and all(dict(s[op.name].degrees) == {"h": 4} for op in split)
    assert comm["heads"] < comm["blocks"]
    with pytest.raises(ValueError, match="qkv must be"):
        GPT2(GPT2Config(layers=1, width=32, heads=4, vocab=64, seq_len=16, positions=16, qkv="interleaved"))


def _pipelined(rank: int, tp: int, pp: int, microbatches: int):
    from _dist_workers import _rel_err, _train
    import torch.distributed as dist
    torch.set_num_threads(1)
    m, x, g = _llama(batch=4)
    ref = copy.deepcopy(m)
    ref_losses = _train(ref, ref, 4)
    world = dist.get_world_size()
    s = ff.Strategy.megatron(g, ff.Machine.preset("h100-cluster", devices=world), tp=tp, pp=pp,
                             microbatches=microbatches)
    par = ff.parallelize(m, world, example_inputs=x, strategy=s)
    losses = _train(par, m, 4)
    rt = par.runtime
    kinds = sorted({ex.coll.kind for r in getattr(rt, "runtimes", [rt]) for ex in getattr(r, "exchanges", [])
                    if ex.coll is not None})
    state = par.state_dict()
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_err": max(_rel_err(state[k], ref.state_dict()[k]) for k in ref.state_dict()), "kinds": kinds}


@pytest.mark.slow
def test_tensor_parallel_collectives_inside_a_pipeline_on_8_ranks():
    """TP 4 x PP 2, two micro-batches, 8 processes: each stage's transitions run as collectives
    on its group (the stages' members meet them in the same micro-batch order); equal to one
    process (float32)."""
    res = launch(_pipelined, 8, 4, 2, 2, timeout_s=300)
    for r in res:
        assert r["kinds"] == ["gather", "scatter"], r
        assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, r
