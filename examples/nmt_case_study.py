"""Case study (the paper's Section 7.4): NMT on 16 P100s and 64 K80s.

The paper found strategies that place the embedding layers on few devices
and split the softmax layer along its vocabulary dimension, cutting the data
moved per iteration on 64 K80s from 65.8 GB (data parallel) and 24.2 GB
(expert) to 12.1 GB.  This script searches both settings on the simulated
clusters and reports where the embeddings and the softmax go and the bytes
moved (activations + parameter sync).

    python examples/nmt_case_study.py [--budget 120] [--out FILE.md]
"""
from __future__ import annotations

import argparse

import flexflow as ff

PAPER_GB = {"data_parallel": 65.8, "expert": 24.2, "searched": 12.1}


def study(preset: str, devices: int, budget: float, seed: int, evaluations):
    machine = ff.Machine.preset(preset, devices=devices)
    module, inputs = ff.models.get("nmt", batch_size=64 * devices, device="meta")
    graph = ff.trace(module, inputs)
    kw = {"evaluations": evaluations} if evaluations else {}
    res = ff.search(graph, machine, budget=budget, seed=seed, **kw)
    rows = []
    for name in ("data_parallel", "expert"):
        r = res.baselines[name]
        rows.append((name, r))
    rows.append(("searched", res.result))
    out = [f"## NMT on {devices} devices of {preset} (batch {graph.batch_size})", "",
           f"{res.evaluations} proposals scored in {res.seconds:.1f} s", "",
           "| strategy | iteration (ms) | activations (GB) | param sync (GB) | total moved (GB) |"
           + (" paper total (GB) |" if preset == "k80-cluster" and devices == 64 else ""),
           "|---|---:|---:|---:|---:|" + ("---:|" if preset == "k80-cluster" and devices == 64 else "")]
    for name, r in rows:
        paper = f" {PAPER_GB[name]} |" if preset == "k80-cluster" and devices == 64 else ""
        out.append(f"| {name} | {r.iteration_time * 1e3:.1f} | {r.comm_bytes / 1e9:.2f} | "
                   f"{r.sync_bytes / 1e9:.2f} | {(r.comm_bytes + r.sync_bytes) / 1e9:.2f} |{paper}")
    out += ["", "Where the searched strategy puts the embeddings, the softmax (vocabulary) layer",
            "and the recurrent layers:", ""]
    for op in graph.compute_ops:
        is_cell_rep = op.kind == "lstm_cell" and graph.groups[op.group][0] == op.name
        if op.kind in ("embedding",) or op.name in ("proj", "out", "decoder", "generator") \
                or (op.kind == "linear" and op.output_shape[-1] >= 1000) or is_cell_rep:
            out.append(f"- `{op.name}` ({op.kind}, {op.param_bytes / 1e6:.0f} MB parameters): "
                       f"{res.strategy[op.name]}")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=120.0)
    p.add_argument("--evaluations", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    a = p.parse_args(argv)
    parts = ["# NMT case study", "",
             f"Command: `python examples/nmt_case_study.py --budget {a.budget:g} --seed {a.seed}"
             + (f" --evaluations {a.evaluations}" if a.evaluations else "") + "`", ""]
    for preset, n in (("p100-cluster", 16), ("k80-cluster", 64)):
        parts.append(study(preset, n, a.budget, a.seed, a.evaluations))
        parts.append("")
    text = "\n".join(parts)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
