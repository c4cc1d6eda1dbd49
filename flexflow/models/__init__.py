"""The model zoo: the paper's six benchmark networks plus LeNet and a
GPT-2-small-style transformer, each returning its own training loss.

    module, inputs = flexflow.models.get("resnet101", batch_size=256)
    loss = module(*inputs)          # 0-d tensor

`size="paper"` gives the sizes of the paper (REFERENCE.md); `size="small"`
the same graph (same op kinds, same number of layers) with few channels,
small vocabularies and images, and 4 instead of 40 recurrent steps, so one
training step takes well under a second on one CPU core.
`device="meta"` builds module and inputs without memory, for planning
paper-size models with large batches.
"""
from __future__ import annotations

import operator

import torch

from ._common import make_inputs
from .cnn import AlexNet, LeNet, alexnet_config, lenet_config
from .inception import InceptionV3, inception_v3_config
from .resnet import ResNet, resnet101_config
from .rnn import NMT, RNNLM, RNNTC, nmt_config, rnnlm_config, rnntc_config
from .transformer import Transformer, transformer_config

__all__ = ["names", "get", "config", "paper_batch", "SIZES"]

SIZES = ("paper", "small")

# name -> (config factory taking a size, module class)
_REGISTRY = {
    "lenet": (lenet_config, LeNet),
    "alexnet": (alexnet_config, AlexNet),
    "inception_v3": (inception_v3_config, InceptionV3),
    "resnet101": (resnet101_config, ResNet),
    "rnntc": (rnntc_config, RNNTC),
    "rnnlm": (rnnlm_config, RNNLM),
    "nmt": (nmt_config, NMT),
    "transformer": (transformer_config, Transformer),
}

# The paper's per-device batch (AlexNet 256, every other network 64).
_PAPER_BATCH = {name: 64 for name in _REGISTRY}
_PAPER_BATCH["alexnet"] = 256
_SMALL_BATCH = 8


def names() -> list[str]:
    """The zoo's model names, in a fixed order."""
    return list(_REGISTRY)


def _check(name: str, size: str) -> None:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(_REGISTRY)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for model {name!r}; valid sizes: {', '.join(SIZES)}")


def paper_batch(name: str, size: str = "paper") -> int:
    """Default (per-device) batch: the paper's for size="paper", 8 for "small"."""
    _check(name, size)
    return _PAPER_BATCH[name] if size == "paper" else _SMALL_BATCH


def config(name: str, size: str = "paper"):
    """The frozen config dataclass of a zoo model at a size."""
    _check(name, size)
    return _REGISTRY[name][0](size)


def get(name, batch_size=None, size="paper", *, seed=0, device=None, dtype=torch.float32):
    """Build zoo model `name` and synthetic example inputs.

    Returns `(module, example_inputs)`: `module(*example_inputs)` is the scalar
    training loss (inputs include labels/targets). `batch_size` is the global
    batch (default: `paper_batch(name, size)`). `seed` fixes weights and inputs
    without touching the global RNG. `device="meta"` allocates nothing."""
    _check(name, size)
    if batch_size is None:
        batch_size = paper_batch(name, size)
    batch = None
    if not isinstance(batch_size, bool):
        try:
            batch = operator.index(batch_size)  # ints and numpy ints, not floats
        except TypeError:
            pass
    if batch is None or batch < 1:
        raise ValueError(f"batch_size for model {name!r} must be a positive int, got {batch_size!r}")
    batch_size = batch
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype for model {name!r} must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    cfg_fn, cls = _REGISTRY[name]
    cfg = cfg_fn(size)
    if device.type == "meta":
        with torch.device("meta"):
            module = cls(cfg)
    else:
        # Build on the CPU under a private seed: same weights on every device.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = cls(cfg)
    module = module.to(device=device, dtype=dtype)
    module.train()
    inputs = make_inputs(module.input_specs(batch_size), seed=seed, device=device, dtype=dtype)
    return module, inputs
