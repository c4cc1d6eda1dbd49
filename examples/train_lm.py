"""Train a zoo language model with a flexflow strategy: AdamW, warmup + cosine
learning rate, global-norm clipping, gradient accumulation, checkpoint/resume.

Local processes (gloo on CPU, NCCL when there is a GPU per process):

    python examples/train_lm.py --nprocs 2 --steps 50 --accum 2 --clip 1.0 --ckpt-dir ckpt

One process per GPU (or CPU rank) under torchrun, several nodes alike:

    torchrun --nproc-per-node 2 examples/train_lm.py --steps 50 --ckpt-dir ckpt
    torchrun --nproc-per-node 2 examples/train_lm.py --steps 100 --ckpt-dir ckpt --resume

The data is synthetic: each step's micro-batches are made from --seed and the
step number, identical on every rank (every rank passes the same global batch;
flexflow's strategy decides who computes what).  A checkpoint is a
torch.distributed.checkpoint folder: the model and the AdamW state as sharded
state dicts (each rank writes only the blocks it holds, nothing is gathered),
the scheduler and the step; meta.json adds the strategy.  With the same number
of processes a resumed run takes the checkpoint's strategy and continues with
the same losses; with another number it runs --strategy (or searches), and
each rank reads just the parts of the checkpoint its blocks need.  The model
loads into the plain module too:

    state = {"model": module.state_dict()}
    torch.distributed.checkpoint.load(state, checkpoint_id="ckpt/step-000050")
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import flexflow as ff

LMS = ("transformer", "rnnlm")  # the zoo models whose inputs are (tokens, targets)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="transformer", choices=LMS)
    p.add_argument("--size", default="small", choices=("small", "paper"))
    p.add_argument("--batch", type=int, default=8, help="global batch of one micro-batch (sequences)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all (the schedule's length)")
    p.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this step, as if "
                   "interrupted; --resume with the same --steps continues the same schedule")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=5, help="linear warmup steps, then cosine to 0 at --steps")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-params"],
                   help="bf16-mixed: compute in bfloat16 (autocast), float32 parameters and AdamW state; "
                        "bf16-params: every parameter cast to bfloat16 for compute (a bfloat16 residual "
                        "stream, as FSDP2's MixedPrecisionPolicy), float32 parameters and AdamW state")
    p.add_argument("--seed", type=int, default=0, help="weights, data and dropout")
    p.add_argument("--nprocs", type=int, default=2, help="local processes when not under torchrun")
    p.add_argument("--strategy", help="strategy JSON file (default: a resume with as many processes "
                   "runs the checkpoint's; otherwise rank 0 searches)")
    p.add_argument("--budget", type=float, default=5.0, help="search seconds")
    p.add_argument("--ckpt-dir", help="checkpoint folder")
    p.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints (and one at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--losses-out", help="rank 0 writes the per-step losses here (JSON)")
    args = p.parse_args(argv)
    if args.accum < 1 or args.steps < 1 or args.batch < 1:
        p.error("--accum, --steps and --batch must be positive")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    args.end = min(args.steps, args.stop_after or args.steps)  # the last step this run makes
    return args


# -- data ------------------------------------------------------------------------
def micro_batch(args, vocab: int, seq_len: int, step: int, k: int):
    """Micro-batch k of a step: (tokens, targets), the same on every rank.

    Each row counts up from a random start with a random stride (mod vocab),
    so there is something to learn; targets are the tokens shifted by one."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + k)
    start = torch.randint(0, vocab, (args.batch, 1), generator=gen)
    stride = torch.randint(1, 4, (args.batch, 1), generator=gen)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def lr_lambda(args):
    """Multiplier of --lr at a step: linear warmup, then cosine decay to 0."""
    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


# -- checkpoints ------------------------------------------------------------------
# ckpt-dir/step-000010/ is a torch.distributed.checkpoint folder (one file per rank,
# .metadata) with meta.json; ckpt-dir/latest names the newest complete one (written
# last, by rank 0).
def latest(ckpt_dir: str) -> str | None:
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return os.path.join(ckpt_dir, f.read().strip())


def state(par, opt, sched, step: int = 0) -> dict:
    """What a checkpoint holds, as torch.distributed.checkpoint saves it and loads into it.
    ``full=False``: sharded values, no gather (each rank writes and reads its own blocks)."""
    return {"model": par.state_dict(full=False), "optim": par.optim_state_dict(opt),
            "scheduler": sched.state_dict(), "step": step}


def save(par, opt, sched, args, step: int, rank: int, world: int) -> None:
    folder = os.path.join(args.ckpt_dir, f"step-{step:06d}")
    dcp.save(state(par, opt, sched, step), checkpoint_id=folder)  # collective: every rank calls it
    if rank == 0:
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump({"step": step, "world_size": world, "model": args.model, "size": args.size,
                       "batch": args.batch, "steps": args.steps, "strategy": par.strategy.to_json()}, f)
    dist.barrier()  # every rank's files are written before "latest" points at them
    if rank == 0:
        tmp = os.path.join(args.ckpt_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(folder))
        os.replace(tmp, os.path.join(args.ckpt_dir, "latest"))


def load(par, opt, sched, folder: str) -> int:
    """Load a checkpoint (of any strategy and number of processes); its step."""
    loaded = state(par, opt, sched)
    dcp.load(loaded, checkpoint_id=folder)  # into this rank's shards and optimizer state
    par.load_state_dict(loaded["model"])
    par.load_optim_state_dict(opt, loaded["optim"])
    sched.load_state_dict(loaded["scheduler"])
    return int(loaded["step"])


# -- training ----------------------------------------------------------------------
def run(rank: int, args) -> list[float]:
    world = dist.get_world_size()
    module, example = ff.models.get(args.model, size=args.size, batch_size=args.batch, seed=args.seed)
    vocab, seq_len = module.input_specs(1)[0].high, example[0].shape[1]

    # A resume with as many processes runs the checkpoint's strategy (the same floats);
    # with another number, --strategy or a search (the checkpoint reshards).
    folder = latest(args.ckpt_dir) if args.resume else None
    strategy_json = meta = None
    if folder is not None:
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
    if args.strategy:
        with open(args.strategy) as f:
            strategy_json = f.read()
    elif meta is not None and meta["world_size"] == world:
        strategy_json = meta["strategy"]
    strategy = ff.Strategy.from_json(strategy_json, ff.trace(module, example)) if strategy_json else None
    par = ff.parallelize(module, None, example_inputs=example, strategy=strategy,
                         budget=args.budget, optimizer="adam", precision=args.precision)

    opt = torch.optim.AdamW(par.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    start = 0
    if folder is not None:
        start = load(par, opt, sched, folder)
        if rank == 0:
            print(f"resumed from {folder} at step {start} ({meta['world_size']} processes, "
                  f"now {world})", flush=True)
            if meta["steps"] != args.steps:
                print(f"note: --steps {args.steps}, the checkpoint's run had {meta['steps']}: "
                      f"the learning-rate schedule changes from here", flush=True)

    par.train()
    losses, tokens_per_step = [], args.batch * seq_len * args.accum
    max_norm = args.clip if args.clip > 0 else float("inf")  # inf: report the norm, scale nothing
    t0 = time.perf_counter()
    for step in range(start, args.end):
        # Dropout masks from a per-step seed: a resumed run draws the same ones.
        torch.manual_seed(args.seed * 1_000_003 + step)
        opt.zero_grad()
        loss_sum = 0.0
        for k in range(args.accum):
            tokens, targets = micro_batch(args, vocab, seq_len, step, k)
            # All but the last micro-batch accumulate locally; the last backward all-reduces.
            sync = contextlib.nullcontext() if k == args.accum - 1 else par.no_sync()
            with sync:
                loss = par(tokens, targets)
                (loss / args.accum).backward()
            loss_sum += loss.item()  # read after backward: no extra collective
        # The norm of the whole model's gradients, the same on every rank.
        norm = torch.nn.utils.clip_grad_norm_(par.parameters(), max_norm)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        losses.append(loss_sum / args.accum)

        done = step + 1
        if rank == 0 and (done % args.log_every == 0 or done == args.end):
            rate = tokens_per_step * (done - start) / (time.perf_counter() - t0)
            print(f"step {done:>5}/{args.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}  "
                  f"grad-norm {float(norm):.3f}  {rate:,.0f} tokens/s", flush=True)
        if args.ckpt_dir and (done % args.ckpt_every == 0 or done == args.end):
            save(par, opt, sched, args, done, rank, world)

    if rank == 0 and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"start": start, "losses": losses}, f)
    return losses


def check_resume(args) -> None:
    """Refuse, before starting any process, a resume from a checkpoint of another
    model or batch (another number of processes is fine: the checkpoint reshards)."""
    folder = latest(args.ckpt_dir) if args.resume else None
    if folder is None:
        return
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    if (meta["model"], meta["size"], meta["batch"]) != (args.model, args.size, args.batch):
        sys.exit(f"cannot resume {folder}: it is {meta['model']}/{meta['size']} with --batch {meta['batch']}, "
                 f"this run is {args.model}/{args.size} with --batch {args.batch}")


def main(argv=None) -> None:
    args = parse(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        check_resume(args)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        try:
            run(dist.get_rank(), args)
        finally:
            dist.destroy_process_group()  # explicit: gloo may abort at interpreter exit otherwise
    else:  # spawn --nprocs local processes; ff.launch makes and destroys the process group
        check_resume(args)
        ff.launch(run, args.nprocs, args)


if __name__ == "__main__":
    main()
