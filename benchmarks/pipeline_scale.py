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

``--search``: LLaMA-70B (seq 4096, 2 sequences a GPU) on 64 H100s, bf16-mixed, Adam, a
120-s search (its 3-D baselines and pipeline moves included), against the fsdp plan with
every block recomputed (aim: a plan that fits, at least 1.3x as fast).
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


def search_70b(budget: float = 120.0) -> dict:
    module, inputs = ff.models.get("llama", batch_size=128, size="70b", seq_len=4096, device="meta")
    graph = ff.trace(module, inputs)
    machine = ff.Machine.preset("h100-cluster", devices=64)
    sim = ff.Simulator(graph, machine, optimizer="adam", precision="bf16-mixed")
    ref = sim.simulate(ff.Strategy.fsdp(graph, machine).recompute_blocks())
    t0 = time.perf_counter()
    r = ff.search(graph, machine, budget=budget, optimizer="adam", precision="bf16-mixed")
    return {"budget_s": budget, "seconds": time.perf_counter() - t0, "evaluations": r.evaluations,
            "source": r.source, "step_s": r.result.iteration_time, "fits": r.result.feasible,
            "peak_gib": max(r.result.peak_memory) / 2**30, "pipeline": str(r.strategy.pipeline),
            "fsdp_rc_step_s": ref.iteration_time, "speedup_over_fsdp_rc": ref.iteration_time / r.result.iteration_time,
            "baselines": {k: {"step_s": v.iteration_time, "fits": v.feasible, "peak_gib": max(v.peak_memory) / 2**30,
                              "bubble": v.bubble} for k, v in r.baselines.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline_scale"))
    ap.add_argument("--only", choices=sorted(CASES))
    ap.add_argument("--search", action="store_true", help="the LLaMA-70B search instead")
    a = ap.parse_args(argv)
    if a.search:
        s = search_70b()
        path = Path(a.out + "_search")
        path.with_suffix(".json").write_text(json.dumps(s, indent=1))
        lines = ["# LLaMA-70B on 64 H100s: the search with 3-D plans", "",
                 "`python benchmarks/pipeline_scale.py --search` (seq 4096, 2 sequences a GPU, bf16-mixed, Adam)", "",
                 f"Searched in {s['seconds']:.0f} s ({s['evaluations']} evaluations): {s['source']}, "
                 f"{s['step_s']:.2f} s a step, {s['peak_gib']:.1f} GiB, fits {s['fits']}; {s['pipeline']}. "
                 f"fsdp with every block recomputed: {s['fsdp_rc_step_s']:.2f} s "
                 f"({s['speedup_over_fsdp_rc']:.2f}x; aim 1.3x).", "",
                 "| baseline | step s | fits | peak GiB | bubble |", "|---|---|---|---|---|"]
        for k, v in s["baselines"].items():
            lines.append(f"| {k} | {v['step_s']:.2f} | {'yes' if v['fits'] else 'no'} | {v['peak_gib']:.1f} | "
                         f"{v['bubble']:.3f} |")
        path.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
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
