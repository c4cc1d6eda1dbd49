"""Workers for tests/test_native.py: a plan handed to torch's own engines (FSDP2, DTensor
tensor parallelism) through ``plan.parallelize_fn``, trained and compared with the plain
module in one process."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import flexflow as ff

STEPS = 3
LR = 0.05


def _batch(step: int, batch: int, cfg):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=g)
    return ids, torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=g)


def _losses(model, batch, cfg, mesh=None) -> list[float]:
    """SGD steps; under a mesh each data-parallel rank feeds its share of the batch, and the
    loss reported is the mean of the shares' (the global batch's loss)."""
    from flexflow.native import local_batch
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        data = _batch(step, batch, cfg)
        loss = model(*(local_batch(data, mesh) if mesh is not None else data))
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if mesh is not None:
            dist.all_reduce(value)
            value /= dist.get_world_size()  # (tensor-parallel ranks hold the same share's loss)
        out.append(float(value))
    return out


def train_native(rank: int, strategy: str, tp: int, batch: int = 8) -> dict:
    """Plan the zoo's small LLaMA with ``strategy`` (fsdp | fsdp_tp | fsdp_tp_rc |
    data_parallel), apply it with torch's engines on a mesh of the world's ranks, train
    3 SGD steps; rank 0 also trains the plain module."""
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    world = dist.get_world_size()
    torch.manual_seed(0)
    module, inputs = ff.models.get("llama", size="small", batch_size=batch)
    cfg = module.config
    ref = copy.deepcopy(module)
    graph = ff.trace(module, inputs)
    machine = ff.Machine.preset("cpu", devices=world)
    s = {"fsdp": lambda: ff.Strategy.fsdp(graph, machine),
         "data_parallel": lambda: ff.Strategy.data_parallel(graph, machine),
         "fsdp_tp": lambda: ff.Strategy.megatron(graph, machine, tp=tp, shard=3),
         "fsdp_tp_rc": lambda: ff.Strategy.megatron(graph, machine, tp=tp, shard=3).recompute_blocks()}[strategy]()
    plan = ff.plan(module, machine, inputs, strategy=s)
    desc = plan.native()
    mesh = init_device_mesh("cpu", tuple(desc["mesh"]["shape"]), mesh_dim_names=tuple(desc["mesh"]["dim_names"]))
    model = plan.parallelize_fn()(module, mesh)
    losses = _losses(model, batch, cfg, mesh)
    out = {"losses": losses, "mesh": desc["mesh"], "styles": len(desc["tensor_parallel"]),
           "checkpoint": desc["checkpoint"]}
    if rank == 0:
        out["reference"] = _losses(ref, batch, cfg)
    return out


def _llama4(batch: int, device=None):
    """The zoo's small LLaMA with 4 blocks (2 stages x 2 chunks for interleaving)."""
    import dataclasses

    from flexflow.models import config
    from flexflow.models.llama import Llama
    cfg = dataclasses.replace(config("llama", "small", None), layers=4)
    torch.manual_seed(0)
    if device == "meta":
        with torch.device("meta"):
            return Llama(cfg), cfg
    return Llama(cfg), cfg


PIPES = {  # name -> (world, megatron args)
    "pp2": (2, dict(tp=1, pp=2, microbatches=2)),
    "pp2_interleaved": (2, dict(tp=1, pp=2, microbatches=2, interleave=2)),
    "pp2_fsdp2": (4, dict(tp=1, shard=3, pp=2, microbatches=2, schedule="gpipe")),
    "pp2_tp2": (4, dict(tp=2, shard=3, pp=2, microbatches=2)),
}


def train_pipeline(rank: int, kind: str, batch: int = 8) -> dict:
    """Plan the 4-block LLaMA as pipeline ``kind`` (:data:`PIPES`), build this rank's stage
    and schedule with ``plan.pipeline`` on torch.distributed.pipelining, train 3 SGD steps
    (each data-parallel rank feeding its share); rank 0 also trains the plain module."""
    from torch.distributed.device_mesh import init_device_mesh

    from flexflow.native import local_batch
    torch.set_num_threads(1)
    world, args = PIPES[kind]
    module, cfg = _llama4(batch)
    ref = copy.deepcopy(module)
    inputs = _batch(0, batch, cfg)
    graph = ff.trace(module, inputs)
    machine = ff.Machine.preset("cpu", devices=world)
    plan = ff.plan(module, machine, inputs, strategy=ff.Strategy.megatron(graph, machine, **args))
    desc = plan.native()
    mesh = init_device_mesh("cpu", tuple(desc["mesh"]["shape"]), mesh_dim_names=tuple(desc["mesh"]["dim_names"]))
    pipe = plan.pipeline(module, mesh)
    stage, schedule = pipe
    params = [p for s in pipe.stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = pipe.step(*local_batch(_batch(step, batch, cfg), mesh))
        opt.step()
        value = torch.zeros(()) if loss is None else loss.detach().clone()
        dist.all_reduce(value)
        value /= world // mesh["pp"].size()  # (the ranks holding the last stage)
        losses.append(float(value))
    out = {"losses": losses, "mesh": desc["mesh"], "pipeline": {k: desc["pipeline"][k] for k in
                                                                 ("stages", "schedule", "microbatches")},
           "schedule": type(schedule).__name__}
    if rank == 0:
        out["reference"] = _losses(ref, batch, cfg)
    return out
