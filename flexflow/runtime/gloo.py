"""Gloo's TCP event-loop threads, moved to ``SCHED_BATCH`` when process groups are made.

See :func:`batch_gloo_loops` for why; :func:`batched_gloo_loops` wraps the
creation of process groups (the runtime's, and the calibration's).
"""
from __future__ import annotations

import contextlib
import os

from .. import settings

__all__ = ["GLOO_LOOP_THREAD", "batch_gloo_loops", "batched_gloo_loops"]

GLOO_LOOP_THREAD = "gloo_tcp_loop"  # the name gloo's TCP transport gives its event-loop threads


def _threads() -> set:
    """This process's thread ids (Linux; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def batch_gloo_loops(tids) -> list:
    """Move gloo's TCP event-loop threads among ``tids`` to ``SCHED_BATCH``; returns the
    thread ids moved.

    A loop thread woken by a socket event preempts the thread that is running on its
    core.  When that is this rank's main thread inside a send, holding the pair's lock,
    the loop thread fails its ``try_lock``, returns to ``epoll_wait``, which reports the
    same event again, and spins so for the rest of its time slice: the send comes back
    milliseconds late.  Where ranks share cores (2 ranks on 2 cores: one main thread and
    several loop threads each) one send in ten did so, and message-heavy strategies ran
    2-3x slower than their compute and messages add up to.  Under ``SCHED_BATCH`` a
    woken thread does not preempt; it runs on an idle core, when the running thread
    blocks (a rank waiting for its data does) or at the next tick.  Only the threads of
    the groups this runtime creates are moved; ``FLEXFLOW_GLOO_LOOP=normal`` leaves
    them alone."""
    if not settings.batch_gloo_loops() or not hasattr(os, "SCHED_BATCH"):
        return []
    moved = []
    for tid in sorted(tids):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != GLOO_LOOP_THREAD:
                    continue
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            moved.append(tid)
        except OSError:  # gone, or not permitted: leave it as it is
            continue
    return moved


@contextlib.contextmanager
def batched_gloo_loops():
    """Create process groups within it: at its end, the gloo event-loop threads that
    appeared meanwhile are moved to ``SCHED_BATCH`` (:func:`batch_gloo_loops`); it
    yields the list their ids go to."""
    before = _threads()
    moved: list = []
    yield moved
    moved.extend(batch_gloo_loops(_threads() - before))

