"""Where a training step's time goes on a GPU: kernel time, idle time, forward / backward / optimizer.

    python benchmarks/gpu_breakdown.py [--cases llama:1b:bf16-mixed:4:2048,...] [--out DIR]

For each case, the plain PyTorch module (the precision's autocast, Adam) on one GPU:
the forward, backward and optimizer step timed apart (CUDA-synchronised between them,
median of 5 steps after 3), the whole step, and over 2 steps under ``torch.profiler``
the device's kernel time (the sum of kernel durations, by kernel) against the wall time:
what the step leaves the device idle.  The simulator adds up op times measured one op at
a time (``benchmarks/gpu_validate.py``); this shows which part of the step those sums
miss.  Writes ``<out>/gpu_breakdown-<KIND>.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gpu_validate import _AUTOCAST, _steps, _sync, parse_cases  # noqa: E402

DEFAULT = "llama:1b:bf16-mixed:4:2048,gpt2:124m:bf16-mixed:16:1024,resnet101:paper:bf16-mixed"


def _phases(module, inputs, opt, autocast, dev, n: int) -> dict:
    f, b, o = [], [], []
    for _ in range(n):
        _sync(dev)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = module(*inputs)
        _sync(dev)
        t1 = time.perf_counter()
        loss.backward()
        _sync(dev)
        t2 = time.perf_counter()
        opt.step()
        _sync(dev)
        f.append(t1 - t0)
        b.append(t2 - t1)
        o.append(time.perf_counter() - t2)
    w = _steps(module, inputs, opt, n, dev, autocast)  # whole steps, nothing waited for inside
    med = statistics.median
    return {"forward_ms": 1e3 * med(f), "backward_ms": 1e3 * med(b), "optimizer_ms": 1e3 * med(o),
            "step_ms": 1e3 * med(w)}


def _kernels(module, inputs, opt, autocast, dev, steps: int = 2) -> dict:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        wall = sum(_steps(module, inputs, opt, steps, dev, autocast))
    by = {}  # kernel (and device copy / fill) name -> microseconds on the device
    for k in prof.key_averages():
        if str(getattr(k, "device_type", "")).endswith("CUDA"):
            t = getattr(k, "self_device_time_total", None)
            by[k.key] = by.get(k.key, 0.0) + (t if t is not None else getattr(k, "self_cuda_time_total", 0.0))
    total = sum(by.values())
    top = sorted(by.items(), key=lambda x: -x[1])[:15]
    return {"wall_ms": 1e3 * wall / steps, "kernel_ms": total / 1e3 / steps,
            "top_kernels": [{"kernel": k[:120], "ms": t / 1e3 / steps} for k, t in top]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=DEFAULT)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--device", default="cuda", help="cpu: a dry run (no kernel times)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_breakdown: no CUDA device here (--device cpu for a dry run)", file=sys.stderr)
        return 2
    import flexflow as ff
    from flexflow.cost.profiledb import device_kind_of, device_name
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = device_kind_of(dev)
    for c in parse_cases(args.cases):
        kw = {"size": c["size"]}
        if c["batch"]:
            kw["batch_size"] = c["batch"]
        if c["seq_len"]:
            kw["seq_len"] = c["seq_len"]
        print(f"== {c['model']} {c['size']} {c['precision']}", flush=True)
        try:
            module, inputs = ff.models.get(c["model"], device=dev, **kw)
            opt = torch.optim.Adam(module.parameters(), lr=1e-5)
            prec = c["precision"]
            autocast = (lambda: torch.autocast(dev.type, dtype=_AUTOCAST[prec])) if prec in _AUTOCAST \
                else contextlib.nullcontext
            _phases(module, inputs, opt, autocast, dev, 3)  # warm-up, optimizer state made
            row = {**c, **_phases(module, inputs, opt, autocast, dev, 5)}
            row.update(_kernels(module, inputs, opt, autocast, dev))
            row["idle_pct"] = 100 * (1 - row["kernel_ms"] / row["wall_ms"])
            print(f"   forward {row['forward_ms']:.1f} backward {row['backward_ms']:.1f} optimizer "
                  f"{row['optimizer_ms']:.1f} step {row['step_ms']:.1f} ms; kernels {row['kernel_ms']:.1f} of "
                  f"{row['wall_ms']:.1f} ms (idle {row['idle_pct']:.0f}%)", flush=True)
            for k in row["top_kernels"][:6]:
                print(f"      {k['ms']:8.2f} ms  {k['kernel'][:90]}")
            del module, inputs, opt
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - reported, the other cases run
            import traceback
            traceback.print_exc()
            row = {**c, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        base = out / f"gpu_breakdown-{kind}"
        meta = {"command": "python benchmarks/gpu_breakdown.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "device": device_name(dev), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        base.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
        lines = [f"# Where a step's time goes: {meta['device']}", "", f"Command: `{meta['command']}` "
                 f"(torch {meta['torch']}, {meta['date']}).  Plain PyTorch, Adam, one GPU.", "",
                 "| model | precision | batch | forward ms | backward ms | optimizer ms | step ms | "
                 "kernel ms / step | device idle |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['precision']} | - | failed: {r['error']} | | | | | |")
                continue
            lines.append(f"| {r['model']} {r['size']} | {r['precision']} | {r['batch'] or '-'} | "
                         f"{r['forward_ms']:.1f} | {r['backward_ms']:.1f} | {r['optimizer_ms']:.1f} | "
                         f"{r['step_ms']:.1f} | {r['kernel_ms']:.1f} | {r['idle_pct']:.0f}% |")
        for r in rows:
            if "top_kernels" in r:
                lines += ["", f"{r['model']}: the kernels with the most time per step", "",
                          "| ms | kernel |", "| --- | --- |"]
                lines += [f"| {k['ms']:.2f} | `{k['kernel']}` |" for k in r["top_kernels"]]
        base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
