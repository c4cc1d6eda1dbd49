"""The pictures of the docs and the README, made again from the code as it is.

    python benchmarks/doc_pictures.py [--out docs/img] [--budget 6]

- ``plan.png``: LLaMA-8B planned on 16 simulated H100s (the demo's plan), devices x layers;
- ``timeline.png``: one simulated step of that plan, a few devices and the links;
- ``search_convergence.png``, ``sim_accuracy.png``: copied from ``benchmarks/results``
  (``search_convergence.py`` and ``sim_accuracy.py`` draw them).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import flexflow as ff  # noqa: E402
from plan_pictures import draw_layers, draw_timeline  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "img"))
    ap.add_argument("--budget", type=float, default=6.0)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    module, inputs = ff.models.get("llama", size="8b", seq_len=4096, batch_size=32, device="meta")
    machine = ff.Machine.preset("h100-cluster", devices=16)
    plan = ff.plan(module, machine, inputs, budget=a.budget, optimizer="adam", precision="bf16-mixed")
    graph = ff.trace(module, inputs)
    strategy = plan.bind(graph)
    draw_layers(graph, machine, strategy, out / "plan.png",
                title=f"LLaMA-8B, 32 x 4096 tokens, on 16 H100s: the plan ({plan.chosen}), "
                      f"{plan.predicted.tokens_per_s_per_device:,.0f} tokens/s per GPU simulated")
    result = ff.Simulator(graph, machine, optimizer="adam", precision="bf16-mixed").simulate(strategy, incremental=False)
    draw_timeline(result, out / "timeline.png",
                  title=f"one simulated step of that plan ({result.iteration_time:.2f} s): 4 devices, then links")
    for name in ("search_convergence.png", "sim_accuracy.png"):
        shutil.copy(HERE / "results" / name, out / name)
    print(f"wrote {', '.join(sorted(p.name for p in out.glob('*.png')))} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
