"""Clean teardown of the runtime's communication, on every exit path.

Under torch 2.13, a gloo process group that is still alive when the
interpreter finalises can abort the process ("terminate called without an
active exception"): its worker threads still hold work objects while their
owners are destroyed.  So the library ends communication itself while the
interpreter is fully alive:

- every :class:`~flexflow.execute.Runtime` registers here; :func:`shutdown`
  waits (bounded) for its outstanding work, drops every work object and
  destroys the process groups it created;
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
import gc
import threading
import weakref

__all__ = ["register", "shutdown", "abandon"]

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
