"""Validate the cost model and the executor on a CUDA GPU: profile, run with NCCL, compare.

    python benchmarks/gpu_validate.py                        # the default cases, on cuda:0
    python benchmarks/gpu_validate.py --cases llama:1b:bf16-mixed,alexnet:paper:32-true
    python benchmarks/gpu_validate.py --device cpu --size small --deadline 120   # dry run

For each case (model, size, precision), on one device, in priority order until
``--deadline`` seconds have passed:

1. **Analytic prediction**: the simulator's step time and peak memory for the whole
   model on one device (``Machine.detect()``: the GPU's datasheet figures and the
   published kernel efficiencies, no measurement) -- what plans for clusters of this
   GPU kind rest on.
2. **Profile**: every op of the graph is timed on the device in the precision's
   dtypes (``profile_graph(..., precision=)``), and each op's analytic time is set
   beside its measured one (per rule and the largest ops).
3. **Profiled prediction**: the same simulation on the profiled cost model.
4. **Measured**: training steps of ``flexflow.parallelize`` (data parallelism on a
   one-rank NCCL process group, the precision's autocast, Adam) and of the plain
   PyTorch module (the same autocast and optimizer), ``--steps`` timed steps in each of
   3 rounds after warm-up, CUDA-synchronised; peak memory
   (``torch.cuda.max_memory_allocated`` over the timed steps) against the predicted.

The profile measured is written where the cost model reads it (this cache and
``flexflow/data/profile-<KIND>.json``, shipped by committing it).  Results go to
``<out>/gpu_validate-<KIND>.md`` and ``.json`` after every case, so a run stopped
early keeps what it finished.  One device: communication is not measured here (one
rank's collectives are no-ops); cluster communication rests on the calibrated or
published link figures (``benchmarks/published.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# model:size:precision[:batch[:seq_len[:rc]]], in priority order (the run stops at the deadline);
# "rc": every op of the repeated blocks recomputed in the backward (Strategy.recompute_blocks)
DEFAULT_CASES = ("llama:1b:bf16-mixed:4:2048,llama:1b:bf16-mixed:4:2048:rc,gpt2:124m:bf16-mixed:16:1024,"
                 "transformer:paper:bf16-mixed:16,alexnet:paper:bf16-mixed,resnet101:paper:bf16-mixed,"
                 "inception_v3:paper:bf16-mixed,rnnlm:paper:bf16-mixed,"
                 "transformer:paper:32-true:16,alexnet:paper:32-true,resnet101:paper:32-true,"
                 "inception_v3:paper:32-true,rnnlm:paper:32-true")
OPTIMIZER = "adam"
ROUNDS = 3
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def parse_cases(text: str, size_override: str | None = None) -> list[dict]:
    """``model:size:precision[:batch[:seq_len[:rc]]]`` items, comma-separated."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if not 3 <= len(parts) <= 6 or (len(parts) == 6 and parts[5] not in ("", "rc")):
            raise SystemExit(f"gpu_validate: case {item!r} is not model:size:precision[:batch[:seq_len[:rc]]]")
        name, size, prec = parts[:3]
        batch = int(parts[3]) if len(parts) > 3 and parts[3] else None
        seq = int(parts[4]) if len(parts) > 4 and parts[4] else None
        if size_override:
            size, batch, seq = size_override, None, None
        out.append({"model": name, "size": size, "precision": prec, "batch": batch, "seq_len": seq,
                    "recompute": len(parts) == 6 and parts[5] == "rc"})
    return out


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _steps(model, inputs, opt, n: int, dev, autocast) -> list[float]:
    """Seconds of each of ``n`` training steps (zero_grad, forward, backward, step)."""
    out = []
    for _ in range(n):
        _sync(dev)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = model(*inputs)
        loss.backward()
        opt.step()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return out


def _peak_reset(dev):
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def _peak(dev) -> int | None:
    return int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None


def _free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _timed(model, inputs, dev, steps: int, warmup: int, autocast) -> dict:
    """Median step, spread and peak memory of ``model`` over ROUNDS rounds of ``steps``."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    _steps(model, inputs, opt, warmup, dev, autocast)  # the optimizer state exists from here on
    _peak_reset(dev)
    ts = []
    for _ in range(ROUNDS):
        ts += _steps(model, inputs, opt, steps, dev, autocast)
    peak = _peak(dev)
    del opt
    return {"step_ms": 1e3 * statistics.median(ts), "spread_ms": [1e3 * min(ts), 1e3 * max(ts)],
            "peak_bytes": peak}


def _op_table(graph, machine, report, precision: str) -> tuple[list, list]:
    """(per-rule rows, per-entry rows): each profiled op's measured forward+backward time
    beside the analytic model's (datasheet rates and published efficiencies)."""
    from flexflow.cost.model import CostModel
    from flexflow.cost.precision import precision as prec_of
    from flexflow.cost.precision import priced_ops
    from flexflow.strategy.localrun import whole_config
    from flexflow.strategy.regions import partitions
    cm = CostModel(machine)
    priced = dict(zip((o.name for o in graph.ops), priced_ops(graph, prec_of(precision))))
    rules, entries = {}, []
    for e in report.ops:
        if e.get("forward_ms") is None or e.get("error"):
            continue
        op = priced[e["ops"][0]]
        part = partitions(op, whole_config(op))[0]
        f, b = cm.op_time(op, part, 0)
        n = int(e.get("count", 1))
        meas = (e["forward_ms"] + e["backward_ms"]) * n
        ana = (f + b) * 1e3 * n
        r = rules.setdefault(op.rule, {"rule": op.rule, "ops": 0, "measured_ms": 0.0, "analytic_ms": 0.0})
        r["ops"] += n
        r["measured_ms"] += meas
        r["analytic_ms"] += ana
        entries.append({"op": e["ops"][0], "rule": op.rule, "dtype": e.get("dtype"), "count": n,
                        "measured_ms": meas, "analytic_ms": ana})
    entries.sort(key=lambda x: -x["measured_ms"])
    return sorted(rules.values(), key=lambda r: -r["measured_ms"]), entries


def run_case(case: dict, dev: torch.device, machine, steps: int, warmup: int, profile_s: float) -> dict:
    """One case's row; a stage that fails is reported under ``errors`` and the others run."""
    import flexflow as ff
    from flexflow.cost.model import CostModel
    from flexflow.cost.profile import profile_graph
    name, size, prec = case["model"], case["size"], case["precision"]
    kw = {"size": size}
    if case["batch"]:
        kw["batch_size"] = case["batch"]
    if case["seq_len"]:
        kw["seq_len"] = case["seq_len"]
    t0 = time.perf_counter()
    graph = ff.trace(*ff.models.get(name, device="meta", **kw))
    dp = ff.Strategy.data_parallel(graph, machine)
    if case["recompute"]:
        dp = dp.recompute_blocks()
    row = {**case, "batch": graph.batch_size, "ops": len(graph.compute_ops), "errors": {}}

    def stage(label, fn):
        try:
            row[label] = fn()
        except Exception as e:  # noqa: BLE001 - reported in the row; the other stages run
            import traceback
            traceback.print_exc()
            row["errors"][label] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            _free(dev)

    def simulate(cm):
        r = ff.Simulator(graph, machine, cm, optimizer=OPTIMIZER, precision=prec).simulate(dp)
        return {"step_ms": r.iteration_time * 1e3, "peak_bytes": int(r.peak_memory[0]),
                "model_flops": r.model_flops, "peak_flops": r.peak_flops}

    def profile():
        tp = time.perf_counter()
        rep = profile_graph(graph, dev, strategy=dp, precision=prec, budget_s=profile_s)
        row["rules"], entries = _op_table(graph, machine, rep, prec)
        row["largest_ops"] = entries[:8]
        return {"seconds": time.perf_counter() - tp, "measured": rep.measured, "cached": rep.cached,
                "skipped": rep.skipped, "errors": rep.errors}

    autocast = (lambda: torch.autocast(dev.type, dtype=_AUTOCAST[prec])) if prec in _AUTOCAST \
        else contextlib.nullcontext

    def flexflow_run():  # the executor autocasts itself
        module, inputs = ff.models.get(name, device=dev, **kw)
        par = ff.parallelize(module, example_inputs=inputs, strategy=dp.to_json(), precision=prec,
                             optimizer=OPTIMIZER, profile=False)
        try:
            return _timed(par, inputs, dev, steps, warmup, contextlib.nullcontext)
        finally:
            del par, module, inputs
            _free(dev)

    def plain_run():
        module, inputs = ff.models.get(name, device=dev, **kw)
        try:
            return _timed(module, inputs, dev, steps, warmup, autocast)
        finally:
            del module, inputs
            _free(dev)

    stage("analytic", lambda: simulate(CostModel(machine)))
    stage("profile", profile)
    stage("profiled", lambda: simulate(CostModel.for_machine(machine)))
    stage("flexflow", flexflow_run)
    stage("plain", plain_run)
    meas = row.get("flexflow", {}).get("step_ms")
    for k in ("analytic", "profiled"):
        if k in row and meas:
            row[k]["error_pct"] = 100 * (row[k]["step_ms"] / meas - 1)
            if row["flexflow"]["peak_bytes"]:
                row[k]["memory_error_pct"] = 100 * (row[k]["peak_bytes"] / row["flexflow"]["peak_bytes"] - 1)
    if meas and "plain" in row:
        row["overhead_pct"] = 100 * (meas / row["plain"]["step_ms"] - 1)
    a = row.get("analytic")
    if meas and a and a["peak_flops"]:  # model FLOPs utilisation measured (the simulator's FLOP count)
        row["mfu_measured"] = a["model_flops"] / (meas * 1e-3 * a["peak_flops"])
    row["seconds"] = time.perf_counter() - t0
    return row


def autocast_table(dev: torch.device) -> dict:
    """kind -> {"torch": the dtype torch's autocast (bfloat16) gives the op on ``dev`` for
    bfloat16 inputs, "model": the one flexflow's precision model prices it in}."""
    import torch.nn.functional as F

    from flexflow.cost.precision import CUDA_FLOAT32_KINDS, precision
    x = torch.randn(8, 16, device=dev).to(torch.bfloat16)
    w = torch.randn(16, 16, device=dev)
    img = torch.randn(2, 4, 3, 3, device=dev).to(torch.bfloat16)
    tgt = torch.zeros(8, dtype=torch.long, device=dev)
    probes = {
        "softmax": lambda: torch.softmax(x, -1), "log_softmax": lambda: F.log_softmax(x, -1),
        "layer_norm": lambda: F.layer_norm(x, (16,)), "group_norm": lambda: F.group_norm(img, 2),
        "rms_norm": lambda: F.rms_norm(x, (16,)), "exp": lambda: x.exp(), "log": lambda: x.abs().log(),
        "pow": lambda: x.pow(2), "rsqrt": lambda: x.abs().rsqrt(), "sum": lambda: x.sum(-1),
        "mean": lambda: x.mean(-1), "cumsum": lambda: x.cumsum(-1), "softplus": lambda: F.softplus(x),
        "logsumexp": lambda: x.logsumexp(-1), "gelu": lambda: F.gelu(x), "silu": lambda: F.silu(x),
        "relu": lambda: F.relu(x), "tanh": lambda: x.tanh(), "mul": lambda: x * x, "add": lambda: x + x,
        "masked_fill": lambda: x.masked_fill(x > 0, 0.0), "linear": lambda: F.linear(x, w),
        "matmul": lambda: x @ w.to(torch.bfloat16), "cross_entropy": lambda: F.cross_entropy(x, tgt),
        "batch_norm": lambda: F.batch_norm(img, None, None, training=True),
        "max_pool2d": lambda: F.max_pool2d(img, 2)}
    cuda = precision("bf16-mixed", dev).autocast == "cuda"
    out = {}
    for kind, fn in probes.items():
        try:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                got = str(fn().dtype).removeprefix("torch.")
        except Exception as e:  # noqa: BLE001 - an op this torch lacks
            got = f"error: {type(e).__name__}"
        f32 = kind == "cross_entropy" or (cuda and kind in CUDA_FLOAT32_KINDS)  # (the loss rule)
        out[kind] = {"torch": got, "model": "float32" if f32 else "bfloat16"}
    return out


def _fmt_gb(b):
    return "-" if not b else f"{b / 2**30:.2f}"


def _ms(x: dict | None, err: str = "error_pct") -> str:
    if not x:
        return "-"
    return f"{x['step_ms']:.2f}" + (f" ({x[err]:+.0f}%)" if err in x else "")


def write(out: Path, kind: str, meta: dict, rows: list):
    base = out / f"gpu_validate-{kind}"
    base.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# GPU validation: {meta['device']}", "",
             f"Command: `{meta['command']}` (torch {meta['torch']}, {meta['backend']} process group of one "
             f"rank, {meta['seconds']:.0f} s, {meta['date']}).", "",
             "Step time of the whole model on one device (data parallelism on one rank), Adam; measured is "
             f"flexflow's executor, median of {ROUNDS} rounds of --steps steps after warm-up.  *analytic*: "
             "the simulator on the datasheet figures and published efficiencies (no measurement); "
             "*profiled*: on this device's op profile; *rc*: the repeated blocks recomputed in the backward "
             "(the plain module runs without).  Memory: `torch.cuda.max_memory_allocated` over "
             "the timed steps against the simulator's peak (profiled run).", "",
             "| model | precision | batch | measured ms (spread) | plain PyTorch ms | analytic ms (error) | "
             "profiled ms (error) | MFU measured | measured peak GiB | predicted peak GiB (error) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        f, p = r.get("flexflow"), r.get("profiled")
        spread = f" ({f['spread_ms'][0]:.2f}-{f['spread_ms'][1]:.2f})" if f else ""
        mem = "-"
        if p and "memory_error_pct" in p:
            mem = f"{_fmt_gb(p['peak_bytes'])} ({p['memory_error_pct']:+.0f}%)"
        mfu = f"{100 * r['mfu_measured']:.0f}%" if "mfu_measured" in r else "-"
        lines.append(f"| {r['model']} {r['size']}{' rc' * r.get('recompute', False)} | {r['precision']} | {r.get('batch', '-')} | "
                     f"{_ms(f, 'x')}{spread} | {_ms(r.get('plain'), 'x')} | {_ms(r.get('analytic'))} | "
                     f"{_ms(p)} | {mfu} | {_fmt_gb(f and f['peak_bytes'])} | {mem} |")
    failed = [(r, k, v) for r in rows for k, v in r.get("errors", {}).items()]
    if failed:
        lines += ["", "Stages that failed:", ""]
        lines += [f"- {r['model']} {r['size']} {r['precision']}, {k}: `{v}`" for r, k, v in failed]
    for k in ("analytic", "profiled"):
        errs = sorted(abs(r[k]["error_pct"]) for r in rows if "error_pct" in r.get(k, {}))
        if errs:
            lines += ["", f"Median |error| of the {k} prediction: {statistics.median(errs):.0f}% "
                          f"(largest {errs[-1]:.0f}%) over {len(errs)} cases."]
    lines += ["", "## Ops: measured against the analytic model", "",
              "Sum over the graph's ops of forward + backward, per rule (each distinct op timed once "
              "and counted as often as it occurs).", "",
              "| model | precision | rule | ops | measured ms | analytic ms | analytic / measured |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for x in r.get("rules", [])[:6]:
            ratio = x["analytic_ms"] / x["measured_ms"] if x["measured_ms"] else float("nan")
            lines.append(f"| {r['model']} | {r['precision']} | {x['rule']} | {x['ops']} | "
                         f"{x['measured_ms']:.2f} | {x['analytic_ms']:.2f} | {ratio:.2f} |")
    lines += ["", "Executor overhead (flexflow against the plain module, same precision and optimizer):", "",
              "| model | precision | plain ms | flexflow ms | overhead | profile s (op keys timed) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        pr = r.get("profile")
        lines.append(f"| {r['model']} | {r['precision']} | {_ms(r.get('plain'), 'x')} | "
                     f"{_ms(r.get('flexflow'), 'x')} | "
                     + (f"{r['overhead_pct']:+.1f}%" if "overhead_pct" in r else "-") + " | "
                     + (f"{pr['seconds']:.1f} ({pr['measured']})" if pr else "-") + " |")
    if meta.get("autocast"):
        bad = {k: v for k, v in meta["autocast"].items() if v["torch"] != v["model"]}
        lines += ["", f"Autocast (bfloat16) on this device, {len(meta['autocast'])} op kinds probed: "
                      + ("the precision model prices every one in torch's dtype." if not bad else
                         "the precision model differs on " + ", ".join(
                             f"{k} (torch {v['torch']}, model {v['model']})" for k, v in bad.items()) + ".")]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _init_group(dev) -> str:
    import torch.distributed as dist
    backend = "nccl" if dev.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group(backend, rank=0, world_size=1, device_id=dev if dev.type == "cuda" else None)
    return backend


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="model:size:precision[:batch[:seq_len]],...")
    p.add_argument("--size", default=None, help="every case at this zoo size (e.g. small, for a dry run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--deadline", type=float, default=420.0, help="start no case after this many seconds")
    p.add_argument("--profile-s", type=float, default=60.0, help="profiling seconds per case at most")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--ship-profile", action="store_true",
                   help="copy the measured profile to flexflow/data/profile-<KIND>.json")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_validate: no CUDA device here (torch.cuda.is_available() is False); run it on a host "
              "with an NVIDIA GPU and a CUDA build of torch, or give --device cpu for a dry run", file=sys.stderr)
        return 2
    import flexflow as ff
    from flexflow.cost.profiledb import ProfileDB, device_kind_of, device_name, package_profile_path
    t_start = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        machine = ff.Machine.detect().with_devices(1)
    else:
        machine = ff.Machine.preset("cpu", devices=1)
    kind = device_kind_of(dev)
    backend = _init_group(dev)
    cases = parse_cases(args.cases, args.size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/gpu_validate.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "device": f"{device_name(dev)} ({machine.spec.kind} spec)", "torch": torch.__version__,
            "backend": backend, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine.name}
    try:
        meta["autocast"] = autocast_table(dev)
    except Exception as e:  # noqa: BLE001 - reported, the cases run
        meta["autocast_error"] = f"{type(e).__name__}: {e}"
    rows = []
    for case in cases:
        spent = time.perf_counter() - t_start
        if spent > args.deadline:
            print(f"gpu_validate: deadline reached after {spent:.0f} s; {case['model']} "
                  f"{case['precision']} and later cases not run", flush=True)
            break
        print(f"== {case['model']} {case['size']} {case['precision']} ({spent:.0f} s)", flush=True)
        try:
            row = run_case(case, dev, machine, args.steps, args.warmup, args.profile_s)
            f, pr = row.get("flexflow"), row.get("profiled")
            print(f"   measured {_ms(f, 'x')} ms (plain {_ms(row.get('plain'), 'x')}), analytic "
                  f"{_ms(row.get('analytic'))}, profiled {_ms(pr)}; peak {_fmt_gb(f and f['peak_bytes'])} GiB, "
                  f"predicted {_fmt_gb(pr and pr['peak_bytes'])}; {row['seconds']:.0f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - a failed case is reported, the others run
            import traceback
            traceback.print_exc()
            row = {**case, "errors": {"case": f"{type(e).__name__}: {e}".splitlines()[0][:300]}}
            _free(dev)
        rows.append(row)
        meta["seconds"] = time.perf_counter() - t_start
        write(out, kind, meta, rows)
    db = ProfileDB.load(device_name(dev), device_kind=kind)
    if len(db):
        saved = db.save()
        shutil.copyfile(saved, out / f"profile-{kind}.json")
        if args.ship_profile:
            shipped = package_profile_path(kind)
            shipped.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(saved, shipped)
    import torch.distributed as dist
    dist.destroy_process_group()
    print(f"wrote {out}/gpu_validate-{kind}.md, .json and profile-{kind}.json "
          f"({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
