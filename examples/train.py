"""Train a zoo model with a flexflow strategy on synthetic data.

Local processes (gloo on CPU, NCCL when there is a GPU per process):

    python examples/train.py --model transformer --size small --nprocs 2 --steps 20

Several nodes (one process per GPU):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 \\
        examples/train.py --model transformer --steps 100

Checkpoints hold the full parameters (loadable into the plain model), the
strategy and the step; each rank also saves its optimizer state for its
shards.  ``--resume`` continues with the same losses as an uninterrupted run.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import flexflow as ff
from flexflow.models._common import make_inputs


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="transformer", choices=ff.models.names())
    p.add_argument("--size", default="small", choices=("small", "paper"))
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--nprocs", type=int, default=2, help="local processes when not under torchrun")
    p.add_argument("--strategy", help="strategy JSON (default: search on rank 0)")
    p.add_argument("--budget", type=float, default=10.0, help="search seconds")
    p.add_argument("--checkpoint", help="checkpoint path (saved every --save-every steps and at the end)")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--eval-mode", action="store_true", help="dropout off (deterministic losses)")
    p.add_argument("--losses-out", help="rank 0 writes the per-step losses here (JSON)")
    return p.parse_args(argv)


def _batch(module, batch: int, step: int):
    """Synthetic batch for a step: identical on every rank, new every step."""
    return make_inputs(module.input_specs(batch), seed=10_000 + step, device="cpu",
                       dtype=next(module.parameters()).dtype)


def run(rank: int, args) -> list[float]:
    module, example = ff.models.get(args.model, size=args.size, batch_size=args.batch, seed=0)
    if args.eval_mode:
        module.eval()
    graph = ff.trace(module, example)
    ckpt = None
    if args.resume and args.checkpoint and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, weights_only=False)
    strategy = None
    if ckpt is not None:
        strategy = ff.Strategy.from_json(ckpt["strategy"], graph)
    elif args.strategy:
        with open(args.strategy) as f:
            strategy = ff.Strategy.from_json(f.read(), graph)
    model = ff.parallelize(module, None, example_inputs=example, strategy=strategy, budget=args.budget)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    start = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(torch.load(_opt_path(args.checkpoint, rank), weights_only=False))
        start = ckpt["step"]
    losses = []
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        inputs = _batch(module, args.batch, step)
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0:
            rate = args.batch * (step + 1 - start) / (time.perf_counter() - t0)
            print(f"step {step + 1:>4}/{args.steps}  loss {losses[-1]:.6f}  {rate:,.0f} samples/s", flush=True)
        if args.checkpoint and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            _save(model, opt, args, step + 1, rank)
    if rank == 0 and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"start": start, "losses": losses}, f)
    return losses


def _opt_path(path: str, rank: int) -> str:
    return f"{path}.optim-rank{rank}"


def _save(model, opt, args, step: int, rank: int) -> None:
    state = model.state_dict()  # full tensors, gathered on every rank
    torch.save(opt.state_dict(), _opt_path(args.checkpoint, rank))
    if rank == 0:
        tmp = args.checkpoint + ".tmp"
        torch.save({"model": state, "strategy": model.strategy.to_json(), "step": step,
                    "model_name": args.model}, tmp)
        os.replace(tmp, args.checkpoint)


def main(argv=None) -> None:
    start(run, parse(argv))


def start(run, args) -> None:
    """``run(rank, args)`` on every rank: under torchrun in this process (its
    process group made and destroyed here), else on ``args.nprocs`` local processes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            run(dist.get_rank(), args)
        finally:
            dist.destroy_process_group()
    else:
        ff.launch(run, args.nprocs, args)


if __name__ == "__main__":
    main()
