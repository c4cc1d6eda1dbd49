"""Workers for tests/test_training_loop.py, at module level so that spawn can pickle them.

Each case parallelizes a model once per strategy and runs several short
training loops on it (reloading the same initial state and making a fresh
optimizer each time): clipping by the global gradient norm (ParallelModule's
own, and torch's utilities over ``parameters()``), and gradient accumulation
over micro-batches with and without ``no_sync()``.  Rank 0 runs the same
loops on the plain module and reports relative errors; every rank reports
the norms it computed, which must agree bit for bit across ranks.
"""
from __future__ import annotations

import contextlib
import copy
import math
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flexflow as ff
import flexflow.runtime.sync as sync_module
from flexflow.hardware.machine import Machine
from flexflow.models._common import InputSpec, make_inputs
from flexflow.strategy.strategy import Strategy

CLIP = 0.05  # below every gradient norm of these models: clipping is active at every step
LR = 0.01
STEPS = 3
MICRO = 3  # micro-batches per optimizer step


class MLP(nn.Module):
    """Three linear layers and an MSE loss."""

    def __init__(self, feat: int = 12, hid: int = 24, out: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(feat, hid)
        self.fc2 = nn.Linear(hid, hid)
        self.fc3 = nn.Linear(hid, out)
        self.feat, self.out = feat, out

    def forward(self, x, y):
        return F.mse_loss(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), y)

    def input_specs(self, batch: int):
        return [InputSpec((batch, self.feat), "float"), InputSpec((batch, self.out), "float")]


def build(name: str, batch: int):
    """(module, example inputs), the same on every rank; eval mode (no dropout)."""
    if name == "mlp":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = MLP()
    else:
        module, _ = ff.models.get(name, batch_size=batch, size="small", seed=0)
        for qual, p in module.named_parameters():
            # frozen: parameters without a gradient (the key bias's is 0 but for rounding:
            # it adds one constant to a row of scores, which softmax ignores)
            if qual.endswith("attn.k.bias"):
                p.requires_grad_(False)
    module.eval()
    return module, batch_for(module, batch, 0)


def batch_for(module, batch: int, i: int):
    return make_inputs(module.input_specs(batch), seed=1000 + i, device="cpu", dtype=torch.float32)


def make_strategy(spec: str, graph, machine) -> Strategy:
    """``data_parallel``, ``fsdp``, ``zero:S``, ``random:SEED``, ``shard:SEED`` (a random
    strategy with a random shard level on every op whose parameters have replicas),
    ``rc:SEED`` (that, with every other op recomputed)."""
    kind, _, arg = spec.partition(":")
    if kind == "random":
        return Strategy.random(graph, machine, int(arg))
    if kind == "zero":
        return Strategy.zero(graph, machine, int(arg))
    if kind == "shard":
        return with_random_shards(Strategy.random(graph, machine, int(arg)), graph, int(arg))
    if kind == "rc":  # and every other op recomputed
        s = with_random_shards(Strategy.random(graph, machine, int(arg)), graph, int(arg))
        for op in graph.compute_ops[int(arg) % 2::2]:
            s = s.replace(op.name, s[op.name].with_recompute())
        return s
    return getattr(Strategy, kind)(graph, machine)


def with_random_shards(strategy: Strategy, graph, seed: int) -> Strategy:
    """``strategy`` with a shard level drawn from 1-3 for every op whose parameters have
    replicas (at least one op gets each level where there are three such ops)."""
    from flexflow.strategy.regions import has_param_replicas
    rng = random.Random(seed)
    ops = [op for op in graph.compute_ops if op.params and has_param_replicas(op, strategy[op.name])]
    levels = [1 + i % 3 for i in range(len(ops))]
    rng.shuffle(levels)
    for op, level in zip(ops, levels):
        strategy = strategy.replace(op.name, strategy[op.name].with_shard(level))
    return strategy


# --------------------------------------------------------------------------- the loops
def _clip(model, how: str, p: float):
    """Clip ``model``'s gradients by ``how``; the norm it used and the norms other
    readers report before clipping (all must be the global norm)."""
    grads = lambda: [q.grad for q in model.parameters() if q.grad is not None]  # noqa: E731
    seen = {"total_fe": float(torch.nn.utils.get_total_norm(grads(), p, foreach=True)),
            "total": float(torch.nn.utils.get_total_norm(grads(), p, foreach=False))}
    if hasattr(model, "grad_norm"):
        seen["grad_norm"] = float(model.grad_norm(p))
    if how == "par" and hasattr(model, "clip_grad_norm_"):
        n = model.clip_grad_norm_(CLIP, p)
    else:
        n = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, p, foreach=(how == "torch_foreach") or None)
    return float(n), seen


def optimizer(model, module):
    """AdamW; SGD for the transformer, where Adam's normalized steps turn rounding
    differences of tiny gradients (1e-7 relative) into parameter differences of 1e-4
    within three steps, whatever the strategy (the plain accumulation too)."""
    if isinstance(module, MLP):
        return torch.optim.AdamW(model.parameters(), lr=LR)
    return torch.optim.SGD(model.parameters(), lr=0.5)


def clip_loop(model, module, batch: int, how: str, p: float) -> dict:
    """Optimizer steps with gradient clipping (``how``: "torch", "torch_foreach", "par")."""
    opt = optimizer(model, module)
    losses, norms, seen = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*batch_for(module, batch, step))
        loss.backward()
        n, s = _clip(model, how, p)
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(n)
        seen.append(s)
    return {"losses": losses, "norms": norms, "seen": seen}


def accum_loop(model, module, batch: int, how: str) -> dict:
    """Optimizer steps, each over MICRO micro-batches whose gradients accumulate.
    ``how``: flags joined by "+": "no_sync" (all but the last micro-batch under
    no_sync()); "div" (each loss divided by MICRO before its backward: that reads the
    loss, so its all-reduce happens at once instead of riding on the gradients);
    "early" (each loss read before its backward too, on every rank) or "earlyR" (on
    rank R only); "clip" (torch's clip_grad_norm_ over the accumulated gradients)."""
    flags = set(how.split("+"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    early = "early" in flags or f"early{rank}" in flags
    opt = optimizer(model, module)
    losses, before, norms, inside = [], [], [], []
    for step in range(2):
        opt.zero_grad()
        for k in range(MICRO):
            x = batch_for(module, batch, 10 * step + k)
            skip = "no_sync" in flags and k < MICRO - 1 and hasattr(model, "no_sync")
            with model.no_sync() if skip else contextlib.nullcontext():
                loss = model(*x)
                if "div" in flags:
                    loss = loss / MICRO
                if early:
                    before.append(float(loss.detach()))
            with _Count() as counted:
                loss.backward()
            if skip:
                inside.append(counted.sizes)
            losses.append(float(loss.detach()))
        if "clip" in flags:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {"losses": losses, "norms": norms, "inside": inside,
            "early_same": not early or before == losses}


class _Count:
    """The sizes of the all-reduces the gradient sync starts meanwhile."""

    def __enter__(self):
        self.sizes = []
        self.orig = sync_module._all_reduce

        def counting(t, group):
            self.sizes.append(t.numel())
            return self.orig(t, group)
        sync_module._all_reduce = counting
        return self

    def __exit__(self, *exc):
        sync_module._all_reduce = self.orig
        return False


LOOPS = [("clip2_torch", lambda m, mod, b: clip_loop(m, mod, b, "torch", 2.0)),
         ("clip2_foreach", lambda m, mod, b: clip_loop(m, mod, b, "torch_foreach", 2.0)),
         ("clipinf_par", lambda m, mod, b: clip_loop(m, mod, b, "par", math.inf)),
         ("clipinf_torch", lambda m, mod, b: clip_loop(m, mod, b, "torch", math.inf)),
         ("accum", lambda m, mod, b: accum_loop(m, mod, b, "plain")),
         ("accum_no_sync", lambda m, mod, b: accum_loop(m, mod, b, "no_sync")),
         ("accum_no_sync_div", lambda m, mod, b: accum_loop(m, mod, b, "no_sync+div+early")),
         ("accum_no_sync_early1", lambda m, mod, b: accum_loop(m, mod, b, "no_sync+early1")),
         ("accum_no_sync_clip", lambda m, mod, b: accum_loop(m, mod, b, "no_sync+clip"))]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-3) if b.numel() else 0.0


def _mixed_raises(model) -> str:
    """torch's clip_grad_norm_ over the shards and a tensor of another module: the
    error it raises (on every rank), or "" when it does not."""
    extra = nn.Parameter(torch.ones(3))
    extra.grad = torch.ones(3)
    try:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + [extra], CLIP)
    except RuntimeError as e:
        return str(e)
    return ""


def suite(rank: int, cases, loops=None) -> list:
    """cases: (model, batch, [strategy specs]).  Every loop of LOOPS (or those named)
    on every strategy; records per (model, spec, loop)."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    chosen = [(n, f) for n, f in LOOPS if loops is None or n in loops]
    out = []
    for name, batch, specs in cases:
        module, example = build(name, batch)
        init = copy.deepcopy(module.state_dict())
        refs = {}
        if rank == 0:
            for loop, fn in chosen:  # (the plain module runs no_sync loops without no_sync)
                ref = copy.deepcopy(module)
                res = fn(ref, ref, batch)
                refs[loop] = (res, {k: v.clone() for k, v in ref.state_dict().items()})
        graph = ff.trace(module, example)
        for spec in specs:
            module.load_state_dict(init)
            strategy = make_strategy(spec, graph, Machine.preset("cpu", devices=world))
            model = ff.parallelize(module, example_inputs=example, strategy=strategy)
            for loop, fn in chosen:
                model.load_state_dict(init)
                res = fn(model, module, batch)
                rec = {"model": name, "spec": spec, "loop": loop, "norms": res["norms"],
                       "seen": res.get("seen"), "inside": res.get("inside"), "losses": res["losses"],
                       "early_same": res.get("early_same"),
                       "holds": [q for q, p in model.named_parameters() if p.numel()]}
                state = model.state_dict()
                if rank == 0:
                    ref, ref_state = refs[loop]
                    rec["loss_err"] = max(_rel(a, b) for a, b in zip(res["losses"], ref["losses"]))
                    rec["norm_err"] = max([_rel(a, b) for a, b in zip(res["norms"], ref["norms"])], default=0.0)
                    if res.get("seen"):
                        rec["seen_err"] = max(_rel(v, b) for s, b in zip(res["seen"], ref["norms"])
                                              for v in s.values()
                                              if loop.startswith("clip"))
                    errs = {k: _rel_err(state[k], ref_state[k]) for k in ref_state}
                    rec["param_err"], rec["worst"] = max((e, k) for k, e in errs.items())
                    rec["errs"] = sorted(((e, k) for k, e in errs.items()), reverse=True)[:4]
                out.append(rec)
            if spec == specs[0]:
                out.append({"model": name, "spec": spec, "loop": "mixed", "error": _mixed_raises(model)})
    return out
