"""Workers for tests/test_plan.py (module level: spawn pickles them)."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

import flexflow as ff
from flexflow.strategy import StrategyError


class Tiny(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def tiny(batch: int = 8, width: int = 16):
    torch.manual_seed(0)
    return Tiny(width), (torch.randn(batch, width), torch.randn(batch, width))


def _sgd_losses(model, batch, steps: int = 2) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def run_plan(rank: int, plan_json: str, other_json: str) -> dict:
    """Every rank: run the given plan for two SGD steps; the losses and, on rank 0, one
    process's; then the refusal of a plan made for 4 devices."""
    module, batch = tiny()
    ref = copy.deepcopy(module)
    par = ff.parallelize(module, 2, example_inputs=batch, plan=plan_json)
    out = {"losses": _sgd_losses(par, batch), "chosen": par.plan.chosen, "strategy": par.plan.strategy.to_json(),
           "same_graph": par.plan.strategy.graph is par.graph}
    if rank == 0:
        out["reference"] = _sgd_losses(ref, batch)
    try:
        ff.parallelize(tiny()[0], 2, example_inputs=batch, plan=other_json)
        out["refused"] = None
    except StrategyError as e:
        out["refused"] = str(e)
    return out


def plan_on_rank0_then_broadcast(rank: int) -> dict:
    """Rank 0 plans alone inside the 2-process group (as a user plans once and broadcasts);
    ``ff.plan`` must join no collective of the group, so rank 1's broadcast receives it."""
    import torch.distributed as dist
    module, batch = tiny()
    box = [None]
    if rank == 0:
        box = [ff.plan(module, ff.Machine.preset("cpu", devices=2), batch, evaluations=20).to_json()]
    dist.broadcast_object_list(box, src=0)
    plan = ff.Plan.from_json(box[0])
    return {"type": type(box[0]).__name__, "chosen": plan.chosen}
