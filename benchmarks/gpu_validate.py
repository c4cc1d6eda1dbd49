"""Validate the library on a CUDA host: profile, run with NCCL, compare with predictions.

    python benchmarks/gpu_validate.py                       # every GPU of the host
    python benchmarks/gpu_validate.py --models alexnet,transformer --steps 10

1. Profiles the ops of the zoo models (the partitions of the strategies run
   below) on this GPU kind and writes the profile where the cost model reads
   it: the profile cache, and ``flexflow/data/profile-<KIND>.json`` in the
   source tree (ship it by committing that file).
2. Runs the executor with NCCL on every GPU of the host (one process per GPU;
   one process where there is one GPU): data parallel, expert and searched
   strategies, timed over ``--steps`` synchronised steps after warm-up.
3. Reports the simulator's predicted step time (``Machine.detect()`` and the
   fresh profile) against the measured one, and the one-process overhead of
   ``parallelize`` against the plain module.

Writes ``benchmarks/results/gpu_validate-<KIND>.md`` and ``.json``.  Without
CUDA it stops at once with a message (exit code 2).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DEFAULT_MODELS = ["alexnet", "transformer", "rnnlm", "inception_v3", "resnet101"]
PER_GPU_BATCH = {"alexnet": 256}  # the paper's per-device batch; 64 for the others


def _batch(name: str, ngpus: int) -> int:
    return PER_GPU_BATCH.get(name, 64) * ngpus


def _timed_steps(model, inputs, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` SGD steps (forward, backward, update), CUDA-synchronised."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    out = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def _worker(rank: int, name: str, size: str, steps: int, warmup: int, budget: float, strategies: dict):
    """One rank: every strategy of ``strategies`` (label -> JSON or None: search) timed on NCCL."""
    import torch.distributed as dist

    import flexflow as ff
    world = dist.get_world_size() if dist.is_initialized() else 1
    module, inputs = ff.models.get(name, size=size, batch_size=_batch(name, world), device="cuda")
    out = {}
    for label, text in strategies.items():
        model = ff.parallelize(module, example_inputs=inputs, strategy=text, budget=budget)
        ts = _timed_steps(model, inputs, steps, warmup)
        if dist.is_initialized():  # a step ends when the slowest rank ends
            t = torch.tensor(ts, device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ts = t.tolist()
        out[label] = {"step_s": statistics.median(ts), "spread_s": [min(ts), max(ts)],
                      "strategy": model.strategy.to_json()}
        del model
        torch.cuda.empty_cache()
    return out


def _one_process(name: str, size: str, steps: int, warmup: int) -> dict:
    """parallelize on one GPU against the plain module, alternating rounds."""
    import flexflow as ff
    module, inputs = ff.models.get(name, size=size, batch_size=_batch(name, 1), device="cuda")
    plain = copy.deepcopy(module)
    par = ff.parallelize(module, example_inputs=inputs)
    p, f = [], []
    for _ in range(3):
        p += _timed_steps(plain, inputs, steps, warmup)
        f += _timed_steps(par, inputs, steps, warmup)
    return {"plain_step_s": statistics.median(p), "flexflow_step_s": statistics.median(f),
            "overhead_pct": 100 * (statistics.median(f) / statistics.median(p) - 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--size", default="paper", choices=("paper", "small"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget", type=float, default=20.0, help="search seconds per model")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_validate: no CUDA device here (torch.cuda.is_available() is False); run it on a host "
              "with NVIDIA GPUs and a CUDA build of torch", file=sys.stderr)
        return 2
    import flexflow as ff
    from flexflow.cost.profile import (
        ProfileDB,
        device_kind_of,
        device_name,
        package_profile_path,
        profile_graph)

    t_start = time.perf_counter()
    ngpus = torch.cuda.device_count()
    machine = ff.Machine.detect()
    kind = device_kind_of("cuda")
    models = [m for m in args.models.split(",") if m]
    rows = []
    for name in models:
        print(f"== {name} on {ngpus} x {device_name('cuda')}", flush=True)
        module, inputs = ff.models.get(name, size=args.size, batch_size=_batch(name, ngpus), device="meta")
        graph = ff.trace(module, inputs)
        m = machine.with_devices(ngpus) if machine.num_devices >= ngpus else machine
        fixed = {"data_parallel": ff.Strategy.data_parallel(graph, m), "expert": ff.Strategy.expert(graph, m)}
        t0 = time.perf_counter()
        for s in fixed.values():
            profile_graph(graph, device="cuda", strategy=s)
        profile_graph(graph, device="cuda")  # every op whole (one-process runs)
        prof_s = time.perf_counter() - t0
        searched = ff.search(graph, m, budget=args.budget).strategy if ngpus > 1 else fixed["data_parallel"]
        profile_graph(graph, device="cuda", strategy=searched)
        strategies = {k: v.to_json() for k, v in fixed.items()}
        strategies["searched"] = searched.to_json()
        if ngpus > 1:
            res = ff.launch(_worker, ngpus, name, args.size, args.steps, args.warmup, args.budget, strategies,
                            backend="nccl", timeout_s=900)[0]
        else:
            res = _worker(0, name, args.size, args.steps, args.warmup, args.budget, strategies)
        sim = ff.Simulator(graph, m)
        row = {"model": name, "batch": _batch(name, ngpus), "gpus": ngpus, "profile_s": prof_s, "runs": {}}
        for label, r in res.items():
            strat = ff.Strategy.from_json(r["strategy"], graph)
            pred = sim.simulate(strat).iteration_time
            row["runs"][label] = {"measured_ms": r["step_s"] * 1e3, "spread_ms": [x * 1e3 for x in r["spread_s"]],
                                  "predicted_ms": pred * 1e3,
                                  "error_pct": 100 * (pred - r["step_s"]) / r["step_s"]}
            print(f"   {label:<14} measured {r['step_s'] * 1e3:8.2f} ms  predicted {pred * 1e3:8.2f} ms", flush=True)
        row["one_process"] = _one_process(name, args.size, args.steps, args.warmup)
        print(f"   one process: overhead {row['one_process']['overhead_pct']:+.1f}% over the plain module")
        rows.append(row)
    db = ProfileDB.load(device_name("cuda"), device_kind=kind)
    saved = db.save()
    shipped = package_profile_path(kind)
    shipped.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(saved, shipped)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"gpu_validate-{kind}"
    command = "python benchmarks/gpu_validate.py " + " ".join(sys.argv[1:] if argv is None else argv)
    base.with_suffix(".json").write_text(json.dumps({"command": command, "device": device_name("cuda"),
                                                     "gpus": ngpus, "torch": torch.__version__, "rows": rows},
                                                    indent=1))
    lines = [f"# GPU validation: {ngpus} x {device_name('cuda')}", "",
             f"Command: `{command.strip()}` ({time.perf_counter() - t_start:.0f} s, torch {torch.__version__}, "
             f"NCCL).  Profile written to `{shipped.relative_to(ROOT)}`.", "",
             "| model | batch | strategy | measured ms (spread) | predicted ms | error |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for label, x in r["runs"].items():
            lo, hi = x["spread_ms"]
            lines.append(f"| {r['model']} | {r['batch']} | {label} | {x['measured_ms']:.2f} ({lo:.2f}-{hi:.2f}) | "
                         f"{x['predicted_ms']:.2f} | {x['error_pct']:+.0f}% |")
    lines += ["", "One process, flexflow against the plain module:", "",
              "| model | plain ms | flexflow ms | overhead |", "| --- | --- | --- | --- |"]
    for r in rows:
        o = r["one_process"]
        lines.append(f"| {r['model']} | {o['plain_step_s'] * 1e3:.2f} | {o['flexflow_step_s'] * 1e3:.2f} | "
                     f"{o['overhead_pct']:+.1f}% |")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {base.with_suffix('.md')}, .json and {shipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
