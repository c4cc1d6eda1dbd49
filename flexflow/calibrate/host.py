"""Host calibration: measure this host's messages, collectives and compute once and
write the machine file that ``Machine.preset("cpu")`` and ``Machine.detect()`` read.

Calibrating runs the executor on local processes, so it sits above the runtime;
the hardware layer below only reads what it wrote.  ``flexflow calibrate`` runs
:func:`calibrate`; :func:`parallelize <flexflow.parallelize>` and the command line
call :func:`ensure_calibrated` first, which calibrates a host that has no current
file (unless :data:`flexflow.settings.no_calibrate` says not to).
"""
from __future__ import annotations

import sys
import warnings

from .. import settings
from ..hardware.machine import _calibration_current, cpu_machine_file

__all__ = ["calibrate", "ensure_calibrated", "is_calibrated"]


def calibrate(nprocs: int = 2, path=None, **kwargs) -> dict:
    """Calibrate the ``cpu`` machine: measure gloo between ``nprocs`` local processes
    and per-process FLOP/s and copy bandwidth (:func:`flexflow.calibrate.comm.calibrate_gloo`;
    extra keyword arguments go to it), and write the machine file the ``cpu`` preset
    reads (default ``cache_dir()/machine-cpu.json``).  Returns the figures plus
    ``"path"`` (str) of the file written."""
    from .comm import calibrate_gloo, write_cpu_machine_file
    figures = calibrate_gloo(nprocs=nprocs, **kwargs)
    out = write_cpu_machine_file(figures, path)
    return {**figures, "path": str(out)}


def is_calibrated() -> bool:
    """Whether this host has a current calibration file."""
    return _calibration_current(cpu_machine_file())


def ensure_calibrated() -> bool:
    """Calibrate the cpu machine into the cache unless a current file is there or
    $FLEXFLOW_NO_CALIBRATE is set; processes of one host calibrate once, together
    (a file lock).  Returns whether a current calibration is there afterwards.  A
    failed calibration is a warning: the preset's defaults still work."""
    path = cpu_machine_file()
    if _calibration_current(path):
        return True
    if settings.no_calibrate():
        return False
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _calibration_current(path):
            return True
        print(f"flexflow: calibrating this host once (gloo between 2 processes, CPU speed); "
              f"cached in {path}", file=sys.stderr, flush=True)
        try:
            calibrate(nprocs=2, path=path, sizes_bytes=(4096, 256 * 1024, 4 * 2**20), repeats=5, warmup=1)
        except Exception as e:  # noqa: BLE001 - an uncalibrated machine still works
            warnings.warn(f"host calibration failed ({type(e).__name__}: {e}); using the cpu preset's defaults")
            return False
    return True
