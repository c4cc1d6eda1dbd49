"""Search convergence: the best iteration time found against evaluations and seconds.

    python benchmarks/search_convergence.py            # six networks x 16, 64 K80s, 15 s each (~7 min)
    python benchmarks/search_convergence.py --quick    # two networks at 16 devices, 3 s each
    python benchmarks/search_convergence.py --llm      # LLaMA-8B at 8 and 64 H100s, LLaMA-70B at 64
    python benchmarks/search_convergence.py --budget-check   # nmt, inception_v3 at 64 K80s: 15-s calls

``--llm``: LLaMA (sequence 4096, 2 sequences per GPU, bf16 mixed precision, AdamW) on the
h100-cluster; one ``ff.search`` call of ``--budget`` seconds (default 120) *including* its
baselines, with repeat moves and without (``repeat=False``), each timed from the trace on.
``--budget-check``: two 15-s ``ff.search`` calls in one process per network, baselines
inside the budget: the first builds them, the second reuses them (same graph and machine).

Counting: ``evals`` are proposals the search scored (simulated in full or by delta, cut once
a proven bound showed them rejected, or screened by the load lower bound); chain starts and
baselines are counted apart, with the seconds they took.

For each of the paper's six networks (paper size, batch 64 per device, AlexNet 256) on the
k80-cluster at 16 and 64 devices: the baselines are built and simulated first (not timed in
the budget), then ``ff.search`` runs for ``--budget`` seconds (seed 0) and its history -- every
improvement of the best strategy, as (evaluations, seconds, iteration time) -- is plotted as
best time / data-parallel time against evaluations and against seconds.  Evaluations count
proposals the load lower bound rejected without a simulation (see ``flexflow/bound.py``);
``sims`` counts the exact simulations.  Wall-clock seconds on a shared host.

Writes benchmarks/results/search_convergence.{md,json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import flexflow as ff
from flexflow.cost.model import CostModel
from flexflow.search import BASELINES, baseline_strategies, search
from flexflow.sim.simulate import Simulator

NETWORKS = ["alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt"]
DEVICES = [16, 64]
OUT = Path(__file__).resolve().parent / "results" / "search_convergence"


def run_case(name: str, devices: int, budget: float) -> dict:
    per = ff.models.paper_batch(name)
    module, inputs = ff.models.get(name, batch_size=per * devices, device="meta")
    graph = ff.trace(module, inputs)
    machine = ff.Machine.preset("k80-cluster", devices=devices)
    cm = CostModel(machine)
    t = time.perf_counter()
    base = baseline_strategies(graph, machine, cm)
    sim = Simulator(graph, machine, cm)
    base_res = {k: sim.simulate(s, incremental=False) for k, s in base.items()}
    base_s = time.perf_counter() - t
    res = search(graph, machine, budget=budget, seed=0, cost_model=cm, progress=False, baselines=base,
                 baseline_results=base_res)
    dp = base_res["data_parallel"].iteration_time
    fits = [r.iteration_time for r in base_res.values() if r.feasible]
    hist = [(e, s, t) for e, s, t in res.history]
    hist.append((res.evaluations, res.seconds, res.result.iteration_time))
    return {
        "network": name, "devices": devices, "groups": len(graph.groups),
        "baseline_seconds": base_s, "data_parallel_ms": dp * 1e3,
        "best_baseline_ms": min(fits) * 1e3 if fits else None,
        "baselines_ms": {k: base_res[k].iteration_time * 1e3 for k in BASELINES},
        "searched_ms": res.result.iteration_time * 1e3, "feasible": res.result.feasible,
        "source": res.source, "evaluations": res.evaluations, "simulations": res.simulations,
        "screened": res.screened, "cut": res.cut, "seconds": res.seconds, "accept_rate": res.accept_rate,
        "start_simulations": res.start_simulations, "start_screened": res.start_screened,
        "start_seconds": res.start_seconds,
        "history": hist,
        # when the final best was first reached
        "reached_at": next(((e, s) for e, s, t in hist if t <= res.result.iteration_time), (None, None)),
    }


def run_llm_case(size: str, devices: int, budget: float, repeat: bool = True) -> dict:
    """One search of LLaMA-``size`` on ``devices`` H100s within ``budget`` seconds, baselines
    included; the trace is timed apart."""
    t0 = time.perf_counter()
    module, inputs = ff.models.get("llama", size=size, seq_len=4096, batch_size=2 * devices, device="meta")
    graph = ff.trace(module, inputs)
    trace_s = time.perf_counter() - t0
    machine = ff.Machine.preset("h100-cluster", devices=devices)
    res = search(graph, machine, budget=budget, seed=0, progress=False, optimizer="adam",
                 precision="bf16-mixed", repeat=repeat)
    fits = {k: r.iteration_time for k, r in res.baselines.items() if r.feasible}
    hist = [(e, s, t) for e, s, t in res.history] + [(res.evaluations, res.seconds, res.result.iteration_time)]
    best = min(fits.values()) if fits else None
    return {"network": f"llama-{size}", "devices": devices, "repeat": repeat, "ops": len(graph.ops),
            "groups": len(graph.groups), "trace_seconds": trace_s, "budget": budget,
            "baselines_ms": {k: r.iteration_time * 1e3 for k, r in res.baselines.items()},
            "baselines_fit": sorted(fits), "best_baseline": min(fits, key=fits.get) if fits else None,
            "best_baseline_ms": best * 1e3 if best else None,
            "searched_ms": res.result.iteration_time * 1e3, "feasible": res.result.feasible,
            "peak_gib": max(res.result.peak_memory) / 2**30, "mfu": res.result.mfu,
            "tokens_per_s_gpu": res.result.tokens_per_s_per_device,
            "not_slower": best is None or res.result.iteration_time <= best * (1 + 1e-12),
            "source": res.source, "evaluations": res.evaluations, "simulations": res.simulations,
            "screened": res.screened, "cut": res.cut, "start_simulations": res.start_simulations,
            "start_screened": res.start_screened, "start_seconds": res.start_seconds,
            "baseline_seconds": res.baseline_seconds, "seconds": res.seconds,
            "total_seconds": time.perf_counter() - t0, "chains": res.chains, "history": hist}


def run_budget_check(name: str, devices: int = 64, budget: float = 15.0) -> list[dict]:
    """Two ``budget``-second searches of ``name`` in this process, baselines inside the budget."""
    per = ff.models.paper_batch(name)
    module, inputs = ff.models.get(name, batch_size=per * devices, device="meta")
    graph = ff.trace(module, inputs)
    machine = ff.Machine.preset("k80-cluster", devices=devices)
    out = []
    for call in (1, 2):
        res = search(graph, machine, budget=budget, seed=0, progress=False)
        out.append({"network": name, "devices": devices, "call": call, "budget": budget,
                    "baselines_reused": res.baselines_reused, "baseline_seconds": res.baseline_seconds,
                    "start_simulations": res.start_simulations, "start_screened": res.start_screened,
                    "start_seconds": res.start_seconds, "evaluations": res.evaluations,
                    "simulations": res.simulations, "cut": res.cut, "screened": res.screened,
                    "seconds": res.seconds, "searched_ms": res.result.iteration_time * 1e3,
                    "source": res.source})
    return out


def llm_markdown(cases: list[dict], checks: list[dict], meta: dict) -> str:
    # each part records the run that made it (``--llm`` and ``--budget-check`` run apart)
    parts = meta.get("parts") or {"cases": meta, "checks": meta}
    L = ["# Search at the scale of today's decoders", ""]
    for part, flag in (("cases", "LLaMA rows"), ("checks", "`--budget-check` rows")):
        m = parts.get(part)
        if m and (cases if part == "cases" else checks):
            L += [f"{flag}: `{m['command']}`, run {m['date']} on {m['host']}.  "]
    L += ["",
         ("LLaMA at sequence 4096, 2 sequences per GPU, bf16 mixed precision, AdamW, on `h100-cluster`; one "
         "`ff.search` call whose budget includes its baselines. `evals`: proposals scored (simulated, "
         "cut by a proven bound, or screened by the load bound); chain starts and baselines apart."), "",
         ("| model | GPUs | repeat moves | ops | best baseline (ms) | searched (ms) | not slower | fits | GiB | "
         "tok/s/GPU | MFU | evals (sim / cut / screened) | starts (s) | baselines (s) | search s | with trace s |"),
         "|---|---:|---|---:|---|---:|---|---|---:|---:|---:|---|---|---:|---:|---:|"]
    for c in cases:
        bb = f"{c['best_baseline']} {c['best_baseline_ms']:.0f}" if c["best_baseline"] else "none fits"
        L.append(f"| {c['network']} | {c['devices']} | {'yes' if c['repeat'] else 'no'} | {c['ops']} | {bb} | "
                 f"{c['searched_ms']:.0f} | {'yes' if c['not_slower'] else 'NO'} | "
                 f"{'yes' if c['feasible'] else 'no'} | {c['peak_gib']:.0f} | {c['tokens_per_s_gpu']:,.0f} | "
                 f"{c['mfu']:.1%} | {c['evaluations']:,} ({c['simulations']} / {c['cut']} / {c['screened']}) | "
                 f"{c['start_simulations'] + c['start_screened']} ({c['start_seconds']:.1f}) | "
                 f"{c['baseline_seconds']:.1f} | {c['seconds']:.1f} | {c['total_seconds']:.1f} |")
    if cases:
        L += ["", ("Each model's second row ran in the same process as its first and reused the first's "
                   "baselines (`baselines (s)`), so it had more of its budget for proposals.  `GiB`: the chosen "
                   "plan's peak per GPU (80 GB on an H100).  Where no plan fits, the result is the fastest "
                   "strategy seen, no slower than any baseline.")]
    if checks:
        L += ["", ("`--budget-check`: two 15-s searches in one process at 64 K80s (baselines inside the budget; the second call "
              "reuses the first's):"), "",
              ("| network | call | baselines (s) | reused | starts (s) | evals | simulated | cut | screened | "
              "searched (ms) |"), "|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]
        for c in checks:
            L.append(f"| {c['network']} | {c['call']} | {c['baseline_seconds']:.1f} | "
                     f"{'yes' if c['baselines_reused'] else 'no'} | "
                     f"{c['start_simulations'] + c['start_screened']} ({c['start_seconds']:.1f}) | "
                     f"{c['evaluations']:,} | {c['simulations']:,} | {c['cut']:,} | {c['screened']:,} | "
                     f"{c['searched_ms']:.1f} |")
    L.append("")
    return "\n".join(L)


def plot(cases: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    devs = sorted({c["devices"] for c in cases})
    fig, axes = plt.subplots(len(devs), 2, figsize=(11, 3.6 * len(devs)), squeeze=False)
    for row, n in zip(axes, devs):
        for c in [c for c in cases if c["devices"] == n]:
            h = c["history"]
            dp = c["data_parallel_ms"] / 1e3
            ys = [t / dp for _, _, t in h]
            row[0].plot([max(e, 1) for e, _, _ in h], ys, drawstyle="steps-post", marker=".", label=c["network"])
            row[1].plot([s for _, s, _ in h], ys, drawstyle="steps-post", marker=".", label=c["network"])
        row[0].set_xscale("log")
        row[0].set_xlabel("evaluations")
        row[1].set_xlabel("seconds (wall, shared host)")
        for ax in row:
            ax.set_ylabel(f"best / data parallel, {n} K80s")
            ax.grid(alpha=0.3)
        row[1].legend(fontsize=8)
    fig.suptitle("flexflow search: best simulated iteration time found (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(cases: list[dict], meta: dict) -> str:
    L = ["# Search convergence", "", f"Command: `{meta['command']}`  ",
         (f"Run: {meta['date']} on {meta['host']}; budget {meta['budget_s']:g} s per search after the "
         f"baselines; {meta['total_seconds'] / 60:.1f} min in all."), "",
         "![best time against evaluations and seconds](search_convergence.png)", "",
         ("`evals`: strategies evaluated (chain starts, proposals, polish), of which `sims` were simulated "
         "to the end and the rest rejected without a complete simulation: by the load lower bound, or by "
         "a simulation stopped once its schedule proved the rejection (`Simulator.simulate_within`); the "
         "chain is the same either way.  `reached`: evaluations and seconds at which the final best was first seen.  "
         "Times in ms per iteration (simulated); `vs DP` = data parallel / searched."), "",
         ("| network | dev | groups | data par. | best baseline | searched | vs DP | src | evals | sims "
         "| evals/s | reached (evals, s) | base s |"),
         "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for c in cases:
        bb = "" if c["best_baseline_ms"] is None else f"{c['best_baseline_ms']:.1f}"
        e, s = c["reached_at"]
        L.append(f"| {c['network']} | {c['devices']} | {c['groups']} | {c['data_parallel_ms']:.1f} | {bb} | "
                 f"{c['searched_ms']:.1f}{'' if c['feasible'] else ' OOM'} | "
                 f"{c['data_parallel_ms'] / c['searched_ms']:.3f}x | {c['source']} | {c['evaluations']:,} | "
                 f"{c['simulations']:,} | {c['evaluations'] / max(c['seconds'], 1e-9):.0f} | "
                 f"{e:,}, {s:.1f} | {c['baseline_seconds']:.0f} |")
    L += ["", meta.get("summary", ""), ""]
    return "\n".join(L)


def summarize(cases: list[dict]) -> str:
    out = []
    for n in sorted({c["devices"] for c in cases}):
        cs = [c for c in cases if c["devices"] == n]
        ev = [c["evaluations"] for c in cs]
        sm = [c["simulations"] for c in cs]
        late = [c["network"] for c in cs if c["reached_at"][1] is not None
                and c["reached_at"][1] > 0.5 * c["seconds"]]
        out.append(f"- {n} devices: {min(ev):,}-{max(ev):,} evaluations ({min(sm):,}-{max(sm):,} simulated) per "
                   f"search; the best was still improving in the second half of the budget for: "
                   f"{', '.join(late) if late else 'none'}.")
    worse = [c for c in cases if c["best_baseline_ms"] is not None and c["searched_ms"] > c["best_baseline_ms"] * (1 + 1e-12)]
    out.append(f"- Searched slower than the best baseline: {len(worse)} cases"
               + (": " + ", ".join(f"{c['network']}/{c['devices']}" for c in worse) if worse else "") + ".")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="alexnet and rnnlm at 16 devices, 3 s each")
    ap.add_argument("--budget", type=float, default=None, help="search seconds per case (default 15)")
    ap.add_argument("--networks", nargs="*", default=None)
    ap.add_argument("--devices", nargs="*", type=int, default=None)
    ap.add_argument("--out", default=None, help="output path without extension")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the .md and .png from a results .json")
    ap.add_argument("--llm", action="store_true", help="LLaMA-8B at 8 and 64 H100s, LLaMA-70B at 64")
    ap.add_argument("--budget-check", action="store_true",
                    help="nmt and inception_v3 at 64 K80s: two 15-s searches in one process")
    a = ap.parse_args(argv)
    if a.llm or a.budget_check:
        return main_llm(a, argv)
    if a.render:
        data = json.loads(Path(a.render).read_text())
        out = Path(a.out) if a.out else Path(a.render).with_suffix("")
        plot(data["cases"], out.with_suffix(".png"))
        out.with_suffix(".md").write_text(markdown(data["cases"], data["meta"]))
        print(f"wrote {out.with_suffix('.md')} and .png")
        return 0
    nets = a.networks or (["alexnet", "rnnlm"] if a.quick else NETWORKS)
    devs = a.devices or ([16] if a.quick else DEVICES)
    budget = a.budget if a.budget is not None else (3.0 if a.quick else 15.0)
    if a.out:
        out = Path(a.out)
    elif a.quick:
        import tempfile
        out = Path(tempfile.mkdtemp()) / "search_convergence"
    else:
        out = OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/search_convergence.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])
                                                       if (argv if argv is not None else sys.argv[1:]) else "")
    meta = {"command": cmd.strip(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
                    f"Python {platform.python_version()}", "budget_s": budget}
    t0 = time.perf_counter()
    cases = []
    for n in devs:
        for net in nets:
            c = run_case(net, n, budget)
            cases.append(c)
            print(f"{net:>13} x{n:<3} DP {c['data_parallel_ms']:9.1f} ms  searched {c['searched_ms']:9.1f} ms  "
                  f"{c['evaluations']:6d} evals ({c['simulations']} simulated)  [{c['source']}]", flush=True)
            meta["total_seconds"] = time.perf_counter() - t0
            out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cases": cases}, indent=1))
    meta["summary"] = summarize(cases)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cases": cases}, indent=1))
    plot(cases, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(markdown(cases, meta))
    print(meta["summary"])
    print(f"wrote {out.with_suffix('.md')}, .png and .json")
    return 0


def main_llm(a, argv) -> int:
    args = argv if argv is not None else sys.argv[1:]
    out = Path(a.out) if a.out else OUT.with_name("search_scale")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": ("python benchmarks/search_convergence.py " + " ".join(args)).strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
                    f"Python {platform.python_version()}"}
    cases, checks = [], []
    parts = {}
    if out.with_suffix(".json").exists():  # keep the other mode's part of an earlier run
        old = json.loads(out.with_suffix(".json").read_text())
        cases, checks = (old.get("cases", []) if not a.llm else []), (old.get("checks", []) if not a.budget_check else [])
        parts = dict(old.get("meta", {}).get("parts") or {})
    for part, mine in (("cases", a.llm), ("checks", a.budget_check)):
        if mine:
            parts[part] = {k: meta[k] for k in ("command", "date", "host")}
    meta["parts"] = parts
    for size, devices in ([("8b", 8), ("8b", 64), ("70b", 64)] if a.llm else []):
        for repeat in (True, False):
            c = run_llm_case(size, devices, a.budget or 120.0, repeat)
            cases.append(c)
            print(f"llama-{size} x{devices} repeat={repeat}: best baseline {c['best_baseline']} "
                  f"{c['best_baseline_ms'] or 0:.0f} ms, searched {c['searched_ms']:.0f} ms, fits {c['feasible']}, "
                  f"{c['evaluations']} evals, baselines {c['baseline_seconds']:.1f} s, total {c['total_seconds']:.0f} s",
                  flush=True)
            out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cases": cases, "checks": checks}, indent=1))
    for name in (["nmt", "inception_v3"] if a.budget_check else []):
        for c in run_budget_check(name):
            checks.append(c)
            print(f"{name} call {c['call']}: baselines {c['baseline_seconds']:.1f} s (reused {c['baselines_reused']}), "
                  f"{c['evaluations']} evals ({c['simulations']} simulated, {c['cut']} cut, {c['screened']} screened)",
                  flush=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cases": cases, "checks": checks}, indent=1))
    out.with_suffix(".md").write_text(llm_markdown(cases, checks, meta))
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
