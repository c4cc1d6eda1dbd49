#!/usr/bin/env python3
"""Compare flexflow's simulated figures and searched strategies between two code roots.

Usage (run with the project venv: .venv/bin/python):

  figures_equal.py cli    ROOT OUTDIR [--evaluations 300]   # run every CLI case for one code root
  figures_equal.py spot   ROOT OUTFILE CASE...             # a few cases as separate processes
  figures_equal.py pysim  ROOT OUTFILE                      # Simulator(...).simulate(Strategy.random(...))
  figures_equal.py compare OLD_OUTDIR NEW_OUTDIR [OLD_PYSIM NEW_PYSIM]

Each ROOT is imported with ROOT first on sys.path (asserted via flexflow.__file__), cwd=ROOT.
The caller sets FLEXFLOW_CACHE_DIR (one fresh empty dir, the same for both roots) and
FLEXFLOW_NO_CALIBRATE=1; this script refuses to run without them. PYTHONHASHSEED is pinned to 0
for the child processes so both sides see identical hashing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

PY = sys.executable
STRATEGIES = ("data_parallel", "model_parallel", "expert", "optcnn")
SIM_MACHINES = (("p100-cluster", 4), ("p100-cluster", 16), ("k80-cluster", 4), ("cpu", 2))
SEARCH_MACHINES = (("p100-cluster", 4), ("cpu", 2))
# fields that depend on the wall clock, not on the model: left out of the comparison
IGNORED = {"search_seconds"}

BOOT = ("import sys, os; root = os.environ['FF_ROOT']; sys.path.insert(0, root); import flexflow; "
        "assert os.path.realpath(flexflow.__file__).startswith(os.path.realpath(root) + os.sep), "
        "flexflow.__file__; from flexflow.cli import main; sys.exit(main())")


def _env(root):
    for v in ("FLEXFLOW_CACHE_DIR", "FLEXFLOW_NO_CALIBRATE"):
        if not os.environ.get(v):
            sys.exit(f"set {v} (the same for both roots)")
    env = dict(os.environ, FF_ROOT=root, PYTHONPATH=root, PYTHONHASHSEED="0")
    return env


def flexflow_cli(root, args, timeout=1800):
    t = time.perf_counter()
    p = subprocess.run([PY, "-c", BOOT, *args], cwd=root, env=_env(root), capture_output=True,
                       text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr, time.perf_counter() - t


def cases(models):
    out = []
    for m in models:
        for mach, n in SIM_MACHINES:
            for s in STRATEGIES:
                out.append((f"simulate-{m}-{mach}-{n}-{s}",
                            ["simulate", m, "--machine", mach, "--devices", str(n), "--strategy", s, "--json"]))
    for m in models:
        for mach, n in SEARCH_MACHINES:
            out.append((f"search-{m}-{mach}-{n}",
                        ["search", m, "--machine", mach, "--devices", str(n), "--seed", "0", "--json"]))
    return out


def run_cli(root, outdir, evaluations):
    """Every case of every zoo model, one child process per model: the child imports ROOT's
    flexflow once and calls its console entry point ``flexflow.cli.main(argv)`` for each case
    (what the ``flexflow`` script does), capturing stdout/stderr."""
    root = os.path.abspath(root)
    os.makedirs(outdir, exist_ok=True)
    rc, out, err, _ = flexflow_cli(root, ["models"])
    if rc:
        sys.exit(f"flexflow models failed: {err}")
    models = out.split()
    with open(os.path.join(outdir, "_models.json"), "w") as f:
        json.dump(models, f)
    for m in models:
        t = time.perf_counter()
        p = subprocess.run([PY, os.path.abspath(__file__), "_worker", root, os.path.abspath(outdir), m,
                            str(evaluations)], cwd=root, env=_env(root))
        print(f"== {m}: worker rc={p.returncode} {time.perf_counter() - t:.0f}s", flush=True)


def _worker(root, outdir, model, evaluations):
    import contextlib
    import io
    import traceback
    sys.path.insert(0, root)
    import flexflow
    assert os.path.realpath(flexflow.__file__).startswith(os.path.realpath(root) + os.sep), flexflow.__file__
    from flexflow.cli import main
    for name, args in cases([model]):
        path = os.path.join(outdir, name + ".json")
        if os.path.exists(path):
            continue  # resumable
        strat_file = None
        if args[0] == "search":
            strat_file = os.path.join(outdir, name + ".strategy.json")
            args = args + ["--evaluations", str(evaluations), "--out", strat_file]
        o, e = io.StringIO(), io.StringIO()
        t = time.perf_counter()
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            try:
                rc = main(list(args))
            except SystemExit as x:
                rc = x.code
            except Exception:  # noqa: BLE001 - record, compare
                traceback.print_exc()
                rc = "exception"
        secs = time.perf_counter() - t
        rec = {"args": args, "rc": rc, "stdout": o.getvalue(), "stderr_tail": e.getvalue()[-3000:],
               "seconds": secs, "flexflow_file": flexflow.__file__}
        if strat_file and os.path.exists(strat_file):
            with open(strat_file) as f:
                rec["strategy_json"] = f.read()
        with open(path + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(path + ".tmp", path)
        print(f"{name}: rc={rc} {secs:.1f}s", flush=True)


def run_spot(root, outfile, names):
    """The given cases each as a separate ``flexflow`` process (the real command line)."""
    root = os.path.abspath(root)
    table = dict(cases(sorted({n.split("-")[1] for n in names})))
    res = {}
    for n in names:
        args = list(table[n])
        if args[0] == "search":
            args += ["--evaluations", "300"]
        rc, out, err, secs = flexflow_cli(root, args)
        res[n] = {"rc": rc, "stdout": out, "stderr_tail": err[-3000:]}
        print(f"{n}: rc={rc} {secs:.1f}s", flush=True)
    with open(outfile, "w") as f:
        json.dump(res, f)


# --------------------------------------------------------------------------- python-level check
PYSIM_MODELS = ("lenet", "alexnet", "rnntc", "transformer")
PYSIM_MACHINES = (("p100-cluster", 4), ("p100-cluster", 16), ("cpu", 2))
PYSIM_SEEDS = range(5)


def run_pysim(root, outfile):
    root = os.path.abspath(root)
    sys.path.insert(0, root)
    import flexflow
    assert os.path.realpath(flexflow.__file__).startswith(os.path.realpath(root) + os.sep), flexflow.__file__
    from flexflow import Machine, Simulator, Strategy
    from flexflow.cli import load_model, _trace
    res = {"flexflow_file": flexflow.__file__}
    for model in PYSIM_MODELS:
        for mach, n in PYSIM_MACHINES:
            machine = Machine.preset(mach, devices=n)
            module, inputs, _ = load_model(model, None, machine.num_devices)
            graph = _trace(module, inputs)
            sim = Simulator(graph, machine)
            for seed in PYSIM_SEEDS:
                s = Strategy.random(graph, machine, seed)
                r = sim.simulate(s)
                res[f"{model}-{mach}-{n}-seed{seed}"] = {
                    "iteration_time": r.iteration_time, "comm_bytes": r.comm_bytes,
                    "sync_bytes": r.sync_bytes, "peak_memory": list(r.peak_memory),
                    "feasible": r.feasible, "message": r.message, "num_tasks": r.num_tasks,
                    "device_busy": list(r.device_busy), "link_busy": list(r.link_busy),
                    "strategy_json": s.to_json()}
                print(model, mach, n, seed, r.iteration_time, flush=True)
    # every CLI search case again through the Python API, recording what the CLI's JSON
    # leaves out (and what a CLI search that finds no feasible strategy does not print)
    from flexflow import search
    from flexflow.cli import _cost_model
    models = flexflow.models.names()
    for model in models:
        for mach, n in SEARCH_MACHINES:
            machine = Machine.preset(mach, devices=n)
            module, inputs, _ = load_model(model, None, machine.num_devices)
            graph = _trace(module, inputs)
            r = search(graph, machine, seed=0, cost_model=_cost_model(machine), evaluations=300, progress=False)
            fig = lambda x: {"iteration_time": x.iteration_time, "comm_bytes": x.comm_bytes,  # noqa: E731
                             "sync_bytes": x.sync_bytes, "peak_memory": list(x.peak_memory),
                             "feasible": x.feasible, "message": x.message, "num_tasks": x.num_tasks}
            res[f"search-{model}-{mach}-{n}"] = {
                "strategy_json": r.strategy.to_json(), "result": fig(r.result),
                "baselines": {k: fig(v) for k, v in r.baselines.items()},
                "baseline_strategies": {k: v.to_json() for k, v in r.baseline_strategies.items()},
                "evaluations": r.evaluations, "simulations": r.simulations, "screened": r.screened,
                "cut": r.cut, "history": [(h[0], h[2]) for h in r.history],  # h[1] is wall time
                "accept_rate": r.accept_rate, "beta": r.beta, "chains": list(r.chains),
                "source": r.source, "local_optimum": r.local_optimum}
            print("search", model, mach, n, r.result.iteration_time, r.evaluations, flush=True)
    with open(outfile, "w") as f:
        json.dump(res, f)


# --------------------------------------------------------------------------- comparison
def diff(a, b, path=""):
    """Every leaf difference between a and b (exact: float == and type)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k in IGNORED:
                continue
            if k not in a or k not in b:
                out.append((f"{path}.{k}", a.get(k, "<missing>"), b.get(k, "<missing>")))
            else:
                out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [(f"{path}[len]", len(a), len(b))]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    if type(a) is not type(b) or a != b:
        return [(path or ".", a, b)]
    return []


def _parse(rec):
    out = {"rc": rec["rc"]}
    if rec["rc"] == 0:
        out["json"] = json.loads(rec["stdout"])
        if "strategy_json" in rec:
            out["strategy"] = json.loads(rec["strategy_json"])
    else:
        out["error"] = rec["stderr_tail"].strip().splitlines()[-1:] if rec["stderr_tail"].strip() else []
    return out


def compare(old_dir, new_dir, old_py=None, new_py=None):
    names = sorted(f[:-5] for f in os.listdir(old_dir) if f.endswith(".json") and not f.startswith("_")
                   and not f.endswith(".strategy.json"))
    names_new = sorted(f[:-5] for f in os.listdir(new_dir) if f.endswith(".json") and not f.startswith("_")
                       and not f.endswith(".strategy.json"))
    report = {"cases": 0, "identical": 0, "differences": {}, "missing": sorted(set(names) ^ set(names_new)),
              "failed_both": [], "models_old": json.load(open(os.path.join(old_dir, "_models.json"))),
              "models_new": json.load(open(os.path.join(new_dir, "_models.json")))}
    for n in sorted(set(names) & set(names_new)):
        a, b = (_parse(json.load(open(os.path.join(d, n + ".json")))) for d in (old_dir, new_dir))
        report["cases"] += 1
        d = diff(a, b)
        if a["rc"] != 0 and b["rc"] != 0:
            report["failed_both"].append((n, a.get("error"), b.get("error")))
        if d:
            report["differences"][n] = d
        else:
            report["identical"] += 1
    if old_py and new_py:
        pa, pb = json.load(open(old_py)), json.load(open(new_py))
        pa.pop("flexflow_file"), pb.pop("flexflow_file")
        report["pysim_cases"] = len(set(pa) | set(pb))
        report["pysim_identical"] = sum(1 for k in set(pa) & set(pb) if not diff(pa[k], pb[k]))
        report["pysim_differences"] = {k: diff(pa.get(k), pb.get(k)) for k in sorted(set(pa) | set(pb))
                                       if k not in pa or k not in pb or diff(pa[k], pb[k])}
    return report


def main():
    cmd = sys.argv[1]
    if cmd == "cli":
        ev = int(sys.argv[sys.argv.index("--evaluations") + 1]) if "--evaluations" in sys.argv else 300
        run_cli(sys.argv[2], sys.argv[3], ev)
    elif cmd == "_worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif cmd == "spot":
        run_spot(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif cmd == "pysim":
        _env(sys.argv[2])
        run_pysim(sys.argv[2], sys.argv[3])
    elif cmd == "compare":
        r = compare(*sys.argv[2:6])
        print(json.dumps(r, indent=1, default=str))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
