"""Proposals simulated side by side.

The scheduler's kernels (``sim/schedcore.py``) are compiled without the interpreter lock,
and they are about half of a proposal's time at 64 devices; the patch of the task graph
around them is Python.  So a search evaluates its proposals in rounds of ``ROUND``: the
proposals of one round are made first (each for its own simulator: a chain's, or one of the
descent's), then simulated on up to ``ROUND`` threads, then read in the order they were
made.  While one thread runs a kernel, another patches its task graph.

A round always holds ``ROUND`` proposals where there are that many to make, whatever the
number of threads: the proposals made, and so the result of a search with a given seed
and ``evaluations``, do not depend on the host's cores (``FLEXFLOW_SEARCH_THREADS``
only sets how many run at once).

The simulators of one round are distinct objects; what they share -- the context's cached
plans (``sim/plans.py``) -- is filled by get-or-compute-and-store, which two threads may
both compute: the same values, one of them kept.
"""
from __future__ import annotations

import concurrent.futures as cf
import sys

from .. import settings

__all__ = ["ROUND", "Evaluator"]

ROUND = 4  # proposals evaluated together
_SWITCH_S = 0.0005  # the interpreter's switch interval while threads simulate: a thread back
# from a kernel waits for the lock at most this long (5 ms by default: longer than a kernel)


class Evaluator:
    """Runs a round's simulations, on ``threads`` threads (default: as the settings say, at
    most ``ROUND``); one thread runs them in the caller.  A context manager: the threads and
    the switch interval last as long as the ``with`` block."""

    def __init__(self, threads: int | None = None):
        self.threads = max(1, min(ROUND, settings.search_threads() if threads is None else int(threads)))
        self._pool = None
        self._switch = None

    def __enter__(self) -> Evaluator:
        if self.threads > 1:
            self._pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="flexflow-search")
            self._switch = sys.getswitchinterval()
            sys.setswitchinterval(min(_SWITCH_S, self._switch))
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            sys.setswitchinterval(self._switch)

    def map(self, jobs: list) -> list:
        """``[fn(*args) for fn, *args in jobs]``, side by side where there are threads.  Every
        job has ended when this returns or raises (the first error, in job order, is raised)."""
        if self._pool is None or len(jobs) <= 1:
            return [fn(*args) for fn, *args in jobs]
        futs = [self._pool.submit(fn, *args) for fn, *args in jobs]
        cf.wait(futs)
        return [f.result() for f in futs]
