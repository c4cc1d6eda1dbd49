"""`make demo`: what flexflow is for, in two parts.

1. Plan (simulated): LLaMA-8B on 16 H100s, built on the meta device, planned
   against FSDP, Megatron-style tensor parallelism and FSDP x TP: step time,
   tokens/s per GPU, MFU, memory per GPU; the plan layer by layer, its
   picture (devices x layers) and the simulated step's timeline.  (The
   paper's AlexNet plan is examples/alexnet_plan.py.)
2. Real (measured): train a model whose parameters dominate on 2 local
   processes with plain DistributedDataParallel, flexflow data parallel and
   flexflow's searched strategy, in alternating rounds; print steps/s, the
   ratios to DDP, the simulator's predictions and the spread over rounds, and
   check that the searched run's losses equal a single-process run's.

Outputs go to $FLEXFLOW_DEMO_OUT (default ``out/``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "benchmarks"))

import flexflow as ff  # noqa: E402
import real_speedup  # noqa: E402
from alexnet_plan import _print_changes, changed_layers  # noqa: E402,F401 (changed_layers: the tests')
from plan_pictures import draw_layers, draw_timeline, layer_rows  # noqa: E402

NOISY = 0.20  # a spread over rounds above this share of the median is called noisy
LOSS_RTOL = 1e-5


GiB = 2**30


def plan(budget_s: float, out: Path) -> None:
    """LLaMA-8B planned on 16 simulated H100s against FSDP, Megatron-style tensor
    parallelism and FSDP x TP; the plan's pictures and timeline written to ``out``."""
    gpus, seq, per_gpu = 16, 4096, 2
    module, inputs = ff.models.get("llama", size="8b", seq_len=seq, batch_size=per_gpu * gpus, device="meta")
    machine = ff.Machine.preset("h100-cluster", devices=gpus)
    params = sum(p.numel() for p in module.parameters())
    print(f"== Plan: LLaMA-8B ({params / 1e9:.1f}B parameters, built on the meta device: no memory), "
          f"{per_gpu * gpus} sequences of {seq} tokens a step,")
    print(f"   on {gpus} simulated H100s ({machine.num_nodes} nodes of 8, NVSwitch, a 400 Gb/s NIC per GPU); "
          "bf16 mixed precision, AdamW")
    t0 = time.perf_counter()
    found = ff.plan(module, machine, inputs, budget=budget_s, optimizer="adam", precision="bf16-mixed")
    graph = ff.trace(module, inputs)
    strategy = found.bind(graph)
    print(f"   planned in {time.perf_counter() - t0:.0f} s: {found.evaluations} proposals scored "
          f"(budget {budget_s:g} s)\n")
    rows = [(f"plan ({found.chosen})", found.predicted)]
    rows += [(k, found.baselines[k]) for k in ("fsdp", "megatron", "fsdp_tp", "data_parallel")
             if k in found.baselines]
    print(f"   {'strategy':<22}{'step s':>8}{'tok/s/GPU':>11}{'MFU':>7}{'GiB/GPU':>9}  fits 80 GB")
    for name, r in rows:
        print(f"   {name:<22}{r.iteration_time:>8.2f}{r.tokens_per_s_per_device:>11,.0f}{r.mfu:>7.1%}"
              f"{max(r.peak_memory) / GiB:>9.1f}  {'yes' if r.feasible else 'no'}")
    print("   (megatron: tensor parallelism over the 8 GPUs of a node, data parallelism across nodes; "
          "fsdp_tp: the same\n   with every parameter sharded among its replicas; every figure simulated)")
    print("\n   the plan, layer by layer (the most common split of each layer's ops):")
    seen = []
    for layer, split, devices in layer_rows(graph, strategy):
        if seen and seen[-1][1] == split and seen[-1][2] == len(devices):
            seen[-1][0].append(layer)
        else:
            seen.append(([layer], split, len(devices)))
    for layers, split, n in seen:
        span = layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]}"
        print(f"   {span:<28}{split:<14}on {n} devices")

    out.mkdir(parents=True, exist_ok=True)
    (out / "llama8b_h100x16_plan.json").write_text(found.to_json())
    draw_layers(graph, machine, strategy, out / "llama8b_h100x16_plan.png",
                title=f"LLaMA-8B on {gpus} H100s: the plan ({found.chosen}), "
                      f"{found.predicted.tokens_per_s_per_device:,.0f} tokens/s per GPU simulated")
    sim = ff.Simulator(graph, machine, optimizer="adam", precision="bf16-mixed")
    result = sim.simulate(strategy, incremental=False)
    result.to_chrome_trace(out / "llama8b_h100x16_trace.json")
    draw_timeline(result, out / "llama8b_h100x16_timeline.png",
                  title=f"one simulated step ({result.iteration_time:.2f} s): the first devices and links")
    print(f"\n   wrote {out}/llama8b_h100x16_plan.json (plan), llama8b_h100x16_plan.png (picture), "
          f"llama8b_h100x16_timeline.png and _trace.json (timeline: open in ui.perfetto.dev)")


# --------------------------------------------------------------------------- real
def real(budget_s: float, steps: int, rounds: int, check_steps: int) -> bool:
    """Returns whether the searched run's losses equal the single-process ones."""
    name, batch = "wide_mlp", 32
    module, inputs = real_speedup.build(name, batch)
    n_params = sum(p.numel() for p in module.parameters())
    print(f"\n== Real: {type(module).__name__} ({n_params / 1e6:.0f} M parameters, batch {batch}) "
          f"on 2 local processes (gloo, one thread each)")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    row = real_speedup.measure(name, batch, steps, rounds, budget_s, check_steps)
    print(f"   {rounds} alternating rounds of {steps} SGD steps each; searched on rank 0 in "
          f"{row['search_s']:.1f} s on machine '{row['machine']}'; {time.perf_counter() - t0:.0f} s in all")
    labels = {"ddp": "plain DDP", "flexflow_dp": "flexflow data par.", "flexflow_searched": "flexflow searched"}
    pred_ddp = row["predicted_ms"]["ddp"]
    print(f"\n   {'':<20}{'ms/step':>9}{'steps/s':>9}{'x DDP':>7}{'spread':>15}"
          f"{'predicted ms':>14}{'x DDP':>7}")
    noisy = []
    for k, label in labels.items():
        ms = row["step_ms"][k]
        lo, hi = row["spread_ms"][k]
        spread = (hi - lo) / ms
        if spread > NOISY:
            noisy.append(label)
        pred = row["predicted_ms"][k]
        print(f"   {label:<20}{ms:>9.1f}{row['steps_per_s'][k]:>9.2f}{row['vs_ddp'][k]:>6.2f}x"
              f"{f'{lo:.0f}-{hi:.0f} ms':>15}{pred:>14.1f}{pred_ddp / pred:>6.2f}x")
    print("   (median over rounds, a round counted at its slower rank; spread: fastest-slowest round; "
          "predicted: the simulator, DDP as data parallel)")
    load = max(load, os.getloadavg()[0])
    if noisy:
        print(f"   NOISY: the rounds of {', '.join(noisy)} spread by more than {NOISY:.0%} of the median "
              f"(load average up to {load:.1f} on {os.cpu_count()} CPUs); the ratios are rough")
    else:
        print(f"   every spread is within {NOISY:.0%} of its median (load average up to {load:.1f} "
              f"on {os.cpu_count()} CPUs)")

    graph = ff.trace(module, inputs)
    searched = ff.Strategy.from_json(row["strategy_json"], graph)
    print("\n   the searched strategy against data parallelism:")
    _print_changes(graph, searched, ff.Strategy.data_parallel(graph, ff.Machine.preset("cpu", devices=2)))

    ref = real_speedup.reference_losses(name, batch, check_steps)
    got = row["check_losses"]
    worst = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref)), default=0.0)
    ok = len(got) == len(ref) and worst <= LOSS_RTOL
    print(f"\n   trains like one process? the searched run's first {check_steps} SGD steps against the "
          f"plain module in one process:")
    print(f"   {'step':>6}{'2 processes':>14}{'1 process':>14}")
    for i, (a, b) in enumerate(zip(got, ref)):
        print(f"   {i:>6}{a:>14.6f}{b:>14.6f}")
    print(f"   largest relative difference {worst:.1e}: " + ("equal to 1e-5" if ok else "DIFFERENT (above 1e-5)"))
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=20.0,
                   help="search seconds for the plan part (its baselines included: about 10 s here)")
    p.add_argument("--real-budget", type=float, default=3.0, help="search seconds for the real part")
    p.add_argument("--steps", type=int, default=3, help="SGD steps per round")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds per contender")
    p.add_argument("--check-steps", type=int, default=3, help="SGD steps compared with one process")
    p.add_argument("--out", default=os.environ.get("FLEXFLOW_DEMO_OUT", "out"))
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    plan(a.budget, Path(a.out))
    ok = real(a.real_budget, a.steps, a.rounds, a.check_steps)
    print(f"\n== done in {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
