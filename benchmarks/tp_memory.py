"""Predicted peak memory of LLaMA-8B under tensor parallelism (meta-device model, no GPU).

    python benchmarks/tp_memory.py

Cases: 8 H100s, TP 8, one sequence of 8,192 tokens; 64 H100s, TP 8 x DP 8 with Adam's state
sharded across the data-parallel replicas (``shard=1``), 2 sequences of 4,096 a GPU (16 a
tensor-parallel group).  Each under ``bf16-mixed`` (autocast: float32 parameters and residual
stream) and ``bf16-params`` (every parameter cast to bfloat16 for compute: a bfloat16
residual stream), without and with every block recomputed; fsdp beside them.  AdamW.  Writes
``benchmarks/results/tp_memory.md`` and ``.json``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import flexflow as ff

CASES = [dict(gpus=8, seq=8192, batch=1, shard=0), dict(gpus=64, seq=4096, batch=128, shard=1)]


def main() -> None:
    rows = []
    t0 = time.perf_counter()
    for c in CASES:
        module, inputs = ff.models.get("llama", batch_size=c["batch"], size="8b", seq_len=c["seq"], device="meta")
        graph = ff.trace(module, inputs)
        machine = ff.Machine.preset("h100-cluster", devices=c["gpus"])
        plans = {"megatron tp8": ff.Strategy.megatron(graph, machine, tp=8, shard=c["shard"])}
        plans["megatron tp8, blocks recomputed"] = plans["megatron tp8"].recompute_blocks()
        plans["fsdp"] = ff.Strategy.fsdp(graph, machine)
        for prec in ("bf16-mixed", "bf16-params"):
            sim = ff.Simulator(graph, machine, optimizer="adam", precision=prec)
            for name, s in plans.items():
                r = sim.simulate(s)
                rows.append({**c, "precision": prec, "plan": name, "step_s": r.iteration_time,
                             "peak_gib": max(r.peak_memory) / 2**30, "fits": r.feasible})
    out = Path(__file__).parent / "results" / "tp_memory"
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    lines = ["# LLaMA-8B under tensor parallelism: predicted peak per GPU (H100 80 GB, AdamW)", "",
             f"`python benchmarks/tp_memory.py` ({time.perf_counter() - t0:.0f} s)", "",
             "| GPUs | tokens a TP group | precision | plan | step s | peak GiB | fits |", "|---:|---:|---|---|---:|---:|---|"]
    for r in rows:
        tokens = r["seq"] * r["batch"] * 8 // r["gpus"]
        lines.append(f"| {r['gpus']} | {tokens:,} | {r['precision']} | {r['plan']} | {r['step_s']:.3f} | "
                     f"{r['peak_gib']:.1f} | {'yes' if r['fits'] else 'no'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
