"""The scheduler's inner loops, compiled: list scheduling over flat integer arrays.

The task graph (``taskgraph.py``) keeps its tasks' predecessors in Python lists, which the
delta patch edits; :class:`flexflow.schedarrays.TaskArrays` holds the task columns and
mirrors those lists in numpy arrays (successors, predecessors and multi-resource routes as
segments of one buffer each), brought up to date with only the tasks a patch touched.  The
two kernels run on those arrays:

- :func:`run_full`: every live task, from time 0;
- :func:`run_delta`: from the restart time t* of a patch (see ``simulate.py``), reusing the
  prefix of the previous run's dequeue log.

Both dequeue tasks by (ready time, priority, task id) from a bucket queue (see ``_loop``) --
the order of the interpreted scheduler they replace, so results are identical bit for bit -- and append each
dequeued task to the log, with the ready time it had.  Ready times in the log never
decrease (a task becomes ready no earlier than the start of the task that released it), so
the prefix a delta run keeps is found by binary search.

The kernels are compiled with numba when it is installed (``cache=True``: compiled once per
host, then loaded); ``FLEXFLOW_NO_JIT=1`` runs the same functions interpreted, which gives
the same results far more slowly.
"""
from __future__ import annotations

import numpy as np

from .. import settings

__all__ = ["JIT", "NO_LIMIT", "prefix_peak"]

try:  # pragma: no cover - depends on the environment
    if settings.no_jit():
        raise ImportError("disabled by FLEXFLOW_NO_JIT")
    import numba

    _jit = numba.njit(cache=True, nogil=True)
    JIT = True
except ImportError:  # pragma: no cover
    def _jit(f):
        return f
    JIT = False

_I8 = np.int64


NO_LIMIT = 1 << 62  # picoseconds: "no limit" (far beyond any step)


# ---- the ready queue -------------------------------------------------------------------------
# Ready times tie massively (the partitions of an op on identical devices finish together: nmt
# on 64 devices has 73,000 tasks and under 700 distinct ready times), and no task becomes ready
# before the one being dequeued (its ready time is a finish time of a task dequeued earlier).
# So the queue holds buckets: lists of tasks with one ready time, in push order, in a binary
# heap keyed by that time alone.  A push goes to the bucket the previous push went to when
# the time matches (the successors a finished task releases), else to a new bucket; when the
# next time is opened, every bucket of that time is merged and sorted once by (priority,
# task id); a task released at the open time is inserted at its place.  A binary heap of
# tasks over (ready, priority, id) spent 90% of the kernel in its sift loops, comparisons
# reaching the priority; this gives the same order at a quarter to a third of the cost.
# Queue arrays: rows of ``Q`` (one column per task).
QNEXT, QTAIL, QORD, QKEY, QCUR, QK, QK2, QT2, QINIT = range(9)


@_jit
def _sort_keys(K, T, K2, T2, n):
    """Sort T[:n] by (K, T) (K[i] is T[i]'s key): insertion sort of runs of 16, then
    bottom-up merges (no recursion: numba's cache and recursion do not mix)."""
    for lo in range(0, n, 16):
        hi = min(lo + 16, n)
        for i in range(lo + 1, hi):
            k = K[i]
            t = T[i]
            j = i
            while j > lo and (k < K[j - 1] or (k == K[j - 1] and t < T[j - 1])):
                K[j] = K[j - 1]
                T[j] = T[j - 1]
                j -= 1
            K[j] = k
            T[j] = t
    w = 16
    while w < n:
        for lo in range(0, n - w, 2 * w):
            mid = lo + w
            hi = min(lo + 2 * w, n)
            if K[mid - 1] < K[mid] or (K[mid - 1] == K[mid] and T[mid - 1] < T[mid]):
                continue  # already in order
            for i in range(lo, mid):
                K2[i] = K[i]
                T2[i] = T[i]
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                if K[j] < K2[i] or (K[j] == K2[i] and T[j] < T2[i]):
                    K[k] = K[j]
                    T[k] = T[j]
                    j += 1
                else:
                    K[k] = K2[i]
                    T[k] = T2[i]
                    i += 1
                k += 1
            while i < mid:
                K[k] = K2[i]
                T[k] = T2[i]
                i += 1
                k += 1
        w *= 2


# columns of the hot table (read by the scheduling loop): one 64-byte row per task
READY, FIN, CNT, DUR, RES1, PRIO, SOFF, SLEN = range(8)
# columns of the cold table (the delta restart, the rare multi-resource task, the lag)
POFF, PLEN, ROFF, RLEN, ALIVE, MARK, SCR, LAG = range(8)
# LAG: picoseconds between a task's end and the earliest start of its successors, holding no
# resource (a message's latency on a host where the cores move the messages: the cores are
# busy for the sending and receiving, the wire and the peer's wake-up hold nothing, and
# messages posted together overlap them)


@_jit
def _loop(Q, ninit, H, C, RBUF, SBUF, free, rem, limit, LOG, LOGR, nlog, lag):
    """Dequeue in (ready, priority, id) order, starting from the ``ninit`` tasks in
    Q[QINIT] (ready at H[t, READY]), until the queue is empty, or until some resource r
    proves the graph cannot end by ``limit``: it is busy until free[r] and still has rem[r]
    of work queued (free[r] + rem[r] > limit).  Returns (new log length, stopped early).
    Without a limit (NO_LIMIT) the queued work is not kept (the callers leave rem unset):
    a complete run is about a tenth faster.  ``lag``: whether any task has a LAG (the
    cold table is then read once per task; without, not at all)."""
    track = limit < NO_LIMIT
    NX, TL, ORD, HK, CUR = Q[QNEXT], Q[QTAIL], Q[QORD], Q[QKEY], Q[QCUR]
    K, K2, T2, INIT = Q[QK], Q[QK2], Q[QT2], Q[QINIT]
    # the first buckets: the initial tasks grouped by ready time (ascending: a valid heap)
    for i in range(ninit):
        K[i] = H[INIT[i], READY]
    _sort_keys(K, INIT, K2, T2, ninit)
    hb = 0
    for i in range(ninit):
        t = INIT[i]
        if hb > 0 and HK[hb - 1] == K[i]:
            b = ORD[hb - 1]
            NX[TL[b]] = t
            TL[b] = t
        else:
            ORD[hb] = t
            HK[hb] = K[i]
            hb += 1
            TL[t] = t
        NX[t] = -1
    size = ninit
    clo, chi = 0, 0  # the open bucket: CUR[clo:chi], tasks ready at time cur
    cur, lastv, lastb = -1, -1, -1  # (lastv, lastb): the bucket a push last went to
    while size > 0:
        if clo == chi:  # open the next time: its buckets merged, in (priority, id) order
            cur = HK[0]
            m = 0
            while hb > 0 and HK[0] == cur:
                x = ORD[0]
                while x >= 0:
                    CUR[m] = x
                    m += 1
                    x = NX[x]
                hb -= 1  # pop the heap's top (a 4-ary heap: half the levels of a binary one)
                if hb > 0:
                    kb, vb = HK[hb], ORD[hb]
                    i = 0
                    while True:
                        c = 4 * i + 1
                        if c >= hb:
                            break
                        e = c + 4 if c + 4 < hb else hb
                        km = HK[c]
                        for cc in range(c + 1, e):
                            if HK[cc] < km:
                                km = HK[cc]
                                c = cc
                        if km < kb:
                            HK[i] = km
                            ORD[i] = ORD[c]
                            i = c
                        else:
                            break
                    HK[i] = kb
                    ORD[i] = vb
            if lastv == cur:
                lastv, lastb = -1, -1
            if m == 2:  # (most buckets hold one or two tasks once the devices' symmetry breaks)
                a, b = CUR[0], CUR[1]
                pa, pb = H[a, PRIO], H[b, PRIO]
                if pb < pa or (pb == pa and b < a):
                    CUR[0], CUR[1] = b, a
            elif m > 2:
                for i in range(m):
                    K[i] = H[CUR[i], PRIO]
                _sort_keys(K, CUR, K2, T2, m)
            clo, chi = 0, m
        t = CUR[clo]
        clo += 1
        size -= 1
        row = H[t]
        rdy = row[READY]
        s = rdy
        r = row[RES1]
        d = row[DUR]
        over = False
        if r >= 0:
            f = free[r]
            if f > s:
                s = f
            e = s + d
            free[r] = e
            if track:
                left = rem[r] - d
                rem[r] = left
                over = e + left > limit
        else:
            o = C[t, ROFF]
            m = C[t, RLEN]
            for i in range(o, o + m):
                f = free[RBUF[i]]
                if f > s:
                    s = f
            e = s + d
            for i in range(o, o + m):
                q = RBUF[i]
                free[q] = e
                if track:
                    left = rem[q] - d
                    rem[q] = left
                    if e + left > limit:
                        over = True
        row[FIN] = e
        LOG[nlog] = t
        LOGR[nlog] = rdy
        nlog += 1
        if over:
            return nlog, True
        if lag:
            e += C[t, LAG]  # when the successors may start
        o = row[SOFF]
        for i in range(o, o + row[SLEN]):
            c = SBUF[i]
            rc = H[c]
            rr = rc[READY]
            if rr < e:
                rr = e
                rc[READY] = e
            k = rc[CNT] - 1
            rc[CNT] = k
            if k != 0:
                continue
            size += 1
            if rr == cur:  # into the open bucket, at its place among the tasks not yet dequeued
                j = chi
                pc = rc[PRIO]
                while j > clo and (pc < H[CUR[j - 1], PRIO] or (pc == H[CUR[j - 1], PRIO] and c < CUR[j - 1])):
                    CUR[j] = CUR[j - 1]
                    j -= 1
                CUR[j] = c
                chi += 1
                continue
            if rr == lastv:  # the bucket the last push went to
                b = lastb
                NX[TL[b]] = c
                NX[c] = -1
                TL[b] = c
                continue
            # a new bucket (one of the same time may be pending: they merge when opened)
            TL[c] = c
            NX[c] = -1
            i = hb
            hb += 1
            while i > 0:
                q = (i - 1) >> 2
                if HK[q] > rr:
                    HK[i] = HK[q]
                    ORD[i] = ORD[q]
                    i = q
                else:
                    break
            HK[i] = rr
            ORD[i] = c
            lastv, lastb = rr, c
    return nlog, False


# (the kernels add a task's duration to the queued work of its resources inline: a call per
# task to a compiled helper taking the arrays costs ~30 ns in reference counting, 30x the
# addition itself)
@_jit
def _queued_work(ts, H, C, RBUF, rem):
    """rem[r] = the durations of tasks ``ts`` on resource r."""
    for r in range(rem.shape[0]):
        rem[r] = 0
    for t in ts:
        r = H[t, RES1]
        if r >= 0:
            rem[r] += H[t, DUR]
        else:
            o = C[t, ROFF]
            for i in range(o, o + C[t, RLEN]):
                rem[RBUF[i]] += H[t, DUR]


@_jit
def _over(free, rem, limit):
    for r in range(free.shape[0]):
        if free[r] + rem[r] > limit:
            return True
    return False


@_jit
def _run_full(n, H, C, RBUF, SBUF, PBUF, free, rem, limit, LOG, LOGR, Q, SUF, lag):
    for r in range(free.shape[0]):
        free[r] = 0
    hn = 0
    ns = 0
    for t in range(n):
        H[t, READY] = 0
        H[t, CNT] = C[t, PLEN]
        if C[t, ALIVE]:
            SUF[ns] = t
            ns += 1
    if limit < NO_LIMIT:
        _queued_work(SUF[:ns], H, C, RBUF, rem)
        if _over(free, rem, limit):
            return 0, True
    INIT = Q[QINIT]
    for t in range(n):
        if C[t, ALIVE] and C[t, PLEN] == 0:
            INIT[hn] = t
            hn += 1
    return _loop(Q, hn, H, C, RBUF, SBUF, free, rem, limit, LOG, LOGR, 0, lag)


@_jit
def _run_delta(dead, dirty, born, n, nlog, valid, H, C, RBUF, SBUF, PBUF, free, rem, limit, LOG, LOGR, Q, SUF,
               stamp, lag):
    """Re-simulate from t* (``simulate.py``), no later than ``valid`` (the previous run
    stopped early: only its tasks with ready time < valid are final).  Returns (new log
    length, tasks re-simulated, stopped early)."""
    tstar = valid
    for t in dead:
        if H[t, READY] < tstar:
            tstar = H[t, READY]
    for t in dirty:
        if H[t, READY] < tstar:
            tstar = H[t, READY]
    # a changed task whose predecessors are all unchanged can become ready at their latest finish
    for t in dirty:
        C[t, MARK] = stamp
    for t in born:
        C[t, MARK] = stamp
    for grp in range(2):
        ts = dirty if grp == 0 else born
        for t in ts:
            lb = 0
            hit = False
            o = C[t, POFF]
            for i in range(o, o + C[t, PLEN]):
                p = PBUF[i]
                if C[p, MARK] == stamp:
                    hit = True
                    break
                if H[p, FIN] + C[p, LAG] > lb:
                    lb = H[p, FIN] + C[p, LAG]
            if not hit and lb < tstar:
                tstar = lb
    # keep the log's prefix with ready time < t*
    lo, hi = 0, nlog
    while lo < hi:
        mid = (lo + hi) >> 1
        if LOGR[mid] < tstar:
            lo = mid + 1
        else:
            hi = mid
    keep = lo
    stamp += 1
    for r in range(free.shape[0]):
        free[r] = 0
    for i in range(keep):
        t = LOG[i]
        C[t, MARK] = stamp
        r = H[t, RES1]
        if r >= 0:
            free[r] = H[t, FIN]
        else:
            o = C[t, ROFF]
            for j in range(o, o + C[t, RLEN]):
                free[RBUF[j]] = H[t, FIN]
    # the suffix: every live task outside the prefix, waiting for all its predecessors ...
    # (one pass: each suffix row is touched once; with a limit, its work is queued too)
    stamp += 1
    ns = 0
    track = limit < NO_LIMIT
    if track:
        for r in range(rem.shape[0]):
            rem[r] = 0
    for t in range(n):
        if C[t, ALIVE] and C[t, MARK] != stamp - 1:
            C[t, MARK] = stamp
            SUF[ns] = t
            ns += 1
            H[t, CNT] = C[t, PLEN]
            H[t, READY] = 0
            if track:  # (its work queued on its resources)
                r = H[t, RES1]
                if r >= 0:
                    rem[r] += H[t, DUR]
                else:
                    o = C[t, ROFF]
                    for i in range(o, o + C[t, RLEN]):
                        rem[RBUF[i]] += H[t, DUR]
    if track and _over(free, rem, limit):
        return keep, ns, True
    # ... but those in the prefix, which are done (a prefix task's predecessors are all in
    # the prefix, so walking the prefix's successors finds every such edge once)
    for i in range(keep):
        p = LOG[i]
        f = H[p, FIN] + C[p, LAG]
        o = H[p, SOFF]
        for j in range(o, o + H[p, SLEN]):
            c = SBUF[j]
            if C[c, MARK] == stamp:
                H[c, CNT] -= 1
                if H[c, READY] < f:
                    H[c, READY] = f
    hn = 0
    INIT = Q[QINIT]
    for x in range(ns):
        t = SUF[x]
        if H[t, CNT] == 0:
            INIT[hn] = t
            hn += 1
    nlog, stopped = _loop(Q, hn, H, C, RBUF, SBUF, free, rem, limit, LOG, LOGR, keep, lag)
    return nlog, ns, stopped


@_jit
def _succ_from_pred(n, H, C, PBUF, SBUF):
    """Successor rows (H's SOFF / SLEN into SBUF) from the predecessor rows; returns their
    total length."""
    for t in range(n):
        H[t, SLEN] = 0
    for t in range(n):
        o = C[t, POFF]
        for i in range(o, o + C[t, PLEN]):
            H[PBUF[i], SLEN] += 1
    pos = 0
    for t in range(n):
        H[t, SOFF] = pos
        pos += H[t, SLEN]
        H[t, SLEN] = 0
    for t in range(n):
        o = C[t, POFF]
        for i in range(o, o + C[t, PLEN]):
            p = PBUF[i]
            SBUF[H[p, SOFF] + H[p, SLEN]] = t
            H[p, SLEN] += 1
    return pos


@_jit
def _succ_edits(ids, nbuf, noff, nlen, H, C, PBUF, SBUF, used):
    """Tasks ``ids`` get new predecessor rows (``nbuf[noff[x]:noff[x] + nlen[x]]``): rewrite
    the successor rows of their old and new predecessors at the end of SBUF (from ``used``).
    Returns the new end, or minus the end needed when SBUF is too short (nothing written).

    Each touched predecessor's row is copied once, with room for its additions; then every
    removal (in the order of ``ids``) and every addition (likewise) is applied in place:
    per predecessor, the same edits in the same order as one pass grouped by predecessor.
    C[:, SCR] counts a touched predecessor's additions (plus one) and is zero again after."""
    m = 0
    for x in range(ids.shape[0]):
        m += C[ids[x], PLEN] + nlen[x]
    touched = np.empty(m, np.int64)
    k = 0
    for x in range(ids.shape[0]):
        t = ids[x]
        o = C[t, POFF]
        for i in range(o, o + C[t, PLEN]):
            p = PBUF[i]
            if C[p, SCR] == 0:
                C[p, SCR] = 1
                touched[k] = p
                k += 1
        o = noff[x]
        for i in range(o, o + nlen[x]):
            p = nbuf[i]
            if C[p, SCR] == 0:
                C[p, SCR] = 1
                touched[k] = p
                k += 1
            C[p, SCR] += 1
    need = used
    for j in range(k):
        p = touched[j]
        need += H[p, SLEN] + C[p, SCR] - 1  # (the old row is copied before its removals)
    if need > SBUF.shape[0]:
        for j in range(k):
            C[touched[j], SCR] = 0
        return -need
    for j in range(k):
        p = touched[j]
        o = H[p, SOFF]
        L = H[p, SLEN]
        for q in range(L):
            SBUF[used + q] = SBUF[o + q]
        H[p, SOFF] = used
        used += L + C[p, SCR] - 1
        C[p, SCR] = 0
    for x in range(ids.shape[0]):  # removals first, then additions
        t = ids[x]
        o = C[t, POFF]
        for i in range(o, o + C[t, PLEN]):
            p = PBUF[i]
            s = H[p, SOFF]
            L = H[p, SLEN]
            q = 0
            while q < L and SBUF[s + q] != t:
                q += 1
            if q == L:
                raise ValueError("successor rows out of step with the predecessor rows")
            L -= 1
            SBUF[s + q] = SBUF[s + L]
            H[p, SLEN] = L
    for x in range(ids.shape[0]):
        t = ids[x]
        o = noff[x]
        for i in range(o, o + nlen[x]):
            p = nbuf[i]
            SBUF[H[p, SOFF] + H[p, SLEN]] = t
            H[p, SLEN] += 1
    return used


@_jit
def _prefix_peak(diff, u):
    """Per column of ``diff`` (positions x devices): the largest running sum over the first
    ``u`` rows (0 when u is 0), and the running sum through row u -- the cumulative sums
    without materialising them."""
    D = diff.shape[1]
    run = np.zeros(D, np.int64)
    peak = np.zeros(D, np.int64)
    for i in range(u):
        for d in range(D):
            x = run[d] + diff[i, d]
            run[d] = x
            if i == 0 or x > peak[d]:
                peak[d] = x
    for d in range(D):
        run[d] += diff[u, d]
    return peak, run


def prefix_peak(diff: np.ndarray, u: int) -> tuple[np.ndarray, np.ndarray]:
    """(largest running sum of each column over rows < u, running sum through row u)."""
    return _prefix_peak(diff, u)
