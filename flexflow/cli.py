"""The ``flexflow`` command line: models, trace, calibrate, profile, simulate, search."""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys

__all__ = ["main", "load_model", "CLIError"]


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def load_model(spec: str, batch: int | None, devices: int = 1, meta: bool = True, size: str | None = None,
               seq: int | None = None):
    """(module, example_inputs, label) for a zoo name or ``path/file.py:factory``
    (a factory may return a dict of keyword inputs as its example inputs).

    Zoo models are built on the meta device (planning needs shapes, not values)
    unless ``meta`` is False; ``size`` and ``seq`` (``--size``, ``--seq``) pick a zoo
    model's size and sequence length (gpt2, llama)."""
    from . import models
    if spec in models.names():
        size = size or "paper"
        try:
            b = batch if batch is not None else models.paper_batch(spec, size) * devices
            if b < 1:
                raise CLIError(f"--batch must be positive, got {b}")
            module, inputs = models.get(spec, batch_size=b, size=size, seq_len=seq, device="meta" if meta else None)
        except ValueError as e:
            raise CLIError(str(e).replace("seq_len", "--seq")) from None
        label = spec if size == "paper" else f"{spec}-{size}"
        return module, inputs, label
    if size is not None or seq is not None:
        raise CLIError(f"--size and --seq apply to zoo models ({', '.join(models.names())}), not to {spec!r}")
    if ":" not in spec or not spec.split(":")[0].endswith(".py"):
        raise CLIError(f"unknown model {spec!r}: use a zoo name ({', '.join(models.names())}) "
                       "or path/to/file.py:factory")
    path, factory = spec.rsplit(":", 1)
    if not os.path.isfile(path):
        raise CLIError(f"model file {path!r} does not exist")
    try:
        mod_spec = importlib.util.spec_from_file_location("_flexflow_user_model", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - report the user's file, one line
        raise CLIError(f"model file {path!r} failed to import: {type(e).__name__}: {e}") from None
    fn = getattr(mod, factory, None)
    if not callable(fn):
        raise CLIError(f"model file {path!r} has no callable {factory!r}")
    try:
        out = fn(batch) if batch is not None else fn()
    except TypeError:
        out = fn()
    if not (isinstance(out, tuple) and len(out) == 2):
        raise CLIError(f"{spec}: factory must return (module, example_inputs), got {type(out).__name__}")
    module, inputs = out
    if isinstance(inputs, dict):  # keyword inputs: module(**inputs)
        return module, inputs, spec
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    return module, tuple(inputs), spec


def _trace(module, inputs, batch_dim=None):
    from .graph.trace import trace
    if batch_dim is not None and len(batch_dim) == 1:
        batch_dim = batch_dim[0]
    if isinstance(inputs, dict):
        return trace(module, (), inputs, batch_dim=batch_dim)
    return trace(module, inputs, batch_dim=batch_dim)


def _machine(args):
    from .hardware.machine import Machine
    if args.machine.endswith(".json"):
        if not os.path.isfile(args.machine):
            raise CLIError(f"machine file {args.machine!r} does not exist")
        try:
            m = Machine.load(args.machine)
        except ValueError as e:
            raise CLIError(f"machine file {args.machine!r}: {e}") from None
        return m.with_devices(args.devices) if args.devices else m
    try:
        return Machine.preset(args.machine, devices=args.devices)
    except ValueError as e:
        raise CLIError(str(e)) from None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n}"


# --------------------------------------------------------------------------- commands
def cmd_models(args) -> int:
    from . import models
    for name in models.names():
        print(name)
    return 0


def cmd_trace(args) -> int:
    from .hardware.machine import Machine
    from .strategy.candidates import strategy_space_log10
    module, inputs, label = load_model(args.model, args.batch, size=args.size, seq=args.seq)
    graph = _trace(module, inputs, args.batch_dim)
    rows = []
    for op in graph.ops:
        params = sum(math.prod(s) for s in op.param_shapes.values())
        dims = " ".join(f"{d.name}:{d.kind[0].upper()}{d.size}" for d in op.dims)
        rows.append((op.name, op.kind, "x".join(map(str, op.output_shape)) or "()",
                     str(params) if params else "", "everywhere" if op.everywhere else dims))
    if args.json:
        space = {str(n): strategy_space_log10(graph, Machine.preset("p100-cluster", devices=n))
                 for n in (4, 16)}
        print(json.dumps({"model": label, "ops": len(graph), "opaque": graph.opaque,
                          "whole": graph.whole_reasons,
                          "param_bytes": graph.param_bytes, "log10_strategies": space,
                          "table": [dict(zip(("name", "kind", "shape", "params", "dims"), r))
                                    for r in rows]}))
        return 0
    widths = [max(len(r[i]) for r in rows + [("op", "kind", "output", "params", "parallel dims")])
              for i in range(5)]
    head = ("op", "kind", "output", "params", "parallel dims")
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print()
    print(f"model {label}: {len(graph)} ops ({len(graph.compute_ops)} placed, "
          f"{len(graph.groups)} config groups), batch {graph.batch_size}")
    print(f"parameters: {_fmt_bytes(graph.param_bytes)}")
    print(f"opaque ops: {', '.join(graph.opaque) if graph.opaque else 'none'}")
    if graph.whole_reasons:
        print("ops that cannot split the batch (data parallelism runs them whole):")
        for name, why in graph.whole_reasons.items():
            print(f"  {name}: {why}")
    for n in (4, 16):
        m = Machine.preset("p100-cluster", devices=n)
        print(f"strategy space on {n} devices: 10^{strategy_space_log10(graph, m):.1f}")
    return 0


def _calibration_text(res: dict) -> str:
    """The calibrated figures in words, with the executor fit's cases (flexflow.calibrate.hostfit)."""
    us = lambda x: f"{x * 1e6:.0f} us"  # noqa: E731
    fitted, bw = "micro" in res, f" + {res['bandwidth_Bps'] / 1e9:.2f} GB/s"
    lines = [f"calibrated {res['nprocs']} gloo processes on {res['cores']} cores in {res['seconds']:.1f} s; "
             f"machine file {res.get('path')}",
             f"  compute: {res['peak_flops'].get('float32', 0) / 1e9:.1f} GFLOP/s fp32 matmul, "
             f"{res['mem_bw_Bps'] / 1e9:.1f} GB/s copy, {us(res['launch_overhead_s'])} per eager op",
             # the bandwidth is the ping-pong's, or the fitted message's when there is a fit
             f"  idle ping-pong: {us(res['latency_s'])}" + ("" if fitted else bw),
             f"  a message between compute: {us(res['exchange_s'])}" + (bw if fitted else "")
             + (f" ({us(res['message_lag_s'])} of it on no core: overlapped by messages in flight together)"
                if res.get("message_lag_s") else ""),
             f"  all-reduce: {us(res['allreduce_latency_s'])} per ring step, "
             f"{res['allreduce_bandwidth_Bps'] / 1e9:.2f} GB/s",
             f"  sync skew: {res['sync_skew']:.2f} of the compute before a synchronisation"]
    if res.get("output_sync_s") is not None:
        lines.append(f"  returning the loss to every rank: {us(res['output_sync_s'])} a step")
    micro = res.get("micro")
    if micro:
        lines.append(f"  (fitted to the executor's steps; the micro-benchmarks said a message "
                     f"{us(micro['exchange_s'])} + {micro['bandwidth_Bps'] / 1e9:.2f} GB/s, an all-reduce step "
                     f"{us(micro['allreduce_latency_s'])}, skew {micro['sync_skew']:.2f})")
    fit = res.get("fit")
    if fit:
        lines.append("  calibration chain        measured ms  predicted ms   error")
        for case, m in fit["measured_ms"].items():
            p, e = fit["predicted_ms"].get(case), fit["error"].get(case)
            lines.append(f"    {case:<22} {m:11.2f} {p:13.2f} {e * 100:+7.1f}%")
    if res.get("fit_error"):
        lines.append(f"  fit failed, micro-benchmark figures kept: {res['fit_error']}")
    return "\n".join(lines)


def cmd_calibrate(args) -> int:
    from .calibrate.host import calibrate
    if args.nprocs < 2:
        raise CLIError(f"--nprocs must be at least 2 (messages need two processes), got {args.nprocs}")
    res = calibrate(nprocs=args.nprocs)
    if args.json:
        print(json.dumps(res, default=str))
    else:
        print(_calibration_text(res))
    return 0


def cmd_profile(args) -> int:
    from .cost import profile
    if args.comm:  # the older spelling of ``flexflow calibrate``
        return cmd_calibrate(args)
    if args.model is None:
        raise CLIError("profile needs a MODEL (or --comm)")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise CLIError("--device cuda: no CUDA device here")
    module, inputs, label = load_model(args.model, args.batch, meta=True, size=args.size, seq=args.seq)
    graph = _trace(module, inputs, args.batch_dim)
    rep = profile.profile_graph(graph, device=args.device, progress=not args.json and sys.stderr.isatty())
    if args.json:
        print(json.dumps({"model": label, "device": args.device, "ops": rep.ops,
                          "measured": rep.measured, "cached": rep.cached}, default=str))
    else:
        print(rep.table())
        print(f"{len(rep.ops)} distinct ops: {rep.measured} measured, {rep.cached} from cache")
    return 0


def _strategy_arg(name, graph, machine, precision="32-true", pipe=None, tensor=(1, True, None)):
    """The --strategy: a built-in or a file; ``pipe`` (tp, pp, microbatches, schedule,
    interleave) and ``tensor`` (cp, sequence parallelism, cp_balance) shape ``megatron`` and
    ``fsdp_tp``, ``pipe`` pipelines any other built-in."""
    from .strategy.config import StrategyError
    from .strategy.strategy import Strategy
    tp, pp, mb, sched, v = pipe or (None, 1, 1, "1f1b", 1)
    cp, sp, balance = (tuple(tensor) + (None,))[:3]
    three = dict(tp=tp, pp=pp, microbatches=mb, schedule=sched, interleave=v, cp=cp, sequence_parallel=sp,
                 cp_balance=balance)
    builtins = {"data_parallel": Strategy.data_parallel, "model_parallel": Strategy.model_parallel,
                "expert": Strategy.expert, "zero1": lambda g, m: Strategy.zero(g, m, 1),
                "zero2": lambda g, m: Strategy.zero(g, m, 2), "fsdp": Strategy.fsdp,
                "megatron": lambda g, m: Strategy.megatron(g, m, **three),
                "fsdp_tp": lambda g, m: Strategy.megatron(g, m, shard=3, **three)}
    if pipe is not None and name not in ("megatron", "fsdp_tp") and (pp != 1 or v != 1 or tp is not None
                                                                      or cp != 1 or not sp or balance is not None):
        raise CLIError("--tp, --pp, --cp, --cp-contiguous, --interleave and --no-sequence-parallel shape --strategy "
                       "megatron or fsdp_tp; other strategies take --microbatches and --schedule only")
    if name in builtins:
        if pipe is not None and name not in ("megatron", "fsdp_tp") and (mb != 1 or sched != "1f1b"):
            try:
                return builtins[name](graph, machine).with_pipeline(mb, sched)
            except StrategyError as e:
                raise CLIError(f"--strategy {name} with --microbatches {mb}: {e}") from None
        try:
            return builtins[name](graph, machine)
        except StrategyError as e:
            raise CLIError(f"--strategy {name}: {e}") from None
    if name == "optcnn":
        from .search import optcnn
        if precision == "32-true":
            return optcnn(graph, machine)
        from .cost.model import CostModel
        from .cost.precision import priced_cost_model
        return optcnn(graph, machine, priced_cost_model(CostModel(machine), precision, graph))
    if not os.path.isfile(name):
        raise CLIError(f"--strategy {name!r}: not a built-in (data_parallel, model_parallel, expert, "
                       "optcnn, zero1, zero2, fsdp, megatron, fsdp_tp) and no such file")
    try:
        with open(name) as f:
            return Strategy.from_json(f.read(), graph, machine)
    except StrategyError as e:
        raise CLIError(f"strategy file {name!r}: {e}") from None


def _sim_json(label, machine, strategy_name, res, batch, precision="32-true"):
    return {"model": label, "machine": machine.name, "devices": machine.num_devices,
            "strategy": strategy_name, "precision": precision, "iteration_time_ms": res.iteration_time * 1e3,
            "throughput": batch / res.iteration_time if res.iteration_time > 0 else 0.0,
            "comm_bytes": res.comm_bytes, "sync_bytes": res.sync_bytes,
            "peak_memory_bytes": list(res.peak_memory), "feasible": res.feasible,
            "mfu": getattr(res, "mfu", 0.0), "tokens_per_s_per_device": getattr(res, "tokens_per_s_per_device", 0.0),
            "bubble": getattr(res, "bubble", 0.0)}


def _precision_arg(args) -> str:
    """The --precision name, checked (a one-line error listing the valid names)."""
    from .cost.precision import precision
    return precision(args.precision).name


def _print_sim(label, machine, strategy_name, res, batch, precision="32-true"):
    print(f"{label} on {machine.name} ({machine.num_devices} devices), strategy {strategy_name}"
          + ("" if precision == "32-true" else f", precision {precision}"))
    tokens = getattr(res, "tokens_per_s_per_device", 0.0)
    per_device = f", {tokens:,.0f} tokens/s per device" if tokens else ""
    print(f"  iteration time  {res.iteration_time * 1e3:10.3f} ms   "
          f"({batch / res.iteration_time:,.0f} samples/s{per_device}, MFU {100 * getattr(res, 'mfu', 0.0):.1f}%)")
    print(f"  activations moved {_fmt_bytes(res.comm_bytes):>12}   parameter sync {_fmt_bytes(res.sync_bytes):>12}")
    print(f"  peak memory       {_fmt_bytes(max(res.peak_memory)):>12} (max over devices)"
          f"{'' if res.feasible else '   INFEASIBLE: ' + str(getattr(res, 'message', ''))}")
    print(f"  memory per device {_memory_per_device(res)}")
    if getattr(res, "bubble", 0.0):
        print(f"  pipeline bubble   {100 * res.bubble:10.1f} % of the step (the busiest stage waiting)")


def _memory_per_device(res) -> str:
    """Peak memory per device, runs of devices with the same figure merged:
    ``0-3: 5.2 GB, 4-63: 3.1 GB (of 12.9 GB)``."""
    shown = [_fmt_bytes(b) for b in res.peak_memory]
    runs, start = [], 0
    for d in range(1, len(shown) + 1):
        if d == len(shown) or shown[d] != shown[start]:
            runs.append(f"{start}{'' if d - 1 == start else f'-{d - 1}'}: {shown[start]}")
            start = d
    caps = sorted(set(res.memory_capacity))
    cap = _fmt_bytes(caps[0]) if len(caps) == 1 else f"{_fmt_bytes(caps[0])}..{_fmt_bytes(caps[-1])}"
    return f"{', '.join(runs)} (of {cap})"


def cmd_simulate(args) -> int:
    machine = _machine(args)
    precision = _precision_arg(args)
    from .sim.simulate import Simulator
    module, inputs, label = load_model(args.model, args.batch, machine.num_devices, size=args.size, seq=args.seq)
    graph = _trace(module, inputs, args.batch_dim)
    strategy = _strategy_arg(args.strategy, graph, machine, precision,
                             (args.tp, args.pp, args.microbatches, args.schedule, args.interleave),
                             (args.cp, not args.no_sequence_parallel, False if args.cp_contiguous else None))
    if args.recompute == "blocks":
        strategy = strategy.recompute_blocks()
    sim = Simulator(graph, machine, _cost_model(machine), optimizer=args.optimizer, precision=precision)
    res = sim.simulate(strategy, incremental=False)
    if args.trace:
        if strategy.pipeline is not None:
            raise CLIError("--trace: a pipelined step is composed from one micro-batch's timeline and has none "
                           "of its own; leave out --pp / --microbatches to trace the plan's micro-batch")
        res.to_chrome_trace(args.trace)
    name = args.strategy if not os.path.isfile(args.strategy) else os.path.basename(args.strategy)
    if args.recompute == "blocks":
        name += " (blocks recomputed)"
    native = None
    if args.native:
        from .native import native_plan
        native = native_plan(graph, strategy, precision)
    if args.json:
        out = _sim_json(label, machine, name, res, graph.batch_size, precision)
        if native is not None:
            out["native"] = native
        print(json.dumps(out))
    else:
        _print_sim(label, machine, name, res, graph.batch_size, precision)
        if args.trace:
            print(f"  timeline written to {args.trace}")
        if native is not None:
            from .native.text import describe
            print("in torch's terms (plan.native()):")
            print("\n".join("  " + line for line in describe(native).splitlines()))
    return 0


def _cost_model(machine):
    from .cost.model import CostModel
    if hasattr(CostModel, "for_machine"):
        return CostModel.for_machine(machine)
    return CostModel(machine)


def cmd_search(args) -> int:
    machine = _machine(args)
    precision = _precision_arg(args)
    from .search import search
    module, inputs, label = load_model(args.model, args.batch, machine.num_devices, size=args.size, seq=args.seq)
    graph = _trace(module, inputs, args.batch_dim)
    init = None
    if args.init:
        init = _strategy_arg(args.init, graph, machine)
    kw = {}
    if args.evaluations:
        kw["evaluations"] = args.evaluations
    if args.exhaustive:
        if precision != "32-true":
            raise CLIError("--exhaustive prices 32-true only; leave out --precision or --exhaustive")
        from .search import exhaustive_search
        strategy, res, explored = exhaustive_search(graph, machine, _cost_model(machine),
                                                    max_states=args.max_states, optimizer=args.optimizer)
        out = _sim_json(label, machine, "exhaustive", res, graph.batch_size)
        out["explored"] = explored
        if args.out:
            with open(args.out, "w") as f:
                f.write(strategy.to_json())
        print(json.dumps(out) if args.json else strategy.table() + "\n" + json.dumps(out, indent=1))
        return 0
    result = search(graph, machine, budget=args.budget, seed=args.seed,
                    cost_model=_cost_model(machine), init=init,
                    progress=None if not args.json else False, optimizer=args.optimizer,
                    precision=precision, **kw)
    if not result.result.feasible:
        raise CLIError(f"no strategy fits device memory (optimizer {args.optimizer}, "
                       f"{result.evaluations} strategies tried); the best: {result.result.message}")
    if args.out:  # a plan (strategy, predictions, baselines, machine); it reads as a strategy file too
        from .plan import Plan
        plan = Plan(result.strategy, result.result, dict(result.baselines), machine, graph.fingerprint(),
                    result.source, args.optimizer, precision, 0.0, result.seconds, result.evaluations)
        with open(args.out, "w") as f:
            f.write(plan.to_json())
    if args.json:
        out = _sim_json(label, machine, "searched", result.result, graph.batch_size, precision)
        out["baselines"] = {k: {"iteration_time_ms": r.iteration_time * 1e3,
                                "comm_bytes": r.comm_bytes, "sync_bytes": r.sync_bytes, "mfu": r.mfu,
                                "tokens_per_s_per_device": r.tokens_per_s_per_device}
                            for k, r in result.baselines.items()}
        out["search_seconds"] = result.seconds
        out["evaluations"] = result.evaluations
        print(json.dumps(out))
        return 0
    print(result.strategy.table())
    print()
    _print_sim(label, machine, "searched", result.result, graph.batch_size, precision)
    print(f"  search: {result.evaluations} evaluations in {result.seconds:.1f} s")
    base = result.baselines
    tokens = result.result.tokens_per_s_per_device > 0  # token ids in: tokens/s per device and MFU too
    print("\n  strategy          iteration ms   speedup   moved        sync"
          + ("   tokens/s/dev     MFU" if tokens else ""))
    for k, r in list(base.items()) + [("searched", result.result)]:
        sp = base["data_parallel"].iteration_time / r.iteration_time
        print(f"  {k:<16} {r.iteration_time * 1e3:12.3f} {sp:8.2f}x   "
              f"{_fmt_bytes(r.comm_bytes):>10} {_fmt_bytes(r.sync_bytes):>10}"
              + (f" {r.tokens_per_s_per_device:14,.0f} {100 * r.mfu:6.1f}%" if tokens else ""))
    if args.out:
        print(f"\nplan written to {args.out} (flexflow simulate --strategy {args.out}, "
              f"or flexflow.Plan.from_json to run it with parallelize(plan=))")
    return 0


# --------------------------------------------------------------------------- parser
def _model_size_args(p) -> None:
    p.add_argument("--size", help="zoo model size: paper, small; gpt2 124m, 350m, 774m, 1.5b; "
                                  "llama 1b, 8b, 70b")
    p.add_argument("--seq", type=int, help="tokens per sequence (gpt2, llama)")
    p.add_argument("--batch-dim", type=int, nargs="+", metavar="D",
                   help="which dim of each input is the batch: one for every input, or one per input "
                        "(default: inferred from the graph)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flexflow", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("models", help="list the zoo models").set_defaults(fn=cmd_models)

    t = sub.add_parser("trace", help="op table and strategy-space size of a model")
    t.add_argument("model")
    t.add_argument("--batch", type=int)
    _model_size_args(t)
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=cmd_trace)

    c = sub.add_parser("calibrate", help="measure this host's messages, collectives and compute once "
                                         "(cached; Machine.detect() and the cpu preset read it)")
    c.add_argument("--nprocs", type=int, default=2)
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_calibrate)

    pr = sub.add_parser("profile", help="measure op times (cached on disk)")
    pr.add_argument("model", nargs="?")
    pr.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    pr.add_argument("--batch", type=int)
    _model_size_args(pr)
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--comm", action="store_true", help="the same as `flexflow calibrate`")
    pr.add_argument("--nprocs", type=int, default=2)
    pr.set_defaults(fn=cmd_profile)

    for name, fn in (("simulate", cmd_simulate), ("search", cmd_search)):
        s = sub.add_parser(name)
        s.add_argument("model")
        s.add_argument("--machine", required=True, help="preset name or machine .json file")
        s.add_argument("--devices", type=int)
        s.add_argument("--batch", type=int)
        _model_size_args(s)
        s.add_argument("--json", action="store_true")
        s.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default="sgd",
                       help="whose state counts in the memory per device")
        s.add_argument("--precision", default="32-true",
                       help="training precision, as PyTorch Lightning names it: 32-true (the model's own "
                            "dtypes), bf16-mixed, 16-mixed or bf16-true")
        s.set_defaults(fn=fn)
        if name == "simulate":
            s.add_argument("--strategy", default="data_parallel",
                           help="data_parallel, model_parallel, expert, optcnn, zero1, zero2, fsdp, megatron, "
                                "fsdp_tp, or a strategy .json file")
            s.add_argument("--recompute", choices=("none", "blocks"), default="none",
                           help="blocks: every op of the repeated blocks recomputed (block checkpointing)")
            s.add_argument("--tp", type=int, help="megatron / fsdp_tp: tensor-parallel degree (default: a node)")
            s.add_argument("--pp", type=int, default=1, help="megatron / fsdp_tp: pipeline stages")
            s.add_argument("--cp", type=int, default=1,
                           help="megatron / fsdp_tp: context parallelism (every op split along the tokens)")
            s.add_argument("--cp-contiguous", action="store_true",
                           help="megatron / fsdp_tp: the sequence cut in contiguous chunks (default: balanced "
                                "head-tail where the model allows)")
            s.add_argument("--no-sequence-parallel", action="store_true",
                           help="megatron / fsdp_tp: the ops between the pairs whole on the tensor-parallel group "
                                "(where it is every device)")
            s.add_argument("--microbatches", type=int, default=1, help="micro-batches a step is cut into")
            s.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved-1f1b"),
                           help="the pipeline's schedule")
            s.add_argument("--interleave", type=int, default=1,
                           help="megatron / fsdp_tp: virtual stages per device group (interleaving)")
            s.add_argument("--trace", help="write a Chrome/Perfetto timeline here")
            s.add_argument("--native", action="store_true",
                           help="also print the plan in torch's terms (FSDP2, DTensor, pipelining): plan.native()")
        else:
            s.add_argument("--budget", type=float, default=30.0, help="seconds")
            s.add_argument("--evaluations", type=int, help="evaluation budget (reproducible)")
            s.add_argument("--seed", type=int, default=0)
            s.add_argument("--out", help="write the best strategy here (JSON)")
            s.add_argument("--init", help="start a chain from this strategy file")
            s.add_argument("--exhaustive", action="store_true", help="exact search (small cases)")
            s.add_argument("--max-states", type=int, default=1_000_000,
                           help="give up the exhaustive search past this many states")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .graph.trace import TraceError
    from .strategy.config import StrategyError
    try:
        return args.fn(args)
    except (CLIError, TraceError, StrategyError, ValueError, FileNotFoundError) as e:
        print(f"flexflow {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
