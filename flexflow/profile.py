"""Operator profiler with an on-disk cache, feeding :class:`flexflow.cost.CostModel`.

Each distinct op partition -- (op kind, input/output/parameter region shapes,
attrs, dtypes), the key of :meth:`CostModel.key` -- is timed once per device:
random tensors of the partition's input and parameter region shapes (integer
inputs drawn as valid indices for their consumer: token ids below the
embedding's vocabulary, class targets below the logits' class count), then
``RULES[op.rule].compute`` forward and a backward through it (gradient of
the sum of the output w.r.t. float inputs and parameters; in-place ops get
fresh untimed copies).  One warm-up (two for fast ops), the median of
``repeats`` runs; CUDA events and a synchronize on GPUs, ``time.perf_counter``
on CPU under the current ``torch.get_num_threads()`` (which the profiler
never changes; it is part of the CPU device name).

Cache layout: ``flexflow.comm.cache_dir()/profiles/<device name>.json``, one
file per device name (``cpu-<cpu model>-<threads>t``, ``cuda-<GPU name>``)::

    {"format": "flexflow-profile", "version": 1, "device_name": "cuda-NVIDIA_H200",
     "device_kind": "H200", "torch": "2.x", "entries": {
    "<json of CostModel.key>": {"fwd_s": .., "bwd_s": .., "kind": .., "rule": .., "dtype": ..,
        "flops": .., "bytes": .., "backward_factor": .., "output_shape": .., "runs": ..,
        "threads": .., "op": <first op name>, ...},       <- one entry per line
    ...}}

Saving takes an exclusive ``fcntl.flock`` on ``<file>.lock``, re-reads the
file, merges (this process's new entries win) and replaces it atomically
(tempfile + ``os.replace``), so processes can share one cache.  A corrupt
file is rebuilt with a warning.  ``flexflow/data/profile-<kind>.json`` in the
package is a read-only fallback (e.g. an H200 profile shipped with the code).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cost import CostModel, fit_efficiency, partition_bytes, partition_flops
from .ops import RULES, region_shape
from .strategy import ParallelConfig, partitions

__all__ = ["ProfileDB", "ProfileReport", "profile_graph", "profile_partition", "device_kind_of",
           "device_name", "profiles_dir", "package_profile_path", "key_str", "fit_efficiency",
           "calibrate_comm", "FORMAT", "VERSION"]

FORMAT, VERSION = "flexflow-profile", 1
_KEYER = CostModel(None)  # key() needs no machine
_PKG_DATA = Path(__file__).parent / "data"


# ---- devices -----------------------------------------------------------------------------
def _torch_device(device) -> torch.device:
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here: cannot profile on 'cuda' (use --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot profile on device {device!r}: use 'cpu' or 'cuda'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _clean(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", s).strip("_") or "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or socket.gethostname() or platform.machine()


def _gpu_kind(name: str) -> str:
    from .machine import GPU_SPECS
    return next((k for k in GPU_SPECS if re.search(rf"\b{k}\b", name.upper())), name)


def device_name(device="cpu") -> str:
    """Name of the profile file of a device: ``cpu-<cpu model>-<threads>t`` (CPU times
    depend on torch's thread count) or ``cuda-<GPU name>`` (e.g. ``cuda-NVIDIA_H200``)."""
    dev = _torch_device(device)
    if dev.type == "cuda":
        return "cuda-" + _clean(torch.cuda.get_device_name(dev))
    return f"cpu-{_clean(_cpu_model())}-{torch.get_num_threads()}t"


def device_kind_of(device="cpu") -> str:
    """The machine device kind (``DeviceSpec.kind``) measurements on ``device`` stand for:
    ``"cpu"`` for the host CPU (the kind of the ``cpu`` preset), the ``GPU_SPECS`` name
    for a known GPU (``"H200"`` for an "NVIDIA H200"), else the GPU's own name (as
    ``Machine.detect`` names unknown GPUs).  RuntimeError when cuda is asked for here
    without a CUDA device."""
    dev = _torch_device(device)
    return "cpu" if dev.type == "cpu" else _gpu_kind(torch.cuda.get_device_name(dev))


def _kind_from_name(name: str) -> str:
    if name.startswith("cpu"):
        return "cpu"
    return _gpu_kind(name.removeprefix("cuda-").replace("_", " "))


def profiles_dir(profile_dir=None) -> Path:
    """``profile_dir``, else ``flexflow.comm.cache_dir()/profiles``."""
    if profile_dir is not None:
        return Path(profile_dir)
    from .comm import cache_dir
    return cache_dir() / "profiles"


def package_profile_path(device_kind: str) -> Path:
    """The read-only profile shipped in the package for a device kind (may not exist)."""
    return _PKG_DATA / f"profile-{_clean(device_kind)}.json"


def key_str(key) -> str:
    """The JSON text a cost-model key is stored under (strings pass through)."""
    return key if isinstance(key, str) else json.dumps(key, separators=(",", ":"))


# ---- the database ------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path):
    """Exclusive lock on ``<path>.lock`` (fcntl.flock; no lock where fcntl is missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(str(path) + ".lock", "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _valid_entry(e) -> bool:
    return (isinstance(e, dict) and all(isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool)
                                        and math.isfinite(e[k]) and e[k] >= 0 for k in ("fwd_s", "bwd_s")))


def _read(path: Path, quiet=False):
    """(header dict, entries dict) of a profile file; None when missing; ({}, {}) with a
    warning when corrupt."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        if not quiet:
            warnings.warn(f"cannot read profile cache {path}: {e}; starting an empty one")
        return {}, {}
    try:
        d = json.loads(text)  # bytes: bad UTF-8 is a ValueError too
        if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("entries"), dict):
            raise ValueError("not a flexflow profile file")
        if d.get("version") != VERSION:
            raise ValueError(f"version {d.get('version')!r}, expected {VERSION}")
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        if not quiet:
            warnings.warn(f"profile cache {path} is corrupt ({e}); rebuilding it")
        return {}, {}
    entries = {k: v for k, v in d["entries"].items() if _valid_entry(v)}
    if len(entries) < len(d["entries"]) and not quiet:
        warnings.warn(f"profile cache {path}: dropped {len(d['entries']) - len(entries)} corrupt entries")
    return {k: v for k, v in d.items() if k != "entries"}, entries


class ProfileDB:
    """Measured (forward_s, backward_s) per cost-model key for one device.

    ``entries``: key text -> dict with ``fwd_s``, ``bwd_s`` and the meta recorded with
    them (``rule``, ``dtype``, ``flops`` ... used by :func:`fit_efficiency`).
    ``fallback``: read-only entries (the package's profile) consulted after ``entries``.
    """

    def __init__(self, device_name: str, device_kind: str | None = None, path=None,
                 entries: dict | None = None, read_only: bool = False):
        self.device_name = device_name
        self.device_kind = device_kind or _kind_from_name(device_name)
        self.path = None if path is None else Path(path)
        self.entries: dict[str, dict] = dict(entries or {})
        self.fallback: dict[str, dict] = {}
        self.read_only = read_only
        self._dirty: dict[str, dict] = {}

    @classmethod
    def load(cls, device_name: str, path=None, *, device_kind: str | None = None,
             profile_dir=None, read_only: bool = False) -> "ProfileDB":
        """The profile of ``device_name`` from ``path`` (default
        ``profiles_dir(profile_dir)/<device_name>.json``); empty when the file does not
        exist; a corrupt file gives a warning and an empty database (rewritten on save)."""
        path = Path(path) if path is not None else profiles_dir(profile_dir) / f"{device_name}.json"
        got = _read(path)
        header, entries = got if got is not None else ({}, {})
        kind = header.get("device_kind") if isinstance(header.get("device_kind"), str) else None
        kind = device_kind or kind or _kind_from_name(device_name)
        return cls(device_name, kind, path, entries, read_only)

    @classmethod
    def for_kind(cls, device_kind: str, profile_dir=None) -> "ProfileDB | None":
        """The measurements that stand for a machine device kind, or None: a cache file
        of that kind (for ``"cpu"`` this host's file under the current thread count when
        there is one, else the largest cpu file), backed by the package's read-only
        ``profile-<kind>.json`` when it exists."""
        d = profiles_dir(profile_dir)
        files = sorted(p for p in d.glob("*.json")
                       if not p.name.startswith(".") and _kind_from_name(p.stem) == device_kind) \
            if d.is_dir() else []
        dbs = [cls.load(p.stem, p) for p in files]
        dbs = [db for db in dbs if db.device_kind == device_kind and len(db)]
        local = device_name("cpu") if device_kind == "cpu" else None
        chosen = next((db for db in dbs if db.device_name == local), None)
        if chosen is None and dbs:
            chosen = max(dbs, key=len)
        pkg = package_profile_path(device_kind)
        base = cls.load(f"package-{device_kind}", pkg, device_kind=device_kind, read_only=True) \
            if pkg.exists() else None
        if chosen is None:
            return base if base is not None and len(base) else None
        if base is not None:
            chosen.fallback = base.entries
        return chosen

    def __len__(self) -> int:
        return len(self.entries.keys() | self.fallback.keys())

    def __contains__(self, key) -> bool:
        k = key_str(key)
        return k in self.entries or k in self.fallback

    def get(self, key) -> dict | None:
        """The entry dict of a key (own entries first, then the fallback), or None."""
        k = key_str(key)
        return self.entries.get(k) or self.fallback.get(k)

    def lookup(self, device_kind: str, key) -> tuple[float, float] | None:
        """(fwd_s, bwd_s) measured for ``key`` when ``device_kind`` is this profile's
        device kind, else None."""
        if device_kind != self.device_kind:
            return None
        e = self.get(key)
        return None if e is None else (float(e["fwd_s"]), float(e["bwd_s"]))

    def record(self, key, fwd_s: float, bwd_s: float, meta: dict | None = None) -> None:
        """Store one measurement (kept in memory until :meth:`save`)."""
        e = dict(meta or {})
        e.update(fwd_s=float(fwd_s), bwd_s=float(bwd_s))
        k = key_str(key)
        self.entries[k] = e
        self._dirty[k] = e

    def save(self) -> Path:
        """Merge this process's new entries into the file under a lock and replace it
        atomically; afterwards ``entries`` also holds what other processes saved."""
        if self.read_only or self.path is None:
            raise RuntimeError(f"profile {self.device_name!r} is read-only ({self.path})")
        with _locked(self.path):
            got = _read(self.path, quiet=True)  # a corrupt file was reported on load: replace it
            disk = got[1] if got is not None else {}
            disk.update(self._dirty)
            head = json.dumps({"format": FORMAT, "version": VERSION, "device_name": self.device_name,
                               "device_kind": self.device_kind, "torch": torch.__version__})
            body = ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(disk.items()))
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}-", suffix=".json", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:  # one entry per line: valid JSON, easy to grep
                    f.write(f'{head[:-1]}, "entries": {{\n{body}\n}}}}\n')
                with contextlib.suppress(OSError):  # readable by others, as a plain file would be
                    os.chmod(tmp, self.path.stat().st_mode & 0o777 if self.path.exists() else 0o644)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        self.entries = disk
        self._dirty = {}
        return self.path

    def efficiency(self, spec) -> dict[str, float]:
        """Per-rule efficiency fitted to these measurements for a device spec."""
        return fit_efficiency(self, spec)

    def __repr__(self) -> str:
        return f"ProfileDB({self.device_name!r}, kind={self.device_kind!r}, {len(self)} entries, {self.path})"


# ---- measuring ---------------------------------------------------------------------------
def _int_bound(op, i: int) -> int | None:
    """Exclusive upper bound of valid values for integer input ``i`` of ``op``."""
    if op.rule == "embedding" and i == 0:
        return op.param_shapes["weight"][0]
    if op.rule == "loss" and i == 1 and len(op.input_shapes[0]) > 1:
        return op.input_shapes[0][1]
    return None


def _make_inputs(op, part, dev, gen, graph=None) -> tuple[list, dict]:
    """Random tensors for a partition's input regions and parameter regions."""
    ins = []
    for i, (r, dt) in enumerate(zip(part.inputs, op.input_dtypes)):
        if r is None:
            ins.append(None)
            continue
        shape = region_shape(r)
        if dt.is_floating_point:
            t = torch.randn(shape, generator=gen, device=dev).to(dt).requires_grad_(True)
        elif dt == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen, device=dev).to(torch.bool)
        else:
            t = _int_input(op, i, r, shape, gen, graph, dev).to(dev, dt)
        ins.append(t)
    params = {}
    for k, r in part.params.items():
        shape = region_shape(r)
        if k in op.buffers:  # running stats: positive variances, integer counters
            if "num_batches" in k:
                params[k] = torch.zeros(shape, dtype=torch.long, device=dev)
            else:
                params[k] = (torch.rand(shape, generator=gen, device=dev) + 0.5).to(op.dtype)
        else:
            w = torch.randn(shape, generator=gen, device=dev) * 0.1
            params[k] = w.to(op.dtype).requires_grad_(True)
    return ins, params


def _int_input(op, i, region, shape, gen, graph, dev):
    bound = _int_bound(op, i)
    if bound:
        return torch.randint(0, bound, shape, generator=gen, device=dev)
    src = graph.op(op.inputs[i]) if graph is not None and op.inputs[i] in graph else None
    if src is not None and src.kind == "constant" and graph.module is not None:
        with contextlib.suppress(Exception):  # the real constant (e.g. positions), when it exists
            from .localrun import constant_value_of
            v = constant_value_of(src, graph.module)
            if v.device.type != "meta":
                return v[region].detach().cpu().clone()
    return torch.zeros(shape, dtype=torch.long, device=dev)  # index 0 is valid for any consumer


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class _Timer:
    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, t0) -> float:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            torch.cuda.synchronize()
            return t0.elapsed_time(ev) / 1e3
        return time.perf_counter() - t0


def profile_partition(op, part, device="cpu", repeats: int = 5, warmup: int = 1, graph=None,
                      max_seconds: float = 2.0, seed: int = 0) -> tuple[float, float, int]:
    """Measure one partition of ``op``: (median forward_s, median backward_s, runs).

    Forward is ``RULES[op.rule].compute``; backward is the gradient of the sum of its
    (grad-requiring) outputs w.r.t. the float inputs and parameters (0 when nothing
    needs one).  ``warmup`` runs (one more when the first is under 10 ms) are not
    counted; runs stop early after ``max_seconds`` once 3 were counted.  ``graph``
    lets integer inputs fed by constants use the real constant."""
    dev = _torch_device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    ins, params = _make_inputs(op, part, dev, gen, graph)
    try:
        return _measure(op, part, dev, ins, params, repeats, warmup, max_seconds, clone=False)
    except RuntimeError as e:  # an in-place op on a leaf: feed it fresh copies (made untimed)
        if "in-place" not in str(e):
            raise
        return _measure(op, part, dev, ins, params, repeats, warmup, max_seconds, clone=True)


def _measure(op, part, dev, ins, params, repeats, warmup, max_seconds, clone):
    rule, timer = RULES[op.rule], _Timer(dev)
    leaves = [t for t in list(ins) + list(params.values()) if t is not None and t.requires_grad]
    fwd_t, bwd_t, grads = [], [], None
    started, it, warm = None, 0, max(0, warmup)
    while len(fwd_t) < max(1, repeats):
        args = [t.clone() if clone and t is not None and t.is_floating_point() else t for t in ins]
        t0 = timer.start()
        out = rule.compute(op, part.block, args, params)
        tf = timer.stop(t0)
        outs = [o for o in _tensors(out) if o.requires_grad]
        tb = 0.0
        if outs and leaves:
            if grads is None:
                grads = [torch.ones_like(o) for o in outs]
            t0 = timer.start()
            torch.autograd.grad(outs, leaves, grads, allow_unused=True)
            tb = timer.stop(t0)
        del out, outs
        it += 1
        if it == 1 and warm and tf + tb < 0.01:
            warm += 1
        if it <= warm:
            continue
        started = started or time.perf_counter()
        fwd_t.append(tf)
        bwd_t.append(tb)
        if len(fwd_t) >= min(3, repeats) and time.perf_counter() - started > max_seconds:
            break
    return statistics.median(fwd_t), statistics.median(bwd_t), len(fwd_t)


@dataclass
class ProfileReport:
    """What :func:`profile_graph` did.  ``ops``: one dict per distinct key, in graph
    order: ``op`` (first op name), ``ops`` (every op name sharing the key), ``count``
    (partitions sharing it), ``kind``, ``rule``, ``dtype``, ``output_shape``,
    ``input_shapes``, ``param_shapes``, ``forward_ms``, ``backward_ms``, ``flops``,
    ``bytes``, ``cached`` (served from the cache), ``error`` (None, or why it could not
    be measured).  ``measured`` / ``cached``: counts measured now / served from cache."""
    device: str
    device_name: str
    device_kind: str
    path: str
    threads: int
    ops: list = field(default_factory=list)
    measured: int = 0
    cached: int = 0
    errors: int = 0
    seconds: float = 0.0

    def total_ms(self) -> tuple[float, float]:
        """(forward, backward) ms summed over every profiled partition instance."""
        ok = [e for e in self.ops if e["error"] is None]
        return (sum(e["forward_ms"] * e["count"] for e in ok), sum(e["backward_ms"] * e["count"] for e in ok))

    def to_dict(self) -> dict:
        fwd, bwd = self.total_ms()
        return {"device": self.device, "device_name": self.device_name, "device_kind": self.device_kind,
                "cache": self.path, "threads": self.threads, "entries": len(self.ops),
                "measured": self.measured, "cached": self.cached, "errors": self.errors,
                "seconds": round(self.seconds, 3), "total_forward_ms": fwd, "total_backward_ms": bwd,
                "ops": [{k: v for k, v in e.items() if k != "key"} for e in self.ops]}

    def table(self) -> str:
        """Plain-text table: one line per distinct key."""
        lines = [f"{'op':<28} {'kind':<18} {'n':>3} {'output':<22} {'fwd ms':>9} {'bwd ms':>9} "
                 f"{'GFLOP':>8}  src"]
        for e in self.ops:
            src = "error" if e["error"] else ("cache" if e["cached"] else "measured")
            f = "-" if e["error"] else f"{e['forward_ms']:.4f}"
            b = "-" if e["error"] else f"{e['backward_ms']:.4f}"
            lines.append(f"{e['op'][:28]:<28} {e['kind'][:18]:<18} {len(e['ops']):>3} "
                         f"{str(tuple(e['output_shape']))[:22]:<22} {f:>9} {b:>9} {e['flops'] / 1e9:>8.3f}  {src}")
        fwd, bwd = self.total_ms()
        lines.append(f"{len(self.ops)} distinct ops on {self.device_name} ({self.device_kind}): "
                     f"{self.measured} measured, {self.cached} from cache, {self.errors} failed; "
                     f"forward {fwd:.3f} ms + backward {bwd:.3f} ms per iteration; cache {self.path}")
        return "\n".join(lines)


def _configs_for(op, strategy, configs) -> list:
    out = []
    if strategy is not None and op.name in strategy:
        out.append(strategy[op.name])
    extra = (configs or {}).get(op.name)
    if isinstance(extra, ParallelConfig):
        extra = [extra]
    out.extend(c for c in (extra or ()) if c not in out)
    return out or [ParallelConfig({}, (0,))]


def profile_graph(graph, device="cpu", strategy=None, configs=None, repeats: int = 5,
                  progress: bool = False, *, db: ProfileDB | None = None, profile_dir=None,
                  warmup: int = 1, max_seconds: float = 2.0, save: bool = True,
                  ops=None) -> ProfileReport:
    """Profile every distinct partition key of ``graph``'s compute ops on ``device``
    ("cpu", "cuda", "cuda:1"), each once; keys already in the cache are not re-run.

    Partitions: each op whole when ``strategy`` and ``configs`` are None; else the
    partitions of ``strategy[op]`` and of ``configs[op]`` (a ParallelConfig or a list,
    e.g. ``candidate_configs(op, machine)``), ops covered by neither whole.
    ``db``: the ProfileDB to use (default: this device's file in ``profile_dir`` or the
    cache).  New measurements are saved (merged under a lock) unless ``save=False``.
    ``ops``: only these op names (default: every compute op).
    ``progress``: a tqdm bar on stderr when it is a terminal.  An op that fails to run
    is reported with its ``error`` and not cached; the others go on."""
    t_start = time.perf_counter()
    dev = _torch_device(device)
    name = device_name(dev)
    if db is None:
        db = ProfileDB.load(name, profile_dir=profile_dir, device_kind=device_kind_of(dev))
    groups: dict[str, dict] = {}
    only = None if ops is None else set(ops)
    for op in graph.compute_ops:
        if only is not None and op.name not in only:
            continue
        for config in _configs_for(op, strategy, configs):
            for part in partitions(op, config):
                k = key_str(_KEYER.key(op, part))
                g = groups.get(k)
                if g is None:
                    groups[k] = g = {"key": k, "op": op.name, "ops": [], "count": 0, "_op": op, "_part": part}
                if op.name not in g["ops"]:
                    g["ops"].append(op.name)
                g["count"] += 1
    report = ProfileReport(str(dev), name, db.device_kind, str(db.path), torch.get_num_threads())
    bar = None
    if progress and sys.stderr.isatty():
        with contextlib.suppress(ImportError):
            from tqdm import tqdm
            bar = tqdm(total=len(groups), desc=f"profiling on {name}", unit="op", file=sys.stderr)
    last_save = time.perf_counter()
    try:
        for k, g in groups.items():
            op, part = g.pop("_op"), g.pop("_part")
            e = _describe(op, part, g)
            hit = db.get(k)
            if hit is not None:
                e.update(forward_ms=hit["fwd_s"] * 1e3, backward_ms=hit["bwd_s"] * 1e3, cached=True)
                report.cached += 1
            else:
                try:
                    fwd, bwd, runs = profile_partition(op, part, dev, repeats, warmup, graph, max_seconds)
                except Exception as exc:  # an op that cannot run on random data: report it
                    e["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    warnings.warn(f"profiling {op.describe()} failed: {e['error']}")
                    report.errors += 1
                else:
                    e.update(forward_ms=fwd * 1e3, backward_ms=bwd * 1e3)
                    db.record(k, fwd, bwd, _meta(op, e, runs, name))
                    report.measured += 1
                    if save and time.perf_counter() - last_save > 60:
                        db.save()  # keep progress of long runs
                        last_save = time.perf_counter()
            report.ops.append(e)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if save and db._dirty:
            db.save()
    report.seconds = time.perf_counter() - t_start
    return report


def _describe(op, part, g) -> dict:
    return {**g, "kind": op.kind, "rule": op.rule, "dtype": str(op.dtype).removeprefix("torch."),
            "output_shape": list(region_shape(part.output)),
            "input_shapes": [None if r is None else list(region_shape(r)) for r in part.inputs],
            "param_shapes": {k: list(region_shape(r)) for k, r in part.params.items()},
            "flops": partition_flops(op, part), "bytes": partition_bytes(op, part),
            "backward_factor": RULES[op.rule].backward_factor(op),
            "forward_ms": None, "backward_ms": None, "cached": False, "error": None}


def _meta(op, e, runs, name) -> dict:
    m = {k: e[k] for k in ("kind", "rule", "dtype", "output_shape", "input_shapes", "param_shapes",
                           "flops", "bytes", "backward_factor")}
    m.update(op=op.name, runs=runs, threads=torch.get_num_threads(), torch=torch.__version__,
             device_name=name, time=round(time.time()))
    return m


# ---- communication calibration -----------------------------------------------------------
def calibrate_comm(nprocs: int = 2, path=None, **kwargs) -> dict:
    """Calibrate the ``cpu`` machine (``flexflow profile --comm``): measure gloo between
    ``nprocs`` local processes and per-process FLOP/s and copy bandwidth
    (:func:`flexflow.comm.calibrate_gloo`, extra keyword arguments go to it), write the
    machine file the ``cpu`` preset reads (:func:`flexflow.comm.write_cpu_machine_file`,
    default location ``cache_dir()/machine-cpu.json``).  Returns the figures plus
    ``"path"`` (str) of the file written."""
    from .comm import calibrate_gloo, write_cpu_machine_file
    figures = calibrate_gloo(nprocs=nprocs, **kwargs)
    out = write_cpu_machine_file(figures, path)
    return {**figures, "path": str(out)}
