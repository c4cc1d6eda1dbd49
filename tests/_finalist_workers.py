"""Workers for tests/test_finalists.py (module level: spawn pickles them)."""
from __future__ import annotations

import copy
import logging
import os
import warnings

import torch

import flexflow as ff
import flexflow.finalists.measure as measure_module
from flexflow.cost.corrections import corrections_path, load_corrections
from flexflow.cost.model import CostModel

from _small_models import MLP  # four 256-wide layers at batch 128: compute dominates a step


def wide(batch: int = 128, width: int = 256):
    torch.manual_seed(0)
    return MLP(width, layers=4), (torch.randn(batch, width), torch.randn(batch, width))


class Flattering(CostModel):
    """A cost model wrong on purpose: an op partition that holds its whole op (no split)
    costs almost nothing, so everything on one device looks far faster than any split."""

    def op_time(self, op, part, device):
        f, b = super().op_time(op, part, device)
        whole = all(tuple(part.block[d.name]) == (0, d.size) for d in op.dims if d.name in part.block)
        return (f * 1e-3, b * 1e-3) if whole else (f, b)


def _sgd_losses(model, batch, steps: int = 2) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        out.append(float(loss))
    return out


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def flattered(rank: int) -> dict:
    """parallelize with a cost model that flatters everything-on-one-device: what the
    finalists measured, what was chosen, the losses of two SGD steps (and one process's)."""
    torch.set_num_threads(1)
    log = logging.getLogger("flexflow")
    lines = _Lines()
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    module, batch = wide()
    ref = copy.deepcopy(module)
    machine = ff.Machine.preset("cpu", devices=2)
    par = ff.parallelize(module, 2, example_inputs=batch, machine=machine, budget=2.0,
                         cost_model=Flattering(machine))
    p = par.plan
    whole = {f.name: len(f.strategy.devices_used()) == 1 for f in p.finalists}
    out = {"plan": p.to_json(), "chosen": p.chosen, "simulator_choice": p.simulator_choice,
           "measured": {f.name: f.measured_s for f in p.finalists},
           "predicted": {f.name: f.predicted_s for f in p.finalists}, "one_device": whole,
           "runs": par.strategy == p.strategy, "lines": lines.lines,
           "losses": _sgd_losses(par, batch), "stored": corrections_path(machine).exists()}
    if rank == 0:
        out["reference"] = _sgd_losses(ref, batch)
    log.removeHandler(lines)
    return out


def learning(rank: int, fail: str) -> dict:
    """parallelize on the host's own cost model twice (the corrections stored by the first
    are used by the second), with one finalist failing on rank 1 only in the second call;
    then ff.plan with the devices at hand."""
    torch.set_num_threads(1)
    module, batch = wide(batch=64, width=64)
    machine = ff.Machine.preset("cpu", devices=2)
    first = ff.parallelize(module, 2, example_inputs=batch, machine=machine, budget=2.0, profile=False)
    stored = load_corrections(machine, first.graph.fingerprint())
    steps = measure_module._Run.steps

    def failing(self, n, inputs, kwargs):  # the first timed steps, after the warm-up
        self.calls = getattr(self, "calls", 0) + 1
        if self.f.name == fail and rank == 1 and self.calls == 2:
            raise RuntimeError("out of memory on purpose")
        return steps(self, n, inputs, kwargs)

    measure_module._Run.steps = failing
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = ff.parallelize(module, 2, example_inputs=batch, machine=machine, budget=2.0, profile=False,
                                    timeout_s=4.0)
    finally:
        measure_module._Run.steps = steps
    ref = copy.deepcopy(module)
    planned = ff.plan(module, machine, batch, evaluations=20, finalist_steps=2, measure=True)
    return {"first": first.plan.to_json(), "second": second.plan.to_json(),
            "stored": stored.factors(), "path": os.path.exists(corrections_path(machine)),
            "warnings": [str(w.message) for w in caught],
            "losses": _sgd_losses(second, batch), "reference": _sgd_losses(ref, batch) if rank == 0 else None,
            "planned": planned.to_json()}
