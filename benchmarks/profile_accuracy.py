"""How well the fitted analytic cost model predicts measured CPU op times.

Profiles (flexflow.cost.profile.profile_graph) every distinct op of the zoo models at
size "small" with a medium batch, plus a few paper-size single ops (the largest
op of each kind in each paper model, traced on the meta device) at a small batch,
into a fresh cache.  Then, per op kind, compares the measured forward+backward
time with the analytic roofline estimate of flexflow.cost.model.CostModel whose per-rule
efficiencies are fitted (flexflow.cost.model.fit_efficiency):

  held-out  fitted on one half of the entries (alternate entries of each kind),
            error on the other half;
  all       fitted on all entries, error on all;
  default   DEFAULT_EFFICIENCY, no fitting, error on all;

each for the full fit CostModel.for_machine uses (fit_overhead + fit_rules) and for
fit_efficiency's per-rule median alone.

The device spec is this host's CPU: matmul FLOP/s and copy bandwidth measured the
way `flexflow profile --comm` does, 10 us launch overhead (the cpu preset's).

    python benchmarks/profile_accuracy.py            # about a minute on 2 cores
    python benchmarks/profile_accuracy.py --quick    # fewer models, smaller batch
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import flexflow as ff  # noqa: E402
from flexflow.calibrate import comm  # noqa: E402
from flexflow.cost.model import CostModel, fit_efficiency, fit_overhead, fit_rules, partition_flops  # noqa: E402
from flexflow.hardware.specs import DeviceSpec  # noqa: E402
from flexflow.cost.profile import ProfileDB, device_name, key_str, profile_graph  # noqa: E402
from flexflow.strategy.config import ParallelConfig
from flexflow.strategy.regions import partitions  # noqa: E402

ZOO = ["lenet", "alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt", "transformer"]
QUICK_ZOO = ["lenet", "alexnet", "inception_v3", "rnnlm", "nmt", "transformer"]
PAPER = ["alexnet", "inception_v3", "resnet101", "rnnlm", "nmt", "transformer"]
PAPER_MAX_FLOPS = 6e9  # keep single paper-size ops quick on a CPU
SKIP_KINDS = {"getitem", "view", "flatten", "transpose", "contiguous", "cat", "stack", "unpack"}


def whole(op):
    return partitions(op, ParallelConfig({}, (0,)))[0]


def collect(args, db) -> tuple[dict, list]:
    """Profile; returns key -> (op, part) and a log of what was profiled."""
    keyer, ops_by_key, log = CostModel(None), {}, []
    for name in (QUICK_ZOO if args.quick else ZOO):
        t = time.perf_counter()
        g = ff.trace(*ff.models.get(name, size="small", batch_size=args.batch))
        r = profile_graph(g, repeats=args.repeats, db=db)
        for op in g.compute_ops:
            ops_by_key.setdefault(key_str(keyer.key(op, whole(op))), (op, whole(op), f"small:{name}"))
        log.append(f"small {name} batch {args.batch}: {len(r.ops)} distinct ops, "
                   f"{r.measured} measured, {r.errors} failed, {time.perf_counter() - t:.1f} s")
        print(log[-1], flush=True)
    for name in ([] if args.quick else PAPER):
        t = time.perf_counter()
        g = ff.trace(*ff.models.get(name, size="paper", batch_size=args.paper_batch, device="meta"))
        best = {}
        for op in g.compute_ops:
            if op.kind in SKIP_KINDS:
                continue
            f = partition_flops(op, whole(op))
            if f <= PAPER_MAX_FLOPS and (op.kind not in best or f > best[op.kind][0]):
                best[op.kind] = (f, op.name)
        names = [n for _, n in best.values()]
        r = profile_graph(g, repeats=args.repeats, db=db, ops=names, max_seconds=1.0)
        for op in g.compute_ops:
            if op.name in names:
                ops_by_key.setdefault(key_str(keyer.key(op, whole(op))), (op, whole(op), f"paper:{name}"))
        log.append(f"paper {name} batch {args.paper_batch}: {len(r.ops)} single ops "
                   f"({', '.join(sorted(best))}), {r.errors} failed, {time.perf_counter() - t:.1f} s")
        print(log[-1], flush=True)
    return ops_by_key, log


def rel(pred, meas):
    return (pred - meas) / meas


def fit(rows, spec, full=True):
    """The analytic model fitted to measured rows: as CostModel.for_machine does (full), or
    only fit_efficiency's per-rule median with the spec's launch overhead."""
    es = [{k: v for k, v in r.items() if k not in ("op", "part")} for r in rows]
    if not full:
        return CostModel(None, efficiency=fit_efficiency(es, spec))
    oh = fit_overhead(es)
    eff = fit_efficiency(es, spec, overhead=None if oh is None else oh[0])
    return CostModel(None, efficiency=eff, overhead=oh, fits=fit_rules(es, spec))


def evaluate(rows, spec, cm):
    out = []
    for r in rows:
        f, b = cm.analytic(r["op"], r["part"], spec)
        out.append({**r, "pred_fwd": f, "pred_bwd": b})
    return out


def summarize(evald):
    """Median |relative error| of forward and of forward+backward, and the error of
    the summed time (what a simulated iteration adds up)."""
    if not evald:
        return None
    ef = [abs(rel(e["pred_fwd"], e["fwd_s"])) for e in evald]
    et = [abs(rel(e["pred_fwd"] + e["pred_bwd"], e["fwd_s"] + e["bwd_s"])) for e in evald]
    meas = sum(e["fwd_s"] + e["bwd_s"] for e in evald)
    pred = sum(e["pred_fwd"] + e["pred_bwd"] for e in evald)
    return {"n": len(evald), "fwd_median_abs_err": statistics.median(ef),
            "total_median_abs_err": statistics.median(et), "sum_err": rel(pred, meas)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer models, batch 16, no paper-size ops")
    p.add_argument("--batch", type=int, default=None, help="zoo batch (default 32; quick 16)")
    p.add_argument("--paper-batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the cpu preset: one per process)")
    p.add_argument("--out", default=str(HERE / "results" / "profile_accuracy"))
    p.add_argument("--cache", default=None, help="profile cache folder (default: a fresh temporary one)")
    args = p.parse_args(argv)
    args.batch = args.batch or (16 if args.quick else 32)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="flexflow-profile-accuracy-")
    cache = Path(args.cache) if args.cache else Path(tmp.name)
    db = ProfileDB.load(device_name("cpu"), profile_dir=cache / "profiles")

    figs = comm._compute_figures(torch)
    spec = DeviceSpec("cpu", figs["peak_flops"], figs["mem_bw_Bps"], 2**34, 1e-5, "gloo")
    print(f"host: {figs['peak_flops']['float32'] / 1e9:.1f} GFLOP/s fp32, "
          f"{figs['mem_bw_Bps'] / 1e9:.1f} GB/s, {args.threads} thread(s)", flush=True)

    ops_by_key, log = collect(args, db)
    rows = []
    for k, (op, part, where) in ops_by_key.items():
        e = db.get(k)
        if e is None or op.kind in SKIP_KINDS:
            continue
        rows.append({**e, "key": k, "where": where, "op": op, "part": part})
    by_kind: dict[str, list] = {}
    for r in sorted(rows, key=lambda r: hashlib.sha1(r["key"].encode()).hexdigest()):
        by_kind.setdefault(r["kind"], []).append(r)
    train, test = [], []
    for kind, rs in by_kind.items():
        for i, r in enumerate(rs):
            (train if i % 2 == 0 else test).append(r)

    half, full = fit(train, spec), fit(rows, spec)
    ev = {"held-out": evaluate(test, spec, half), "all": evaluate(rows, spec, full),
          "median held-out": evaluate(test, spec, fit(train, spec, full=False)),
          "median all": evaluate(rows, spec, fit(rows, spec, full=False)),
          "default": evaluate(rows, spec, CostModel(None))}
    table = []
    for kind in sorted(by_kind, key=lambda k: -sum(r["fwd_s"] + r["bwd_s"] for r in by_kind[k])):
        rs = by_kind[kind]
        row = {"kind": kind, "rule": rs[0]["rule"], "n": len(rs),
               "fwd_ms_median": statistics.median(r["fwd_s"] for r in rs) * 1e3,
               "bwd_ms_median": statistics.median(r["bwd_s"] for r in rs) * 1e3}
        for name, e in ev.items():
            row[name] = summarize([x for x in e if x["kind"] == kind])
        table.append(row)
    overall = {name: summarize(e) for name, e in ev.items()}
    big = sorted(ev["all"], key=lambda e: -(e["fwd_s"] + e["bwd_s"]))[:20]
    worst = sorted(big, key=lambda e: -abs(math.log((e["pred_fwd"] + e["pred_bwd"]) / (e["fwd_s"] + e["bwd_s"]))))[:8]
    worst = [{"kind": e["kind"], "where": e["where"], "output_shape": e["output_shape"],
              "measured_ms": (e["fwd_s"] + e["bwd_s"]) * 1e3, "predicted_ms": (e["pred_fwd"] + e["pred_bwd"]) * 1e3}
             for e in worst]
    seconds = time.perf_counter() - t0
    cmd = " ".join(["python benchmarks/profile_accuracy.py",
                    *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    result = {"command": cmd, "device_name": device_name("cpu"), "threads": args.threads,
              "torch": torch.__version__, "batch": args.batch, "paper_batch": args.paper_batch,
              "repeats": args.repeats, "spec": {"peak_flops": figs["peak_flops"], "mem_bw_Bps": figs["mem_bw_Bps"],
                                                "launch_overhead_s": spec.launch_overhead_s},
              "fitted_overhead_s": full.overhead, "fits": {k: vars(v) for k, v in full.fits.items()},
              "median_efficiency": fit(rows, spec, full=False).efficiency, "worst": worst, "log": log,
              "per_kind": table, "overall": overall, "seconds": seconds,
              "entries": [{k: v for k, v in r.items() if k not in ("op", "part")} for r in rows]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    tmp.cleanup()
    return 0


def _pct(s, field):
    return "-" if s is None else f"{100 * s[field]:.0f}%"


def markdown(r) -> str:
    spec, o = r["spec"], r["overall"]
    cell = lambda t, v, f="total_median_abs_err": _pct(t[v], f)  # noqa: E731
    lines = [
        "# Profiler vs analytic cost model (CPU)", "",
        f"Command: `{r['command']}` ({r['seconds']:.0f} s; torch {r['torch']}, {r['threads']} thread(s), "
        f"profile `{r['device_name']}`).", "",
        f"Measured: every distinct op of the zoo at size small, batch {r['batch']}"
        + (f", plus the largest op of each kind (<= {PAPER_MAX_FLOPS / 1e9:g} GFLOP) of the paper-size "
           f"models at batch {r['paper_batch']}" if any(x.startswith("paper") for x in r["log"]) else "")
        + f"; median of {r['repeats']} runs of `flexflow.cost.profile.profile_graph` (forward, and backward of "
        "the sum of the output w.r.t. float inputs and parameters). Structural ops (views, transposes, "
        "concat) are left out.", "",
        "Analytic: `work = max(FLOPs / (peak x eff), bytes / (bandwidth x bw_scale))`, forward = work + "
        "fixed forward cost, backward = backward_factor x bwd_scale x work + fixed backward cost, with this "
        f"host's {spec['peak_flops']['float32'] / 1e9:.1f} GFLOP/s fp32 matmul peak and "
        f"{spec['mem_bw_Bps'] / 1e9:.1f} GB/s copy bandwidth (measured as `flexflow profile --comm` does).", "",
        "- **fit** (what `CostModel.for_machine` uses): `fit_overhead` + `fit_rules`: per rule, and per op "
        "kind with >= 4 entries, efficiency, fixed costs and scales by least squares on log time;",
        "- **median**: `fit_efficiency` alone, the per-rule median of FLOP time / measured compute time, "
        f"{spec['launch_overhead_s'] * 1e6:g} us launch (the cpu preset's), scales 1;",
        "- **default**: `DEFAULT_EFFICIENCY`, nothing fitted.", "",
        "Errors: median over entries of |predicted - measured| / measured forward+backward time "
        "(`fwd`: forward only); `sum`: error of the group's summed time (what an iteration adds up). "
        "**held-out**: fitted on alternate entries of each kind, evaluated on the other half; **all**: "
        "fitted on and evaluated on every entry.", "",
        "| kind | rule | n | fwd ms (med) | bwd ms (med) | fit held-out | fit held-out fwd | fit all | fit all sum "
        "| median held-out | median all | default |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for t in r["per_kind"]:
        lines.append(f"| {t['kind']} | {t['rule']} | {t['n']} | {t['fwd_ms_median']:.3f} | {t['bwd_ms_median']:.3f} | "
                     f"{cell(t, 'held-out')} | {cell(t, 'held-out', 'fwd_median_abs_err')} | {cell(t, 'all')} | "
                     f"{cell(t, 'all', 'sum_err')} | {cell(t, 'median held-out')} | {cell(t, 'median all')} | "
                     f"{cell(t, 'default')} |")
    lines.append(f"| **all kinds** | | {o['all']['n']} | | | **{cell(o, 'held-out')}** | "
                 f"{cell(o, 'held-out', 'fwd_median_abs_err')} | **{cell(o, 'all')}** | {cell(o, 'all', 'sum_err')} | "
                 f"{cell(o, 'median held-out')} | {cell(o, 'median all')} | {cell(o, 'default')} |")
    lines += ["", "Fitted parameters (all entries):", "",
              "| group | n | eff | fixed fwd us | fixed bwd us | bw scale | bwd scale |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for g, f in r["fits"].items():
        lines.append(f"| {g} | {f['n']} | {f['efficiency']:.3g} | {f['overhead_fwd_s'] * 1e6:.1f} | "
                     f"{f['overhead_bwd_s'] * 1e6:.1f} | {f['bandwidth_scale']:.3g} | {f['backward_scale']:.3g} |")
    oh = r["fitted_overhead_s"]
    lines += ["", f"Per-op fixed cost (`fit_overhead`, other rules): forward {oh[0] * 1e6:.1f} us, "
              f"backward {oh[1] * 1e6:.1f} us. Median-fit efficiencies: "
              + ", ".join(f"{k} {v:.3g}" for k, v in sorted(r["median_efficiency"].items()) if k != "default"),
              "", "Largest errors of the fit (all entries), by measured time:", "",
              "| op | from | output | measured fwd+bwd ms | predicted ms |", "| --- | --- | --- | ---: | ---: |"]
    for e in r["worst"]:
        lines.append(f"| {e['kind']} | {e['where']} | {tuple(e['output_shape'])} | {e['measured_ms']:.2f} | "
                     f"{e['predicted_ms']:.2f} |")
    lines += ["", "What was profiled:", ""] + [f"- {x}" for x in r["log"]] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
