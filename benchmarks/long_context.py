"""Long sequences: LLaMA-8B at 131,072 tokens on 64 H100s, planned by the search (meta device,
no GPU).

    python benchmarks/long_context.py              # 120-s search per case
    python benchmarks/long_context.py --budget 20  # a short run

Case: one sequence of 131,072 tokens (the length of Llama 3's long-context phase), bf16-mixed,
AdamW, 64 simulated H100s (8 a node).  One sequence splits nothing by samples, so data
parallelism, FSDP and tensor parallelism alone hold a sequence's activations on too few
devices; the search's baselines include FSDP x TP with context parallelism
(``fsdp_tp_cpC``: the sequence cut in C chunks, balanced as Llama 3 did -- the tokens laid
out head-tail, rank i holding chunks i and 2C - 1 - i, the keys and values all-gathered)
where a causal attention reads 8,192 tokens or more.  Reported: each baseline's predicted
step, tokens/s per GPU, peak and whether it fits; the search's plan, its proposals and
seconds; for the chosen plan the attention's load across the chunks (the FLOPs of its
busiest block against the mean) and the same plan with contiguous chunks (each receiving
the keys and values before it, the last computing the most).  Writes
``benchmarks/results/long_context.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import flexflow as ff
from flexflow.graph.ops import RULES
from flexflow.search.baselines import context_baselines
from flexflow.strategy.regions import partitions

CASES = [dict(gpus=64, seq=131072, batch=1)]


def _attention_load(graph, strategy) -> float | None:
    """The busiest partition's attention FLOPs over the mean, for the first causal attention."""
    op = next((o for o in graph.compute_ops if o.rule == "attention" and o.attrs.get("is_causal")), None)
    if op is None:
        return None
    flops = [RULES["attention"].flops(op, p.block) for p in partitions(op, strategy[op.name])]
    return max(flops) / (sum(flops) / len(flops))


def _contiguous(strategy):
    """The same plan with every head-tail attention split contiguously (dim l)."""
    configs = {}
    for name, cfg in strategy.items():
        if cfg.degree("z") > 1:
            cfg = ff.ParallelConfig({("l" if k == "z" else k): v for k, v in cfg.degrees.items()}, cfg.devices,
                                    cfg.shard, cfg.recompute)
        configs[name] = cfg
    return ff.Strategy(strategy.graph, configs, name=strategy.name + "_contiguous")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=120.0, help="search seconds per case")
    a = ap.parse_args(argv)
    rows = []
    t0 = time.perf_counter()
    for c in CASES:
        t = time.perf_counter()
        module, inputs = ff.models.get("llama", size="8b", batch_size=c["batch"], seq_len=c["seq"], device="meta")
        graph = ff.trace(module, inputs)
        trace_s = time.perf_counter() - t
        machine = ff.Machine.preset("h100-cluster", devices=c["gpus"])
        t = time.perf_counter()
        res = ff.search(graph, machine, budget=a.budget, optimizer="adam", precision="bf16-mixed", seed=0)
        search_s = time.perf_counter() - t
        tokens = c["seq"] * c["batch"]
        base = {k: {"step_s": r.iteration_time, "tokens_per_gpu": tokens / r.iteration_time / c["gpus"],
                    "peak_gib": max(r.peak_memory) / 2**30, "fits": r.feasible, "mfu": r.mfu}
                for k, r in res.baselines.items()}
        best = res.result
        contiguous = None
        if any(cfg.degree("z") > 1 for cfg in res.strategy.values()):
            # every context-parallel baseline again with contiguous chunks, and the chosen plan
            sim = ff.Simulator(graph, machine, optimizer="adam", precision="bf16-mixed")
            contiguous = {}
            plans = dict(context_baselines(graph, machine))
            plans["search: " + res.strategy.name] = res.strategy
            for k, s in plans.items():
                s = _contiguous(s)
                r = sim.simulate(s, incremental=False)
                contiguous[k] = {"step_s": r.iteration_time, "peak_gib": max(r.peak_memory) / 2**30,
                                 "fits": r.feasible, "attention_load": _attention_load(graph, s)}
        rows.append({**c, "trace_s": trace_s, "search_s": search_s, "budget_s": a.budget,
                     "evaluations": res.evaluations, "baselines": base, "chosen": res.strategy.name,
                     "chosen_step_s": best.iteration_time, "chosen_peak_gib": max(best.peak_memory) / 2**30,
                     "chosen_fits": best.feasible, "chosen_tokens_per_gpu": tokens / best.iteration_time / c["gpus"],
                     "chosen_mfu": best.mfu, "attention_load": _attention_load(graph, res.strategy),
                     "contiguous": contiguous})
    out = Path(__file__).parent / "results" / "long_context"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/long_context.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out.with_suffix(".json").write_text(json.dumps({"command": command.strip(), "rows": rows}, indent=1))
    lines = ["# Long sequences: LLaMA-8B at 131,072 tokens, planned by the search (simulated H100s, bf16-mixed, "
             "AdamW)", "", f"`{command.strip()}` ({time.perf_counter() - t0:.0f} s)", ""]
    for r in rows:
        lines += [f"## {r['gpus']} H100s, {r['batch']} sequence(s) of {r['seq']:,} tokens", "",
                  f"Trace {r['trace_s']:.1f} s; search {r['search_s']:.0f} s (budget {r['budget_s']:.0f} s, "
                  f"{r['evaluations']:,} proposals scored).", "",
                  "| plan | step s | tokens/s per GPU | MFU | peak GiB | fits 80 GB |", "|---|---:|---:|---:|---:|---|"]
        for k, b in sorted(r["baselines"].items(), key=lambda kv: (not kv[1]["fits"], kv[1]["step_s"])):
            lines.append(f"| {k} | {b['step_s']:.2f} | {b['tokens_per_gpu']:,.0f} | {b['mfu']:.1%} | "
                         f"{b['peak_gib']:.1f} | {'yes' if b['fits'] else 'no'} |")
        lines.append(f"| **search: {r['chosen']}** | {r['chosen_step_s']:.2f} | {r['chosen_tokens_per_gpu']:,.0f} | "
                     f"{r['chosen_mfu']:.1%} | {r['chosen_peak_gib']:.1f} | {'yes' if r['chosen_fits'] else 'no'} |")
        if r["attention_load"] is not None:
            lines += ["", f"The chosen plan's causal attention: its busiest block computes {r['attention_load']:.2f}x "
                          "the mean block's FLOPs."]
        cont = r["contiguous"]
        if cont:
            lines += ["", "The same plans with contiguous chunks (each receiving the keys and values before it, the "
                          "last computing the most):", "",
                      "| plan, contiguous | step s | peak GiB | fits | attention's busiest block / mean |",
                      "|---|---:|---:|---|---:|"]
            for k, c in sorted(cont.items(), key=lambda kv: kv[1]["step_s"]):
                lines.append(f"| {k} | {c['step_s']:.2f} | {c['peak_gib']:.1f} | {'yes' if c['fits'] else 'no'} | "
                             f"{c['attention_load']:.2f} |")
            best = min((c for c in cont.values() if c["fits"]), key=lambda c: c["step_s"], default=None)
            if best is not None:
                lines += ["", f"Balanced, the chosen plan's step is {best['step_s'] / r['chosen_step_s']:.2f}x as fast "
                              f"as the best contiguous plan's ({best['step_s']:.2f} s)."]
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
