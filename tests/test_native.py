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
    assert tp["layers.0.attention.wq"] == tp["layers.0.feed_forward.w1"] == "ColwiseParallel"
    assert tp["layers.0.attention.wo"] == tp["layers.0.feed_forward.w2"] == "RowwiseParallel"
    assert "tok_embeddings" in d["replicated_in_tp"]
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


def test_a_plan_off_the_mesh_names_the_first_op_that_does_not_map():
    module, inputs, graph, machine = _llama(4)
    with pytest.raises(StrategyError, match=r"\[.*\].*runs on devices .* not on the whole mesh"):
        ff.plan(module, machine, inputs, strategy=ff.Strategy.random(graph, machine, 0)).native()
    with pytest.raises(StrategyError, match="shard level 1"):
        ff.plan(module, machine, inputs, strategy=ff.Strategy.zero(graph, machine, 1)).native()
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
        assert res[0]["mesh"]["shape"] == [world // tp, tp] and res[0]["styles"] == 14


@pytest.mark.slow
def test_the_example_trains_under_torchrun_as_one_process():
    """examples/native_fsdp_tp.py: planned on the meta device, trained with FSDP2 x TP under
    torchrun on 4 gloo processes; its losses are the plain module's with AdamW."""
    import os
    import re
    import subprocess
    import sys

    import torch
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        os.path.join(root, "examples", "native_fsdp_tp.py"), "--steps", "3"],
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
