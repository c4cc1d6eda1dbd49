"""The paper's ground: plan AlexNet on a simulated 16-GPU P100 cluster and set the
searched strategy against every baseline: iteration time, bytes moved, memory per device,
the layers that changed; write the strategy, its Perfetto timeline and a picture of it.

    python examples/alexnet_plan.py [--budget 8] [--out out]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import flexflow as ff  # noqa: E402
from strategy_picture import draw_strategy  # noqa: E402


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
    print(f"   search: {found.evaluations} proposals scored in {found.seconds:.1f} s "
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



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=8.0, help="search seconds")
    p.add_argument("--out", default=os.environ.get("FLEXFLOW_DEMO_OUT", "out"))
    a = p.parse_args(argv)
    plan(a.budget, Path(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
