"""How long 3-D plans take to simulate at the scale of published runs (meta-device models).

    python benchmarks/pipeline_scale.py [--out benchmarks/results/pipeline_scale]

- GPT-3 175B (96 layers, width 12288, 96 heads, vocabulary 51,200, sequence 2048) on
  1,536 A100s: TP 8 x PP 12 x DP 16, batch 1536, one sequence a micro-batch per replica
  (96 micro-batches), interleaved 1F1B over 2 chunks, every block recomputed.
- LLaMA 3 405B (126 layers, width 16384, 128 heads, 8 key-value heads, SwiGLU 53248,
  vocabulary 128,256, sequence 8192) on 16,384 H100s: TP 8 x PP 16 x DP 128, 16M tokens a
  step (2048 sequences, 16 micro-batches a replica), 1F1B, every block recomputed, as
  Llama 3 was trained.

Reported: trace and simulation seconds on this host, the step, the bubble, the peak per GPU,
the tokens a second per GPU and MFU.  Aim (issue): each simulated in at most 60 s.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import flexflow as ff
from flexflow.models.gpt2 import GPT2, GPT2Config
from flexflow.models.llama import Llama, LlamaConfig

CASES = {
    "gpt3-175b": dict(machine="a100-cluster", gpus=1536, tp=8, pp=12, interleave=2, batch=1536, seq=2048),
    "llama3-405b": dict(machine="h100-cluster", gpus=16384, tp=8, pp=16, interleave=1, batch=2048, seq=8192),
}


def build(name: str, batch: int, seq: int):
    with torch.device("meta"):
        if name == "gpt3-175b":
            module = GPT2(GPT2Config(layers=96, width=12288, heads=96, vocab=51200, seq_len=seq, positions=seq,
                                     tie_embeddings=False))
        else:
            module = Llama(LlamaConfig(layers=126, width=16384, heads=128, kv_heads=8, hidden=53248, vocab=128256,
                                       seq_len=seq))
        x = torch.zeros(batch, seq, dtype=torch.long)
    return module, (x, x)


def run(name: str) -> dict:
    c = CASES[name]
    t0 = time.perf_counter()
    module, inputs = build(name, c["batch"], c["seq"])
    graph = ff.trace(module, inputs)
    machine = ff.Machine.preset(c["machine"], devices=c["gpus"])
    dp = c["gpus"] // (c["tp"] * c["pp"])
    s = ff.Strategy.megatron(graph, machine, tp=c["tp"], pp=c["pp"], microbatches=c["batch"] // dp,
                             schedule="interleaved-1f1b" if c["interleave"] > 1 else "1f1b",
                             interleave=c["interleave"]).recompute_blocks()
    t1 = time.perf_counter()
    res = ff.Simulator(graph, machine, optimizer="adam", precision="bf16-params").simulate(s)
    t2 = time.perf_counter()
    return {"case": name, **c, "dp": dp, "microbatches": c["batch"] // dp, "trace_and_plan_s": t1 - t0,
            "simulate_s": t2 - t1, "step_s": res.iteration_time, "bubble": res.bubble,
            "peak_gib": max(res.peak_memory) / 2**30, "fits": res.feasible,
            "tokens_per_s_per_gpu": res.tokens_per_s_per_device, "mfu": res.mfu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline_scale"))
    ap.add_argument("--only", choices=sorted(CASES))
    a = ap.parse_args(argv)
    rows = []
    for name in CASES:
        if a.only and name != a.only:
            continue
        r = run(name)
        rows.append(r)
        print(f"{name}: TP{r['tp']} PP{r['pp']} DP{r['dp']} on {r['gpus']} {r['machine']}: trace+plan "
              f"{r['trace_and_plan_s']:.0f} s, simulate {r['simulate_s']:.1f} s; step {r['step_s']:.2f} s, bubble "
              f"{r['bubble']:.3f}, peak {r['peak_gib']:.1f} GiB{'' if r['fits'] else ' (over)'}, "
              f"{r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, MFU {100 * r['mfu']:.1f}%", flush=True)
    command = "python benchmarks/pipeline_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    path = Path(a.out)
    path.with_suffix(".json").write_text(json.dumps({"command": command.strip(), "rows": rows}, indent=1))
    lines = ["# 3-D plans simulated at the scale of published runs", "", f"`{command.strip()}`", "",
             "| case | GPUs | TP x PP x DP | micro-batches | trace + plan s | simulate s | step s | bubble | "
             "peak GiB | tokens/s/GPU | MFU |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['gpus']} {r['machine']} | {r['tp']} x {r['pp']} x {r['dp']} | "
                     f"{r['microbatches']} | {r['trace_and_plan_s']:.0f} | {r['simulate_s']:.1f} | {r['step_s']:.2f} | "
                     f"{r['bubble']:.3f} | {r['peak_gib']:.1f}{'' if r['fits'] else ' (over)'} | "
                     f"{r['tokens_per_s_per_gpu']:.0f} | {100 * r['mfu']:.1f}% |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
