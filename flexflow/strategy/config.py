"""The SOAP strategy space: configs, strategies, and the one partition
function everything else asks "which device holds which slice".

A :class:`ParallelConfig` gives a degree per parallel dim and the device of
each partition.  :func:`partitions` turns an (op, config) pair into the
output region, input regions and parameter regions of every partition;
:func:`param_placement` derives from the same regions which devices hold
which parameter block and so which devices all-reduce which gradients.
The simulator, the memory estimate and the executor all use these two.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ['REPLICA', 'StrategyError', 'format_devices', 'ParallelConfig']


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


class ParallelConfig:
    """Frozen: a degree per parallel dim (1 when absent) and one device per partition."""

    __slots__ = ("_degrees", "_devices", "_hash")

    def __init__(self, degrees: Mapping[str, int], devices):
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
        object.__setattr__(self, "_degrees", tuple(sorted(items)))
        object.__setattr__(self, "_devices", devs)
        object.__setattr__(self, "_hash", hash((self._degrees, devs)))

    def __setattr__(self, k, v):
        raise AttributeError("ParallelConfig is frozen")

    def __reduce__(self):  # pickle (multiprocessing) through the checked constructor
        return ParallelConfig, (dict(self._degrees), self._devices)

    @property
    def degrees(self) -> dict[str, int]:
        return dict(self._degrees)

    @property
    def devices(self) -> tuple[int, ...]:
        return self._devices

    @property
    def num_partitions(self) -> int:
        return len(self._devices)

    def degree(self, dim: str) -> int:
        return dict(self._degrees).get(dim, 1)

    def __eq__(self, other):
        return (isinstance(other, ParallelConfig) and self._degrees == other._degrees
                and self._devices == other._devices)

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"ParallelConfig({dict(self._degrees)}, {self._devices})"

    def __str__(self):
        items = sorted(self._degrees, key=lambda kv: (kv[0] != "n", kv[0]))
        degs = " ".join(f"{_LETTER.get(k, k.upper())}{v}" for k, v in items) or "whole"
        return f"{degs} @{format_devices(self._devices)}"

    def to_dict(self) -> dict:
        return {"degrees": dict(self._degrees), "devices": list(self._devices)}

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelConfig":
        if not isinstance(d, dict) or "devices" not in d:
            raise StrategyError(f"a config needs 'degrees' and 'devices', got {d!r}")
        return cls(d.get("degrees", {}), d["devices"])
