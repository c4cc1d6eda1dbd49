"""The scheduler's arrays (:class:`TaskArrays`): the task columns and the predecessor,
successor and route rows the compiled kernels (``schedcore.py``) read, mirrored from a task
graph in full (:meth:`TaskArrays.load`) or by the tasks a delta patch touched
(:meth:`TaskArrays.update`), and the schedule state the kernels fill."""
from __future__ import annotations

from itertools import chain

import numpy as np

from .schedcore import (
    _I8,
    ALIVE,
    DUR,
    FIN,
    LAG,
    NO_LIMIT,
    PLEN,
    POFF,
    PRIO,
    QINIT,
    RES1,
    RLEN,
    ROFF,
    SLEN,
    SOFF,
    _run_delta,
    _run_full,
    _succ_edits,
    _succ_from_pred,
)
from .taskkeys import TID_BITS, XB, XF, kind_of

__all__ = ["TaskArrays"]


def _ids(xs) -> np.ndarray:
    return np.fromiter(xs, _I8, len(xs))


# ---- the arrays ------------------------------------------------------------------------------
def _aligned(rows: int, cols: int) -> np.ndarray:
    """A zeroed int64 (rows, cols) table whose rows start on 64-byte boundaries."""
    raw = np.zeros(rows * cols + 8, _I8)
    skip = (-raw.ctypes.data % 64) // 8
    return raw[skip:skip + rows * cols].reshape(rows, cols)


class _Segments:
    """Variable-length integer rows (one per task) in one buffer; each task's (offset,
    length) are two columns of a task table.  Rewritten rows are appended; the live rows are
    gathered to the front when dead space dominates."""

    def __init__(self, offcol: int, lencol: int):
        self.oc, self.lc = offcol, lencol
        self.buf = np.zeros(1024, _I8)
        self.used = 0

    def set_all(self, table: np.ndarray, rows: list) -> None:
        n = len(rows)
        lens = np.fromiter(map(len, rows), _I8, n)
        total = int(lens.sum())
        self.buf = np.zeros(max(2 * total, 1024), _I8)
        self.buf[:total] = np.fromiter(chain.from_iterable(rows), _I8, total)
        table[:n, self.oc] = np.cumsum(lens) - lens
        table[:n, self.lc] = lens
        table[n:, self.lc] = 0
        self.used = total

    def _compact(self, table: np.ndarray, n: int, room: int) -> None:
        offs, lens = table[:n, self.oc], table[:n, self.lc]
        live = int(lens.sum())
        starts = np.cumsum(lens) - lens
        idx = np.arange(live, dtype=_I8) + np.repeat(offs - starts, lens)
        buf = np.zeros(max(4 * (live + room), 1024), _I8)  # (room for many patches before the next)
        buf[:live] = self.buf[idx]
        self.buf = buf
        table[:n, self.oc] = starts
        self.used = live

    def set_rows(self, table: np.ndarray, n: int, ids: np.ndarray, rows: list) -> None:
        lens = np.fromiter(map(len, rows), _I8, len(rows))
        self.set_flat(table, n, ids, np.fromiter(chain.from_iterable(rows), _I8, int(lens.sum())), lens)

    def set_flat(self, table: np.ndarray, n: int, ids: np.ndarray, flat: np.ndarray, lens: np.ndarray) -> None:
        """Rows ``ids`` become the consecutive pieces of ``flat`` of lengths ``lens``."""
        total = len(flat)
        if self.used + total > len(self.buf):
            table[ids, self.lc] = 0  # (their old rows are dropped by the compaction)
            self._compact(table, n, total)
        self.buf[self.used:self.used + total] = flat
        table[ids, self.oc] = self.used + np.cumsum(lens) - lens
        table[ids, self.lc] = lens
        self.used += total


class TaskArrays:
    """numpy mirror of a task graph's lists, plus the schedule state the kernels fill: each
    task's ready and finish time, the dequeue log, and when each resource is next free."""

    def __init__(self, R: int, xfer_lag: int = 0):
        self.R = R
        self.xfer_lag = int(xfer_lag)  # picoseconds after a transfer before its consumer may start
        self.cap = 0
        self.n = 0
        self.H = self.C = self.LOG = self.LOGR = self.HEAP = self.SUF = None
        self.succ, self.pred, self.res = _Segments(SOFF, SLEN), _Segments(POFF, PLEN), _Segments(ROFF, RLEN)
        self.free = np.zeros(R, _I8)
        self.rem = np.zeros(R, _I8)  # work queued per resource (the early stop's bound)
        self.valid = NO_LIMIT  # ready times below this are final in the log
        self.nlog = 0
        self.stamp = 0

    @property
    def FIN(self) -> np.ndarray:
        return self.H[:self.n, FIN]

    def column(self, name: str) -> list[int]:
        """A task column as a list: "dur" (picoseconds), "prio" (the task's priority key) or
        "alive" (1 for a live task, 0 for a dead id)."""
        if name == "alive":
            return self.C[:self.n, ALIVE].tolist()
        return self.H[:self.n, {"dur": DUR, "prio": PRIO}[name]].tolist()

    def _grow(self, n: int) -> None:
        if n <= self.cap:
            return
        cap = max(n, int(self.cap * 1.5) + 64)
        H, C = _aligned(cap, 8), _aligned(cap, 8)
        if self.H is not None:
            H[:self.cap] = self.H
            C[:self.cap] = self.C
        self.H, self.C = H, C
        LOG, LOGR = np.zeros(cap, _I8), np.zeros(cap, _I8)
        if self.LOG is not None:
            LOG[:self.cap] = self.LOG
            LOGR[:self.cap] = self.LOGR
        self.LOG, self.LOGR = LOG, LOGR
        self.HEAP = np.zeros((QINIT + 1, cap + 1), _I8)  # the ready queue (_loop)
        self.SUF = np.zeros(cap, _I8)
        self.cap = cap

    def load(self, tg) -> None:
        """Mirror every task of ``tg``."""
        n = self.n = len(tg.DUR)
        self._grow(n + n // 4 + 64)  # (room for the ids the first patches add)
        H, C = self.H, self.C
        H[n:] = 0  # (ids a later patch appends start empty)
        C[n:] = 0
        H[:n, DUR] = tg.DUR
        H[:n, RES1] = tg.RES1
        H[:n, PRIO] = [k >> TID_BITS for k in tg.KP]
        C[:n, ALIVE] = tg.ALIVE
        if self.xfer_lag:  # (else every LAG stays 0)
            C[:n, LAG] = self._lags(H[:n, PRIO])
        self.pred.set_all(C, tg.PRED)
        self.res.set_all(C, [r or () for r in tg.RESM])
        sg = self.succ
        sg.buf = np.zeros(max(2 * self.pred.used, 1024), _I8)
        sg.used = int(_succ_from_pred(n, H, C, self.pred.buf, sg.buf))

    def _lags(self, prios: np.ndarray) -> np.ndarray:
        """The LAG column of tasks with priorities ``prios``: ``xfer_lag`` for transfers."""
        kinds = kind_of(prios)
        return np.where((kinds == XF) | (kinds == XB), self.xfer_lag, 0)

    def update(self, tg, killed, preds, born) -> None:
        """Mirror a patch: the tasks it killed, those whose predecessors it changed (and
        their predecessors' successor rows), and the tasks it allocated (columns, see
        ``TaskGraph.take_touched``)."""
        n = self.n = len(tg.PRED)
        self._grow(n)
        H, C = self.H, self.C
        if killed:
            C[_ids(killed), ALIVE] = 0
        if born[0]:
            tids, durs, r1s, rms, prios = born
            ids = np.array(tids, _I8)
            H[ids, DUR] = durs
            H[ids, RES1] = r1s
            H[ids, PRIO] = prios
            if self.xfer_lag:
                C[ids, LAG] = self._lags(H[ids, PRIO])
            C[ids, ALIVE] = 1
            C[ids, RLEN] = 0
            multi = [i for i, r in enumerate(rms) if r]  # (routes: the rare multi-resource tasks)
            if multi:
                self.res.set_rows(C, n, ids[multi], [rms[i] for i in multi])
        if preds:
            ts = list(preds)
            ids = np.array(ts, _I8)
            PRED = tg.PRED
            rows = [PRED[t] for t in ts]
            lens = np.fromiter(map(len, rows), _I8, len(rows))
            flat = np.fromiter(chain.from_iterable(rows), _I8, int(lens.sum()))
            offs = np.cumsum(lens) - lens
            sg = self.succ
            used = _succ_edits(ids, flat, offs, lens, H, C, self.pred.buf, sg.buf, sg.used)
            if used < 0:  # out of room: gather the live rows to the front and try again
                sg._compact(H, n, -used - sg.used)
                used = _succ_edits(ids, flat, offs, lens, H, C, self.pred.buf, sg.buf, sg.used)
            sg.used = int(used)
            self.pred.set_flat(C, n, ids, flat, lens)

    def check(self, tg) -> None:
        """The arrays mirror ``tg`` (for tests): columns, routes, predecessor rows, and
        successor rows that hold exactly the live tasks' predecessor edges."""
        if tg.ALIVE is None:
            raise ValueError("check() needs a task graph that keeps its columns (TaskGraph.keep_columns)")
        n = len(tg.PRED)
        H, C = self.H, self.C
        row = lambda seg, tab, t: sorted(seg.buf[tab[t, seg.oc]:tab[t, seg.oc] + tab[t, seg.lc]].tolist())
        succ = [[] for _ in range(n)]
        for t in range(n):
            assert bool(C[t, ALIVE]) == tg.ALIVE[t], t
            if tg.ALIVE[t]:
                assert (H[t, DUR], H[t, RES1], H[t, PRIO]) == (tg.DUR[t], tg.RES1[t], tg.KP[t] >> TID_BITS), t
                assert C[t, LAG] == (self._lags(H[t:t + 1, PRIO])[0] if self.xfer_lag else 0), t
                assert row(self.res, C, t) == sorted(tg.RESM[t] or ()), t
            assert row(self.pred, C, t) == sorted(tg.PRED[t]), t
            for p in tg.PRED[t]:
                succ[p].append(t)
        for t in range(n):
            assert row(self.succ, H, t) == sorted(succ[t]), t

    def run_full(self, limit: int = NO_LIMIT) -> bool:
        """Schedule every task; False if stopped early (see :meth:`run_delta`)."""
        self.nlog, stopped = _run_full(self.n, self.H, self.C, self.res.buf, self.succ.buf, self.pred.buf,
                                       self.free, self.rem, limit, self.LOG, self.LOGR, self.HEAP, self.SUF,
                                       self.xfer_lag > 0)
        self.nlog = int(self.nlog)
        self._set_valid(stopped)
        return not stopped

    def run_delta(self, dead, dirty, born, limit: int = NO_LIMIT) -> tuple[int, bool]:
        """Re-simulate after a patch.  Returns (tasks scheduled again, finished): with a
        ``limit`` (picoseconds) the run stops as soon as some resource's busy time plus its
        queued work exceeds it -- then the graph provably ends later than ``limit``, and the
        next run restarts no later than the stopping point."""
        nlog, ns, stopped = _run_delta(_ids(dead), _ids(dirty), _ids(born), self.n, self.nlog, self.valid, self.H,
                                       self.C, self.res.buf, self.succ.buf, self.pred.buf, self.free, self.rem,
                                       limit, self.LOG, self.LOGR, self.HEAP, self.SUF, self.stamp + 1,
                                       self.xfer_lag > 0)
        self.stamp += 3  # (a delta run marks with three fresh stamps)
        self.nlog = int(nlog)
        self._set_valid(stopped)
        return int(ns), not stopped

    def _set_valid(self, stopped: bool) -> None:
        # after an early stop only the tasks dequeued with ready time below the last one's are final
        self.valid = int(self.LOGR[self.nlog - 1]) if stopped and self.nlog else (0 if stopped else NO_LIMIT)

    @property
    def complete(self) -> bool:
        """Whether the last run scheduled every task."""
        return self.valid == NO_LIMIT

    def log(self) -> np.ndarray:
        """Task ids in the order the last run dequeued them."""
        return self.LOG[:self.nlog]

    def resources(self, t: int) -> list[int]:
        """The resources task ``t`` holds."""
        r = int(self.H[t, RES1])
        if r >= 0:
            return [r]
        o = self.C[t, ROFF]
        return self.res.buf[o:o + self.C[t, RLEN]].tolist()
