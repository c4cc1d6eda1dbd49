"""Plan LLaMA-8B for 16 H100s, on a laptop.

    python examples/plan_llama.py [--gpus 16] [--seq 4096] [--batch-per-gpu 2] [--budget 60]

The model is built on the ``meta`` device (no memory is allocated), traced, and planned
for an ``h100-cluster`` of 16 GPUs (two nodes of 8 with NVSwitch, one 400 Gb/s NIC per
GPU) in bf16 mixed precision with AdamW.  It prints the plan (the configs it gives each
kind of op), its memory per GPU, tokens a second per GPU and MFU, against FSDP, Megatron
tensor parallelism and the 2-D FSDP x TP plan.  Every figure is the simulator's.
"""
from __future__ import annotations

import argparse
import time
from collections import Counter

import flexflow as ff

GiB = 2**30


def plan_lines(graph, strategy) -> list[str]:
    """The plan in a few lines: per op kind, its configs and how many ops take each
    (devices left out: the blocks run on all of them)."""
    by_kind: dict[str, Counter] = {}
    for op in graph.compute_ops:
        cfg = str(strategy[op.name]).split(" @")[0]
        by_kind.setdefault(op.kind, Counter())[cfg] += 1
    lines = []
    for kind, counts in sorted(by_kind.items(), key=lambda kv: -sum(kv[1].values())):
        parts = ", ".join(f"{cfg} x{n}" for cfg, n in counts.most_common(3))
        more = f", +{len(counts) - 3} more" if len(counts) > 3 else ""
        lines.append(f"  {kind:<28} {parts}{more}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch-per-gpu", type=int, default=2)
    ap.add_argument("--budget", type=float, default=60.0)
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    module, inputs = ff.models.get("llama", size="8b", seq_len=a.seq, batch_size=a.batch_per_gpu * a.gpus,
                                   device="meta")
    machine = ff.Machine.preset("h100-cluster", devices=a.gpus)
    params = sum(p.numel() for p in module.parameters())
    print(f"LLaMA-8B ({params / 1e9:.2f}B parameters), {a.batch_per_gpu * a.gpus} sequences of {a.seq} tokens "
          f"a step, on {a.gpus} x H100 ({machine.num_nodes} nodes); bf16 mixed precision, AdamW")
    plan = ff.plan(module, machine, inputs, budget=a.budget, optimizer="adam", precision="bf16-mixed")
    print(f"planned in {time.perf_counter() - t0:.0f} s ({plan.evaluations} evaluations)\n")

    graph = ff.trace(module, inputs)  # (the plan's graph, to read its strategy by op)
    print(f"the plan ({plan.chosen}):")
    print("\n".join(plan_lines(graph, plan.bind(graph))))

    rows = [(f"plan ({plan.chosen})", plan.predicted)]
    rows += [(k, plan.baselines[k]) for k in ("fsdp", "megatron", "fsdp_tp", "data_parallel") if k in plan.baselines]
    print(f"\n  {'strategy':<24} {'step s':>7} {'tok/s/GPU':>10} {'MFU':>6} {'GiB/GPU':>8}  fits")
    for name, r in rows:
        print(f"  {name:<24} {r.iteration_time:7.2f} {r.tokens_per_s_per_device:10,.0f} {r.mfu:6.1%} "
              f"{max(r.peak_memory) / GiB:8.1f}  {'yes' if r.feasible else 'no'}")
    print("\n(megatron: tensor parallelism over the 8 GPUs of a node, data parallelism across nodes; "
          "fsdp_tp: the same with every parameter sharded among its replicas.  The h100-cluster preset "
          "prices kernels at their published rates times what published H100 runs reach of them (x0.57, "
          "benchmarks/published.py: within 10% at the median of runs no fit saw).)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
