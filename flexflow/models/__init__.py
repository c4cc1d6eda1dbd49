"""The model zoo: the paper's six benchmark networks plus LeNet, a GPT-2-small-style
transformer and today's decoders (GPT-2 and LLaMA 3 at their published sizes), each
returning its own training loss.

    module, inputs = flexflow.models.get("resnet101", batch_size=256)
    loss = module(*inputs)          # 0-d tensor

`size="paper"` gives the sizes of the paper (REFERENCE.md); `size="small"`
the same graph (same op kinds, same number of layers) with few channels,
small vocabularies and images, and 4 instead of 40 recurrent steps, so one
training step takes well under a second on one CPU core.
`device="meta"` builds module and inputs without memory, for planning
paper-size models with large batches.  ``gpt2`` and ``llama`` take their own sizes
(``sizes(name)``: gpt2 ``124m`` ... ``1.5b``, llama ``1b``, ``8b``, ``70b``; "paper" is
gpt2 124m and llama 8b) and ``seq_len=``.
"""
from __future__ import annotations

import operator

import torch

from ._common import make_inputs
from .cnn import AlexNet, LeNet, alexnet_config, lenet_config
from .gpt2 import GPT2, GPT2_SIZES, gpt2_config
from .inception import InceptionV3, inception_v3_config
from .llama import LLAMA_SIZES, Llama, llama_config
from .resnet import ResNet, resnet101_config
from .rnn import NMT, RNNLM, RNNTC, nmt_config, rnnlm_config, rnntc_config
from .transformer import Transformer, transformer_config

__all__ = ["SIZES", "config", "get", "names", "paper_batch", "sizes"]

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
    "gpt2": (gpt2_config, GPT2),
    "llama": (llama_config, Llama),
}
# models with sizes of their own and a sequence length (config factories take seq_len)
_LLM_SIZES = {"gpt2": GPT2_SIZES, "llama": LLAMA_SIZES}

# The paper's per-device batch (AlexNet 256, every other network 64); for the decoders a
# per-device batch of sequences that today's runs use (llm.c trains GPT-2 at 16-64 per
# GPU, torchtitan LLaMA at 1-2).
_PAPER_BATCH = {name: 64 for name in _REGISTRY}
_PAPER_BATCH.update(alexnet=256, gpt2=16, llama=2)
_SMALL_BATCH = 8


def names() -> list[str]:
    """The zoo's model names, in a fixed order."""
    return list(_REGISTRY)


def sizes(name: str) -> tuple:
    """The sizes model ``name`` takes ("paper" and "small" for every model)."""
    _check(name, "paper")
    return _LLM_SIZES.get(name, SIZES)


def _check(name: str, size: str, seq_len=None) -> None:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(_REGISTRY)}")
    valid = _LLM_SIZES.get(name, SIZES)
    if size not in valid:
        raise ValueError(f"unknown size {size!r} for model {name!r}; valid sizes: {', '.join(valid)}")
    if seq_len is not None:
        if name not in _LLM_SIZES:
            raise ValueError(f"seq_len applies to {' and '.join(_LLM_SIZES)} only, not to model {name!r}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len for model {name!r} must be a positive int, got {seq_len!r}")


def paper_batch(name: str, size: str = "paper") -> int:
    """Default (per-device) batch: the paper's for size="paper" (for gpt2 and llama the
    per-device batch at every size but "small"), 8 for "small"."""
    _check(name, size)
    return _SMALL_BATCH if size == "small" else _PAPER_BATCH[name]


def config(name: str, size: str = "paper", seq_len: int | None = None):
    """The frozen config dataclass of a zoo model at a size (and sequence length)."""
    _check(name, size, seq_len)
    fn = _REGISTRY[name][0]
    return fn(size) if seq_len is None else fn(size, seq_len)


def get(name, batch_size=None, size="paper", *, seq_len=None, seed=0, device=None, dtype=torch.float32):
    """Build zoo model `name` and synthetic example inputs.

    Returns `(module, example_inputs)`: `module(*example_inputs)` is the scalar
    training loss (inputs include labels/targets). `batch_size` is the global
    batch (default: `paper_batch(name, size)`). `seq_len` (gpt2, llama) the tokens
    per sequence. `seed` fixes weights and inputs without touching the global RNG.
    `device="meta"` allocates nothing."""
    _check(name, size, seq_len)
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
    cls = _REGISTRY[name][1]
    cfg = config(name, size, seq_len)
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
