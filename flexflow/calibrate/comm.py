"""Calibration of the `cpu` machine (used by `flexflow profile --comm`).

Local processes talking over torch.distributed gloo: point-to-point and all-reduce time vs
message size (latency and bandwidth fitted by least squares), per-process matmul FLOP/s and
copy bandwidth. The figures go into a machine file in the cache folder that the `cpu` preset
reads. torch and torch.distributed are imported only inside the calibration itself.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from ..hardware.machine import (
    CALIBRATION_VERSION,
    CPU_MACHINE_FILE,
    _cpu_default,
    cache_dir,
    cpu_machine_file,
)
from ..hardware.specs import LinkSpec

__all__ = ["cache_dir", "cpu_machine_file", "calibrate_gloo", "write_cpu_machine_file", "cpu_machine_from_figures",
           "CPU_MACHINE_FILE", "DEFAULT_SIZES_BYTES"]

KiB, MiB = 2**10, 2**20
DEFAULT_SIZES_BYTES = (4 * KiB, 64 * KiB, 512 * KiB, 2 * MiB, 8 * MiB)


def _median_time(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _best_time(fn, repeats: int = 5, limit_s: float = 0.2) -> float:
    """Fastest of a few runs after one warm-up, stopping early once limit_s is spent."""
    fn()
    best, start = float("inf"), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > limit_s:
            break
    return best


def _compute_figures(torch) -> dict:
    """Per-process matmul FLOP/s per dtype and copy bandwidth (bytes read + written)."""
    flops = {}
    for dtype, n in (("float32", 512), ("bfloat16", 256), ("float16", 256)):
        try:
            a = torch.randn(n, n).to(getattr(torch, dtype))
            b = torch.randn(n, n).to(getattr(torch, dtype))
            flops[dtype] = 2 * n**3 / _best_time(lambda: a @ b)
        except (RuntimeError, TypeError):  # dtype without a CPU matmul kernel
            pass
    src = torch.ones(8 * MiB)  # 32 MiB of float32
    dst = torch.empty_like(src)
    mem_bw = 2 * src.numel() * 4 / _best_time(lambda: dst.copy_(src))
    return {"peak_flops": flops, "mem_bw_Bps": mem_bw, "launch_overhead_s": _eager_op_time(torch)}


def _eager_op_time(torch, n: int = 200) -> float:
    """Seconds per eager aten op on a tiny tensor, forward (with autograd
    recording) and its backward node averaged: what an op costs beyond its work."""
    x = torch.ones(4, requires_grad=True)

    def chain():
        y = x
        for _ in range(n):
            y = y * 1.0
        y.sum().backward()
    return _best_time(chain) / (2 * n)


def _worker(rank, nprocs, tmp, sizes, repeats, warmup, fit=False):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from ..runtime.gloo import batched_gloo_loops
    with batched_gloo_loops():  # as the executor's groups run (runtime/gloo.py)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=nprocs)
    try:
        out = {"p2p": [], "allreduce": []}
        for size in sizes:  # ping-pong between ranks 0 and 1: one-way time = round trip / 2
            buf = torch.zeros(max(1, size // 4))

            def pingpong():
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                elif rank == 1:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
            dist.barrier()
            out["p2p"].append([buf.numel() * 4, _median_time(pingpong, warmup, repeats) / 2])
        chunk = _Chunk(torch)
        for size in sizes:  # each all-reduce between compute, as the gradient buckets go in a step
            buf = torch.zeros(max(1, size // 4))
            t = _between_compute(dist, chunk, lambda: dist.all_reduce(buf), warmup, repeats)
            out["allreduce"].append([buf.numel() * 4, max(t, 1e-9)])
        out["exchange"] = _exchange_cost(torch, dist, rank, chunk, warmup, repeats)
        out["skew"] = _skew_samples(torch, dist, chunk, warmup, repeats)
        dist.barrier()
        out.update(_compute_figures(torch))  # all ranks at once, as in a real run
        if fit:  # the executor's own steps on a calibration model (flexflow.calibrate.hostfit)
            from .hostfit import measure_steps
            dist.barrier()
            try:
                out["steps"] = measure_steps(nprocs)
            except Exception as e:  # noqa: BLE001 - the micro figures still stand
                out["steps"] = None
                out["steps_error"] = f"{type(e).__name__}: {e}"
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


class _Chunk:
    """A fixed piece of compute (``reps=12``: some 100-200 us, about one op of a small model)."""

    def __init__(self, torch, reps: int = 12):
        self.a, self.b = torch.randn(96, 96), torch.randn(96, 96)
        self.c = torch.empty(96, 96)
        self.mm = torch.mm
        self.reps = reps

    def __call__(self):
        for _ in range(self.reps):
            self.mm(self.a, self.b, out=self.c)


def _skew_samples(torch, dist, chunk, warmup, repeats) -> list:
    """[[compute seconds, seconds a small all-reduce adds after it], ...] for a short and a
    long piece of compute (about a step of a small model).  Where the ranks' speeds jitter,
    the all-reduce waits for the slowest rank, and the longer the compute the longer that
    wait: the slope is the sync skew."""
    buf = torch.zeros(256)
    out = []
    for c in (chunk, _Chunk(torch, reps=chunk.reps * 40)):
        t = _median_time(c, warmup, repeats)
        out.append([t, _between_compute(dist, c, lambda: dist.all_reduce(buf), warmup, repeats,
                                         rounds=10)])
    return out


def _between_compute(dist, chunk, fn, warmup: int, repeats: int, rounds: int = 10, before=None) -> float:
    """Seconds ``fn`` adds to a round of compute on every rank: the median over ``repeats``
    of (time of ``rounds`` x (before; chunk; fn) - time of ``rounds`` x chunk) / rounds.  A
    message or collective that lands between compute costs more here than back to back (the
    peer's threads must be woken and scheduled on busy cores).  ``before``: what is posted
    ahead of the compute (a receive)."""
    def round_():
        if before is not None:
            before()
        chunk()
        fn()
    for _ in range(max(1, warmup) * 3):
        round_()
    samples = []
    for _ in range(max(3, repeats)):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            round_()
        t_both = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            chunk()
        samples.append(max(t_both - (time.perf_counter() - t0), 0.0) / rounds)
    return statistics.median(samples)


def _exchange_cost(torch, dist, rank, chunk, warmup, repeats, nbytes: int = 4096) -> float:
    """Seconds one small message costs when it lands between compute, as in a training step:
    ranks 0 and 1 each compute a chunk, then swap one message each way (receive posted
    before the compute, send after it, as the executor does).  With messages holding both
    ends' cores, a round lasts compute + 2 messages; other ranks only compute."""
    if rank >= 2:
        return _between_compute(dist, chunk, lambda: None, warmup, repeats)
    peer = 1 - rank
    x, y = torch.ones(max(1, nbytes // 4)), torch.empty(max(1, nbytes // 4))
    pending = []

    def post_recv():
        pending[:] = [dist.irecv(y, peer)]

    def swap():
        s = dist.isend(x, peer)
        pending[0].wait()
        s.wait()
    return _between_compute(dist, chunk, swap, warmup, repeats, before=post_recv) / 2


def _fit(samples) -> tuple[float, float]:
    """Fit t = latency + size / bandwidth, least squares on relative error (each row / t)."""
    import numpy as np
    x = np.array([s for s, _ in samples], dtype=float)
    y = np.array([t for _, t in samples], dtype=float)
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    (lat, inv_bw), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    if lat <= 0:  # noise: the smallest message is nearly all latency
        lat = float(y[np.argmin(x)]) / 2
    bw = 1.0 / inv_bw if inv_bw > 0 else float(np.max(x / y))
    return float(lat), float(bw)


def calibrate_gloo(nprocs: int = 2, sizes_bytes=DEFAULT_SIZES_BYTES, repeats: int = 5,
                   warmup: int = 2, fit: bool | None = None) -> dict:
    """Spawn nprocs local gloo processes and measure. Returns latency_s / bandwidth_Bps
    (point-to-point link), allreduce_latency_s / allreduce_bandwidth_Bps (per ring step and
    bus bandwidth under the ring model), peak_flops (dtype -> FLOP/s per process),
    mem_bw_Bps, the raw samples and the seconds spent.

    ``fit`` (default: when the host has fewer than two cores per process, where messages
    share the computing cores): also run a calibration model under the executor and
    replace ``exchange_s``, ``bandwidth_Bps``, ``allreduce_latency_s`` and ``sync_skew`` (and add
    ``output_sync_s``) by the figures that
    make the simulator predict its steps (:mod:`flexflow.calibrate.hostfit`); the micro-benchmark
    figures stay under ``micro`` and the fit's cases under ``fit``."""
    if nprocs < 2:
        raise ValueError(f"calibrate_gloo needs at least 2 processes, not {nprocs}")
    sizes = sorted({int(s) for s in sizes_bytes})
    if len(sizes) < 2 or sizes[0] < 1:
        raise ValueError("calibrate_gloo needs at least 2 distinct positive message sizes")
    import torch.multiprocessing as mp
    start = time.perf_counter()
    if fit is None:
        fit = _cpu_cores() < 2 * nprocs
    with tempfile.TemporaryDirectory(prefix="flexflow-comm-") as tmp:
        mp.spawn(_worker, args=(nprocs, tmp, sizes, repeats, warmup, fit), nprocs=nprocs, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nprocs)]
    lat, bw = _fit(ranks[0]["p2p"])
    # all-reduce completes when the slowest rank does
    ar = [[s, max(r["allreduce"][i][1] for r in ranks)] for i, (s, _) in enumerate(ranks[0]["allreduce"])]
    ar_lat, ar_inv = _fit(ar)
    steps = 2 * (nprocs - 1)  # ring model: t = steps * (lat + size / (n * bw))
    dtypes = set.intersection(*(set(r["peak_flops"]) for r in ranks))
    # sync skew: the slope of an all-reduce's cost (at the slowest rank) against the compute
    # before it, from a short and a long piece of compute; noise can make it negative: 0
    (t_short, ar_short), (t_long, ar_long) = (
        (statistics.mean(r["skew"][i][0] for r in ranks), max(r["skew"][i][1] for r in ranks)) for i in (0, 1))
    skew = min(max((ar_long - ar_short) / max(t_long - t_short, 1e-9), 0.0), 0.5)
    figures = {
        "version": CALIBRATION_VERSION,
        "nprocs": nprocs,
        "cores": _cpu_cores(),
        "exchange_s": statistics.mean([ranks[0]["exchange"], ranks[1]["exchange"]]),
        "latency_s": lat, "bandwidth_Bps": bw,
        "allreduce_latency_s": ar_lat / steps, "allreduce_bandwidth_Bps": ar_inv * steps / nprocs,
        "sync_skew": skew,
        "peak_flops": {d: statistics.median(r["peak_flops"][d] for r in ranks) for d in sorted(dtypes)},
        "mem_bw_Bps": statistics.median(r["mem_bw_Bps"] for r in ranks),
        "launch_overhead_s": statistics.median(r["launch_overhead_s"] for r in ranks),
        "samples": {"p2p": ranks[0]["p2p"], "allreduce": ar, "skew": [r["skew"] for r in ranks]},
    }
    if fit:
        _fit_or_keep(figures, ranks, nprocs)
    figures["seconds"] = time.perf_counter() - start
    return figures


def _fit_or_keep(figures: dict, ranks: list, nprocs: int) -> None:
    """Replace the micro-benchmark figures by those fitted to the ranks' calibration steps
    (:mod:`flexflow.calibrate.hostfit`), keeping the micro ones under ``micro``; when the chains
    did not run or the fit fails, warn and keep the micro figures (``fit_error`` says why)."""
    figures["micro"] = {k: figures[k] for k in ("exchange_s", "bandwidth_Bps", "allreduce_latency_s", "sync_skew")}
    figures.setdefault("samples", {})["steps"] = ranks[0].get("steps")
    try:
        failed = next((r.get("steps_error") or "no steps" for r in ranks if r.get("steps") is None), None)
        if failed:
            raise RuntimeError(f"the calibration chains did not run: {failed}")
        from .hostfit import fit_figures
        figures.update(fit_figures(cpu_machine_from_figures(figures, nprocs), ranks[0]["steps"], nprocs))
    except Exception as e:  # noqa: BLE001 - keep the micro-benchmark figures
        import warnings
        warnings.warn(f"fitting the host's communication figures to the executor failed "
                      f"({type(e).__name__}: {e}); keeping the micro-benchmark figures")
        figures["fit_error"] = f"{type(e).__name__}: {e}"


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_machine_from_figures(figures: dict, devices: int | None = None):
    """The cpu Machine the calibrated figures describe (``devices``: that many devices on
    one node; default the preset's).

    When the host has fewer than two cores per process, gloo's communication threads share
    the cores that compute (``comm_on_cores``): a message then holds both ends' devices, and
    its latency is the cost measured between compute (``exchange_s``), not the idle ping-pong."""
    base = _cpu_default()
    flops = dict(figures.get("peak_flops") or {})
    if "float32" not in flops:
        flops["float32"] = base.spec.flops("float32")
    spec = dataclasses.replace(base.spec, peak_flops=flops,
                               mem_bw_Bps=float(figures.get("mem_bw_Bps") or base.spec.mem_bw_Bps),
                               launch_overhead_s=float(figures.get("launch_overhead_s")
                                                       or base.spec.launch_overhead_s))
    nprocs, cores = int(figures.get("nprocs") or 2), int(figures.get("cores") or _cpu_cores())
    on_cores = cores < 2 * nprocs and figures.get("exchange_s") is not None
    latency = float(figures["exchange_s"] if on_cores else figures["latency_s"])
    ar = {}
    if figures.get("allreduce_bandwidth_Bps") and figures.get("allreduce_latency_s") is not None:
        ar = {"allreduce_bandwidth_Bps": float(figures["allreduce_bandwidth_Bps"]),
              "allreduce_latency_s": float(figures["allreduce_latency_s"])}
    out_sync = figures.get("output_sync_s")
    spec = dataclasses.replace(spec, comm_on_cores=on_cores,
                               sync_skew=float(figures.get("sync_skew") or 0.0) if on_cores else 0.0,
                               output_sync_s=float(out_sync) if on_cores and out_sync is not None else None,
                               message_lag_s=min(float(figures.get("message_lag_s") or 0.0), latency)
                               if on_cores else 0.0)
    link = LinkSpec(float(figures["bandwidth_Bps"]), latency, "loopback", **ar)
    machine = dataclasses.replace(base, spec=spec, intra_node=link)
    if devices is not None:
        machine = dataclasses.replace(machine, num_nodes=1, devices_per_node=int(devices), num_devices=int(devices))
    return machine


def write_cpu_machine_file(figures: dict, path=None) -> Path:
    """Write the cpu machine with the calibrated figures (atomically); returns the path
    (:func:`cpu_machine_from_figures` says what it holds)."""
    machine = cpu_machine_from_figures(figures)
    d = machine.to_dict()
    d["measured"] = {k: v for k, v in figures.items() if k != "samples"}
    target = Path(path) if path is not None else cpu_machine_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".machine-", suffix=".json", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(d, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return target
