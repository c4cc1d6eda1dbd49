"""Planning a multi-billion-parameter GPT-style model that data parallelism does not fit.

    python benchmarks/big_model_plan.py [--budget 30] [--layers 32 --width 4096 --heads 32]
                                        [--batch 8 --seq 2048] [--out benchmarks/results/big_model_plan]

A GPT-style decoder (token and position embeddings, pre-norm blocks of fused-QKV causal
attention through ``scaled_dot_product_attention`` and a 4x GELU MLP, a tied-free LM
head; 6.9B parameters at the defaults) is built on the ``meta`` device (no memory), traced,
and simulated on one node of 8 H200s capped at 80 GiB each (``machine.with_memory``),
float32, Adam, a global batch of ``batch`` sequences of ``seq`` tokens.  Each built-in
strategy is simulated, then ``ff.search`` runs for ``budget`` seconds (its baselines
include ``fsdp``).  Everything here is simulated: no step of this model runs on this host.

Aim (the sharded-training issue): the search returns a plan that fits and is within 1.15x
of data parallelism's (infeasible) step time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import flexflow as ff

GiB = 2**30


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, h = x.shape  # (B, T, H)
        q, k, v = self.qkv(self.ln_1(x)).split(h, dim=2)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.out(nn.functional.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocab: int = 50304, seq: int = 2048):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())


def _row(name, r) -> dict:
    return {"strategy": name, "iteration_time_s": r.iteration_time, "peak_memory_gib": max(r.peak_memory) / GiB,
            "feasible": bool(r.feasible), "sync_gb": r.sync_bytes / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "big_model_plan"))
    a = ap.parse_args(argv)
    with torch.device("meta"):
        module = GPT(a.layers, a.width, a.heads, seq=a.seq)
        inputs = (torch.randint(0, 50304, (a.batch, a.seq)), torch.randint(0, 50304, (a.batch, a.seq)))
    n_params = sum(p.numel() for p in module.parameters())
    t0 = time.perf_counter()
    graph = ff.trace(module, inputs)
    trace_s = time.perf_counter() - t0
    machine = ff.Machine.preset("h200-node").with_memory(80 * GiB)
    sim = ff.Simulator(graph, machine, optimizer="adam")
    rows = []
    for s in (ff.Strategy.data_parallel(graph, machine), ff.Strategy.zero(graph, machine, 1),
              ff.Strategy.zero(graph, machine, 2), ff.Strategy.fsdp(graph, machine)):
        rows.append(_row(s.name, sim.simulate(s, incremental=False)))
    found = ff.search(graph, machine, budget=a.budget, seed=a.seed, optimizer="adam")
    rows.append(_row(f"searched ({found.source})", found.result))
    dp = rows[0]["iteration_time_s"]
    for r in rows:
        r["x_data_parallel_time"] = r["iteration_time_s"] / dp
    aim = found.result.feasible and found.result.iteration_time <= 1.15 * dp
    out = {"command": "python benchmarks/big_model_plan.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": {"layers": a.layers, "width": a.width, "heads": a.heads, "params": n_params,
                     "batch": a.batch, "seq": a.seq, "dtype": "float32", "optimizer": "adam"},
           "machine": "h200-node (8 x H200) capped at 80 GiB per device", "ops": len(graph.ops),
           "trace_s": trace_s, "search_s": found.seconds, "evaluations": found.evaluations,
           "rows": rows, "aim_met": bool(aim)}
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(out, indent=1))
    lines = [f"# Planning a {n_params / 1e9:.2f}B GPT-style model on 8 GPUs of 80 GiB (simulated)", "",
             f"`{out['command']}`", "",
             f"{a.layers} layers, width {a.width}, {a.heads} heads, batch {a.batch} x {a.seq} tokens, float32, "
             f"Adam; {len(graph.ops)} ops traced on the meta device in {trace_s:.1f} s; search "
             f"{found.seconds:.1f} s, {found.evaluations} evaluations. Machine: `h200-node` with "
             "`with_memory(80 GiB)`. Every figure is the simulator's.", "",
             "| strategy | step (s) | x data parallel | peak per device (GiB) | fits | parameter-sync GB |",
             "| --- | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['iteration_time_s']:.3f} | {r['x_data_parallel_time']:.2f} | "
                     f"{r['peak_memory_gib']:.1f} | {'yes' if r['feasible'] else 'no'} | {r['sync_gb']:.1f} |")
    lines += ["", f"Aim (a plan that fits, within 1.15x of data parallelism's step): "
              f"{'met' if aim else 'missed'}.", ""]
    path.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if aim else 1


if __name__ == "__main__":
    sys.exit(main())
