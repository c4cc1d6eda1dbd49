"""`make demo`: search a strategy for Inception-v3 on a simulated 16-GPU P100
cluster, compare it with the baselines, write the strategy and a timeline,
then train a small model for a few steps with a searched strategy on two
local processes and compare its losses with a single-process run."""
from __future__ import annotations

import argparse
import os
import time

import torch

import flexflow as ff

OUT = os.environ.get("FLEXFLOW_DEMO_OUT", "out")


def plan(budget_s: float) -> None:
    machine = ff.Machine.preset("p100-cluster")
    module, inputs = ff.models.get("inception_v3", batch_size=64 * machine.num_devices, device="meta")
    graph = ff.trace(module, inputs)
    print(f"== Inception-v3, batch {graph.batch_size}, on {machine.describe().splitlines()[0]}")
    print(f"   {len(graph)} ops; strategy space 10^{ff.strategy.strategy_space_log10(graph, machine):.0f}")
    t = time.time()
    result = ff.search(graph, machine, budget=budget_s, seed=0)
    print(f"   searched {result.evaluations} strategies in {time.time() - t:.1f} s")
    base = result.baselines["data_parallel"]
    print(f"\n   {'strategy':<16}{'iteration':>12}{'vs data par.':>14}{'activations':>14}{'param sync':>14}")
    for name, r in list(result.baselines.items()) + [("searched", result.result)]:
        print(f"   {name:<16}{r.iteration_time * 1e3:>10.1f}ms{base.iteration_time / r.iteration_time:>13.2f}x"
              f"{r.comm_bytes / 1e9:>12.2f}GB{r.sync_bytes / 1e9:>12.2f}GB")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "inception_v3_p100x16.json"), "w") as f:
        f.write(result.strategy.to_json())
    result.result.to_chrome_trace(os.path.join(OUT, "inception_v3_p100x16_trace.json"))
    changed = [op.name for op in graph.compute_ops
               if result.strategy[op.name] != result.baseline_strategies["data_parallel"][op.name]] \
        if hasattr(result, "baseline_strategies") else []
    print(f"\n   ops whose config differs from data parallelism: {len(changed)}")
    for name in changed[:12]:
        print(f"     {name}: {result.strategy[name]}")
    print(f"   strategy and timeline written to {OUT}/ (open the trace in ui.perfetto.dev)")


def _train(rank, strategy_json, steps, queue):
    torch.manual_seed(0)
    module, inputs = ff.models.get("transformer", size="small", batch_size=8)
    module.eval()  # dropout off: the two runs then agree step by step
    graph = ff.trace(module, inputs)
    strategy = ff.Strategy.from_json(strategy_json, graph)
    model = ff.parallelize(module, 2, example_inputs=inputs, strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if rank == 0:
        queue.put(losses)


def train(steps: int, budget_s: float) -> None:
    print("\n== Training the small transformer on 2 local processes (gloo) with a searched strategy")
    module, inputs = ff.models.get("transformer", size="small", batch_size=8)
    module.eval()  # dropout off so the two runs are comparable step by step
    graph = ff.trace(module, inputs)
    machine = ff.Machine.preset("cpu", devices=2)
    result = ff.search(graph, machine, budget=budget_s, seed=0)
    table = result.strategy.table().splitlines()
    for line in table[:12]:
        print("     " + line)
    if len(table) > 12:
        print(f"     ... ({len(table) - 12} more op groups)")
    print(f"   searched {result.evaluations} strategies; "
          f"simulated {result.result.iteration_time * 1e3:.2f} ms/iter "
          f"(data parallel {result.baselines['data_parallel'].iteration_time * 1e3:.2f} ms)")
    ref_losses = []
    torch.manual_seed(0)
    ref, _ = ff.models.get("transformer", size="small", batch_size=8)
    ref.eval()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss = ref(*inputs)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").SimpleQueue()
    ff.launch(_train, 2, result.strategy.to_json(), steps, q)
    losses = q.get()
    print(f"   {'step':>4}  {'2 processes':>12}  {'1 process':>12}")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        print(f"   {i:>4}  {a:>12.6f}  {b:>12.6f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    print(f"   largest relative difference: {worst:.2e}")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--budget", type=float, default=45.0, help="search seconds for Inception-v3")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    plan(a.budget)
    train(a.steps, budget_s=5.0)


if __name__ == "__main__":
    main()
