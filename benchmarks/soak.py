"""Soak test: many consecutive short 2-process trainings, counting failures and hangs.

    .venv/bin/python benchmarks/soak.py --runs 100          # writes benchmarks/results/soak.md

Each run is a fresh launch of 2 gloo processes that trains 3 SGD steps of a
model under a strategy, and checks on rank 0 that the losses equal a
single-process run of the plain module (to 1e-5).  Runs alternate between
the two ways users start a job:

- ``launch``: :func:`flexflow.launch` from a fresh Python process;
- ``torchrun``: ``torchrun --standalone --nproc-per-node 2`` on a script that
  calls ``parallelize``, trains, and simply ends (no destroy_process_group:
  the library must tear down by itself).

Models: the small zoo models and two fused recurrent models as users write
them (``nn.LSTM`` and ``nn.GRU``); strategies: random ones (sample,
attribute and parameter splits on device subsets) and data parallel.  A run
counts as a failure when any process exits non-zero (an abort at exit
included) or the losses differ, and as a hang when it does not end within
``--timeout`` seconds.  Every failure's first line is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ["lenet", "alexnet", "rnntc", "rnnlm", "nmt", "transformer", "lstm", "gru"]
STEPS = 3
BATCH = 5
TOL = 1e-5


class LSTMClassifier(nn.Module):
    """Embedding -> 2-layer nn.LSTM (batch first) -> classes from the last state."""

    def __init__(self, vocab=17, dim=8, hidden=8, classes=4, seq=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)
        self.vocab, self.seq, self.classes = vocab, seq, classes

    def forward(self, tokens, label):
        _, (h, _) = self.rnn(self.emb(tokens))  # h: (layers, N, hidden)
        return F.cross_entropy(self.head(h[-1]), label)

    def example(self, batch, seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, self.vocab, (batch, self.seq), generator=g),
                torch.randint(0, self.classes, (batch,), generator=g))


class GRULanguageModel(nn.Module):
    """Embedding -> nn.GRU (time first) -> next-token logits at every step."""

    def __init__(self, vocab=19, dim=8, hidden=10, seq=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, hidden)
        self.out = nn.Linear(hidden, vocab)
        self.vocab, self.seq = vocab, seq

    def forward(self, tokens, target):
        y, _ = self.rnn(self.emb(tokens).transpose(0, 1))  # (T, N, hidden)
        return F.cross_entropy(self.out(y).reshape(-1, self.vocab), target.transpose(0, 1).reshape(-1))

    def example(self, batch, seed):
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randint(0, self.vocab, (batch, self.seq), generator=g) for _ in range(2))


def build(name: str, seed: int = 0):
    """(module, batch for step k) of a soak model; the same on every rank."""
    import flexflow as ff
    from flexflow.models._common import make_inputs

    torch.manual_seed(seed)
    if name in ("lstm", "gru"):
        module = LSTMClassifier() if name == "lstm" else GRULanguageModel()
        return module, lambda k: module.example(BATCH, 100 + k)
    module, _ = ff.models.get(name, size="small", batch_size=BATCH, seed=seed)
    for m in module.modules():  # deterministic: dropout off
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return module, lambda k: make_inputs(module.input_specs(BATCH), seed=100 + k, device="cpu",
                                         dtype=torch.float32)


def train(model, batches) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for k in range(STEPS):
        opt.zero_grad()
        loss = model(*batches(k))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def worker(rank: int, case: dict):
    """One rank of a soak run: parallelize with the case's strategy, train,
    compare with the plain module on rank 0.  Returns the losses' worst error."""
    import copy

    import flexflow as ff
    from flexflow.strategy.strategy import Strategy

    torch.set_num_threads(1)
    module, batches = build(case["model"])
    ref = copy.deepcopy(module) if rank == 0 else None
    graph = ff.trace(module, batches(0))
    machine = ff.Machine.preset("cpu", devices=2)
    if case["strategy"] == "data_parallel":
        strategy = Strategy.data_parallel(graph, machine)
    else:
        strategy = Strategy.random(graph, machine, int(case["strategy"].split(":")[1]))
    model = ff.parallelize(module, 2, example_inputs=batches(0), strategy=strategy)
    losses = train(model, batches)
    if rank != 0:
        return None
    want = train(ref, batches)
    err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, want))
    if err > TOL:
        raise AssertionError(f"{case['model']} {case['strategy']}: losses {losses} differ from one "
                             f"process {want} (relative error {err:.2e})")
    return err


def _torchrun_main(case: dict) -> None:
    """Body of the torchrun script: no process-group handling at all, like a
    user script that calls parallelize and ends."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    worker(dist.get_rank(), case)


def _launch_main(case: dict) -> None:
    import flexflow as ff
    ff.launch(worker, 2, case, timeout_s=case["timeout_s"])


def run_one(case: dict, timeout_s: float) -> tuple[str, str, float]:
    """('ok' | 'fail' | 'hang', first line of the failure, seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
               FLEXFLOW_TIMEOUT_S=str(case["timeout_s"]), OMP_NUM_THREADS="1")
    payload = json.dumps(case)
    if case["runner"] == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.abspath(__file__), "--torchrun-case", payload]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--launch-case", payload]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a hang is killed whole
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.communicate()
        return "hang", f"no end within {timeout_s:g} s", time.perf_counter() - t0
    finally:
        _kill_group(proc.pid)  # nothing of a run may outlive it
    seconds = time.perf_counter() - t0
    if proc.returncode == 0:
        return "ok", "", seconds
    return "fail", f"exit code {proc.returncode}: {_first_line(out)}", seconds


def _kill_group(pgid: int) -> None:
    import signal
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _first_line(text: str) -> str:
    """The most telling line of a failure: the last error line of a traceback,
    else an abort message, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(("flexflow.", "RuntimeError", "AssertionError", "LaunchError")) or "Error:" in ln:
            return ln[:300]
    for ln in lines:
        if "terminate called" in ln or "Abort" in ln or "Signal" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "(no output)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a run counts as a hang")
    p.add_argument("--out", default=os.path.join(HERE, "results", "soak.md"))
    p.add_argument("--launch-case", help=argparse.SUPPRESS)
    p.add_argument("--torchrun-case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.launch_case:
        return _launch_main(json.loads(args.launch_case))
    if args.torchrun_case:
        return _torchrun_main(json.loads(args.torchrun_case))

    rng = random.Random(args.seed)
    counts = {"ok": 0, "fail": 0, "hang": 0}
    failures, rows = [], []
    t0 = time.perf_counter()
    for i in range(args.runs):
        case = {"model": MODELS[i % len(MODELS)],
                "strategy": "data_parallel" if rng.random() < 0.2 else f"random:{rng.randrange(10**6)}",
                "runner": "torchrun" if i % 2 else "launch",
                "timeout_s": min(60.0, args.timeout / 2)}
        verdict, why, seconds = run_one(case, args.timeout)
        counts[verdict] += 1
        rows.append((i, case, verdict, seconds))
        line = f"run {i + 1:>3}/{args.runs}  {case['runner']:<8} {case['model']:<11} {case['strategy']:<14} {verdict} {seconds:5.1f} s"
        if verdict != "ok":
            failures.append(f"run {i + 1} ({case['runner']}, {case['model']}, {case['strategy']}): {verdict}: {why}")
            line += f"  {why}"
        print(line, flush=True)
    total = time.perf_counter() - t0
    summary = f"{counts['ok']} ok, {counts['fail']} failed, {counts['hang']} hung, in {args.runs} runs ({total:.0f} s)"
    print(summary)
    for f in failures:
        print("  " + f)
    if args.out:
        _write(args, counts, failures, rows, summary)


def _write(args, counts, failures, rows, summary) -> None:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    by = {}
    for _, case, verdict, _ in rows:
        key = (case["runner"], case["model"])
        by.setdefault(key, [0, 0])
        by[key][0] += 1
        by[key][1] += verdict != "ok"
    lines = ["# Soak: consecutive 2-process trainings", "",
             f"Command: `.venv/bin/python benchmarks/soak.py --runs {args.runs} --seed {args.seed}` "
             f"(torch {torch.__version__}, gloo, {os.cpu_count()} CPUs).", "",
             "Each run: a fresh 2-process launch, 3 SGD steps of a small model under a random or "
             "data-parallel strategy, losses checked against one process (1e-5); every process must "
             "exit 0. `torchrun` runs end without any process-group teardown in the user's script.", "",
             f"**{summary}.**", "",
             "| runner | model | runs | failed or hung |", "| --- | --- | --- | --- |"]
    for (runner, model), (n, bad) in sorted(by.items()):
        lines.append(f"| {runner} | {model} | {n} | {bad} |")
    lines += ["", "Failures:" if failures else "No failures."]
    lines += [f"- {f}" for f in failures]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
