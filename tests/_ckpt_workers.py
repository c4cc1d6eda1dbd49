"""Workers for tests/test_checkpoint.py, at module level so that spawn can pickle them.

A *save run* trains a model two optimizer steps under one strategy, saves the
model and optimizer state with torch.distributed.checkpoint (the sharded values
of ``par.state_dict(full=False)`` and ``par.optim_state_dict``; nothing may be
gathered meanwhile), saves the full state dict too (``par.state_dict()``, the
contract's form), and takes a third step.  A *load run* builds the same model
with other initial values under another strategy (or number of processes),
loads the checkpoint (recording what each rank reads) and takes the third step.
The same functions run in one process without a process group.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import flexflow as ff
import flexflow.runtime.checkpoint as ckpt
from flexflow.hardware.machine import Machine
from flexflow.models._common import make_inputs
from flexflow.strategy.strategy import Strategy

STEPS = 2  # before the checkpoint; one more after it

from _loop_workers import MLP  # noqa: E402  (three linear layers and an MSE loss)


def build(name: str, batch: int, seed: int = 0):
    """(module, example inputs); ``seed`` sets the initial values; eval mode (no dropout)."""
    if name == "mlp":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = MLP()
    else:
        module, _ = ff.models.get(name, batch_size=batch, size="small", seed=seed)
    module.eval()
    return module, batch_for(module, batch, 0)


def batch_for(module, batch: int, i: int):
    return make_inputs(module.input_specs(batch), seed=1000 + i, device="cpu", dtype=torch.float32)


def optimizer(model, name: str):
    """AdamW for the MLP; SGD with momentum for the LSTM model (Adam's normalized
    steps would turn rounding differences of tiny gradients into visible ones)."""
    if name == "mlp":
        return torch.optim.AdamW(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def train(model, module, batch: int, opt, steps) -> list[float]:
    losses = []
    for i in steps:
        opt.zero_grad()
        loss = model(*batch_for(module, batch, i))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def plain(state) -> dict:
    return {k: v.detach().clone().as_subclass(torch.Tensor) for k, v in state.items()}


def boxes(state) -> dict:
    """key -> [(offsets, sizes, writes)] of this rank's boxes in a sharded state dict."""
    return {k: [(tuple(o), tuple(s), w) for o, s, _, w in v._ff_pieces]
            for k, v in state.items() if isinstance(v, ckpt.ShardedState)}


@contextlib.contextmanager
def no_gather():
    """Any gather of a sharded value meanwhile raises."""
    orig = ckpt.gather

    def refuse(values):
        raise AssertionError(f"gathered {[v._ff_name for v in values]}")
    ckpt.gather = refuse
    try:
        yield
    finally:
        ckpt.gather = orig


class RecordingReader(dcp.FileSystemReader):
    """A FileSystemReader that counts the elements each rank reads, per key."""

    def __init__(self, path):
        super().__init__(path)
        self.read: dict = {}

    def read_data(self, plan, planner):
        for item in plan.items:
            n = 1
            for x in item.lengths:
                n *= int(x)
            self.read[item.dest_index.fqn] = self.read.get(item.dest_index.fqn, 0) + n
        return super().read_data(plan, planner)


def parallelized(name: str, batch: int, spec: str, seed: int):
    module, example = build(name, batch, seed)
    world = dist.get_world_size() if dist.is_initialized() else 1
    machine = Machine.preset("cpu", devices=world)
    strategy = None
    if spec != "default":
        kind, _, arg = spec.partition(":")
        graph = ff.trace(module, example)
        if kind in ("random", "zero"):
            strategy = getattr(Strategy, kind)(graph, machine, int(arg))
        elif kind == "pipe":  # pipeline stages over the ranks, 1F1B over ``arg`` micro-batches
            strategy = Strategy.megatron(graph, machine, tp=1, pp=world, microbatches=int(arg))
        else:
            strategy = getattr(Strategy, kind)(graph, machine)
    return module, ff.parallelize(module, example_inputs=example, strategy=strategy, machine=machine)


def plain_run(name: str, batch: int) -> dict:
    """The reference: the plain module, in one process."""
    module, _ = build(name, batch)
    opt = optimizer(module, name)
    losses = train(module, module, batch, opt, range(STEPS))
    after = plain(module.state_dict())
    losses += train(module, module, batch, opt, [STEPS])
    return {"losses": losses, "after": after, "final": plain(module.state_dict())}


def save_run(name: str, batch: int, spec: str, folder: str) -> dict:
    module, par = parallelized(name, batch, spec, seed=0)
    opt = optimizer(par, name)
    losses = train(par, module, batch, opt, range(STEPS))
    with no_gather():  # a sharded save writes the shards as they are
        state = {"model": par.state_dict(full=False), "optim": par.optim_state_dict(opt)}
        dcp.save(state, checkpoint_id=folder)
    full = par.state_dict()
    dcp.save({"model": full}, checkpoint_id=folder + "-full")
    # read on every rank, in the same order, a sharded value is the full tensor
    lazy_ok = all(torch.equal(v, full[k]) for k, v in state["model"].items())
    rec = {"boxes": boxes(state["model"]), "lazy_ok": lazy_ok, "after": plain(full)}
    rec["losses"] = losses + train(par, module, batch, opt, [STEPS])
    rec["final"] = plain(par.state_dict())
    rec["holds"] = sorted(q for q, p in par.named_parameters() if p.numel())
    return rec


def load_run(name: str, batch: int, spec: str, folder: str) -> dict:
    module, par = parallelized(name, batch, spec, seed=5)  # other initial values
    opt = optimizer(par, name)
    state = {"model": par.state_dict(full=False), "optim": par.optim_state_dict(opt)}
    reader = RecordingReader(folder)
    with no_gather():  # a sharded load reads into the shards
        dcp.load(state, storage_reader=reader)
        par.load_state_dict(state["model"])
        par.load_optim_state_dict(opt, state["optim"])
    rec = {"boxes": boxes(state["model"]), "read": reader.read, "after": plain(par.state_dict())}
    rec["losses"] = train(par, module, batch, opt, [STEPS])
    rec["final"] = plain(par.state_dict())
    return rec


def suite(rank: int, root: str, saves, loads) -> dict:
    """saves: (tag, model, batch, strategy spec); loads: (tag, model, batch, spec, checkpoint tag)."""
    torch.set_num_threads(1)
    out = {}
    for tag, name, batch, spec in saves:
        out[tag] = save_run(name, batch, spec, f"{root}/{tag}")
    for tag, name, batch, spec, src in loads:
        out[tag] = load_run(name, batch, spec, f"{root}/{src}")
    return out
