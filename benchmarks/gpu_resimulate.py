"""Recorded GPU measurements against the current simulator's predictions (no GPU needed).

    python benchmarks/gpu_resimulate.py benchmarks/results/gpu_validate-H200-run2.json \\
        benchmarks/results/gpu_validate-H200.json --skip llama:bf16-mixed:rc,transformer:32-true,rnnlm:32-true

Reads the rows ``benchmarks/gpu_validate.py`` recorded (a later file's row replaces an
earlier one of the same case) and predicts each again: the model traced on the ``meta``
device, data parallelism on one device of the GPU kind's node preset, Adam, the row's
precision; *analytic* on the datasheet figures and published efficiencies, *as shipped*
on the cost model a planning host gets for that kind (``CostModel.for_machine``: the
profile under ``flexflow/data`` and the efficiencies fitted to it).  The recorded step is
flexflow's executor's, so a change to the simulator or the executor since the recording
shows here (a row measured before a change to the executor is stale: ``--skip`` it).
Writes ``benchmarks/results/gpu_resimulate-<KIND>.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _case_key(r: dict) -> tuple:
    return (r["model"], r["size"], r["precision"], r.get("batch"), r.get("seq_len"), bool(r.get("recompute")))


def resimulate(row: dict, machine) -> dict:
    import flexflow as ff
    from flexflow.cost.model import CostModel
    kw = {"size": row["size"], "batch_size": row["batch"]}
    if row.get("seq_len"):
        kw["seq_len"] = row["seq_len"]
    graph = ff.trace(*ff.models.get(row["model"], device="meta", **kw))
    dp = ff.Strategy.data_parallel(graph, machine)
    if row.get("recompute"):
        dp = dp.recompute_blocks()
    out = {}
    for label, cm in (("analytic", CostModel(machine)), ("shipped", CostModel.for_machine(machine))):
        r = ff.Simulator(graph, machine, cm, optimizer="adam", precision=row["precision"]).simulate(dp)
        out[label] = {"step_ms": r.iteration_time * 1e3, "peak_bytes": int(r.peak_memory[0])}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="gpu_validate JSON files, oldest first")
    p.add_argument("--skip", default="", help="model:precision[:rc],... rows not to use (stale measurements)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    import flexflow as ff
    from flexflow.hardware.specs import GPU_SPECS
    skip = {tuple(s.split(":")) for s in args.skip.split(",") if s}
    rows, kind, sources = {}, None, {}
    for f in args.files:
        d = json.loads(Path(f).read_text())
        k = d["device"].split("(")[-1].split()[0]  # "cuda-NVIDIA_H200 (H200 spec)" -> H200
        if kind not in (None, k):
            raise SystemExit(f"gpu_resimulate: {f} is of {k}, the others of {kind}")
        kind = k
        for r in d["rows"]:
            tag = (r["model"], r["precision"]) + (("rc",) if r.get("recompute") else ())
            if "flexflow" in r and tag not in skip:
                rows[_case_key(r)] = r
                sources[_case_key(r)] = Path(f).name
    if kind not in GPU_SPECS:
        raise SystemExit(f"gpu_resimulate: no preset of GPU kind {kind!r}")
    machine = ff.Machine.preset(f"{kind.lower()}-node", devices=1)
    out = []
    for key, r in rows.items():
        pred = resimulate(r, machine)
        meas = r["flexflow"]["step_ms"]
        row = {"case": list(key), "source": sources[key], "measured_ms": meas,
               "measured_peak_bytes": r["flexflow"]["peak_bytes"], **pred}
        for label in ("analytic", "shipped"):
            row[label]["error_pct"] = 100 * (pred[label]["step_ms"] / meas - 1)
        out.append(row)
        print(f"{r['model']:12s} {r['precision']:10s} measured {meas:8.2f} ms  analytic "
              f"{pred['analytic']['step_ms']:8.2f} ({row['analytic']['error_pct']:+.0f}%)  shipped "
              f"{pred['shipped']['step_ms']:8.2f} ({row['shipped']['error_pct']:+.0f}%)", flush=True)
    command = "python benchmarks/gpu_resimulate.py " + " ".join(sys.argv[1:] if argv is None else argv)
    base = Path(args.out) / f"gpu_resimulate-{kind}"
    base.with_suffix(".json").write_text(json.dumps({"command": command, "rows": out}, indent=1))
    lines = [f"# Recorded {kind} steps against the current simulator", "", f"Command: `{command}`.", "",
             "Measured: flexflow's executor, one GPU, data parallelism, Adam (`gpu_validate.py`, the file "
             "named). Predicted now: *analytic* (datasheet figures, published efficiencies) and *as "
             "shipped* (the kind's profile in `flexflow/data` and the efficiencies fitted to it).", "",
             "| model | precision | batch | measured ms | analytic ms (error) | as shipped ms (error) | "
             "measured in |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in out:
        m, s, prec, b, seq, rc = row["case"]
        a, sh = row["analytic"], row["shipped"]
        lines.append(f"| {m} {s}{' rc' * rc} | {prec} | {b}{' x ' + str(seq) if seq else ''} | "
                     f"{row['measured_ms']:.2f} | {a['step_ms']:.2f} ({a['error_pct']:+.0f}%) | "
                     f"{sh['step_ms']:.2f} ({sh['error_pct']:+.0f}%) | `{row['source']}` |")
    for label in ("analytic", "shipped"):
        e = sorted(abs(r[label]["error_pct"]) for r in out)
        if e:
            lines += ["", f"Median |error| {label}: {statistics.median(e):.0f}% (largest {e[-1]:.0f}%) "
                          f"over {len(e)} cases."]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {base.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
