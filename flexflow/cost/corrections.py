"""Corrections learnt from measured steps: what the finalists of a search measured on a
host, turned into factors on the simulator's inputs, so that the next search of that model
on that host errs less.

Three factors, each multiplying times the simulator is given:

- ``compute``: every op partition's time (``CostModel.op_time``);
- ``message``: a point-to-point message (the activation and gradient exchanges between
  devices): the links' latency times the factor, their bandwidth over it;
- ``sync``: a collective (the gradient all-reduce, the outputs' all-reduce).

They are relative to the host's own cost model (:meth:`CostModel.for_machine`, the
profiled op times) and to the machine's figures (the calibrated links), and are kept per
machine (its fingerprint: a new calibration starts afresh) and per graph (its fingerprint:
what a model's steps teach says little about another's, whose messages and collectives
are of other sizes), in the profile cache: ``profiles/corrections/<machine>.json``, and
per op-profile format (a file learnt against profiles of another format, which are
measured again, starts afresh: the executor or the timing changed under them).
:func:`load_corrections` reads them; :meth:`Corrections.machine` and
:meth:`Corrections.cost_model` apply them; the fit that makes them from measured
finalists is :func:`flexflow.finalists.fit.fit_corrections`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .model import CostModel
from .profiledb import VERSION as PROFILE_VERSION
from .profiledb import _locked, profiles_dir  # (one lock file per database file)

__all__ = [
    "FACTOR_RANGE",
    "CorrectedCostModel",
    "Corrections",
    "corrections_path",
    "load_corrections",
    "save_corrections",
]

FORMAT, VERSION = "flexflow-corrections", 2
# version 1 was learnt by finalists that read the loss before the backward, which made every
# plan whose loss rides a gradient bucket measure slow (data parallelism up to 2x): not reused
_STALE = {1: "learnt from finalist timings that read the loss before the backward (data-parallel "
             "plans measured up to 2x slow); starting afresh"}
FACTOR_RANGE = (0.2, 5.0)  # every factor is kept in this range
_HISTORY = 10  # fits kept per graph, newest last


def _factor(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise ValueError(f"correction {what} must be a positive number, got {x!r}")
    lo, hi = FACTOR_RANGE
    return min(hi, max(lo, float(x)))


@dataclass
class Corrections:
    """Factors on the simulator's inputs for one graph on one machine (see the module's
    docstring).  ``samples``: finalist measurements fitted so far; ``history``: the latest
    fits (what was predicted, measured and refitted, and the further factors), newest last."""

    compute: float = 1.0  # factor on every op partition's time
    message: float = 1.0  # factor on a point-to-point message's time
    sync: float = 1.0  # factor on a collective's time
    samples: int = 0
    history: list = field(default_factory=list)

    def __post_init__(self):
        self.compute = _factor(self.compute, "compute")
        self.message = _factor(self.message, "message")
        self.sync = _factor(self.sync, "sync")

    @property
    def identity(self) -> bool:
        """Whether applying them changes nothing."""
        return self.compute == self.message == self.sync == 1.0

    def factors(self) -> dict:
        """The factors alone: {"compute": c, "message": m, "sync": s}."""
        return {"compute": self.compute, "message": self.message, "sync": self.sync}

    def scaled(self, compute: float = 1.0, message: float = 1.0, sync: float = 1.0) -> Corrections:
        """These corrections times further factors (each kept in ``FACTOR_RANGE``)."""
        return Corrections(self.compute * compute, self.message * message, self.sync * sync, self.samples,
                           list(self.history))

    # ---- applying them ---------------------------------------------------------------------
    def machine(self, machine):
        """``machine`` with its messages and collectives priced by the factors: each link's
        latency times the factor and its bandwidth over it, point-to-point (``message``) and
        all-reduce (``sync``) apart; the spec's ``message_lag_s`` and ``output_sync_s`` with
        them; on a machine whose collectives follow NCCL's model, their bus bandwidths over
        ``sync`` (NCCL's latencies stay).  The same machine when both are 1."""
        if self.message == 1.0 and self.sync == 1.0:
            return machine
        m, s = self.message, self.sync

        def link(ls):
            if ls is None:
                return None
            ar_bw = ls.bandwidth_Bps if ls.allreduce_bandwidth_Bps is None else ls.allreduce_bandwidth_Bps
            ar_lat = ls.latency_s if ls.allreduce_latency_s is None else ls.allreduce_latency_s
            return dataclasses.replace(ls, latency_s=ls.latency_s * m, bandwidth_Bps=ls.bandwidth_Bps / m,
                                       allreduce_latency_s=ar_lat * s, allreduce_bandwidth_Bps=ar_bw / s)
        spec = machine.spec
        spec = dataclasses.replace(spec, message_lag_s=spec.message_lag_s * m,
                                   output_sync_s=None if spec.output_sync_s is None else spec.output_sync_s * s)
        extra = {}
        coll = getattr(machine, "collectives", None)
        if coll is not None:  # collectives as NCCL runs them: their bus bandwidths over the factor
            extra["collectives"] = dataclasses.replace(coll, **{
                f.name: getattr(coll, f.name) / s for f in dataclasses.fields(coll) if f.name.endswith("_Bps")})
        return dataclasses.replace(machine, spec=spec, intra_node=link(machine.intra_node),
                                   inter_node=link(machine.inter_node), **extra)

    def cost_model(self, cost_model: CostModel) -> CostModel:
        """``cost_model`` with every op partition's time times ``compute`` (the same object
        when that is 1)."""
        return cost_model if self.compute == 1.0 else CorrectedCostModel(cost_model, self.compute)

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {**self.factors(), "samples": self.samples, "history": self.history[-_HISTORY:]}

    @classmethod
    def from_dict(cls, d) -> Corrections:
        if not isinstance(d, dict):
            raise TypeError(f"corrections must be an object, got {type(d).__name__}")
        samples, history = d.get("samples", 0), d.get("history", [])
        return cls(d.get("compute", 1.0), d.get("message", 1.0), d.get("sync", 1.0),
                   samples if isinstance(samples, int) and samples >= 0 else 0,
                   list(history) if isinstance(history, list) else [])


class CorrectedCostModel(CostModel):
    """A cost model whose partition times are another's times a factor."""

    def __init__(self, base: CostModel, compute: float):
        # the base's figures (profile, fits, memos of uncorrected times); not the caches
        # simulators keep on a cost model, which hold this one's corrected times
        self.__dict__.update({k: v for k, v in base.__dict__.items() if k != "_simulator_contexts"})
        self._memo = dict(base._memo)
        self.base, self.compute = base, float(compute)

    def op_time(self, op, part, device: int) -> tuple[float, float]:
        f, b = super().op_time(op, part, device)
        return (f * self.compute, b * self.compute)


# ---- the store -------------------------------------------------------------------------------
def corrections_path(machine, profile_dir=None) -> Path:
    """Where the corrections of ``machine`` live: ``profiles/corrections/<fingerprint>.json``
    under the profile cache (``profile_dir``, else :func:`profiles_dir`)."""
    return profiles_dir(profile_dir) / "corrections" / f"{machine.fingerprint()}.json"


def _read(path: Path) -> dict:
    """graph fingerprint -> corrections dict of a file ({} when there is none; a warning when
    it is unreadable)."""
    try:
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a flexflow corrections file (missing \"format\": \"{FORMAT}\")")
        if d.get("version") in _STALE:
            raise ValueError(f"format version {d['version']}: {_STALE[d['version']]}")
        if d.get("version") != VERSION:
            raise ValueError(f"format version {d.get('version')!r}, this flexflow reads {VERSION}")
        if d.get("profile_version", PROFILE_VERSION - 1) != PROFILE_VERSION:
            raise ValueError(f"learnt against op profiles of format {d.get('profile_version', '3 or older')}, "
                             f"which this flexflow measures again (format {PROFILE_VERSION}); starting afresh")
        if not isinstance(d.get("graphs"), dict):
            raise TypeError("no \"graphs\" object")
        return d["graphs"]
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        warnings.warn(f"ignoring the corrections in {path}: {e}", stacklevel=3)
        return {}


def load_corrections(machine, graph_fingerprint: str, profile_dir=None) -> Corrections:
    """The stored corrections of a graph (its fingerprint) on ``machine``; none (every factor
    1) when there are none, and with a warning when the file is unreadable."""
    path = corrections_path(machine, profile_dir)
    got = _read(path).get(graph_fingerprint)
    if got is None:
        return Corrections()
    try:
        return Corrections.from_dict(got)
    except (TypeError, ValueError) as e:
        warnings.warn(f"ignoring the corrections of graph {graph_fingerprint} in {path}: {e}", stacklevel=2)
        return Corrections()


def save_corrections(machine, graph_fingerprint: str, corrections: Corrections, profile_dir=None) -> Path:
    """Store the corrections of a graph on ``machine``, beside the other graphs' (under a
    lock; the file replaced atomically: a reader sees the old one or the new one)."""
    path = corrections_path(machine, profile_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        graphs = _read(path) if path.exists() else {}
        graphs[graph_fingerprint] = corrections.to_dict()
        text = json.dumps({"format": FORMAT, "version": VERSION, "profile_version": PROFILE_VERSION,
                           "machine": machine.name,
                           "device_kind": machine.spec.kind, "num_devices": machine.num_devices,
                           "graphs": graphs}, indent=1)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return path
