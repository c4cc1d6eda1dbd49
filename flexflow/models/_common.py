"""Helpers shared by the zoo: channel scaling and synthetic example inputs."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def scaled(channels: int, div: int, minimum: int = 4) -> int:
    """`channels` divided by `div`, never below `minimum` (small-size widths)."""
    if div <= 1:
        return channels
    return max(minimum, channels // div)


@dataclass(frozen=True)
class InputSpec:
    """One synthetic example input, realised by `make_inputs`."""

    shape: tuple  # full shape, batch dim first
    kind: str  # "float": standard normal in the model dtype; "index": int64 in [0, high)
    high: int = 0  # exclusive upper bound for "index" inputs


def images(batch: int, channels: int, size: int) -> InputSpec:
    return InputSpec((batch, channels, size, size), "float")


def indices(shape: tuple, high: int) -> InputSpec:
    return InputSpec(tuple(shape), "index", high)


def make_inputs(specs, *, seed: int, device, dtype) -> tuple:
    """Realise `specs` as tensors: deterministic in `seed` (a local generator,
    the global RNG is untouched); on the meta device only shapes and dtypes."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "meta":
        return tuple(
            torch.zeros(s.shape, dtype=dtype if s.kind == "float" else torch.int64, device="meta")
            for s in specs
        )
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in specs:
        if s.kind == "float":
            t = torch.randn(s.shape, generator=gen, dtype=torch.float32).to(dtype)
        else:
            t = torch.randint(0, s.high, s.shape, generator=gen, dtype=torch.int64)
        out.append(t.to(device))
    return tuple(out)
