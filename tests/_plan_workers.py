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


def run_plan(rank: int, plan_json: str, other_json: str) -> dict:
    """Every rank: run the given plan for two SGD steps; the losses and, on rank 0, one
    process's; then the refusal of a plan made for 4 devices."""
    module, batch = tiny()
    ref = copy.deepcopy(module)
    par = ff.parallelize(module, 2, example_inputs=batch, plan=plan_json)
    opt = torch.optim.SGD(par.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = par(*batch)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    out = {"losses": losses, "chosen": par.plan.chosen, "strategy": par.plan.strategy.to_json(),
           "same_graph": par.plan.strategy.graph is par.graph}
    if rank == 0:
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        ref_losses = []
        for _ in range(2):
            ropt.zero_grad()
            loss = ref(*batch)
            loss.backward()
            ropt.step()
            ref_losses.append(float(loss))
        out["reference"] = ref_losses
    try:
        ff.parallelize(tiny()[0], 2, example_inputs=batch, plan=other_json)
        out["refused"] = None
    except StrategyError as e:
        out["refused"] = str(e)
    return out
