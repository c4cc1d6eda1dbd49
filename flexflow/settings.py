"""Every setting flexflow reads from the environment, in one place.

Each is read when it is asked for (not at import), so a test or a launcher may set
it first.  docs/install.md lists them (Settings).

| variable                  | default                         | what it does                                   |
| ------------------------- | ------------------------------- | ---------------------------------------------- |
| ``FLEXFLOW_CACHE_DIR``    | ``$XDG_CACHE_HOME/flexflow`` or ``~/.cache/flexflow`` | calibrated machine, op profiles |
| ``FLEXFLOW_NO_CALIBRATE`` | unset                           | ``1``: never calibrate a new host (use the cpu preset's defaults) |
| ``FLEXFLOW_TIMEOUT_S``    | 300                             | how long a rank waits for a peer before failing |
| ``FLEXFLOW_LAUNCH_GRACE_S`` | 30                            | after one rank fails, how long ``launch`` lets the others end |
| ``FLEXFLOW_FRONTEND``     | ``auto``                        | the tracer: ``fx``, ``export`` or ``auto`` (fx, then export) |
| ``FLEXFLOW_NO_JIT``       | unset                           | ``1``: run the scheduler kernels interpreted (no numba) |
| ``FLEXFLOW_GLOO_LOOP``    | ``batch``                       | ``normal``: leave gloo's event-loop threads at the normal scheduling policy |
| ``FLEXFLOW_SEARCH_THREADS`` | the cores this process may use | threads a search simulates its proposals on (1: none beside the caller's) |
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["VARIABLES", "cache_dir", "no_calibrate", "timeout_s", "launch_grace_s", "frontend", "no_jit",
           "batch_gloo_loops",
           "search_threads"]

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_LAUNCH_GRACE_S = 30.0

VARIABLES = ("FLEXFLOW_CACHE_DIR", "FLEXFLOW_NO_CALIBRATE", "FLEXFLOW_TIMEOUT_S", "FLEXFLOW_LAUNCH_GRACE_S",
             "FLEXFLOW_FRONTEND", "FLEXFLOW_NO_JIT", "FLEXFLOW_GLOO_LOOP", "FLEXFLOW_SEARCH_THREADS")


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _seconds(name: str, default: float) -> float:
    env = os.environ.get(name)
    if not env:
        return default
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {env!r}") from None
    return value if value > 0 else default


def cache_dir() -> Path:
    """$FLEXFLOW_CACHE_DIR, else $XDG_CACHE_HOME/flexflow, else ~/.cache/flexflow (not created)."""
    env = os.environ.get("FLEXFLOW_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "flexflow"


def no_calibrate() -> bool:
    """$FLEXFLOW_NO_CALIBRATE set (not 0): a host without a calibration keeps the defaults."""
    return _flag("FLEXFLOW_NO_CALIBRATE")


def timeout_s() -> float:
    """$FLEXFLOW_TIMEOUT_S, else 300 s: how long a rank waits for a peer before failing."""
    return _seconds("FLEXFLOW_TIMEOUT_S", DEFAULT_TIMEOUT_S)


def launch_grace_s() -> float:
    """$FLEXFLOW_LAUNCH_GRACE_S, else 30 s: after a rank fails, how long the others get."""
    return _seconds("FLEXFLOW_LAUNCH_GRACE_S", DEFAULT_LAUNCH_GRACE_S)


def frontend() -> str:
    """$FLEXFLOW_FRONTEND, else "auto"."""
    return os.environ.get("FLEXFLOW_FRONTEND") or "auto"


def no_jit() -> bool:
    """$FLEXFLOW_NO_JIT set (not 0): the scheduler kernels run interpreted."""
    return _flag("FLEXFLOW_NO_JIT")


def batch_gloo_loops() -> bool:
    """$FLEXFLOW_GLOO_LOOP is "batch" (the default): the runtime's gloo loop threads
    run under SCHED_BATCH; "normal" leaves them alone."""
    return os.environ.get("FLEXFLOW_GLOO_LOOP", "batch") == "batch"


def search_threads() -> int:
    """$FLEXFLOW_SEARCH_THREADS, else the cores this process may run on: how many threads a
    search simulates its proposals on."""
    env = os.environ.get("FLEXFLOW_SEARCH_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"FLEXFLOW_SEARCH_THREADS must be a whole number of threads, got {env!r}") from None
        if n < 1:
            raise ValueError(f"FLEXFLOW_SEARCH_THREADS must be at least 1, got {env!r}")
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        return os.cpu_count() or 1
