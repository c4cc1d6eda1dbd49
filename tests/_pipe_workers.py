"""Workers for tests/test_pipeline_run.py: pipelined strategies trained on every rank
against the plain module in one process (the reference runs on every rank: the models
are small)."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

import flexflow as ff
from flexflow.hardware.machine import Machine
from flexflow.runtime.plan import ExecutorError

STEPS = 3
LR = 0.05


class DeepMLP(nn.Module):
    """Eight tanh layers (repeated blocks) and a classifier."""

    def __init__(self, width=24, layers=8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))
        self.head = nn.Linear(width, 4)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x), y)


def _model(name: str, batch: int):
    if name == "mlp":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = DeepMLP()
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(batch, 24, generator=g), torch.randint(0, 4, (batch,), generator=g))
                   for _ in range(STEPS)]
        return module, batches
    module, inputs = ff.models.get(name, batch_size=batch, size="small", seed=0)
    batches = [ff.models.get(name, batch_size=batch, size="small", seed=s)[1] for s in range(1, STEPS + 1)]
    return module, [inputs] + batches[1:]


def _train(model, batches, opt, accumulate: bool, clip: float | None):
    losses = []
    for inputs in batches:
        if accumulate:  # the batch in two halves: the first backward without a sync
            halves = [tuple(x.chunk(2)[i] for x in inputs) for i in range(2)]
            sync = getattr(model, "no_sync", None)
            with sync() if sync is not None else torch.enable_grad():
                (model(*halves[0]) / 2).backward() if sync is None else model(*halves[0]).backward()
            loss = model(*halves[1])
            (loss / 2).backward() if sync is None else loss.backward()
            if sync is not None:  # the pipelined loss is the half's mean: scale the gradients as one process
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(2)
        else:
            loss = model(*inputs)
            loss.backward()
        if clip is not None:
            (model.clip_grad_norm_ if hasattr(model, "clip_grad_norm_") and hasattr(model, "runtime")
             else lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c))(clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def case(name: str, batch: int, kw: dict, *, recompute=False, accumulate=False, clip=None,
         precision: str = "32-true") -> dict:
    world = torch.distributed.get_world_size()
    module, batches = _model(name, batch)
    ref = copy.deepcopy(module)
    graph = ff.trace(module, batches[0] if not accumulate else tuple(x.chunk(2)[0] for x in batches[0]))
    machine = Machine.preset("cpu", devices=world)
    s = ff.Strategy.megatron(graph, machine, **kw)
    if recompute:
        s = s.recompute_blocks()
    example = graph and (batches[0] if not accumulate else tuple(x.chunk(2)[0] for x in batches[0]))
    pm = ff.parallelize(module, example_inputs=example, strategy=s, machine=machine, precision=precision)
    try:
        got = _train(pm, batches, torch.optim.SGD(pm.parameters(), lr=LR), accumulate, clip)
        state = pm.state_dict()
    finally:
        pm.runtime.close()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        want = _train(ref, batches, torch.optim.SGD(ref.parameters(), lr=LR), accumulate, clip)
    params = max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items())
    moved = max(float((v - module.state_dict()[k]).abs().max()) for k, v in ref.state_dict().items())
    return {"loss": max(abs(a - b) for a, b in zip(got, want)), "params": params, "moved": moved,
            "stages": [list(st) for st in s.pipeline.stages], "schedule": s.pipeline.schedule}


def refused(kw: dict) -> str:
    world = torch.distributed.get_world_size()
    module, batches = _model("mlp", 16)
    graph = ff.trace(module, batches[0])
    s = ff.Strategy.megatron(graph, Machine.preset("cpu", devices=world), **kw)
    try:
        ff.parallelize(module, example_inputs=batches[0], strategy=s, machine=Machine.preset("cpu", devices=world))
    except ExecutorError as e:
        return str(e)
    return ""


def suite(rank: int, cases) -> dict:
    torch.set_num_threads(1)
    out = {}
    for tag, name, batch, kw, extra in cases:
        out[tag] = refused(kw) if extra.get("refused") else case(name, batch, kw, **extra)
    return out
