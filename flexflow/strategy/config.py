"""ParallelConfig: how one op is split and placed, and how its parameter replicas
keep their state.

A config gives a degree per parallel dim, the device of each partition, a shard level
(the ZeRO stages: how the partitions that hold the same parameter region keep the
parameter, its gradient and its optimizer state) and whether the op's output is
recomputed in the backward instead of kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["REPLICA", "SHARD_LEVELS", "StrategyError", "format_devices", "ParallelConfig"]


_LETTER = {"n": "S", "s": "T", "r": "R"}  # sample prints as S (the paper), sequence as T, replicas R


# Replicated placement: ``{"r": k}`` computes the op whole on k devices.  Each
# partition holds the full output (every partition's regions are those of the
# whole op), parameters are held by all k and their gradients all-reduced among
# them; a consumer reads from one replica (:func:`pick_replica`).
REPLICA = "r"


class StrategyError(ValueError):
    """A config or strategy that does not fit its op, graph or machine."""


def format_devices(devices) -> str:
    devices = tuple(devices)
    if len(devices) > 1 and devices == tuple(range(devices[0], devices[0] + len(devices))):
        return f"[{devices[0]}..{devices[-1]}]"
    return "[" + ",".join(map(str, devices)) + "]"


# shard levels (the ZeRO stages), as printed: what the replicas of a parameter region split
# among themselves.  0: nothing (each holds parameters, gradients and optimizer state whole,
# gradients all-reduced); 1: the optimizer state (gradients reduce-scattered, each replica
# updates its slice, parameters all-gathered for the next step); 2: the gradients too;
# 3: the parameters too (all-gathered before the op's forward and again before its
# backward, freed after use: FSDP).
SHARD_LEVELS = (0, 1, 2, 3)


class ParallelConfig:
    """Frozen: a degree per parallel dim (1 when absent), one device per partition, a shard
    level (0-3, :data:`SHARD_LEVELS`) and whether the output is recomputed in the backward."""

    __slots__ = ("_degrees", "_devices", "_shard", "_recompute", "_hash")

    def __init__(self, degrees: Mapping[str, int], devices, shard: int = 0, recompute: bool = False):
        items = []
        for k, v in dict(degrees).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise StrategyError(f"degree of dim {k!r} must be a positive int, got {v!r}")
            if v > 1:
                items.append((str(k), v))
        devs = tuple(int(d) for d in devices)
        n = math.prod(v for _, v in items)
        if len(devs) != n:
            raise StrategyError(f"config {dict(items)} has {n} partitions but {len(devs)} devices {devs}")
        if len(set(devs)) != len(devs) or any(d < 0 for d in devs):
            raise StrategyError(f"devices {devs} must be distinct non-negative ids")
        if not isinstance(shard, int) or isinstance(shard, bool) or shard not in SHARD_LEVELS:
            raise StrategyError(f"shard must be one of {SHARD_LEVELS} (the ZeRO stages), got {shard!r}")
        if not isinstance(recompute, bool):
            raise StrategyError(f"recompute must be True or False, got {recompute!r}")
        object.__setattr__(self, "_degrees", tuple(sorted(items)))
        object.__setattr__(self, "_devices", devs)
        object.__setattr__(self, "_shard", shard)
        object.__setattr__(self, "_recompute", recompute)
        extra = (shard, recompute) if shard or recompute else ()  # the plain config hashes as it always has
        object.__setattr__(self, "_hash", hash((self._degrees, devs) + extra))

    def __setattr__(self, k, v):
        raise AttributeError("ParallelConfig is frozen")

    def __reduce__(self):  # pickle (multiprocessing) through the checked constructor
        return ParallelConfig, (dict(self._degrees), self._devices, self._shard, self._recompute)

    @property
    def degrees(self) -> dict[str, int]:
        """Dim name -> degree (dims of degree 1 left out)."""
        return dict(self._degrees)

    @property
    def devices(self) -> tuple[int, ...]:
        """The device of each partition, partition k on ``devices[k]``."""
        return self._devices

    @property
    def shard(self) -> int:
        """The shard level (0-3, the ZeRO stages) of the op's parameter replicas."""
        return self._shard

    @property
    def recompute(self) -> bool:
        """Whether the op's output is recomputed in the backward instead of kept."""
        return self._recompute

    def with_shard(self, shard: int) -> "ParallelConfig":
        """The same config at shard level ``shard``."""
        return ParallelConfig(dict(self._degrees), self._devices, shard, self._recompute)

    def with_recompute(self, recompute: bool = True) -> "ParallelConfig":
        """The same config with recomputation on (or off)."""
        return ParallelConfig(dict(self._degrees), self._devices, self._shard, recompute)

    @property
    def num_partitions(self) -> int:
        """The number of partitions (the product of the degrees)."""
        return len(self._devices)

    def degree(self, dim: str) -> int:
        """The degree of dim ``dim`` (1 when it is not split)."""
        return dict(self._degrees).get(dim, 1)

    def __eq__(self, other):
        return (isinstance(other, ParallelConfig) and self._degrees == other._degrees
                and self._devices == other._devices and self._shard == other._shard
                and self._recompute == other._recompute)

    def __hash__(self):
        return self._hash

    def __repr__(self):
        extra = (f", shard={self._shard}" if self._shard else "") + (", recompute=True" if self._recompute else "")
        return f"ParallelConfig({dict(self._degrees)}, {self._devices}{extra})"

    def __str__(self):
        items = sorted(self._degrees, key=lambda kv: (kv[0] != "n", kv[0]))
        degs = " ".join(f"{_LETTER.get(k, k.upper())}{v}" for k, v in items) or "whole"
        degs += (f" Z{self._shard}" if self._shard else "") + (" RC" if self._recompute else "")
        return f"{degs} @{format_devices(self._devices)}"

    def to_dict(self) -> dict:
        """The config as a plain dict (as the strategy JSON holds it)."""
        d = {"degrees": dict(self._degrees), "devices": list(self._devices)}
        if self._shard:
            d["shard"] = self._shard
        if self._recompute:
            d["recompute"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelConfig":
        """A config from ``to_dict``'s dict."""
        if not isinstance(d, dict) or "devices" not in d:
            raise StrategyError(f"a config needs 'degrees' and 'devices', got {d!r}")
        return cls(d.get("degrees", {}), d["devices"], d.get("shard", 0), d.get("recompute", False))
