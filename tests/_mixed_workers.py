"""Workers for tests/test_mixed_run.py (module level, so that spawn can pickle them)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import flexflow as ff
from flexflow.hardware.machine import Machine

from _loop_workers import batch_for, build, make_strategy

STEPS = 3


def _loop(model, batch: int, autocast: bool, scaler=None, dtype=torch.bfloat16) -> list:
    """SGD steps (Adam would amplify rounding noise of near-0 gradients), under autocast to
    ``dtype`` if asked, through a loss ``scaler`` if given; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for i in range(STEPS):
        opt.zero_grad()
        xs = batch_for(model if hasattr(model, "input_specs") else model.original_module, batch, i)
        if autocast:
            with torch.autocast("cpu", dtype=dtype):
                loss = model(*xs)
        else:
            loss = model(*xs)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(float(loss.detach()))
    return losses


def _trained(module, example, graph, init, batch: int, specs, precision: str):
    """(spec, parallel module, its losses) for each strategy spec, trained from ``init``."""
    for spec in specs:
        module.load_state_dict(init)
        strategy = make_strategy(spec, graph, Machine.preset("cpu", devices=dist.get_world_size()))
        par = ff.parallelize(module, example_inputs=example, strategy=strategy, precision=precision)
        yield spec, par, _loop(par, batch, False)


def _norm(ts) -> float:
    return float(torch.stack([t.double().norm() for t in ts]).norm())


def mixed(rank: int, name: str, batch: int, specs) -> list:
    """bf16-mixed on the world for each strategy spec against one process under autocast
    (SGD steps): (spec, loss relative errors, the parameters' relative error (the norm of
    the difference over the norm of the parameters, all tensors together), the
    first loss's relative difference between float32 and autocast in one process, the
    three worst parameters)."""
    torch.set_num_threads(1)
    module, example = build(name, batch)
    init = copy.deepcopy(module.state_dict())
    ref = copy.deepcopy(module)
    ref_losses = _loop(ref, batch, True)
    fp32 = copy.deepcopy(module)
    first32 = _loop(fp32, batch, False)[0]
    scale = abs(first32 - ref_losses[0]) / abs(ref_losses[0])  # float32 against autocast, first step
    graph = ff.trace(module, example)
    out = []
    for spec, par, losses in _trained(module, example, graph, init, batch, specs, "bf16-mixed"):
        state = par.state_dict()
        refs = {k: v for k, v in ref.state_dict().items() if v.is_floating_point()}
        errs = sorted(((float((state[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)), k)
                       for k, v in refs.items()), reverse=True)
        whole = _norm([state[k] - v for k, v in refs.items()]) / _norm(list(refs.values()))
        # the dtype each sharded region is gathered in, by the kinds of op that read it
        kinds: dict = {}
        for op in graph.compute_ops:
            for q in op.params.values():
                kinds.setdefault(q, set()).add(op.kind)
        gathered = sorted({(tuple(sorted(kinds[q])), str(t.dtype)) for q, t in par._runtime.full.items()})
        out.append((spec, [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)], whole, scale, errs[:3],
                    gathered))
    return out


def mixed16(rank: int, name: str, batch: int, specs) -> list:
    """16-mixed with loss scaling (torch's ShardedGradScaler, which agrees on skipped steps
    across the ranks) against one process under float16 autocast with a GradScaler: (spec,
    loss relative errors, the parameters' relative error, the scale after the steps on
    every rank and in the reference)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.set_num_threads(1)
    module, example = build(name, batch)
    init = copy.deepcopy(module.state_dict())
    ref = copy.deepcopy(module)
    kw = {"init_scale": 2.0 ** 14, "growth_interval": 2}  # (grows once within the steps)
    ref_scaler = torch.amp.GradScaler("cpu", **kw)
    ref_losses = _loop(ref, batch, True, ref_scaler, torch.float16)
    graph = ff.trace(module, example)
    out = []
    for spec in specs:
        module.load_state_dict(init)
        strategy = make_strategy(spec, graph, Machine.preset("cpu", devices=dist.get_world_size()))
        par = ff.parallelize(module, example_inputs=example, strategy=strategy, precision="16-mixed")
        scaler = ShardedGradScaler(device="cpu", **kw)
        losses = _loop(par, batch, False, scaler)
        state = par.state_dict()
        refs = {k: v for k, v in ref.state_dict().items() if v.is_floating_point()}
        whole = _norm([state[k] - v for k, v in refs.items()]) / _norm(list(refs.values()))
        scales = [0.0] * dist.get_world_size()
        dist.all_gather_object(scales, float(scaler.get_scale()))
        out.append((spec, [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)], whole, scales,
                    float(ref_scaler.get_scale())))
    return out


def _loop_bf16_params(model, batch: int) -> list:
    """SGD steps with every parameter cast to bfloat16 for compute (floating inputs and
    constant buffers too), as FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32) runs a module in one process whose rotary tables follow its
    activations' dtype; the float32 parameters take the gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for i in range(STEPS):
        opt.zero_grad()
        xs = batch_for(model, batch, i)
        xs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in xs)
        params = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
        params.update({n: b.to(torch.bfloat16) for n, b in model.named_buffers()
                       if b.is_floating_point() and "running_" not in n})  # (rotary tables)
        loss = torch.func.functional_call(model, params, xs)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def params16(rank: int, name: str, batch: int, specs) -> list:
    """bf16-params on the world for each strategy spec against one process casting its
    parameters (SGD steps): (spec, loss relative errors, the parameters' relative error,
    float32 training's parameters' relative distance from the reference, the dtypes the
    forward's matrix products read, the parameters' dtypes after training, the loss's dtype)."""
    torch.set_num_threads(1)
    module, example = build(name, batch)
    init = copy.deepcopy(module.state_dict())
    ref = copy.deepcopy(module)
    ref_losses = _loop_bf16_params(ref, batch)
    fp32 = copy.deepcopy(module)
    _loop(fp32, batch, False)
    refs = {k: v for k, v in ref.state_dict().items() if v.is_floating_point()}
    state32 = fp32.state_dict()
    scale = _norm([state32[k] - v for k, v in refs.items()]) / _norm(list(refs.values()))
    graph = ff.trace(module, example)
    out = []
    for spec, par, losses in _trained(module, example, graph, init, batch, specs, "bf16-params"):
        with _MatmulDtypes() as seen:  # what the forward's matrix products read
            loss_dtype = str(par(*batch_for(module, batch, 0)).dtype)
        state = par.state_dict()
        whole = _norm([state[k] - v for k, v in refs.items()]) / _norm(list(refs.values()))
        dtypes = sorted({str(v.dtype) for v in state.values() if v.is_floating_point()})
        out.append((spec, [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)], whole, scale,
                    sorted(seen.dtypes), dtypes, loss_dtype))
    return out


class _MatmulDtypes:
    """The dtypes of the floating operands of every matrix product run inside it."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        aten = torch.ops.aten
        names = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                 aten.linear.default, aten.matmul.default}
        seen = self.dtypes = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in names:
                    seen.update(str(a.dtype) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
                return func(*args, **(kwargs or {}))
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
