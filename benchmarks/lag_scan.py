"""The simulator's error on recorded sim_accuracy runs as the message lag varies.

    .venv/bin/python benchmarks/lag_scan.py benchmarks/results/sim_accuracy.json [more.json ...]

A recorded run (``sim_accuracy.py``'s JSON) keeps every strategy and its measured step
time, and the calibration it fitted.  This re-simulates each strategy with that
calibration, the part of a message's latency that holds no core (``message_lag_s``) set
to 0, 1/4, 1/2, 3/4 and all of the latency, and the op profiles now in the cache
(``benchmarks/.cache``, as sim_accuracy.py leaves them): what the lag the calibration
fitted costs against the best one for those measurements.  No process is launched.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def scan(path: str, graphs: dict) -> list[str]:
    import flexflow as ff
    from flexflow.calibrate.comm import cpu_machine_from_figures
    from flexflow.cost.model import CostModel
    from flexflow.sim.simulate import Simulator
    from real_speedup import build
    d = json.loads(Path(path).read_text())
    fig = d["summary"]["calibration"]
    base = cpu_machine_from_figures(fig, devices=2)
    lat = base.intra_node.latency_s
    rows = d["rows"] + (d.get("mixed_rows") or [])
    lines = [f"{path}: a message {lat * 1e6:.0f} us, fitted lag {fig.get('message_lag_s', 0) * 1e6:.0f} us, "
             f"recorded median {d['summary']['median_abs_error'] * 100:.1f}%, largest "
             f"{d['summary']['max_abs_error'] * 100:.1f}% (the 32 main cases)"]
    for frac in FRACTIONS:
        m = dataclasses.replace(base, spec=dataclasses.replace(base.spec, message_lag_s=frac * lat))
        cost, errs = CostModel.for_machine(m), []
        for r in rows:
            if (r["model"], r["batch"]) not in graphs:
                module, inputs = build(r["model"], r["batch"])
                graphs[r["model"], r["batch"]] = ff.trace(module, inputs)
            g = graphs[r["model"], r["batch"]]
            s = ff.Strategy(g, dict(ff.Strategy.from_json(r["strategy_json"], g).items()))
            p = Simulator(g, m, cost).simulate(s, incremental=False).iteration_time * 1e3
            errs.append((p - r["measured_ms"]) / r["measured_ms"])
        a = sorted(abs(e) for e in errs)
        lines.append(f"  lag {frac:.2f} of the latency: median |error| {statistics.median(a) * 100:.1f}%, "
                     f"largest {a[-1] * 100:.1f}%, mean {statistics.mean(errs) * 100:+.1f}% "
                     f"({len(errs)} strategies, mixed ones included)")
    return lines


def main(argv=None) -> int:
    paths = (sys.argv[1:] if argv is None else argv) or [str(ROOT / "benchmarks/results/sim_accuracy.json")]
    os.environ.setdefault("FLEXFLOW_CACHE_DIR", str(ROOT / "benchmarks" / ".cache"))
    os.environ.setdefault("FLEXFLOW_NO_CALIBRATE", "1")
    graphs: dict = {}
    for p in paths:
        print("\n".join(scan(p, graphs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
