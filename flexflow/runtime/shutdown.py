"""Clean teardown of the runtime's communication, on every exit path.

Under torch 2.13, a gloo process group that is still alive when the
interpreter finalises can abort the process ("terminate called without an
active exception"): its worker threads still hold work objects while their
owners are destroyed.  So the library ends communication itself while the
interpreter is fully alive:

- every :class:`~flexflow.runtime.execute.Runtime` registers here;
  :func:`shutdown` closes it (:func:`close`: waits (bounded) for its
  outstanding work, drops every work object and destroys the process groups
  it created);
- then the default process group is destroyed (it is no use once the
  interpreter exits), and the garbage collector runs while the threads that
  might still reference Python objects are gone.

:func:`shutdown` runs from ``atexit`` (registered by the first runtime), so a
script that calls ``parallelize`` and simply ends exits 0, under ``torchrun``
as under :func:`flexflow.launch`; ``launch`` also calls it when the user's
function returns, then leaves the process without interpreter finalisation.
After a failure a process must not wait on peers that may be dead:
:func:`abandon` drops the references without waiting, and the caller exits
with ``os._exit``.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import threading
import weakref

__all__ = ["register", "close", "shutdown", "abandon"]

_runtimes: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()
_installed = False


def register(runtime) -> None:
    """Track a runtime so that :func:`shutdown` closes it (installs the atexit hook once)."""
    global _installed
    with _lock:
        _runtimes.add(runtime)
        if not _installed:
            atexit.register(shutdown)
            _installed = True


def close(rt, wait_s: float = 10.0, destroy_groups: bool = True) -> None:
    """End the communication of runtime ``rt`` (:meth:`Runtime.close
    <flexflow.runtime.execute.Runtime.close>`): wait at most ``wait_s`` for
    outstanding gradient all-reduces, drop every work object, destroy the
    process groups it created.  The module cannot run afterwards."""
    import torch.distributed as dist

    if rt.closed:
        return
    rt.closed = True
    works = [w for w, *_ in rt.sync.works]
    works += [w for ws, _ in rt._sends + rt._bwd_sends for w in ws]
    rt.sync.reset()
    rt._pending, rt._sends, rt._bwd_sends, rt._recv, rt._bwd_recv = [], [], [], {}, {}
    rt._riders, rt._early = [], []
    works = [w for w in works if w is not None]
    if wait_s > 0 and works and not rt.nccl:
        for w in works:
            try:
                w.wait(datetime.timedelta(seconds=wait_s))
            except Exception:  # noqa: BLE001 - a dead peer: nothing left to wait for
                break
    del works
    groups = [g for g in [rt.p2p_group, rt.coll_group, rt.ride_group, *rt.groups.values()]
              if g is not None]
    rt.groups, rt.p2p_group, rt.coll_group, rt.ride_group = {}, None, None, None
    if destroy_groups and dist.is_available() and dist.is_initialized():
        for g in groups:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001
                pass


def shutdown(wait_s: float = 10.0, destroy_default: bool = True) -> None:
    """Close every live runtime (wait at most ``wait_s`` for each outstanding
    work), then destroy the default process group.  Idempotent; never raises."""
    import torch.distributed as dist

    # garbage that still holds work objects (autograd graphs of the last steps
    # kept alive by reference cycles) goes while its process groups exist:
    # collected after they are destroyed, it crashes the process
    gc.collect()
    with _lock:
        runtimes = list(_runtimes)
        _runtimes.clear()
    for rt in runtimes:
        try:
            rt.close(wait_s=wait_s)
        except Exception:  # noqa: BLE001 - teardown goes on whatever a runtime says
            pass
    try:
        if destroy_default and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()


def abandon() -> None:
    """After a failure: drop every runtime's work objects without waiting on peers."""
    with _lock:
        runtimes = list(_runtimes)
        _runtimes.clear()
    for rt in runtimes:
        try:
            rt.close(wait_s=0.0, destroy_groups=False)
        except Exception:  # noqa: BLE001
            pass
