"""Running the finalists: a few real training steps of each strategy on the ranks that will
train, timed, before one is chosen.

Collective: every rank of the default process group calls :func:`measure` with the same
finalists.  Each finalist gets its own runtime on the module (its parameter shards are
copies, so the module's parameters and buffers are left as they were; the random
generators are restored afterwards), an optimizer of the kind the caller will use, and
steps of zero_grad, forward on the example inputs, backward, optimizer step and a read of
the loss.  After ``WARMUP`` steps each, the finalists run in interleaved rounds (load from
other jobs hits them alike); a round counts at its slowest rank.  A finalist that raises
on any rank -- out of memory, a step the executor refuses -- is dropped on every rank with
a warning; the others go on.  A rank that fails alone leaves its peers waiting for it
until the finalist's timeout: ``FINALIST_TIMEOUT_S`` or 20 predicted steps, whichever is
longer (the caller's timeout if shorter).
"""
from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..runtime.pipeline import runtime_for
from ..runtime.module import ParallelModule
from ..runtime.program import check_programs
from .select import Finalist

__all__ = ["FINALIST_TIMEOUT_S", "ROUNDS", "TIMED_S", "WARMUP", "fastest", "measure"]

WARMUP = 2  # untimed steps of each finalist first
ROUNDS = 5  # interleaved rounds the timed steps are spread over (fewer when there are fewer steps)
TIMED_S = 0.3  # short steps repeat until each finalist's timed steps last about this long, time allowing
FINALIST_TIMEOUT_S = 30.0  # a finalist's wait for a peer, at least (the caller's timeout when shorter)
_MEMORY_SHARE = 0.8  # finalists run side by side when their predicted peaks fit this share of a device


def _gather(obj) -> list:
    """``obj`` of every rank of the default group (just ``[obj]`` without one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _loss(out):
    """The scalar a training step differentiates: the output itself, its ``loss`` (a
    Hugging Face output), or the first tensor with a gradient in a structure (summed
    when it is not a scalar)."""
    if isinstance(out, torch.Tensor):  # (its shape, not its values: reading a pending loss
        # before the backward would all-reduce its gradient bucket twice, see runtime/sync.py)
        return out if math.prod(out.shape) == 1 else out.sum()
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return _loss(loss)
    items = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    for x in items:
        if isinstance(x, torch.Tensor) and x.requires_grad or isinstance(x, (tuple, list, Mapping)):
            try:
                return _loss(x)
            except ValueError:
                continue
    raise ValueError("the module's outputs hold no tensor to train on")


def _optimizer(params, kind: str):
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if kind == "momentum" else 0.0)


class _Run:
    """One finalist's runtime, module and optimizer on this rank."""

    def __init__(self, f: Finalist, graph, module, ranks, device, timeout_s, bucket_cap_mb, reduce_outputs,
                 optimizer, precision="32-true"):
        self.f = f
        timeout_s = min(timeout_s, max(FINALIST_TIMEOUT_S, 20 * f.predicted_s))
        strategy = f.bind(graph)
        self.runtime, driver = runtime_for(graph, strategy, module, ranks, device=device, timeout_s=timeout_s,
                                           bucket_cap_mb=bucket_cap_mb, reduce_outputs=reduce_outputs,
                                           precision=precision)
        try:
            check_programs(self.runtime)
        except BaseException:
            self.runtime.close(wait_s=0.0)
            raise
        self.model = ParallelModule(module, self.runtime, pipeline=driver, strategy=strategy)
        self.opt = _optimizer(self.model.parameters(), optimizer)

    def steps(self, n: int, inputs, kwargs) -> None:
        for _ in range(n):
            self.opt.zero_grad(set_to_none=True)
            loss = _loss(self.model(*inputs, **kwargs))
            loss.backward()
            self.opt.step()
            float(loss.detach())  # the values are there: the step is over

    def close(self) -> None:
        self.model = self.opt = None
        gc.collect()  # autograd graphs holding work objects go while their groups exist
        self.runtime.close(wait_s=1.0)
        self.runtime = None


def _why(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _verdict(local: str | None, what: str) -> str | None:
    """Every rank's error for one finalist, agreed: None when no rank failed."""
    errors = [(r, e) for r, e in enumerate(_gather(local)) if e]
    if not errors:
        return None
    return f"{what} failed on rank " + "; rank ".join(f"{r}: {e}" for r, e in errors)


def _drop(run: _Run | None, f: Finalist, why: str) -> None:
    f.dropped = why
    f.measured_s, f.rounds_s = None, []
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        warnings.warn(f"finalist {f.name!r} dropped: {why}", stacklevel=3)
    if run is not None:
        with contextlib.suppress(Exception):  # a broken runtime still must not stop the others
            run.close()


def _groups(finalists: list[Finalist]) -> list[list[Finalist]]:
    """Finalists that run side by side: all of them when their predicted peaks fit a device
    together, else one at a time."""
    total = [0.0] * max((len(f.predicted.peak_memory or ()) for f in finalists), default=0)
    cap = math.inf
    for f in finalists:
        for d, b in enumerate(f.predicted.peak_memory or ()):
            total[d] += b
        if f.predicted.memory_capacity:
            cap = min(cap, min(f.predicted.memory_capacity))
    if not total or max(total) <= _MEMORY_SHARE * cap:
        return [list(finalists)]
    return [[f] for f in finalists]


def _plan_rounds(steps: int, per_step_s: float, left_s: float, count: int = 1) -> tuple[int, int]:
    """(rounds, steps per round) for at least ``steps`` timed steps of each of ``count``
    finalists whose steps take ``per_step_s`` together, within ``left_s`` (at least one round
    of one step).  Short steps repeat until each finalist's timed steps last about ``TIMED_S``
    (all of them together at most 80% of ``left_s``): two steps of 3 ms measure the host's
    noise more than the step."""
    rounds = min(ROUNDS, steps)
    per = max(1, math.ceil(steps / rounds))
    if per_step_s <= 0:
        return rounds, per
    fill = min(TIMED_S * max(1, count), 0.8 * left_s)
    per = max(per, int(fill / (per_step_s * rounds)))
    per = max(1, min(per, int(left_s / (per_step_s * rounds))))
    rounds = max(1, min(rounds, int(left_s / (per_step_s * per))))
    return rounds, per


def measure(finalists: list[Finalist], graph, module, inputs, kwargs=None, ranks=None, *, device=None,
            timeout_s: float = FINALIST_TIMEOUT_S, steps: int = 6, seconds: float = math.inf,
            bucket_cap_mb: float = 25.0, reduce_outputs: str = "with_gradients",
            optimizer: str = "sgd", precision: str = "32-true") -> float:
    """Run and time ``finalists`` (collective; see the module's docstring): each gets
    ``measured_s`` and ``rounds_s``, or ``dropped``.  ``steps``: timed steps per finalist,
    fewer when they would not fit in ``seconds`` (at least one each), more when they are short
    (``TIMED_S``).  Returns the seconds
    it took (the slowest rank's).  ``precision``: the executor's (as the run will train)."""
    t0 = time.perf_counter()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    ranks = list(range(world)) if ranks is None else list(ranks)
    kwargs = dict(kwargs or {})
    inputs = tuple(inputs)
    device = torch.device("cpu") if device is None else torch.device(device)
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    groups = _groups([f for f in finalists if f.dropped is None])
    try:
        for gi, group in enumerate(groups):
            runs: list[_Run] = []
            for f in group:
                run, err = None, None
                try:
                    run = _Run(f, graph, module, ranks, device, timeout_s, bucket_cap_mb, reduce_outputs, optimizer,
                               precision)
                except Exception as e:  # noqa: BLE001 - agreed below, then dropped
                    err = _why(e)
                why = _verdict(err, "building it")
                if why is None:
                    runs.append(run)
                else:
                    _drop(run, f, why)
            warm = {}
            for run in list(runs):
                err, w0 = None, time.perf_counter()
                try:
                    run.steps(WARMUP, inputs, kwargs)
                except Exception as e:  # noqa: BLE001
                    err = _why(e)
                got = _gather((err, time.perf_counter() - w0))
                errors = [(r, e) for r, (e, _) in enumerate(got) if e]
                if errors:
                    runs.remove(run)
                    _drop(run, run.f, "warm-up failed on rank " + "; rank ".join(f"{r}: {e}" for r, e in errors))
                else:
                    warm[run.f.name] = max(dt for _, dt in got) / WARMUP
            spent = max(_gather(time.perf_counter() - t0))
            left = (seconds - spent) / (len(groups) - gi)
            rounds, per = _plan_rounds(steps, sum(warm.values()), left, len(warm))
            times = {run.f.name: [] for run in runs}
            for r in range(rounds):
                errs = {}
                order = runs[r % len(runs):] + runs[:r % len(runs)] if runs else []
                for run in order:
                    _barrier()
                    s0 = time.perf_counter()
                    try:
                        run.steps(per, inputs, kwargs)
                    except Exception as e:  # noqa: BLE001
                        errs[run.f.name] = _why(e)
                    times[run.f.name].append((time.perf_counter() - s0) / per)
                got = _gather((errs, {k: v[-1] for k, v in times.items()}))
                for run in list(runs):
                    bad = [(q, e[run.f.name]) for q, (e, _) in enumerate(got) if run.f.name in e]
                    if bad:
                        runs.remove(run)
                        _drop(run, run.f, "a timed step failed on rank " + "; rank ".join(f"{q}: {e}" for q, e in bad))
                    else:
                        times[run.f.name][-1] = max(t[run.f.name] for _, t in got)
            for run in runs:
                run.f.rounds_s = list(times[run.f.name])
                run.f.measured_s = statistics.median(run.f.rounds_s)
                run.close()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    return max(_gather(time.perf_counter() - t0))


def fastest(finalists: list[Finalist]) -> Finalist | None:
    """The measured finalist with the shortest step (the first listed among equals), or None
    when none was measured."""
    measured = [f for f in finalists if f.measured_s is not None]
    return min(measured, key=lambda f: f.measured_s) if measured else None
