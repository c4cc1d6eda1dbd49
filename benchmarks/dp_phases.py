"""Where a data-parallel step goes: flexflow against DDP, phase by phase.

    .venv/bin/python benchmarks/dp_phases.py            # about a minute
    .venv/bin/python benchmarks/dp_phases.py --quick

On 2 gloo processes (one thread each), per model: DDP on the plain module
(each rank its half of the batch) and ``flexflow.parallelize`` with
``Strategy.data_parallel``, in alternating blocks of steps.  Every step is
cut at the same points in both:

- *forward*: the module call;
- *backward to launch*: from the end of the forward to the launch of the
  last gradient all-reduce (DDP: a communication hook that marks its bucket's
  launch and completion and otherwise all-reduces as DDP does; flexflow: the
  process group's all-reduce call);
- *all-reduce*: from that launch to the end of its wait;
- *rest of backward*: from there to the end of ``backward()``;
- *SGD step + loss read*.

For flexflow it also times, inside the forward, the gradient gate (the
autograd function that hands a bucket's parameters on and takes their
gradients to the all-reduce) and the assembly of the outputs (the loss that
rides on the gradient all-reduce).  Medians per phase over the steps, rank 0
and 1.  The hook adds its own cost to DDP's step (a Python call per bucket),
so read DDP's total here as a little slow; ``dp_steps.py`` and
``executor_overhead.py`` time the contenders without instruments.  Writes
``benchmarks/results/dp_phases.md`` and ``.json``.
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from flexflow.api import parallelize  # noqa: E402
from flexflow.launch import launch  # noqa: E402

CASES = [("rnnlm", 32), ("transformer", 32), ("alexnet", 64)]
PHASES = ["forward", "backward to launch", "all-reduce", "rest of backward", "SGD step + loss read", "step"]


def _timed(owner, attr: str, into: dict, key: str) -> None:
    """Wrap ``owner.attr`` so that its seconds add up in ``into[key]``."""
    orig = getattr(owner, attr)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            into[key] = into.get(key, 0.0) + time.perf_counter() - t0
    setattr(owner, attr, wrapper)


def _worker(rank: int, name: str, batch: int, blocks: int, steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flexflow.runtime.autograd as A
    import flexflow.runtime.execute as E
    import flexflow.runtime.sync as S
    from dp_steps import dp_setup
    module, inputs, strategy, half = dp_setup(rank, name, batch)
    marks: dict = {}

    def hook(state, bucket):  # DDP's own all-reduce, its launch and completion marked
        marks["launch"] = time.perf_counter()

        def done(fut):
            marks["done"] = time.perf_counter()
            return fut.value()[0] if isinstance(fut.value(), list) else fut.value()
        return default_hooks.allreduce_hook(state, bucket).then(done)
    ddp = DDP(copy.deepcopy(module))
    ddp.register_comm_hook(None, hook)
    model = parallelize(module, example_inputs=inputs, strategy=strategy)
    inner: dict = {}
    orig_ar, orig_wait = S._all_reduce, E.Runtime.wait

    def all_reduce(t, group):
        marks["launch"] = time.perf_counter()
        return orig_ar(t, group)

    def wait(self, works, what=None):  # (data parallelism waits on nothing but its all-reduces)
        try:
            return orig_wait(self, works, what)
        finally:
            marks["done"] = time.perf_counter()
    S._all_reduce, A._all_reduce, E.Runtime.wait = all_reduce, all_reduce, wait  # the gradients' and the outputs'
    _timed(A._GateFn, "apply", inner, "gradient gate")
    _timed(A._OutputFn, "apply", inner, "outputs")
    runs = {"ddp": (ddp, half), "flexflow": (model, inputs)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, (m, _) in runs.items()}
    rows = {k: [] for k in runs}
    inner_sum, counted = {}, 0
    for block in range(blocks + 1):  # the first block warms up
        for k, (m, inp) in runs.items():
            dist.barrier()
            for _ in range(steps):
                marks.clear()
                inner.clear()
                t0 = time.perf_counter()
                opts[k].zero_grad()
                loss = m(*inp)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opts[k].step()
                loss.item()
                t3 = time.perf_counter()
                if block and "launch" in marks and "done" in marks:
                    rows[k].append((t1 - t0, marks["launch"] - t1, marks["done"] - marks["launch"],
                                    t2 - marks["done"], t3 - t2, t3 - t0))
                    if k == "flexflow":
                        counted += 1
                        for key, v in inner.items():
                            inner_sum[key] = inner_sum.get(key, 0.0) + v
    out = {k: {p: statistics.median(r[i] for r in v) * 1e3 for i, p in enumerate(PHASES)}
           for k, v in rows.items() if v}
    out["flexflow inside the forward"] = {k: v / max(counted, 1) * 1e3 for k, v in inner_sum.items()}
    return out


def main(argv=None) -> int:
    from dp_steps import block_args
    a, blocks, steps = block_args(argv, __doc__, "dp_phases", "2 blocks of 5 steps, rnnlm only")
    cases = CASES[:1] if a.quick else CASES
    t0 = time.perf_counter()
    results = {}
    for name, batch in cases:
        res = launch(_worker, 2, name, batch, blocks, steps, timeout_s=900)
        results[name] = res
        for rank, r in enumerate(res):
            line = "  ".join(f"{k} {r[k]['step']:.3f} ms" for k in ("ddp", "flexflow") if k in r)
            print(f"{name:12s} rank {rank}: {line}", flush=True)
    cmd = "python benchmarks/dp_phases.py" + (" --quick" if a.quick else "")
    lines = ["# Data parallel, phase by phase: flexflow against DDP", "",
             f"Command: `{cmd}` ({time.perf_counter() - t0:.0f} s). 2 gloo processes, one thread each; "
             f"{blocks} blocks of {steps} steps per contender, alternating, after one block of warm-up; "
             "medians per phase in ms. DDP runs with a communication hook that marks its all-reduce "
             "(its own cost is in DDP's figures); *all-reduce* is the last gradient all-reduce from its "
             "launch to the end of its wait.", ""]
    for name, res in results.items():
        batch = dict(cases)[name]
        lines += [f"## {name} (small), global batch {batch}", "",
                  "| phase | " + " | ".join(f"{k} rank {r}" for r in range(len(res)) for k in ("ddp", "flexflow"))
                  + " |", "|---|" + "---:|" * (2 * len(res))]
        for ph in PHASES:
            cells = [f"{res[r][k][ph]:.3f}" if k in res[r] else "-" for r in range(len(res))
                     for k in ("ddp", "flexflow")]
            lines.append(f"| {ph} | " + " | ".join(cells) + " |")
        inside = [res[r]["flexflow inside the forward"] for r in range(len(res))]
        lines += ["", "flexflow, inside the forward (mean ms a step): " + "; ".join(
            f"rank {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(d.items())) for r, d in enumerate(inside)),
            ""]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "results": results}, indent=1) + "\n")
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
