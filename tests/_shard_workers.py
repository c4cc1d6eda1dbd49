"""Workers for tests/test_shard_run.py (module level, so that spawn can pickle them)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flexflow as ff
from flexflow.hardware.machine import Machine


class Net(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.a = nn.Linear(width, 4 * width)
        self.b = nn.Linear(4 * width, width)

    def forward(self, x, y):
        return F.mse_loss(self.b(F.gelu(self.a(x))), y)


def holdings(rank: int, stage: int) -> dict:
    """One AdamW step under zero(stage) on the world: what this rank holds."""
    torch.manual_seed(0)
    net = Net()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    graph = ff.trace(net, (x, y))
    world = dist.get_world_size()
    strategy = ff.Strategy.zero(graph, Machine.preset("cpu", devices=world), stage)
    par = ff.parallelize(net, example_inputs=(x, y), strategy=strategy)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    rt = par.runtime
    out = {"total": sum(p.numel() for p in net.parameters())}
    for step in range(2):
        loss = par(x, y)
        out.setdefault("gathered_in_forward", sum(rt.full[q].untyped_storage().nbytes() for q in rt.full))
        loss.backward()
        out[f"full_bytes_after_backward_{step}"] = sum(rt.full[q].untyped_storage().nbytes() for q in rt.full)
        out[f"grad_numel_{step}"] = sum(p.grad.numel() for p in par.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad()
    out["held"] = sum(p.numel() for p in par.parameters())
    out["adam_numel"] = sum(t.numel() for st in opt.state.values() for k, t in st.items() if k != "step")
    out["state"] = {k: v.clone() for k, v in par.state_dict().items()}
    ref = Net()
    ref.load_state_dict({k: v for k, v in zip(ref.state_dict(), _initial())})
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        F.mse_loss(ref.b(F.gelu(ref.a(x))), y).backward()
        ropt.step()
        ropt.zero_grad()
    out["err"] = max(float((out["state"][k] - v).abs().max() / v.abs().max()) for k, v in ref.state_dict().items())
    del out["state"]
    return out


def holdings_by_stage(rank: int) -> dict:
    """:func:`holdings` at stages 1, 2 and 3 in one launch."""
    return {stage: holdings(rank, stage) for stage in (1, 2, 3)}


def _initial():
    torch.manual_seed(0)
    return [t.clone() for t in Net().state_dict().values()]


class DropBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(width, 4 * width)
        self.b = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.b(F.dropout(F.gelu(self.a(x)), 0.3, self.training))


class DropNet(nn.Module):
    """Two residual blocks with dropout: recomputing every op chains each block's ops (one
    checkpoint a block, :func:`flexflow.graph.ir.repeated_block`)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(DropBlock(width) for _ in range(2))

    def forward(self, x, y):
        for blk in self.blocks:
            x = blk(x)
        return F.mse_loss(x, y)


def recompute_same(rank: int, seed: int) -> dict:
    """Training mode (dropout): a random strategy with shard levels, run as it is and with
    every op recomputed, from the same seed: the same losses and parameters (the
    recomputation redraws the same dropout mask)."""
    from _loop_workers import with_random_shards
    torch.manual_seed(0)
    net = DropNet()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    graph = ff.trace(net, (x, y))
    mach = Machine.preset("cpu", devices=dist.get_world_size())
    base = with_random_shards(ff.Strategy.random(graph, mach, seed), graph, seed)
    rc = base
    for op in graph.compute_ops:
        rc = rc.replace(op.name, rc[op.name].with_recompute())
    init = {k: v.clone() for k, v in net.state_dict().items()}
    out = {}
    for name, s in (("plain", base), ("recomputed", rc)):
        net.load_state_dict(init)
        par = ff.parallelize(net, example_inputs=(x, y), strategy=s)
        par.train()
        opt = torch.optim.SGD(par.parameters(), lr=0.1)
        torch.manual_seed(1 + dist.get_rank())
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = par(x, y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        out[name] = (losses, {k: v.clone() for k, v in par.state_dict().items()})
    (l0, s0), (l1, s1) = out["plain"], out["recomputed"]
    return {"losses": (l0, l1), "err": max(float((s0[k] - s1[k]).abs().max()) for k in s0)}


def measured_peak(module, inputs, strategy, machine, precision: str = "32-true") -> int:
    """MemTracker's peak (CPU) over one AdamW step of ``module`` parallelized with
    ``strategy`` (after one untracked step)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    par = ff.parallelize(module, example_inputs=inputs, strategy=strategy, machine=machine,
                         reduce_outputs="eager", optimizer="adam", precision=precision)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-4)

    def step():
        xs = [x.clone() for x in inputs]
        opt.zero_grad()
        par(*xs).backward()
        opt.step()
    step()
    mt = MemTracker()
    mt.track_external(par, opt)
    with mt:
        step()
    return int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def peaks_by_stage(rank: int, name: str) -> dict:
    """Per stage (0 = data parallelism): this rank's MemTracker peak over one AdamW step
    (after one untracked step) and the simulator's prediction for its device."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module, inputs = ff.models.get(name, size="small")
    graph = ff.trace(module, inputs)
    m = Machine.preset("cpu", devices=dist.get_world_size())
    sim = ff.Simulator(graph, m, optimizer="adam", reduce_outputs="eager")
    out = {}
    for stage in (0, 1, 2, 3):
        s = ff.Strategy.zero(graph, m, stage)
        out[stage] = (measured_peak(module, inputs, s, m), int(sim.simulate(s).peak_memory[rank]))
    return out
