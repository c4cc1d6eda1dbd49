"""launch: spawn local processes with a process group and run a function in each.

    def train(rank):
        module, batch = flexflow.models.get("alexnet", batch_size=64, size="small")
        model = flexflow.parallelize(module, example_inputs=batch)  # every rank
        ...
    flexflow.launch(train, 2)
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from . import settings

__all__ = ['LaunchError', 'launch']


# --------------------------------------------------------------------------- launch
class LaunchError(RuntimeError):
    """One or more ranks of :func:`launch` failed; the message holds every rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_entry(rank, nprocs, tmp, backend, timeout_s, port, fn, args):
    """One rank of :func:`launch`.  It never reaches interpreter finalisation
    (where a live gloo group can abort the process): on success it shuts
    communication down cleanly and leaves with ``os._exit(0)``; on failure it
    writes its traceback, drops its work objects without waiting on peers
    that may be dead, and leaves with ``os._exit(1)``."""
    import sys

    from .runtime import shutdown

    _die_with_parent()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ["FLEXFLOW_TIMEOUT_S"] = str(timeout_s)
    code = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=rank,
                                world_size=nprocs, timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, *args)
        try:
            data = pickle.dumps(result)
        except Exception:  # noqa: BLE001 - results are a convenience
            data = pickle.dumps(None)
        _write_atomic(os.path.join(tmp, f"rank{rank}.result"), data)
        shutdown.shutdown()
    except BaseException:  # noqa: BLE001 - reported to the parent
        code = 1
        try:
            _write_atomic(os.path.join(tmp, f"rank{rank}.error"), traceback.format_exc().encode())
        finally:
            shutdown.abandon()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the launching process dies, so a
    killed launcher leaves no orphan ranks behind (elsewhere: nothing)."""
    try:
        import ctypes
        import signal
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


def _write_atomic(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def launch(fn, nprocs: int, *args, timeout_s: float | None = None, backend: str | None = None,
           grace_s: float | None = None):
    """Spawn ``nprocs`` local processes with a process group and run ``fn(rank, *args)`` in each.

    gloo on CPU, NCCL (one GPU per rank) when CUDA has enough GPUs.  The
    rendezvous is a fresh ``file://`` in a temporary folder.  Returns the
    list of each rank's return value (None where it cannot be pickled).
    When a rank fails, the others get ``grace_s`` (default 30 s, or
    $FLEXFLOW_LAUNCH_GRACE_S) to fail or finish before they are stopped;
    then :class:`LaunchError` is raised with every failed rank's traceback
    (the first rank to fail is often not the one at fault).
    ``fn`` must be importable (defined at module level): spawn pickles it.
    """
    import multiprocessing.connection

    import torch.multiprocessing as mp

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    timeout_s = float(timeout_s) if timeout_s is not None else settings.timeout_s()
    if grace_s is None:
        grace_s = settings.launch_grace_s()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"
    tmp = tempfile.mkdtemp(prefix="flexflow-launch-")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = []
    try:
        for rank in range(nprocs):
            p = ctx.Process(target=_launch_entry, name=f"flexflow-rank{rank}",
                            args=(rank, nprocs, tmp, backend, timeout_s, port, fn, args))
            p.start()
            procs.append(p)
        failed_at, stopped = None, []
        while True:
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for p in alive:
                    stopped.append(procs.index(p))
                    p.terminate()
                for p in alive:
                    p.join(5)
                    if p.is_alive():
                        p.kill()
                        p.join()
                break
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.2)
        results, reports = [], []
        for rank, p in enumerate(procs):
            p.join()
            err_path = os.path.join(tmp, f"rank{rank}.error")
            res_path = os.path.join(tmp, f"rank{rank}.result")
            if os.path.exists(err_path):
                with open(err_path) as f:
                    reports.append(f"--- rank {rank} failed:\n{f.read().rstrip()}")
            elif rank in stopped:
                reports.append(f"--- rank {rank} was stopped: still running {grace_s:g} s after another "
                               f"rank failed")
            elif p.exitcode != 0:
                reports.append(f"--- rank {rank} exited with code {p.exitcode} without a Python traceback")
            result = None
            if os.path.exists(res_path):
                with open(res_path, "rb") as f:
                    try:
                        result = pickle.load(f)
                    except Exception:  # noqa: BLE001
                        result = None
            results.append(result)
        if reports:
            failed = [r for r in range(nprocs) if os.path.exists(os.path.join(tmp, f"rank{r}.error"))]
            head = (f"{len(reports)} of {nprocs} ranks failed"
                    + (f" (tracebacks from ranks {failed})" if failed else ""))
            raise LaunchError(head + "\n" + "\n".join(reports))
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
