"""`make demo`: what flexflow is for, in two parts.

1. Plan (simulated): search a strategy for AlexNet on a 16-GPU P100 cluster
   and set it against every baseline: iteration time, bytes moved, memory per
   device, the layers that changed; write the strategy, its Perfetto timeline
   and a picture of it.
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
from strategy_picture import draw_strategy  # noqa: E402

NOISY = 0.20  # a spread over rounds above this share of the median is called noisy
LOSS_RTOL = 1e-5


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


def _memory(result) -> str:
    """Peak memory per device in GB: one figure, or the range over devices."""
    lo, hi = min(result.peak_memory), max(result.peak_memory)
    text = _gb(hi) if hi - lo < 5e6 else f"{_gb(lo)}-{_gb(hi)}"
    return text + ("" if result.feasible else " > capacity")


def changed_layers(graph, strategy, baseline) -> list[tuple[str, list[str], str, str]]:
    """The ops whose config differs from ``baseline``, grouped by layer: an op
    belongs to the module that ran it, or to the last module before it (a relu
    after fc1 belongs to fc1).  Rows ``(layer, op names, config, baseline config)``,
    one per layer and config, in graph order."""
    rows, layer = [], ""
    for op in graph.compute_ops:
        layer = op.module_path or layer or op.name
        new, old = strategy[op.name], baseline[op.name]
        if new == old:
            continue
        if rows and rows[-1][0] == layer and rows[-1][2] == str(new) and rows[-1][3] == str(old):
            rows[-1][1].append(op.name)
        else:
            rows.append((layer, [op.name], str(new), str(old)))
    return rows


def _print_changes(graph, strategy, baseline, indent="   ") -> None:
    rows = changed_layers(graph, strategy, baseline)
    if not rows:
        print(f"{indent}every op as in data parallelism")
        return
    width = max(len(", ".join(r[1])) for r in rows)
    print(f"{indent}{'layer':<10}{'ops':<{width + 2}}{'searched':<18}data parallel")
    for layer, names, new, old in rows:
        print(f"{indent}{layer:<10}{', '.join(names):<{width + 2}}{new:<18}{old}")


# --------------------------------------------------------------------------- plan
def plan(budget_s: float, out: Path) -> None:
    machine = ff.Machine.preset("p100-cluster")
    n = machine.num_devices
    module, inputs = ff.models.get("alexnet", batch_size=256 * n, device="meta")
    graph = ff.trace(module, inputs)
    print(f"== Plan: AlexNet, batch {graph.batch_size}, on the simulated cluster '{machine.name}'")
    for line in machine.describe().splitlines()[1:]:
        print("   " + line.strip())
    print(f"   {len(graph.compute_ops)} ops; strategy space 10^{ff.strategy.strategy_space_log10(graph, machine):.0f}")
    found = ff.search(graph, machine, budget=budget_s, seed=0)
    print(f"   search: {found.evaluations} strategies simulated in {found.seconds:.1f} s "
          f"(budget {budget_s:g} s, baselines included)")
    dp = found.baselines["data_parallel"]
    rows = list(found.baselines.items()) + [("searched", found.result)]
    print(f"\n   {'strategy':<16}{'iteration':>11}{'x data par.':>13}{'moved GB':>10}{'sync GB':>9}"
          f"   peak GB per device")
    for name, r in rows:
        print(f"   {name:<16}{r.iteration_time * 1e3:>9.1f}ms{dp.iteration_time / r.iteration_time:>12.2f}x"
              f"{_gb(r.comm_bytes):>10}{_gb(r.sync_bytes):>9}   {_memory(r)}")
    best_name, best = min(found.baselines.items(), key=lambda kv: kv[1].iteration_time)
    gain = best.iteration_time / found.result.iteration_time
    if gain > 1:
        print(f"   searched beats every baseline: {(gain - 1) * 100:.2f}% faster than the best ({best_name}), "
              f"{dp.iteration_time / found.result.iteration_time:.2f}x data parallel")
    else:
        print(f"   searched equals the best baseline ({best_name}): the search found nothing better "
              f"in {budget_s:g} s; {dp.iteration_time / found.result.iteration_time:.2f}x data parallel")
    print("   (moved: activations and their gradients between devices; sync: parameter gradients)")

    print("\n   what changed against data parallelism (S: samples, C: out-channels/features, "
          "@: devices):")
    _print_changes(graph, found.strategy, found.baseline_strategies["data_parallel"])

    out.mkdir(parents=True, exist_ok=True)
    (out / "alexnet_p100x16.json").write_text(found.strategy.to_json())
    found.result.to_chrome_trace(out / "alexnet_p100x16_trace.json")
    draw_strategy(graph, machine, found.strategy, out / "alexnet_p100x16.png",
                  baseline=found.baseline_strategies["data_parallel"],
                  title=f"AlexNet, batch {graph.batch_size}, {n} P100s: searched strategy, "
                        f"{found.result.iteration_time * 1e3:.1f} ms/iteration simulated "
                        f"(data parallel {dp.iteration_time * 1e3:.1f} ms)")
    print(f"\n   wrote {out}/alexnet_p100x16.json (strategy), alexnet_p100x16_trace.json "
          f"(timeline: open in ui.perfetto.dev), alexnet_p100x16.png (picture)")


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
    p.add_argument("--budget", type=float, default=8.0, help="search seconds for the plan part")
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
