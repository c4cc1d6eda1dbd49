"""Plan with flexflow, train with torch's own engines (FSDP2 x DTensor tensor parallelism,
and torch.distributed.pipelining with --pp).

    torchrun --nproc-per-node 4 examples/native_fsdp_tp.py [--tp 2] [--pp 1] [--steps 5] [--plan plan.json]

Rank 0 plans the model on the ``meta`` device (no memory) for the run's ranks, with the
FSDP x TP plan (``Strategy.megatron(tp=..., shard=3)``) or a plan file made elsewhere, and
prints ``plan.native()``: the mesh, the tensor-parallel style of each module, the FSDP
units.  Every rank then builds the real model, applies the plan with
``plan.parallelize_fn()`` on a device mesh of that shape, and trains with a plain loop:
FSDP2, DTensor and AdamW do the work, no flexflow runtime.  With ``--pp 2`` the plan has
two pipeline stages (two micro-batches, 1F1B) and each rank runs its stage through
``flexflow.native.pipe.pipeline`` (a ``PipelineStage`` and the schedule).  On CPUs the process group is
gloo (one thread a rank); on GPUs, NCCL.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import flexflow as ff


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (the rest is FSDP)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (two micro-batches a step)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--plan", default=None, help="a plan file (ff.plan(...).to_json()) instead of FSDP x TP")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    try:
        # plan once, on rank 0, on the meta device; every rank gets the plan's JSON
        box = [None]
        if rank == 0:
            meta, inputs = ff.models.get("llama", size="small", batch_size=a.batch, device="meta")
            machine = ff.Machine.preset("cpu" if not cuda else "h100-node", devices=world)
            if a.plan:
                with open(a.plan) as f:
                    plan = ff.Plan.from_json(f.read())
                desc = plan.native(ff.trace(meta, inputs))
            else:
                graph = ff.trace(meta, inputs)
                strategy = ff.Strategy.megatron(graph, machine, tp=a.tp, shard=3, pp=a.pp,
                                                microbatches=2 if a.pp > 1 else 1)
                desc = ff.plan(meta, machine, inputs, strategy=strategy).native()
            print(json.dumps(desc, indent=1), flush=True)
            box = [desc]
        dist.broadcast_object_list(box, src=0)
        desc = box[0]

        torch.manual_seed(0)  # the same initial weights on every rank
        model, batch = ff.models.get("llama", size="small", batch_size=a.batch)
        if cuda:
            model = model.cuda()
            batch = tuple(t.cuda() for t in batch)
        mesh = init_device_mesh("cuda" if cuda else "cpu", tuple(desc["mesh"]["shape"]),
                                mesh_dim_names=tuple(desc["mesh"]["dim_names"]))
        from flexflow.native import local_batch, parallelize_fn
        from flexflow.native.pipe import pipeline
        mine = local_batch(batch, mesh)  # this data-parallel rank's share (a TP group shares one)
        if desc["pipeline"] is None:
            model = parallelize_fn(desc)(model, mesh)
            params, holders = list(model.parameters()), world
        else:  # this rank's stage of the module, and the schedule
            pipe = pipeline(desc, model, mesh)
            params = [p for stage in pipe.stages for p in stage.submod.parameters()]
            holders = world // mesh["pp"].size()  # the ranks of the last stage hold the loss
        opt = torch.optim.AdamW(params, lr=1e-3)
        for step in range(a.steps):
            opt.zero_grad()
            if desc["pipeline"] is None:
                loss = model(*mine)
                loss.backward()
            else:
                loss = pipe.step(*mine)  # the micro-batches' mean loss on the last stage, else None
            opt.step()
            value = torch.zeros(()) if loss is None else loss.detach().clone()
            if cuda:
                value = value.cuda()
            dist.all_reduce(value)  # the global batch's loss: the mean of the shares'
            if rank == 0:
                print(f"step {step}: loss {float(value) / holders:.6f}", flush=True)
        dist.barrier()  # every rank's collectives finished before the group goes
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
