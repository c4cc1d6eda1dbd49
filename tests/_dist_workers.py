"""Workers for tests/test_execute.py, at module level so that spawn can pickle them,
and the small models the executor tests run besides the zoo.

Each worker runs on every rank under ``flexflow.api.launch`` and returns
plain data; the test process asserts on it.  Reference runs (the plain
module in one process) happen on rank 0 only.
"""
from __future__ import annotations

import copy
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flexflow as ff
from flexflow.api import parallelize
from _corpus import CORPUS
from flexflow.hardware.machine import Machine
from flexflow.models._common import InputSpec, make_inputs
from flexflow.strategy.config import ParallelConfig, StrategyError
from flexflow.strategy.strategy import Strategy
from flexflow.strategy.candidates import candidate_configs
from flexflow.strategy.regions import partitions

LR = 0.01
STEPS = 3


# --------------------------------------------------------------------------- models
class BranchNet(nn.Module):
    """Residual add, concatenated branches, a channel shuffle (view/transpose/view), BatchNorm."""

    def __init__(self, c: int = 6, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.b = nn.Conv2d(c, c, 1)
        self.mix = nn.Conv2d(2 * c, c, 1)
        self.bn = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c * 4 * 4, classes)
        self.classes = classes

    def forward(self, x, y):
        h = F.relu(self.stem(x))  # (N, c, 8, 8)
        z = torch.cat([F.relu(self.a(h)), self.b(h)], dim=1)  # (N, 2c, 8, 8)
        n, ch, hh, ww = z.shape
        z = z.view(n, 2, ch // 2, hh, ww).transpose(1, 2).contiguous().view(n, ch, hh, ww)  # shuffle
        h = h + self.mix(z)  # residual
        h = F.relu(self.bn(h))
        h = F.max_pool2d(h, 2)  # (N, c, 4, 4)
        return F.cross_entropy(self.fc(h.flatten(1)), y)

    def input_specs(self, batch: int):
        return [InputSpec((batch, 3, 8, 8), "float"), InputSpec((batch,), "index", self.classes)]


class TinyLM(nn.Module):
    """Tied weights (embedding reused by F.linear), a 1-D convolution over the
    embeddings, causal attention with a mask buffer, LayerNorm."""

    def __init__(self, vocab: int = 11, dim: int = 8, seq: int = 5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)))
        self.vocab, self.seq = vocab, seq

    def forward(self, tok, tgt):
        x = self.emb(tok)  # (N, L, E)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)  # 1-D conv over the sequence
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        att = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (N, L, L)
        length = tok.shape[1]
        att = att.masked_fill(self.mask[:length, :length] == 0, float("-inf"))
        x = x + self.proj(att.softmax(-1) @ v)
        logits = F.linear(x, self.emb.weight)  # tied output layer
        return F.cross_entropy(logits.reshape(-1, self.vocab), tgt.reshape(-1))

    def input_specs(self, batch: int):
        return [InputSpec((batch, self.seq), "index", self.vocab),
                InputSpec((batch, self.seq), "index", self.vocab)]


class RecurrentNet(nn.Module):
    """torch's fused recurrent modules as users write them: a 2-layer nn.LSTM
    (batch first, its (out, (h, c)) output unpacked) into an nn.GRU (time
    first), classified from the GRU's last hidden state and every LSTM step."""

    def __init__(self, vocab: int = 13, emb: int = 8, hid: int = 6, seq: int = 4, classes: int = 5):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hid, num_layers=2, batch_first=True)
        self.gru = nn.GRU(hid, hid)
        self.fc = nn.Linear(hid, classes)
        self.step = nn.Linear(hid, vocab)
        self.vocab, self.seq, self.classes = vocab, seq, classes

    def forward(self, tok, tgt, label):
        out, (h, c) = self.lstm(self.emb(tok))  # (N, T, H), (2, N, H), (2, N, H)
        g, h_last = self.gru(out.transpose(0, 1), h[-1:].contiguous())  # (T, N, H), (1, N, H)
        per_step = F.cross_entropy(self.step(out + c[-1].unsqueeze(1)).reshape(-1, self.vocab), tgt.reshape(-1))
        return per_step + F.cross_entropy(self.fc(h_last[0] + g[-1]), label)

    def input_specs(self, batch: int):
        return [InputSpec((batch, self.seq), "index", self.vocab),
                InputSpec((batch, self.seq), "index", self.vocab),
                InputSpec((batch,), "index", self.classes)]


class Regressor(nn.Module):
    """A regression head trained on element-wise losses as users write them: the
    functional and the module forms, each reduction (kl_div's batchmean too), and
    keywords (beta, delta)."""

    def __init__(self, feat: int = 6, hid: int = 8, out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(feat, hid)
        self.fc2 = nn.Linear(hid, out)
        self.smooth = nn.SmoothL1Loss(beta=0.5)
        self.bce = nn.BCEWithLogitsLoss(reduction="sum")
        self.feat, self.out = feat, out

    def forward(self, x, y):
        z = self.fc2(torch.tanh(self.fc1(x)))
        return (F.mse_loss(z, y) + self.smooth(z, y) + 0.1 * self.bce(z, torch.sigmoid(y))
                + F.huber_loss(z, y, delta=2.0) + F.l1_loss(z, y, reduction="none").mean()
                + (z - y).abs().sum(dim=1).mean() + 0.1 * z.sum(1, keepdim=True).mean(0).sum()
                + F.kl_div(F.log_softmax(z, -1), F.softmax(y, -1), reduction="batchmean"))

    def input_specs(self, batch: int):
        return [InputSpec((batch, self.feat), "float"), InputSpec((batch, self.out), "float")]


class HandMSE(Regressor):
    """The squared error written by hand, ``((z - y) ** 2).mean()``: its mean splits
    with the samples, so data parallelism moves no activation."""

    def forward(self, x, y):
        return ((self.fc2(torch.tanh(self.fc1(x))) - y) ** 2).mean()


CUSTOM = {"branchnet": BranchNet, "tinylm": TinyLM, "recurrent": RecurrentNet, "regressor": Regressor, "handmse": HandMSE}
CUSTOM.update(CORPUS)  # models as their authors write them (tests/_corpus.py)


def _gpt2_fused():
    """The zoo's small GPT-2 with its loss through flexflow.fused_cross_entropy."""
    from dataclasses import replace
    from flexflow.models.gpt2 import GPT2
    m, _ = ff.models.get("gpt2", size="small", batch_size=2)
    return GPT2(replace(m.config, loss="fused"))


CUSTOM["gpt2_fused"] = _gpt2_fused


def build(name: str, batch: int, seed: int = 0):
    """(module, example inputs) for a zoo or custom model, the same on every rank."""
    if name in CUSTOM:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = CUSTOM[name]()
        return module, make_inputs(module.input_specs(batch), seed=seed, device="cpu", dtype=torch.float32)
    return ff.models.get(name, batch_size=batch, size="small", seed=seed)


def batch_for_step(module, batch: int, step: int):
    return make_inputs(module.input_specs(batch), seed=1000 + step, device="cpu", dtype=torch.float32)


def make_strategy(spec: str, graph, machine) -> Strategy:
    """data_parallel | model_parallel | expert | single_device | random:SEED | bnchannel:SEED (random, but
    BatchNorm ops split along channels only or whole: train-mode BatchNorm stays exact)."""
    kind, _, arg = spec.partition(":")
    if kind in ("data_parallel", "model_parallel", "expert", "single_device"):
        return getattr(Strategy, kind)(graph, machine)
    s = Strategy.random(graph, machine, int(arg))
    if kind == "random":
        return s
    if kind == "bnchannel":
        rng = random.Random(int(arg))
        for members in graph.groups.values():
            op = graph.op(members[0])
            if op.rule == "batchnorm":
                ok = [c for c in candidate_configs(op, machine) if set(c.degrees) <= {"c"}]
                s = s.replace(op.name, rng.choice(ok))
        return s
    raise ValueError(spec)


def _spec_flags(spec: str) -> tuple[str, set]:
    """"STRATEGY...[+flag]...": the spec without its flags, and the flags.
    +tiny: ~100-byte gradient buckets (nearly every shard its own all-reduce);
    +eager: reduce_outputs="eager" (the default rides on the gradients); +early:
    every rank reads the loss before its backward; +earlyR: only rank R does."""
    base, *flags = spec.split("+")
    return base, set(flags)


def _parse_spec(spec: str):
    """"STRATEGY[@R1,R2,..|#N][+tiny]": the strategy on the ranks listed (device k
    on rank Rk) or on the first N ranks; "+tiny": ~100-byte gradient buckets,
    so that nearly every shard is its own all-reduce."""
    spec, flags = _spec_flags(spec)
    tiny = "tiny" in flags
    devices = None
    if "@" in spec:
        spec, ranks = spec.split("@")
        devices = [int(r) for r in ranks.split(",")]
    elif "#" in spec:
        spec, count = spec.split("#")
        devices = int(count)
    return spec, devices, tiny


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the reference tensor's scale (floor 1e-3: parameters near 0)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-3) if b.numel() else 0.0


def _train(model, module, batch: int, steps: int = STEPS, early: bool = False):
    """SGD steps on fresh batches; step 1 accumulates the gradients of two
    backward passes (another batch first) before updating.  ``early``: read
    the loss before its backward too.  The gradients of step 0, kept by the
    caller after zero_grad() dropped them, must not change in later steps
    (the executor reuses its gradient buckets only when no one holds them)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    kept = []
    for step in range(steps):
        if step == 1:
            kept = [(p.grad, p.grad.clone()) for p in model.parameters() if p.grad is not None]
        opt.zero_grad()
        if step == 1:
            model(*batch_for_step(module, batch, 50)).backward()
        loss = model(*batch_for_step(module, batch, step))
        if early:
            losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if not all(torch.equal(g, copy) for g, copy in kept):
        raise AssertionError("a gradient kept from step 0 changed in a later step")
    return losses


# --------------------------------------------------------------------------- workers
def suite(rank: int, cases, with_refusals: bool = False):
    """The equivalence cases, then (optionally) the refusal checks, in one spawn."""
    out = {"equivalence": equivalence(rank, cases)}
    if with_refusals:
        out["refusals"] = refusals(rank)
    return out


def _policy(tid: int):
    try:
        return os.sched_getscheduler(tid)
    except OSError:
        return None


def equivalence(rank: int, cases):
    """cases: (model, batch, mode, [strategy specs], check_state_dict).  Every rank
    trains 3 SGD steps with each strategy; rank 0 also trains the plain module and
    reports relative errors of the losses and of every state_dict tensor."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    out = []
    for name, batch, mode, specs, check_sd in cases:
        module, example = build(name, batch)
        module.train(mode == "train")
        if mode == "train":  # deterministic train mode: dropout off, BatchNorm on batch statistics
            for m in module.modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.0
        init = copy.deepcopy(module.state_dict())
        ref_losses = ref_state = None
        if rank == 0:
            ref = copy.deepcopy(module)
            ref_losses = _train(ref, ref, batch)
            ref_state = ref.state_dict()
        graph = ff.trace(module, example)  # (tracing a train-mode BatchNorm bumps num_batches_tracked)
        for spec in specs:
            module.load_state_dict(init)
            base, devices, tiny = _parse_spec(spec)
            n = world if devices is None else (devices if isinstance(devices, int) else len(devices))
            strategy = make_strategy(base, graph, Machine.preset("cpu", devices=n))
            flags = _spec_flags(spec)[1]
            model = parallelize(module, devices, example_inputs=example, strategy=strategy,
                                bucket_cap_mb=1e-4 if tiny else 25.0,
                                reduce_outputs="eager" if "eager" in flags else "with_gradients")
            loops = model.runtime.batch_threads  # gloo's loop threads of its groups, under SCHED_BATCH
            loops_batch = [_policy(t) == getattr(os, "SCHED_BATCH", None) for t in loops]
            early = "early" in flags or f"early{rank}" in flags
            losses = _train(model, module, batch, early=early)
            if early:  # the loss read before and after the backward: the same value
                if losses[0::2] != losses[1::2]:
                    raise AssertionError(f"{spec}: loss read before backward {losses[0::2]} differs "
                                         f"from after {losses[1::2]}")
                losses = losses[1::2]
            if "eager" not in flags and n == world and model.runtime.ride is None \
                    and strategy.name == "data_parallel" and not model.runtime.num_exchanges:
                raise AssertionError(f"{name} {spec}: data parallelism found no gradient bucket to carry the outputs")
            state = model.state_dict()
            rec = {"model": name, "spec": spec, "mode": mode, "losses": losses,
                   "exchanges": model.runtime.num_exchanges, "comm_bytes": model.runtime.comm_bytes,
                   "loop_threads": loops_batch}
            if rank == 0:
                rec["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
                errs = {k: _rel_err(state[k], ref_state[k]) for k in ref_state}
                rec["keys_match"] = list(state) == list(ref_state)
                rec["param_err"], rec["worst"] = max((e, k) for k, e in errs.items())
            if check_sd:
                rec.update(_state_dict_round_trip(model, module, name, batch, example, strategy, state))
            out.append(rec)
    return out


def _state_dict_round_trip(model, module, name, batch, example, strategy, state):
    """gather -> load into a fresh original module -> equal; load_state_dict scatter
    into a differently initialised parallel module -> same forward and state."""
    fresh, _ = build(name, batch, seed=5)
    fresh.train(module.training)
    fresh.load_state_dict(state)
    gathered_ok = all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
    other, _ = build(name, batch, seed=7)
    other.train(module.training)
    model2 = parallelize(other, example_inputs=example, strategy=strategy.to_json())
    model2.load_state_dict(state)
    state2 = model2.state_dict()
    scatter_ok = list(state2) == list(state) and all(torch.equal(state2[k], v) for k, v in state.items())
    x = batch_for_step(module, batch, 99)
    with torch.no_grad():
        was = model.training
        model.eval(), model2.eval(), fresh.eval()
        y1, y2, y3 = model(*x), model2(*x), fresh(*x)
        model.train(was), model2.train(was)
    return {"gathered_loads": gathered_ok, "scatter_exact": scatter_ok,
            "forward_after_load_equal": bool(torch.equal(y1, y2)),
            "fresh_forward_err": abs(float(y1) - float(y3)) / abs(float(y3))}


def refusals(rank: int):
    """Strategies that must be refused on every rank, without a hang."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    module, example = build("lenet", 4)
    graph = ff.trace(module, example)
    other, other_example = build("lenet", 6)  # another batch: another graph
    other_graph = ff.trace(other, other_example)
    out = {}

    def attempt(label, **kw):
        try:
            parallelize(module, example_inputs=example, **kw)
            out[label] = "accepted"
        except (StrategyError, ValueError) as e:
            out[label] = f"{type(e).__name__}: {e}"

    attempt("other_graph", strategy=Strategy.data_parallel(other_graph, Machine.preset("cpu", devices=world)))
    big = Strategy.data_parallel(graph, Machine.preset("cpu", devices=world + 1)) if world < 4 else \
        Strategy(graph, {op.name: ParallelConfig({}, (world,)) for op in graph.compute_ops})
    attempt("too_many_devices", strategy=big)
    # only rank 1 passes a bad strategy: rank 0 must refuse too
    good = Strategy.data_parallel(graph, Machine.preset("cpu", devices=world))
    attempt("bad_on_one_rank", strategy=big if rank == 1 else good)
    try:
        parallelize(module, strategy=good)
        out["no_example_inputs"] = "accepted"
    except ValueError as e:
        out["no_example_inputs"] = str(e)
    # still usable afterwards: the group is not wedged; no strategy: rank 0 searches
    # (or falls back to data parallelism while flexflow.search is missing) and broadcasts
    model = parallelize(module, example_inputs=example, budget=1.0)
    out["after"] = float(model(*example).detach())
    out["searched"] = (model.strategy.to_json(), float(module(*example).detach()))
    return out


def _lenet_model_parallel(timeout_s: float | None = None):
    """(module, example, parallel module): lenet on every rank of the world, model parallel."""
    torch.set_num_threads(1)
    module, example = build("lenet", 4)
    graph = ff.trace(module, example)
    machine = Machine.preset("cpu", devices=dist.get_world_size())
    model = parallelize(module, example_inputs=example, strategy=Strategy.model_parallel(graph, machine),
                        timeout_s=timeout_s)
    return module, example, model


def failing_peer(rank: int, how: str, timeout_s: float):
    """Rank 1 dies (raises) or hangs right after parallelize; rank 0 must fail
    within the timeout instead of hanging (its error says after how long)."""
    module, example, model = _lenet_model_parallel(timeout_s)
    if rank == 1:
        if how == "dies":
            raise RuntimeError("rank 1 exits on purpose")
        time.sleep(120)  # hangs; launch stops it after the grace period
        return None
    try:
        for _ in range(3):
            model(*example).backward()
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"rank 0 failed: {type(e).__name__}: {e}")
    return "rank 0 did not fail"



def faulty(rank: int, how: str, timeout_s: float, ckpt: str):
    """Two ranks train lenet under model parallelism; after step 1 rank 0 writes
    a checkpoint (full tensors); in step 2, after its forward, rank 1 is killed
    (SIGKILL), raises, or stalls past the timeout.  Rank 0 must fail with an
    error naming its rank, the step and the exchange it waited on."""
    import os
    import signal

    module, example, model = _lenet_model_parallel(timeout_s)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad()
    model(*batch_for_step(module, 4, 0)).backward()
    opt.step()
    state = model.state_dict()
    if rank == 0:
        torch.save(state, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
    opt.zero_grad()
    loss = model(*batch_for_step(module, 4, 1))
    if rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "raises":
            raise RuntimeError("rank 1 raises mid-step on purpose")
        time.sleep(600)  # "slow": far past the timeout; launch stops it
    try:
        loss.backward()
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"rank 0 failed: {type(e).__name__}: {e}")
    return "rank 0 did not fail"


def mismatched_programs(rank: int):
    """Programs that match pass the setup check; then rank 0 drops a send from its
    plan and the check must fail on every rank, naming the message."""
    from flexflow.runtime.program import ProgramMismatch, check_programs, describe

    module, example, model = _lenet_model_parallel()
    text = model.program()
    rt = model.runtime
    if rank == 0:
        ex = next(e for e in rt.exchanges if e.sends)
        ex.sends = []
    try:
        check_programs(rt)
        return {"error": None, "program": text}
    except ProgramMismatch as e:
        return {"error": str(e), "program": text, "same_as_describe": describe(rt).splitlines()[0]}


def profiled_steps(rank: int, name: str = "rnnlm", seed: int = 1) -> str:
    """Two training steps of a random strategy (exchanges both ways) under
    torch.profiler with named ranges; the launch must then end cleanly."""
    from torch.profiler import ProfilerActivity, profile, record_function
    torch.set_num_threads(1)
    module, example = build(name, 4)
    graph = ff.trace(module, example)
    strategy = ff.Strategy.random(graph, Machine.preset("cpu", devices=2), seed)
    model = parallelize(module, example_inputs=example, strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(2):
            with record_function(f"step {k}"):
                opt.zero_grad()
                loss = model(*example)
                loss.backward()
                opt.step()
                loss.item()
    names = {e.name for e in prof.events()}
    missing = [op.name for op in graph.compute_ops if f"{op.name} fwd" not in names
               and any(p.device == rank for p in partitions(op, strategy[op.name]))]
    return "ok" if not missing else f"no profiler range for {missing[:5]}"
