"""The operator-profile database: measured (forward_s, backward_s) per cost-model key and
device, on disk (one JSON file per device name, merged under a lock), plus the read-only
profiles shipped in the package.  Read by :class:`flexflow.cost.model.CostModel`; written by the
profiler (:mod:`flexflow.cost.profile`).  torch is imported only to name this host's devices."""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import socket
import tempfile
import warnings
from pathlib import Path

from ..hardware.machine import cache_dir
from ..hardware.specs import GPU_SPECS

__all__ = ["ProfileDB", "device_kind_of", "device_name", "profiles_dir", "package_profile_path", "key_str",
           "FORMAT", "VERSION"]

FORMAT, VERSION = "flexflow-profile", 4
# a file of another version is measured again (4: losses over a middle class dim timed as the
# executor now runs them, class dim last)
# profiles shipped with the package (flexflow/data/profile-<kind>.json), for device kinds that
# are not on the planning host; a file put there must be listed as package data in pyproject.toml
_PKG_DATA = Path(__file__).resolve().parent.parent / "data"


# ---- devices -----------------------------------------------------------------------------
def _torch_device(device):
    import torch
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
    return next((k for k in GPU_SPECS if re.search(rf"\b{k}\b", name.upper())), name)


def device_name(device="cpu") -> str:
    """Name of the profile file of a device: ``cpu-<cpu model>-<threads>t`` (CPU times
    depend on torch's thread count) or ``cuda-<GPU name>`` (e.g. ``cuda-NVIDIA_H200``)."""
    import torch
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
    import torch
    dev = _torch_device(device)
    return "cpu" if dev.type == "cpu" else _gpu_kind(torch.cuda.get_device_name(dev))


def _kind_from_name(name: str) -> str:
    if name.startswith("cpu"):
        return "cpu"
    return _gpu_kind(name.removeprefix("cuda-").replace("_", " "))


def profiles_dir(profile_dir=None) -> Path:
    """``profile_dir``, else ``flexflow.hardware.machine.cache_dir()/profiles``."""
    if profile_dir is not None:
        return Path(profile_dir)
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
            if isinstance(d.get("version"), int) and d["version"] < VERSION:
                if not quiet:
                    warnings.warn(f"profile cache {path} was written by an older flexflow (format version "
                                  f"{d['version']}, now {VERSION}); its ops will be measured again")
                return {}, {}
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
        import torch
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

    def __repr__(self) -> str:
        return f"ProfileDB({self.device_name!r}, kind={self.device_kind!r}, {len(self)} entries, {self.path})"
