"""A flexflow plan in torch's own terms (plan.native(), plan.parallelize_fn()): the
description of the plans on one device mesh, the error for plans off it, and training
through FSDP2 and DTensor tensor parallelism on gloo processes equal to one process."""
import pytest

import _native_workers as W
import flexflow as ff
from flexflow.launch import launch
from flexflow.strategy.config import StrategyError

TOL = 1e-5


def _llama(devices=4):
    module, inputs = ff.models.get("llama", size="small", batch_size=8, device="meta")
    return module, inputs, ff.trace(module, inputs), ff.Machine.preset("h100-cluster", devices=devices)


def test_native_describes_the_mesh_family_as_torchtitan_would():
    module, inputs, graph, machine = _llama(8)
    p = ff.plan(module, machine, inputs, strategy=ff.Strategy.megatron(graph, machine, tp=4, shard=3),
                precision="bf16-true")
    d = p.native()
    assert d["mesh"] == {"shape": [2, 4], "dim_names": ["dp_shard", "tp"]}
    tp = d["tensor_parallel"]
    # Megatron's sequence parallelism, as torchtitan writes it: flexflow splits the norms by tokens
    assert d["sequence_parallel"]
    assert tp["layers.0.attention.wq"] == tp["layers.0.feed_forward.w1"] == "ColwiseParallel()"
    # the sequence gathered once at the attention's and the MLP's input (their first argument)
    assert tp["layers.0.attention"] == ("PrepareModuleInput(input_layouts=(Shard(1), None, None), "
                                        "desired_input_layouts=(Replicate(), None, None), use_local_output=True)")
    assert tp["layers.0.feed_forward"].startswith("PrepareModuleInput(input_layouts=(Shard(1),),")
    assert tp["layers.0.attention.wo"] == tp["layers.0.feed_forward.w2"] == "RowwiseParallel(output_layouts=Shard(1))"
    assert tp["layers.1.ffn_norm"] == "SequenceParallel()"
    assert tp["tok_embeddings"] == "RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))"
    assert tp["norm"].startswith("PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)")
    assert d["replicated_in_tp"] == ["output"]
    units = [u["module"] for u in d["fully_shard"]]
    assert units[-1] == "" and units[:2] == ["layers.0", "layers.1"]
    assert all(u["reshard_after_forward"] and u["mp_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
               for u in d["fully_shard"])
    fsdp = ff.plan(module, machine, inputs, strategy=ff.Strategy.fsdp(graph, machine)).native()
    assert fsdp["mesh"] == {"shape": [8], "dim_names": ["dp_shard"]} and not fsdp["tensor_parallel"]
    z2 = ff.plan(module, machine, inputs, strategy=ff.Strategy.zero(graph, machine, 2)).native()
    assert not any(u["reshard_after_forward"] for u in z2["fully_shard"])
    dp = ff.plan(module, machine, inputs, strategy=ff.Strategy.data_parallel(graph, machine)).native()
    assert dp["replicate"] and dp["mesh"]["dim_names"] == ["dp_replicate"]
    rc = ff.plan(module, machine, inputs, strategy=ff.Strategy.fsdp(graph, machine).recompute_blocks()).native()
    assert rc["checkpoint"] == ["layers.0", "layers.1"]
    # without sequence parallelism (one group): torch's plain TP plan, the rest replicated in it
    m4 = ff.Machine.preset("h100-cluster", devices=4)
    nosp = ff.plan(module, m4, inputs, strategy=ff.Strategy.megatron(graph, m4, tp=4, sequence_parallel=False)).native()
    assert not nosp["sequence_parallel"] and nosp["mesh"]["dim_names"][-1] == "tp"
    tp = nosp["tensor_parallel"]
    assert tp["layers.0.attention.wq"] == "ColwiseParallel" and tp["layers.0.feed_forward.w2"] == "RowwiseParallel"
    assert "layers.0.attention_norm" not in tp and "norm" not in tp


def test_a_plan_off_the_mesh_names_the_first_op_that_does_not_map():
    module, inputs, graph, machine = _llama(4)
    with pytest.raises(StrategyError, match=r"\[.*\].*runs on devices .* not on the whole mesh"):
        ff.plan(module, machine, inputs, strategy=ff.Strategy.random(graph, machine, 0)).native()
    with pytest.raises(StrategyError, match="shard level 1"):
        ff.plan(module, machine, inputs, strategy=ff.Strategy.zero(graph, machine, 1)).native()
    with pytest.raises(StrategyError, match="query rows \\(context parallelism\\)"):
        ff.plan(module, machine, inputs, strategy=ff.Strategy.megatron(graph, machine, tp=2, cp=2)).native()
    with pytest.raises(StrategyError, match="replicate \\(DDP\\) takes a 1-D mesh"):
        ff.plan(module, machine, inputs, strategy=ff.Strategy.megatron(graph, machine, tp=2)).native()


@pytest.mark.slow
@pytest.mark.parametrize("strategy,world,tp", [("fsdp", 2, 1), ("data_parallel", 2, 1), ("fsdp_tp", 4, 2),
                                               ("fsdp_tp_rc", 4, 2)])
def test_training_through_torchs_engines_equals_one_process(strategy, world, tp):
    res = launch(W.train_native, world, strategy, tp, timeout_s=240)
    ref = res[0]["reference"]
    for r in res:
        err = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        assert err <= TOL, (strategy, r["losses"], ref)
    if tp > 1:
        assert res[0]["mesh"]["shape"] == [world // tp, tp] and res[0]["styles"] == 24


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("--pp", "2")], ids=["fsdp_tp", "fsdp_tp_pp"])
def test_the_example_trains_under_torchrun_as_one_process(args):
    """examples/native_fsdp_tp.py: planned on the meta device, trained with FSDP2 x TP (and
    two pipeline stages on torch.distributed.pipelining) under torchrun on 4 gloo
    processes; its losses are the plain module's with AdamW."""
    import os
    import re
    import subprocess
    import sys

    import torch
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        os.path.join(root, "examples", "native_fsdp_tp.py"), "--steps", "3", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", r.stdout)]
    assert '"tp"' in r.stdout and len(got) == 3
    torch.manual_seed(0)
    model, batch = ff.models.get("llama", size="small", batch_size=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        ref.append(float(loss))
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(W.PIPES))
def test_a_pipelined_plan_trains_on_torch_pipelining_as_one_process(kind):
    """plan.pipeline(model, mesh): this rank's PipelineStage(s) and the schedule, cut at the
    plan's stage boundaries, with the plan's FSDP / tensor parallelism inside each stage;
    three SGD steps equal the plain module's (float32)."""
    world = W.PIPES[kind][0]
    res = launch(W.train_pipeline, world, kind, timeout_s=240)
    ref = res[0]["reference"]
    for r in res:
        err = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        assert err <= TOL, (kind, r["losses"], ref)
    want = {"pp2": "Schedule1F1B", "pp2_interleaved": "ScheduleInterleaved1F1B", "pp2_fsdp2": "ScheduleGPipe",
            "pp2_tp2": "Schedule1F1B"}[kind]
    assert res[0]["schedule"] == res[0]["pipeline"]["schedule"] == want
    stages = res[0]["pipeline"]["stages"]
    assert stages[0][0] == "tok_embeddings" and stages[-1][-2:] == ["norm", "output"]
    assert sum(len(s) for s in stages) == 4 + 3


def test_native_describes_a_3d_plan_with_its_stages():
    """LLaMA-8B on 16 H100s, TP 4 x PP 2 x FSDP 2: the mesh as the plan lays ranks out, the
    blocks of each stage, the schedule class and micro-batches, and an input spec from
    which one micro-batch is made."""
    from flexflow.native import native_plan
    module, inputs = ff.models.get("llama", size="8b", batch_size=8, seq_len=512, device="meta")
    graph = ff.trace(module, inputs)
    machine = ff.Machine.preset("h100-cluster", devices=16)
    s = ff.Strategy.megatron(graph, machine, tp=4, shard=3, pp=2, microbatches=4)
    d = native_plan(graph, s, "bf16-params")
    assert d["mesh"] == {"shape": [2, 2, 4], "dim_names": ["dp_shard", "pp", "tp"]}
    p = d["pipeline"]
    assert p["schedule"] == "Schedule1F1B" and p["microbatches"] == 4 and p["stages_per_rank"] == 1
    assert p["stages"][0][:2] == ["tok_embeddings", "layers.0"] and p["stages"][1][-2:] == ["norm", "output"]
    assert [b for st in p["stages"] for b in st if b.startswith("layers.")] == [f"layers.{i}" for i in range(32)]
    assert p["inputs"][0] == {"shape": [8, 512], "dtype": "int64", "batch_dim": 0}
    assert d["sequence_parallel"] and d["tensor_parallel"]["layers.31.attention.wq"].startswith("ColwiseParallel")
    assert d["fully_shard"][-1]["mp_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    # read as a torchtitan config: the degrees, and one tensor-parallel plan for every block
    t = d["parallelism"]
    assert (t["data_parallel_shard_degree"], t["tensor_parallel_degree"], t["pipeline_parallel_degree"]) == (2, 4, 2)
    assert t["pipeline_parallel_schedule"] == "1F1B" and t["sequence_parallel"] and t["activation_checkpoint"] == "none"
    assert t["mixed_precision_param"] == "bfloat16" and t["fsdp_reshard_after_forward"] == "always"
    block = d["block_plan"]["layers.*"]
    assert block["attention_norm"] == "SequenceParallel()" and len(block) == 11


def test_a_stage_cut_inside_a_module_or_a_tied_weight_is_refused_in_words():
    import torch

    from flexflow.native import native_plan
    from flexflow.native.split import split_stages
    from flexflow.strategy.config import ParallelConfig
    module, _ = W._llama4(8, device="meta")
    inputs = W._batch(0, 8, module.config)
    inputs = tuple(t.to("meta") for t in inputs)
    graph = ff.trace(module, inputs)
    machine = ff.Machine.preset("cpu", devices=2)
    s = ff.Strategy.megatron(graph, machine, tp=1, pp=2, microbatches=2)
    first = next(op for op in graph.compute_ops if op.module_path.startswith("layers.2."))
    c = s[first.name]
    moved = s.replace(first.name, ParallelConfig(c.degrees, (0,), c.shard, c.recompute))
    with pytest.raises(StrategyError, match=r"cut between pipeline stages 0 and 1 falls inside module layers\.2"):
        native_plan(graph, moved)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.mid = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.nn.functional.linear(self.mid(self.emb(x)), self.emb.weight).sum()
    with pytest.raises(StrategyError, match=r"emb\.weight is used on stages 0 and 1 \(tied"):
        split_stages(Tied(), [["emb"], ["mid"]], [torch.zeros(2, 3, dtype=torch.long)])
